// Every collective against a direct computation, on both worlds, over the world grid:
// zero-length and uneven contributions, bitwise-exact fp32 sums in ascending rank order,
// byte counters by path, and errors every rank agrees on.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "comm/world_sizes.h"
#include "moed/world.h"
#include "support/world_test.h"

namespace moed::testing {
namespace {

class CollectivesTest : public ::testing::TestWithParam<Backend> {};

// Counts a send of `bytes` from `src` to `dst` by the rule every backend follows.
void expect_send(const World& w, int dst, uint64_t bytes, TrafficCounters& want) {
  if (dst == w.rank()) return;
  (w.same_node(w.rank(), dst) ? want.shared_bytes : want.network_bytes) += bytes;
}

Status check_counters(World& w, const TrafficCounters& want, const char* what) {
  if (w.counters().shared_bytes != want.shared_bytes ||
      w.counters().network_bytes != want.network_bytes) {
    return internal_error(what, ": rank ", w.rank(), " counted shared ", w.counters().shared_bytes,
                          " network ", w.counters().network_bytes, ", want shared ",
                          want.shared_bytes, " network ", want.network_bytes);
  }
  return ok_status();
}

TEST_P(CollectivesTest, BarrierAndBroadcast) {
  for (auto [ranks, g] : moed::testing::world_grid()) {
    Status s = run_world(GetParam(), ranks, g, [&](World& w) -> Status {
      if (w.size() != ranks || w.ranks_per_node() != g) return internal_error("bad shape");
      MOED_RETURN_IF_ERROR(w.barrier());
      for (int root : {0, ranks - 1, ranks / 2}) {
        for (size_t n : {size_t(0), size_t(1), size_t(1000)}) {
          w.reset_counters();
          std::vector<uint8_t> data(n, 0);
          if (w.rank() == root) {
            for (size_t i = 0; i < n; ++i) data[i] = uint8_t(mix(uint32_t(root), uint32_t(i)));
          }
          MOED_RETURN_IF_ERROR(w.broadcast_bytes(data.data(), n, root));
          for (size_t i = 0; i < n; ++i) {
            if (data[i] != uint8_t(mix(uint32_t(root), uint32_t(i)))) {
              return internal_error("broadcast root ", root, " n ", n, ": rank ", w.rank(),
                                    " byte ", i);
            }
          }
          TrafficCounters want;
          if (w.rank() == root) {
            for (int d = 0; d < ranks; ++d) expect_send(w, d, n, want);
          }
          MOED_RETURN_IF_ERROR(check_counters(w, want, "broadcast"));
        }
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << grid_name(ranks, g) << ": " << s.to_string();
  }
}

TEST_P(CollectivesTest, AllGatherV) {
  for (auto [ranks, g] : moed::testing::world_grid()) {
    Status s = run_world(GetParam(), ranks, g, [&](World& w) -> Status {
      w.reset_counters();
      auto count = [](int r) { return size_t((r * 7 + 3) % 5); };  // includes zero
      std::vector<uint32_t> mine(count(w.rank()));
      for (size_t i = 0; i < mine.size(); ++i) mine[i] = mix(uint32_t(w.rank()), uint32_t(i), 1);
      MOED_ASSIGN_OR_RETURN(std::vector<std::vector<uint32_t>> all,
                            all_gather_v<uint32_t>(w, mine));
      TrafficCounters want;
      for (int d = 0; d < ranks; ++d) expect_send(w, d, sizeof(uint64_t), want);  // counts
      for (int d = 0; d < ranks; ++d) expect_send(w, d, mine.size() * 4, want);
      MOED_RETURN_IF_ERROR(check_counters(w, want, "all_gather_v"));
      for (int r = 0; r < ranks; ++r) {
        if (all[size_t(r)].size() != count(r)) return internal_error("all_gather_v size ", r);
        for (size_t i = 0; i < count(r); ++i) {
          if (all[size_t(r)][i] != mix(uint32_t(r), uint32_t(i), 1)) {
            return internal_error("all_gather_v: rank ", w.rank(), " got a wrong element ", i,
                                  " from rank ", r);
          }
        }
      }
      // Fixed size through the typed wrapper.
      int32_t me = w.rank() * 10;
      MOED_ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                            all_gather<int32_t>(w, std::span<const int32_t>(&me, 1)));
      for (int r = 0; r < ranks; ++r) {
        if (ids[size_t(r)] != r * 10) return internal_error("all_gather ", r);
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << grid_name(ranks, g) << ": " << s.to_string();
  }
}

TEST_P(CollectivesTest, AllToAllV) {
  for (auto [ranks, g] : moed::testing::world_grid()) {
    Status s = run_world(GetParam(), ranks, g, [&](World& w) -> Status {
      const int me = w.rank();
      // Uneven, with zeros (and a rank that sends nothing at all when ranks > 2).
      auto count = [&](int src, int dst) {
        return src == 1 ? size_t(0) : size_t((src * 5 + dst * 3) % 7);
      };
      std::vector<size_t> sc(static_cast<size_t>(ranks)), rc(static_cast<size_t>(ranks));
      std::vector<uint32_t> send;
      for (int d = 0; d < ranks; ++d) {
        sc[size_t(d)] = count(me, d);
        rc[size_t(d)] = count(d, me);
        for (size_t i = 0; i < sc[size_t(d)]; ++i)
          send.push_back(mix(uint32_t(me), uint32_t(d), uint32_t(i)));
      }
      std::vector<uint32_t> recv(std::accumulate(rc.begin(), rc.end(), size_t(0)), 0xFFFFFFFFu);
      w.reset_counters();
      MOED_RETURN_IF_ERROR(all_to_all_v<uint32_t>(w, send, sc, recv, rc));
      TrafficCounters want;
      for (int d = 0; d < ranks; ++d) expect_send(w, d, sc[size_t(d)] * 4, want);
      MOED_RETURN_IF_ERROR(check_counters(w, want, "all_to_all_v"));
      size_t off = 0;
      for (int src = 0; src < ranks; ++src) {
        for (size_t i = 0; i < rc[size_t(src)]; ++i, ++off) {
          if (recv[off] != mix(uint32_t(src), uint32_t(me), uint32_t(i))) {
            return internal_error("all_to_all_v: rank ", me, " element ", i, " from ", src);
          }
        }
      }
      // Byte level with gaps between the blocks (offsets not packed).
      std::vector<size_t> sb(static_cast<size_t>(ranks)), so(static_cast<size_t>(ranks)),
          rb(static_cast<size_t>(ranks)), ro(static_cast<size_t>(ranks));
      std::vector<uint8_t> sbuf(size_t(ranks) * 16), rbuf(size_t(ranks) * 16, 0);
      for (int d = 0; d < ranks; ++d) {
        sb[size_t(d)] = size_t(d + me) % 5;
        so[size_t(d)] = size_t(d) * 16 + 3;
        rb[size_t(d)] = size_t(d + me) % 5;
        ro[size_t(d)] = size_t(ranks - 1 - d) * 16 + 1;
        for (size_t i = 0; i < sb[size_t(d)]; ++i)
          sbuf[so[size_t(d)] + i] = uint8_t(me * 16 + d + i);
      }
      MOED_RETURN_IF_ERROR(w.all_to_all_v_bytes(sbuf.data(), sb, so, rbuf.data(), rb, ro));
      for (int src = 0; src < ranks; ++src) {
        for (size_t i = 0; i < rb[size_t(src)]; ++i) {
          if (rbuf[ro[size_t(src)] + i] != uint8_t(src * 16 + me + i)) {
            return internal_error("all_to_all_v_bytes: rank ", me, " from ", src, " byte ", i);
          }
        }
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << grid_name(ranks, g) << ": " << s.to_string();
  }
}

// The expected sum, computed here in the contract's order: acc = 0; for r ascending.
float expected_sum(int ranks, uint32_t i, uint32_t salt) {
  float acc = 0.0f;
  for (int r = 0; r < ranks; ++r) acc += test_float(uint32_t(r), i, salt);
  return acc;
}

TEST_P(CollectivesTest, ReduceScatterVIsBitExactInRankOrder) {
  for (auto [ranks, g] : moed::testing::world_grid()) {
    for (int repeat = 0; repeat < 2; ++repeat) {
      Status s = run_world(GetParam(), ranks, g, [&](World& w) -> Status {
        const int me = w.rank();
        std::vector<size_t> counts(static_cast<size_t>(ranks));
        for (int d = 0; d < ranks; ++d) counts[size_t(d)] = d == 0 ? 0 : size_t(d * 37 % 11 + 1);
        const size_t total = std::accumulate(counts.begin(), counts.end(), size_t(0));
        std::vector<float> send(total);
        for (size_t i = 0; i < total; ++i) send[i] = test_float(uint32_t(me), uint32_t(i), 7);
        std::vector<float> recv(counts[size_t(me)], -1.0f);
        w.reset_counters();
        MOED_RETURN_IF_ERROR(w.reduce_scatter_v_f32(send.data(), counts, recv.data()));
        TrafficCounters want;
        for (int d = 0; d < ranks; ++d) expect_send(w, d, counts[size_t(d)] * 4, want);
        MOED_RETURN_IF_ERROR(check_counters(w, want, "reduce_scatter_v_f32"));
        size_t off = 0;
        for (int d = 0; d < me; ++d) off += counts[size_t(d)];
        for (size_t i = 0; i < recv.size(); ++i) {
          const float want_sum = expected_sum(ranks, uint32_t(off + i), 7);
          if (std::memcmp(&recv[i], &want_sum, 4) != 0) {
            return internal_error("reduce_scatter_v_f32: rank ", me, " element ", i, " = ", recv[i],
                                  ", want ", want_sum);
          }
        }
        // In place: recv aliases send.
        MOED_RETURN_IF_ERROR(w.reduce_scatter_v_f32(send.data(), counts, send.data()));
        for (size_t i = 0; i < recv.size(); ++i) {
          if (std::memcmp(&send[i], &recv[i], 4) != 0) return internal_error("in place ", i);
        }
        return ok_status();
      });
      ASSERT_TRUE(s.ok()) << grid_name(ranks, g) << ": " << s.to_string();
    }
  }
}

TEST_P(CollectivesTest, AllReduceIsBitExactInRankOrder) {
  for (auto [ranks, g] : moed::testing::world_grid()) {
    Status s = run_world(GetParam(), ranks, g, [&](World& w) -> Status {
      for (size_t count : {size_t(0), size_t(1), size_t(5000)}) {
        std::vector<float> send(count), recv(count, -1.0f);
        for (size_t i = 0; i < count; ++i) send[i] = test_float(uint32_t(w.rank()), uint32_t(i), 3);
        w.reset_counters();
        MOED_RETURN_IF_ERROR(w.all_reduce_f32(send.data(), recv.data(), count));
        TrafficCounters want;
        for (int d = 0; d < ranks; ++d) expect_send(w, d, count * 4, want);
        MOED_RETURN_IF_ERROR(check_counters(w, want, "all_reduce_f32"));
        for (size_t i = 0; i < count; ++i) {
          const float want_sum = expected_sum(ranks, uint32_t(i), 3);
          if (std::memcmp(&recv[i], &want_sum, 4) != 0) {
            return internal_error("all_reduce_f32: rank ", w.rank(), " element ", i, " = ", recv[i],
                                  ", want ", want_sum);
          }
        }
        MOED_RETURN_IF_ERROR(w.all_reduce_f32(send.data(), send.data(), count));  // in place
        if (count > 0 && std::memcmp(send.data(), recv.data(), count * 4) != 0) {
          return internal_error("all_reduce_f32 in place differs");
        }
        MOED_RETURN_IF_ERROR(moed::testing::expect_same_on_all_ranks<float>(w, recv, "sums"));
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << grid_name(ranks, g) << ": " << s.to_string();
  }
}

// A fixed float whose value pins the order: large + small terms cancel differently in any
// other order. Same constant on both backends, so the backends agree bit for bit.
TEST_P(CollectivesTest, SumOrderIsAscendingRanks) {
  Status s = run_world(GetParam(), 3, 0, [&](World& w) -> Status {
    const float x[3] = {1e8f, 1.0f, -1e8f};
    float sum = -1;
    MOED_RETURN_IF_ERROR(w.all_reduce_f32(&x[w.rank()], &sum, 1));
    // ((0 + 1e8) + 1) - 1e8 = 0 in fp32; any order adding 1 last would give 1.
    if (sum != 0.0f) return internal_error("sum = ", sum, ", want 0");
    return ok_status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

TEST_P(CollectivesTest, MismatchedSizesAreAnErrorOnEveryRank) {
  Status s = run_world(GetParam(), 4, 2, [&](World& w) -> Status {
    std::vector<size_t> sc(4, 1), rc(4, 1);
    if (w.rank() == 2) rc[1] = 2;  // rank 2 expects 2 bytes from rank 1, which sends 1
    std::vector<uint8_t> send(4, 1), recv(5, 0);
    std::vector<size_t> so = {0, 1, 2, 3}, ro = {0, 1, 3, 4};
    if (w.rank() != 2) ro = {0, 1, 2, 3};
    Status st = w.all_to_all_v_bytes(send.data(), sc, so, recv.data(), rc, ro);
    if (st.code() != StatusCode::kInvalidArgument ||
        st.message().find("rank 2 expects 2 bytes from rank 1, which sends 1") ==
            std::string::npos) {
      return internal_error("rank ", w.rank(), " got ", st.to_string());
    }
    // The world is still usable after an agreed error.
    float x = 1.0f, sum = 0.0f;
    MOED_RETURN_IF_ERROR(w.all_reduce_f32(&x, &sum, 1));
    if (sum != 4.0f) return internal_error("sum ", sum);
    // all_reduce count mismatch.
    std::vector<float> v(w.rank() == 3 ? 2u : 1u, 1.0f), out(v.size());
    st = w.all_reduce_f32(v.data(), out.data(), v.size());
    if (st.code() != StatusCode::kInvalidArgument ||
        st.message().find("rank 3 has count 2, rank 0 has 1") == std::string::npos) {
      return internal_error("rank ", w.rank(), " got ", st.to_string());
    }
    return ok_status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

TEST_P(CollectivesTest, AgreeReturnsTheLowestFailingRank) {
  Status s = run_world(GetParam(), 7, 0, [&](World& w) -> Status {
    Status local =
        w.rank() == 5 || w.rank() == 3 ? invalid_argument("bad input on ", w.rank()) : ok_status();
    return w.agree(local);
  });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "rank 3: bad input on 3");
}

INSTANTIATE_TEST_SUITE_P(Worlds, CollectivesTest, ::testing::ValuesIn(moed::testing::backends()),
                         moed::testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed::testing
