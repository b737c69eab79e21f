// low_latency_combine: its checks and opening agreement; the call itself is segment_combine.cc's,
// reading in-node rows from the segments or, in an in-place combine, where they are.
#include <array>

#include "comm/agreement.h"
#include "core/row_checks.h"
#include "dispatch/low_latency/segment.h"

namespace moed {

namespace {

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

// The combine's opening collective: agrees on every rank's inputs (as World::agree, whose
// message the error path fetches) and on return_recv_hook, and in the threads world gathers
// every rank's InPlaceRows, so that no signal has to say where the rows are. Returns them for
// an in-place combine (no hook), else none.
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
  if (in.return_recv_hook) sources.clear();
  return sources;
}

}  // namespace

StatusOr<LowLatencyCombineOutput> LowLatencyBuffer::low_latency_combine(
    const LowLatencyCombineInput& in, const Status& caller_error) {
  State& st = *state_;
  const Status local = check_combine(st, in, caller_error);
  // NOTE: as in dispatch, the agreement is the double-buffer handshake: every home rank has
  // entered this combine, so it has reduced the combine two back out of this half.
  if (st.shrink) return low_latency::segment_combine(state_, in, local);
  MOED_ASSIGN_OR_RETURN(std::vector<low_latency::InPlaceRows> sources,
                        agree_and_publish(st, in, local));
  return low_latency::segment_combine(state_, in, local, std::move(sources));
}

}  // namespace moed
