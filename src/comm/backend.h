// Internal: what every backend's World does the same way: the start of a collective, the
// traffic count of a send, and the argument checks each rank runs over every rank's arguments
// (so all reach the same verdict, with the same message on every backend). Ranks' values come
// through accessors (`value_of(r)`), since each backend holds them in its own form (slots,
// gathered words).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "comm/wait.h"
#include "moed/status.h"
#include "moed/world.h"

// The transport every backend defines (moed/world.h says what each does), declared once:
// `class XWorld final : public World { public: MOED_WORLD_TRANSPORT_OVERRIDES ... };`.
#define MOED_WORLD_TRANSPORT_OVERRIDES                                                        \
  Status barrier() override;                                                                  \
  Status broadcast_bytes(void* data, size_t bytes, int root) override;                        \
  Status all_gather_v_bytes(const void* send, size_t send_bytes, void* recv,                  \
                            std::span<const size_t> recv_bytes) override;                     \
  Status all_to_all_v_bytes(const void* send, std::span<const size_t> send_bytes,             \
                            std::span<const size_t> send_offsets, void* recv,                 \
                            std::span<const size_t> recv_bytes,                               \
                            std::span<const size_t> recv_offsets) override;                   \
  Status reduce_scatter_v_f32(const float* send, std::span<const size_t> counts, float* recv) \
      override;                                                                               \
  Status all_reduce_f32(const float* send, float* recv, size_t count) override;               \
  StatusOr<std::shared_ptr<SharedBuffer>> alloc_shared(size_t bytes) override;                \
  StatusOr<Request> isend(int dst, int tag, const void* data, size_t bytes) override;         \
  StatusOr<Request> irecv(int src, int tag, void* data, size_t bytes) override;

