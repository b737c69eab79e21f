// Test support: run one test body on both worlds (threads and MPI) with the same source.
//
// How to use it (dispatcher tests and everyone else):
//
//   1. In your tests/<area>/CMakeLists.txt:
//        moed_world_gtest(moed_<area>_tests SOURCES a_test.cc b_test.cc [LIBS moed_x ...] [NP 8])
//      This builds one binary, moed_<area>_tests, and runs it twice: on the threads world
//      (its tests one by one, CTest label `tsan`) and, when MOED_WITH_MPI, as the CTest test
//      moed_<area>_tests_mpi: `mpiexec --oversubscribe -np 8 moed_<area>_tests --world=mpi`
//      (label `mpi`). Do not link GTest::gtest_main yourself; world_main.cc is the main.
//   2. In the test, parameterise over moed::testing::backends() (kThreads, or kMpi under
//      --world=mpi) and run the body with run_world:
//
//        class MyTest : public ::testing::TestWithParam<moed::testing::Backend> {};
//        TEST_P(MyTest, Sums) {
//          for (int ranks : {1, 2, 3, 4, 7, 8}) {
//            moed::Status s = moed::testing::run_world(GetParam(), ranks, /*ranks_per_node=*/0,
//                [&](moed::World& w) -> moed::Status {
//                  ...; MOED_RETURN_IF_ERROR(w.barrier());
//                  if (got != want) return moed::internal_error("rank ", w.rank(), ": ...");
//                  return moed::ok_status();
//                });
//            ASSERT_TRUE(s.ok()) << s.to_string();
//          }
//        }
//        INSTANTIATE_TEST_SUITE_P(Worlds, MyTest,
//                                 ::testing::ValuesIn(moed::testing::backends()),
//                                 moed::testing::backend_param_name);
//
// Rules that keep one source valid on both worlds:
//   - The body runs once per rank: on R threads (threads) or in R processes (MPI). Report
//     problems by returning an error Status (preferred: run_world then fails the test on
//     every rank); gtest EXPECT_* inside the body also work but only on the rank that sees
//     them. Everything outside the body runs on every MPI process.
//   - Keep ranks <= 8 (mpiexec starts 8 processes, or NP); ranks_per_node must
//     divide ranks (0 = all ranks on one node).
//   - Inside `namespace moed`, write gtest's namespace as ::testing (moed::testing is this).
//   - MPI: run_world announces a body's error after the body returns, i.e. after its locals
//     (dispatchers, buffers) are dropped. A body that fails on purpose calls World::abort first
//     (tests/faults/fault_hook.h does), so the others hear kAborted naming it at once.
#pragma once

#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "moed/status.h"
#include "moed/world.h"

namespace moed::testing {

enum class Backend { kThreads, kMpi };

// The backends this run of the test binary has: {kThreads}, or {kMpi} under --world=mpi.
std::vector<Backend> backends();
// Chooses the backend (world_main.cc, before gtest registers the tests).
void use_backend(Backend b);
const char* backend_name(Backend b);
// For INSTANTIATE_TEST_SUITE_P's name generator: "threads" / "mpi".
template <typename ParamInfo>
std::string backend_param_name(const ParamInfo& info) {
  return backend_name(info.param);
}

// Runs body on `ranks` ranks with G = ranks_per_node (0 = all on one node) and returns one
// result, the same on every rank/process: OK, or the root-cause error (the lowest rank's
// error that is not the kAborted echo of another rank's failure), as run_threads does.
// MPI: the first `ranks` processes of MPI_COMM_WORLD run the body; the rest wait and return
// the same result. opts.ranks_per_node is overwritten by ranks_per_node.
Status run_world(Backend b, int ranks, int ranks_per_node,
                 const std::function<Status(World&)>& body, WorldOptions opts = {});

// A check inside a world body: OK, or an internal error saying `what`.
inline Status expect(bool ok, const std::string& what) {
  return ok ? ok_status() : internal_error(what);
}

// Collective: OK when `value` has the same bytes on every rank, else an error naming the
// first rank that differs from rank 0 and the first differing element.
template <typename T>
Status expect_same_on_all_ranks(World& w, std::span<const T> value, const std::string& what) {
  MOED_ASSIGN_OR_RETURN(std::vector<std::vector<T>> all, all_gather_v<T>(w, value));
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r].size() != all[0].size()) {
      return internal_error(what, ": rank ", r, " has ", all[r].size(), " elements, rank 0 has ",
                            all[0].size());
    }
    for (size_t i = 0; i < all[r].size(); ++i) {
      if (std::memcmp(&all[r][i], &all[0][i], sizeof(T)) != 0) {
        return internal_error(what, ": rank ", r, " differs from rank 0 at element ", i);
      }
    }
  }
  return ok_status();
}

}  // namespace moed::testing
