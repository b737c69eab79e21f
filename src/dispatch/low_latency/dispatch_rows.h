// Where a low-latency dispatch puts its rows and how its receive packs them, for dispatch.cc
// and segment_dispatch.cc alike: the network messages (NetPlan), the send of
// every (token, expert) row (send_rows), and the receive's counts, packed layout and copies
// (Received).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "dispatch/low_latency/phases.h"
#include "dispatch/sections.h"

namespace moed::low_latency {

// One message per rank d on another node at block[d] of the half's net_send, its chunk of
// local expert j starting at row chunk_row[d * L + j]. `count` [E]: the rows this rank sends
// to each expert.
struct NetPlan {
  std::vector<size_t> block;       // [R]
  std::vector<int64_t> rows;       // [R]
  std::vector<int64_t> chunk_row;  // [E]

  NetPlan(const LowLatencyBuffer::State& st, std::span<const int32_t> count, const RowFormat& f,
          DispatchHalf& dh)
      : block(size_t(st.layout.num_ranks), 0),
        rows(size_t(st.layout.num_ranks), 0),
        chunk_row(size_t(st.layout.num_experts), 0) {
    const World& w = *st.world;
    const int L = st.layout.num_local_experts;
    Sections messages(64);
    for (int d = 0; d < st.layout.num_ranks; ++d) {
      if (w.same_node(d, w.rank())) continue;
      for (int j = 0; j < L; ++j) {
        chunk_row[size_t(d) * L + j] = rows[size_t(d)];
        rows[size_t(d)] += count[size_t(d) * L + j];
      }
      block[size_t(d)] = messages.add(size_t(rows[size_t(d)]) * f.net_row_bytes());
    }
    dh.net_send.resize(messages.aligned_end());
  }
  NetRows message(DispatchHalf& dh, int d, const RowFormat& f) const {
    return {dh.net_send.data() + block[size_t(d)], size_t(rows[size_t(d)]), f};
  }
};

// Where the send phase writes the rows for its own node.
enum class InNode {
  kInPlace,    // nowhere: the receiver reads them in place (st.reads_in_place)
  kOwnSegment  // into this rank's slot (e, i), read once its sequence word says so
};

// Writes every (token, expert) row where its receiver reads it: on this node as `in_node`
// says (in-place mode records the token and prob beside this rank's rows instead), the message
// for another node as `plan` says. Rows for a rank whose `live` entry is 0 (shrink mode's
// masked ranks; empty: all live) are not sent. Counts the rows that cross into another rank's
// memory per worker.
inline void send_rows(LowLatencyBuffer::State& st, const LowLatencyDispatchInput& in,
                      const LowLatencyHandle& h, int half, const RowFormat& f,
                      const NetPlan& plan, InNode in_node, std::span<const uint8_t> live,
                      std::vector<uint64_t>& shared_rows) {
  World& w = *st.world;
  const SegmentLayout& lay = st.layout;
  DispatchHalf& dh = st.dispatch_half[half];
  const TopkView& routing = in.topk;
  const int L = lay.num_local_experts, K = routing.num_topk, me = w.rank();
  const int64_t T = in.x.rows;
  const bool stream =
      in_node == InNode::kOwnSegment && stream_node_copy(w, size_t(T) * size_t(K) * f.payload);
  w.pool().parallel_for(T, [&](int64_t t0, int64_t t1, int worker) {
    internal::StreamBatch batch(f.payload);
    for (int64_t t = t0; t < t1; ++t) {
      const std::byte* row = in.use_fp8 ? dh.fp8_rows.data() + size_t(t) * f.row_bytes()
                                        : static_cast<const std::byte*>(in.x.row_ptr(t));
      for (int k = 0; k < K; ++k) {
        const int32_t e = int32_t(routing.at(t, k));
        if (e < 0 || (!live.empty() && live[size_t(e / L)] == 0)) continue;
        const int d = e / L;
        const int64_t i = h.slot[size_t(t) * K + k];
        const float p = routing.weight(t, k);
        if (!w.same_node(d, me)) {
          plan.message(dh, d, f).put(size_t(plan.chunk_row[size_t(e)] + i), row, int32_t(t), p);
          continue;
        }
        // NOTE: a in_place row is counted here, by the rank whose row crosses the node (as when
        // it writes it itself, and as the planning model counts NVLink bytes), not by the reader.
        ++shared_rows[size_t(worker)];
        if (in_node == InNode::kInPlace) {
          dh.in_place_tokens[size_t(e) * size_t(lay.max_tokens) + size_t(i)] = int32_t(t);
          dh.in_place_probs[size_t(e) * size_t(lay.max_tokens) + size_t(i)] = p;
        } else {
          put_slot(st.local(), lay, half, int64_t(e) * lay.max_tokens + i, f, row, int32_t(t), p,
                   stream ? &batch : nullptr);
        }
      }
    }
    if (stream) {
      batch.flush();
      internal::stream_fence();
    }
  });
}

// The receive phase's view of one dispatch: its half, its row format and every (local expert
// j, source s) count, [L][R].
struct Received {
  LowLatencyBuffer::State& st;
  DispatchHalf& dh;
  int half;
  uint64_t seq;
  RowFormat f;
  std::vector<int32_t> count;
  // [(L + 1) * R]: the row of (j, s) in source s's network message; at j = L, its rows.
  std::vector<int64_t> first;
  std::vector<size_t> block;  // [R]: where source s's message starts in dh.net_recv

