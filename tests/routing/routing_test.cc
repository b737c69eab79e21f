// Validation and conversion of the two routing forms (design.md §2.2-§2.3).
#include "moed/routing.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "routing/routing_test_util.h"

namespace moed {
namespace {

using routing_test::expect_invalid;

TopkRouting make_topk(int64_t num_tokens, int num_topk, std::vector<int32_t> idx,
                      std::vector<float> weights) {
  TopkRouting r;
  r.num_tokens = num_tokens;
  r.num_topk = num_topk;
  r.topk_idx = std::move(idx);
  r.topk_weights = std::move(weights);
  return r;
}

TEST(ValidateTopk, AcceptsValidRoutingWithUnusedSlots) {
  TopkRouting r = make_topk(2, 2, {0, 3, -1, 2}, {0.5f, 0.5f, std::nanf(""), 1.0f});
  EXPECT_TRUE(validate(r, 4).ok());  // the weight of a -1 slot is ignored
  EXPECT_TRUE(validate(make_topk(0, 8, {}, {}), 4).ok());
}

TEST(ValidateTopk, NamesTheOffendingValue) {
  std::vector<int32_t> idx(18 * 4, 0);
  std::vector<float> w(18 * 4, 0.25f);
  for (int t = 0; t < 18; ++t)
    for (int k = 0; k < 4; ++k) idx[t * 4 + k] = k;
  idx[17 * 4 + 3] = 300;
  expect_invalid(validate(make_topk(18, 4, idx, w), 256),
                 "topk_idx[17][3] = 300 is outside [-1, 256)");
  idx[17 * 4 + 3] = -2;
  expect_invalid(validate(make_topk(18, 4, idx, w), 256),
                 "topk_idx[17][3] = -2 is outside [-1, 256)");
  idx[17 * 4 + 3] = 3;

  idx[4 * 4 + 0] = 7;
  idx[4 * 4 + 2] = 7;
  expect_invalid(validate(make_topk(18, 4, idx, w), 256),
                 "topk_idx[4] repeats expert 7 (at k = 0 and k = 2)");
  idx[4 * 4 + 0] = 0;
  idx[4 * 4 + 2] = 2;

  w[2 * 4 + 1] = std::nanf("");
  expect_invalid(validate(make_topk(18, 4, idx, w), 256),
                 "topk_weights[2][1] = nan is not a valid prob");
  w[2 * 4 + 1] = -0.5f;
  expect_invalid(validate(make_topk(18, 4, idx, w), 256),
                 "topk_weights[2][1] = -0.5 is not a valid prob");
  w[2 * 4 + 1] = std::numeric_limits<float>::infinity();
  expect_invalid(validate(make_topk(18, 4, idx, w), 256),
                 "topk_weights[2][1] = inf is not a valid prob");
  w[2 * 4 + 1] = -0.0f;
  EXPECT_TRUE(validate(make_topk(18, 4, idx, w), 256).ok());
}

// Repeats are looked for two ways (a scan of the token's earlier picks for small K, one stamp
// per expert past that); both name the same two picks.
TEST(ValidateTopk, RepeatsNamedAlikeForEveryK) {
  for (int K : {2, 16, 17, 40}) {
    std::vector<int32_t> idx(size_t(3) * K);
    for (int t = 0; t < 3; ++t)
      for (int k = 0; k < K; ++k) idx[size_t(t) * K + k] = (k + t) % 64;
    idx[size_t(2) * K + K - 1] = idx[size_t(2) * K];
    expect_invalid(validate(make_topk(3, K, idx, std::vector<float>(idx.size(), 1.0f)), 64),
                   "topk_idx[2] repeats expert 2 (at k = 0 and k = " + std::to_string(K - 1) + ")");
  }
}

TEST(ValidateTopk, SizesThatDisagree) {
  expect_invalid(validate(make_topk(4, 3, std::vector<int32_t>(10, 0), std::vector<float>(12)), 8),
                 "topk_idx has 10 entries, expected num_tokens * num_topk = 4 * 3 = 12");
  expect_invalid(validate(make_topk(4, 3, std::vector<int32_t>(12, -1), std::vector<float>(11)), 8),
                 "topk_weights has 11 entries, expected num_tokens * num_topk = 4 * 3 = 12");
  expect_invalid(validate(make_topk(-1, 3, {}, {}), 8), "num_tokens = -1 must be >= 0");
  expect_invalid(validate(make_topk(1, -3, {}, {}), 8), "num_topk = -3 must be >= 0");
  expect_invalid(validate(make_topk(0, 3, {}, {}), 0), "num_experts = 0 must be >= 1");
}

TEST(ValidateMap, NamesTheOffendingValue) {
  RoutingMap m = RoutingMap::empty(3, 4);
  EXPECT_EQ(m.routing_map.size(), 12u);
  EXPECT_TRUE(validate(m, 4).ok());
  expect_invalid(validate(m, 8), "routing map has num_experts = 4, expected 8");
  m.probs[2 * 4 + 1] = -1.0f;  // not routed: ignored
  EXPECT_TRUE(validate(m, 4).ok());
  m.routing_map[2 * 4 + 1] = 1;
  expect_invalid(validate(m, 4), "probs[2][1] = -1 is not a valid prob");
  m.probs[2 * 4 + 1] = std::nanf("");
  expect_invalid(validate(m, 4), "probs[2][1] = nan is not a valid prob");
  m.probs[2 * 4 + 1] = 0.5f;
  m.routing_map[1 * 4 + 3] = 7;
  expect_invalid(validate(m, 4), "routing_map[1][3] = 7 is not 0 or 1");
  m.routing_map[1 * 4 + 3] = 0;
  m.probs.pop_back();
  expect_invalid(validate(m, 4),
                 "probs has 11 entries, expected num_tokens * num_experts = 3 * 4 = 12");
  m.routing_map.push_back(0);
  expect_invalid(validate(m, 4),
                 "routing_map has 13 entries, expected num_tokens * num_experts = 3 * 4 = 12");
}

// The map is scanned a word (8 cells) at a time: a width of 21 has two whole words and a
// tail of 5, and every cell position must be found, in order, by the view and the owned form.
TEST(ValidateMap, ViewScansEveryCellInOrder) {
  const int64_t T = 9;
  const int E = 21;
  std::mt19937 rng(5);
  RoutingMap m = RoutingMap::empty(T, E);
  m.num_topk = 3;
  for (size_t i = 0; i < m.routing_map.size(); ++i) {
    m.routing_map[i] = rng() % 4 == 0;
    m.probs[i] = m.routing_map[i] ? float(rng() % 100) / 100.0f : -1.0f;  // unrouted: ignored
  }
  for (int e = 0; e < E; ++e)
    m.routing_map[size_t(4 * E + e)] = 1, m.probs[size_t(4 * E + e)] = 0.5f;
  for (int e = 0; e < E; ++e) m.routing_map[size_t(5 * E + e)] = 0;  // a token with none
  const MapView v = MapView::of(m);
  EXPECT_TRUE(validate(v, E).ok());
  SparseRouting s = to_sparse(v);
  EXPECT_EQ(s.num_topk, 3);
  size_t n = 0;
  for (int64_t t = 0; t < T; ++t) {
    ASSERT_EQ(s.begin[size_t(t)], int64_t(n));
    for (int e = 0; e < E; ++e) {
      if (!m.routed(t, e)) continue;
      ASSERT_LT(n, s.expert.size());
      EXPECT_EQ(s.expert[n], e);
      EXPECT_EQ(s.prob[n], m.prob(t, e));
      ++n;
    }
  }
  EXPECT_EQ(s.num_entries(), int64_t(n));
  // Offending cells in a word, in the tail, and two at once (the first in row-major order).
  for (int e : {0, 7, 8, 15, 16, 20}) {
    RoutingMap bad = m;
    bad.routing_map[size_t(6 * E + e)] = 1;
    bad.probs[size_t(6 * E + e)] = std::nanf("");
    bad.routing_map[size_t(7 * E + 2)] = 9;
    expect_invalid(validate(MapView::of(bad), E),
                   "probs[6][" + std::to_string(e) + "] = nan is not a valid prob");
    bad.routing_map[size_t(6 * E + e)] = 0;
    expect_invalid(validate(bad, E), "routing_map[7][2] = 9 is not 0 or 1");
  }
  // A bad byte before a bad prob in the same row: the byte is named (cells in row-major order).
  RoutingMap bad = m;
  bad.routing_map[size_t(6 * E + 3)] = 2;
  bad.routing_map[size_t(6 * E + 17)] = 1;
  bad.probs[size_t(6 * E + 17)] = -2.0f;
  expect_invalid(validate(MapView::of(bad), E), "routing_map[6][3] = 2 is not 0 or 1");
}

TEST(Convert, SeedExampleRoundTrips) {
  // The seed's map [[1,1,0],[0,1,1],[1,0,1],[0,1,0]] with one slot left unused on token 3.
  TopkRouting topk = make_topk(4, 2, {1, 0, 2, 1, 0, 2, -1, 1},
                               {0.25f, 0.75f, 0.5f, 0.5f, 0.125f, 0.875f, 0.0f, 1.0f});
  ASSERT_TRUE(validate(topk, 3).ok());
  RoutingMap map = to_map(topk, 3);
  EXPECT_EQ(map.num_topk, 2);
  EXPECT_EQ(map.routing_map, (std::vector<uint8_t>{1, 1, 0, 0, 1, 1, 1, 0, 1, 0, 1, 0}));
  EXPECT_EQ(map.probs,
            (std::vector<float>{0.75f, 0.25f, 0, 0, 0.5f, 0.5f, 0.125f, 0, 0.875f, 0, 1.0f, 0}));
  StatusOr<TopkRouting> back = to_topk(map);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->num_topk, 2);
  // Experts in ascending id, unused slots -1 with weight 0.
  EXPECT_EQ(back->topk_idx, (std::vector<int32_t>{0, 1, 1, 2, 0, 2, 1, -1}));
  EXPECT_EQ(back->topk_weights,
            (std::vector<float>{0.75f, 0.25f, 0.5f, 0.5f, 0.125f, 0.875f, 1.0f, 0.0f}));

