// Where a low-latency dispatch puts its rows and how its receive places them, for dispatch.cc
// (the push) and segment_dispatch.cc (shrink mode) alike: the network messages (NetPlan), the
// send of every (token, expert) row (send_rows), and the receive's counts, packed layout and
// copies (Received).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <vector>

#include "dispatch/flex/message.h"
#include "dispatch/low_latency/phases.h"
#include "dispatch/sections.h"

namespace moed::low_latency {

// The row a send reads for token t: its payload, then its FP8 scales (this half's cast of x),
// or x's bf16 row.
inline const std::byte* token_row(const DispatchHalf& dh, const LowLatencyDispatchInput& in,
                                  const RowFormat& f, int64_t t) {
  return in.use_fp8 ? dh.fp8_rows.data() + size_t(t) * f.row_bytes()
                    : static_cast<const std::byte*>(in.x.row_ptr(t));
}

// One message per rank d on another node at block[d] of the half's net_send, in the one wire
// layout (flex/message.h, design.md §6.5): per token bound for d, in token order, a header and
// an entry (global expert, prob, top-k column) per expert of d it goes to, then its row once.
// The plan writes the headers and entries; send_rows copies the rows in, or, with `gather`,
// the message goes as a gather list (pieces) whose rows are read where they lie: only where
// the call waits for its sends before it returns, as a call without a receive hook does. Ranks
// whose `live` entry is 0 (shrink mode's masked ranks; empty: all live) get none.
struct NetPlan {
  std::vector<size_t> block;                // [R]
  std::vector<int32_t> tokens;              // [R] tokens in the message to d
  std::vector<flex::MessageLayout> layout;  // [R]
  std::vector<int32_t> row;                 // [T * K] see row_of
  bool gather = false;

  NetPlan(const LowLatencyBuffer::State& st, const TopkView& routing, int64_t num_tokens,
          std::span<const uint8_t> live, const RowFormat& f, DispatchHalf& dh, bool gather_rows)
      : block(size_t(st.layout.num_ranks), 0),
        tokens(size_t(st.layout.num_ranks), 0),
        layout(size_t(st.layout.num_ranks)),
        row(size_t(num_tokens) * size_t(routing.num_topk), -1),
        gather(gather_rows) {
    const int R = st.layout.num_ranks, K = routing.num_topk, me = st.world->rank();
    auto remote = [&](int64_t t, int k) {  // d of (t, k) when its rank is on another node
      const int e = int(routing.at(t, k));
      if (e < 0) return -1;
      const int d = e / st.layout.num_local_experts;
      const bool go = !st.world->same_node(d, me) && (live.empty() || live[size_t(d)] != 0);
      return go ? d : -1;
    };
    // The entries of each token of each message, then the messages' places.
    std::vector<std::vector<int32_t>> entries(static_cast<size_t>(R));
    std::vector<int64_t> last(size_t(R), -1);
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int k = 0; k < K; ++k) {
        const int d = remote(t, k);
        if (d < 0) continue;
        std::vector<int32_t>& n = entries[size_t(d)];
        if (last[size_t(d)] != t) {
          last[size_t(d)] = t;
          row[size_t(t) * K + k] = int32_t(n.size());
          n.push_back(0);
        }
        ++n.back();
      }
    }
    Sections messages(64);
    for (int d = 0; d < R; ++d) {
      const std::vector<int32_t>& n = entries[size_t(d)];
      if (n.empty()) continue;
      tokens[size_t(d)] = int32_t(n.size());
      layout[size_t(d)] = flex::MessageLayout::of(int64_t(n.size()),
                                                  std::accumulate(n.begin(), n.end(), int64_t(0)),
                                                  f.payload, f.scale_bytes);
      block[size_t(d)] = messages.add(layout[size_t(d)].bytes);
    }
    dh.net_send.resize(messages.aligned_end());
    // The headers and entries, each token's entries in top-k order.
    std::vector<size_t> entry(size_t(R), 0);
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int k = 0; k < K; ++k) {
        const int d = remote(t, k);
        if (d < 0) continue;
        const flex::Message<std::byte> m = message(dh, d);
        if (const int32_t i = row[size_t(t) * K + k]; i >= 0) {
          m.put_header(size_t(i), {int32_t(t),
                                   entries[size_t(d)][size_t(i)],
                                   uint64_t(1) << (d % st.world->ranks_per_node()),
                                   {}});
        }
        m.put_entry(entry[size_t(d)]++, {int32_t(routing.at(t, k)), routing.weight(t, k), k});
      }
    }
  }
  // The token's index in the message to d when k is its first entry there (its row goes
  // once), else -1.
  int32_t row_of(int64_t t, int k, int K) const { return row[size_t(t) * K + k]; }
  flex::Message<std::byte> message(DispatchHalf& dh, int d) const {
    return {dh.net_send.data() + block[size_t(d)], layout[size_t(d)]};
  }
  std::span<const std::byte> bytes(const DispatchHalf& dh, int d) const {
    return {dh.net_send.data() + block[size_t(d)], tokens[size_t(d)] ? layout[size_t(d)].bytes : 0};
  }
  // With `gather`: the message to d as a gather list, its rows where the send reads them.
  void pieces(DispatchHalf& dh, int d, const LowLatencyDispatchInput& in, const RowFormat& f,
              std::vector<World::Piece>& out) const {
    const flex::Message<std::byte> m = message(dh, d);
    const size_t n = size_t(tokens[size_t(d)]);
    std::vector<const char*> rows(f.scale_bytes ? 2 * n : n);
    for (size_t i = 0; i < n; ++i) {
      const auto* r = reinterpret_cast<const char*>(token_row(dh, in, f, m.header(i).src_token));
      rows[i] = r;
      if (f.scale_bytes) rows[n + i] = r + f.payload;
    }
    flex::message_pieces(layout[size_t(d)], reinterpret_cast<const char*>(bytes(dh, d).data()),
                         rows, n, out);
  }
};

