// The reference: a plain, single-process implementation of docs/design.md §3-§4 on the *global*
// input (every rank's tokens at once). It returns what each rank must receive from dispatch and
// what combine (and both backward passes) must return. Written for clarity, not speed, and it
// shares no code with the fast paths it checks (it has its own dropping, padding, layout and
// summation loops). Every dispatcher test compares against it bit for bit.
//
// Summation order (design.md §4.1), used by combine and the dispatch backward:
//   term_e  = fp32: 0 + sum over p = 0..P-1 (ascending) of float(y_{e,p}[row])
//   acc     = fp32: 0 + sum over experts e ascending of (weighted ? prob_e * term_e : term_e)
//   out[t]  = acc rounded once to the output dtype
// each + and * a single fp32 operation (no fused multiply-add; moed builds with
// -ffp-contract=off). The weighted combine backward's grad_prob(s,t,e) = dot(grad_out_s[t],
// term_e) with term_e as above and the dot accumulated in fp32 over h ascending.
//
// Readings the reference settles (where the shared semantics leave a choice):
// - The effective map routes 0/1 and has prob 0 on every unrouted cell (a raw map's probs on
//   unrouted cells are ignored); its num_topk is the raw map's.
// - K for the capacity formula: `num_topk` if > 0, else the (equal) nonzero num_topk the maps
//   carry; with a capacity_factor it must end up > 0. Without one, K is not used.
// - Router padding runs after dropping and picks the lowest unrouted tokens, so a token just
//   dropped from e can be routed to e again, with prob 0. pad_to_capacity with router padding
//   is an error (a chunk could then exceed C_s).
// - Router-padded (t, e) are routed like any other: their rows carry x_s[t] with prob 0, they
//   take part in combine (adding prob 0 * term, or term when unweighted) and get grad_probs.
// - Expert outputs and gradients are f32 or bf16, the same dtype on every rank, with H columns
//   (H of the hidden states). grad_pprobs may be empty, and an empty entry reads as zeros for
//   that rank. expert_output is not read by the unweighted combine backward.
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
