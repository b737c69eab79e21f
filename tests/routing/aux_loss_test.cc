// Router losses and the router backward against central finite differences of independent
// double-precision forwards. The top-k choices (the aux-loss map, the router's selection and
// what dropping kept) are piecewise constant, so they are held at the unperturbed point.
// Tolerance: |analytic - numeric| <= 1e-5 * max|numeric| + 1e-9 (step h = 1e-5; the analytic
// gradient is computed in double and rounded to float once, ~6e-8 relative).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>

#include "moed/router.h"
#include "routing/routing_test_util.h"

namespace moed {
namespace {

using routing_test::router_config;

using Objective = std::function<double(const std::vector<double>&)>;

void expect_gradient(const std::vector<float>& logits, const std::vector<float>& analytic,
                     const Objective& objective) {
  ASSERT_EQ(analytic.size(), logits.size());
  std::vector<double> x(logits.begin(), logits.end()), numeric(x.size());
  const double h = 1e-5;
  double scale = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double up = objective(x);
    x[i] = x0 - h;
    const double down = objective(x);
    x[i] = x0;
    numeric[i] = (up - down) / (2 * h);
    scale = std::max(scale, std::abs(numeric[i]));
  }
  // scale is 0 only where the objective is flat (softmax over one chosen expert: prob 1).
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_NEAR(analytic[i], numeric[i], 1e-5 * scale + 1e-9) << "entry " << i;
  }
}

double d_score(ScoreFunction f, double x) {
  return f == ScoreFunction::kSigmoid ? 1.0 / (1.0 + std::exp(-x))
                                      : std::sqrt(x > 20.0 ? x : std::log1p(std::exp(x)));
}

// Megatron's scores for aux loss, in double.
std::vector<double> d_aux_scores(const std::vector<double>& x, int64_t T, int E, int K,
                                 ScoreFunction f) {
  std::vector<double> s(x.size());
  for (int64_t t = 0; t < T; ++t) {
    double sum = 0.0, m = -1e300;
    for (int e = 0; e < E; ++e) m = std::max(m, x[t * E + e]);
    for (int e = 0; e < E; ++e) {
      s[t * E + e] =
          f == ScoreFunction::kSoftmax ? std::exp(x[t * E + e] - m) : d_score(f, x[t * E + e]);
      sum += s[t * E + e];
    }
    if (f == ScoreFunction::kSoftmax || K > 1)
      for (int e = 0; e < E; ++e)
        s[t * E + e] /= (f == ScoreFunction::kSoftmax ? sum : sum + 1e-20);
  }
  return s;
}

// Top-k map of the aux scores (held fixed while differencing).
std::vector<int> aux_map(const std::vector<double>& s, int64_t T, int E, int K) {
  std::vector<int> map(s.size(), 0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> order(E);
    for (int e = 0; e < E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return s[t * E + a] > s[t * E + b]; });
    for (int k = 0; k < K; ++k) map[t * E + order[k]] = 1;
  }
  return map;
}

double d_switch(const std::vector<double>& x, const std::vector<int>& map, int64_t T, int E, int K,
                ScoreFunction f, double coeff) {
  const std::vector<double> s = d_aux_scores(x, T, E, K, f);
  double loss = 0.0;
  for (int e = 0; e < E; ++e) {
    double tokens = 0.0, probs = 0.0;
    for (int64_t t = 0; t < T; ++t) {
      tokens += map[t * E + e];
      probs += s[t * E + e];
    }
    loss += tokens * probs;
  }
  return loss * E * coeff / (double(K) * T * T);
}

double d_seq(const std::vector<double>& x, const std::vector<int>& map, int64_t T, int E, int K,
             int64_t S, ScoreFunction f, double coeff) {
  const std::vector<double> s = d_aux_scores(x, T, E, K, f);
  const int64_t B = T / S;
  double loss = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    for (int e = 0; e < E; ++e) {
      double count = 0.0, mean = 0.0;
      for (int64_t p = 0; p < S; ++p) {
        count += map[(p * B + b) * E + e];
        mean += s[(p * B + b) * E + e] / double(S);
      }
      loss += count / (double(S) * K / E) * mean;
    }
  }
  return loss / double(B) * coeff;
}

double d_z(const std::vector<double>& x, int64_t T, int E, double coeff) {
  double loss = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    double sum = 0.0;
    for (int e = 0; e < E; ++e) sum += std::exp(x[t * E + e]);
    loss += std::log(sum) * std::log(sum);
  }
  return loss / double(T) * coeff;
}