// Writes every (token, expert) row where its receiver reads it: on this node through
// `put(d, e, i, row, t, prob, copier)` (rank d, expert e, the row's slot i in this rank's chunk
// of e, the token's row, its index and prob), the message for another node as `plan` says.
// Rows for a rank whose `live` entry is 0 (shrink mode's masked ranks; empty: all live) are
// not sent. With `stream`, put copies through non-temporal stores, fenced per worker. Counts
// the rows that cross into another rank's memory per worker.
template <typename Put>
void send_rows(LowLatencyBuffer::State& st, const LowLatencyDispatchInput& in,
               const LowLatencyHandle& h, int half, const RowFormat& f, const NetPlan& plan,
               std::span<const uint8_t> live, bool stream, Put&& put,
               std::vector<uint64_t>& shared_rows) {
  World& w = *st.world;
  DispatchHalf& dh = st.dispatch_half[half];
  const TopkView& routing = in.topk;
  const int L = st.layout.num_local_experts, K = routing.num_topk, me = w.rank();
  w.pool().parallel_for(in.x.rows, [&](int64_t t0, int64_t t1, int worker) {
    internal::RowCopier copier(f.payload, stream);
    for (int64_t t = t0; t < t1; ++t) {
      const std::byte* row = token_row(dh, in, f, t);
      for (int k = 0; k < K; ++k) {
        const int32_t e = int32_t(routing.at(t, k));
        if (e < 0 || (!live.empty() && live[size_t(e / L)] == 0)) continue;
        const int d = e / L;
        if (!w.same_node(d, me)) {
          const int32_t r = plan.row_of(t, k, K);
          if (r >= 0 && !plan.gather) plan.message(dh, d).put_row(size_t(r), row, row + f.payload);
          continue;
        }
        ++shared_rows[size_t(worker)];
        put(d, e, int64_t(h.slot[size_t(t) * K + k]), row, int32_t(t), routing.weight(t, k),
            copier);
      }
    }
    copier.finish();
  });
}

