// Timeouts on both worlds: a receive whose sender never sends returns kDeadlineExceeded
// naming what it waited for, within the world's (short) timeout.
#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "moed/world.h"
#include "support/world_test.h"

namespace moed::testing {
namespace {

class TimeoutTest : public ::testing::TestWithParam<Backend> {};

TEST_P(TimeoutTest, ReceiveFromSilentRankTimesOut) {
  // Short, but not so short that making the MPI world (8 ranks on 2 cores, under ASan, next
  // to another suite) runs past it: the timeout bounds the bootstrap's waits too.
  WorldOptions opts;
  opts.timeout = std::chrono::seconds(2);
  const auto start = std::chrono::steady_clock::now();
  Status s = run_world(
      GetParam(), 3, 1,
      [&](World& w) -> Status {
        if (w.rank() != 0) return ok_status();
        uint64_t x = 0;
        return w.recv(1, 3, &x, sizeof(x));
      },
      opts);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
  EXPECT_NE(s.message().find("rank 0 receiving 8 bytes from rank 1 with tag 3"), std::string::npos)
      << s.message();
  // Not a timing assertion on speed: only that the wait ended (well before the default 300 s).
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(120));
}

// A rank whose body fails before a collective: the others' pending collective returns
// kAborted naming it (threads: the shared failure state; MPI: the failure message run_world
// sends), and the result is that rank's error.
TEST_P(TimeoutTest, RankFailingBeforeACollectiveAbortsTheOthers) {
  for (int failing : {0, 2}) {
    Status s = run_world(GetParam(), 4, 2, [&](World& w) -> Status {
      if (w.rank() == failing) return invalid_argument("bad input on ", failing);
      std::vector<float> x(1000, 1.0f), y(1000);
      Status st = w.all_reduce_f32(x.data(), y.data(), x.size());
      const std::string want = str_cat("rank ", failing, " failed: bad input on ", failing);
      if (st.code() != StatusCode::kAborted || st.message() != want) {
        return internal_error("rank ", w.rank(), " got ", st.to_string());
      }
      return st;
    });
    EXPECT_EQ(s, invalid_argument("bad input on ", failing));
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, TimeoutTest, ::testing::ValuesIn(moed::testing::backends()),
                         moed::testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed::testing