std::vector<float> random_logits(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

const ScoreFunction kScoreFunctions[] = {ScoreFunction::kSoftmax, ScoreFunction::kSigmoid,
                                         ScoreFunction::kSqrtSoftplus};

TEST(AuxLoss, SwitchMatchesFiniteDifferences) {
  std::mt19937 rng(1);
  for (ScoreFunction f : kScoreFunctions) {
    for (int K : {1, 3}) {
      const int64_t T = 9;
      const int E = 6;
      const std::vector<float> logits = random_logits(rng, T * E);
      StatusOr<LossAndGrad> got = switch_aux_loss(logits, T, E, K, f, 0.01);
      ASSERT_TRUE(got.ok()) << got.status().to_string();
      std::vector<double> x(logits.begin(), logits.end());
      const std::vector<int> map = aux_map(d_aux_scores(x, T, E, K, f), T, E, K);
      EXPECT_NEAR(got->loss, d_switch(x, map, T, E, K, f, 0.01), 1e-7);
      expect_gradient(logits, got->grad_logits, [&](const std::vector<double>& y) {
        return d_switch(y, map, T, E, K, f, 0.01);
      });
    }
  }
}

TEST(AuxLoss, SequenceMatchesFiniteDifferences) {
  std::mt19937 rng(2);
  for (ScoreFunction f : kScoreFunctions) {
    const int64_t T = 12, S = 4;
    const int E = 5, K = 2;
    const std::vector<float> logits = random_logits(rng, T * E);
    StatusOr<LossAndGrad> got = sequence_aux_loss(logits, T, E, K, S, f, 0.1);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    std::vector<double> x(logits.begin(), logits.end());
    const std::vector<int> map = aux_map(d_aux_scores(x, T, E, K, f), T, E, K);
    EXPECT_NEAR(got->loss, d_seq(x, map, T, E, K, S, f, 0.1), 1e-7);
    expect_gradient(logits, got->grad_logits, [&](const std::vector<double>& y) {
      return d_seq(y, map, T, E, K, S, f, 0.1);
    });
  }
  EXPECT_EQ(sequence_aux_loss(std::vector<float>(10), 2, 5, 2, 3, ScoreFunction::kSoftmax, 1.0)
                .status()
                .message(),
            "num_tokens = 2 is not a multiple of seq_length = 3");
}

TEST(AuxLoss, ZLossMatchesFiniteDifferences) {
  std::mt19937 rng(3);
  const int64_t T = 7;
  const int E = 5;
  const std::vector<float> logits = random_logits(rng, T * E);
  StatusOr<LossAndGrad> got = z_loss(logits, T, E, 1e-3);
  ASSERT_TRUE(got.ok());
  std::vector<double> x(logits.begin(), logits.end());
  EXPECT_NEAR(got->loss, d_z(x, T, E, 1e-3), 1e-12);
  expect_gradient(logits, got->grad_logits,
                  [&](const std::vector<double>& y) { return d_z(y, T, E, 1e-3); });
  StatusOr<LossAndGrad> empty = z_loss({}, 0, E, 1e-3);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->loss, 0.0);
}

// The router's kept probs in double, for its fixed selection.
std::vector<double> d_router_probs(const RouterConfig& c, const RouterOutput& out,
                                   const std::vector<double>& x) {
  const int E = c.num_experts, K = c.num_topk;
  const int64_t T = out.selected.num_tokens;
  std::vector<double> p(T * K);
  for (int64_t t = 0; t < T; ++t) {
    const double* row = x.data() + t * E;
    std::vector<double> v(K);
    if (c.score_function == ScoreFunction::kSoftmax) {
      const int n = c.pre_softmax ? E : K;
      std::vector<double> in(n);
      for (int i = 0; i < n; ++i) in[i] = c.pre_softmax ? row[i] : row[out.selected.idx(t, i)];
      double m = *std::max_element(in.begin(), in.end()), sum = 0.0;
      for (double& z : in) sum += (z = std::exp(z - m));
      for (int k = 0; k < K; ++k) v[k] = (c.pre_softmax ? in[out.selected.idx(t, k)] : in[k]) / sum;
    } else {
      double sum = 1e-20;
      for (int k = 0; k < K; ++k)
        sum += (v[k] = d_score(c.score_function, row[out.selected.idx(t, k)]));
      if (K > 1)
        for (double& z : v) z /= sum;
    }
    for (int k = 0; k < K; ++k)
      p[t * K + k] = out.kept[t * K + k] ? v[k] * c.topk_scaling_factor.value_or(1.0f) : 0.0;
  }
  return p;
}

