// Flex beyond the sweep: get_dispatch_layout against a brute force, cached mode, async use,
// num_worst_tokens, network bytes against the analytic count, and error paths.
#include <gtest/gtest.h>

#include <random>

#include "dispatch/flex/flex.h"
#include "dispatch/harness.h"
#include "moed/flex.h"
#include "moed/reference.h"

namespace moed {
namespace {

using testing::Backend;

TEST(FlexLayout, MatchesBruteForce) {
  std::mt19937 rng(7);
  for (int etp : {1, 2}) {
    const int R = 8, G = 4, E = 16, K = 3, T = 50;
    TopkRouting topk;
    topk.num_tokens = T;
    topk.num_topk = K;
    for (int t = 0; t < T; ++t) {
      std::vector<int> experts(E);
      for (int e = 0; e < E; ++e) experts[size_t(e)] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int k = 0; k < K; ++k) {
        topk.topk_idx.push_back(k == 2 && t % 5 == 0 ? -1 : experts[size_t(k)]);
        topk.topk_weights.push_back(0.25f);
      }
    }
    auto l = get_dispatch_layout(topk, E, R, G, etp);
    ASSERT_TRUE(l.ok()) << l.status().to_string();
    const int L = E / (R / etp);
    std::vector<int64_t> per_rank(R), per_node(R / G), per_expert(E);
    for (int t = 0; t < T; ++t) {
      std::vector<bool> rank(R), node(R / G);
      for (int k = 0; k < K; ++k) {
        const int e = topk.idx(t, k);
        if (e < 0) continue;
        ++per_expert[size_t(e)];
        for (int p = 0; p < etp; ++p) rank[size_t((e / L) * etp + p)] = true;
      }
      for (int r = 0; r < R; ++r) {
        EXPECT_EQ(l->in_rank(t, r), bool(rank[size_t(r)])) << "t " << t << " r " << r;
        if (rank[size_t(r)]) {
          ++per_rank[size_t(r)];
          node[size_t(r / G)] = true;
        }
      }
      for (int m = 0; m < R / G; ++m) per_node[size_t(m)] += node[size_t(m)];
    }
    EXPECT_EQ(l->num_tokens_per_rank, per_rank);
    EXPECT_EQ(l->num_tokens_per_node, per_node);
    EXPECT_EQ(l->num_tokens_per_expert, per_expert);
  }
  TopkRouting bad;
  bad.num_tokens = 1;
  bad.num_topk = 1;
  bad.topk_idx = {300};
  bad.topk_weights = {1.0f};
  auto l = get_dispatch_layout(bad, 16, 8, 4);
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("300"), std::string::npos) << l.status().to_string();
  EXPECT_EQ(get_dispatch_layout(bad, 16, 8, 3).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moed
