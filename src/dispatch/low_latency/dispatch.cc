// low_latency_dispatch: every call but an in-place one goes through the segments
// (segment_dispatch.cc); an in-place call (the threads world, no hook) leaves its in-node rows
// where they are, publishes where with its opening collective, and sends other nodes one
// message each (segment_peers.h). Its receive copies each expert's rows (source ascending, token
// ascending) into memory the output owns (ReceiveBlock), with recv_count and layout_range.
#include <algorithm>
#include <cstring>

#include "comm/agreement.h"
#include "core/row_checks.h"
#include "core/row_kernels.h"
#include "dispatch/low_latency/dispatch_rows.h"
#include "dispatch/low_latency/segment.h"
#include "dispatch/low_latency/segment_peers.h"

namespace moed {

namespace {

using low_latency::DispatchHalf;
using low_latency::NetPlan;
using low_latency::Received;
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

// In-place mode's opening collective: agrees on every rank's inputs (as World::agree, whose
// message the error path fetches) and on return_recv_hook, and gathers every rank's
// InPlaceRows and its count per expert (`mine` null: this rank has none, as with a hook).
// Fills `sources` [R] and `count` [R][L], source s's count for this rank's expert j.
Status publish_dispatch(LowLatencyBuffer::State& st, const LowLatencyDispatchInput& in,
                        const Status& local, const low_latency::InPlaceRows* mine,
                        std::vector<low_latency::InPlaceRows>& sources, std::vector<int32_t>& count,
                        std::span<const int32_t> send_count = {}) {
  World& w = *st.world;
  const int R = w.size(), E = st.layout.num_experts, L = st.layout.num_local_experts;
  // The agreement's payload: [in_place, acked, rows, stride, tokens, probs, count [E]].
  constexpr size_t kCounts = 6;
  std::vector<int64_t> payload(kCounts + size_t(E), 0);
  if (mine != nullptr) {
    // NOTE: pointers cross ranks as integers: in-place mode is one address space (state.h).
    payload[0] = 1;
    payload[1] = int64_t(mine->acked);
    payload[2] = int64_t(reinterpret_cast<intptr_t>(mine->rows));
    payload[3] = int64_t(mine->stride);
    payload[4] = int64_t(reinterpret_cast<intptr_t>(mine->tokens));
    payload[5] = int64_t(reinterpret_cast<intptr_t>(mine->probs));
    for (int e = 0; e < E; ++e) payload[kCounts + size_t(e)] = send_count[size_t(e)];
  }
  const AgreedField hook{"low_latency_dispatch: return_recv_hook", in.return_recv_hook,
                         AgreedField::kAgree};
  MOED_ASSIGN_OR_RETURN(AgreedTable table, agree_in_one(w, local, {&hook, 1}, payload));
  sources.assign(size_t(R), low_latency::InPlaceRows{});
  count.assign(size_t(R) * size_t(L), 0);
  for (int r = 0; r < R; ++r) {
    const int64_t* t = table.payload(r);
    low_latency::InPlaceRows& ps = sources[size_t(r)];
    ps.in_place = t[0] != 0;
    ps.acked = t[1] != 0;
    ps.rows = reinterpret_cast<const std::byte*>(intptr_t(t[2]));
    ps.stride = size_t(t[3]);
    ps.tokens = reinterpret_cast<const int32_t*>(intptr_t(t[4]));
    ps.probs = reinterpret_cast<const float*>(intptr_t(t[5]));
    for (int j = 0; j < L; ++j) {
      count[size_t(r) * L + j] = int32_t(t[kCounts + size_t(w.rank() * L + j)]);
    }
  }
  return ok_status();
}

// Fills rv.count: the in-node sources' counts came with the opening collective; other nodes
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
    for (int j = 0; j < L; ++j) {
      rv.count[size_t(j) * R + s] = dh.published_count[size_t(s) * L + j];
    }
  }
  return ok_status();
}