TEST(RouterBackward, MatchesFiniteDifferences) {
  std::mt19937 rng(4);
  int cases = 0;
  for (ScoreFunction f : kScoreFunctions) {
    for (bool pre : {false, true}) {
      if (pre && f != ScoreFunction::kSoftmax) continue;
      for (int K : {1, 2, 6}) {
        for (LoadBalancing lb :
             {LoadBalancing::kNone, LoadBalancing::kAuxLoss, LoadBalancing::kSeqAuxLoss}) {
          RouterConfig c = router_config(6, K);
          c.score_function = f;
          c.pre_softmax = pre;
          c.load_balancing = lb;
          c.aux_loss_coeff = 0.05;
          c.seq_length = 4;
          c.z_loss_coeff = cases % 2 ? 1e-3 : 0.0;
          if (cases % 3 == 0) c.topk_scaling_factor = 1.5f;
          if (cases % 4 == 1) {
            c.layout.capacity_factor = 0.8;  // drops: those slots get no gradient
            c.layout.router_padding_multiple = 3;
          }
          if (cases % 5 == 2 && K == 2) {
            c.num_groups = 3;
            c.group_topk = 2;
          }
          Router router = *Router::create(c);
          const int64_t T = 8;
          const std::vector<float> logits = random_logits(rng, T * 6);
          RouterOutput out = *router.forward(logits, T);
          std::vector<float> grad_probs = random_logits(rng, T * 6);
          const double loss_scale = 0.7;
          StatusOr<std::vector<float>> grad = router.backward(logits, out, grad_probs, loss_scale);
          ASSERT_TRUE(grad.ok()) << grad.status().to_string();

          std::vector<double> x(logits.begin(), logits.end());
          const std::vector<int> map = aux_map(d_aux_scores(x, T, 6, K, f), T, 6, K);
          SCOPED_TRACE(::testing::Message() << score_function_name(f) << " pre=" << pre
                                            << " K=" << K << " lb=" << load_balancing_name(lb));
          expect_gradient(logits, *grad, [&](const std::vector<double>& y) {
            const std::vector<double> p = d_router_probs(c, out, y);
            double j = 0.0;
            for (int64_t t = 0; t < T; ++t)
              for (int k = 0; k < K; ++k)
                j += grad_probs[t * 6 + out.selected.idx(t, k)] * p[t * K + k];
            if (lb == LoadBalancing::kAuxLoss) j += loss_scale * d_switch(y, map, T, 6, K, f, 0.05);
            if (lb == LoadBalancing::kSeqAuxLoss)
              j += loss_scale * d_seq(y, map, T, 6, K, 4, f, 0.05);
            if (c.z_loss_coeff > 0) j += loss_scale * d_z(y, T, 6, c.z_loss_coeff);
            return j;
          });
          if (lb == LoadBalancing::kAuxLoss) {
            EXPECT_NEAR(out.aux_loss, d_switch(x, map, T, 6, K, f, 0.05), 1e-7);
          } else if (lb == LoadBalancing::kSeqAuxLoss) {
            EXPECT_NEAR(out.aux_loss, d_seq(x, map, T, 6, K, 4, f, 0.05), 1e-7);
          }

          // The top-k form of the same gradient gives the same result.
          std::vector<float> grad_topk(out.topk.topk_idx.size(), 0.0f);
          for (int64_t t = 0; t < T; ++t)
            for (int k = 0; k < out.topk.num_topk; ++k)
              if (out.topk.idx(t, k) >= 0)
                grad_topk[t * out.topk.num_topk + k] = grad_probs[t * 6 + out.topk.idx(t, k)];
          StatusOr<std::vector<float>> grad2 =
              router.backward_topk(logits, out, grad_topk, loss_scale);
          ASSERT_TRUE(grad2.ok());
          EXPECT_EQ(*grad2, *grad);
          ++cases;
        }
      }
    }
  }
  EXPECT_GT(cases, 20);
}

TEST(RouterBackward, SizeErrors) {
  Router router = *Router::create(router_config(4, 2));
  const std::vector<float> logits(12, 0.5f);
  RouterOutput out = *router.forward(logits, 3);
  EXPECT_EQ(router.backward(logits, out, std::vector<float>(11)).status().message(),
            "grad_probs has 11 entries, expected 3 * 4 = 12");
  EXPECT_EQ(router.backward_topk(logits, out, std::vector<float>(5)).status().message(),
            "grad_topk_weights has 5 entries, expected num_tokens * num_topk = 3 * 2 = 6");
}

}  // namespace
}  // namespace moed
