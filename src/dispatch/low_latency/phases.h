// What the send and receive phases of the dispatches and combines do alike: keep the requests
// they post, count their node-shared traffic, and run their receive phase now or as a hook.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "comm/wait.h"
#include "core/row_kernels.h"
#include "dispatch/low_latency/state.h"
#include "dispatch/steps.h"

namespace moed {

namespace low_latency {

// Copies below this many bytes run on the calling thread (parallel_for's min_chunk): waking
// the pool's workers costs more than they save.
inline constexpr size_t kInlineBytes = size_t(256) << 10;

// A dispatch's handle with its home side filled: each (t, e) gets the next slot of its
// (this rank, e) chunk in token order, which is what makes the receiver's rows token-ascending
// without any sort.
inline std::shared_ptr<LowLatencyHandle> new_dispatch_handle(const LowLatencyBuffer::State& st,
                                                             const TopkView& routing,
                                                             int64_t num_tokens) {
  auto handle = std::make_shared<LowLatencyHandle>();
  const int K = routing.num_topk;
  handle->buffer_id = st.id;
  handle->num_tokens = num_tokens;
  handle->num_topk = K;
  handle->topk_idx.resize(size_t(num_tokens) * size_t(K));
  handle->slot.assign(size_t(num_tokens) * size_t(K), -1);
  handle->send_count.assign(size_t(st.layout.num_experts), 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int k = 0; k < K; ++k) {
      const auto e = int32_t(routing.at(t, k));
      handle->topk_idx[size_t(t) * K + k] = e;
      if (e >= 0) handle->slot[size_t(t) * K + k] = handle->send_count[size_t(e)]++;
    }
  }
  return handle;
}

// Casts every row of x to FP8 once (every destination gets a copy of the same bytes):
// rows [T] of H fp8 bytes, then their scales.
inline void cast_fp8_rows(LowLatencyBuffer::State& st, const LowLatencyDispatchInput& in,
                          std::vector<std::byte>& rows) {
  const int H = st.layout.hidden, S = st.layout.num_scales;
  const size_t bytes = size_t(H) + size_t(S) * sizeof(float);
  rows.resize(size_t(in.x.rows) * bytes);
  st.world->pool().parallel_for(in.x.rows, [&](int64_t t0, int64_t t1, int) {
    for (int64_t t = t0; t < t1; ++t) {
      std::byte* row = rows.data() + size_t(t) * bytes;
      quantize_fp8_row(std::span<const bf16>(in.x.row<bf16>(t), size_t(H)), in.round_scale,
                       std::span<fp8_e4m3>(reinterpret_cast<fp8_e4m3*>(row), size_t(H)),
                       std::span<float>(reinterpret_cast<float*>(row + H), size_t(S)));
    }
  });
}

// One term of a token's combine: expert e's row `slot` of this rank's chunk, weighted.
struct Term {
  int32_t key;  // the sum's order: the expert id, or the caller's order key
  int32_t e, slot;
  float weight;
};

// Token t's terms in summation order: its experts (those of the dispatch the combine's routing
// has not set to -1) that `keep` accepts, ascending by the order key (the expert id when
// `order` is empty).
template <typename Keep>
void token_terms(const LowLatencyHandle& handle, const TopkView& routing,
                 std::span<const int32_t> order, int64_t t, Keep&& keep, std::vector<Term>& terms) {
  const int K = handle.num_topk;
  terms.clear();
  for (int k = 0; k < K; ++k) {
    const size_t i = size_t(t) * K + k;
    const int32_t e = handle.topk_idx[i];
    if (e < 0 || routing.at(t, k) < 0 || !keep(e)) continue;
    terms.push_back({order.empty() ? e : order[i], e, handle.slot[i], routing.weight(t, k)});
  }
  std::sort(terms.begin(), terms.end(), [](const Term& a, const Term& b) {
    return a.key != b.key ? a.key < b.key : a.e < b.e;
  });
}

// A combine's receive: out[t] = the sum over t's terms (token_terms, `keep`) of weight * the
// expert's row (row_of(e, slot)), fp32 from 0, each product and sum rounded on its own (the sum
// kept in registers, rounded once to bf16), one token behind (FoldAhead).
template <typename Keep, typename RowOf>
void reduce_tokens(World& w, const LowLatencyHandle& handle, const TopkView& routing,
                   std::span<const int32_t> order, Keep&& keep, RowOf&& row_of, TensorView out) {
  w.pool().parallel_for(handle.num_tokens, [&](int64_t t0, int64_t t1, int) {
    std::vector<Term> terms;
    internal::FoldAhead fold(DType::kBF16, DType::kBF16, size_t(out.cols), /*weighted=*/true,
                             /*stream=*/false);
    for (int64_t t = t0; t < t1; ++t) {
      token_terms(handle, routing, order, t, keep, terms);
      for (const Term& term : terms) fold.add(row_of(term.e, term.slot), term.weight);
      fold.push(out.row<bf16>(t));
    }
    fold.flush();
  });
}

// Reports the rows the workers copied into node-shared segments, counted per worker so the
// parallel copies need no shared counter.
inline void add_shared_rows(World& w, std::span<const uint64_t> rows_per_worker, size_t row_bytes) {
  uint64_t rows = 0;
  for (uint64_t n : rows_per_worker) rows += n;
  w.add_shared_bytes(rows * row_bytes, rows);
}

// The receive phase: run now (hook = an already-completed request), or handed back as `hook`
// when the caller asked for one (return_recv_hook); a hook dropped unwaited still receives, so
// the buffer's halves and the peers' signals stay in step.
template <typename Receive>
Status receive_now_or_hook(bool return_hook, Receive receive, Request& hook) {
  hook = run_body(return_hook ? BodyRun::kOnWait : BodyRun::kNow, std::move(receive));
  return return_hook ? ok_status() : hook->wait();
}

}  // namespace low_latency

}  // namespace moed
