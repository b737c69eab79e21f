// The MoE layer on the low-latency dispatcher (moed/low_latency.h): bf16, fixed slots.
//
// NOTE: the low-latency combine weights each expert's output. To keep the layer's arithmetic
// identical to the other dispatchers (prob applied inside the expert, unweighted combine:
// bitwise equal to the reference layer), the experts take each received row's prob from the
// dispatch's slots (recv_probs: the row's topk_weights entry travels with it, so no rank
// gathers anyone's routing), and combine runs with unit weights, where acc += 1 * y is
// exactly the unweighted sum. Backward reuses the same two calls: the combine's backward is a
// low-latency dispatch of grad_output, the dispatch's backward a unit-weight low-latency
// combine of the row gradients; the probs' gradients go home by one all-to-all.
#include "core/block_cache.h"
#include "moe/layer_internal.h"

namespace moed::moe {
namespace {

using Clock = std::chrono::steady_clock;

struct ProbGrad {
  int32_t token;
  int32_t expert;
  float grad;
};

std::vector<Segment> ll_segments(const LowLatencyDispatchOutput& d) {
  std::vector<Segment> segs;
  for (int j = 0; j < d.num_local_experts; ++j) {
    segs.push_back({j * d.rows_per_expert, d.recv_count[size_t(j)]});
  }
  return segs;
}

}  // namespace

StatusOr<Tensor> ll_forward(MoELayer::State& s, const TensorView& x) {
  World& w = *s.world;
  ThreadPool* pool = &w.pool();
  const int64_t T = x.rows, H = s.config.hidden;
  const int R = w.size(), E = s.config.num_experts;

  auto t0 = Clock::now();
  MOED_ASSIGN_OR_RETURN(s.route, route(*s.router, s.weights.router, x, pool));
  s.stats.route_s = seconds_since(t0);
  const RouterOutput& ro = s.route.out;
  s.stats.routed = 0;
  s.stats.dropped = 0;
  for (size_t i = 0; i < ro.selected.topk_idx.size(); ++i) {
    if (ro.selected.topk_idx[i] < 0) continue;
    ++s.stats.routed;
    if (!ro.kept[i]) ++s.stats.dropped;
  }

  t0 = Clock::now();
  // Slots are sized for the largest rank; the buffer is rebuilt (collectively: every rank sees
  // the same maximum) only when a step needs more.
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> all_t,
                        all_gather<int64_t>(w, std::span<const int64_t>(&T, 1)));
  int64_t max_t = 1;
  for (int64_t v : all_t) max_t = std::max(max_t, v);
  if (!s.ll_buffer || s.ll_buffer->max_tokens_per_rank() < max_t) {
    s.ll_buffer.reset();
    MOED_ASSIGN_OR_RETURN(s.ll_buffer, LowLatencyBuffer::create(w, max_t, int(H), E));
  }
  s.ll_unit_topk = ro.topk;
  std::fill(s.ll_unit_topk.topk_weights.begin(), s.ll_unit_topk.topk_weights.end(), 1.0f);
  MOED_ASSIGN_OR_RETURN(s.ll_dispatched,
                        s.ll_buffer->low_latency_dispatch(
                            {.x = x, .topk = TopkView::of(ro.topk), .return_recv_hook = true}));
  double dispatch_s = seconds_since(t0);

  Tensor shared_y;
  if (s.config.shared_expert_ffn > 0) {
    auto ts = Clock::now();
    shared_y = Tensor::empty(s.config.dtype, T, H);
    shared_forward(s.weights, x, pool, &s.shared, shared_y.view());
    s.stats.shared_s = seconds_since(ts);
  }
  t0 = Clock::now();
  MOED_RETURN_IF_ERROR(s.ll_dispatched.hook->wait());
  const LowLatencyDispatchOutput& d = s.ll_dispatched;
  const int L = d.num_local_experts;
  const int64_t rpe = d.rows_per_expert;
  s.ll_probs.assign(size_t(L * rpe), 0.0f);
  s.ll_row_src_rank.assign(size_t(L * rpe), -1);
  s.stats.tokens_per_local_expert.assign(size_t(L), 0);
  s.stats.dispatch_rows = 0;
  for (int j = 0; j < L; ++j) {
    s.stats.tokens_per_local_expert[size_t(j)] = d.recv_count[size_t(j)];
    s.stats.dispatch_rows += d.recv_count[size_t(j)];
    for (int src = 0; src < R; ++src) {
      const LowLatencyRange range = d.layout_range[size_t(j) * R + size_t(src)];
      for (int32_t i = range.begin; i < range.begin + range.count; ++i) {
        const int64_t row = j * rpe + i;
        s.ll_probs[size_t(row)] = d.recv_probs[size_t(row)];
        s.ll_row_src_rank[size_t(row)] = src;
      }
    }
  }
  s.stats.dispatch_s = dispatch_s + seconds_since(t0);

