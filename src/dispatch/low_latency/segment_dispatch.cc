// A dispatch through the segments (segment.h; the protocol in segment_peers.h).
#include <algorithm>
#include <cstring>

#include "core/row_kernels.h"
#include "dispatch/low_latency/dispatch_rows.h"
#include "dispatch/low_latency/segment.h"
#include "dispatch/low_latency/segment_peers.h"

namespace moed::low_latency {

using segment::Call;
using segment::finish_receive;
using segment::kFp8Flag;
using segment::kHeaderFp8Flag;
using segment::open_call;
using segment::Peers;
using segment::post_dispatch_messages;
using segment::publish;
using segment::receive_dispatch_rows;
using segment::receive_parts;
using segment::State;

Status segment::post_dispatch_messages(Peers& peers, const LowLatencyHandle& handle, int half,
                                       uint64_t seq, const RowFormat& f, const NetPlan& plan,
                                       const Status& local, const LowLatencyDispatchInput& in) {
  const bool fp8 = in.use_fp8;
  State& st = peers.state();
  World& w = *st.world;
  DispatchHalf& dh = st.dispatch_half[half];
  const int R = st.layout.num_ranks, L = st.layout.num_local_experts;
  // What a call of this half that failed midway left (its requests) is dropped.
  dh.header_requests.clear();
  dh.header_requests.resize(size_t(R));
  dh.send_requests.clear();
  dh.send_peers.clear();
  Status posted;
  std::vector<World::Piece> pieces;
  for (int d = 0; d < R && posted.ok(); ++d) {
    if (peers.in_node(d) || peers.masked(d)) continue;
    int32_t* header = dh.send_header.data() + size_t(d) * header_ints(L);
    header[0] = int32_t(local.code()) | (fp8 ? kHeaderFp8Flag : 0);
    for (int j = 0; j < L; ++j) {
      header[1 + j] = local.ok() ? handle.send_count[size_t(d) * L + j] : 0;
    }
    header[1 + L] = plan.tokens[size_t(d)];
    auto send = [&](const void* data, size_t bytes, tags::LowLatencyKind kind) {
      if (!posted.ok()) return;
      posted = peers.post_send(d, w.isend(d, tags::low_latency(seq, kind), data, bytes),
                               dh.send_requests, dh.send_peers);
    };
    send(header, header_ints(L) * sizeof(int32_t), tags::LowLatencyKind::kDispatchHeader);
    const std::span<const std::byte> m = plan.bytes(dh, d);
    if (!m.empty() && plan.gather && posted.ok()) {
      plan.pieces(dh, d, in, f, pieces);
      posted = peers.post_send(
          d, w.isend_gather(d, tags::low_latency(seq, tags::LowLatencyKind::kDispatchData), pieces),
          dh.send_requests, dh.send_peers);
    } else if (!m.empty()) {
      send(m.data(), m.size(), tags::LowLatencyKind::kDispatchData);
    }
    if (!posted.ok()) break;
    posted = peers.post(d,
                        w.irecv(d, tags::low_latency(seq, tags::LowLatencyKind::kDispatchHeader),
                                dh.recv_header.data() + size_t(d) * header_ints(L),
                                header_ints(L) * sizeof(int32_t)),
                        dh.header_requests[size_t(d)]);
  }
  return posted;
}

Status segment::receive_dispatch_rows(Peers& peers, Received& rv, ReceiveBlock& rb,
                                      const std::function<void(bool)>& in_node) {
  State& st = rv.st;
  World& w = *st.world;
  DispatchHalf& dh = rv.dh;
  const int R = st.layout.num_ranks;
  rv.size_messages();
  std::vector<Request> data(static_cast<size_t>(R));
  Status net;  // outside shrink mode: the first failed message
  for (int s = 0; s < R && net.ok(); ++s) {
    const std::span<std::byte> m = rv.bytes(s);
    if (peers.in_node(s) || m.empty() || peers.masked(s)) continue;
    net = peers.post(s,
                     w.irecv(s, tags::low_latency(rv.seq, tags::LowLatencyKind::kDispatchData),
                             m.data(), m.size()),
                     data[size_t(s)]);
  }
  for (int s = 0; s < R; ++s) {
    if (!data[size_t(s)]) continue;
    StatusOr<bool> in = peers.wait(s, data[size_t(s)]);
    if (!in.ok() && net.ok()) net = in.status();
    if (in.ok() && !*in) rv.drop(s);
  }
  Status sent = peers.wait_sends(dh.send_requests, dh.send_peers);
  dh.header_requests.clear();  // dropped: cancelled where a masked peer never sent
  MOED_RETURN_IF_ERROR(net);
  MOED_RETURN_IF_ERROR(sent);
  // A source masked above after its counts were read adds no rows (its message is not read).
  for (int s = 0; s < R; ++s) {
    if (peers.masked(s)) rv.drop(s);
  }
  // Non-temporal stores when the node's blocks take many rows this call, counting the in-node
  // senders' too: they go into the same last-level cache.
  const bool stream = rv.stream(rv.set_layout(rb));
  in_node(stream);
  std::vector<RowPlace> places;
  rv.place_messages(rb, places);
  // A few rows (decode at T = 1) are copied on this thread: waking the pool costs more.
  const int64_t placed = int64_t(places.size());
  const bool inline_copy = size_t(placed) * rv.f.payload < kInlineBytes;
  copy_places(w.pool(), rb, rv.f, places, stream, inline_copy ? std::max<int64_t>(1, placed) : 1);
  return ok_status();
}

namespace {

Status receive_dispatch(State& st, LowLatencyHandle& handle, int half, uint64_t n, uint64_t seq,
                        bool fp8, ReceiveBlock& rb) {
  World& w = *st.world;
  const SegmentLayout& lay = st.layout;
  DispatchHalf& dh = st.dispatch_half[half];
  const int R = lay.num_ranks, L = lay.num_local_experts, me = w.rank();
  dh.pending = false;
  Peers peers(st, "low_latency_dispatch");
  Status bad;  // the first source whose verdict is an error

  // Counts of every (local expert j, source s): in-node sources in their segment, the others
  // in their header; then the rows of other nodes.
  Received rv{st,
              dh,
              half,
              seq,
              RowFormat::of(lay, fp8),
              std::vector<int32_t>(size_t(L) * R, 0),
              std::vector<int32_t>(size_t(R), 0)};
  std::vector<bool> from_segment(size_t(R), false);
  auto read_counts = [&](int s, std::optional<uint64_t> published) -> StatusOr<uint64_t> {
    if (published) {
      const auto* c = reinterpret_cast<const std::atomic<uint64_t>*>(st.segment(st.local_of(s)) +
                                                                     lay.counts[half]);
      for (int j = 0; j < L; ++j) {
        rv.count[size_t(j) * R + s] =
            int32_t(c[size_t(me) * L + j].load(std::memory_order_relaxed));
      }
      return *published;
    }
    const int32_t* header = dh.recv_header.data() + size_t(s) * header_ints(L);
    rv.read_header(s, header);
    return uint64_t(uint32_t(header[0] & ~kHeaderFp8Flag)) |
           ((header[0] & kHeaderFp8Flag) != 0 ? kFp8Flag : 0);
  };
  MOED_RETURN_IF_ERROR(receive_parts(st, peers, CallKind::kDispatch, half, n, fp8, false,
                                     dh.header_requests, from_segment, bad, read_counts,
                                     [&](int s) { rv.drop(s); }));
  auto pack = [&](bool stream) {
    w.pool().parallel_for(int64_t(L) * R, [&](int64_t c0, int64_t c1, int) {
      for (int64_t c = c0; c < c1; ++c) {
        const int s = int(c % R);
        rv.pack(rb, int(c / R), s, st.segment(st.local_of(s)) + lay.slots[half], stream);
      }
      if (stream) internal::stream_fence();
    });
  };
  MOED_RETURN_IF_ERROR(receive_dispatch_rows(peers, rv, rb, pack));
  MOED_RETURN_IF_ERROR(finish_receive(st, peers, CallKind::kDispatch, half, n, from_segment));
  handle.layout_range = rb.layout_range;
  handle.received = true;
  MOED_RETURN_IF_ERROR(dh.local_check);
  return bad;
}

}  // namespace

StatusOr<LowLatencyDispatchOutput> segment_dispatch(const std::shared_ptr<State>& sp,
                                                    const LowLatencyDispatchInput& in,
                                                    const Status& local) {
  State& st = *sp;
  World& w = *st.world;
  Peers peers(st, "low_latency_dispatch");
  const SegmentLayout& lay = st.layout;
  const int R = lay.num_ranks, L = lay.num_local_experts;
  MOED_ASSIGN_OR_RETURN(const Call call, open_call(st, peers, CallKind::kDispatch, st.dispatches,
                                                   st.dispatch_half, local));
  const int half = call.half;
  const uint64_t n = call.n, seq = call.seq;
  DispatchHalf& dh = st.dispatch_half[half];

  const bool ok = local.ok(), fp8 = in.use_fp8;
  const int64_t T = ok ? in.x.rows : 0;
  const TopkView none{nullptr, false, nullptr, 0, in.topk.num_topk > 0 ? in.topk.num_topk : 1};
  std::shared_ptr<LowLatencyHandle> handle = new_dispatch_handle(st, ok ? in.topk : none, T);
  const RowFormat f = RowFormat::of(lay, fp8);
  if (ok && fp8) cast_fp8_rows(st, in, dh.fp8_rows);

  // Counts and rows for in-node ranks in this rank's segment; one message per other node's rank.
  std::vector<uint8_t> live(static_cast<size_t>(R));
  std::vector<int32_t> count(size_t(lay.num_experts), 0);  // send_count to live ranks
  auto* counts = reinterpret_cast<std::atomic<uint64_t>*>(st.local() + lay.counts[half]);
  for (int e = 0; e < lay.num_experts; ++e) {
    live[size_t(e / L)] = !peers.masked(e / L);
    if (live[size_t(e / L)]) count[size_t(e)] = handle->send_count[size_t(e)];
    if (peers.in_node(e / L)) {
      counts[e].store(uint64_t(count[size_t(e)]), std::memory_order_relaxed);
    }
  }
  // Packed: with a hook, the sends may complete after the call returns, x then the caller's.
  const NetPlan plan(st, ok ? in.topk : none, T, live, f, dh, /*gather_rows=*/false);
  std::vector<uint64_t> shared_rows(size_t(w.pool().num_threads()), 0);
  if (ok) {
    const bool stream = stream_node_copy(w, size_t(T) * size_t(in.topk.num_topk) * f.payload);
    auto put = [&](int, int e, int64_t i, const std::byte* row, int32_t t, float p,
                   internal::RowCopier& copier) {
      put_block_row(st.local() + lay.slots[half], lay.slot_block, int64_t(e) * lay.max_tokens + i,
                    f, row, row + f.payload, t, p, copier);
    };
    send_rows(st, in, *handle, half, f, plan, live, stream, put, shared_rows);
  }
  publish(st, CallKind::kDispatch, half, n, local, fp8);
  Status posted = post_dispatch_messages(peers, *handle, half, seq, f, plan, local, in);
  if (!posted.ok()) {
    dh.pending = false;
    return posted;
  }
  add_shared_rows(w, shared_rows, f.row_bytes());

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
