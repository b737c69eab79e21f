// The standard sweep (harness.h) for the AllGather and AlltoAll dispatchers: every output bit
// for bit against the reference, so the two are also bitwise equal to each other.
#include <gtest/gtest.h>

#include "dispatch/allgather/allgather.h"
#include "dispatch/alltoall/alltoall.h"
#include "dispatch/harness.h"

namespace moed {
namespace {

using testing::Backend;

class DispatchSweep : public testing::SweepTest {};

TEST_P(DispatchSweep, AllGather) {
  run_sweep(DispatcherKind::kAllGather, make_allgather_dispatcher);
}

TEST_P(DispatchSweep, AlltoAll) { run_sweep(DispatcherKind::kAlltoAll, make_alltoall_dispatcher); }

// Strided inputs, R = 5 and 7, all ranks empty, H not a multiple of 16 (harness.h).
class DispatchEdges : public testing::EdgesTest {};

TEST_P(DispatchEdges, AllGather) {
  run_edges(DispatcherKind::kAllGather, make_allgather_dispatcher);
}

TEST_P(DispatchEdges, AlltoAll) { run_edges(DispatcherKind::kAlltoAll, make_alltoall_dispatcher); }

TEST(DispatchEdgeCases, CoverEveryCorner) {
  bool strided = false, r5 = false, r7 = false, all_empty = false, h17 = false, h4099 = false;
  for (const auto& c : testing::edge_cases()) {
    strided |= c.strided;
    r5 |= c.ranks == 5;
    r7 |= c.ranks == 7;
    bool empty = c.ranks > 1;
    for (int64_t t : c.tokens) empty &= t == 0;
    all_empty |= empty;
    h17 |= c.hidden == 17;
    h4099 |= c.hidden == 4099;
  }
  EXPECT_TRUE(strided && r5 && r7 && all_empty && h17 && h4099);
}

TEST(DispatchSweepCases, CoverEveryAxis) {
  const auto cases = testing::sweep_cases();
  bool zero_tokens = false, skewed = false, fp8 = false, pad = false, align = false,
       router_pad = false, weighted = false, position = false, map_form = false, etp2 = false;
  for (const auto& c : cases) {
    for (int64_t t : c.tokens) zero_tokens |= t == 0;
    skewed |= c.skewed;
    fp8 |= c.dtype == DType::kFP8;
    pad |= c.layout.pad_to_capacity;
    align |= c.layout.expert_alignment == 16;
    router_pad |= c.layout.router_padding_multiple == 16;
    weighted |= c.weighted;
    position |= c.layout.capacity_factor && c.layout.drop_policy == DropPolicy::kPosition;
    map_form |= c.map_form;
    etp2 |= c.etp == 2;
  }
  EXPECT_TRUE(zero_tokens && skewed && fp8 && pad && align && router_pad && weighted && position &&
              map_form && etp2);
}

INSTANTIATE_TEST_SUITE_P(Worlds, DispatchEdges, ::testing::ValuesIn(testing::backends()),
                         testing::backend_param_name<::testing::TestParamInfo<Backend>>);
INSTANTIATE_TEST_SUITE_P(Worlds, DispatchSweep, testing::sweep_grid(), testing::sweep_grid_name);

}  // namespace
}  // namespace moed