namespace moed::internal {

// The async step this thread runs (dispatch/steps.cc): its world and ticket; none elsewhere.
struct AsyncStepThread {
  const World* world = nullptr;
  uint64_t ticket = 0;
};
inline thread_local AsyncStepThread t_async_step;

// Every call on a world waits its turn first: until every async step ticketed before it has
// finished (on an async step's own thread, the steps before that one). Steps run one at a time
// in ticket order, so they finish in it. Bounded by the world's timeout.
inline Status wait_turn(World& w) {
  World::AsyncSteps& steps = w.async_steps();
  const uint64_t before = t_async_step.world == &w ? t_async_step.ticket - 1
                                                   : steps.taken.load(std::memory_order_acquire);
  if (steps.finished.load(std::memory_order_acquire) >= before) return ok_status();
  return poll_until(
      w, [&] { return steps.finished.load(std::memory_order_acquire) >= before; },
      [&] {
        return str_cat("rank ", w.rank(),
                       ": a call on this world waited for an async step (token_*(async = true)) "
                       "still running on it; wait on the step's request first");
      });
}

// Every call starts with its turn, then the world's call hook (World::set_call_hook).
inline Status enter_call(World& w, const char* call) {
  MOED_RETURN_IF_ERROR(wait_turn(w));
  return w.call_hook() ? w.call_hook()(call) : ok_status();
}

// Every collective `call` starts so: a world that has failed fails it; else it is counted.
inline Status start_collective(World& w, const char* call) {
  MOED_RETURN_IF_ERROR(enter_call(w, call));
  MOED_RETURN_IF_ERROR(w.failure());
  ++w.counters().collectives;
  return ok_status();
}

// Point to point starts so (start_p2p): its turn, then posting fails only when the peer itself
// has failed (another rank's failure shows in the wait, which the low-latency shrink mode may
// ask to go on past it). The error is the world's first failure, the root cause (a peer that
// failed after it usually echoes it).
inline Status peer_failure(const World& w, int peer) {
  if (peer < 0 || peer >= w.size() || !w.rank_failed(peer)) return ok_status();
  Status first = w.failure();
  return first.ok() ? aborted("rank ", peer, " failed") : first;
}
inline Status start_p2p(World& w, int peer, const char* call) {
  MOED_RETURN_IF_ERROR(enter_call(w, call));
  return peer_failure(w, peer);
}

// World::shrink's nodes: G' = the gcd of the survivors per old node, so that runs of G'
// members (ascending ranks, node-major) stay inside one old node.
inline int shrunk_ranks_per_node(const World& w, std::span<const int> members) {
  std::vector<int> per_node(size_t(w.num_nodes()), 0);
  for (int m : members) ++per_node[size_t(w.node_of(m))];
  int g = 0;
  for (int n : per_node) g = std::gcd(g, n);
  return std::max(g, 1);
}

// Counts `bytes` this rank sends to `dst`: nothing to itself, shared within a node, network
// between nodes (the rule every collective and isend follows).
inline void count_send(World& w, int dst, uint64_t bytes) {
  if (dst == w.rank() || bytes == 0) return;
  if (w.same_node(dst, w.rank())) {
    w.add_shared_bytes(bytes);
  } else {
    w.add_network_bytes(bytes);
  }
}

// Counts a send of `bytes` to every rank (a broadcast's root, an all-gather, an all-reduce).
inline void count_send_to_all(World& w, uint64_t bytes) {
  for (int d = 0; d < w.size(); ++d) count_send(w, d, bytes);
}

// Rank `rank`'s span `name` has one entry per rank of the `n`.
inline Status check_length(const char* op, int rank, const char* name, size_t length, size_t n) {
  if (length == n) return ok_status();
  return invalid_argument(op, ": rank ", rank, " passed ", name, " of length ", length,
                          "; must be the world size ", n);
}

// The four spans of rank `rank`'s all-to-all-v, each one entry per rank.
inline Status check_exchange_lengths(const char* op, int rank, size_t n,
                                     std::span<const size_t> send_sizes,
                                     std::span<const size_t> send_offsets,
                                     std::span<const size_t> recv_sizes,
                                     std::span<const size_t> recv_offsets) {
  MOED_RETURN_IF_ERROR(check_length(op, rank, "send sizes", send_sizes.size(), n));
  MOED_RETURN_IF_ERROR(check_length(op, rank, "send offsets", send_offsets.size(), n));
  MOED_RETURN_IF_ERROR(check_length(op, rank, "recv sizes", recv_sizes.size(), n));
  return check_length(op, rank, "recv offsets", recv_offsets.size(), n);
}

// Rank `rank` expects want(s) bytes from each rank s, which sends sent(s).
template <typename Want, typename Sent>
Status check_recv_sizes(const char* op, int rank, int size, const Want& want, const Sent& sent) {
  for (int s = 0; s < size; ++s) {
    if (want(s) != sent(s)) {
      return invalid_argument(op, ": rank ", rank, " expects ", want(s), " bytes from rank ", s,
                              ", which sends ", sent(s));
    }
  }
  return ok_status();
}

// Rank `rank`'s all-gather-v: one recv size per rank, each the bytes that rank sends (sent(s)).
template <typename Sent>
Status check_all_gather_v(int rank, int size, std::span<const size_t> recv_bytes,
                          const Sent& sent) {
  MOED_RETURN_IF_ERROR(
      check_length("all_gather_v", rank, "recv sizes", recv_bytes.size(), size_t(size)));
  return check_recv_sizes(
      "all_gather_v", rank, size, [&](int s) { return recv_bytes[size_t(s)]; }, sent);
}

// Every rank's value_of(r) (its `what`) equals rank 0's.
template <typename ValueOf>
Status check_same_as_rank0(const char* op, const char* what, int size, const ValueOf& value_of) {
  for (int r = 0; r < size; ++r) {
    if (value_of(r) != value_of(0)) {
      return invalid_argument(op, ": rank ", r, " has ", what, " ", value_of(r), ", rank 0 has ",
                              value_of(0));
    }
  }
  return ok_status();
}

// A broadcast's arguments: every rank names the same root, inside the world, and expects as
// many bytes as the root sends.
template <typename RootOf, typename BytesOf>
Status check_broadcast(int size, int root, const RootOf& root_of, const BytesOf& bytes_of) {
  MOED_RETURN_IF_ERROR(check_same_as_rank0("broadcast", "root", size, root_of));
  if (root < 0 || root >= size) {
    return invalid_argument("broadcast: root = ", root, " is outside [0, ", size, ")");
  }
  for (int r = 0; r < size; ++r) {
    if (bytes_of(r) != bytes_of(root)) {
      return invalid_argument("broadcast: rank ", r, " expects ", bytes_of(r), " bytes, root ",
                              root, " sends ", bytes_of(root));
    }
  }
  return ok_status();
}

// Rank `rank` passed one reduce-scatter count per rank of the `n`.
inline Status check_counts_length(int rank, size_t length, size_t n) {
  if (length == n) return ok_status();
  return invalid_argument("reduce_scatter_v_f32: rank ", rank, " passed ", length,
                          " counts; must be world size ", n);
}

// Rank r's `n` reduce-scatter counts equal rank 0's.
template <typename T>
Status check_counts_match(size_t r, const T* counts, const T* counts0, size_t n) {
  for (size_t d = 0; d < n; ++d) {
    if (counts[d] != counts0[d]) {
      return invalid_argument("reduce_scatter_v_f32: rank ", r, " has counts[", d,
                              "] = ", counts[d], ", rank 0 has ", counts0[d]);
    }
  }
  return ok_status();
}

}  // namespace moed::internal