// Row r of the receive block at `base` gets a payload, its FP8 scales, token and prob.
inline void put_block_row(std::byte* base, const BlockLayout& lay, int64_t r, const RowFormat& f,
                          const std::byte* payload, const std::byte* scales, int32_t token,
                          float prob, internal::RowCopier& copier) {
  copier.copy(base + lay.x + size_t(r) * f.payload, payload);
  if (f.scale_bytes != 0) {
    std::memcpy(base + lay.scales + size_t(r) * f.scale_bytes, scales, f.scale_bytes);
  }
  std::memcpy(base + lay.src + size_t(r) * sizeof(int32_t), &token, sizeof(token));
  std::memcpy(base + lay.prob + size_t(r) * sizeof(float), &prob, sizeof(prob));
}

// Rows [from, from + n) of the block at `src` (layout `sl`) to packed rows [to, to + n) of rb;
// with stream, the payloads through non-temporal stores (the caller fences).
inline void copy_block_rows(const std::byte* src, const BlockLayout& sl, int64_t from,
                            ReceiveBlock& rb, int64_t to, size_t n, const RowFormat& f,
                            bool stream) {
  auto copy = [&](size_t dst_off, size_t src_off, size_t bytes, bool nt) {
    if (nt) {
      internal::stream_copy(rb.base + dst_off, src + src_off, bytes);
    } else {
      std::memcpy(rb.base + dst_off, src + src_off, bytes);
    }
  };
  copy(rb.lay.x + size_t(to) * f.payload, sl.x + size_t(from) * f.payload, n * f.payload, stream);
  copy(rb.lay.scales + size_t(to) * f.scale_bytes, sl.scales + size_t(from) * f.scale_bytes,
       n * f.scale_bytes, false);
  copy(rb.lay.src + size_t(to) * 4, sl.src + size_t(from) * 4, n * 4, false);
  copy(rb.lay.prob + size_t(to) * 4, sl.prob + size_t(from) * 4, n * 4, false);
}

// A row the receive copies into packed row `to`: its payload, its scales (FP8), its source
// token and prob.
struct RowPlace {
  int64_t to;
  const std::byte* row;
  const std::byte* scales;
  int32_t token;
  float prob;
};

// Copies every place into rb, in parallel from min_chunk places; with stream, non-temporal
// stores, fenced by each worker (the caller's threads read the rows next).
inline void copy_places(ThreadPool& pool, ReceiveBlock& rb, const RowFormat& f,
                        std::span<const RowPlace> places, bool stream, int64_t min_chunk) {
  auto copy = [&](int64_t p0, int64_t p1, int) {
    internal::RowCopier copier(f.payload, stream);
    for (int64_t p = p0; p < p1; ++p) {
      const RowPlace& pl = places[size_t(p)];
      put_block_row(rb.base, rb.lay, pl.to, f, pl.row, pl.scales, pl.token, pl.prob, copier);
    }
    copier.finish();
  };
  pool.parallel_for(int64_t(places.size()), copy, min_chunk);
}

// The receive phase's view of one dispatch: its half, its row format, every (local expert j,
// source s) count, [L][R], and the tokens of each source's message, [R].
struct Received {
  LowLatencyBuffer::State& st;
  DispatchHalf& dh;
  int half;
  uint64_t seq;
  RowFormat f;
  std::vector<int32_t> count;
  std::vector<int32_t> tokens;
  std::vector<size_t> block;  // [R]: where source s's message starts in dh.net_recv

