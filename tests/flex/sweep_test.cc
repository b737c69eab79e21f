// The standard sweep (tests/dispatch/harness.h) for Flex, on one node and on every node split
// of R = 8 (1x8, 2x4, 4x2, 8x1) and R = 6 (2x3, 3x2): every output bit for bit against the
// reference, so Flex is also bitwise equal to AllGather and AlltoAll.
#include <gtest/gtest.h>

#include "dispatch/flex/flex_dispatcher.h"
#include "dispatch/harness.h"
#include "support/sanitizers.h"

namespace moed {
namespace {

using testing::Backend;

class FlexSweep : public testing::SweepTest {};

TEST_P(FlexSweep, OneNode) { run_sweep(DispatcherKind::kFlex, make_flex_dispatcher); }

// Strided inputs, R = 5 and 7, all ranks empty, H not a multiple of 16 (harness.h).
class FlexEdges : public testing::EdgesTest {};

TEST_P(FlexEdges, Cases) { run_edges(DispatcherKind::kFlex, make_flex_dispatcher); }

// Every sweep case of R ranks again, with the ranks split into nodes of G (cross-node traffic
// then takes the two hops). Cases whose ETP group would straddle nodes are skipped (Flex
// rejects them as unimplemented; see NodeSplitErrors).
std::vector<testing::DispatchCase> split_cases(int ranks, int ranks_per_node, int stride) {
  std::vector<testing::DispatchCase> out;
  int i = 0;
  for (testing::DispatchCase c : testing::sweep_cases()) {
    if (c.ranks != (ranks == 6 ? 8 : ranks) || ranks_per_node % c.etp != 0) continue;
    if (i++ % stride != 0) continue;
    if (ranks != c.ranks) {
      // R = 6: the R = 8 case's axes on 6 ranks (E a multiple of the EP size).
      c.ranks = ranks;
      c.tokens.resize(size_t(ranks), 5);
      const int ep = ranks / c.etp;
      if (c.num_experts % ep != 0) c.num_experts = ep * std::max(1, c.num_experts / ep);
      if (c.num_topk > c.num_experts) c.num_topk = c.num_experts;
    }
    c.ranks_per_node = ranks_per_node;
    out.push_back(c);
  }
  return out;
}

// Rows wider than the combine's column tile (1024 fp32) with a tail, and outputs past the
// size at which combine streams them (8 MiB): every dtype pair, weighted or not, skewed, one
// and two nodes, odd R with an empty rank; and aligned rows past the size at which dispatch
// streams them. ThreadSanitizer runs two of the first four, one on one node (k = E) and one on
// two nodes (strided), with the same tiles (sanitizers.h).
class FlexWideRows : public ::testing::TestWithParam<Backend> {};

TEST_P(FlexWideRows, Cases) {
  std::vector<testing::DispatchCase> cases;
  uint64_t seed = 7100;
  for (int i = 0; i < 4; ++i) {
    testing::DispatchCase c;
    c.ranks = i < 2 ? 3 : 4;
    c.ranks_per_node = i < 2 ? 0 : 2;
    c.num_experts = c.ranks * 2;
    c.num_topk = i == 1 ? c.num_experts : 2;
    c.tokens = i < 2 ? std::vector<int64_t>{900, 0, 37} : std::vector<int64_t>{850, 3, 0, 860};
    c.dtype = i % 2 ? DType::kBF16 : DType::kF32;
    c.out_dtype = i / 2 ? DType::kBF16 : DType::kF32;
    c.hidden = 2500;
    c.weighted = i % 2 == 0;
    c.skewed = i == 2;
    c.strided = i == 3;
    c.seed = seed++;
    if (testing::kUnderTsan && i % 2 == 0) continue;
    cases.push_back(c);
  }
  if (!testing::kUnderTsan) {
    // bf16 rows of 8208 bytes (16-byte aligned, not whole lines): the dispatch's streamed
    // rows go out several side by side (internal::stream_copy_rows), with a tail per row.
    testing::DispatchCase c;
    c.ranks = 2;
    c.num_experts = 4;
    c.num_topk = 2;
    c.tokens = {1200, 1100};
    c.dtype = DType::kBF16;
    c.out_dtype = DType::kBF16;
    c.hidden = 4104;
    c.seed = seed++;
    cases.push_back(c);
  }
  Status s = testing::run_cases(GetParam(), cases, DispatcherKind::kFlex, make_flex_dispatcher);
  ASSERT_TRUE(s.ok()) << s.to_string();
}

class FlexNodes : public ::testing::TestWithParam<std::tuple<Backend, std::pair<int, int>>> {};

TEST_P(FlexNodes, Split) {
  const auto [backend, split] = GetParam();
  const auto [ranks, ranks_per_node] = split;
  Status s = testing::run_cases(backend, split_cases(ranks, ranks_per_node, 3),
                                DispatcherKind::kFlex, make_flex_dispatcher);
  ASSERT_TRUE(s.ok()) << s.to_string();
}

std::string nodes_name(
    const ::testing::TestParamInfo<std::tuple<Backend, std::pair<int, int>>>& info) {
  const auto [r, g] = std::get<1>(info.param);
  return std::string(testing::backend_name(std::get<0>(info.param))) + "_" + std::to_string(r / g) +
         "x" + std::to_string(g);
}

INSTANTIATE_TEST_SUITE_P(Worlds, FlexEdges, ::testing::ValuesIn(testing::backends()),
                         testing::backend_param_name<::testing::TestParamInfo<Backend>>);
INSTANTIATE_TEST_SUITE_P(Worlds, FlexWideRows, ::testing::ValuesIn(testing::backends()),
                         testing::backend_param_name<::testing::TestParamInfo<Backend>>);
INSTANTIATE_TEST_SUITE_P(Worlds, FlexSweep, testing::sweep_grid(), testing::sweep_grid_name);
INSTANTIATE_TEST_SUITE_P(Worlds, FlexNodes,
                         ::testing::Combine(::testing::ValuesIn(testing::backends()),
                                            ::testing::Values(std::pair{8, 8}, std::pair{8, 4},
                                                              std::pair{8, 2}, std::pair{8, 1},
                                                              std::pair{6, 3}, std::pair{6, 2})),
                         nodes_name);

}  // namespace
}  // namespace moed
