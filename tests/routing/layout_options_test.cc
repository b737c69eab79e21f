// Layout options (design.md §3.2): validation, the capacity formula, and apply_layout_options
// against a brute-force version written from design.md §3.2-§3.3 (sort each expert's tokens, keep
// a prefix, then pad with the lowest unrouted tokens).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "moed/routing.h"
#include "moed/thread_pool.h"
#include "routing/routing_test_util.h"

namespace moed {
namespace {

using routing_test::expect_invalid;

TEST(LayoutOptions, Validate) {
  LayoutOptions o;
  EXPECT_TRUE(o.validate().ok());
  o.capacity_factor = -0.5;
  expect_invalid(o.validate(), "capacity_factor = -0.5 must be > 0");
  o.capacity_factor = 0.0;
  expect_invalid(o.validate(), "capacity_factor = 0 must be > 0");
  o.capacity_factor = std::nan("");
  expect_invalid(o.validate(), "capacity_factor = nan must be > 0");
  o.capacity_factor = INFINITY;
  expect_invalid(o.validate(), "capacity_factor = inf must be finite");
  o.capacity_factor = 1.5;
  EXPECT_TRUE(o.validate().ok());
  o.expert_alignment = 0;
  expect_invalid(o.validate(), "expert_alignment = 0 must be >= 1");
  o.expert_alignment = 16;
  o.router_padding_multiple = -1;
  expect_invalid(o.validate(), "router_padding_multiple = -1 must be >= 0");
  o.router_padding_multiple = 8;
  EXPECT_TRUE(o.validate().ok());
  o.pad_to_capacity = true;
  expect_invalid(o.validate(),
                 "pad_to_capacity cannot be combined with router_padding_multiple = 8");
  o.router_padding_multiple = 0;
  EXPECT_TRUE(o.validate().ok());
  o.capacity_factor.reset();
  expect_invalid(o.validate(), "pad_to_capacity needs capacity_factor");
}

TEST(LayoutOptions, ExpertCapacity) {
  EXPECT_EQ(expert_capacity(4, 2, 3, 1.0), 3);    // ceil(8/3)
  EXPECT_EQ(expert_capacity(64, 2, 8, 1.0), 16);  // exact
  EXPECT_EQ(expert_capacity(64, 2, 8, 1.01), 17);
  EXPECT_EQ(expert_capacity(0, 8, 256, 2.0), 0);
  EXPECT_EQ(expert_capacity(10, 1, 4, 0.1), 1);
  // Evaluated exactly as design.md §3.2's formula, in double.
  EXPECT_EQ(expert_capacity(4096, 8, 256, 1.1),
            int64_t(std::ceil(double(4096) * double(8) / double(256) * 1.1)));
}

// The effective routing (design.md §3.3), written the slow, obvious way.
RoutingMap brute_force(const RoutingMap& in, int num_topk, const LayoutOptions& o) {
  RoutingMap out = in;
  const int64_t T = in.num_tokens;
  for (int e = 0; e < in.num_experts; ++e) {
    if (o.capacity_factor) {
      const int64_t cap = int64_t(
          std::ceil(double(T) * double(num_topk) / double(in.num_experts) * *o.capacity_factor));
      std::vector<int64_t> tokens;
      for (int64_t t = 0; t < T; ++t)
        if (in.routed(t, e)) tokens.push_back(t);
      if (o.drop_policy == DropPolicy::kProbs) {
        std::stable_sort(tokens.begin(), tokens.end(), [&](int64_t a, int64_t b) {
          return in.prob(a, e) > in.prob(b, e);  // stable: ties keep lower t first
        });
      }
      for (size_t i = size_t(std::max<int64_t>(cap, 0)); i < tokens.size(); ++i) {
        out.routing_map[tokens[i] * in.num_experts + e] = 0;
        out.probs[tokens[i] * in.num_experts + e] = 0.0f;
      }
    }
    if (o.router_padding_multiple > 0) {
      const int m = o.router_padding_multiple;
      int64_t count = 0;
      for (int64_t u = 0; u < T; ++u) count += out.routed(u, e);
      for (int64_t t = 0; t < T && count % m != 0; ++t) {
        if (!out.routed(t, e)) {
          out.routing_map[t * in.num_experts + e] = 1;
          out.probs[t * in.num_experts + e] = 0.0f;
          ++count;
        }
      }
    }
  }
  return out;
}

// Random top-k routing; `skew` sends every token to expert 0 first; probs are drawn from a
// few values so ties are common.
RoutingMap random_map(std::mt19937& rng, int64_t T, int E, int K, bool skew) {
  TopkRouting r;
  r.num_tokens = T;
  r.num_topk = K;
  std::vector<int32_t> perm(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    if (skew) std::iter_swap(perm.begin(), std::find(perm.begin(), perm.end(), 0));
    for (int k = 0; k < K; ++k) {
      r.topk_idx.push_back(perm[k]);
      r.topk_weights.push_back(float(rng() % 4) * 0.25f);
    }
  }
  return to_map(r, E);
}

TEST(ApplyLayoutOptions, MatchesBruteForce) {
  std::mt19937 rng(2024);
  ThreadPool pool(3);
  int cases = 0;
  for (int64_t T : {0, 1, 7, 64}) {
    for (int E : {1, 4, 9}) {
      for (int K : {1, 2, E}) {
        if (K > E) continue;
        for (bool skew : {false, true}) {
          const RoutingMap map = random_map(rng, T, E, K, skew);
          for (std::optional<double> cf :
               {std::optional<double>(), std::optional<double>(0.3), std::optional<double>(1.0),
                std::optional<double>(2.5)}) {
            for (DropPolicy policy : {DropPolicy::kProbs, DropPolicy::kPosition}) {
              for (int m : {0, 1, 3, 8}) {
                LayoutOptions o;
                o.capacity_factor = cf;
                o.drop_policy = policy;
                o.router_padding_multiple = m;
                const RoutingMap want = brute_force(map, K, o);
                for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
                  StatusOr<RoutingMap> got = apply_layout_options(map, K, o, p);
                  ASSERT_TRUE(got.ok()) << got.status().to_string();
                  EXPECT_EQ(got->routing_map, want.routing_map)
                      << "T=" << T << " E=" << E << " K=" << K << " skew=" << skew
                      << " policy=" << drop_policy_name(policy) << " m=" << m;
                  EXPECT_EQ(got->probs, want.probs);
                  EXPECT_EQ(got->num_topk, K);
                  // The sparse form (what the dispatchers use) gives the same routing.
                  SparseRouting sparse = to_sparse(map);
                  sparse.num_topk = K;
                  StatusOr<SparseRouting> got_sparse = apply_layout_options(sparse, o, p);
                  ASSERT_TRUE(got_sparse.ok()) << got_sparse.status().to_string();
                  ASSERT_TRUE(validate(*got_sparse, E).ok());
                  EXPECT_EQ(to_map(*got_sparse).routing_map, want.routing_map);
                  EXPECT_EQ(to_map(*got_sparse).probs, want.probs);
                  ++cases;
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 1000);
}

TEST(ApplyLayoutOptions, LargeMapUsesThePoolAndMatches) {
  std::mt19937 rng(5);
  const RoutingMap map = random_map(rng, 3000, 32, 4, /*skew=*/true);
  LayoutOptions o;
  o.capacity_factor = 0.8;
  o.router_padding_multiple = 16;
  const RoutingMap want = brute_force(map, 4, o);
  StatusOr<RoutingMap> got = apply_layout_options(map, 4, o);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->routing_map, want.routing_map);
  EXPECT_EQ(got->probs, want.probs);
  ThreadPool pool(4);
  got = apply_layout_options(map, 4, o, &pool);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->routing_map, want.routing_map);
  EXPECT_EQ(got->probs, want.probs);
}

TEST(ApplyLayoutOptions, WorkedTies) {
  // Expert 0 gets tokens 0..3 with probs .5 .9 .5 .9; C = ceil(4 * 1 / 2 * 0.5) = 1.
  RoutingMap map = RoutingMap::empty(4, 2);
  map.num_topk = 1;
  const float p[4] = {0.5f, 0.9f, 0.5f, 0.9f};
  for (int t = 0; t < 4; ++t) {
    map.routing_map[t * 2] = 1;
    map.probs[t * 2] = p[t];
  }
  LayoutOptions o;
  o.capacity_factor = 0.5;
  StatusOr<RoutingMap> got = apply_layout_options(map, 1, o);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->routing_map, (std::vector<uint8_t>{0, 0, 1, 0, 0, 0, 0, 0}));  // t = 1 wins
  o.drop_policy = DropPolicy::kPosition;
  got = apply_layout_options(map, 1, o);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->routing_map, (std::vector<uint8_t>{1, 0, 0, 0, 0, 0, 0, 0}));
  // Router padding to 3: expert 0 keeps t = 0 and gains t = 1, 2 with prob 0; expert 1 had
  // nothing and stays empty.
  o.router_padding_multiple = 3;
  got = apply_layout_options(map, 1, o);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->routing_map, (std::vector<uint8_t>{1, 0, 1, 0, 1, 0, 0, 0}));
  EXPECT_EQ(got->probs, (std::vector<float>{0.5f, 0, 0, 0, 0, 0, 0, 0}));
}

TEST(ApplyLayoutOptions, Errors) {
  RoutingMap map = RoutingMap::empty(4, 2);
  LayoutOptions o;
  o.capacity_factor = 1.0;
  expect_invalid(apply_layout_options(map, 0, o).status(),
                 "num_topk = 0 must be >= 1 with capacity_factor (the capacity formula needs K)");
  map.num_topk = 2;
  expect_invalid(apply_layout_options(map, 1, o).status(),
                 "num_topk = 1 disagrees with the routing's num_topk = 2");
  o.capacity_factor = -1.0;
  expect_invalid(apply_layout_options(map, 2, o).status(), "capacity_factor = -1 must be > 0");
  o.capacity_factor.reset();
  map.routing_map[3] = 1;
  map.probs[3] = std::nanf("");
  expect_invalid(apply_layout_options(map, 2, o).status(), "probs[1][1] = nan is not a valid prob");
  // Without capacity, K is not needed.
  map.probs[3] = 1.0f;
  map.num_topk = 0;
  EXPECT_TRUE(apply_layout_options(map, 0, o).ok());
}

}  // namespace
}  // namespace moed
