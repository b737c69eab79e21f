// Validation of the global problem, the effective routing of every source rank (capacity
// dropping, then router padding) and the canonical layout of every expert-parallel group:
// design.md §3, written out as plain loops.
#include "reference/reference_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/row_checks.h"

namespace moed::reference_internal {
namespace {

Status check_options(const LayoutOptions& o) {
  if (o.capacity_factor.has_value()) {
    const double cf = *o.capacity_factor;
    if (!(cf > 0.0) || !std::isfinite(cf)) {
      return invalid_argument("capacity_factor = ", cf, " must be finite and > 0");
    }
  }
  if (o.expert_alignment < 1) {
    return invalid_argument("expert_alignment = ", o.expert_alignment, " must be >= 1");
  }
  if (o.router_padding_multiple < 0) {
    return invalid_argument("router_padding_multiple = ", o.router_padding_multiple,
                            " must be >= 0");
  }
  if (o.pad_to_capacity && !o.capacity_factor.has_value()) {
    return invalid_argument("pad_to_capacity needs a capacity_factor");
  }
  // NOTE: router padding may push a chunk above its capacity, so a fixed C_s rows per chunk
  // would not hold; the two are exclusive (LayoutOptions::validate says the same).
  if (o.pad_to_capacity && o.router_padding_multiple > 0) {
    return invalid_argument("pad_to_capacity cannot be combined with router_padding_multiple = ",
                            o.router_padding_multiple);
  }
  return ok_status();
}

Status check_routing(const RoutingMap& m, int s, int num_experts) {
  if (m.num_tokens < 0) {
    return invalid_argument("routing[", s, "].num_tokens = ", m.num_tokens, " is negative");
  }
  if (m.num_tokens > std::numeric_limits<int32_t>::max()) {
    return invalid_argument("routing[", s, "].num_tokens = ", m.num_tokens,
                            " does not fit row_src_token (int32)");
  }
  if (m.num_experts != num_experts) {
    return invalid_argument("routing[", s, "].num_experts = ", m.num_experts,
                            " differs from num_experts = ", num_experts);
  }
  const size_t cells = size_t(m.num_tokens) * size_t(num_experts);
  if (m.routing_map.size() != cells) {
    return invalid_argument("routing[", s, "].routing_map has ", m.routing_map.size(),
                            " entries, expected num_tokens * num_experts = ", m.num_tokens, " * ",
                            num_experts, " = ", cells);
  }
  if (m.probs.size() != cells) {
    return invalid_argument("routing[", s, "].probs has ", m.probs.size(),
                            " entries, expected num_tokens * num_experts = ", m.num_tokens, " * ",
                            num_experts, " = ", cells);
  }
  for (int64_t t = 0; t < m.num_tokens; ++t) {
    for (int e = 0; e < num_experts; ++e) {
      if (!m.routed(t, e)) continue;
      const float prob = m.prob(t, e);
      if (std::isnan(prob) || prob < 0.0f) {
        return invalid_argument("routing[", s, "].probs[", t, "][", e, "] = ", prob,
                                " is NaN or negative");
      }
    }
  }
  return ok_status();
}

Status check_hidden(const ReferenceProblem& p) {
  const TensorView& x0 = p.hidden[0].x;
  for (int s = 0; s < int(p.hidden.size()); ++s) {
    const TokenRows& h = p.hidden[size_t(s)];
    const std::string name = str_cat("hidden[", s, "]");
    MOED_RETURN_IF_ERROR(moed::internal::check_view(name.c_str(), h.x, -1, -1));
    if (h.x.rows != p.routing[size_t(s)].num_tokens) {
      return invalid_argument(name, " has ", h.x.rows, " rows but routing[", s,
                              "] has T = ", p.routing[size_t(s)].num_tokens, " tokens");
    }
    if (h.x.cols != x0.cols) {
      return invalid_argument(name, " has H = ", h.x.cols, " but hidden[0] has H = ", x0.cols);
    }
    if (h.x.dtype != x0.dtype) {
      return invalid_argument(name, " is ", dtype_name(h.x.dtype), " but hidden[0] is ",
                              dtype_name(x0.dtype));
    }
    if (h.x.dtype != DType::kFP8) continue;
    if (h.x.cols % kFp8BlockSize != 0) {
      return invalid_argument(name, " is fp8 with H = ", h.x.cols, ", not a multiple of ",
                              kFp8BlockSize);
    }
    MOED_RETURN_IF_ERROR(moed::internal::check_view((name + ".scales").c_str(), h.scales, -1, -1));
    if (h.scales.dtype != DType::kF32 || h.scales.rows != h.x.rows ||
        h.scales.cols != h.x.cols / kFp8BlockSize) {
      return invalid_argument(name, ".scales is ", dtype_name(h.scales.dtype), " [", h.scales.rows,
                              ", ", h.scales.cols, "], expected f32 [", h.x.rows, ", ",
                              h.x.cols / kFp8BlockSize, "]");
    }
  }
  return ok_status();
}

// K for the capacity formula: the problem's num_topk, else the one the maps carry.
StatusOr<int> capacity_topk(const ReferenceProblem& p) {
  int k = p.num_topk;
  for (int s = 0; s < int(p.routing.size()); ++s) {
    const int map_k = p.routing[size_t(s)].num_topk;
    if (map_k == 0) continue;  // hand-made maps and RoutingMap::empty carry no K
    if (k == 0) k = map_k;
    if (map_k != k) {
      return invalid_argument("routing[", s, "].num_topk = ", map_k,
                              " differs from num_topk = ", k);
    }
  }
  if (k <= 0) {
    return invalid_argument("capacity_factor = ", *p.layout.capacity_factor,
                            " needs num_topk > 0 (got ", k, ")");
  }
  return k;
}

// C_s = ceil(T_s * K / E * cf), evaluated in exactly this order in double.
int64_t capacity_of(int64_t num_tokens, int num_topk, int num_experts, double cf) {
  return int64_t(std::ceil(double(num_tokens) * double(num_topk) / double(num_experts) * cf));
}

// Capacity dropping then router padding on one source rank's map (design.md §3.3).
RoutingMap effective_routing_of(const RoutingMap& raw, int64_t capacity, const LayoutOptions& o) {
  const int64_t T = raw.num_tokens;
  const int E = raw.num_experts;
  RoutingMap m;
  m.num_tokens = T;
  m.num_experts = E;
  m.num_topk = raw.num_topk;
  m.routing_map.assign(size_t(T) * size_t(E), 0);
  m.probs.assign(size_t(T) * size_t(E), 0.0f);
  // Normalise: routed cells become 1 with their prob, unrouted cells 0 with prob 0.
  for (int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) {
      if (!raw.routed(t, e)) continue;
      m.routing_map[size_t(t) * E + e] = 1;
      m.probs[size_t(t) * E + e] = raw.prob(t, e);
    }
  }

