// The sparse routing form (moed/routing.h): conversions from every other form, validation,
// and the dispatch layout counted on it.
#include <gtest/gtest.h>

#include <random>

#include "moed/dispatch_layout.h"
#include "moed/routing.h"

namespace moed {
namespace {

TEST(SparseRouting, FromTopkSortsEachTokensExpertsAndSkipsUnused) {
  // int64 indices, as DeepEP's topk_idx_t; token 1 routes nowhere.
  const std::vector<int64_t> idx = {5, 2, -1, -1, -1, -1, 0, 7, 3};
  const std::vector<float> w = {0.5f, 0.25f, 0.9f, 0.1f, 0.2f, 0.3f, 0.4f, 0.6f, 0.7f};
  const TopkView v{idx.data(), true, w.data(), 3, 3};
  ASSERT_TRUE(validate(v, 8).ok());
  const SparseRouting s = to_sparse(v, 8);
  ASSERT_TRUE(validate(s, 8).ok());
  EXPECT_EQ(s.num_tokens(), 3);
  EXPECT_EQ(s.num_topk, 3);
  EXPECT_EQ(s.begin, (std::vector<int64_t>{0, 2, 2, 5}));
  EXPECT_EQ(s.expert, (std::vector<int32_t>{2, 5, 0, 3, 7}));
  EXPECT_EQ(s.prob, (std::vector<float>{0.25f, 0.5f, 0.4f, 0.7f, 0.6f}));
  // Each entry's column in the top-k form (DeepEP's slot), sorted along with its expert.
  EXPECT_EQ(s.slot, (std::vector<int32_t>{1, 0, 0, 2, 1}));
  EXPECT_EQ(s.tokens_per_expert(), (std::vector<int64_t>{1, 0, 1, 1, 0, 1, 0, 1}));
  EXPECT_EQ(s.prob_sums(), (std::vector<float>{0.25f + 0.5f, 0.0f, 0.4f + 0.7f + 0.6f}));
}

TEST(SparseRouting, EveryFormAgrees) {
  std::mt19937 rng(7);
  for (int E : {1, 5, 16}) {
    for (int K : {1, 2, E}) {
      if (K > E) continue;
      TopkRouting r;
      r.num_tokens = 37;
      r.num_topk = K;
      std::vector<int32_t> perm(size_t(E), 0);
      for (int64_t t = 0; t < r.num_tokens; ++t) {
        for (int e = 0; e < E; ++e) perm[size_t(e)] = e;
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int k = 0; k < K; ++k) {
          r.topk_idx.push_back(t % 5 == 0 && k == 0 ? -1 : perm[size_t(k)]);
          r.topk_weights.push_back(float(rng() % 8) / 8.0f);
        }
      }
      ASSERT_TRUE(validate(r, E).ok());
      const RoutingMap map = to_map(r, E);
      const SparseRouting from_topk = to_sparse(TopkView::of(r), E);
      const SparseRouting from_map = to_sparse(map);
      EXPECT_EQ(from_topk.begin, from_map.begin);
      EXPECT_EQ(from_topk.expert, from_map.expert);
      EXPECT_EQ(from_topk.prob, from_map.prob);
      EXPECT_EQ(to_map(from_topk).routing_map, map.routing_map);
      EXPECT_EQ(to_map(from_topk).probs, map.probs);
      StatusOr<TopkRouting> back = to_topk(from_topk, K);
      ASSERT_TRUE(back.ok());
      EXPECT_EQ(to_map(*back, E).routing_map, map.routing_map);
      // The dispatch layout counted on the sparse form equals the map's.
      StatusOr<DispatchLayout> a = get_dispatch_layout(r, E, E, 1);
      StatusOr<DispatchLayout> b = get_dispatch_layout(map, E, 1);
      StatusOr<DispatchLayout> c = get_dispatch_layout(TopkView::of(r), E, E, 1);
      ASSERT_TRUE(a.ok() && b.ok() && c.ok());
      EXPECT_EQ(a->num_tokens_per_rank, b->num_tokens_per_rank);
      EXPECT_EQ(a->num_tokens_per_expert, c->num_tokens_per_expert);
      EXPECT_EQ(a->is_token_in_rank, c->is_token_in_rank);
    }
  }
}

TEST(SparseRouting, ValidateNamesTheProblem) {
  SparseRouting s;
  s.num_experts = 4;
  s.begin = {0, 2};
  s.expert = {3, 1};
  s.prob = {0.5f, 0.5f};
  Status st = validate(s, 4);
  EXPECT_EQ(st.message(), "token 0's experts are not strictly ascending (3 then 1)");
  s.expert = {1, 4};
  EXPECT_EQ(validate(s, 4).message(), "token 0 routes to expert 4, outside [0, 4)");
  s.expert = {1, 2};
  s.prob = {0.5f, -1.0f};
  EXPECT_EQ(validate(s, 4).message(), "prob of token 0 at expert 2 = -1 is not a valid prob");
  s.prob = {0.5f};
  EXPECT_EQ(validate(s, 4).message(),
            "sparse routing has 2 experts and 1 probs; begin says 2 entries");
  EXPECT_EQ(validate(SparseRouting{}, 3).message(),
            "sparse routing has num_experts = 0, expected 3");
}

TEST(SparseRouting, PaddingCanWidenATokenPastK) {
  // 3 tokens, E = 2, K = 1. All on expert 0: padding to a multiple finds no unrouted token
  // for expert 0 and expert 1 has 0 (a multiple), so nothing changes.
  SparseRouting s;
  s.num_experts = 2;
  s.num_topk = 1;
  s.begin = {0, 1, 2, 3};
  s.expert = {0, 0, 0};
  s.prob = {1.0f, 1.0f, 1.0f};
  LayoutOptions o;
  o.router_padding_multiple = 4;
  StatusOr<SparseRouting> got = apply_layout_options(s, o);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(got->begin, s.begin);
  EXPECT_EQ(got->expert, s.expert);
  // Tokens 0 / 1, 2 on experts 0 / 1: expert 0 is padded with tokens 1 and 2, expert 1 with
  // token 0 (prob 0; there are not enough tokens to reach 4), so every token has 2 > K.
  s.expert = {0, 1, 1};
  got = apply_layout_options(s, o);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->begin, (std::vector<int64_t>{0, 2, 4, 6}));
  EXPECT_EQ(got->expert, (std::vector<int32_t>{0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(got->prob, (std::vector<float>{1.0f, 0.0f, 0.0f, 1.0f, 0.0f, 1.0f}));
}

}  // namespace
}  // namespace moed