  int32_t at(int j, int s) const { return count[size_t(j) * st.layout.num_ranks + s]; }
  int64_t row_in_message(int j, int s) const { return first[size_t(j) * st.layout.num_ranks + s]; }
  int64_t rows_from(int s) const { return row_in_message(st.layout.num_local_experts, s); }
  void drop(int s) {  // source s adds no rows
    const int R = st.layout.num_ranks;
    for (int j = 0; j < st.layout.num_local_experts; ++j) count[size_t(j) * R + s] = 0;
  }
  void index_messages() {
    const int R = st.layout.num_ranks, L = st.layout.num_local_experts;
    first.assign(size_t(L + 1) * R, 0);
    for (int j = 0; j < L; ++j) {
      for (int s = 0; s < R; ++s) first[size_t(j + 1) * R + s] = row_in_message(j, s) + at(j, s);
    }
  }
  // Room in dh.net_recv for a message from every source on another node (rows_from), at block.
  void size_messages() {
    block.assign(size_t(st.layout.num_ranks), 0);
    Sections messages(64);
    for (int s = 0; s < st.layout.num_ranks; ++s) {
      if (!st.world->same_node(s, st.world->rank()))
        block[size_t(s)] = messages.add(size_t(rows_from(s)) * f.net_row_bytes());
    }
    dh.net_recv.resize(messages.aligned_end());
  }
  NetRows message(int s) const {
    return {dh.net_recv.data() + block[size_t(s)], size_t(rows_from(s)), f};
  }
  // The packed layout: expert j's rows from source s start at begin(j, s) = rows of sources
  // < s. Returns the rows received.
  int64_t set_layout(ReceiveBlock& rb) const {
    const int R = st.layout.num_ranks;
    int64_t received = 0;
    for (int j = 0; j < st.layout.num_local_experts; ++j) {
      int32_t begin = 0;
      for (int s = 0; s < R; ++s) {
        rb.layout_range[size_t(j) * R + s] = LowLatencyRange{begin, at(j, s)};
        begin += at(j, s);
      }
      rb.recv_count[size_t(j)] = begin;
      received += begin;
    }
    return received;
  }
  bool stream(int64_t received) const {
    return stream_node_copy(*st.world, size_t(received) * f.payload);
  }
  // Packs chunk (j, s) from its message, or from the in-node slots `slot_row(j, s)` (a
  // RowSpan); a chunk `skip(s)` says another copy takes is left. stream: the caller fences.
  template <typename SlotRow, typename Skip>
  void pack(ReceiveBlock& rb, int j, int s, const SlotRow& slot_row, const Skip& skip,
            bool stream) const {
    const LowLatencyRange range = rb.layout_range[size_t(j) * st.layout.num_ranks + s];
    if (range.count == 0 || skip(s)) return;
    const int64_t to = int64_t(j) * st.layout.rows_per_expert() + range.begin;
    pack_rows(rb, to, size_t(range.count), f,
              st.world->same_node(s, st.world->rank())
                  ? slot_row(j, s)
                  : RowSpan::message(message(s), size_t(row_in_message(j, s))),
              stream);
  }
};

}  // namespace moed::low_latency
