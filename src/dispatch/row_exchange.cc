#include "dispatch/row_exchange.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/row_kernels.h"
#include "dispatch/out_buffer.h"

namespace moed {

namespace {

// One value per row seen as a [n, 1] f32 tensor, so the row functions move it like a payload.
TokenRows value_rows(std::span<const float> v) {
  return TokenRows{TensorView(const_cast<float*>(v.data()), DType::kF32, int64_t(v.size()), 1),
                   TensorView()};
}

std::vector<int64_t> prefix(std::span<const int64_t> n) {
  std::vector<int64_t> off(n.size() + 1, 0);
  for (size_t i = 0; i < n.size(); ++i) off[i + 1] = off[i] + n[i];
  return off;
}

// all_to_all_v of whole rows: send_rows[d] rows at row send_offsets[d] go to rank d (offsets
// may repeat: the same rows to several ranks); rank s's rows land packed in rank order.
Status exchange_rows(World& world, const void* send, std::span<const int64_t> send_rows,
                     std::span<const int64_t> send_offsets, void* recv,
                     std::span<const int64_t> recv_rows, size_t row_bytes) {
  const size_t R = size_t(world.size());
  std::vector<size_t> sb(R), so(R), rb(R), ro(R);
  size_t r = 0;
  for (size_t i = 0; i < R; ++i) {
    sb[i] = size_t(send_rows[i]) * row_bytes;
    so[i] = size_t(send_offsets[i]) * row_bytes;
    rb[i] = size_t(recv_rows[i]) * row_bytes;
    ro[i] = r;
    r += rb[i];
  }
  return world.all_to_all_v_bytes(send, sb, so, recv, rb, ro);
}

}  // namespace

TensorView ScratchBuffer::view(DType dtype, int64_t rows, int64_t cols) {
  const size_t need = size_t(rows) * size_t(cols) * dtype_size(dtype);
  if (bytes_.bytes() < need) {
    bytes_ = Tensor();  // free first: old and new together could double the peak
    bytes_ = Tensor::empty(DType::kFP8, 1, int64_t(need));
  }
  return TensorView(bytes_.data(), dtype, rows, cols);
}

std::shared_ptr<void> OutputPool::acquire(DType dtype, int64_t rows, int64_t cols,
                                          TokenRows& rows_out, bool with_x) {
  // NOTE: two entries cover the usual caller, which holds the previous output while the next
  // dispatch runs; a caller holding more gets unpooled buffers instead of unbounded growth.
  constexpr size_t kMaxEntries = 2;
  std::shared_ptr<Entry> e;
  for (const std::shared_ptr<Entry>& c : entries_) {
    if (c.use_count() == 1) {
      e = c;
      break;
    }
  }
  if (!e) {
    e = std::make_shared<Entry>();
    if (entries_.size() < kMaxEntries) entries_.push_back(e);
  }
  rows_out.x = with_x ? e->x.view(dtype, rows, cols) : TensorView();
  rows_out.scales =
      dtype == DType::kFP8 ? e->scales.view(DType::kF32, rows, cols / kFp8BlockSize) : TensorView();
  return e;
}

StatusOr<GlobalCounts> exchange_counts(World& world, const DispatchConfig& config,
                                       const Status& verdict, const PreparedInput& input) {
  const int R = world.size(), E = config.num_experts;
  const AgreedField fields[] = {{"hidden", input.hidden, AgreedField::kAgree},
                                {"dtype", int64_t(input.dtype), AgreedField::kAgreeDType},
                                {"num_topk", input.num_topk, AgreedField::kAgree}};
  // [counts[E], T, C_s, out rows]; zeros from a rank whose input failed (the table is not read).
  std::vector<int64_t> payload(size_t(E) + 3, 0);
  if (verdict.ok()) {
    std::copy(input.tokens_per_expert.begin(), input.tokens_per_expert.end(), payload.begin());
    payload[size_t(E)] = input.num_tokens;
    payload[size_t(E) + 1] = input.capacity;
    payload[size_t(E) + 2] = input.out_rows;
  }
  MOED_ASSIGN_OR_RETURN(AgreedTable all, agree_in_one(world, verdict, fields, payload));
  GlobalCounts c;
  c.counts.resize(size_t(R) * E);
  c.num_tokens.resize(size_t(R));
  c.capacity.resize(size_t(R));
  c.out_rows.resize(size_t(R));
  for (int s = 0; s < R; ++s) {
    const int64_t* row = all.row(s) + 1 + std::size(fields);
    std::copy(row, row + E, c.counts.begin() + size_t(s) * E);
    c.num_tokens[size_t(s)] = row[E];
    c.capacity[size_t(s)] = row[E + 1];
    c.out_rows[size_t(s)] = row[E + 2];
  }
  return c;
}

StatusOr<RowExchangePlan> make_row_exchange_plan(const DispatchConfig& config, World& world,
                                                 const GlobalCounts& counts,
                                                 const SparseRouting& effective) {
  const int R = world.size(), L = config.num_local_experts(R), P = config.etp_size;
  RowExchangePlan plan;
  plan.world_size = R;
  plan.num_local_experts = L;
  plan.etp_size = P;
  plan.layout = compute_expert_layout(config, R, world.rank(), counts.counts, counts.capacity);
  plan.chunk_sizes.resize(size_t(R) * L);
  plan.chunk_order.resize(size_t(L) * R);
  plan.chunk_offsets.resize(size_t(L) * R);
  plan.rows_of_source.assign(size_t(R), 0);
  for (int j = 0; j < L; ++j) {
    for (int s = 0; s < R; ++s) {
      const int64_t n = plan.layout.tokens(j, s);
      plan.chunk_sizes[size_t(s) * L + j] = n;
      plan.chunk_order[size_t(j) * R + s] = s * L + j;
      plan.chunk_offsets[size_t(j) * R + s] = plan.layout.offset(j, s);
      plan.rows_of_source[size_t(s)] += n;
      plan.expert_rows += n;
    }
  }
  MOED_ASSIGN_OR_RETURN(plan.home, make_permute_layout(effective, PermuteOptions{}, world.pool()));
  plan.home_rows_of_rank.resize(size_t(R));
  plan.home_offset_of_rank.resize(size_t(R));
  for (int g = 0; g < R; ++g) {
    const int first = (g / P) * L;
    int64_t n = 0;
    for (int j = 0; j < L; ++j) n += plan.home.tokens_per_expert_unpadded[size_t(first + j)];
    plan.home_rows_of_rank[size_t(g)] = n;
    plan.home_offset_of_rank[size_t(g)] = plan.home.expert_offsets[size_t(first)];
  }
  return plan;
}

Status exchange_to_experts(World& world, const RowExchangePlan& plan, const void* send, void* recv,
                           size_t row_bytes) {
  return exchange_rows(world, send, plan.home_rows_of_rank, plan.home_offset_of_rank, recv,
                       plan.rows_of_source, row_bytes);
}

Status exchange_to_home(World& world, const RowExchangePlan& plan, const void* send, void* recv,
                        size_t row_bytes) {
  return exchange_rows(world, send, plan.rows_of_source, prefix(plan.rows_of_source), recv,
                       plan.home_rows_of_rank, row_bytes);
}

// ---- dispatch glue ----

void RowExchangeDispatcher::stage_dispatch(const DispatchInput& input,
                                           const Status& caller_error) {
  staged_ = PreparedInput{};
  dispatch_out_ = std::nullopt;
  staged_verdict_ = caller_error;
  if (!caller_error.ok()) return;
  StatusOr<PreparedInput> in = prepare_dispatch_input(config_, input, world_->pool());
  staged_verdict_ = in.status();
  if (in.ok()) staged_ = std::move(*in);
  dispatch_out_ = input.out;
}

StatusOr<GlobalCounts> RowExchangeDispatcher::agree_dispatch(ExchangeHandle& h) {
  MOED_ASSIGN_OR_RETURN(GlobalCounts counts,
                        exchange_counts(*world_, config_, std::exchange(staged_verdict_, Status()),
                                        staged_));
  MOED_RETURN_IF_ERROR(check_dispatch_out(counts, staged_.hidden));
  MOED_RETURN_IF_ERROR(init_handle(h, counts, staged_));
  staged_ = PreparedInput{};
  return counts;
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

Status RowExchangeDispatcher::check_dispatch_out(const GlobalCounts& counts,
                                                 int64_t hidden) const {
  const int R = world_->size();
  for (int r = 0; r < R; ++r) {
    if (counts.out_rows[size_t(r)] < 0) continue;
    const int64_t rows =
        compute_expert_layout(config_, R, r, counts.counts, counts.capacity).num_rows;
    if (counts.out_rows[size_t(r)] != rows) {
      return invalid_argument("rank ", r, ": out is [", counts.out_rows[size_t(r)], ", ", hidden,
                              "]; expected [", rows, ", ", hidden, "]");
    }
  }
  return ok_status();
}

std::shared_ptr<void> RowExchangeDispatcher::take_expert_input(const ExchangeHandle& h,
                                                               TokenRows& expert_input) {
  std::optional<TensorView> out = std::exchange(dispatch_out_, std::nullopt);
  if (!out) return outputs_.acquire(h.dtype, h.num_rows, h.hidden, expert_input);
  // fp8: the scales stay ours, in a pool buffer.
  std::shared_ptr<void> storage =
      h.dtype == DType::kFP8
          ? outputs_.acquire(h.dtype, h.num_rows, h.hidden, expert_input, /*with_x=*/false)
          : nullptr;
  expert_input.x = *out;
  return storage;
}

DispatchOutput RowExchangeDispatcher::dispatch_output(std::shared_ptr<const ExchangeHandle> h,
                                                      const TokenRows& expert_input,
                                                      std::shared_ptr<void> storage) {
  DispatchOutput out;
  out.expert_input = expert_input;
  out.permuted_probs = h->permuted_probs;
  out.tokens_per_expert = h->tokens_per_expert;
  out.handle = std::move(h);
  out.storage = std::move(storage);
  return out;
}

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

Status RowExchangeDispatcher::check_expert_rows(const char* what, const TensorView& rows,
                                                const DispatchHandle& handle) {
  if (rows.dtype != DType::kF32 && rows.dtype != DType::kBF16) {
    return invalid_argument(what, " is ", dtype_name(rows.dtype),
                            "; expert outputs and "
                            "gradients must be f32 or bf16");
  }
  if (rows.rows != handle.num_rows || rows.cols != handle.hidden) {
    return invalid_argument(what, " is [", rows.rows, ", ", rows.cols,
                            "] but the dispatch gave "
                            "this rank [",
                            handle.num_rows, ", ", handle.hidden, "]");
  }
  if (rows.row_stride < rows.cols) {
    return invalid_argument(what, " row_stride = ", rows.row_stride, " < hidden = ", rows.cols);
  }
  if (rows.rows > 0 && rows.data == nullptr) return invalid_argument(what, ".data is null");
  return ok_status();
}

// ---- the return path ----

Status RowExchangeDispatcher::pack_return(ReturnState& st,
                                          std::shared_ptr<const ExchangeHandle> handle,
                                          const TensorView& rows, std::span<const float> values) {
  st.reset();
  st.handle = std::move(handle);
  const RowExchangePlan& plan = st.handle->plan;
  const int64_t n = plan.expert_rows;
  // NOTE: sorting back is the backward of the dispatch's sort_chunks_by_idxs: chunk (j, s) of
  // the canonical layout returns to source-major place s * L + j; padding rows stay behind.
  st.packed = st.packed_buffer.view(rows.dtype, n, rows.cols);
  MOED_RETURN_IF_ERROR(sort_chunks_by_idxs_backward_into(
      TokenRows{rows, TensorView()}, plan.chunk_sizes, plan.chunk_order,
      TokenRows{st.packed, TensorView()}, plan.chunk_offsets, world_->pool()));
  st.has_values = !values.empty();
  if (st.has_values) {
    st.packed_values.resize(size_t(n));
    MOED_RETURN_IF_ERROR(sort_chunks_by_idxs_backward_into(
        value_rows(values), plan.chunk_sizes, plan.chunk_order, value_rows(st.packed_values),
        plan.chunk_offsets, world_->pool()));
  }
  st.stage = Stage::kPrepared;
  return ok_status();
}

Status RowExchangeDispatcher::send_return(ReturnState& st) {
  if (st.stage != Stage::kPrepared)
    return failed_precondition("the return exchange runs after its preprocess");
  const RowExchangePlan& plan = st.handle->plan;
  int64_t n = 0;
  for (int64_t r : plan.home_rows_of_rank) n += r;
  st.received = st.received_buffer.view(st.packed.dtype, n, st.packed.cols);
  MOED_RETURN_IF_ERROR(
      exchange_to_home(*world_, plan, st.packed.data, st.received.data, st.packed.row_bytes()));
  if (st.has_values) {
    st.received_values.resize(size_t(n));
    MOED_RETURN_IF_ERROR(exchange_to_home(*world_, plan, st.packed_values.data(),
                                          st.received_values.data(), sizeof(float)));
  }
  st.packed = TensorView();
  st.stage = Stage::kExchanged;
  return ok_status();
}

// NOTE: rows arrive rank-major, [g][j][t] with g = ep * P + p; home order is [ep][j][t]. With
// P = 1 the two are the same and the received rows are already the terms: unpermute's
// `acc += prob * float(y)` equals design.md §4.1's `acc += prob * (0 + float(y))` bit for bit (the
// two differ only for y = -0, where acc, which starts at +0, is unchanged either way).
Tensor RowExchangeDispatcher::sum_partials(const ReturnState& st) const {
  const RowExchangePlan& plan = st.handle->plan;
  const int P = plan.etp_size, R = plan.world_size;
  if (P == 1) return Tensor();
  const int64_t H = st.received.cols;
  const std::vector<int64_t> recv_off = prefix(plan.home_rows_of_rank);
  Tensor out = Tensor::empty(DType::kF32, plan.home.num_rows, H);
  const internal::RowKernels& kernels = internal::row_kernels();
  world_->pool().parallel_for(
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
              const int64_t r = recv_off[size_t(g0 + p)] + k;
              (p == 0 ? kernels.start : kernels.accumulate)(acc, st.received.row_ptr(r),
                                                            st.received.dtype, size_t(H));
            }
          }
        }
      },
      /*min_chunk=*/16);
  return out;
}

