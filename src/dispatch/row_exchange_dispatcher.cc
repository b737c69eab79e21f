// The AllGather and AlltoAll dispatchers' TokenDispatcher (row_exchange.h): the six steps and
// their backward on the step sequencer (steps.h); each dispatch's agreement, plan and output;
// and every return home (combine, dispatch backward, the weighted combine backward's expert
// outputs). How rows reach the experts is the ForwardExchange's.
#include <algorithm>
#include <optional>
#include <utility>

#include "core/row_checks.h"
#include "core/row_kernels.h"
#include "dispatch/row_exchange.h"
#include "dispatch/steps.h"

namespace moed {

namespace {

// One value per row seen as a [n, 1] f32 tensor, so the row functions move it like a payload.
TokenRows value_rows(std::span<const float> v) {
  return TokenRows{TensorView(const_cast<float*>(v.data()), DType::kF32, int64_t(v.size()), 1),
                   TensorView()};
}

// Expert rows on their way home (send_home), in buffers kept across calls.
struct ReturnRows {
  TensorView received;                 // [sum of home_rows_of_rank, H], rank-major
  std::vector<float> received_values;  // when values were sent
  ScratchBuffer packed_buffer, received_buffer;
  std::vector<float> packed_values;
};

// Sorts `rows` (the canonical layout of `plan`) back source-major, without padding, and sends
// them home, with one value per row when `values` is given.
Status send_home(World& world, const RowExchangePlan& plan, const TensorView& rows,
                 const std::vector<float>* values, ReturnRows& r) {
  const int64_t n = plan.expert_rows;
  int64_t m = 0;
  for (int64_t k : plan.home_rows_of_rank) m += k;
  // NOTE: sorting back is the backward of the dispatch's sort_chunks_by_idxs: chunk (j, s) of
  // the canonical layout returns to source-major place s * L + j; padding rows stay behind.
  const TensorView packed = r.packed_buffer.view(rows.dtype, n, rows.cols);
  MOED_RETURN_IF_ERROR(sort_chunks_by_idxs_backward_into(
      TokenRows{rows, TensorView()}, plan.chunk_sizes, plan.chunk_order,
      TokenRows{packed, TensorView()}, plan.chunk_offsets, world.pool()));
  r.received = r.received_buffer.view(rows.dtype, m, rows.cols);
  MOED_RETURN_IF_ERROR(
      exchange_to_home(world, plan, packed.data, r.received.data, packed.row_bytes()));
  r.received_values.clear();
  if (values == nullptr) return ok_status();
  r.packed_values.assign(size_t(n), 0.0f);
  if (!values->empty()) {
    MOED_RETURN_IF_ERROR(sort_chunks_by_idxs_backward_into(
        value_rows(*values), plan.chunk_sizes, plan.chunk_order, value_rows(r.packed_values),
        plan.chunk_offsets, world.pool()));
  }
  r.received_values.resize(size_t(m));
  return exchange_to_home(world, plan, r.packed_values.data(), r.received_values.data(),
                          sizeof(float));
}

// fp32 terms of design.md §4.1 in home order (0 + partials in p order): [home.num_rows, H] f32.
// NOTE: rows arrive rank-major, [g][j][t] with g = ep * P + p; home order is [ep][j][t]. With
// P = 1 the two are the same and the received rows are already the terms (terms() returns
// them): unpermute's `acc += prob * float(y)` equals design.md §4.1's `acc += prob * (0 +
// float(y))` bit for bit (the two differ only for y = -0, where acc, which starts at +0, is
// unchanged either way). So with P = 1 this returns an empty tensor.
Tensor sum_partials(ThreadPool& pool, const RowExchangePlan& plan, const ReturnRows& r) {
  const int P = plan.etp_size, R = plan.world_size;
  if (P == 1) return Tensor();
  const int64_t H = r.received.cols;
  const std::vector<int64_t> recv_off = prefix(plan.home_rows_of_rank);  // where rank g starts
  Tensor out = Tensor::empty(DType::kF32, plan.home.num_rows, H);
  const internal::RowKernels& kernels = internal::row_kernels();
  pool.parallel_for(
      plan.home.num_rows,
      [&](int64_t begin, int64_t end, int) {
        for (int g0 = 0; g0 < R; g0 += P) {
          const int64_t lo = std::max(begin, plan.home_offset_of_rank[size_t(g0)]);
          const int64_t hi = std::min(
              end, plan.home_offset_of_rank[size_t(g0)] + plan.home_rows_of_rank[size_t(g0)]);
          for (int64_t i = lo; i < hi; ++i) {
            float* acc = out.row<float>(i);
            const int64_t k = i - plan.home_offset_of_rank[size_t(g0)];
            // fp32 from 0: the first partial is 0 + y (P > 1 here).
            for (int p = 0; p < P; ++p) {
              const int64_t row = recv_off[size_t(g0 + p)] + k;
              (p == 0 ? kernels.start : kernels.accumulate)(acc, r.received.row_ptr(row),
                                                            r.received.dtype, size_t(H));
            }
          }
        }
      },
      /*min_chunk=*/16);
  return out;
}

std::vector<float> sum_partial_values(const RowExchangePlan& plan, const ReturnRows& r) {
  const int P = plan.etp_size, R = plan.world_size;
  if (P == 1) return r.received_values;
  const std::vector<int64_t> recv_off = prefix(plan.home_rows_of_rank);  // where rank g starts
  std::vector<float> out(size_t(plan.home.num_rows), 0.0f);
  for (int g0 = 0; g0 < R; g0 += P) {
    for (int64_t k = 0; k < plan.home_rows_of_rank[size_t(g0)]; ++k) {
      float acc = 0.0f;
      for (int p = 0; p < P; ++p) acc += r.received_values[size_t(recv_off[size_t(g0 + p)] + k)];
      out[size_t(plan.home_offset_of_rank[size_t(g0)] + k)] = acc;
    }
  }
  return out;
}

// The received rows as the fp32-equivalent terms: sum_partials when P > 1, else `received`.
TensorView terms(const RowExchangePlan& plan, const ReturnRows& r, const Tensor& summed) {
  return plan.etp_size == 1 ? r.received : summed.view();
}

// Home-side reduction of the terms in design.md §4.1's order, rounded once to `dtype`, into
// `out` (the caller's buffer) when given, else into a new Tensor (returned).
StatusOr<Tensor> reduce_home(const PermuteLayout& home, const TensorView& terms,
                             std::span<const float> probs, DType dtype, ThreadPool& pool,
                             const std::optional<TensorView>& out = std::nullopt) {
  if (terms.dtype == dtype) {
    if (out) {
      MOED_RETURN_IF_ERROR(unpermute_into(terms, home.sorted_indices, probs, *out, pool));
      return Tensor();
    }
    return unpermute(terms, home.sorted_indices, home.num_tokens, probs, pool);
  }
  // fp32 terms (P > 1) and a bf16 output: the fp32 accumulator, rounded once here.
  MOED_ASSIGN_OR_RETURN(Tensor acc,
                        unpermute(terms, home.sorted_indices, home.num_tokens, probs, pool));
  Tensor b = out ? Tensor() : Tensor::empty(dtype, acc.rows(), acc.cols());
  const TensorView dst = out ? *out : b.view();
  pool.parallel_for(acc.rows(), [&](int64_t begin, int64_t end, int) {
    for (int64_t t = begin; t < end; ++t) {
      convert_f32_to_bf16(std::span<const float>(acc.row<float>(t), size_t(acc.cols())),
                          std::span<bf16>(dst.row<bf16>(t), size_t(acc.cols())));
    }
  });
  return b;
}

// Rows shaped like the handle's expert side (f32 / bf16), as Flex checks them.
Status check_expert_rows(const char* what, const TensorView& rows, const DispatchHandle& handle) {
  return internal::check_float_rows(what, rows, handle.num_rows, handle.hidden);
}

class RowExchangeDispatcher final : public TokenDispatcher {
 public:
  RowExchangeDispatcher(World& world, const DispatchConfig& config,
                        std::unique_ptr<ForwardExchange> forward)
      : TokenDispatcher(world, config), forward_(std::move(forward)) {}