  int32_t at(int j, int s) const { return count[size_t(j) * st.layout.num_ranks + s]; }
  int64_t rows_from(int s) const {
    int64_t n = 0;
    for (int j = 0; j < st.layout.num_local_experts; ++j) n += at(j, s);
    return n;
  }
  void drop(int s) {  // source s adds no rows
    const int R = st.layout.num_ranks;
    for (int j = 0; j < st.layout.num_local_experts; ++j) count[size_t(j) * R + s] = 0;
  }
  // Source s's counts and tokens from its header (header_ints).
  void read_header(int s, const int32_t* header) {
    const int R = st.layout.num_ranks, L = st.layout.num_local_experts;
    for (int j = 0; j < L; ++j) count[size_t(j) * R + s] = header[1 + j];
    tokens[size_t(s)] = header[1 + L];
  }
  bool sends_message(int s) const {
    return !st.world->same_node(s, st.world->rank()) && rows_from(s) > 0;
  }
  flex::MessageLayout message_layout(int s) const {
    return flex::MessageLayout::of(tokens[size_t(s)], rows_from(s), f.payload, f.scale_bytes);
  }
  // Room in dh.net_recv for a message from every source on another node, at block.
  void size_messages() {
    block.assign(size_t(st.layout.num_ranks), 0);
    Sections messages(64);
    for (int s = 0; s < st.layout.num_ranks; ++s) {
      if (sends_message(s)) block[size_t(s)] = messages.add(message_layout(s).bytes);
    }
    dh.net_recv.resize(messages.aligned_end());
  }
  std::span<std::byte> bytes(int s) const {
    return {dh.net_recv.data() + block[size_t(s)], sends_message(s) ? message_layout(s).bytes : 0};
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
  // Packs in-node chunk (j, s) from the sender's dispatch slots (`slots`: that half's block in
  // its segment); other nodes' rows are place_messages'. stream: the caller fences.
  void pack(ReceiveBlock& rb, int j, int s, const std::byte* slots, bool stream) const {
    const LowLatencyRange range = rb.layout_range[size_t(j) * st.layout.num_ranks + s];
    if (range.count == 0 || !st.world->same_node(s, st.world->rank())) return;
    const int64_t from =
        (int64_t(st.world->rank()) * st.layout.num_local_experts + j) * st.layout.max_tokens;
    const int64_t to = int64_t(j) * st.layout.rows_per_expert() + range.begin;
    copy_block_rows(slots, st.layout.slot_block, from, rb, to, size_t(range.count), f, stream);
  }
  // Where every entry of the other nodes' messages goes, appended to `places`: source s's
  // i-th token for expert j to begin(j, s) + i, the order of the sender's slots (token order).
  void place_messages(const ReceiveBlock& rb, std::vector<RowPlace>& places) const {
    const int R = st.layout.num_ranks, L = st.layout.num_local_experts;
    const int first_expert = st.world->rank() * L;
    std::vector<int32_t> next(static_cast<size_t>(L));
    for (int s = 0; s < R; ++s) {
      if (!sends_message(s)) continue;
      const flex::Message<const std::byte> m(bytes(s).data(), message_layout(s));
      std::fill(next.begin(), next.end(), 0);
      size_t q = 0;
      for (int32_t i = 0; i < tokens[size_t(s)]; ++i) {
        const flex::MessageHeader hd = m.header(size_t(i));
        for (int32_t n = 0; n < hd.num_entries; ++n, ++q) {
          const flex::MessageEntry en = m.entry(q);
          const int j = en.expert - first_expert;
          MOED_CHECK(j >= 0 && j < L && next[size_t(j)] < at(j, s), "rank ", s,
                     " sent an entry for expert ", en.expert, " beyond its counts");
          const LowLatencyRange range = rb.layout_range[size_t(j) * R + s];
          places.push_back(
              {int64_t(j) * st.layout.rows_per_expert() + range.begin + next[size_t(j)]++,
               m.payload(size_t(i)), m.scales(size_t(i)), hd.src_token, en.prob});
        }
      }
      MOED_CHECK(int64_t(q) == rows_from(s), "rank ", s, " sent ", q, " entries of ", rows_from(s));
    }
  }
};

}  // namespace moed::low_latency