std::vector<float> RowExchangeDispatcher::sum_partial_values(const ReturnState& st) const {
  const RowExchangePlan& plan = st.handle->plan;
  const int P = plan.etp_size, R = plan.world_size;
  if (P == 1) return st.received_values;
  const std::vector<int64_t> recv_off = prefix(plan.home_rows_of_rank);
  std::vector<float> out(size_t(plan.home.num_rows), 0.0f);
  for (int g0 = 0; g0 < R; g0 += P) {
    for (int64_t k = 0; k < plan.home_rows_of_rank[size_t(g0)]; ++k) {
      float acc = 0.0f;
      for (int p = 0; p < P; ++p) acc += st.received_values[size_t(recv_off[size_t(g0 + p)] + k)];
      out[size_t(plan.home_offset_of_rank[size_t(g0)] + k)] = acc;
    }
  }
  return out;
}

TensorView RowExchangeDispatcher::terms(const ReturnState& st, const Tensor& summed) const {
  return st.handle->plan.etp_size == 1 ? st.received : summed.view();
}

namespace {

// Home-side reduction of the terms in design.md §4.1's order, rounded once to `dtype`, into `out`
// (the caller's buffer) when given, else into a new Tensor (returned).
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

}  // namespace

// ---- combine ----

Status RowExchangeDispatcher::combine_preprocess(const CombineInput& input,
                                                 const Status& caller_error) {
  combine_step_ = CombineStep{};
  combine_step_.stage = Stage::kPrepared;
  if (!caller_error.ok()) {
    combine_step_.verdict = caller_error;
    return ok_status();
  }
  auto h = check_handle(input.handle, "combine");
  Status local =
      h.ok() ? check_expert_rows("expert_output", input.expert_output.x, **h) : h.status();
  if (local.ok() && input.out) {
    local = moed::internal::check_out_buffer("out", *input.out, (*h)->plan.home.num_tokens,
                                             (*h)->hidden, input.expert_output.x.dtype,
                                             "expert_output");
  }
  // Local, as the step's contract says: the verdict is agreed in token_combine.
  combine_step_.verdict = local;
  if (local.ok()) {
    combine_step_.handle = *h;
    combine_step_.expert_output = input.expert_output.x;
    combine_step_.out = input.out;
  }
  return ok_status();
}