  if (o.capacity_factor.has_value()) {
    for (int e = 0; e < E; ++e) {
      std::vector<int64_t> tokens;  // routed to e, t ascending
      for (int64_t t = 0; t < T; ++t) {
        if (m.routed(t, e)) tokens.push_back(t);
      }
      if (int64_t(tokens.size()) <= capacity) continue;
      if (o.drop_policy == DropPolicy::kProbs) {
        // Highest prob first; equal probs keep the lower t first.
        std::sort(tokens.begin(), tokens.end(), [&](int64_t a, int64_t b) {
          if (m.prob(a, e) != m.prob(b, e)) return m.prob(a, e) > m.prob(b, e);
          return a < b;
        });
      }
      // kPosition: tokens is already t ascending, so its head is the lowest positions.
      for (size_t i = size_t(capacity); i < tokens.size(); ++i) {
        m.routing_map[size_t(tokens[i]) * E + e] = 0;
        m.probs[size_t(tokens[i]) * E + e] = 0.0f;
      }
    }
  }

  if (o.router_padding_multiple > 0) {
    const int64_t multiple = o.router_padding_multiple;
    for (int e = 0; e < E; ++e) {
      int64_t count = 0;
      for (int64_t t = 0; t < T; ++t) count += m.routed(t, e) ? 1 : 0;
      // Route the lowest-index unrouted tokens, prob 0, until count % m == 0 or none is left.
      for (int64_t t = 0; t < T && count % multiple != 0; ++t) {
        if (m.routed(t, e)) continue;
        m.routing_map[size_t(t) * E + e] = 1;
        m.probs[size_t(t) * E + e] = 0.0f;
        ++count;
      }
    }
  }
  return m;
}

void push_padding_row(EpLayout& l, int e) {
  l.row_src_rank.push_back(-1);
  l.row_src_token.push_back(-1);
  l.row_expert.push_back(e);
}

// design.md §3.1 on the ranks of group `ep`: segments j ascending; in each, source ranks s
// ascending, tokens t ascending; chunk padding to C_s, then segment padding to the alignment.
EpLayout build_layout(Plan& plan, int ep, const LayoutOptions& o) {
  EpLayout l;
  const int E = plan.num_experts;
  for (int j = 0; j < plan.num_local_experts; ++j) {
    const int e = ep * plan.num_local_experts + j;
    const int64_t segment_begin = l.num_rows();
    int64_t with_source = 0;
    for (int s = 0; s < plan.world_size; ++s) {
      const RoutingMap& m = plan.effective[size_t(s)];
      int64_t chunk = 0;
      for (int64_t t = 0; t < m.num_tokens; ++t) {
        if (!m.routed(t, e)) continue;
        plan.row_of[size_t(s)][size_t(t) * E + e] = l.num_rows();
        l.row_src_rank.push_back(s);
        l.row_src_token.push_back(int32_t(t));
        l.row_expert.push_back(e);
        ++chunk;
      }
      with_source += chunk;
      if (o.pad_to_capacity) {
        MOED_CHECK(chunk <= plan.capacity[size_t(s)], "chunk (", s, ", ", e, ") has ", chunk,
                   " rows, above capacity ", plan.capacity[size_t(s)]);
        for (; chunk < plan.capacity[size_t(s)]; ++chunk) push_padding_row(l, e);
      }
    }
    while ((l.num_rows() - segment_begin) % o.expert_alignment != 0) push_padding_row(l, e);
    l.tokens_per_expert.push_back(l.num_rows() - segment_begin);
    l.tokens_per_expert_unpadded.push_back(with_source);
  }
  return l;
}

}  // namespace