// Where the rows of the sources read in place go, appended to `places` in (source, token)
// order: a token bound for several of this rank's experts is read from its source once, the
// later copies hitting the cache (expert order would read it again from memory).
void place_in_place(const Received& rv, std::span<const low_latency::InPlaceRows* const> in_place,
                    const low_latency::ReceiveBlock& rb,
                    std::vector<low_latency::RowPlace>& places) {
  const LowLatencyBuffer::State& st = rv.st;
  const SegmentLayout& lay = st.layout;
  const int R = lay.num_ranks, L = lay.num_local_experts, me = st.world->rank();
  std::vector<int32_t> first(size_t(lay.max_tokens) + 1);
  for (int s = 0; s < R; ++s) {
    const low_latency::InPlaceRows* ps = in_place[size_t(s)];
    if (ps == nullptr) continue;
    // Counting sort of the source's (expert, slot) rows by token.
    std::fill(first.begin(), first.end(), 0);
    for (int j = 0; j < L; ++j) {
      const size_t chunk = size_t(me * L + j) * size_t(lay.max_tokens);
      for (int32_t i = 0; i < rb.layout_range[size_t(j) * R + s].count; ++i) {
        ++first[size_t(ps->tokens[chunk + size_t(i)]) + 1];
      }
    }
    for (size_t t = 1; t < first.size(); ++t) first[t] += first[t - 1];
    const size_t base = places.size();
    places.resize(base + size_t(first.back()));
    for (int j = 0; j < L; ++j) {
      const size_t chunk = size_t(me * L + j) * size_t(lay.max_tokens);
      const LowLatencyRange range = rb.layout_range[size_t(j) * R + s];
      for (int32_t i = 0; i < range.count; ++i) {
        const int32_t t = ps->tokens[chunk + size_t(i)];
        const std::byte* row = ps->rows + size_t(t) * ps->stride;  // FP8: its scales follow
        places[base + size_t(first[size_t(t)]++)] = {
            int64_t(j) * lay.rows_per_expert() + range.begin + i, row, row + rv.f.payload, t,
            ps->probs[chunk + size_t(i)]};
      }
    }
  }
}

// Receive phase of dispatch `seq` of `half`, into `rb`.
Status receive_dispatch(LowLatencyBuffer::State& st, LowLatencyHandle& handle, int half,
                        uint64_t seq, bool fp8, low_latency::ReceiveBlock& rb) {
  World& w = *st.world;
  const SegmentLayout& lay = st.layout;
  DispatchHalf& dh = st.dispatch_half[half];
  const int R = lay.num_ranks;
  // Whatever happens below, this half is no longer in flight, and the peers whose rows this
  // rank reads in place learn that it is done with them.
  dh.pending = false;
  low_latency::InPlaceRelease release(st, half, low_latency::CallKind::kDispatch, seq, dh.sources);

  Received rv{st, dh, half, seq, low_latency::RowFormat::of(lay, fp8)};
  low_latency::segment::Peers peers(st, "low_latency_dispatch");
  if (Status counted = receive_counts(rv); !counted.ok()) {
    dh.send_requests.clear();  // dropped: an unmatched send (a gather list) no longer reads x
    dh.send_peers.clear();
    return counted;
  }
  // Also waits for this call's sends (the gather lists read x).
  MOED_RETURN_IF_ERROR(low_latency::segment::receive_dispatch_messages(peers, rv));

  const int64_t received = rv.set_layout(rb);
  std::vector<const low_latency::InPlaceRows*> in_place(size_t(R), nullptr);
  for (int s = 0; s < R; ++s) {
    if (w.same_node(s, w.rank())) in_place[size_t(s)] = &dh.sources[size_t(s)];
  }
  // A few rows (decode at T = 1) are copied on this thread: waking the pool costs more.
  const bool inline_copy = size_t(received) * rv.f.payload < low_latency::kInlineBytes;
  const bool stream = rv.stream(received);
  std::vector<low_latency::RowPlace> places;
  rv.place_messages(rb, places);
  place_in_place(rv, in_place, rb, places);
  low_latency::copy_places(w.pool(), rb, rv.f, places, stream,
                           inline_copy ? std::max<int64_t>(1, received) : 1);

  handle.layout_range = rb.layout_range;
  handle.received = true;
  return release.finish();
}

// Where this rank's in-node receivers find its rows: this half's own copy (`own_rows`: FP8
// rows, staged bf16), or the caller's x.
low_latency::InPlaceRows in_place_rows(const DispatchHalf& dh, const LowLatencyDispatchInput& in,
                                       const low_latency::RowFormat& f, bool own_rows) {
  low_latency::InPlaceRows ps;
  ps.in_place = true;
  ps.acked = !own_rows;
  ps.rows = in.use_fp8 ? dh.fp8_rows.data()
            : own_rows ? dh.staged_rows.data()
                       : static_cast<const std::byte*>(in.x.data);
  ps.stride = in.use_fp8 ? f.row_bytes()
              : own_rows ? f.payload
                         : size_t(in.x.row_stride) * sizeof(bf16);
  ps.tokens = dh.in_place_tokens.data();
  ps.probs = dh.in_place_probs.data();
  return ps;
}

}  // namespace