// The rows are packed, sent home and summed all here, not in the local steps around it
// (row_exchange.h says why).
StatusOr<Request> RowExchangeDispatcher::token_combine(bool async) {
  CombineStep& c = combine_step_;
  if (c.stage != Stage::kPrepared)
    return failed_precondition("token_combine before combine_preprocess");
  if (Status agreed = world_->agree(c.verdict); !agreed.ok()) {
    c = CombineStep{};
    return agreed;
  }
  MOED_RETURN_IF_ERROR(pack_return(combine_, c.handle, c.expert_output, {}));
  combine_.out = c.out;  // after pack_return, which starts the step afresh
  c.expert_output = TensorView();
  MOED_RETURN_IF_ERROR(send_return(combine_));
  const ExchangeHandle& h = *combine_.handle;
  const Tensor summed = sum_partials(combine_);
  std::span<const float> probs;
  if (config_.weighted_combine) probs = h.plan.home.permuted_probs;
  CombineOutput out;
  MOED_ASSIGN_OR_RETURN(
      out.hidden, reduce_home(h.plan.home, terms(combine_, summed), probs, combine_.received.dtype,
                              world_->pool(), combine_.out));
  out.out = combine_.out;
  out.combined_probs = h.routing.prob_sums();
  combine_.reset();
  c.result = std::move(out);
  c.stage = Stage::kExchanged;
  return completed_request();
}

