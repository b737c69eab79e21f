// reference_combine: hand-computed sums (unweighted, weighted, ETP partials, dropped tokens),
// the fixed summation order and single rounding, and design.md §4.3's round-trip identity on random
// data with the expectation computed straight from the formula.
#include <gtest/gtest.h>

#include <cmath>

#include "moed/reference.h"
#include "reference/reference_test_util.h"

namespace moed::testing {
namespace {

Tensor column_f32(const std::vector<float>& values) {
  Tensor t = Tensor::zeros(DType::kF32, int64_t(values.size()), 1);
  for (size_t i = 0; i < values.size(); ++i) t.row<float>(int64_t(i))[0] = values[i];
  return t;
}

// Worked example with power-of-two-friendly probs; layout rows (t, e):
// (0,0) (2,0) | (0,1) (1,1) (3,1) | (1,2) (2,2).
ReferenceProblem worked_example(std::vector<Tensor>& xs) {
  xs.push_back(named_hidden(0, 4, 1));
  return make_problem(
      3, 1, 1,
      {make_map({{1, 1, 0}, {0, 1, 1}, {1, 0, 1}, {0, 1, 0}},
                {{0.5f, 0.25f, 0}, {0, 0.75f, 0.125f}, {0.5f, 0, 1.5f}, {0, 2, 0}})},
      xs);
}

TEST(ReferenceCombine, WorkedExampleUnweightedAndWeighted) {
  std::vector<Tensor> xs;
  ReferenceProblem p = worked_example(xs);
  std::vector<Tensor> y;
  y.push_back(column_f32({1, 2, 4, 8, 16, 32, 64}));
  auto out = reference_combine(p, views_of(y));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  ASSERT_EQ(out->size(), 1u);
  const Tensor& o = (*out)[0];
  ASSERT_EQ(o.dtype(), DType::kF32);
  ASSERT_EQ(o.rows(), 4);
  EXPECT_EQ(o.row<float>(0)[0], 1 + 4);
  EXPECT_EQ(o.row<float>(1)[0], 8 + 32);
  EXPECT_EQ(o.row<float>(2)[0], 2 + 64);
  EXPECT_EQ(o.row<float>(3)[0], 16);

  p.weighted_combine = true;
  out = reference_combine(p, views_of(y));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  const Tensor& w = (*out)[0];
  EXPECT_EQ(w.row<float>(0)[0], 0.5f * 1 + 0.25f * 4);
  EXPECT_EQ(w.row<float>(0)[0], 1.5f);
  EXPECT_EQ(w.row<float>(1)[0], 10.0f);  // 0.75 * 8 + 0.125 * 32
  EXPECT_EQ(w.row<float>(2)[0], 97.0f);  // 0.5 * 2 + 1.5 * 64
  EXPECT_EQ(w.row<float>(3)[0], 32.0f);  // 2 * 16
}

TEST(ReferenceCombine, Bf16RoundsOnceAtTheEndAndStartsFromPositiveZero) {
  // Token 0 on all 3 experts: 1 + 2^-8 + 2^-8 = 1 + 2^-7 (a bf16 value). Rounding after each
  // add would tie back to 1.0 twice. Token 1 on expert 0 only, y = -0.0: 0 + -0 = +0.
  // Token 2 routes nowhere: 0.
  std::vector<Tensor> xs;
  xs.push_back(named_hidden(0, 3, 1));
  ReferenceProblem p = make_problem(3, 1, 1, {make_map({{1, 1, 1}, {1, 0, 0}, {0, 0, 0}})}, xs);
  // Rows: e0: t0, t1 | e1: t0 | e2: t0.
  Tensor y = Tensor::zeros(DType::kBF16, 4, 1);
  y.row<bf16>(0)[0] = float_to_bf16(1.0f);
  y.row<bf16>(1)[0] = float_to_bf16(-0.0f);
  y.row<bf16>(2)[0] = float_to_bf16(std::ldexp(1.0f, -8));
  y.row<bf16>(3)[0] = float_to_bf16(std::ldexp(1.0f, -8));
  std::vector<Tensor> ys;
  ys.push_back(std::move(y));
  auto out = reference_combine(p, views_of(ys));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  const Tensor& o = (*out)[0];
  ASSERT_EQ(o.dtype(), DType::kBF16);
  EXPECT_EQ(o.row<bf16>(0)[0].bits, 0x3f81);  // 1.0078125
  EXPECT_EQ(o.row<bf16>(1)[0].bits, 0x0000);  // +0.0, not -0.0
  EXPECT_EQ(o.row<bf16>(2)[0].bits, 0x0000);
}

TEST(ReferenceCombine, ExpertTensorParallelPartialsSumPerExpertFirst) {
  // EP = 1, ETP = 2, E = 2: rank 0's token routes to both experts; rank 1 has T = 0. Both
  // ranks hold rows (e0: t0), (e1: t0).
  std::vector<Tensor> xs;
  xs.push_back(named_hidden(0, 1, 1));
  xs.push_back(named_hidden(1, 0, 1));
  ReferenceProblem p =
      make_problem(2, 1, 2, {make_map({{1, 1}}, {{0.5f, 0.25f}}), make_map({}, {}, 2)}, xs);
  std::vector<Tensor> y;
  y.push_back(column_f32({1, 2}));
  y.push_back(column_f32({4, 8}));
  auto out = reference_combine(p, views_of(y));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  ASSERT_EQ(out->size(), 2u);
  EXPECT_EQ((*out)[0].row<float>(0)[0], 15.0f);  // (1 + 4) + (2 + 8)
  EXPECT_EQ((*out)[1].rows(), 0);
  p.weighted_combine = true;
  out = reference_combine(p, views_of(y));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ((*out)[0].row<float>(0)[0], 5.0f);  // 0.5 * 5 + 0.25 * 10

  // Order: term_e0 = (0 + 1) + 2^-24 = 1 (tie to even), term_e1 = 2^-24 + 2^-24 = 2^-23,
  // acc = 1 + 2^-23. Summing rank by rank instead would stay at 1.
  const float tiny = std::ldexp(1.0f, -24);
  y.clear();
  y.push_back(column_f32({1, tiny}));
  y.push_back(column_f32({tiny, tiny}));
  p.weighted_combine = false;
  out = reference_combine(p, views_of(y));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(bits_of((*out)[0].row<float>(0)[0]), bits_of(1.0f + std::ldexp(1.0f, -23)));
}

TEST(ReferenceCombine, DroppedTokensContributeNothing) {
  // T = 2, K = 1, E = 2, cf = 1 -> C = 1: expert 0 keeps t1 (higher prob); t0 is dropped and
  // combines to 0.
  std::vector<Tensor> xs;
  xs.push_back(named_hidden(0, 2, 1));
  ReferenceProblem p =
      make_problem(2, 1, 1, {make_map({{1, 0}, {1, 0}}, {{0.25f, 0}, {0.5f, 0}})}, xs);
  p.num_topk = 1;
  p.layout.capacity_factor = 1.0;
  p.weighted_combine = true;
  std::vector<Tensor> y;
  y.push_back(column_f32({8}));
  auto out = reference_combine(p, views_of(y));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_EQ((*out)[0].row<float>(0)[0], 0.0f);
  EXPECT_EQ((*out)[0].row<float>(1)[0], 4.0f);
}

// ---- design.md §4.3 round trip on random data ----

struct RoundTripCase {
  const char* name;
  int num_experts, ep_size, etp_size, num_topk;
  std::vector<int64_t> num_tokens;  // per source rank
  int expert_alignment;
  int router_padding_multiple;
  bool skewed;  // every token to expert num_experts - 1 (num_topk must be 1)
};

class ReferenceRoundTrip : public ::testing::TestWithParam<RoundTripCase> {};

TEST_P(ReferenceRoundTrip, CombineOfDispatchIsXTimesSumOfProbs) {
  const RoundTripCase& c = GetParam();
  const int64_t H = 9;
  const int R = c.ep_size * c.etp_size;
  std::mt19937 rng(1234);
  std::vector<Tensor> xs;
  std::vector<RoutingMap> maps;
  for (int s = 0; s < R; ++s) {
    xs.push_back(testing::random_f32(rng, c.num_tokens[size_t(s)], H));
    RoutingMap m = testing::random_map(rng, c.num_tokens[size_t(s)], c.num_experts, c.num_topk);
    if (c.skewed) {
      for (int64_t t = 0; t < m.num_tokens; ++t) {
        for (int e = 0; e < c.num_experts; ++e) {
          const size_t cell = size_t(t) * c.num_experts + size_t(e);
          const bool last = e == c.num_experts - 1;
          m.routing_map[cell] = last ? 1 : 0;
          m.probs[cell] = last ? 0.25f + 0.5f * float(t % 3) : 0.0f;
        }
      }
    }
    maps.push_back(m);
  }
  ReferenceProblem p = make_problem(c.num_experts, c.ep_size, c.etp_size, maps, xs);
  p.num_topk = c.num_topk;
  p.layout.expert_alignment = c.expert_alignment;
  p.layout.router_padding_multiple = c.router_padding_multiple;

  // Expected, straight from design.md §4.3 on the raw map. Router padding adds (t, e) with prob 0,
  // whose terms are +-0 and leave an fp32 sum that started at +0 unchanged bit for bit.
  auto expected = [&](int s, int64_t t, int64_t h) {
    float acc = 0.0f;
    for (int e = 0; e < c.num_experts; ++e) {
      if (!maps[size_t(s)].routed(t, e)) continue;
      float term = 0.0f;
      for (int pp = 0; pp < c.etp_size; ++pp)
        term += xs[size_t(s)].row<float>(t)[h] * maps[size_t(s)].prob(t, e);
      acc += term;
    }
    return acc;
  };

  auto d = reference_dispatch(p);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  // Experts: y = x * prob, row by row (padding rows are 0 * 0).
  std::vector<Tensor> y;
  for (const ReferenceRankDispatch& r : *d) {
    Tensor yr = Tensor::copy_of(r.expert_input.x.view());
    for (int64_t i = 0; i < yr.rows(); ++i) {
      for (int64_t h = 0; h < H; ++h) yr.row<float>(i)[h] *= r.permuted_probs[size_t(i)];
    }
    y.push_back(std::move(yr));
  }
  auto out = reference_combine(p, views_of(y));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  for (int s = 0; s < R; ++s) {
    ASSERT_EQ((*out)[size_t(s)].rows(), c.num_tokens[size_t(s)]);
    for (int64_t t = 0; t < c.num_tokens[size_t(s)]; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        ASSERT_EQ(bits_of((*out)[size_t(s)].row<float>(t)[h]), bits_of(expected(s, t, h)))
            << "s " << s << " t " << t << " h " << h;
      }
    }
  }

