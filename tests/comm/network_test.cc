// Point-to-point on both worlds: every rank sends to every rank (two messages per pair with
// one tag, to check order), byte counters split into shared (same node) and network.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "comm/world_sizes.h"
#include "moed/world.h"
#include "support/world_test.h"

namespace moed::testing {
namespace {

class NetworkTest : public ::testing::TestWithParam<Backend> {};

size_t message_size(int src, int dst, int k) {
  return size_t((src * 3 + dst * 5 + k * 7) % 9) * 100;
}

TEST_P(NetworkTest, AllPairsInOrderWithCounters) {
  for (auto [ranks, g] : moed::testing::world_grid()) {
    Status s = run_world(GetParam(), ranks, g, [&](World& w) -> Status {
      const int me = w.rank();
      w.reset_counters();
      std::vector<std::vector<uint8_t>> out, in;
      std::vector<Request> reqs;
      TrafficCounters want;
      // Receives first on odd ranks, sends first on even ones: both orders meet.
      for (int phase = 0; phase < 2; ++phase) {
        const bool sends = (phase == 0) == (me % 2 == 0);
        for (int peer = 0; peer < ranks; ++peer) {
          for (int k = 0; k < 2; ++k) {
            if (sends) {
              std::vector<uint8_t> msg(message_size(me, peer, k));
              for (size_t i = 0; i < msg.size(); ++i) {
                msg[i] = uint8_t(mix(uint32_t(me), uint32_t(peer), uint32_t(i + 1000 * k)));
              }
              out.push_back(std::move(msg));
              MOED_ASSIGN_OR_RETURN(Request r,
                                    w.isend(peer, 7, out.back().data(), out.back().size()));
              reqs.push_back(std::move(r));
              if (peer != me) {
                (w.same_node(me, peer) ? want.shared_bytes : want.network_bytes) +=
                    out.back().size();
              }
            } else {
              in.emplace_back(message_size(peer, me, k));
              MOED_ASSIGN_OR_RETURN(Request r,
                                    w.irecv(peer, 7, in.back().data(), in.back().size()));
              reqs.push_back(std::move(r));
            }
          }
        }
      }
      MOED_RETURN_IF_ERROR(wait_all(reqs));
      for (int peer = 0, j = 0; peer < ranks; ++peer) {
        for (int k = 0; k < 2; ++k, ++j) {
          const std::vector<uint8_t>& msg = in[size_t(j)];
          for (size_t i = 0; i < msg.size(); ++i) {
            if (msg[i] != uint8_t(mix(uint32_t(peer), uint32_t(me), uint32_t(i + 1000 * k)))) {
              return internal_error("rank ", me, " message ", k, " from ", peer, " byte ", i);
            }
          }
        }
      }
      if (w.counters().network_bytes != want.network_bytes ||
          w.counters().shared_bytes != want.shared_bytes) {
        return internal_error("rank ", me, " counters shared ", w.counters().shared_bytes,
                              " network ", w.counters().network_bytes, ", want ", want.shared_bytes,
                              " / ", want.network_bytes);
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << grid_name(ranks, g) << ": " << s.to_string();
  }
}

TEST_P(NetworkTest, BlockingSendRecvRing) {
  Status s = run_world(GetParam(), 7, 1, [&](World& w) -> Status {
    const int next = (w.rank() + 1) % w.size(), prev = (w.rank() + w.size() - 1) % w.size();
    uint64_t token = uint64_t(w.rank()) * 11, got = 0;
    MOED_ASSIGN_OR_RETURN(Request r, w.irecv(prev, 0, &got, sizeof(got)));
    MOED_RETURN_IF_ERROR(w.send(next, 0, &token, sizeof(token)));
    MOED_RETURN_IF_ERROR(r->wait());
    if (got != uint64_t(prev) * 11) return internal_error("ring: got ", got);
    if (w.counters().network_bytes != sizeof(token)) return internal_error("G = 1: all network");
    return ok_status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

TEST_P(NetworkTest, BadPeerIsAnError) {
  Status s = run_world(GetParam(), 2, 0, [&](World& w) -> Status {
    uint8_t b = 0;
    StatusOr<Request> r = w.isend(5, 0, &b, 1);
    if (r.ok() || r.status().message().find("dst = 5 is outside [0, 2)") == std::string::npos) {
      return internal_error("isend to 5: ", r.ok() ? "OK" : r.status().to_string());
    }
    return ok_status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

INSTANTIATE_TEST_SUITE_P(Worlds, NetworkTest, ::testing::ValuesIn(moed::testing::backends()),
                         moed::testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed::testing