StatusOr<CombineOutput> RowExchangeDispatcher::combine_postprocess() {
  return take_result(combine_step_, combine_step_.result,
                     "combine_postprocess before token_combine");
}

// ---- dispatch backward: an unweighted combine of the row gradients ----

Status RowExchangeDispatcher::dispatch_postprocess_backward(const DispatchGradInput& grad) {
  auto h = check_handle(grad.handle, "dispatch backward");
  Status local =
      h.ok() ? check_expert_rows("grad_expert_input", grad.grad_expert_input, **h) : h.status();
  if (local.ok() && !grad.grad_permuted_probs.empty() &&
      int64_t(grad.grad_permuted_probs.size()) != (*h)->num_rows) {
    local = invalid_argument("grad_permuted_probs has ", grad.grad_permuted_probs.size(),
                             " values but the dispatch gave this rank ", (*h)->num_rows, " rows");
  }
  MOED_RETURN_IF_ERROR(world_->agree(local));
  // NOTE: the values always travel (zeros when none were given), so every rank takes part in
  // the same exchanges whether or not its caller passed grad_permuted_probs.
  grad_pprobs_.assign(size_t((*h)->num_rows), 0.0f);
  std::copy(grad.grad_permuted_probs.begin(), grad.grad_permuted_probs.end(), grad_pprobs_.begin());
  MOED_RETURN_IF_ERROR(pack_return(dispatch_grad_, *h, grad.grad_expert_input, grad_pprobs_));
  dispatch_grad_.has_values = true;
  dispatch_grad_.packed_values.resize(size_t(dispatch_grad_.packed.rows), 0.0f);
  return ok_status();
}

