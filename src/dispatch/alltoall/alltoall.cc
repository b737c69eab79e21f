#include "dispatch/alltoall/alltoall.h"

#include <algorithm>
#include <vector>

#include "dispatch/row_exchange.h"

namespace moed {

namespace {

// AlltoAll's move: this rank's tokens permuted by global expert (destination d's rows, the
// experts of ep(d), are contiguous), one all_to_all_v each of rows, scales (fp8), probs and
// source token ids, then each source's chunks placed expert-major (sort_chunks_by_idxs). Its
// combine backward is a dispatch of the home rows.
class AlltoAllForward final : public ForwardExchange {
 public:
  DispatcherKind kind() const override { return DispatcherKind::kAlltoAll; }
  bool reads_home_rows() const override { return true; }

  Status to_experts(World& w, const DispatchConfig&, const GlobalCounts&, const TokenRows& hidden,
                    ExchangeHandle& h, const TokenRows& expert_input) override {
    const RowExchangePlan& plan = h.plan;
    const bool fp8 = h.dtype == DType::kFP8;
    const int64_t home_rows = plan.home.num_rows, n = plan.expert_rows;
    TokenRows permuted;
    permuted.x = permuted_x_.view(h.dtype, home_rows, h.hidden);
    if (fp8) permuted.scales = permuted_scales_.view(DType::kF32, home_rows, h.hidden / kFp8BlockSize);
    MOED_RETURN_IF_ERROR(permute_rows_into(hidden, plan.home, permuted, w.pool()));
    auto move = [&](const void* send, void* recv, size_t row_bytes) {
      return exchange_to_experts(w, plan, send, recv, row_bytes);
    };
    TokenRows received;
    received.x = received_x_.view(h.dtype, n, h.hidden);
    MOED_RETURN_IF_ERROR(move(permuted.x.data, received.x.data, received.x.row_bytes()));
    if (fp8) {
      received.scales = received_scales_.view(DType::kF32, n, h.hidden / kFp8BlockSize);
      MOED_RETURN_IF_ERROR(
          move(permuted.scales.data, received.scales.data, received.scales.row_bytes()));
    }
    std::vector<float> probs(static_cast<size_t>(n));
    MOED_RETURN_IF_ERROR(move(plan.home.permuted_probs.data(), probs.data(), sizeof(float)));
    std::vector<int32_t> tokens(static_cast<size_t>(n));
    MOED_RETURN_IF_ERROR(move(plan.home.sorted_indices.data(), tokens.data(), sizeof(int32_t)));
    // Source-major (s, j) chunks to expert-major (j, s) at their canonical offsets; the gaps
    // are the pad_to_capacity and expert_alignment padding, zeroed.
    MOED_RETURN_IF_ERROR(sort_chunks_by_idxs_into(received, plan.chunk_sizes, plan.chunk_order,
                                                  expert_input, plan.chunk_offsets, w.pool()));
    const int R = plan.world_size, L = plan.num_local_experts;
    h.permuted_probs.assign(size_t(h.num_rows), 0.0f);
    h.row_src_rank.assign(size_t(h.num_rows), -1);
    h.row_src_token.assign(size_t(h.num_rows), -1);
    int64_t src = 0;
    for (int s = 0; s < R; ++s) {
      for (int j = 0; j < L; ++j) {
        const int64_t dst = plan.layout.offset(j, s);
        for (int64_t k = 0; k < plan.layout.tokens(j, s); ++k, ++src) {
          h.permuted_probs[size_t(dst + k)] = probs[size_t(src)];
          h.row_src_rank[size_t(dst + k)] = s;
          h.row_src_token[size_t(dst + k)] = tokens[size_t(src)];
        }
      }
    }
    return ok_status();
  }

  StatusOr<Tensor> grad_to_experts(World& w, const DispatchConfig&, const ExchangeHandle& h,
                                   const TensorView&, const TensorView&,
                                   const Tensor& home_rows) override {
    const RowExchangePlan& plan = h.plan;
    const TensorView received =
        received_x_.view(home_rows.dtype(), plan.expert_rows, home_rows.cols());
    MOED_RETURN_IF_ERROR(
        exchange_to_experts(w, plan, home_rows.data(), received.data, received.row_bytes()));
    Tensor out = Tensor::empty(received.dtype, h.num_rows, h.hidden);
    MOED_RETURN_IF_ERROR(sort_chunks_by_idxs_into(
        TokenRows{received, TensorView()}, plan.chunk_sizes, plan.chunk_order,
        TokenRows{out.view(), TensorView()}, plan.chunk_offsets, w.pool()));
    return out;
  }

 private:
  // Kept across calls (see ScratchBuffer).
  ScratchBuffer permuted_x_, permuted_scales_, received_x_, received_scales_;
};

}  // namespace

StatusOr<std::unique_ptr<TokenDispatcher>> make_alltoall_dispatcher(World& world,
                                                                    const DispatchConfig& config) {
  return make_row_exchange_dispatcher(world, config, std::make_unique<AlltoAllForward>());
}

}  // namespace moed