  Status dispatch_preprocess(const DispatchInput& input,
                             const Status& caller_error = Status()) override;
  StatusOr<Request> token_dispatch(bool /*async*/) override {
    return run(dispatch_, kDispatchCalls, &RowExchangeDispatcher::dispatch_body);
  }
  StatusOr<DispatchOutput> dispatch_postprocess() override {
    return finish_result(dispatch_, kDispatchCalls);
  }
  Status combine_preprocess(const CombineInput& input,
                            const Status& caller_error = Status()) override;
  StatusOr<Request> token_combine(bool /*async*/) override {
    return run(combine_, kCombineCalls, &RowExchangeDispatcher::combine_body);
  }
  StatusOr<CombineOutput> combine_postprocess() override {
    return finish_result(combine_, kCombineCalls);
  }

  Status dispatch_postprocess_backward(const DispatchGradInput& grad) override;
  StatusOr<Request> token_dispatch_backward(bool /*async*/) override {
    return run(dispatch_grad_, kDispatchBackwardCalls, &RowExchangeDispatcher::dispatch_grad_body);
  }
  StatusOr<DispatchGrad> dispatch_preprocess_backward() override {
    return finish_result(dispatch_grad_, kDispatchBackwardCalls);
  }
  Status combine_postprocess_backward(const CombineGradInput& grad) override;
  StatusOr<Request> token_combine_backward(bool /*async*/) override {
    return run(combine_grad_, kCombineBackwardCalls, &RowExchangeDispatcher::combine_grad_body);
  }
  StatusOr<CombineGrad> combine_preprocess_backward() override {
    return finish_result(combine_grad_, kCombineBackwardCalls);
  }

