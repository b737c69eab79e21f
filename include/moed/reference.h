// The reference: a plain, single-process implementation of docs/design.md §3-§4 on the *global*
// input (every rank's tokens at once). It returns what each rank must receive from dispatch and
// what combine (and both backward passes) must return, in the summation order of design.md §4.1.
// Written for clarity, not speed, it shares no code with the fast paths it checks; every
// dispatcher test compares against it bit for bit. Where the shared semantics leave a choice, it
// settles it (design.md §3.3, §4.5).
//
//   moed::ReferenceProblem p{.num_experts = 8, .ep_size = 2, ...};
//   p.routing = {map_rank0, map_rank1}; p.num_topk = 2; p.hidden = {x0, x1};
//   MOED_ASSIGN_OR_RETURN(std::vector<moed::ReferenceRankDispatch> d, moed::reference_dispatch(p));
#pragma once

#include <cstdint>
#include <vector>

#include "moed/routing.h"
#include "moed/status.h"
#include "moed/tensor.h"

namespace moed {

struct ReferenceProblem {
  int num_experts = 0;
  int ep_size = 1;
  int etp_size = 1;  // world size R = ep_size * etp_size
  LayoutOptions layout;
  bool weighted_combine = false;
  int num_topk = 0;                 // K of the routing (for the capacity formula)
  std::vector<RoutingMap> routing;  // per source rank, raw (before dropping / padding)
  std::vector<TokenRows> hidden;    // per source rank [T_s, H]; all the same H and dtype

  int world_size() const { return ep_size * etp_size; }
};

// What rank r must receive (design.md §3.1).
struct ReferenceRankDispatch {
  TokenTensor expert_input;                         // [num_rows, H], payload dtype (+ scales)
  std::vector<float> permuted_probs;                // [num_rows]
  std::vector<int64_t> tokens_per_expert;           // [L], padded
  std::vector<int64_t> tokens_per_expert_unpadded;  // [L]
  std::vector<int32_t> row_src_rank;                // -1 on padding rows
  std::vector<int32_t> row_src_token;               // -1 on padding rows
};

// The effective routing of each source rank after capacity dropping and router padding.
StatusOr<std::vector<RoutingMap>> reference_effective_routing(const ReferenceProblem& p);

StatusOr<std::vector<ReferenceRankDispatch>> reference_dispatch(const ReferenceProblem& p);

// expert_output[r]: rank r's expert outputs in its dispatch layout (f32 or bf16).
// Returns out[s] [T_s, H] in that dtype.
StatusOr<std::vector<Tensor>> reference_combine(const ReferenceProblem& p,
                                                const std::vector<TensorView>& expert_output);

struct ReferenceDispatchGrad {
  std::vector<Tensor> grad_hidden;             // per source rank [T_s, H]
  std::vector<std::vector<float>> grad_probs;  // per source rank [T_s, E]
};
// grad_rows[r] [num_rows_r, H]; grad_pprobs[r] [num_rows_r] (may be empty).
StatusOr<ReferenceDispatchGrad> reference_dispatch_backward(
    const ReferenceProblem& p, const std::vector<TensorView>& grad_rows,
    const std::vector<std::vector<float>>& grad_pprobs);

struct ReferenceCombineGrad {
  std::vector<Tensor> grad_expert_output;      // per rank [num_rows_r, H]
  std::vector<std::vector<float>> grad_probs;  // per source rank [T_s, E]
};
// grad_out[s] [T_s, H]; expert_output[r] needed when weighted_combine.
StatusOr<ReferenceCombineGrad> reference_combine_backward(
    const ReferenceProblem& p, const std::vector<TensorView>& grad_out,
    const std::vector<TensorView>& expert_output);

}  // namespace moed
