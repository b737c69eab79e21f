// Timeouts on both worlds: a receive whose sender never sends, or a signal that never comes,
// returns kDeadlineExceeded naming what it waited for, within the world's (short) timeout.
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

// A signal that never comes: kDeadlineExceeded naming it. Here with the timeouts' tests, since
// under MPI both ranks' timed-out waits leave MPI requests (the census) that are never freed
// (scripts/lsan.supp).
TEST_P(TimeoutTest, WaitSignalTimesOut) {
  WorldOptions opts;
  // NOTE: the timeout also bounds alloc_shared's collectives below; 200 ms failed them now and
  // then when a loaded machine left a rank unscheduled that long, so allow 3 s.
  opts.timeout = std::chrono::milliseconds(3000);
  Status s = run_world(
      GetParam(), 2, 2,
      [&](World& w) -> Status {
        MOED_ASSIGN_OR_RETURN(std::shared_ptr<SharedBuffer> buf, w.alloc_shared(64));
        if (w.rank() == 0) {
          Status st = buf->wait_signal(1, 5);  // rank 1 never signals 5
          // MPI asks who is there (World::after_timeout), as its collectives' timeouts do:
          // rank 1 is, waiting in moed, so it answers (a stopped rank would be named).
          const bool census = GetParam() != Backend::kMpi ||
                              st.message().find("; every rank answered within") != std::string::npos;
          if (st.code() != StatusCode::kDeadlineExceeded || !census ||
              st.message().find("signal >= 5 from local rank 1") == std::string::npos) {
            return internal_error("rank 0 got ", st.to_string());
          }
          buf->signal(1, 1);
          return ok_status();
        }
        // Rank 1 waits for rank 0 to be done (its own waits may time out meanwhile).
        Status st;
        for (int i = 0; i < 50; ++i) {
          st = buf->wait_signal(0, 1);
          if (st.code() != StatusCode::kDeadlineExceeded) break;
        }
        return st;
      },
      opts);
  ASSERT_TRUE(s.ok()) << s.to_string();
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