StatusOr<Request> RowExchangeDispatcher::token_dispatch_backward(bool async) {
  MOED_RETURN_IF_ERROR(send_return(dispatch_grad_));
  return completed_request();
}

StatusOr<DispatchGrad> RowExchangeDispatcher::dispatch_preprocess_backward() {
  if (dispatch_grad_.stage != Stage::kExchanged) {
    return failed_precondition("dispatch_preprocess_backward before token_dispatch_backward");
  }
  const ExchangeHandle& h = *dispatch_grad_.handle;
  const Tensor summed = sum_partials(dispatch_grad_);
  DispatchGrad out;
  MOED_ASSIGN_OR_RETURN(out.grad_hidden,
                        reduce_home(h.plan.home, terms(dispatch_grad_, summed), {},
                                    dispatch_grad_.received.dtype, world_->pool()));
  const std::vector<float> values = sum_partial_values(dispatch_grad_);
  MOED_ASSIGN_OR_RETURN(out.grad_probs, row_values_to_map(h.plan.home, values));
  dispatch_grad_.reset();
  grad_pprobs_.clear();
  return out;
}

// ---- combine backward, shared half ----

Status RowExchangeDispatcher::start_combine_backward(const CombineGradInput& grad) {
  auto h = check_handle(grad.handle, "combine backward");
  Status local = h.ok() ? ok_status() : h.status();
  if (local.ok()) {
    const DispatchHandle& d = **h;
    const TensorView& g = grad.grad_hidden;
    if (g.dtype != DType::kF32 && g.dtype != DType::kBF16) {
      local = invalid_argument("grad_hidden is ", dtype_name(g.dtype), "; must be f32 or bf16");
    } else if (g.rows != d.routing.num_tokens() || g.cols != d.hidden) {
      local = invalid_argument("grad_hidden is [", g.rows, ", ", g.cols, "] but this rank has [",
                               d.routing.num_tokens(), ", ", d.hidden, "] tokens");
    } else if (g.row_stride < g.cols || (g.rows > 0 && g.data == nullptr)) {
      local = invalid_argument("grad_hidden has row_stride ", g.row_stride, " < ", g.cols,
                               " or null data");
    } else if (config_.weighted_combine) {
      local = check_expert_rows("expert_output (needed by the weighted combine backward)",
                                grad.expert_output.x, d);
    }
  }
  MOED_RETURN_IF_ERROR(world_->agree(local));
  combine_grad_.reset();
  combine_grad_.handle = *h;
  combine_grad_.grad_out = grad.grad_hidden;
  if (config_.weighted_combine) {
    combine_grad_.expert_output = grad.expert_output.x;
    MOED_RETURN_IF_ERROR(pack_return(combine_grad_.y, *h, grad.expert_output.x, {}));
  }
  combine_grad_.stage = Stage::kPrepared;
  return ok_status();
}

StatusOr<UnpermuteGrad> RowExchangeDispatcher::home_combine_backward() {
  if (combine_grad_.stage != Stage::kPrepared) {
    return failed_precondition("token_combine_backward before combine_postprocess_backward");
  }
  const RowExchangePlan& plan = combine_grad_.handle->plan;
  if (!config_.weighted_combine) {
    return unpermute_backward(combine_grad_.grad_out, plan.home.sorted_indices, {}, TensorView(),
                              world_->pool());
  }
  MOED_RETURN_IF_ERROR(send_return(combine_grad_.y));
  const Tensor summed = sum_partials(combine_grad_.y);
  MOED_ASSIGN_OR_RETURN(
      UnpermuteGrad g,
      unpermute_backward(combine_grad_.grad_out, plan.home.sorted_indices, plan.home.permuted_probs,
                         terms(combine_grad_.y, summed), world_->pool()));
  combine_grad_.y.reset();
  return g;
}

Status RowExchangeDispatcher::finish_combine_backward(std::span<const float> grad_row_probs,
                                                      CombineGrad& out) {
  const ExchangeHandle& h = *combine_grad_.handle;
  if (config_.weighted_combine) {
    MOED_ASSIGN_OR_RETURN(out.grad_probs, row_values_to_map(h.plan.home, grad_row_probs));
  } else {
    out.grad_probs.assign(size_t(h.routing.num_tokens()) * size_t(h.routing.num_experts), 0.0f);
  }
  combine_grad_.reset();
  return ok_status();
}

}  // namespace moed