  t0 = Clock::now();
  s.expert_y = Tensor::empty(s.config.dtype, L * rpe, H);
  internal::advise_sparse(s.expert_y.data(), s.expert_y.bytes());  // only recv_count[j] rows
  expert_forward(d.recv.x, s.ll_probs, ll_segments(d), views(s.weights.fc1), views(s.weights.fc2),
                 pool, &s.experts, s.expert_y.view());
  s.stats.experts_s = seconds_since(t0);

  t0 = Clock::now();
  MOED_ASSIGN_OR_RETURN(
      LowLatencyCombineOutput c,
      s.ll_buffer->low_latency_combine(
          {.x = s.expert_y.view(), .topk = TopkView::of(s.ll_unit_topk), .handle = d.handle}));
  add_rows(c.combined_x.view(), shared_y.view(), pool);
  s.stats.combine_s = seconds_since(t0);
  return std::move(c.combined_x);
}

StatusOr<MoEGrads> ll_backward(MoELayer::State& s, const TensorView& grad_output) {
  World& w = *s.world;
  ThreadPool* pool = &w.pool();
  const int64_t T = s.x.rows(), H = s.config.hidden;
  const int R = w.size(), E = s.config.num_experts;
  MoEGrads grads;

  // Backward of combine: every received row gets its token's grad_output row.
  MOED_ASSIGN_OR_RETURN(
      LowLatencyDispatchOutput gd,
      s.ll_buffer->low_latency_dispatch(
          {.x = grad_output, .topk = TopkView::of(s.route.out.topk), .return_recv_hook = true}));
  Tensor shared_dx;
  if (s.config.shared_expert_ffn > 0) {
    shared_dx = Tensor::empty(s.config.dtype, T, H);
    shared_backward(s.weights, s.shared, grad_output, pool, shared_dx.view(), &grads);
  }
  MOED_RETURN_IF_ERROR(gd.hook->wait());
  const LowLatencyDispatchOutput& d = s.ll_dispatched;
  const int L = d.num_local_experts;
  const int64_t rpe = d.rows_per_expert;

  Tensor dx_rows = Tensor::empty(s.config.dtype, L * rpe, H);
  std::vector<float> dprobs(size_t(L * rpe), 0.0f);
  expert_backward(s.experts, gd.recv.x, views(s.weights.fc1), views(s.weights.fc2), pool,
                  dx_rows.view(), dprobs, &grads.grad_fc1, &grads.grad_fc2);

  // Backward of dispatch: the unweighted sum of each token's row gradients.
  MOED_ASSIGN_OR_RETURN(
      LowLatencyCombineOutput gc,
      s.ll_buffer->low_latency_combine(
          {.x = dx_rows.view(), .topk = TopkView::of(s.ll_unit_topk), .handle = gd.handle}));

  // The probs' gradients go back to their tokens' home ranks.
  std::vector<std::vector<ProbGrad>> out(static_cast<size_t>(R));
  for (int j = 0; j < L; ++j) {
    for (int32_t i = 0; i < d.recv_count[size_t(j)]; ++i) {
      const int64_t row = j * rpe + i;
      out[size_t(s.ll_row_src_rank[size_t(row)])].push_back(
          {d.src_info[size_t(row)], s.ep_rank * L + j, dprobs[size_t(row)]});
    }
  }
  std::vector<ProbGrad> send;
  std::vector<uint64_t> send_counts(static_cast<size_t>(R));
  std::vector<size_t> sc(static_cast<size_t>(R)), rc(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    send_counts[size_t(r)] = out[size_t(r)].size();
    sc[size_t(r)] = out[size_t(r)].size();
    send.insert(send.end(), out[size_t(r)].begin(), out[size_t(r)].end());
  }
  MOED_ASSIGN_OR_RETURN(std::vector<uint64_t> recv_counts,
                        all_to_all<uint64_t>(w, std::span<const uint64_t>(send_counts)));
  size_t total = 0;
  for (int r = 0; r < R; ++r) total += (rc[size_t(r)] = size_t(recv_counts[size_t(r)]));
  std::vector<ProbGrad> recv(total);
  MOED_RETURN_IF_ERROR(all_to_all_v<ProbGrad>(w, send, sc, recv, rc));
  std::vector<float> grad_probs(size_t(T) * size_t(E), 0.0f);
  for (const ProbGrad& g : recv)
    grad_probs[size_t(g.token) * size_t(E) + size_t(g.expert)] = g.grad;

  MOED_ASSIGN_OR_RETURN(RouteGrad rg,
                        route_backward(*s.router, s.weights.router, s.route, grad_probs, pool));
  grads.grad_router = std::move(rg.grad_router);
  grads.grad_input = sum_input_grads(gc.combined_x.view(), rg.grad_x, shared_dx.view(), pool);
  return grads;
}

}  // namespace moed::moe
