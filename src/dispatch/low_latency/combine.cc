// low_latency_combine: every call but an in-place one goes through the segments
// (segment_combine.cc); an in-place call leaves its expert outputs where they are for the
// in-node homes and sends other nodes' homes one message each (segment_peers.h). The receive
// reduces each token over its experts in ascending expert id.
#include <algorithm>
#include <array>
#include <cstring>

#include "comm/agreement.h"
#include "core/row_checks.h"
#include "core/row_kernels.h"
#include "dispatch/low_latency/phases.h"
#include "dispatch/low_latency/segment.h"
#include "dispatch/low_latency/segment_peers.h"

namespace moed {

namespace {

using low_latency::CombineHalf;
using low_latency::SegmentLayout;

Status check_combine(const LowLatencyBuffer::State& st, const LowLatencyCombineInput& in,
                     const Status& caller_error) {
  if (!caller_error.ok()) return caller_error;
  const SegmentLayout& lay = st.layout;
  const TensorView& x = in.x;
  const int64_t rows = int64_t(lay.num_local_experts) * lay.rows_per_expert();
  if (x.dtype != DType::kBF16) {
    return invalid_argument("low_latency_combine: x must be bf16; got ", dtype_name(x.dtype));
  }
  if (x.rows != rows || x.cols != lay.hidden) {
    return invalid_argument("low_latency_combine: x is [", x.rows, ", ", x.cols, "]; expected [",
                            rows, ", ", lay.hidden,
                            "] (num_local_experts * num_ranks * "
                            "max_tokens_per_rank, hidden)");
  }
  MOED_RETURN_IF_ERROR(moed::internal::check_token_rows("low_latency_combine: x", {x, {}}));
  if (!in.handle) return invalid_argument("low_latency_combine: handle is null");
  const LowLatencyHandle& h = *in.handle;
  if (h.buffer_id != st.id) {
    return invalid_argument("low_latency_combine: the handle comes from another LowLatencyBuffer");
  }
  if (!h.received) {
    return failed_precondition(
        "low_latency_combine: the dispatch of this handle has not been "
        "received yet; call its hook first");
  }
  const TopkView& r = in.topk;
  if (r.num_tokens != h.num_tokens || r.num_topk != h.num_topk) {
    return invalid_argument("low_latency_combine: topk is [", r.num_tokens, ", ", r.num_topk,
                            "] but the dispatch had [", h.num_tokens, ", ", h.num_topk, "]");
  }
  // As in DeepEP, an entry may be -1 where the dispatch had an expert: that term is dropped
  // (DeepEP's shrink test masks its failed ranks' experts so).
  const int64_t entries = r.num_tokens * r.num_topk;
  if (entries > 0 && (r.idx == nullptr || r.weights == nullptr)) {
    return invalid_argument("low_latency_combine: topk_", r.idx ? "weights" : "idx",
                            " has no data");
  }
  for (int64_t i = 0; i < entries; ++i) {
    const int64_t e = r.at(i / r.num_topk, int(i % r.num_topk));
    if (e != h.topk_idx[size_t(i)] && e != -1) {
      return invalid_argument("low_latency_combine: topk_idx[", i / r.num_topk, "][",
                              i % r.num_topk, "] = ", e, " differs from the dispatch's ",
                              h.topk_idx[size_t(i)], " (only -1 may replace an expert)");
    }
  }
  MOED_RETURN_IF_ERROR(validate(r, lay.num_experts));
  if (st.combine_half[st.combines % 2].pending) {
    return failed_precondition(
        "low_latency_combine: two combines are already in flight; call "
        "the hook of combine #",
        st.combines - 2, " first");
  }
  if (in.out) {
    MOED_RETURN_IF_ERROR(moed::internal::check_out_buffer(
        "low_latency_combine: out", *in.out, h.num_tokens, lay.hidden, DType::kBF16, "x"));
  }
  if (!in.order.empty() && in.order.size() != size_t(entries)) {
    return invalid_argument("low_latency_combine: order has ", in.order.size(),
                            " entries, expected ", r.num_tokens, " x ", r.num_topk);
  }
  return ok_status();
}

// Receive phase of an in-place combine from `half`: out[t] = sum over t's experts e ascending
// of w * float(y[e][slot]), fp32 from 0, each product and sum rounded on its own; in-node
// experts' outputs read where `peer` ([R], the call's collective) says.
Status receive_combine(LowLatencyBuffer::State& st, const LowLatencyHandle& handle,
                       const TopkView& routing, std::span<const int32_t> order, int half,
                       std::span<const low_latency::InPlaceRows> peer, TensorView out) {
  World& w = *st.world;
  const SegmentLayout& lay = st.layout;
  CombineHalf& ch = st.combine_half[half];
  const int R = lay.num_ranks, me = w.rank(), H = lay.hidden;
  ch.pending = false;
  // Other nodes' expert outputs come in one message per expert rank (segment_peers.h).
  low_latency::segment::Peers peers(st, "low_latency_combine");
  std::vector<const std::byte*> first_row(size_t(lay.num_experts), nullptr);
  Status net;
  for (int d = 0; d < R; ++d) {
    if (w.same_node(d, me)) continue;
    StatusOr<bool> in = peers.wait(d, ch.recvs[size_t(d)]);
    if (!in.ok() && net.ok()) net = in.status();
    if (in.ok() && *in) low_latency::segment::message_rows(st, half, handle, d, first_row);
  }
  if (net.ok()) net = peers.wait_sends(ch.row_recvs, ch.row_peers);
  Status sent = peers.wait_sends(ch.requests, ch.send_peers);
  MOED_RETURN_IF_ERROR(net);
  MOED_RETURN_IF_ERROR(sent);

  const int L = lay.num_local_experts;
  const size_t row_bytes = size_t(H) * sizeof(bf16);
  auto row_of = [&](int32_t e, int32_t slot) -> const bf16* {
    const int d = e / L, j = e % L;
    if (!w.same_node(d, me)) {
      return reinterpret_cast<const bf16*>(first_row[size_t(e)] + size_t(slot) * row_bytes);
    }
    const low_latency::InPlaceRows& p = peer[size_t(d)];
    const int64_t row =
        int64_t(j) * lay.rows_per_expert() + p.ranges[size_t(j) * R + me].begin + slot;
    return reinterpret_cast<const bf16*>(p.rows + size_t(row) * p.stride);
  };
  low_latency::reduce_tokens(
      w, handle, routing, order, [](int32_t) { return true; }, row_of, out);
  return ok_status();
}

// The combine's opening collective: agrees on every rank's inputs (as World::agree, whose
// message the error path fetches) and on return_recv_hook, and in in-place mode gathers every
// rank's InPlaceRows, so that no signal has to say where the rows are.
StatusOr<std::vector<low_latency::InPlaceRows>> agree_and_publish(LowLatencyBuffer::State& st,
                                                                  const LowLatencyCombineInput& in,
                                                                  const Status& local) {
  World& w = *st.world;
  if (!st.in_place) {
    MOED_RETURN_IF_ERROR(w.agree(local));
    return std::vector<low_latency::InPlaceRows>();
  }
  // NOTE: pointers cross ranks as integers: in-place mode is one address space (state.h).
  std::array<int64_t, 3> mine = {0, 0, 0};  // the payload: rows, stride, ranges
  if (local.ok()) {
    mine[0] = int64_t(reinterpret_cast<intptr_t>(in.x.data));
    mine[1] = int64_t(in.x.row_stride) * int64_t(sizeof(bf16));
    mine[2] = int64_t(reinterpret_cast<intptr_t>(in.handle->layout_range.data()));
  }
  const AgreedField hook{"low_latency_combine: return_recv_hook", in.return_recv_hook,
                         AgreedField::kAgree};
  MOED_ASSIGN_OR_RETURN(AgreedTable table, agree_in_one(w, local, {&hook, 1}, mine));
  const int R = w.size();
  std::vector<low_latency::InPlaceRows> sources(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    const int64_t* row = table.payload(r);
    low_latency::InPlaceRows& ps = sources[size_t(r)];
    ps.rows = reinterpret_cast<const std::byte*>(intptr_t(row[0]));
    ps.stride = size_t(row[1]);
    ps.ranges = reinterpret_cast<const LowLatencyRange*>(intptr_t(row[2]));
  }
  return sources;
}

// The rows the in-node homes read in place from this rank, counted here, by the rank whose rows
// cross the node (as when it writes them, and as the planning model counts NVLink bytes).
void count_in_node_rows(LowLatencyBuffer::State& st, const LowLatencyHandle& handle) {
  World& w = *st.world;
  const int R = st.layout.num_ranks;
  uint64_t rows = 0;
  for (size_t c = 0; c < handle.layout_range.size(); ++c) {
    if (w.same_node(int(c % size_t(R)), w.rank())) rows += uint64_t(handle.layout_range[c].count);
  }
  low_latency::add_shared_rows(w, {&rows, 1}, size_t(st.layout.hidden) * sizeof(bf16));
}

}  // namespace

StatusOr<LowLatencyCombineOutput> LowLatencyBuffer::low_latency_combine(
    const LowLatencyCombineInput& in, const Status& caller_error) {
  State& st = *state_;
  const Status local = check_combine(st, in, caller_error);
  // As in dispatch: every call but an in-place one goes through the segments.
  // NOTE: as in dispatch, the agreement is the double-buffer handshake: every home rank has
  // entered this combine, so it has reduced the combine two back out of this half.
  if (st.shrink) return low_latency::segment_combine(state_, in, local);
  MOED_ASSIGN_OR_RETURN(std::vector<low_latency::InPlaceRows> sources,
                        agree_and_publish(st, in, local));
  if (!st.in_place || in.return_recv_hook) return low_latency::segment_combine(state_, in, local);

  const uint64_t seq = ++st.seq;
  const int half = int(st.combines++ % 2);
  CombineHalf& ch = st.combine_half[half];
  ch.pending = true;

  // In-place mode (state.h): the in-node homes read this rank's rows where they are, until
  // the round closes.
  // NOTE: always read in place, round and all, even at T = 1: copying the rows into the homes'
  // slots first (8 rows of 14 KiB a rank at decode) costs more than the round it saves.
  flex::PublishRound round(*st.world, st.combine_signals, st.combine_epoch, /*in_place=*/true,
                           flex::PublishRound::Role::kReads);
  round.opened_by_collective();
  count_in_node_rows(st, *in.handle);
  low_latency::segment::Peers peers(st, "low_latency_combine");
  Status status =
      low_latency::segment::post_combine_messages(peers, in.handle.get(), in.x, half, seq, local);
  if (!status.ok()) {
    ch.pending = false;
    return round.close(status);
  }

  LowLatencyCombineOutput out;
  if (!in.out) {
    out.combined_x = Tensor::empty(DType::kBF16, in.handle->num_tokens, st.layout.hidden);
  }
  out.out = in.out;
  auto receive = [&] {
    return round.close(
        receive_combine(st, *in.handle, in.topk, in.order, half, sources, out.result()));
  };
  MOED_RETURN_IF_ERROR(low_latency::receive_now_or_hook(false, std::move(receive), out.hook));
  return out;
}

}  // namespace moed
