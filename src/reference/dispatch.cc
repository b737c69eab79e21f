// reference_effective_routing and reference_dispatch: what every rank must receive (design.md §3).
#include <cstring>

#include "moed/reference.h"
#include "reference/reference_plan.h"

namespace moed {

using reference_internal::EpLayout;
using reference_internal::make_plan;
using reference_internal::Plan;

StatusOr<std::vector<RoutingMap>> reference_effective_routing(const ReferenceProblem& p) {
  MOED_ASSIGN_OR_RETURN(Plan plan, make_plan(p));
  return std::move(plan.effective);
}

StatusOr<std::vector<ReferenceRankDispatch>> reference_dispatch(const ReferenceProblem& p) {
  MOED_ASSIGN_OR_RETURN(Plan plan, make_plan(p));
  const bool fp8 = plan.dtype == DType::kFP8;
  const int64_t num_blocks = fp8 ? plan.hidden / kFp8BlockSize : 0;
  std::vector<ReferenceRankDispatch> out;
  for (int r = 0; r < plan.world_size; ++r) {
    const EpLayout& l = plan.layout_of_rank(r);
    const int64_t rows = l.num_rows();
    ReferenceRankDispatch d;
    // Zeros everywhere first: padding rows stay all zero bytes (fp8 scales 0.0f, prob 0).
    d.expert_input.x = Tensor::zeros(plan.dtype, rows, plan.hidden);
    if (fp8) d.expert_input.scales = Tensor::zeros(DType::kF32, rows, num_blocks);
    d.permuted_probs.assign(size_t(rows), 0.0f);
    d.tokens_per_expert = l.tokens_per_expert;
    d.tokens_per_expert_unpadded = l.tokens_per_expert_unpadded;
    d.row_src_rank = l.row_src_rank;
    d.row_src_token = l.row_src_token;
    for (int64_t i = 0; i < rows; ++i) {
      const int s = l.row_src_rank[size_t(i)];
      if (s < 0) continue;
      const int64_t t = l.row_src_token[size_t(i)];
      d.permuted_probs[size_t(i)] = plan.effective[size_t(s)].prob(t, l.row_expert[size_t(i)]);
      // NOTE: with H = 0 the tensors own no memory; memcpy must not see their null rows.
      if (plan.hidden == 0) continue;
      const TokenRows& src = p.hidden[size_t(s)];
      std::memcpy(d.expert_input.x.view().row_ptr(i), src.x.row_ptr(t), src.x.row_bytes());
      if (fp8) {
        std::memcpy(d.expert_input.scales.view().row_ptr(i), src.scales.row_ptr(t),
                    src.scales.row_bytes());
      }
    }
    out.push_back(std::move(d));
  }
  return out;
}

}  // namespace moed
