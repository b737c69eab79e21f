// Timeouts on both worlds: a receive whose sender never sends returns kDeadlineExceeded
// naming what it waited for, within the world's (short) timeout.
#include <gtest/gtest.h>

#include <chrono>

#include "moed/world.h"
#include "support/world_test.h"

namespace moed {
namespace {

using ::moed::testing::Backend;
using ::moed::testing::run_world;

class TimeoutTest : public ::testing::TestWithParam<Backend> {};

TEST_P(TimeoutTest, ReceiveFromSilentRankTimesOut) {
  WorldOptions opts;
  opts.timeout = std::chrono::milliseconds(200);
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

INSTANTIATE_TEST_SUITE_P(Worlds, TimeoutTest, ::testing::ValuesIn(moed::testing::backends()),
                         moed::testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed
