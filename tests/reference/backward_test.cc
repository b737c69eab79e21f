// Both backward passes on cases small enough to compute by hand, with ETP = 2 partials and
// bf16 rounding; the dispatch backward also against the unweighted combine on random rows.
#include <gtest/gtest.h>

#include "moed/reference.h"
#include "reference/reference_test_util.h"

namespace moed::testing {
namespace {

Tensor rows_f32(const std::vector<std::vector<float>>& values) {
  Tensor t = Tensor::zeros(DType::kF32, int64_t(values.size()), int64_t(values[0].size()));
  for (size_t i = 0; i < values.size(); ++i) {
    for (size_t h = 0; h < values[i].size(); ++h) t.row<float>(int64_t(i))[h] = values[i][h];
  }
  return t;
}

// EP = 1, ETP = 2, E = 2, H = 2. Rank 0: t0 -> {e0, e1} probs 0.5, 0.25; t1 -> nothing.
// Rank 1: T = 0. Both ranks hold rows (e0: t0), (e1: t0).
struct EtpCase : HeldProblem {
  EtpCase()
      : HeldProblem(2, 1, 2,
                    {make_map({{1, 1}, {0, 0}}, {{0.5f, 0.25f}, {0, 0}}), make_map({}, {}, 2)},
                    /*hidden=*/2) {}
};

TEST(ReferenceDispatchBackward, SumsRowGradientsAndPermutedProbGradients) {
  EtpCase c;
  std::vector<Tensor> grad_rows;
  grad_rows.push_back(rows_f32({{1, 2}, {4, 8}}));
  grad_rows.push_back(rows_f32({{16, 32}, {64, 128}}));
  auto g = reference_dispatch_backward(c.p, views_of(grad_rows), {{0.5f, 0.25f}, {1.0f, 2.0f}});
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  ASSERT_EQ(g->grad_hidden.size(), 2u);
  // t0: (1 + 16) + (4 + 64) = 85, (2 + 32) + (8 + 128) = 170; t1 routes nowhere: 0.
  EXPECT_EQ(row_values(g->grad_hidden[0], 0), (std::vector<float>{85, 170}));
  EXPECT_EQ(row_values(g->grad_hidden[0], 1), (std::vector<float>{0, 0}));
  EXPECT_EQ(g->grad_hidden[1].rows(), 0);
  // grad_probs[t][e] = sum over p of the permuted prob grads of (t, e)'s rows.
  EXPECT_EQ(g->grad_probs[0], (std::vector<float>{1.5f, 2.25f, 0, 0}));
  EXPECT_TRUE(g->grad_probs[1].empty());

  // Without permuted prob gradients, grad_probs is all 0.
  g = reference_dispatch_backward(c.p, views_of(grad_rows), {});
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->grad_probs[0], (std::vector<float>{0, 0, 0, 0}));
}

TEST(ReferenceDispatchBackward, EqualsTheUnweightedCombineOfTheGradients) {
  // Random bf16 gradients on 3 ranks, one with no tokens, alignment padding in between.
  std::mt19937 rng(7);
  std::vector<Tensor> xs;
  std::vector<RoutingMap> maps;
  const std::vector<int64_t> T = {6, 0, 9};
  for (int s = 0; s < 3; ++s) {
    xs.push_back(testing::random_f32(rng, T[size_t(s)], 5));
    maps.push_back(testing::random_map(rng, T[size_t(s)], 6, 3));
  }
  ReferenceProblem p = make_problem(6, 3, 1, maps, xs);
  p.layout.expert_alignment = 4;
  auto d = reference_dispatch(p);
  ASSERT_TRUE(d.ok());
  std::vector<Tensor> grads;
  for (const ReferenceRankDispatch& r : *d) {
    Tensor f = testing::random_f32(rng, r.expert_input.x.rows(), 5);
    Tensor b = Tensor::zeros(DType::kBF16, f.rows(), 5);
    for (int64_t i = 0; i < f.rows(); ++i) {
      for (int64_t h = 0; h < 5; ++h) b.row<bf16>(i)[h] = float_to_bf16(f.row<float>(i)[h]);
    }
    grads.push_back(std::move(b));
  }
  auto g = reference_dispatch_backward(p, views_of(grads), {});
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  auto combined = reference_combine(p, views_of(grads));
  ASSERT_TRUE(combined.ok());
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(g->grad_hidden[size_t(s)].dtype(), DType::kBF16);
    EXPECT_TRUE(bitwise_equal(g->grad_hidden[size_t(s)].view(), (*combined)[size_t(s)].view()));
  }
}

TEST(ReferenceCombineBackward, WeightedScalesRowsAndDotsWithExpertOutputs) {
  // One rank, E = 2, H = 2: t0 -> {e0, e1} probs 0.5, 0.25. Rows: (e0: t0), (e1: t0).
  std::vector<Tensor> xs;
  xs.push_back(named_hidden(0, 1, 2));
  ReferenceProblem p = make_problem(2, 1, 1, {make_map({{1, 1}}, {{0.5f, 0.25f}})}, xs);
  p.weighted_combine = true;
  std::vector<Tensor> grad_out, y;
  grad_out.push_back(rows_f32({{1, 2}}));
  y.push_back(rows_f32({{3, 4}, {5, 6}}));
  auto g = reference_combine_backward(p, views_of(grad_out), views_of(y));
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_EQ(row_values(g->grad_expert_output[0], 0), (std::vector<float>{0.5f, 1.0f}));
  EXPECT_EQ(row_values(g->grad_expert_output[0], 1), (std::vector<float>{0.25f, 0.5f}));
  // dot(g, y_e0) = 1*3 + 2*4 = 11; dot(g, y_e1) = 1*5 + 2*6 = 17.
  EXPECT_EQ(g->grad_probs[0], (std::vector<float>{11, 17}));

  // Unweighted: rows get g itself, grad_probs is 0, expert outputs are not needed.
  p.weighted_combine = false;
  g = reference_combine_backward(p, views_of(grad_out), {});
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_EQ(row_values(g->grad_expert_output[0], 0), (std::vector<float>{1, 2}));
  EXPECT_EQ(row_values(g->grad_expert_output[0], 1), (std::vector<float>{1, 2}));
  EXPECT_EQ(g->grad_probs[0], (std::vector<float>{0, 0}));
}

TEST(ReferenceCombineBackward, EtpRowsOnEveryRankAndDotWithThePartialSum) {
  EtpCase c;
  c.p.weighted_combine = true;
  std::vector<Tensor> grad_out, y;
  grad_out.push_back(rows_f32({{1, 2}, {3, 4}}));
  grad_out.push_back(Tensor::zeros(DType::kF32, 0, 2));
  y.push_back(rows_f32({{1, 1}, {2, 2}}));
  y.push_back(rows_f32({{3, 5}, {4, 8}}));
  auto g = reference_combine_backward(c.p, views_of(grad_out), views_of(y));
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(row_values(g->grad_expert_output[size_t(r)], 0), (std::vector<float>{0.5f, 1}));
    EXPECT_EQ(row_values(g->grad_expert_output[size_t(r)], 1), (std::vector<float>{0.25f, 0.5f}));
  }
  // term_e0 = (1 + 3, 1 + 5) = (4, 6): 1*4 + 2*6 = 16; term_e1 = (6, 10): 6 + 20 = 26.
  EXPECT_EQ(c.p.routing[0].num_tokens, 2);
  EXPECT_EQ(g->grad_probs[0], (std::vector<float>{16, 26, 0, 0}));
  EXPECT_TRUE(g->grad_probs[1].empty());
}

TEST(ReferenceCombineBackward, Bf16RowsAreRoundedProducts) {
  // prob 1/3 (f32) * 1.0 = 0.3333333433 -> bf16 0x3eab; unweighted copies the bits.
  std::vector<Tensor> xs;
  xs.push_back(named_hidden(0, 1, 1));
  ReferenceProblem p = make_problem(1, 1, 1, {make_map({{1}}, {{1.0f / 3.0f}})}, xs);
  p.weighted_combine = true;
  Tensor g = Tensor::zeros(DType::kBF16, 1, 1);
  g.row<bf16>(0)[0] = float_to_bf16(1.0f);
  Tensor y = Tensor::zeros(DType::kBF16, 1, 1);
  y.row<bf16>(0)[0] = float_to_bf16(3.0f);
  auto r = reference_combine_backward(p, {g.view()}, {y.view()});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r->grad_expert_output[0].dtype(), DType::kBF16);
  EXPECT_EQ(r->grad_expert_output[0].row<bf16>(0)[0].bits, 0x3eab);
  EXPECT_EQ(r->grad_probs[0], (std::vector<float>{3.0f}));
}

TEST(ReferenceCombineBackward, PaddingRowsGetZero) {
  std::vector<Tensor> xs;
  xs.push_back(named_hidden(0, 1, 1));
  ReferenceProblem p = make_problem(2, 1, 1, {make_map({{0, 1}}, {{0, 0.5f}})}, xs);
  p.layout.expert_alignment = 2;
  std::vector<Tensor> grad_out;
  grad_out.push_back(rows_f32({{-7}}));
  auto g = reference_combine_backward(p, views_of(grad_out), {});
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  // Segments: e0 empty (0 rows), e1 = t0 + one padding row.
  ASSERT_EQ(g->grad_expert_output[0].rows(), 2);
  EXPECT_EQ(row_values(g->grad_expert_output[0], 0), (std::vector<float>{-7}));
  EXPECT_EQ(testing::bits_of(g->grad_expert_output[0].row<float>(1)[0]), 0u);
}

}  // namespace
}  // namespace moed::testing
