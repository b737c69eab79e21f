// Node-shared memory on both worlds: every local rank sees every local rank's segment
// (64-byte aligned), and per-pair signals order the writes (release/acquire).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "comm/world_sizes.h"
#include "moed/world.h"
#include "support/world_test.h"

namespace moed::testing {
namespace {

class SharedMemoryTest : public ::testing::TestWithParam<Backend> {};

TEST_P(SharedMemoryTest, PeersSeeSegmentsAfterSignals) {
  for (auto [ranks, g] : moed::testing::world_grid()) {
    Status s = run_world(GetParam(), ranks, g, [&](World& w) -> Status {
      const size_t bytes = 4096 + 8;  // not a multiple of 64: the next segment stays aligned
      MOED_ASSIGN_OR_RETURN(std::shared_ptr<SharedBuffer> buf, w.alloc_shared(bytes));
      if (buf->local_size() != g || buf->local_rank() != w.local_rank() || buf->bytes() != bytes) {
        return internal_error("shape of the shared buffer");
      }
      for (int lr = 0; lr < g; ++lr) {
        if (reinterpret_cast<uintptr_t>(buf->peer(lr)) % 64 != 0) {
          return internal_error("segment of local rank ", lr, " is not 64-byte aligned");
        }
      }
      if (buf->local() != buf->peer(w.local_rank())) return internal_error("local() != peer(me)");
      // Two rounds: each local rank writes, in every peer's segment, the slot for itself,
      // then signals that peer; the peer waits and checks. Counters only grow.
      const size_t slot = bytes / size_t(g) / 4 * 4;
      for (uint64_t round = 1; round <= 2; ++round) {
        for (int to = 0; to < g; ++to) {
          auto* dst = static_cast<uint8_t*>(buf->peer(to)) + size_t(w.local_rank()) * slot;
          for (size_t i = 0; i < slot; ++i) {
            dst[i] = uint8_t(mix(uint32_t(w.rank()), uint32_t(to), uint32_t(i + round)));
          }
          buf->signal(to, round);
        }
        for (int from = 0; from < g; ++from) {
          MOED_RETURN_IF_ERROR(buf->wait_signal(from, round));
          const int src_rank = w.node() * g + from;
          const auto* got = static_cast<const uint8_t*>(buf->local()) + size_t(from) * slot;
          for (size_t i = 0; i < slot; ++i) {
            if (got[i] !=
                uint8_t(mix(uint32_t(src_rank), uint32_t(w.local_rank()), uint32_t(i + round)))) {
              return internal_error("rank ", w.rank(), " round ", round, ": byte ", i,
                                    " from local rank ", from);
            }
          }
        }
        // Nobody overwrites a slot before its reader is done with the round.
        MOED_RETURN_IF_ERROR(w.barrier());
      }
      // A second allocation on the same node is independent of the first.
      MOED_ASSIGN_OR_RETURN(std::shared_ptr<SharedBuffer> other, w.alloc_shared(64));
      if (other->peer(0) == buf->peer(0)) return internal_error("allocations alias");
      static_cast<uint8_t*>(other->local())[0] = uint8_t(w.rank());
      other->signal((w.local_rank() + 1) % g, 1);
      const int prev = (w.local_rank() + g - 1) % g;
      MOED_RETURN_IF_ERROR(other->wait_signal(prev, 1));
      if (static_cast<uint8_t*>(other->peer(prev))[0] != uint8_t(w.node() * g + prev)) {
        return internal_error("second allocation content");
      }
      MOED_RETURN_IF_ERROR(w.barrier());
      // Freed locally on every world, in any order.
      other.reset();
      buf.reset();
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << grid_name(ranks, g) << ": " << s.to_string();
  }
}

TEST_P(SharedMemoryTest, MismatchedSizesAreAnError) {
  Status s = run_world(GetParam(), 4, 4, [&](World& w) -> Status {
    StatusOr<std::shared_ptr<SharedBuffer>> buf = w.alloc_shared(w.rank() == 2 ? 128 : 64);
    if (buf.ok() || buf.status().code() != StatusCode::kInvalidArgument ||
        buf.status().message().find("local rank 2 of node 0 asked for 128 bytes") ==
            std::string::npos) {
      return internal_error("rank ", w.rank(), " got ",
                            buf.ok() ? std::string("OK") : buf.status().to_string());
    }
    return ok_status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

INSTANTIATE_TEST_SUITE_P(Worlds, SharedMemoryTest, ::testing::ValuesIn(moed::testing::backends()),
                         moed::testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed::testing