 private:
  // Each step's state between its calls (the sequencer's Step: staged, verdict, progress).
  struct DispatchStep : Step {
    PreparedInput prepared;
    TokenRows hidden;               // the caller's tokens, until token_dispatch returns
    std::optional<TensorView> out;  // DispatchInput::out
    DispatchOutput result;  // made by the body
  };
  struct CombineStep : Step {
    std::shared_ptr<const ExchangeHandle> handle;
    TensorView expert_output;       // caller-owned until token_combine returns
    std::optional<TensorView> out;  // CombineInput::out
    CombineOutput result;  // made by the body
  };
  struct DispatchGradStep : Step {
    std::shared_ptr<const ExchangeHandle> handle;
    TensorView rows;           // grad of expert_input
    std::vector<float> probs;  // grad_permuted_probs, zeros where none were given
    DispatchGrad result;  // made by the body
  };
  struct CombineGradStep : Step {
    std::shared_ptr<const ExchangeHandle> handle;
    TensorView grad_out;       // [T, H]
    TensorView expert_output;  // when weighted
    CombineGrad result;  // made by the body
  };

  Status dispatch_body();
  Status combine_body();
  Status dispatch_grad_body();
  Status combine_grad_body();
  // A communicating call. NOTE: AllGather's and AlltoAll's run their body at once whatever
  // `async` says, as Megatron's do on a CPU (their overlap comes from CUDA streams there).
  StatusOr<Request> run(Step& step, const StepCalls& calls,
                        Status (RowExchangeDispatcher::*body)()) {
    return run_step(*world_, /*async=*/false, step, calls,
                    [this, body] { return (this->*body)(); });
  }

  // The handle given to a later step if this dispatcher's kind made it in this world.
  StatusOr<std::shared_ptr<const ExchangeHandle>> check_handle(
      const std::shared_ptr<const DispatchHandle>& handle, const char* step) const;
  // The first call of a step after the dispatch: resets and stages `step` and takes its handle
  // (check_handle); null, the verdict in step.local, when the caller or the handle failed.
  template <class S>
  const ExchangeHandle* start_step(S& step, const std::shared_ptr<const DispatchHandle>& handle,
                                   const Status& caller_error, const char* name) {
    step = S{};
    step.staged = true;
    step.local = caller_error;
    if (!step.local.ok()) return nullptr;
    StatusOr<std::shared_ptr<const ExchangeHandle>> h = check_handle(handle, name);
    if (!h.ok()) {
      step.local = h.status();
      return nullptr;
    }
    step.handle = *std::move(h);
    return step.handle.get();
  }
  // The staged DispatchInput::out against the rows every rank receives (each rank's layout
  // from the gathered counts: the same verdict on every rank, no collective).
  Status check_dispatch_out(const GlobalCounts& counts, int64_t hidden) const;
  // The plan and the public handle fields, taking in.effective as the handle's routing.
  Status init_handle(ExchangeHandle& h, const GlobalCounts& counts, PreparedInput& in) const;
  // Where this dispatch's expert rows go: the caller's `out` (storage holds only fp8 scales),
  // else a buffer of the output pool.
  std::shared_ptr<void> take_expert_input(const ExchangeHandle& h,
                                          const std::optional<TensorView>& out,
                                          TokenRows& expert_input);
  // The combine backward's home rows (design.md §4.3): grad_out permuted, or when weighted
  // round(prob * grad_out) and grad_row_probs, dotted with the fp32 terms, for which the expert
  // outputs go home as in the combine.
  StatusOr<UnpermuteGrad> home_grad(const CombineGradStep& g);

