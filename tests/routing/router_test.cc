// The router's forward against a sort-based brute force (every score function, pre-softmax,
// expert bias, groups, scaling, ties, K = 1 and K = E), its config errors, and its layout
// options (dropping / padding must equal apply_layout_options on the raw choice).
#include "moed/router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "routing/routing_test_util.h"

namespace moed {
namespace {

using routing_test::expect_invalid;
using routing_test::router_config;

std::vector<float> bf_softmax(std::vector<float> v) {
  float m = -std::numeric_limits<float>::infinity();
  for (float x : v) m = std::max(m, x);
  float sum = 0.0f;
  for (float& x : v) {
    x = std::exp(x - m);
    sum += x;
  }
  for (float& x : v) x = x / sum;
  return v;
}

// Sorts every candidate; groups mask the others to -inf exactly as Megatron's
// group_limited_topk does.
void brute_force(const RouterConfig& c, const std::vector<float>& logits, int64_t T,
                 const std::vector<float>& bias, std::vector<int32_t>& idx,
                 std::vector<float>& probs) {
  const int E = c.num_experts, K = c.num_topk;
  idx.clear();
  probs.clear();
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> x(logits.begin() + t * E, logits.begin() + (t + 1) * E), unbiased(E);
    if (c.score_function == ScoreFunction::kSoftmax) {
      unbiased = c.pre_softmax ? bf_softmax(x) : x;
    } else {
      for (int e = 0; e < E; ++e) {
        unbiased[e] = c.score_function == ScoreFunction::kSigmoid
                          ? 1.0f / (1.0f + std::exp(-x[e]))
                          : std::sqrt(x[e] > 20.0f ? x[e] : std::log1p(std::exp(x[e])));
      }
    }
    std::vector<float> sel = unbiased;
    if (!bias.empty())
      for (int e = 0; e < E; ++e) sel[e] = sel[e] + bias[e];
    if (c.num_groups > 0) {
      const int size = E / c.num_groups;
      std::vector<std::pair<float, int>> groups;
      for (int g = 0; g < c.num_groups; ++g) {
        std::vector<float> v(sel.begin() + g * size, sel.begin() + (g + 1) * size);
        std::sort(v.begin(), v.end(), std::greater<float>());
        float s = 0.0f;
        for (int i = 0; i < K / c.group_topk; ++i) s += v[i];
        groups.emplace_back(s, g);
      }
      std::sort(groups.begin(), groups.end(), [](auto a, auto b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      });
      std::vector<bool> keep(c.num_groups, false);
      for (int i = 0; i < c.group_topk; ++i) keep[groups[i].second] = true;
      for (int e = 0; e < E; ++e)
        if (!keep[e / size]) sel[e] = -std::numeric_limits<float>::infinity();
    }
    std::vector<std::pair<float, int>> order;
    for (int e = 0; e < E; ++e) order.emplace_back(sel[e], e);
    std::sort(order.begin(), order.end(), [](auto a, auto b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    std::vector<float> chosen;
    for (int k = 0; k < K; ++k) {
      idx.push_back(order[k].second);
      chosen.push_back(unbiased[order[k].second]);
    }
    std::vector<float> p = chosen;
    if (c.score_function == ScoreFunction::kSoftmax) {
      if (!c.pre_softmax) p = bf_softmax(chosen);
    } else if (K > 1) {
      float sum = 0.0f;
      for (float v : chosen) sum += v;
      for (float& v : p) v = v / (sum + 1e-20f);
    }
    if (c.topk_scaling_factor)
      for (float& v : p) v = v * *c.topk_scaling_factor;
    probs.insert(probs.end(), p.begin(), p.end());
  }
}

// Logits from a small set of values when `ties`, so equal scores are common.
std::vector<float> random_logits(std::mt19937& rng, int64_t T, int E, bool ties) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(T * E);
  for (float& x : logits) x = ties ? float(int(rng() % 5) - 2) : normal(rng);
  return logits;
}

TEST(Router, ForwardMatchesBruteForce) {
  std::mt19937 rng(11);
  int cases = 0;
  for (ScoreFunction f :
       {ScoreFunction::kSoftmax, ScoreFunction::kSigmoid, ScoreFunction::kSqrtSoftplus}) {
    for (bool pre : {false, true}) {
      if (pre && f != ScoreFunction::kSoftmax) continue;
      for (int E : {1, 6, 16}) {
        for (int K : {1, 2, 4, E}) {
          if (K > E) continue;
          for (int groups : {0, 2, 4}) {
            if (groups > 0 && (E % groups != 0 || K < 2 || K / 2 > E / groups)) continue;
            for (bool use_bias : {false, true}) {
              for (bool ties : {false, true}) {
                RouterConfig c = router_config(E, K);
                c.score_function = f;
                c.pre_softmax = pre;
                c.num_groups = groups;
                c.group_topk = groups > 0 ? 2 : 0;
                c.enable_expert_bias = use_bias;
                if (cases % 3 == 1) c.topk_scaling_factor = 2.5f;
                StatusOr<Router> router = Router::create(c);
                ASSERT_TRUE(router.ok()) << router.status().to_string();
                std::vector<float> bias;
                if (use_bias) {
                  for (int e = 0; e < E; ++e) bias.push_back(float(int(rng() % 3)) * 0.25f);
                  ASSERT_TRUE(router->set_expert_bias(bias).ok());
                }
                for (int64_t T : {0, 1, 23}) {
                  const std::vector<float> logits = random_logits(rng, T, E, ties);
                  StatusOr<RouterOutput> out = router->forward(logits, T);
                  ASSERT_TRUE(out.ok()) << out.status().to_string();
                  std::vector<int32_t> idx;
                  std::vector<float> probs;
                  brute_force(c, logits, T, bias, idx, probs);
                  SCOPED_TRACE(::testing::Message()
                               << score_function_name(f) << " pre=" << pre << " E=" << E
                               << " K=" << K << " groups=" << groups << " bias=" << use_bias
                               << " ties=" << ties << " T=" << T);
                  EXPECT_EQ(out->selected.topk_idx, idx);
                  EXPECT_EQ(out->selected.topk_weights, probs);  // bit for bit
                  // No layout options: the effective routing is the raw choice.
                  RoutingMap want = to_map(out->selected, E);
                  EXPECT_EQ(out->routing.routing_map, want.routing_map);
                  EXPECT_EQ(out->routing.probs, want.probs);
                  EXPECT_EQ(out->routing.num_topk, K);
                  EXPECT_EQ(out->topk.num_topk, K);
                  RoutingMap again = to_map(out->topk, E);
                  EXPECT_EQ(again.probs, want.probs);
                  EXPECT_EQ(out->kept, std::vector<uint8_t>(T * K, 1));
                  std::vector<int64_t> tpe(E, 0);
                  for (int32_t e : idx) ++tpe[e];
                  EXPECT_EQ(out->tokens_per_expert, tpe);
                  ++cases;
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 300);
}

TEST(Router, TiesGoToTheLowerExpert) {
  RouterConfig c = router_config(8, 3);
  Router router = *Router::create(c);
  std::vector<float> logits = {1, 2, 2, 0, 2, 0, 0, 0,  // experts 1, 2, 4 tie
                               0, 0, 0, 0, 0, 0, 0, 0};
  RouterOutput out = *router.forward(logits, 2);
  EXPECT_EQ(out.selected.topk_idx, (std::vector<int32_t>{1, 2, 4, 0, 1, 2}));
  // Groups: 4 groups of 2, top-1 per group (K / group_topk = 3 / 3); groups 0..3 score
  // 2, 2, 2, 0: the first three groups win the tie against each other.
  c.num_groups = 4;
  c.group_topk = 3;
  router = *Router::create(c);
  out = *router.forward(logits, 2);
  EXPECT_EQ(out.selected.topk_idx, (std::vector<int32_t>{1, 2, 4, 0, 1, 2}));
}

TEST(Router, LayoutOptionsEqualApplyLayoutOptions) {
  std::mt19937 rng(3);
  for (DropPolicy policy : {DropPolicy::kProbs, DropPolicy::kPosition}) {
    for (int m : {0, 4}) {
      RouterConfig c = router_config(8, 2);
      c.layout.capacity_factor = 0.75;
      c.layout.drop_policy = policy;
      c.layout.router_padding_multiple = m;
      Router router = *Router::create(c);
      std::vector<float> logits = random_logits(rng, 50, 8, false);
      for (int t = 0; t < 50; ++t) logits[t * 8 + 5] += 3.0f;  // skew towards expert 5
      RouterOutput out = *router.forward(logits, 50);
      LayoutOptions o = c.layout;
      StatusOr<RoutingMap> want = apply_layout_options(to_map(out.selected, 8), 2, o);
      ASSERT_TRUE(want.ok());
      EXPECT_EQ(out.routing.routing_map, want->routing_map);
      EXPECT_EQ(out.routing.probs, want->probs);
      o.router_padding_multiple = 0;
      RoutingMap dropped = *apply_layout_options(to_map(out.selected, 8), 2, o);
      int kept = 0;
      for (int t = 0; t < 50; ++t) {
        for (int k = 0; k < 2; ++k) {
          EXPECT_EQ(out.kept[t * 2 + k], dropped.routed(t, out.selected.idx(t, k)));
          kept += out.kept[t * 2 + k];
        }
      }
      EXPECT_LT(kept, 100);  // expert 5 is over capacity
      int64_t routed = 0;
      for (int e = 0; e < 8; ++e) {
        routed += out.tokens_per_expert[e];
        if (m > 0) {
          EXPECT_EQ(out.tokens_per_expert[e] % m, 0);
        }
      }
      EXPECT_EQ(out.topk.num_topk, std::max<int>(2, out.topk.num_topk));
      EXPECT_EQ(to_map(out.topk, 8).routing_map, out.routing.routing_map);
      EXPECT_GE(routed, kept);
    }
  }
}

TEST(Router, ConfigErrors) {
  RouterConfig c = router_config(8, 9);
  expect_invalid(c.validate(), "num_topk = 9 is outside [1, 8]");
  c.num_topk = 4;
  c.score_function = ScoreFunction::kSigmoid;
  c.pre_softmax = true;
  expect_invalid(c.validate(), "pre_softmax needs score_function = softmax, not sigmoid");
  c.pre_softmax = false;
  c.num_groups = 3;
  c.group_topk = 1;
  expect_invalid(c.validate(), "num_groups = 3 does not divide num_experts = 8");
  c.num_groups = 4;
  c.group_topk = 5;
  expect_invalid(c.validate(), "group_topk = 5 is outside [1, 4]");
  c.group_topk = 1;
  expect_invalid(c.validate(), "num_topk = 4 / group_topk = 1 experts per group must be in [1, 2]");
  c.group_topk = 2;
  EXPECT_TRUE(c.validate().ok());
  c.load_balancing = LoadBalancing::kSeqAuxLoss;
  expect_invalid(c.validate(), "seq_length = 0 must be >= 1 with seq_aux_loss");
  c.seq_length = 4;
  c.z_loss_coeff = -1.0;
  expect_invalid(c.validate(), "z_loss_coeff = -1 must be finite and >= 0");
  c.z_loss_coeff = 0.0;
  c.layout.capacity_factor = -0.5;
  expect_invalid(c.validate(), "capacity_factor = -0.5 must be > 0");
  c.layout.capacity_factor.reset();
  Router router = *Router::create(c);
  expect_invalid(router.forward(std::vector<float>(8 * 6), 6).status(),
                 "num_tokens = 6 is not a multiple of seq_length = 4");
  expect_invalid(router.forward(std::vector<float>(7), 1).status(),
                 "logits has 7 entries, expected num_tokens * num_experts = 1 * 8 = 8");
  std::vector<float> logits(8 * 4, 0.0f);
  logits[2 * 8 + 3] = std::nanf("");
  expect_invalid(router.forward(logits, 4).status(), "logits[2][3] = nan is not finite");
  EXPECT_EQ(router.set_expert_bias({}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(*parse_score_function("sqrtsoftplus"), ScoreFunction::kSqrtSoftplus);
  expect_invalid(parse_score_function("relu").status(),
                 "score function 'relu' is not one of: softmax, sigmoid, sqrtsoftplus");
  EXPECT_EQ(*parse_load_balancing("seq_aux_loss"), LoadBalancing::kSeqAuxLoss);
  EXPECT_STREQ(load_balancing_name(LoadBalancing::kAuxLoss), "aux_loss");
}

TEST(Router, ExpertBiasUpdateRule) {
  // mean = 5: under-loaded experts go up, over-loaded down, exactly-average ones stay.
  std::vector<int64_t> tpe = {10, 0, 5, 5};
  StatusOr<std::vector<float>> b =
      updated_expert_bias(tpe, std::vector<float>{0, 0.5f, 1, -1}, 0.25f);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, (std::vector<float>{-0.25f, 0.75f, 1.0f, -1.0f}));
  // The mean is 7/3 here; the sign is exact (no rounding of the mean).
  b = updated_expert_bias(std::vector<int64_t>{7, 0, 0}, std::vector<float>(3, 0.0f), 1.0f);
  EXPECT_EQ(*b, (std::vector<float>{-1.0f, 1.0f, 1.0f}));
  expect_invalid(updated_expert_bias(tpe, std::vector<float>(3), 1.0f).status(),
                 "tokens_per_expert has 4 entries but expert_bias has 3");

  RouterConfig c = router_config(4, 2);
  c.score_function = ScoreFunction::kSigmoid;
  c.enable_expert_bias = true;
  c.expert_bias_update_rate = 0.5f;
  Router router = *Router::create(c);
  EXPECT_EQ(router.expert_bias(), std::vector<float>(4, 0.0f));
  const std::vector<float> logits = {3, 2, 1, 0};
  RouterOutput out = *router.forward(logits, 1);
  EXPECT_EQ(out.selected.topk_idx, (std::vector<int32_t>{0, 1}));
  ASSERT_TRUE(router.update_expert_bias(out.tokens_per_expert).ok());
  ASSERT_TRUE(router.update_expert_bias(out.tokens_per_expert).ok());
  EXPECT_EQ(router.expert_bias(), (std::vector<float>{-1, -1, 1, 1}));
  // The bias now picks experts 2 and 3, but their probs are the unbiased sigmoid scores.
  out = *router.forward(logits, 1);
  EXPECT_EQ(out.selected.topk_idx, (std::vector<int32_t>{2, 3}));
  const float s2 = 1.0f / (1.0f + std::exp(-1.0f)), s3 = 0.5f;
  EXPECT_EQ(out.selected.topk_weights,
            (std::vector<float>{s2 / (s2 + s3 + 1e-20f), s3 / (s2 + s3 + 1e-20f)}));
}

}  // namespace
}  // namespace moed
