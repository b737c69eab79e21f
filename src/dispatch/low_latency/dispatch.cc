// low_latency_dispatch. Shrink mode goes through the segments (segment_dispatch.cc); every
// other call pushes (state.h): its opening agreement gathers every rank's counts per expert and
// held receive blocks, each sender writes its in-node rows once, straight into their packed
// place in the receiver's block (source ascending, token ascending), and signals it, and other
// nodes get one message each (segment_peers.h), which the receiver places.
#include <algorithm>
#include <cstring>

#include "comm/agreement.h"
#include "core/block_cache.h"
#include "core/row_checks.h"
#include "core/row_kernels.h"
#include "dispatch/low_latency/dispatch_rows.h"
#include "dispatch/low_latency/segment.h"
#include "dispatch/low_latency/segment_peers.h"

namespace moed {

namespace {

using low_latency::DispatchHalf;
using low_latency::NetPlan;
using low_latency::ReceiveBlock;
using low_latency::Received;
using low_latency::RowFormat;
using low_latency::SegmentLayout;

Status check_dispatch(const LowLatencyBuffer::State& st, const LowLatencyDispatchInput& in,
                      const Status& caller_error) {
  if (!caller_error.ok()) return caller_error;
  const SegmentLayout& lay = st.layout;
  const TensorView& x = in.x;
  if (x.dtype != DType::kBF16) {
    return invalid_argument("low_latency_dispatch: x must be bf16; got ", dtype_name(x.dtype));
  }
  if (x.cols != lay.hidden) {
    return invalid_argument("low_latency_dispatch: x has hidden = ", x.cols,
                            " but the buffer was made for hidden = ", lay.hidden);
  }
  if (x.rows < 0 || x.rows > lay.max_tokens) {
    return invalid_argument("low_latency_dispatch: x has ", x.rows,
                            " rows > max_tokens_per_rank = ", lay.max_tokens);
  }
  MOED_RETURN_IF_ERROR(moed::internal::check_token_rows("low_latency_dispatch: x", {x, {}}));
  if (in.use_fp8 && lay.hidden % kFp8BlockSize != 0) {
    return invalid_argument("low_latency_dispatch: use_fp8 needs hidden to be a multiple of ",
                            kFp8BlockSize, "; hidden = ", lay.hidden);
  }
  const TopkView& r = in.topk;
  if (r.num_tokens != x.rows) {
    return invalid_argument("low_latency_dispatch: topk_idx has ", r.num_tokens,
                            " tokens but x has ", x.rows, " rows");
  }
  if (r.num_topk <= 0) {
    return invalid_argument("low_latency_dispatch: num_topk = ", r.num_topk, " must be positive");
  }
  // No weights at dispatch (as DeepEP's): only the indices are checked.
  MOED_RETURN_IF_ERROR(validate(r.indices(), lay.num_experts));
  const DispatchHalf& half = st.dispatch_half[st.dispatches % 2];
  if (half.pending) {
    return failed_precondition(
        "low_latency_dispatch: two dispatches are already in flight; "
        "call the hook of dispatch #",
        st.dispatches - 2, " first");
  }
  return ok_status();
}

// The opening agreement of a push: every rank's inputs (as World::agree, whose message the
// error path fetches), and per rank [held ring slots, send_count [E]]. Fills dh.agreed_count
// ([R][L], source s's count for this rank's expert j), `begin` [E] (where this rank's chunk of
// expert e starts in its receiver's packed layout: the rows of lower sources) and the ring
// slot every receiver of this node uses.
Status agree_counts(LowLatencyBuffer::State& st, const Status& local, const LowLatencyHandle& h,
                    DispatchHalf& dh, std::vector<int32_t>& begin, int& slot) {
  World& w = *st.world;
  const int R = w.size(), E = st.layout.num_experts, L = st.layout.num_local_experts;
  std::vector<int64_t> payload(1 + size_t(E), 0);
  payload[0] = int64_t(st.recv_ring.held_mask());
  for (int e = 0; e < E; ++e) payload[1 + size_t(e)] = h.send_count[size_t(e)];
  MOED_ASSIGN_OR_RETURN(AgreedTable table, agree_in_one(w, local, {}, payload));
  dh.agreed_count.assign(size_t(R) * L, 0);
  begin.assign(size_t(E), 0);
  for (int s = 0; s < R; ++s) {
    const int64_t* counts = table.payload(s) + 1;
    for (int j = 0; j < L; ++j)
      dh.agreed_count[size_t(s) * L + j] = int32_t(counts[w.rank() * L + j]);
    if (s >= w.rank()) continue;
    for (int e = 0; e < E; ++e) begin[size_t(e)] += int32_t(counts[e]);
  }
  slot = st.recv_ring.pick(st.topo, [&](int r) { return uint64_t(table.payload(r)[0]); });
  return ok_status();
}

// Fills rv.count: the in-node sources' counts came with the opening agreement; other nodes
// sent theirs in a header (dispatch_rows.h, header_ints; the agreement passed the verdicts).
Status receive_counts(Received& rv) {
  LowLatencyBuffer::State& st = rv.st;
  World& w = *st.world;
  DispatchHalf& dh = rv.dh;
  const int R = st.layout.num_ranks, L = st.layout.num_local_experts, me = w.rank();
  MOED_RETURN_IF_ERROR(wait_all(dh.header_requests));
  rv.count.assign(size_t(L) * R, 0);
  rv.tokens.assign(size_t(R), 0);
  for (int s = 0; s < R; ++s) {
    if (!w.same_node(s, me)) {
      rv.read_header(s, dh.recv_header.data() + size_t(s) * low_latency::header_ints(L));
      continue;
    }
    for (int j = 0; j < L; ++j) rv.count[size_t(j) * R + s] = dh.agreed_count[size_t(s) * L + j];
  }
  return ok_status();
}

// Receive phase of push dispatch `n` (operation `seq`) of `half`, into `rb`: the other nodes'
// messages placed, then the in-node senders' signals.
Status receive_dispatch(LowLatencyBuffer::State& st, LowLatencyHandle& handle, int half, uint64_t n,
                        uint64_t seq, ReceiveBlock& rb) {
  DispatchHalf& dh = st.dispatch_half[half];
  dh.pending = false;
  Received rv{st, dh, half, seq, RowFormat::of(st.layout, rb.fp8)};
  low_latency::segment::Peers peers(st, "low_latency_dispatch");
  if (Status counted = receive_counts(rv); !counted.ok()) {
    dh.send_requests.clear();  // dropped: an unmatched send (a gather list) no longer reads x
    dh.send_peers.clear();
    return counted;
  }
  // Also waits for this call's sends (the gather lists read x); the in-node senders wrote
  // their rows themselves.
  MOED_RETURN_IF_ERROR(
      low_latency::segment::receive_dispatch_rows(peers, rv, rb, [](bool /*stream*/) {}));
  MOED_RETURN_IF_ERROR(st.dispatch_signals.wait_all(n));
  handle.layout_range = rb.layout_range;
  handle.received = true;
  return ok_status();
}

// The send phase of a push after its agreement: this rank's in-node rows into their receivers'
// blocks of ring slot `slot`, signalled, then the messages to other nodes.
Status push_rows(LowLatencyBuffer::State& st, const LowLatencyDispatchInput& in,
                 const LowLatencyHandle& handle, int half, uint64_t n, uint64_t seq, int slot,
                 std::span<const int32_t> begin) {
  World& w = *st.world;
  const SegmentLayout& lay = st.layout;
  DispatchHalf& dh = st.dispatch_half[half];
  const RowFormat f = RowFormat::of(lay, in.use_fp8);
  const flex::Region& region = st.recv_ring.region(slot);
  const int64_t T = in.x.rows;
  // The messages to other nodes are gather lists, their rows read from x (or this half's FP8
  // rows) by the transport, when the call waits for its sends before it returns.
  const NetPlan plan(st, in.topk, T, {}, f, dh, /*gather_rows=*/!in.return_recv_hook);
  // Non-temporal stores when the node's blocks take many rows this call: as many as this rank
  // sends, on average over the receivers (the receive decides the same for other nodes' rows).
  const bool stream = low_latency::stream_node_copy(w, handle.slot.size() * f.payload);
  auto put = [&](int d, int e, int64_t i, const std::byte* row, int32_t t, float p,
                 internal::RowCopier& copier) {
    const int64_t to =
        int64_t(e % lay.num_local_experts) * lay.rows_per_expert() + begin[size_t(e)] + i;
    auto* block = reinterpret_cast<std::byte*>(region.peer(st.local_of(d)));
    low_latency::put_block_row(block, st.block_layout, to, f, row, row + f.payload, t, p, copier);
  };
  std::vector<uint64_t> shared_rows(size_t(w.pool().num_threads()), 0);
  low_latency::send_rows(st, in, handle, half, f, plan, {}, stream, put, shared_rows);
  st.dispatch_signals.signal_all(n);
  low_latency::add_shared_rows(w, shared_rows, f.row_bytes());
  low_latency::segment::Peers peers(st, "low_latency_dispatch");
  Status posted = low_latency::segment::post_dispatch_messages(peers, handle, half, seq, f, plan,
                                                               ok_status(), in);
  if (!posted.ok()) {
    dh.send_requests.clear();  // dropped: an unmatched send (a gather list) no longer reads x
    dh.send_peers.clear();
  }
  return posted;
}

}  // namespace

StatusOr<LowLatencyDispatchOutput> LowLatencyBuffer::low_latency_dispatch(
    const LowLatencyDispatchInput& in, const Status& caller_error) {
  State& st = *state_;
  const Status local = check_dispatch(st, in, caller_error);
  if (st.shrink) return low_latency::segment_dispatch(state_, in, local);
  const TopkView none{nullptr, false, nullptr, 0, 1};
  std::shared_ptr<LowLatencyHandle> handle =
      low_latency::new_dispatch_handle(st, local.ok() ? in.topk : none, local.ok() ? in.x.rows : 0);
  const int half = int(st.dispatches % 2);
  DispatchHalf& dh = st.dispatch_half[half];
  std::vector<int32_t> begin;
  int slot = 0;
  // The cast comes first, so that a rank casts while it would wait for the others in the
  // agreement (the half's FP8 rows are free: its last dispatch's sends are done).
  if (local.ok() && in.use_fp8) low_latency::cast_fp8_rows(st, in, dh.fp8_rows);
  // NOTE: the agreement is also the double-buffer handshake: once it returns, every receiver
  // has entered this dispatch, so it has received (hooked) the dispatch two back, and no peer
  // still uses this half's messages.
  MOED_RETURN_IF_ERROR(agree_counts(st, local, *handle, dh, begin, slot));
  const uint64_t n = ++st.dispatches, seq = ++st.seq;
  dh.pending = true;
  flex::Region& region = st.recv_ring.region(slot);
  if (region.buffer() == nullptr) {
    // Every local rank allocates the slot's block together (the same pick everywhere).
    if (Status made = region.ensure(*st.world, st.block_layout.bytes); !made.ok()) {
      dh.pending = false;
      return made;
    }
    // Each expert's rows fill the start of its R * M rows: small pages, or every expert's first
    // rows would each touch (and the kernel clear) a 2 MiB page.
    internal::advise_sparse(region.local(), region.buffer()->bytes());
  }
  std::shared_ptr<ReceiveBlock> rb = low_latency::ring_receive_block(st, slot, in.use_fp8);
  if (Status pushed = push_rows(st, in, *handle, half, n, seq, slot, begin); !pushed.ok()) {
    dh.pending = false;
    return pushed;
  }
  LowLatencyDispatchOutput out;
  low_latency::view_receive_block(st, rb, out);
  out.handle = handle;
  auto receive = [state = state_, handle, half, n, seq, rb] {
    return receive_dispatch(*state, *handle, half, n, seq, *rb);
  };
  MOED_RETURN_IF_ERROR(
      low_latency::receive_now_or_hook(in.return_recv_hook, std::move(receive), out.hook));
  return out;
}

}  // namespace moed
