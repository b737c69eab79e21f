#include "dispatch/alltoall/alltoall.h"

#include <algorithm>
#include <vector>

#include "dispatch/row_exchange.h"

namespace moed {

namespace {

class AlltoAllDispatcher final : public RowExchangeDispatcher {
 public:
  AlltoAllDispatcher(World& world, const DispatchConfig& config)
      : RowExchangeDispatcher(world, config) {}

  Status dispatch_preprocess(const DispatchInput& input,
                             const Status& caller_error = Status()) override;
  StatusOr<Request> token_dispatch(bool async) override;
  StatusOr<DispatchOutput> dispatch_postprocess() override;

  Status combine_postprocess_backward(const CombineGradInput& grad) override;
  StatusOr<Request> token_combine_backward(bool async) override;
  StatusOr<CombineGrad> combine_preprocess_backward() override;

 private:
  struct DispatchState {
    std::shared_ptr<ExchangeHandle> handle;
    TokenRows hidden;    // the caller's tokens, valid until token_dispatch returns
    TokenRows permuted;  // home order: this rank's rows, expert-major (in permuted_*_)
    TokenRows received;  // source-major chunks (s, j) (in received_*_)
    std::vector<float> received_probs;
    std::vector<int32_t> received_tokens;
    std::optional<DispatchOutput> output;  // made by token_dispatch
    Stage stage = Stage::kIdle;            // kPrepared: checked; kExchanged: received, placed
  };
  // The received chunks placed expert-major (token_dispatch's last part).
  StatusOr<DispatchOutput> place_received();
  struct CombineGradRows {
    UnpermuteGrad home;          // rows in home order (+ grad_row_probs when weighted)
    TensorView received;         // source-major chunks on the expert side (in received_x_)
    Stage stage = Stage::kIdle;  // kPrepared: started; kHomeReady; kExchanged: received
  };

  DispatchState d_;
  CombineGradRows cg_;
  // Kept across calls (see ScratchBuffer); d_ and cg_ hold views into them.
  ScratchBuffer permuted_x_, permuted_scales_, received_x_, received_scales_;
};

// ---- dispatch ----

Status AlltoAllDispatcher::dispatch_preprocess(const DispatchInput& input,
                                              const Status& caller_error) {
  d_ = DispatchState{};
  stage_dispatch(input, caller_error);
  d_.hidden = input.hidden;
  d_.handle = std::make_shared<ExchangeHandle>();
  d_.stage = Stage::kPrepared;
  return ok_status();
}

// The permute and the placing of the received chunks run here, not in the local steps around
// it (row_exchange.h says why).
StatusOr<Request> AlltoAllDispatcher::token_dispatch(bool async) {
  if (d_.stage != Stage::kPrepared)
    return failed_precondition("token_dispatch before dispatch_preprocess");
  // NOTE: the counts travel even with pad_to_capacity, where Megatron's fixed C_s splits need
  // none: only real rows cross the wire here (the padding is made on arrival) and the
  // receiver needs every chunk's token count to place them. Megatron gathers them in its
  // preprocess; here they travel in this step, with the agreement, so the preprocess stays local.
  if (Status s = agree_dispatch(*d_.handle).status(); !s.ok()) {
    d_ = DispatchState{};
    return s;
  }
  const ExchangeHandle& h = *d_.handle;
  const RowExchangePlan& plan = h.plan;
  // Permute by global expert: destination d's rows are the contiguous block of ep(d)'s experts.
  const int64_t home_rows = plan.home.num_rows;
  d_.permuted.x = permuted_x_.view(h.dtype, home_rows, h.hidden);
  if (h.dtype == DType::kFP8) {
    d_.permuted.scales = permuted_scales_.view(DType::kF32, home_rows, h.hidden / kFp8BlockSize);
  }
  MOED_RETURN_IF_ERROR(permute_rows_into(d_.hidden, plan.home, d_.permuted, world_->pool()));
  d_.hidden = TokenRows{};
  const int64_t n = plan.expert_rows;
  auto move = [&](const void* send, void* recv, size_t row_bytes) {
    return exchange_to_experts(*world_, plan, send, recv, row_bytes);
  };
  d_.received.x = received_x_.view(h.dtype, n, h.hidden);
  MOED_RETURN_IF_ERROR(move(d_.permuted.x.data, d_.received.x.data, d_.received.x.row_bytes()));
  if (h.dtype == DType::kFP8) {
    d_.received.scales = received_scales_.view(DType::kF32, n, h.hidden / kFp8BlockSize);
    MOED_RETURN_IF_ERROR(
        move(d_.permuted.scales.data, d_.received.scales.data, d_.received.scales.row_bytes()));
  }
  d_.received_probs.resize(size_t(n));
  MOED_RETURN_IF_ERROR(
      move(plan.home.permuted_probs.data(), d_.received_probs.data(), sizeof(float)));
  d_.received_tokens.resize(size_t(n));
  MOED_RETURN_IF_ERROR(
      move(plan.home.sorted_indices.data(), d_.received_tokens.data(), sizeof(int32_t)));
  d_.permuted = TokenRows{};
  MOED_ASSIGN_OR_RETURN(DispatchOutput out, place_received());
  d_.output = std::move(out);
  d_.stage = Stage::kExchanged;
  return completed_request();
}

StatusOr<DispatchOutput> AlltoAllDispatcher::dispatch_postprocess() {
  return take_result(d_, d_.output, "dispatch_postprocess before token_dispatch");
}

StatusOr<DispatchOutput> AlltoAllDispatcher::place_received() {
  ExchangeHandle& h = *d_.handle;
  const RowExchangePlan& plan = h.plan;
  TokenRows expert_input;
  std::shared_ptr<void> storage = take_expert_input(h, expert_input);
  // Source-major (s, j) chunks to expert-major (j, s) at their canonical offsets; the gaps are
  // the pad_to_capacity and expert_alignment padding, zeroed.
  MOED_RETURN_IF_ERROR(sort_chunks_by_idxs_into(d_.received, plan.chunk_sizes, plan.chunk_order,
                                                expert_input, plan.chunk_offsets, world_->pool()));
  const int R = plan.world_size, L = plan.num_local_experts;
  h.permuted_probs.assign(size_t(h.num_rows), 0.0f);
  h.row_src_rank.assign(size_t(h.num_rows), -1);
  h.row_src_token.assign(size_t(h.num_rows), -1);
  int64_t src = 0;
  for (int s = 0; s < R; ++s) {
    for (int j = 0; j < L; ++j) {
      const int64_t dst = plan.layout.offset(j, s);
      for (int64_t k = 0; k < plan.layout.tokens(j, s); ++k, ++src) {
        h.permuted_probs[size_t(dst + k)] = d_.received_probs[size_t(src)];
        h.row_src_rank[size_t(dst + k)] = s;
        h.row_src_token[size_t(dst + k)] = d_.received_tokens[size_t(src)];
      }
    }
  }
  return dispatch_output(std::move(d_.handle), expert_input, std::move(storage));
}

// ---- combine backward: a dispatch of grad_out (times the prob when weighted) ----

Status AlltoAllDispatcher::combine_postprocess_backward(const CombineGradInput& grad) {
  cg_ = CombineGradRows{};
  MOED_RETURN_IF_ERROR(start_combine_backward(grad));
  cg_.stage = Stage::kPrepared;
  if (!config_.weighted_combine) {
    // Local: the home rows are grad_out permuted; no expert output needed.
    MOED_ASSIGN_OR_RETURN(cg_.home, home_combine_backward());
    cg_.stage = Stage::kHomeReady;
  }
  return ok_status();
}

StatusOr<Request> AlltoAllDispatcher::token_combine_backward(bool async) {
  if (cg_.stage == Stage::kPrepared) {
    // Weighted: the expert outputs come home first (grad_row_probs needs their fp32 terms).
    MOED_ASSIGN_OR_RETURN(cg_.home, home_combine_backward());
    cg_.stage = Stage::kHomeReady;
  }
  if (cg_.stage != Stage::kHomeReady) {
    return failed_precondition("token_combine_backward before combine_postprocess_backward");
  }
  const RowExchangePlan& plan = combine_grad_.handle->plan;
  cg_.received =
      received_x_.view(cg_.home.grad_rows.dtype(), plan.expert_rows, cg_.home.grad_rows.cols());
  MOED_RETURN_IF_ERROR(exchange_to_experts(*world_, plan, cg_.home.grad_rows.data(),
                                           cg_.received.data, cg_.received.row_bytes()));
  cg_.home.grad_rows = Tensor();
  cg_.stage = Stage::kExchanged;
  return completed_request();
}

StatusOr<CombineGrad> AlltoAllDispatcher::combine_preprocess_backward() {
  if (cg_.stage != Stage::kExchanged) {
    return failed_precondition("combine_preprocess_backward before token_combine_backward");
  }
  const ExchangeHandle& h = *combine_grad_.handle;
  const RowExchangePlan& plan = h.plan;
  CombineGrad out;
  out.grad_expert_output = Tensor::empty(cg_.received.dtype, h.num_rows, h.hidden);
  MOED_RETURN_IF_ERROR(sort_chunks_by_idxs_into(
      TokenRows{cg_.received, TensorView()}, plan.chunk_sizes, plan.chunk_order,
      TokenRows{out.grad_expert_output.view(), TensorView()}, plan.chunk_offsets, world_->pool()));
  MOED_RETURN_IF_ERROR(finish_combine_backward(cg_.home.grad_row_probs, out));
  cg_ = CombineGradRows{};
  return out;
}

}  // namespace

StatusOr<std::unique_ptr<TokenDispatcher>> make_alltoall_dispatcher(World& world,
                                                                    const DispatchConfig& config) {
  return make_row_exchange_dispatcher<AlltoAllDispatcher>(world, config, DispatcherKind::kAlltoAll);
}

}  // namespace moed
