// A world that goes on without a lost rank (World::shrink): in 4 ranks (and 2 nodes of 2)
// rank 2 fails; the others see the error naming it, shrink to 3 ranks and run the dispatchers
// there, every output bit for bit against the reference for 3 ranks (the harness's check).
// The threads world and the MPI world (where the failed rank stays alive) both shrink.
#include <gtest/gtest.h>

#include <string>

#include "dispatch/allgather/allgather.h"
#include "dispatch/alltoall/alltoall.h"
#include "dispatch/flex/flex_dispatcher.h"
#include "dispatch/harness.h"
#include "moed/world.h"
#include "support/world_test.h"

namespace moed {
namespace {

using ::moed::testing::Backend;

constexpr int kRanks = 4;
constexpr int kLost = 2;

Status survive(World& w) {
  Status seen = w.barrier();
  if (seen.ok() || seen.message().find("rank 2") == std::string::npos)
    return internal_error("survivor ", w.rank(), ": the loss was not seen: ", seen.to_string());
  MOED_ASSIGN_OR_RETURN(ShrunkWorld s, w.shrink());
  if (!w.rank_failed(kLost))
    return internal_error("survivor ", w.rank(), ": rank 2 is not marked failed");
  if (s.members != std::vector<int>{0, 1, 3} || s.world->size() != 3)
    return internal_error("survivor ", w.rank(), ": the shrunk world is not ranks 0, 1, 3");
  if (s.members[size_t(s.world->rank())] != w.rank())
    return internal_error("survivor ", w.rank(), ": renumbered out of order");
  testing::DispatchCase c;
  c.ranks = 3;
  c.num_experts = 6;
  c.num_topk = 2;
  c.tokens = {5, 0, 9};
  c.weighted = true;
  c.hidden = 100;
  const struct {
    DispatcherKind kind;
    testing::DispatcherFactory make;
  } kinds[] = {{DispatcherKind::kAllGather, make_allgather_dispatcher},
               {DispatcherKind::kAlltoAll, make_alltoall_dispatcher},
               {DispatcherKind::kFlex, make_flex_dispatcher}};
  for (const auto& k : kinds) {
    Status st = testing::check_case(*s.world, c, k.kind, k.make);
    if (!st.ok())
      return internal_error("survivor ", w.rank(), ": ", dispatcher_kind_name(k.kind), " on the ",
                            "shrunk world: ", st.to_string());
  }
  // The shrunk world's own collectives, and its failure, are its own.
  MOED_RETURN_IF_ERROR(s.world->barrier());
  return ok_status();
}

class ShrinkWorldTest : public ::testing::TestWithParam<Backend> {};

TEST_P(ShrinkWorldTest, TheSurvivorsGoOnBitForBit) {
  for (int g : {0, 2}) {
    Status s = testing::run_world(GetParam(), kRanks, g, [&](World& w) -> Status {
      if (w.rank() == kLost) {
        Status reason = internal_error("rank ", kLost, " leaves");
        w.abort(reason);
        return reason;
      }
      return survive(w);
    });
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("rank 2 leaves"), std::string::npos)
        << "G" << g << ": " << s.to_string();
    EXPECT_EQ(s.message().find("survivor"), std::string::npos) << "G" << g << ": " << s.to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, ShrinkWorldTest, ::testing::ValuesIn(testing::backends()),
                         testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed
