// Fault injection in the threads world: a rank that fails before or inside a collective,
// throws, calls abort(), or never arrives (timeout). Every other rank's calls return an error
// naming that rank, and run_threads returns the root cause.
#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "moed/threads_world.h"
#include "moed/world.h"

namespace moed {
namespace {

// Runs body on R threads, collecting each rank's own returned status.
struct FaultRun {
  Status result;
  std::vector<Status> per_rank;
};
FaultRun run(int ranks, int g, const std::function<Status(World&)>& body, int timeout_ms = 300000) {
  WorldOptions opts;
  opts.ranks_per_node = g;
  opts.timeout = std::chrono::milliseconds(timeout_ms);
  FaultRun out;
  out.per_rank.resize(size_t(ranks));
  std::mutex mu;
  out.result = run_threads(ranks, opts, [&](World& w) {
    Status s = body(w);
    std::lock_guard<std::mutex> lock(mu);
    out.per_rank[size_t(w.rank())] = s;
    return s;
  });
  return out;
}

void expect_others_aborted(const FaultRun& r, int failed, const std::string& message) {
  for (size_t i = 0; i < r.per_rank.size(); ++i) {
    if (int(i) == failed) continue;
    EXPECT_EQ(r.per_rank[i].code(), StatusCode::kAborted) << i << ": " << r.per_rank[i].to_string();
    EXPECT_EQ(r.per_rank[i].message(), "rank " + std::to_string(failed) + " failed: " + message)
        << i;
  }
}

TEST(FaultsTest, RankFailsBeforeACollective) {
  FaultRun r = run(7, 0, [](World& w) -> Status {
    if (w.rank() == 2) return invalid_argument("bad topk_idx");
    float x = 1, y = 0;
    return w.all_reduce_f32(&x, &y, 1);
  });
  EXPECT_EQ(r.result, invalid_argument("bad topk_idx"));
  expect_others_aborted(r, 2, "bad topk_idx");
}

TEST(FaultsTest, RankFailsInTheMiddleOfALoop) {
  FaultRun r = run(4, 2, [](World& w) -> Status {
    for (int it = 0; it < 10; ++it) {
      if (w.rank() == 3 && it == 4) return internal_error("expert 5 exploded");
      std::vector<int32_t> send(4, w.rank());
      MOED_ASSIGN_OR_RETURN(std::vector<int32_t> got, all_to_all<int32_t>(w, send));
      MOED_RETURN_IF_ERROR(w.barrier());
    }
    return ok_status();
  });
  EXPECT_EQ(r.result, internal_error("expert 5 exploded"));
  expect_others_aborted(r, 3, "expert 5 exploded");
}

TEST(FaultsTest, ExceptionBecomesAStatusNamingTheRank) {
  FaultRun r = run(3, 0, [](World& w) -> Status {
    if (w.rank() == 1) throw std::runtime_error("out of cheese");
    return w.barrier();
  });
  EXPECT_EQ(r.result.code(), StatusCode::kInternal);
  EXPECT_EQ(r.result.message(), "rank 1 threw: out of cheese");
  EXPECT_EQ(r.per_rank[0].message(), "rank 1 failed: rank 1 threw: out of cheese");
}

TEST(FaultsTest, AbortFailsTheOthersEvenIfTheRankReturnsOk) {
  FaultRun r = run(4, 4, [](World& w) -> Status {
    if (w.rank() == 0) {
      w.abort(failed_precondition("gave up"));
      return ok_status();
    }
    MOED_ASSIGN_OR_RETURN(std::shared_ptr<SharedBuffer> buf, w.alloc_shared(64));
    return buf->wait_signal(0, 1);
  });
  EXPECT_EQ(r.result.code(), StatusCode::kAborted);
  EXPECT_EQ(r.result.message(), "rank 0 failed: gave up");
  expect_others_aborted(r, 0, "gave up");
}

TEST(FaultsTest, PeerFailureEndsSignalAndReceiveWaits) {
  FaultRun r = run(4, 2, [](World& w) -> Status {
    MOED_ASSIGN_OR_RETURN(std::shared_ptr<SharedBuffer> buf, w.alloc_shared(64));
    if (w.rank() == 1) return internal_error("boom");
    if (w.rank() == 0) return buf->wait_signal(1, 1);  // same node as rank 1
    uint64_t x;
    return w.recv(1, 0, &x, sizeof(x));  // ranks 2, 3: over the network
  });
  EXPECT_EQ(r.result, internal_error("boom"));
  expect_others_aborted(r, 1, "boom");
}

TEST(FaultsTest, BarrierTimeoutNamesTheMissingRank) {
  FaultRun r = run(
      3, 0,
      [](World& w) -> Status {
        if (w.rank() == 1) return ok_status();  // never arrives
        return w.barrier();
      },
      200);
  EXPECT_EQ(r.result.code(), StatusCode::kDeadlineExceeded) << r.result.to_string();
  EXPECT_NE(r.result.message().find("in barrier waiting for rank(s) 1: waited"), std::string::npos)
      << r.result.message();
  for (int i : {0, 2}) EXPECT_FALSE(r.per_rank[size_t(i)].ok());
}

TEST(FaultsTest, LaterCallsAfterAFailureAreAborted) {
  FaultRun r = run(2, 0, [](World& w) -> Status {
    if (w.rank() == 1) return internal_error("first");
    Status a = w.barrier();
    Status b = w.alloc_shared(8).status();
    uint8_t x = 0;
    Status c = w.isend(1, 0, &x, 1).status();
    if (a.code() != StatusCode::kAborted || b.code() != StatusCode::kAborted ||
        c.code() != StatusCode::kAborted) {
      return internal_error("not aborted: ", a.to_string(), b.to_string(), c.to_string());
    }
    return c;
  });
  expect_others_aborted(r, 1, "first");
}

TEST(FaultsTest, BadArguments) {
  WorldOptions opts;
  opts.ranks_per_node = 3;
  Status s = run_threads(8, opts, [](World&) { return ok_status(); });
  EXPECT_EQ(s, invalid_argument("ranks_per_node = 3 must divide world_size = 8"));
  EXPECT_EQ(run_threads(0, {}, [](World&) { return ok_status(); }).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moed
