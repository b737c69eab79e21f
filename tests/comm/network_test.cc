// Point-to-point on both worlds: every rank sends to every rank (two messages per pair with
// one tag, to check order), byte counters split into shared (same node) and network; a
// gathered send arrives as the one message of its pieces.
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

// isend_gather's pieces (empty ones, pieces that touch, pieces apart) arrive back to back as
// one message, counted once; the backend's own (threads: copied straight, MPI: a datatype)
// and World's default (packed first, gloo's), on odd worlds and on one of two nodes.
TEST_P(NetworkTest, GatheredSendArrivesAsOneMessage) {
  for (auto [ranks, g] : {std::pair{5, 1}, std::pair{7, 0}, std::pair{4, 2}}) {
    Status s = run_world(GetParam(), ranks, g, [&](World& w) -> Status {
      const int me = w.rank(), next = (me + 1) % ranks, prev = (me + ranks - 1) % ranks;
      std::vector<uint8_t> a(300), b(1000);
      for (size_t i = 0; i < a.size(); ++i) a[i] = uint8_t(mix(uint32_t(me), 1, uint32_t(i)));
      for (size_t i = 0; i < b.size(); ++i) b[i] = uint8_t(mix(uint32_t(me), 2, uint32_t(i)));
      const std::vector<World::Piece> pieces = {{b.data() + 500, 200}, {a.data(), 0},
                                                {a.data(), 100},       {a.data() + 100, 200},
                                                {b.data(), 17},        {b.data() + 999, 1}};
      const auto want = [&](int src) {
        std::vector<uint8_t> v;
        auto at = [&](int which, size_t i) {
          return uint8_t(mix(uint32_t(src), uint32_t(which), uint32_t(i)));
        };
        for (size_t i = 500; i < 700; ++i) v.push_back(at(2, i));
        for (size_t i = 0; i < 300; ++i) v.push_back(at(1, i));
        for (size_t i = 0; i < 17; ++i) v.push_back(at(2, i));
        v.push_back(at(2, 999));
        return v;
      };
      for (int packed = 0; packed < 2; ++packed) {
        w.reset_counters();
        std::vector<uint8_t> got(want(prev).size());
        MOED_ASSIGN_OR_RETURN(Request r, w.irecv(prev, 3, got.data(), got.size()));
        MOED_ASSIGN_OR_RETURN(Request sent, packed ? w.World::isend_gather(next, 3, pieces)
                                                   : w.isend_gather(next, 3, pieces));
        MOED_RETURN_IF_ERROR(sent->wait());
        MOED_RETURN_IF_ERROR(r->wait());
        if (got != want(prev)) {
          return internal_error("rank ", me, packed ? " (packed)" : "", ": gathered message wrong");
        }
        const uint64_t counted = w.counters().network_bytes + w.counters().shared_bytes;
        if (counted != got.size()) {
          return internal_error("rank ", me, ": counted ", counted, " bytes, sent ", got.size());
        }
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << grid_name(ranks, g) << ": " << s.to_string();
  }
}

// Messages past the caches (the threads world writes them with non-temporal stores): one
// buffer and a gather list of odd-sized pieces, received at an odd offset, arrive whole, and
// the bytes past them stay untouched.
TEST_P(NetworkTest, LargeMessagesArriveWhole) {
  Status s = run_world(GetParam(), 3, 0, [&](World& w) -> Status {
    const int me = w.rank(), next = (me + 1) % 3, prev = (me + 2) % 3;
    const size_t n = (size_t(9) << 20) + 13;
    auto byte = [](int src, size_t i) { return uint8_t(mix(uint32_t(src), 5, uint32_t(i))); };
    std::vector<uint8_t> send(n + 64);
    for (size_t i = 0; i < send.size(); ++i) send[i] = byte(me, i);
    // The same n bytes as a gather list: [3, n / 2 + 7), [0, 3), [n / 2 + 7, n).
    const std::vector<World::Piece> pieces = {
        {send.data() + 3, n / 2 + 4}, {send.data(), 3}, {send.data() + n / 2 + 7, n - n / 2 - 7}};
    for (int gathered = 0; gathered < 2; ++gathered) {
      std::vector<uint8_t> got(n + 8, 0xa5);
      MOED_ASSIGN_OR_RETURN(Request r, w.irecv(prev, 4, got.data() + 5, n));
      MOED_ASSIGN_OR_RETURN(Request sent, gathered ? w.isend_gather(next, 4, pieces)
                                                   : w.isend(next, 4, send.data(), n));
      MOED_RETURN_IF_ERROR(sent->wait());
      MOED_RETURN_IF_ERROR(r->wait());
      for (size_t i = 0; i < n; ++i) {
        const size_t from = !gathered       ? i
                            : i < n / 2 + 4 ? i + 3
                            : i < n / 2 + 7 ? i - (n / 2 + 4)
                                            : i;
        if (got[5 + i] != byte(prev, from)) {
          return internal_error("rank ", me, gathered ? " (gathered)" : "", ": byte ", i, " wrong");
        }
      }
      for (size_t i : {size_t(0), size_t(4), n + 5, n + 7}) {
        if (got[i] != 0xa5) return internal_error("rank ", me, ": byte ", i, " outside written");
      }
    }
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