StatusOr<LowLatencyDispatchOutput> LowLatencyBuffer::low_latency_dispatch(
    const LowLatencyDispatchInput& in, const Status& caller_error) {
  State& st = *state_;
  World& w = *st.world;
  const Status local = check_dispatch(st, in, caller_error);
  // Every call but an in-place one goes through the node-shared segments (segment_peers.h); in
  // shrink mode with no collective, else after the agreement.
  // NOTE: the agreement is also the double-buffer handshake: once it returns, every receiver
  // has entered this dispatch, so it has received (hooked) the dispatch two back and its views
  // of this half are released; senders may overwrite the half.
  if (st.shrink) return low_latency::segment_dispatch(state_, in, local);
  const bool in_place = st.in_place && !in.return_recv_hook;
  std::vector<low_latency::InPlaceRows> sources;
  std::vector<int32_t> published_count;
  if (!in_place || !local.ok()) {
    if (st.in_place) {  // the same collective as an in-place call's, which agrees on the hook
      MOED_RETURN_IF_ERROR(publish_dispatch(st, in, local, nullptr, sources, published_count));
    } else {
      MOED_RETURN_IF_ERROR(w.agree(local));
    }
    return low_latency::segment_dispatch(state_, in, local);
  }

  // In-place mode (state.h): this rank writes only its own memory (the rows and tokens its
  // in-node receivers read, the messages for other nodes), so it does so first and the
  // collective then publishes them with the counts (publish_dispatch): no signal round.
  // NOTE: its half's previous readers are done: they read it in the dispatch two back, inside
  // their own call, before the agreement of the dispatch one back let this rank through.
  const bool fp8 = in.use_fp8;
  const uint64_t seq = ++st.seq;
  const int half = int(st.dispatches++ % 2);
  DispatchHalf& dh = st.dispatch_half[half];
  dh.pending = true;

  const int64_t T = in.x.rows;
  std::shared_ptr<LowLatencyHandle> handle = low_latency::new_dispatch_handle(st, in.topk, T);
  const low_latency::RowFormat f = low_latency::RowFormat::of(st.layout, fp8);
  if (fp8) low_latency::cast_fp8_rows(st, in, dh.fp8_rows);
  // The messages to other nodes are gather lists, their rows read from x (or this half's FP8
  // rows) by the transport: this call waits for its sends, or drops them, before it returns.
  const NetPlan plan(st, in.topk, T, {}, f, dh, /*gather_rows=*/true);

  // Receivers read this half's own rows (no acks to wait for): the FP8 rows always, a few
  // bf16 rows once copied here; else the caller's x.
  const bool own_rows = fp8 || size_t(T) * f.payload <= low_latency::kStageBytes;
  if (own_rows && !fp8) {
    dh.staged_rows.resize(size_t(T) * f.payload);
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(dh.staged_rows.data() + size_t(t) * f.payload, in.x.row_ptr(t), f.payload);
    }
  }
  std::vector<uint64_t> shared_rows(size_t(w.pool().num_threads()), 0);
  low_latency::send_rows(st, in, *handle, half, f, plan, low_latency::InNode::kInPlace, {},
                         shared_rows);
  const low_latency::InPlaceRows ps = in_place_rows(dh, in, f, own_rows);
  Status published =
      publish_dispatch(st, in, local, &ps, sources, published_count, handle->send_count);
  if (!published.ok()) {
    // Nothing left this rank: the call never happened.
    dh.pending = false;
    --st.seq;
    --st.dispatches;
    return published;
  }
  low_latency::add_shared_rows(w, shared_rows, f.row_bytes());
  dh.sources = std::move(sources);
  dh.published_count = std::move(published_count);
  dh.own_rows_seq = own_rows ? seq : 0;

  low_latency::segment::Peers peers(st, "low_latency_dispatch");
  Status status =
      low_latency::segment::post_dispatch_messages(peers, *handle, half, seq, f, plan, local, in);
  if (!status.ok()) {
    dh.pending = false;
    dh.send_requests.clear();  // dropped: an unmatched send (a gather list) no longer reads x
    dh.send_peers.clear();
    low_latency::release_in_place(st, half, low_latency::CallKind::kDispatch, seq, dh.sources)
        .ignore();
    return status;
  }

  std::shared_ptr<low_latency::ReceiveBlock> rb = low_latency::take_receive_block(st, half, fp8);
  LowLatencyDispatchOutput out;
  low_latency::view_receive_block(st, rb, out);
  out.handle = handle;
  auto receive = [state = state_, handle, half, seq, fp8, rb] {
    return receive_dispatch(*state, *handle, half, seq, fp8, *rb);
  };
  MOED_RETURN_IF_ERROR(low_latency::receive_now_or_hook(false, std::move(receive), out.hook));
  return out;
}

}  // namespace moed