  // Backward with grad_out = x: the combine backward sends x to every row, the experts'
  // backward multiplies by the prob, and the dispatch backward sums: the same values again.
  std::vector<TensorView> grad_out = views_of(xs);
  auto cg = reference_combine_backward(p, grad_out, {});
  ASSERT_TRUE(cg.ok()) << cg.status().to_string();
  std::vector<Tensor> grad_rows;
  for (int r = 0; r < R; ++r) {
    Tensor g = Tensor::copy_of(cg->grad_expert_output[size_t(r)].view());
    for (int64_t i = 0; i < g.rows(); ++i) {
      for (int64_t h = 0; h < H; ++h)
        g.row<float>(i)[h] *= (*d)[size_t(r)].permuted_probs[size_t(i)];
    }
    grad_rows.push_back(std::move(g));
  }
  auto dg = reference_dispatch_backward(p, views_of(grad_rows), {});
  ASSERT_TRUE(dg.ok()) << dg.status().to_string();
  for (int s = 0; s < R; ++s) {
    EXPECT_TRUE(bitwise_equal(dg->grad_hidden[size_t(s)].view(), (*out)[size_t(s)].view())) << s;
  }

  // Weighted combine of y = x (identity experts) follows the same formula with prob * term.
  p.weighted_combine = true;
  std::vector<TensorView> identity;
  for (const ReferenceRankDispatch& r : *d) identity.push_back(r.expert_input.x.view());
  out = reference_combine(p, identity);
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  for (int s = 0; s < R; ++s) {
    for (int64_t t = 0; t < c.num_tokens[size_t(s)]; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        float acc = 0.0f;
        for (int e = 0; e < c.num_experts; ++e) {
          if (!maps[size_t(s)].routed(t, e)) continue;
          float term = 0.0f;
          for (int pp = 0; pp < c.etp_size; ++pp) term += xs[size_t(s)].row<float>(t)[h];
          acc += maps[size_t(s)].prob(t, e) * term;
        }
        ASSERT_EQ(bits_of((*out)[size_t(s)].row<float>(t)[h]), bits_of(acc))
            << "s " << s << " t " << t << " h " << h;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ReferenceRoundTrip,
    ::testing::Values(RoundTripCase{"ep3", 6, 3, 1, 2, {5, 0, 7}, 1, 0, false},
                      RoundTripCase{"ep2_etp2", 4, 2, 2, 2, {3, 6, 0, 4}, 1, 0, false},
                      RoundTripCase{"k_equals_e", 4, 1, 1, 4, {11}, 1, 0, false},
                      RoundTripCase{"skewed_k1", 6, 3, 1, 1, {4, 7, 1}, 1, 0, true},
                      RoundTripCase{"aligned_router_padded", 6, 2, 1, 3, {8, 5}, 4, 3, false},
                      RoundTripCase{"ep7_etp1", 7, 7, 1, 2, {2, 0, 3, 1, 0, 5, 4}, 2, 0, false}),
    [](const ::testing::TestParamInfo<RoundTripCase>& info) {
      return std::string(info.param.name);
    });

}  // namespace
}  // namespace moed::testing
