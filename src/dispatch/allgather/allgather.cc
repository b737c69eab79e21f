#include "dispatch/allgather/allgather.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "dispatch/row_exchange.h"

namespace moed {

namespace {

// The AllGather handle also keeps how this rank picked its rows out of the gathered tokens,
// for the combine backward (which all-gathers grad_out and picks the same rows).
class AllGatherHandle final : public ExchangeHandle {
 public:
  PermuteLayout expert;                 // over the gathered tokens; sorted_indices are global
  std::vector<int64_t> source_offsets;  // [R + 1] first gathered token of each source
};

// all_gather_v of `rows[s]` rows of row_bytes each; a strided view is packed first.
Status gather_rows(World& w, const TensorView& mine, std::span<const int64_t> rows, void* recv) {
  Tensor packed;
  const void* send = mine.data;
  if (!mine.contiguous() && mine.rows > 0) {
    packed = Tensor::copy_of(mine);
    send = packed.data();
  }
  std::vector<size_t> bytes(rows.size());
  for (size_t s = 0; s < rows.size(); ++s) bytes[s] = size_t(rows[s]) * mine.row_bytes();
  return w.all_gather_v_bytes(send, size_t(mine.rows) * mine.row_bytes(), recv, bytes);
}

// Every source's effective routing (after dropping and router padding), sparse, in one
// all_gather_v: source s sends [entries of each token int32 x T_s][experts int32 x n_s]
// [probs f32 x n_s], where n_s = the sum of its counts (known to every rank already).
StatusOr<SparseRouting> gather_routing(World& w, const SparseRouting& mine, const GlobalCounts& c) {
  const int R = w.size(), E = mine.num_experts;
  std::vector<size_t> words(static_cast<size_t>(R));
  size_t total = 0;
  for (int s = 0; s < R; ++s) {
    int64_t n = 0;
    for (int e = 0; e < E; ++e) n += c.counts[size_t(s) * E + e];
    words[size_t(s)] = size_t(c.num_tokens[size_t(s)] + 2 * n);
    total += words[size_t(s)];
  }
  const int64_t T = mine.num_tokens(), n = mine.num_entries();
  std::vector<int32_t> send(size_t(T + 2 * n));
  for (int64_t t = 0; t < T; ++t)
    send[size_t(t)] = int32_t(mine.begin[size_t(t) + 1] - mine.begin[size_t(t)]);
  std::copy(mine.expert.begin(), mine.expert.end(), send.begin() + T);
  // NOTE: memcpy (float bits into the int32 message) only when there are entries: with none,
  // prob.data() may be null, which memcpy must not get even for 0 bytes (UBSan).
  if (n > 0) std::memcpy(send.data() + T + n, mine.prob.data(), size_t(n) * sizeof(float));
  std::vector<int32_t> recv(total);
  std::vector<size_t> bytes(words.size());
  for (size_t s = 0; s < words.size(); ++s) bytes[s] = words[s] * sizeof(int32_t);
  MOED_RETURN_IF_ERROR(
      w.all_gather_v_bytes(send.data(), send.size() * sizeof(int32_t), recv.data(), bytes));
  SparseRouting g;
  g.num_experts = E;
  g.num_topk = mine.num_topk;
  const int32_t* p = recv.data();
  for (int s = 0; s < R; ++s) {
    const int64_t Ts = c.num_tokens[size_t(s)];
    const size_t first = g.expert.size();
    for (int64_t t = 0; t < Ts; ++t) g.begin.push_back(g.begin.back() + p[t]);
    const size_t ns = size_t(g.begin.back()) - first;
    MOED_CHECK(words[size_t(s)] == size_t(Ts) + 2 * ns, "source ", s, " sent ", ns,
               " entries; its counts say ", (words[size_t(s)] - size_t(Ts)) / 2);
    g.expert.insert(g.expert.end(), p + Ts, p + Ts + ns);
    g.prob.resize(first + ns);
    if (ns > 0) std::memcpy(g.prob.data() + first, p + Ts + ns, ns * sizeof(float));
    p += words[size_t(s)];
  }
  return g;
}

class AllGatherDispatcher final : public RowExchangeDispatcher {
 public:
  AllGatherDispatcher(World& world, const DispatchConfig& config)
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
    std::shared_ptr<AllGatherHandle> handle;
    GlobalCounts counts;
    TokenRows hidden;    // the caller's tokens, valid until token_dispatch returns
    TokenRows gathered;  // in gathered_x_ / gathered_scales_
    SparseRouting gathered_routing;
    std::optional<DispatchOutput> output;  // made by token_dispatch
    Stage stage = Stage::kIdle;            // kPrepared; kExchanged: gathered and permuted
  };
  // The gathered rows permuted into this rank's canonical layout (token_dispatch's second half).
  StatusOr<DispatchOutput> permute_gathered();
  struct CombineGradRows {
    std::shared_ptr<const AllGatherHandle> handle;
    UnpermuteGrad home;          // weighted: grad_row_probs in home order
    TensorView gathered;         // every rank's grad_out (in gathered_x_)
    Stage stage = Stage::kIdle;  // kPrepared: started; kExchanged: gathered
  };