StatusOr<Plan> make_plan(const ReferenceProblem& p) {
  if (p.num_experts <= 0) {
    return invalid_argument("num_experts = ", p.num_experts, " must be > 0");
  }
  if (p.ep_size <= 0) return invalid_argument("ep_size = ", p.ep_size, " must be > 0");
  if (p.etp_size <= 0) return invalid_argument("etp_size = ", p.etp_size, " must be > 0");
  if (p.num_experts % p.ep_size != 0) {
    return invalid_argument("num_experts = ", p.num_experts,
                            " is not divisible by ep_size = ", p.ep_size);
  }
  if (p.num_topk < 0) return invalid_argument("num_topk = ", p.num_topk, " is negative");
  const int R = p.world_size();
  if (int(p.routing.size()) != R) {
    return invalid_argument("routing has ", p.routing.size(),
                            " ranks but world size = ep_size * etp_size = ", p.ep_size, " * ",
                            p.etp_size, " = ", R);
  }
  if (p.hidden.size() != p.routing.size()) {
    return invalid_argument("hidden has ", p.hidden.size(), " ranks but routing has ",
                            p.routing.size());
  }
  MOED_RETURN_IF_ERROR(check_options(p.layout));
  for (int s = 0; s < R; ++s) {
    MOED_RETURN_IF_ERROR(check_routing(p.routing[size_t(s)], s, p.num_experts));
  }
  MOED_RETURN_IF_ERROR(check_hidden(p));

  Plan plan;
  plan.num_experts = p.num_experts;
  plan.ep_size = p.ep_size;
  plan.etp_size = p.etp_size;
  plan.world_size = R;
  plan.num_local_experts = p.num_experts / p.ep_size;
  plan.hidden = p.hidden[0].x.cols;
  plan.dtype = p.hidden[0].x.dtype;
  plan.capacity.assign(size_t(R), 0);
  if (p.layout.capacity_factor.has_value()) {
    MOED_ASSIGN_OR_RETURN(int k, capacity_topk(p));
    for (int s = 0; s < R; ++s) {
      plan.capacity[size_t(s)] =
          capacity_of(p.routing[size_t(s)].num_tokens, k, p.num_experts, *p.layout.capacity_factor);
    }
  }
  for (int s = 0; s < R; ++s) {
    plan.effective.push_back(
        effective_routing_of(p.routing[size_t(s)], plan.capacity[size_t(s)], p.layout));
    plan.row_of.emplace_back(size_t(plan.num_tokens(s)) * size_t(p.num_experts), -1);
  }
  for (int ep = 0; ep < p.ep_size; ++ep) plan.layouts.push_back(build_layout(plan, ep, p.layout));
  return plan;
}

Status check_float_views(const std::string& name, const std::vector<TensorView>& views,
                         const std::vector<int64_t>& expected_rows, int64_t expected_cols,
                         const std::function<std::string(int)>& what) {
  if (views.size() != expected_rows.size()) {
    return invalid_argument(name, " has ", views.size(), " ranks, expected ", expected_rows.size());
  }
  for (int r = 0; r < int(views.size()); ++r) {
    const TensorView& v = views[size_t(r)];
    const std::string vname = str_cat(name, "[", r, "]");
    MOED_RETURN_IF_ERROR(moed::internal::check_view(vname.c_str(), v, -1, -1));
    if (v.dtype != DType::kF32 && v.dtype != DType::kBF16) {
      return invalid_argument(vname, " is ", dtype_name(v.dtype), "; only f32 and bf16 allowed");
    }
    if (v.dtype != views[0].dtype) {
      return invalid_argument(vname, " is ", dtype_name(v.dtype), " but ", name, "[0] is ",
                              dtype_name(views[0].dtype));
    }
    if (v.rows != expected_rows[size_t(r)]) {
      return invalid_argument(vname, " has ", v.rows, " rows but ", what(r));
    }
    if (v.cols != expected_cols) {
      return invalid_argument(vname, " has ", v.cols, " columns, expected H = ", expected_cols);
    }
  }
  return ok_status();
}

std::vector<int64_t> layout_rows(const Plan& plan) {
  std::vector<int64_t> rows;
  for (int r = 0; r < plan.world_size; ++r) rows.push_back(plan.layout_of_rank(r).num_rows());
  return rows;
}

std::vector<int64_t> token_rows(const Plan& plan) {
  std::vector<int64_t> rows;
  for (int s = 0; s < plan.world_size; ++s) rows.push_back(plan.num_tokens(s));
  return rows;
}

}  // namespace moed::reference_internal
