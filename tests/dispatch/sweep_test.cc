// The standard sweep (harness.h) for the AllGather and AlltoAll dispatchers: every output bit
// for bit against the reference, so the two are also bitwise equal to each other.
#include <gtest/gtest.h>

#include "dispatch/allgather/allgather.h"
#include "dispatch/alltoall/alltoall.h"
#include "dispatch/harness.h"

namespace moed {
namespace {

using testing::Backend;

std::vector<testing::DispatchCase> cases_with_ranks(int ranks) {
  std::vector<testing::DispatchCase> out;
  for (const testing::DispatchCase& c : testing::sweep_cases()) {
    if (c.ranks == ranks) out.push_back(c);
  }
  return out;
}

class DispatchSweep : public ::testing::TestWithParam<std::tuple<Backend, int>> {};

TEST_P(DispatchSweep, AllGather) {
  const auto [backend, ranks] = GetParam();
  Status s = testing::run_cases(backend, cases_with_ranks(ranks), DispatcherKind::kAllGather,
                                make_allgather_dispatcher);
  ASSERT_TRUE(s.ok()) << s.to_string();
}

TEST_P(DispatchSweep, AlltoAll) {
  const auto [backend, ranks] = GetParam();
  Status s = testing::run_cases(backend, cases_with_ranks(ranks), DispatcherKind::kAlltoAll,
                                make_alltoall_dispatcher);
  ASSERT_TRUE(s.ok()) << s.to_string();
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

std::string param_name(const ::testing::TestParamInfo<std::tuple<Backend, int>>& info) {
  return std::string(testing::backend_name(std::get<0>(info.param))) + "_R" +
         std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Worlds, DispatchSweep,
                         ::testing::Combine(::testing::ValuesIn(testing::backends()),
                                            ::testing::Values(1, 2, 3, 4, 8)),
                         param_name);

}  // namespace
}  // namespace moed