  StatusOr<TopkRouting> wide = to_topk(map, 3);
  ASSERT_TRUE(wide.ok());
  EXPECT_EQ(wide->num_topk, 3);
  EXPECT_EQ(wide->topk_idx, (std::vector<int32_t>{0, 1, -1, 1, 2, -1, 0, 2, -1, 1, -1, -1}));
  expect_invalid(to_topk(map, 1).status(), "token 0 routes to 2 experts, more than num_topk = 1");
  expect_invalid(to_topk(map, -1).status(), "num_topk = -1 must be >= 0");
}

TEST(Convert, RandomRoundTripIsExact) {
  std::mt19937 rng(7);
  for (int num_experts : {1, 5, 16}) {
    for (int num_topk : {1, 3, 16}) {
      if (num_topk > num_experts) continue;
      const int64_t num_tokens = 37;
      TopkRouting topk = make_topk(num_tokens, num_topk, {}, {});
      std::vector<int32_t> perm(num_experts);
      for (int64_t t = 0; t < num_tokens; ++t) {
        for (int e = 0; e < num_experts; ++e) perm[e] = e;
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int k = 0; k < num_topk; ++k) {
          topk.topk_idx.push_back(rng() % 5 == 0 ? -1 : perm[k]);
          topk.topk_weights.push_back(float(rng() % 1000) / 1000.0f);
        }
      }
      ASSERT_TRUE(validate(topk, num_experts).ok());
      RoutingMap map = to_map(topk, num_experts);
      ASSERT_TRUE(validate(map, num_experts).ok());
      StatusOr<TopkRouting> back = to_topk(map, num_topk);
      ASSERT_TRUE(back.ok());
      RoutingMap again = to_map(*back, num_experts);
      EXPECT_EQ(again.routing_map, map.routing_map);
      EXPECT_EQ(again.probs, map.probs);
    }
  }
}

TEST(DropPolicy, NamesAndParsing) {
  EXPECT_STREQ(drop_policy_name(DropPolicy::kProbs), "probs");
  EXPECT_STREQ(drop_policy_name(DropPolicy::kPosition), "position");
  EXPECT_EQ(*parse_drop_policy("probs"), DropPolicy::kProbs);
  EXPECT_EQ(*parse_drop_policy("position"), DropPolicy::kPosition);
  expect_invalid(parse_drop_policy("random").status(),
                 "drop policy 'random' is not one of: probs, position");
}

}  // namespace
}  // namespace moed