  DispatchState d_;
  CombineGradRows cg_;
  // Kept across calls (see ScratchBuffer); d_ and cg_ hold views into them.
  ScratchBuffer gathered_x_, gathered_scales_;
};

// ---- dispatch ----

Status AllGatherDispatcher::dispatch_preprocess(const DispatchInput& input,
                                               const Status& caller_error) {
  d_ = DispatchState{};
  stage_dispatch(input, caller_error);
  d_.hidden = input.hidden;
  d_.handle = std::make_shared<AllGatherHandle>();
  d_.stage = Stage::kPrepared;
  return ok_status();
}

StatusOr<Request> AllGatherDispatcher::token_dispatch(bool async) {
  if (d_.stage != Stage::kPrepared)
    return failed_precondition("token_dispatch before dispatch_preprocess");
  StatusOr<GlobalCounts> counts = agree_dispatch(*d_.handle);
  if (!counts.ok()) {
    d_ = DispatchState{};
    return counts.status();
  }
  d_.counts = std::move(*counts);
  AllGatherHandle& h = *d_.handle;
  h.source_offsets.assign(1, 0);
  for (int64_t t : d_.counts.num_tokens) h.source_offsets.push_back(h.source_offsets.back() + t);
  const std::span<const int64_t> T = d_.counts.num_tokens;
  const int64_t N = h.source_offsets.back();
  d_.gathered.x = gathered_x_.view(h.dtype, N, h.hidden);
  MOED_RETURN_IF_ERROR(gather_rows(*world_, d_.hidden.x, T, d_.gathered.x.data));
  if (h.dtype == DType::kFP8) {
    d_.gathered.scales = gathered_scales_.view(DType::kF32, N, h.hidden / kFp8BlockSize);
    MOED_RETURN_IF_ERROR(gather_rows(*world_, d_.hidden.scales, T, d_.gathered.scales.data));
  }
  MOED_ASSIGN_OR_RETURN(d_.gathered_routing, gather_routing(*world_, h.routing, d_.counts));
  d_.hidden = TokenRows{};
  // The permute runs here, not in dispatch_postprocess (row_exchange.h says why).
  MOED_ASSIGN_OR_RETURN(DispatchOutput out, permute_gathered());
  d_.output = std::move(out);
  d_.stage = Stage::kExchanged;
  return completed_request();
}

StatusOr<DispatchOutput> AllGatherDispatcher::dispatch_postprocess() {
  return take_result(d_, d_.output, "dispatch_postprocess before token_dispatch");
}

StatusOr<DispatchOutput> AllGatherDispatcher::permute_gathered() {
  AllGatherHandle& h = *d_.handle;
  const int R = world_->size();
  const int first = first_local_expert(config_, R, world_->rank());
  PermuteOptions o;
  o.expert_begin = first;
  o.expert_end = first + config_.num_local_experts(R);
  o.expert_alignment = config_.layout.expert_alignment;
  o.source_offsets = h.source_offsets;
  if (config_.layout.pad_to_capacity) o.source_capacities = d_.counts.capacity;
  MOED_ASSIGN_OR_RETURN(h.expert, make_permute_layout(d_.gathered_routing, o, world_->pool()));
  MOED_CHECK(h.expert.num_rows == h.num_rows, "gathered layout has ", h.expert.num_rows,
             " rows; the counts gave ", h.num_rows);
  TokenRows expert_input;
  std::shared_ptr<void> storage = take_expert_input(h, expert_input);
  MOED_RETURN_IF_ERROR(permute_rows_into(d_.gathered, h.expert, expert_input, world_->pool()));
  h.permuted_probs = h.expert.permuted_probs;
  h.row_src_rank.assign(size_t(h.num_rows), -1);
  h.row_src_token.assign(size_t(h.num_rows), -1);
  for (int64_t i = 0; i < h.num_rows; ++i) {
    const int32_t g = h.expert.sorted_indices[size_t(i)];
    if (g < 0) continue;
    const int s = int(std::upper_bound(h.source_offsets.begin(), h.source_offsets.end(), g) -
                      h.source_offsets.begin()) -
                  1;
    h.row_src_rank[size_t(i)] = s;
    h.row_src_token[size_t(i)] = int32_t(g - h.source_offsets[size_t(s)]);
  }
  return dispatch_output(std::move(d_.handle), expert_input, std::move(storage));
}

// ---- combine backward: all-gather grad_out; each rank picks (and weights) its own rows ----

Status AllGatherDispatcher::combine_postprocess_backward(const CombineGradInput& grad) {
  cg_ = CombineGradRows{};
  MOED_RETURN_IF_ERROR(start_combine_backward(grad));
  cg_.handle = std::static_pointer_cast<const AllGatherHandle>(combine_grad_.handle);
  cg_.stage = Stage::kPrepared;
  return ok_status();
}

StatusOr<Request> AllGatherDispatcher::token_combine_backward(bool async) {
  if (cg_.stage != Stage::kPrepared) {
    return failed_precondition("token_combine_backward before combine_postprocess_backward");
  }
  const AllGatherHandle& h = *cg_.handle;
  std::vector<int64_t> T(size_t(world_->size()));
  for (size_t s = 0; s < T.size(); ++s) T[s] = h.source_offsets[s + 1] - h.source_offsets[s];
  cg_.gathered = gathered_x_.view(combine_grad_.grad_out.dtype, h.source_offsets.back(), h.hidden);
  MOED_RETURN_IF_ERROR(gather_rows(*world_, combine_grad_.grad_out, T, cg_.gathered.data));
  // NOTE: grad_probs = dot(grad_out, term_e) needs the fp32 terms (the P partials summed), so
  // when weighted the expert outputs also go home, as in the combine; the home-order rows it
  // computes besides are not used here (the expert ranks build theirs from the gather).
  if (config_.weighted_combine) {
    MOED_ASSIGN_OR_RETURN(cg_.home, home_combine_backward());
    cg_.home.grad_rows = Tensor();
  }
  cg_.stage = Stage::kExchanged;
  return completed_request();
}

StatusOr<CombineGrad> AllGatherDispatcher::combine_preprocess_backward() {
  if (cg_.stage != Stage::kExchanged) {
    return failed_precondition("combine_preprocess_backward before token_combine_backward");
  }
  const AllGatherHandle& h = *cg_.handle;
  const bool weighted = config_.weighted_combine;
  CombineGrad out;
  MOED_ASSIGN_OR_RETURN(
      UnpermuteGrad rows,
      unpermute_backward(
          cg_.gathered, h.expert.sorted_indices,
          weighted ? std::span<const float>(h.expert.permuted_probs) : std::span<const float>(),
          weighted ? combine_grad_.expert_output : TensorView(), world_->pool()));
  out.grad_expert_output = std::move(rows.grad_rows);
  MOED_RETURN_IF_ERROR(finish_combine_backward(cg_.home.grad_row_probs, out));
  cg_ = CombineGradRows{};
  return out;
}

}  // namespace

StatusOr<std::unique_ptr<TokenDispatcher>> make_allgather_dispatcher(World& world,
                                                                     const DispatchConfig& config) {
  return make_row_exchange_dispatcher<AllGatherDispatcher>(world, config,
                                                           DispatcherKind::kAllGather);
}

}  // namespace moed