  std::unique_ptr<ForwardExchange> forward_;
  DispatchStep dispatch_;
  CombineStep combine_;
  DispatchGradStep dispatch_grad_;
  CombineGradStep combine_grad_;
  // One per kind of return, so an async step never shares one with another step.
  ReturnRows combine_rows_, dispatch_grad_rows_, combine_grad_rows_;
  OutputPool outputs_;  // dispatch outputs (see OutputPool)
};

// ---- checks ----

StatusOr<std::shared_ptr<const ExchangeHandle>> RowExchangeDispatcher::check_handle(
    const std::shared_ptr<const DispatchHandle>& handle, const char* step) const {
  if (!handle) return invalid_argument(step, ": the dispatch handle is null");
  if (handle->kind != config_.kind) {
    return invalid_argument(step, ": the handle comes from a '", dispatcher_kind_name(handle->kind),
                            "' dispatch; this dispatcher is '", dispatcher_kind_name(config_.kind),
                            "'");
  }
  auto h = std::dynamic_pointer_cast<const ExchangeHandle>(handle);
  if (!h || h->plan.world_size != world_->size()) {
    return invalid_argument(step, ": the handle was not made by a dispatcher of this world");
  }
  return h;
}

Status RowExchangeDispatcher::check_dispatch_out(const GlobalCounts& counts,
                                                 int64_t hidden) const {
  const int R = world_->size();
  for (int r = 0; r < R; ++r) {
    if (counts.out_rows[size_t(r)] < 0) continue;
    const int64_t rows = compute_expert_layout(config_, R, r, counts.view()).num_rows;
    if (counts.out_rows[size_t(r)] != rows) {
      return invalid_argument("rank ", r, ": out is [", counts.out_rows[size_t(r)], ", ", hidden,
                              "]; expected [", rows, ", ", hidden, "]");
    }
  }
  return ok_status();
}

// ---- dispatch ----

Status RowExchangeDispatcher::dispatch_preprocess(const DispatchInput& input,
                                                  const Status& caller_error) {
  DispatchStep& d = dispatch_ = DispatchStep{};
  d.local = caller_error;
  if (d.local.ok()) {
    StatusOr<PreparedInput> in = prepare_dispatch_input(config_, input, world_->pool());
    d.local = in.status();
    if (in.ok()) d.prepared = std::move(*in);
  }
  d.hidden = input.hidden;
  d.out = input.out;
  d.staged = true;
  return ok_status();  // agreed in token_dispatch, so every rank reports the same error
}

// NOTE: the counts travel even with pad_to_capacity, where Megatron's fixed C_s splits need
// none: only real rows cross the wire here (the padding is made on arrival) and the receiver
// needs every chunk's token count to place them. Megatron gathers them in its preprocess; here
// they travel in this step, with the agreement, so the preprocess stays local.
Status RowExchangeDispatcher::dispatch_body() {
  DispatchStep& d = dispatch_;
  MOED_ASSIGN_OR_RETURN(GlobalCounts counts,
                        exchange_counts(*world_, config_, d.local, d.prepared));
  MOED_RETURN_IF_ERROR(check_dispatch_out(counts, d.prepared.hidden));
  std::shared_ptr<ExchangeHandle> h = forward_->new_handle();
  MOED_RETURN_IF_ERROR(init_handle(*h, counts, d.prepared));
  d.prepared = PreparedInput{};
  TokenRows expert_input;
  std::shared_ptr<void> storage = take_expert_input(*h, d.out, expert_input);
  MOED_RETURN_IF_ERROR(forward_->to_experts(*world_, config_, counts, d.hidden, *h, expert_input));
  d.hidden = TokenRows{};
  DispatchOutput out;
  out.expert_input = expert_input;
  out.permuted_probs = h->permuted_probs;
  out.tokens_per_expert = h->tokens_per_expert;
  out.handle = std::move(h);
  out.storage = std::move(storage);
  d.result = std::move(out);
  return ok_status();
}

Status RowExchangeDispatcher::init_handle(ExchangeHandle& h, const GlobalCounts& counts,
                                          PreparedInput& in) const {
  MOED_ASSIGN_OR_RETURN(h.plan, make_row_exchange_plan(config_, *world_, counts, in.effective));
  h.kind = config_.kind;
  h.hidden = in.hidden;
  h.dtype = in.dtype;
  h.num_topk = in.num_topk;
  h.routing = std::move(in.effective);
  h.num_rows = h.plan.layout.num_rows;
  h.tokens_per_expert = h.plan.layout.tokens_per_expert;
  h.tokens_per_expert_unpadded = h.plan.layout.tokens_per_expert_unpadded;
  return ok_status();
}

std::shared_ptr<void> RowExchangeDispatcher::take_expert_input(
    const ExchangeHandle& h, const std::optional<TensorView>& out, TokenRows& expert_input) {
  if (!out) return outputs_.acquire(h.dtype, h.num_rows, h.hidden, expert_input);
  // fp8: the scales stay ours, in a pool buffer.
  std::shared_ptr<void> storage =
      h.dtype == DType::kFP8
          ? outputs_.acquire(h.dtype, h.num_rows, h.hidden, expert_input, /*with_x=*/false)
          : nullptr;
  expert_input.x = *out;
  return storage;
}

// ---- combine: the rows sent home and summed there ----

Status RowExchangeDispatcher::combine_preprocess(const CombineInput& input,
                                                 const Status& caller_error) {
  CombineStep& c = combine_;
  const ExchangeHandle* h = start_step(c, input.handle, caller_error, "combine");
  if (h == nullptr) return ok_status();  // agreed in token_combine
  c.local = check_expert_rows("expert_output", input.expert_output.x, *h);
  if (c.local.ok() && input.out) {
    c.local = internal::check_out_buffer("out", *input.out, h->plan.home.num_tokens, h->hidden,
                                         input.expert_output.x.dtype, "expert_output");
  }
  c.expert_output = input.expert_output.x;
  c.out = input.out;
  return ok_status();
}

Status RowExchangeDispatcher::combine_body() {
  CombineStep& c = combine_;
  MOED_RETURN_IF_ERROR(world_->agree(c.local));
  const ExchangeHandle& h = *c.handle;
  MOED_RETURN_IF_ERROR(send_home(*world_, h.plan, c.expert_output, nullptr, combine_rows_));
  c.expert_output = TensorView();
  const Tensor summed = sum_partials(world_->pool(), h.plan, combine_rows_);
  std::span<const float> probs;
  if (config_.weighted_combine) probs = h.plan.home.permuted_probs;
  CombineOutput out;
  MOED_ASSIGN_OR_RETURN(out.hidden, reduce_home(h.plan.home, terms(h.plan, combine_rows_, summed),
                                                probs, combine_rows_.received.dtype,
                                                world_->pool(), c.out));
  out.out = c.out;
  out.combined_probs = h.routing.prob_sums();
  c.result = std::move(out);
  return ok_status();
}

// ---- dispatch backward: an unweighted combine of the row gradients ----

Status RowExchangeDispatcher::dispatch_postprocess_backward(const DispatchGradInput& grad) {
  DispatchGradStep& g = dispatch_grad_;
  const ExchangeHandle* h = start_step(g, grad.handle, ok_status(), "dispatch backward");
  if (h == nullptr) return ok_status();  // agreed in token_dispatch_backward
  g.local = check_expert_rows("grad_expert_input", grad.grad_expert_input, *h);
  if (g.local.ok() && !grad.grad_permuted_probs.empty() &&
      int64_t(grad.grad_permuted_probs.size()) != h->num_rows) {
    g.local = invalid_argument("grad_permuted_probs has ", grad.grad_permuted_probs.size(),
                               " values but the dispatch gave this rank ", h->num_rows, " rows");
  }
  if (!g.local.ok()) return ok_status();
  g.rows = grad.grad_expert_input;
  // NOTE: the values always travel (zeros when none were given), so every rank takes part in
  // the same exchanges whether or not its caller passed grad_permuted_probs.
  g.probs.assign(size_t(g.handle->num_rows), 0.0f);
  std::copy(grad.grad_permuted_probs.begin(), grad.grad_permuted_probs.end(), g.probs.begin());
  return ok_status();
}

Status RowExchangeDispatcher::dispatch_grad_body() {
  DispatchGradStep& g = dispatch_grad_;
  MOED_RETURN_IF_ERROR(world_->agree(g.local));
  const RowExchangePlan& plan = g.handle->plan;
  MOED_RETURN_IF_ERROR(send_home(*world_, plan, g.rows, &g.probs, dispatch_grad_rows_));
  g.rows = TensorView();
  const Tensor summed = sum_partials(world_->pool(), plan, dispatch_grad_rows_);
  DispatchGrad out;
  MOED_ASSIGN_OR_RETURN(out.grad_hidden,
                        reduce_home(plan.home, terms(plan, dispatch_grad_rows_, summed), {},
                                    dispatch_grad_rows_.received.dtype, world_->pool()));
  MOED_ASSIGN_OR_RETURN(
      out.grad_probs,
      row_values_to_map(plan.home, sum_partial_values(plan, dispatch_grad_rows_)));
  g.result = std::move(out);
  return ok_status();
}

// ---- combine backward: grad_out to the experts (the ForwardExchange's move) ----

Status RowExchangeDispatcher::combine_postprocess_backward(const CombineGradInput& grad) {
  CombineGradStep& g = combine_grad_;
  if (const ExchangeHandle* h = start_step(g, grad.handle, ok_status(), "combine backward")) {
    g.local = internal::check_float_rows("grad_hidden", grad.grad_hidden, h->routing.num_tokens(),
                                         h->hidden);
    if (g.local.ok() && config_.weighted_combine) {
      g.local = check_expert_rows("expert_output", grad.expert_output.x, *h);
    }
  }
  if (!g.local.ok()) return ok_status();  // agreed in token_combine_backward
  g.grad_out = grad.grad_hidden;
  if (config_.weighted_combine) g.expert_output = grad.expert_output.x;
  return ok_status();
}

StatusOr<UnpermuteGrad> RowExchangeDispatcher::home_grad(const CombineGradStep& g) {
  const RowExchangePlan& plan = g.handle->plan;
  if (!config_.weighted_combine) {
    return unpermute_backward(g.grad_out, plan.home.sorted_indices, {}, TensorView(),
                              world_->pool());
  }
  MOED_RETURN_IF_ERROR(send_home(*world_, plan, g.expert_output, nullptr, combine_grad_rows_));
  const Tensor summed = sum_partials(world_->pool(), plan, combine_grad_rows_);
  return unpermute_backward(g.grad_out, plan.home.sorted_indices, plan.home.permuted_probs,
                            terms(plan, combine_grad_rows_, summed), world_->pool());
}

Status RowExchangeDispatcher::combine_grad_body() {
  CombineGradStep& g = combine_grad_;
  MOED_RETURN_IF_ERROR(world_->agree(g.local));
  const ExchangeHandle& h = *g.handle;
  const bool weighted = config_.weighted_combine;
  UnpermuteGrad home;
  if (weighted || forward_->reads_home_rows()) {
    MOED_ASSIGN_OR_RETURN(home, home_grad(g));
  }
  CombineGrad out;
  MOED_ASSIGN_OR_RETURN(out.grad_expert_output,
                        forward_->grad_to_experts(*world_, config_, h, g.grad_out,
                                                  g.expert_output, home.grad_rows));
  // grad_probs: the home rows' grad_row_probs as a [T, E] map when weighted (zeros otherwise:
  // the probs did not weigh the output).
  if (weighted) {
    MOED_ASSIGN_OR_RETURN(out.grad_probs, row_values_to_map(h.plan.home, home.grad_row_probs));
  } else {
    out.grad_probs.assign(size_t(h.routing.num_tokens()) * size_t(h.routing.num_experts), 0.0f);
  }
  g.result = std::move(out);
  return ok_status();
}

}  // namespace

StatusOr<std::unique_ptr<TokenDispatcher>> make_row_exchange_dispatcher(
    World& world, const DispatchConfig& config, std::unique_ptr<ForwardExchange> forward) {
  MOED_RETURN_IF_ERROR(world.agree(config.validate(world.size())));
  DispatchConfig c = config;
  c.kind = forward->kind();
  return std::unique_ptr<TokenDispatcher>(
      new RowExchangeDispatcher(world, c, std::move(forward)));
}

}  // namespace moed
