// Shrink mode's dispatch (shrink.h; the protocol in shrink_peers.h).
#include <algorithm>
#include <cstring>

#include "core/row_kernels.h"
#include "dispatch/low_latency/shrink.h"
#include "dispatch/low_latency/shrink_peers.h"
#include "dispatch/sections.h"

namespace moed::low_latency {

using shrink_protocol::Call;
using shrink_protocol::finish_receive;
using shrink_protocol::kFp8Flag;
using shrink_protocol::kHeaderFp8Flag;
using shrink_protocol::open_call;
using shrink_protocol::Peers;
using shrink_protocol::publish;
using shrink_protocol::State;
using shrink_protocol::verdict_error;
using shrink_protocol::wait_published;

namespace {

Status receive_dispatch(State& st, LowLatencyHandle& handle, int half, uint64_t n, uint64_t seq,
                        bool fp8, ReceiveBlock& rb) {
  World& w = *st.world;
  const SegmentLayout& lay = st.layout;
  DispatchHalf& dh = st.dispatch_half[half];
  const int R = lay.num_ranks, L = lay.num_local_experts, me = w.rank();
  const int64_t M = lay.max_tokens;
  const RowFormat f = RowFormat::of(lay, fp8);
  dh.pending = false;
  Peers peers(st, "low_latency_dispatch");
  Status bad;  // the first source whose verdict is an error

  // Counts of every (local expert j, source s): in-node sources in their segment, the others
  // in their header; then the rows of other nodes.
  std::vector<int32_t> count(size_t(L) * R, 0);
  std::vector<bool> from_segment(size_t(R), false);
  std::vector<size_t> block(size_t(R), 0);
  std::vector<Request> data(static_cast<size_t>(R));
  Sections messages(64);
  for (int s = 0; s < R; ++s) {
    if (peers.masked(s)) continue;
    uint64_t verdict = 0;
    if (peers.in_node(s)) {
      MOED_ASSIGN_OR_RETURN(std::optional<uint64_t> published,
                            wait_published(st, peers, PullKind::kDispatch, half, n, s));
      if (!published) continue;
      verdict = *published;
      const auto* c = reinterpret_cast<const std::atomic<uint64_t>*>(st.segment(st.local_of(s)) +
                                                                     lay.counts[half]);
      for (int j = 0; j < L; ++j) {
        count[size_t(j) * R + s] = int32_t(c[size_t(me) * L + j].load(std::memory_order_relaxed));
      }
      from_segment[size_t(s)] = true;
    } else {
      if (!peers.wait(s, dh.header_requests[size_t(s)])) continue;
      const int32_t* header = dh.recv_header.data() + size_t(s) * (L + 1);
      verdict = uint64_t(uint32_t(header[0] & ~kHeaderFp8Flag)) |
                ((header[0] & kHeaderFp8Flag) != 0 ? kFp8Flag : 0);
      int64_t rows = 0;
      for (int j = 0; j < L; ++j) rows += (count[size_t(j) * R + s] = header[1 + j]);
      block[size_t(s)] = messages.add(size_t(rows) * f.net_row_bytes());
    }
    Status v = verdict_error("low_latency_dispatch", n, s, verdict, fp8);
    if (!v.ok()) {
      if (bad.ok()) bad = v;
      for (int j = 0; j < L; ++j) count[size_t(j) * R + s] = 0;
    }
  }
  dh.net_recv.resize(messages.aligned_end());
  for (int s = 0; s < R; ++s) {
    int64_t rows = 0;
    for (int j = 0; j < L && !peers.in_node(s); ++j) rows += count[size_t(j) * R + s];
    if (rows == 0 || peers.masked(s)) continue;
    peers.post(s,
               w.irecv(s, tags::low_latency(seq, tags::LowLatencyKind::kDispatchData),
                       dh.net_recv.data() + block[size_t(s)], size_t(rows) * f.net_row_bytes()),
               data[size_t(s)]);
  }
  for (int s = 0; s < R; ++s) {
    if (data[size_t(s)] && !peers.wait(s, data[size_t(s)])) {
      for (int j = 0; j < L; ++j) count[size_t(j) * R + s] = 0;
    }
  }
  peers.wait_sends(dh.send_requests, dh.send_peers);
  dh.header_requests.clear();  // dropped: cancelled where a masked peer never sent
  dh.header_requests.resize(size_t(R));

  // Packed layout: expert j's rows from source s start at begin(j, s) = rows of sources < s;
  // a source masked above after its counts were read adds none.
  for (int j = 0; j < L; ++j) {
    int32_t begin = 0;
    for (int s = 0; s < R; ++s) {
      const int32_t c = peers.masked(s) ? 0 : count[size_t(j) * R + s];
      rb.layout_range[size_t(j) * R + s] = LowLatencyRange{begin, c};
      begin += c;
    }
    rb.recv_count[size_t(j)] = begin;
  }
  // first[j * R + s]: the row of (j, s) in source s's message; at j = L, its rows.
  std::vector<int64_t> first(size_t(L + 1) * R, 0);
  for (int j = 0; j < L; ++j) {
    for (int s = 0; s < R; ++s) {
      first[size_t(j + 1) * R + s] = first[size_t(j) * R + s] + count[size_t(j) * R + s];
    }
  }
  w.pool().parallel_for(int64_t(L) * R, [&](int64_t c0, int64_t c1, int) {
    for (int64_t c = c0; c < c1; ++c) {
      const int j = int(c / R), s = int(c % R);
      const LowLatencyRange range = rb.layout_range[size_t(c)];
      if (range.count == 0) continue;
      const int64_t to = int64_t(j) * lay.rows_per_expert() + range.begin;
      if (from_segment[size_t(s)]) {
        const int64_t from = (int64_t(me) * L + j) * M;  // the sender's slots (e, i)
        pack_rows(rb, to, size_t(range.count), f,
                  RowSpan::slots(st.segment(st.local_of(s)), lay, half, from, f));
        continue;
      }
      const NetRows m{dh.net_recv.data() + block[size_t(s)], size_t(first[size_t(L) * R + s]), f};
      pack_rows(rb, to, size_t(range.count), f, RowSpan::message(m, size_t(first[size_t(c)])));
    }
  });
  MOED_RETURN_IF_ERROR(finish_receive(st, peers, PullKind::kDispatch, half, n, from_segment));
  handle.layout_range = rb.layout_range;
  handle.received = true;
  MOED_RETURN_IF_ERROR(dh.shrink_local);
  return bad;
}

}  // namespace

StatusOr<LowLatencyDispatchOutput> shrink_dispatch(const std::shared_ptr<State>& sp,
                                                   const LowLatencyDispatchInput& in,
                                                   const Status& local) {
  State& st = *sp;
  World& w = *st.world;
  Peers peers(st, "low_latency_dispatch");
  const SegmentLayout& lay = st.layout;
  const int R = lay.num_ranks, L = lay.num_local_experts;
  const int64_t M = lay.max_tokens;
  MOED_ASSIGN_OR_RETURN(const Call call, open_call(st, peers, PullKind::kDispatch, st.dispatches,
                                                   st.dispatch_half, local));
  const int half = call.half;
  const uint64_t n = call.n, seq = call.seq;
  DispatchHalf& dh = st.dispatch_half[half];

  const bool ok = local.ok(), fp8 = in.use_fp8;
  const int64_t T = ok ? in.x.rows : 0;
  TopkRouting none;
  none.num_topk = in.topk ? in.topk->num_topk : 1;
  std::shared_ptr<LowLatencyHandle> handle = new_dispatch_handle(st, ok ? *in.topk : none, T);
  const RowFormat f = RowFormat::of(lay, fp8);
  if (ok && fp8) cast_fp8_rows(st, in, dh.fp8_rows);

  // Counts and rows for in-node ranks in this rank's segment; one message per other node's rank.
  std::byte* seg = st.local();
  auto* counts = reinterpret_cast<std::atomic<uint64_t>*>(seg + lay.counts[half]);
  std::vector<size_t> block(size_t(R), 0);
  std::vector<int64_t> block_rows(size_t(R), 0), chunk_row(size_t(lay.num_experts), 0);
  Sections messages(64);
  for (int d = 0; d < R; ++d) {
    const bool live = !peers.masked(d);
    for (int j = 0; j < L; ++j) {
      const int e = d * L + j;
      const int32_t c = live ? handle->send_count[size_t(e)] : 0;
      if (peers.in_node(d)) {
        counts[e].store(uint64_t(c), std::memory_order_relaxed);
      } else {
        chunk_row[size_t(e)] = block_rows[size_t(d)];
        block_rows[size_t(d)] += c;
      }
    }
    if (!peers.in_node(d)) {
      block[size_t(d)] = messages.add(size_t(block_rows[size_t(d)]) * f.net_row_bytes());
    }
  }
  dh.net_send.resize(messages.aligned_end());
  const bool has_weights =
      ok && in.topk->topk_weights.size() == size_t(T) * size_t(in.topk->num_topk);
  w.pool().parallel_for(T, [&](int64_t t0, int64_t t1, int) {
    const TopkRouting& routing = *in.topk;
    for (int64_t t = t0; t < t1; ++t) {
      const std::byte* row = fp8 ? dh.fp8_rows.data() + size_t(t) * f.row_bytes()
                                 : static_cast<const std::byte*>(in.x.row_ptr(t));
      for (int k = 0; k < routing.num_topk; ++k) {
        const int32_t e = routing.idx(t, k);
        if (e < 0 || peers.masked(e / L)) continue;
        const int d = e / L;
        const int64_t i = handle->slot[size_t(t) * routing.num_topk + k];
        const float p = has_weights ? routing.weight(t, k) : 0.0f;
        if (peers.in_node(d)) {
          put_slot(seg, lay, half, int64_t(e) * M + i, f, row, int32_t(t), p);
        } else {
          const NetRows m{dh.net_send.data() + block[size_t(d)], size_t(block_rows[size_t(d)]), f};
          m.put(size_t(chunk_row[size_t(e)] + i), row, int32_t(t), p);
        }
      }
    }
  });
  publish(st, PullKind::kDispatch, half, n, local, fp8);
  for (int d = 0; d < R; ++d) {
    if (peers.in_node(d) || peers.masked(d)) continue;
    int32_t* header = dh.send_header.data() + size_t(d) * (L + 1);
    header[0] = int32_t(local.code()) | (fp8 ? kHeaderFp8Flag : 0);
    for (int j = 0; j < L; ++j) header[1 + j] = ok ? handle->send_count[size_t(d) * L + j] : 0;
    auto send = [&](const void* data, size_t bytes, tags::LowLatencyKind kind) {
      peers.post_send(d, w.isend(d, tags::low_latency(seq, kind), data, bytes), dh.send_requests,
                      dh.send_peers);
    };
    send(header, size_t(L + 1) * sizeof(int32_t), tags::LowLatencyKind::kDispatchHeader);
    if (block_rows[size_t(d)] > 0) {
      send(dh.net_send.data() + block[size_t(d)], size_t(block_rows[size_t(d)]) * f.net_row_bytes(),
           tags::LowLatencyKind::kDispatchData);
    }
    peers.post(
        d,
        w.irecv(d, tags::low_latency(seq, tags::LowLatencyKind::kDispatchHeader),
                dh.recv_header.data() + size_t(d) * (L + 1), size_t(L + 1) * sizeof(int32_t)),
        dh.header_requests[size_t(d)]);
  }
  uint64_t shared_rows = 0;
  for (int e = 0; e < lay.num_experts; ++e) {
    if (peers.in_node(e / L) && !peers.masked(e / L))
      shared_rows += uint64_t(handle->send_count[size_t(e)]);
  }
  w.add_shared_bytes(shared_rows * f.row_bytes(), shared_rows);

  std::shared_ptr<ReceiveBlock> rb = take_receive_block(st, half, fp8);
  LowLatencyDispatchOutput out;
  view_receive_block(st, rb, out);
  out.handle = handle;
  auto receive = [sp, handle, half, n, seq, fp8, rb] {
    return receive_dispatch(*sp, *handle, half, n, seq, fp8, *rb);
  };
  // A rank with bad input receives at once (the peers' messages must not linger) and fails.
  if (!ok) {
    Status received = receive();
    return received.ok() ? local : received;
  }
  MOED_RETURN_IF_ERROR(receive_now_or_hook(in.return_recv_hook, std::move(receive), out.hook));
  return out;
}

}  // namespace moed::low_latency
