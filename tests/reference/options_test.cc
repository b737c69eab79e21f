// Layout options on hand-computed cases: capacity dropping (both policies, ties, the ceil),
// pad_to_capacity, expert_alignment, router padding, and dropping followed by router padding.
#include <gtest/gtest.h>

#include "moed/reference.h"
#include "reference/reference_test_util.h"

namespace moed::testing {
namespace {

std::vector<int> routed_column(const RoutingMap& m, int e) {
  std::vector<int> out;
  for (int64_t t = 0; t < m.num_tokens; ++t) out.push_back(m.routed(t, e) ? 1 : 0);
  return out;
}
std::vector<float> prob_column(const RoutingMap& m, int e) {
  std::vector<float> out;
  for (int64_t t = 0; t < m.num_tokens; ++t) out.push_back(m.prob(t, e));
  return out;
}

// probs[t] on expert 0, nothing on expert 1.
std::vector<std::vector<float>> on_expert_0(const std::vector<float>& probs) {
  std::vector<std::vector<float>> out;
  for (float v : probs) out.push_back({v, 0.0f});
  return out;
}

// One rank, 4 tokens, 2 experts, K = 1, every token on expert 0: C = ceil(4 * 1 / 2 * 1) = 2.
struct DropCase : HeldProblem {
  DropCase(const std::vector<float>& probs0, DropPolicy policy)
      : HeldProblem(2, 1, 1, {make_map({{1, 0}, {1, 0}, {1, 0}, {1, 0}}, on_expert_0(probs0))},
                    /*hidden=*/1) {
    p.num_topk = 1;
    p.layout.capacity_factor = 1.0;
    p.layout.drop_policy = policy;
  }
};

// Expert e's column in rank 0's effective routing of p: which tokens are routed, and their probs.
void expect_column(const ReferenceProblem& p, int e, const std::vector<int>& routed,
                   const std::vector<float>& probs) {
  auto eff = reference_effective_routing(p);
  ASSERT_TRUE(eff.ok()) << eff.status().to_string();
  EXPECT_EQ(routed_column((*eff)[0], e), routed);
  EXPECT_EQ(prob_column((*eff)[0], e), probs);
}

TEST(ReferenceOptions, CapacityProbsKeepsHighestProbs) {
  DropCase c({0.1f, 0.2f, 0.9f, 0.8f}, DropPolicy::kProbs);
  expect_column(c.p, 0, {0, 0, 1, 1}, {0, 0, 0.9f, 0.8f});
  auto d = reference_dispatch(c.p);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  // Kept rows stay in token order, not prob order.
  EXPECT_EQ((*d)[0].row_src_token, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ((*d)[0].permuted_probs, (std::vector<float>{0.9f, 0.8f}));
  EXPECT_EQ((*d)[0].tokens_per_expert, (std::vector<int64_t>{2, 0}));
}

TEST(ReferenceOptions, CapacityProbsTiesGoToLowerToken) {
  DropCase c({0.5f, 0.9f, 0.5f, 0.5f}, DropPolicy::kProbs);
  auto eff = reference_effective_routing(c.p);
  ASSERT_TRUE(eff.ok()) << eff.status().to_string();
  EXPECT_EQ(routed_column((*eff)[0], 0), (std::vector<int>{1, 1, 0, 0}));
}

TEST(ReferenceOptions, CapacityPositionKeepsLowestTokens) {
  DropCase c({0.1f, 0.2f, 0.9f, 0.8f}, DropPolicy::kPosition);
  expect_column(c.p, 0, {1, 1, 0, 0}, {0.1f, 0.2f, 0, 0});
}

TEST(ReferenceOptions, CapacityRoundsUpAndUsesTheMapsTopkWhenTheProblemHasNone) {
  // T = 3, K = 1, E = 2, cf = 1: 1.5 -> C = 2. K comes from the map (p.num_topk = 0).
  RoutingMap m = make_map({{1, 0}, {1, 0}, {1, 0}}, {{0.3f, 0}, {0.2f, 0}, {0.1f, 0}});
  m.num_topk = 1;
  std::vector<Tensor> xs;
  xs.push_back(named_hidden(0, 3, 1));
  ReferenceProblem p = make_problem(2, 1, 1, {m}, xs);
  p.layout.capacity_factor = 1.0;
  auto eff = reference_effective_routing(p);
  ASSERT_TRUE(eff.ok()) << eff.status().to_string();
  EXPECT_EQ(routed_column((*eff)[0], 0), (std::vector<int>{1, 1, 0}));
  // cf = 0.5: 0.75 -> C = 1.
  p.layout.capacity_factor = 0.5;
  eff = reference_effective_routing(p);
  ASSERT_TRUE(eff.ok()) << eff.status().to_string();
  EXPECT_EQ(routed_column((*eff)[0], 0), (std::vector<int>{1, 0, 0}));
}

TEST(ReferenceOptions, PadToCapacityPerSourceRank) {
  // EP = 2, E = 2, K = 1. Rank 0: T = 3, C0 = ceil(1.5) = 2; rank 1: T = 1, C1 = ceil(0.5) = 1.
  std::vector<RoutingMap> maps = {make_map({{1, 0}, {1, 0}, {0, 1}}), make_map({{1, 0}})};
  std::vector<Tensor> xs;
  xs.push_back(named_hidden(0, 3, 2));
  xs.push_back(named_hidden(1, 1, 2));
  ReferenceProblem p = make_problem(2, 2, 1, maps, xs);
  p.num_topk = 1;
  p.layout.capacity_factor = 1.0;
  p.layout.pad_to_capacity = true;
  auto d = reference_dispatch(p);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  // Expert 0: chunk (0) = t0, t1 (full); chunk (1) = t0 (full).
  EXPECT_EQ((*d)[0].row_src_rank, (std::vector<int32_t>{0, 0, 1}));
  EXPECT_EQ((*d)[0].row_src_token, (std::vector<int32_t>{0, 1, 0}));
  EXPECT_EQ((*d)[0].tokens_per_expert, (std::vector<int64_t>{3}));
  EXPECT_EQ((*d)[0].tokens_per_expert_unpadded, (std::vector<int64_t>{3}));
  // Expert 1: chunk (0) = t2 + one padding row; chunk (1) = one padding row.
  EXPECT_EQ((*d)[1].row_src_rank, (std::vector<int32_t>{0, -1, -1}));
  EXPECT_EQ((*d)[1].row_src_token, (std::vector<int32_t>{2, -1, -1}));
  EXPECT_EQ((*d)[1].tokens_per_expert, (std::vector<int64_t>{3}));
  EXPECT_EQ((*d)[1].tokens_per_expert_unpadded, (std::vector<int64_t>{1}));
  EXPECT_EQ((*d)[1].permuted_probs, (std::vector<float>{1, 0, 0}));
  EXPECT_EQ(row_values((*d)[1].expert_input.x, 0), (std::vector<float>{20, 21}));
  EXPECT_EQ(row_values((*d)[1].expert_input.x, 1), (std::vector<float>{0, 0}));
  EXPECT_EQ(row_values((*d)[1].expert_input.x, 2), (std::vector<float>{0, 0}));
}

TEST(ReferenceOptions, PadToCapacityAfterDroppingThenAlignment) {
  // One rank, T = 4, K = 1, E = 2, cf = 1 -> C = 2; expert 0 has 3 tokens, drops t1 (lowest
  // prob); expert 1 has 1 token and one padding row; alignment 3 pads each segment to 3.
  std::vector<Tensor> xs;
  xs.push_back(named_hidden(0, 4, 1));
  ReferenceProblem p = make_problem(
      2, 1, 1,
      {make_map({{1, 0}, {1, 0}, {1, 0}, {0, 1}}, {{0.5f, 0}, {0.25f, 0}, {0.75f, 0}, {0, 1}})},
      xs);
  p.num_topk = 1;
  p.layout.capacity_factor = 1.0;
  p.layout.pad_to_capacity = true;
  p.layout.expert_alignment = 3;
  auto d = reference_dispatch(p);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ((*d)[0].row_src_token, (std::vector<int32_t>{0, 2, -1, 3, -1, -1}));
  EXPECT_EQ((*d)[0].tokens_per_expert, (std::vector<int64_t>{3, 3}));
  EXPECT_EQ((*d)[0].tokens_per_expert_unpadded, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ((*d)[0].permuted_probs, (std::vector<float>{0.5f, 0.75f, 0, 1, 0, 0}));
}

// One rank, E = 3, H = 1, four tokens: t0 -> {e0, e1}, t1 -> {e1, e2}, t2 -> {e0, e2},
// t3 -> {e1}.
struct FourTokens : HeldProblem {
  FourTokens()
      : HeldProblem(3, 1, 1, {make_map({{1, 1, 0}, {0, 1, 1}, {1, 0, 1}, {0, 1, 0}})},
                    /*hidden=*/1) {}
};

TEST(ReferenceOptions, ExpertAlignmentPadsEachSegmentAtItsEnd) {
  FourTokens f;
  ReferenceProblem& p = f.p;
  p.layout.expert_alignment = 4;
  auto d = reference_dispatch(p);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  const ReferenceRankDispatch& r = (*d)[0];
  EXPECT_EQ(r.tokens_per_expert, (std::vector<int64_t>{4, 4, 4}));
  EXPECT_EQ(r.tokens_per_expert_unpadded, (std::vector<int64_t>{2, 3, 2}));
  EXPECT_EQ(r.row_src_token, (std::vector<int32_t>{0, 2, -1, -1, 0, 1, 3, -1, 1, 2, -1, -1}));
  EXPECT_EQ(r.row_src_rank, (std::vector<int32_t>{0, 0, -1, -1, 0, 0, 0, -1, 0, 0, -1, -1}));
  EXPECT_EQ(r.permuted_probs, (std::vector<float>{1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 0, 0}));
  for (int i : {2, 3, 7, 10, 11}) {
    EXPECT_EQ(row_values(r.expert_input.x, i), (std::vector<float>{0})) << i;
  }
  // Alignment 1 and an already aligned segment add nothing.
  p.layout.expert_alignment = 1;
  EXPECT_EQ((*reference_dispatch(p))[0].tokens_per_expert, (std::vector<int64_t>{2, 3, 2}));
}

TEST(ReferenceOptions, RouterPaddingRoutesLowestUnroutedTokensWithProbZero) {
  FourTokens f;
  ReferenceProblem& p = f.p;
  p.layout.router_padding_multiple = 2;
  // Expert 1 had 3 (t0, t1, t3): t2 joins with prob 0. Experts 0 and 2 had 2.
  expect_column(p, 1, {1, 1, 1, 1}, {1, 1, 0, 1});
  auto eff = reference_effective_routing(p);
  ASSERT_TRUE(eff.ok()) << eff.status().to_string();
  EXPECT_EQ(routed_column((*eff)[0], 0), (std::vector<int>{1, 0, 1, 0}));
  auto d = reference_dispatch(p);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ((*d)[0].row_src_token, (std::vector<int32_t>{0, 2, 0, 1, 2, 3, 1, 2}));
  EXPECT_EQ((*d)[0].tokens_per_expert, (std::vector<int64_t>{2, 4, 2}));
  // Router-padded rows are real token rows: they count as unpadded and carry the payload.
  EXPECT_EQ((*d)[0].tokens_per_expert_unpadded, (std::vector<int64_t>{2, 4, 2}));
  EXPECT_EQ((*d)[0].permuted_probs, (std::vector<float>{1, 1, 1, 1, 0, 1, 1, 1}));
  EXPECT_EQ(row_values((*d)[0].expert_input.x, 4), (std::vector<float>{20}));

  // Multiple 3: expert 0 gains t1, expert 2 gains t0.
  p.layout.router_padding_multiple = 3;
  eff = reference_effective_routing(p);
  ASSERT_TRUE(eff.ok());
  EXPECT_EQ(routed_column((*eff)[0], 0), (std::vector<int>{1, 1, 1, 0}));
  EXPECT_EQ(routed_column((*eff)[0], 1), (std::vector<int>{1, 1, 0, 1}));
  EXPECT_EQ(routed_column((*eff)[0], 2), (std::vector<int>{1, 1, 1, 0}));

  // Multiple 8 with 4 tokens: every token ends up routed, the count stays 4.
  p.layout.router_padding_multiple = 8;
  eff = reference_effective_routing(p);
  ASSERT_TRUE(eff.ok());
  for (int e = 0; e < 3; ++e)
    EXPECT_EQ(routed_column((*eff)[0], e), (std::vector<int>{1, 1, 1, 1}));
}

TEST(ReferenceOptions, DroppedTokensMayComeBackAsRouterPadding) {
  // Drop first (C = 2 keeps t2, t3 by prob), then pad expert 0 to a multiple of 3: the
  // lowest unrouted token, t0 (just dropped), is routed again with prob 0.
  DropCase c({0.1f, 0.2f, 0.9f, 0.8f}, DropPolicy::kProbs);
  c.p.layout.router_padding_multiple = 3;
  auto eff = reference_effective_routing(c.p);
  ASSERT_TRUE(eff.ok()) << eff.status().to_string();
  EXPECT_EQ(routed_column((*eff)[0], 0), (std::vector<int>{1, 0, 1, 1}));
  EXPECT_EQ(prob_column((*eff)[0], 0), (std::vector<float>{0, 0, 0.9f, 0.8f}));
  // Expert 1: 0 routed tokens, already a multiple of 3.
  EXPECT_EQ(routed_column((*eff)[0], 1), (std::vector<int>{0, 0, 0, 0}));
}

TEST(ReferenceOptions, UnroutedProbsAreZeroInTheEffectiveRouting) {
  std::vector<Tensor> xs;
  xs.push_back(named_hidden(0, 1, 1));
  ReferenceProblem p = make_problem(2, 1, 1, {make_map({{1, 0}}, {{0.75f, 0.25f}})}, xs);
  auto eff = reference_effective_routing(p);
  ASSERT_TRUE(eff.ok());
  EXPECT_EQ((*eff)[0].probs, (std::vector<float>{0.75f, 0.0f}));
}

}  // namespace
}  // namespace moed::testing
