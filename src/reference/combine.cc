// reference_combine and both backward passes (design.md §4.1, §4.3), in the fixed summation order:
//   term_e = fp32 0 + sum over p ascending of float(y on rank (ep(e), p) at row(s, t, e))
//   acc    = fp32 0 + sum over effective-routed e ascending of (weighted ? prob * term_e : term_e)
// rounded once to the output dtype.
#include "moed/reference.h"
#include "reference/reference_plan.h"

namespace moed {

using reference_internal::check_float_views;
using reference_internal::EpLayout;
using reference_internal::layout_rows;
using reference_internal::load_float;
using reference_internal::make_plan;
using reference_internal::Plan;
using reference_internal::store_float;
using reference_internal::token_rows;

namespace {

// Message tails for check_float_views: "... has N rows but <what>".
std::function<std::string(int)> layout_what(const Plan& plan) {
  return [&plan](int r) {
    return str_cat("rank ", r, "'s dispatch layout has ", plan.layout_of_rank(r).num_rows());
  };
}
std::function<std::string(int)> tokens_what(const Plan& plan) {
  return [&plan](int s) { return str_cat("source rank ", s, " has T = ", plan.num_tokens(s)); };
}

// term_e[h] for (s, t, e): the P partial rows of expert e, p ascending, from fp32 0.
float expert_term(const Plan& plan, const std::vector<TensorView>& rows, int s, int64_t t, int e,
                  int64_t h) {
  const int64_t row = plan.row_of[size_t(s)][size_t(t) * plan.num_experts + e];
  MOED_CHECK(row >= 0, "(", s, ", ", t, ", ", e, ") has no row");
  float term = 0.0f;
  for (int p = 0; p < plan.etp_size; ++p) {
    term += load_float(rows[size_t(plan.rank_of(plan.ep_of_expert(e), p))], row, h);
  }
  return term;
}

// out[s][t] = the (weighted) combine of `rows` in the fixed order; dtype of rows.
std::vector<Tensor> combine_rows(const Plan& plan, const std::vector<TensorView>& rows,
                                 bool weighted) {
  std::vector<Tensor> out;
  for (int s = 0; s < plan.world_size; ++s) {
    const RoutingMap& m = plan.effective[size_t(s)];
    Tensor o = Tensor::zeros(rows[0].dtype, m.num_tokens, plan.hidden);
    for (int64_t t = 0; t < m.num_tokens; ++t) {
      for (int64_t h = 0; h < plan.hidden; ++h) {
        float acc = 0.0f;
        for (int e = 0; e < plan.num_experts; ++e) {
          if (!m.routed(t, e)) continue;
          const float term = expert_term(plan, rows, s, t, e, h);
          if (weighted) {
            acc += m.prob(t, e) * term;
          } else {
            acc += term;
          }
        }
        store_float(o.view(), t, h, acc);
      }
    }
    out.push_back(std::move(o));
  }
  return out;
}

}  // namespace

StatusOr<std::vector<Tensor>> reference_combine(const ReferenceProblem& p,
                                                const std::vector<TensorView>& expert_output) {
  MOED_ASSIGN_OR_RETURN(Plan plan, make_plan(p));
  MOED_RETURN_IF_ERROR(check_float_views("expert_output", expert_output, layout_rows(plan),
                                         plan.hidden, layout_what(plan)));
  return combine_rows(plan, expert_output, p.weighted_combine);
}

StatusOr<ReferenceDispatchGrad> reference_dispatch_backward(
    const ReferenceProblem& p, const std::vector<TensorView>& grad_rows,
    const std::vector<std::vector<float>>& grad_pprobs) {
  MOED_ASSIGN_OR_RETURN(Plan plan, make_plan(p));
  const std::vector<int64_t> rows = layout_rows(plan);
  MOED_RETURN_IF_ERROR(
      check_float_views("grad_rows", grad_rows, rows, plan.hidden, layout_what(plan)));
  if (!grad_pprobs.empty() && grad_pprobs.size() != size_t(plan.world_size)) {
    return invalid_argument("grad_pprobs has ", grad_pprobs.size(), " ranks, expected ",
                            plan.world_size, " (or none)");
  }
  for (int r = 0; r < int(grad_pprobs.size()); ++r) {
    const size_t n = grad_pprobs[size_t(r)].size();
    if (n != 0 && n != size_t(rows[size_t(r)])) {
      return invalid_argument("grad_pprobs[", r, "] has ", n, " entries but ", layout_what(plan)(r),
                              " rows");
    }
  }

  ReferenceDispatchGrad g;
  g.grad_hidden = combine_rows(plan, grad_rows, /*weighted=*/false);
  for (int s = 0; s < plan.world_size; ++s) {
    const RoutingMap& m = plan.effective[size_t(s)];
    std::vector<float> gp(size_t(m.num_tokens) * size_t(plan.num_experts), 0.0f);
    for (int64_t t = 0; t < m.num_tokens; ++t) {
      for (int e = 0; e < plan.num_experts; ++e) {
        if (!m.routed(t, e)) continue;
        const int64_t row = plan.row_of[size_t(s)][size_t(t) * plan.num_experts + e];
        float sum = 0.0f;
        for (int pp = 0; pp < plan.etp_size; ++pp) {
          const int r = plan.rank_of(plan.ep_of_expert(e), pp);
          // NOTE: a rank without grad_pprobs contributes 0 (as if it passed zeros).
          if (grad_pprobs.empty() || grad_pprobs[size_t(r)].empty()) continue;
          sum += grad_pprobs[size_t(r)][size_t(row)];
        }
        gp[size_t(t) * plan.num_experts + e] = sum;
      }
    }
    g.grad_probs.push_back(std::move(gp));
  }
  return g;
}

StatusOr<ReferenceCombineGrad> reference_combine_backward(
    const ReferenceProblem& p, const std::vector<TensorView>& grad_out,
    const std::vector<TensorView>& expert_output) {
  MOED_ASSIGN_OR_RETURN(Plan plan, make_plan(p));
  MOED_RETURN_IF_ERROR(
      check_float_views("grad_out", grad_out, token_rows(plan), plan.hidden, tokens_what(plan)));
  const bool weighted = p.weighted_combine;
  if (weighted) {
    MOED_RETURN_IF_ERROR(check_float_views("expert_output", expert_output, layout_rows(plan),
                                           plan.hidden, layout_what(plan)));
  }
  const DType dtype = grad_out[0].dtype;

  ReferenceCombineGrad g;
  // Each row (s, t, e) on every p gets grad_out_s[t], times prob(t, e) when weighted.
  for (int r = 0; r < plan.world_size; ++r) {
    const EpLayout& l = plan.layout_of_rank(r);
    Tensor rows = Tensor::zeros(dtype, l.num_rows(), plan.hidden);
    for (int64_t i = 0; i < l.num_rows(); ++i) {
      const int s = l.row_src_rank[size_t(i)];
      if (s < 0) continue;  // padding rows stay 0
      const int64_t t = l.row_src_token[size_t(i)];
      const float prob = plan.effective[size_t(s)].prob(t, l.row_expert[size_t(i)]);
      const TensorView& src = grad_out[size_t(s)];
      for (int64_t h = 0; h < plan.hidden; ++h) {
        if (!weighted) {
          // Unweighted: the grad element itself, in grad_out's dtype (no rounding at all).
          if (dtype == DType::kF32) {
            rows.row<float>(i)[h] = src.row<const float>(t)[h];
          } else {
            rows.row<bf16>(i)[h] = src.row<const bf16>(t)[h];
          }
        } else {
          store_float(rows.view(), i, h, prob * load_float(src, t, h));
        }
      }
    }
    g.grad_expert_output.push_back(std::move(rows));
  }

  // grad_probs (weighted only): d = fp32 0; d += float(g[t][h]) * term_e[h], h ascending.
  for (int s = 0; s < plan.world_size; ++s) {
    const RoutingMap& m = plan.effective[size_t(s)];
    std::vector<float> gp(size_t(m.num_tokens) * size_t(plan.num_experts), 0.0f);
    if (weighted) {
      for (int64_t t = 0; t < m.num_tokens; ++t) {
        for (int e = 0; e < plan.num_experts; ++e) {
          if (!m.routed(t, e)) continue;
          float d = 0.0f;
          for (int64_t h = 0; h < plan.hidden; ++h) {
            d += load_float(grad_out[size_t(s)], t, h) *
                 expert_term(plan, expert_output, s, t, e, h);
          }
          gp[size_t(t) * plan.num_experts + e] = d;
        }
      }
    }
    g.grad_probs.push_back(std::move(gp));
  }
  return g;
}

}  // namespace moed
