// The router (Megatron-Core's TopKRouter): configuration, forward and backward.
#include "moed/router.h"

#include <algorithm>
#include <cmath>

#include "core/enum_names.h"
#include "routing/router_internal.h"

namespace moed {

using router_internal::TopkScratch;

namespace {
constexpr EnumName<ScoreFunction> kScoreFunctionNames[] = {
    {ScoreFunction::kSoftmax, "softmax"},
    {ScoreFunction::kSigmoid, "sigmoid"},
    {ScoreFunction::kSqrtSoftplus, "sqrtsoftplus"},
};
constexpr EnumName<LoadBalancing> kLoadBalancingNames[] = {
    {LoadBalancing::kNone, "none"},
    {LoadBalancing::kAuxLoss, "aux_loss"},
    {LoadBalancing::kSeqAuxLoss, "seq_aux_loss"},
};
}  // namespace

const char* score_function_name(ScoreFunction f) {
  return enum_name(kScoreFunctionNames, f, "unknown");
}

StatusOr<ScoreFunction> parse_score_function(std::string_view name) {
  return parse_enum(kScoreFunctionNames, name, "score function", "is not one of:");
}

const char* load_balancing_name(LoadBalancing l) {
  return enum_name(kLoadBalancingNames, l, "unknown");
}

StatusOr<LoadBalancing> parse_load_balancing(std::string_view name) {
  return parse_enum(kLoadBalancingNames, name, "load balancing", "is not one of:");
}

Status RouterConfig::validate() const {
  if (num_experts < 1) return invalid_argument("num_experts = ", num_experts, " must be >= 1");
  if (num_topk < 1 || num_topk > num_experts) {
    return invalid_argument("num_topk = ", num_topk, " is outside [1, ", num_experts, "]");
  }
  if (score_function != ScoreFunction::kSoftmax && score_function != ScoreFunction::kSigmoid &&
      score_function != ScoreFunction::kSqrtSoftplus) {
    return invalid_argument("score_function = ", int(score_function), " is not a score function");
  }
  if (pre_softmax && score_function != ScoreFunction::kSoftmax) {
    return invalid_argument("pre_softmax needs score_function = softmax, not ",
                            score_function_name(score_function));
  }
  if (num_groups != 0 || group_topk != 0) {
    if (num_groups < 1 || num_experts % num_groups != 0) {
      return invalid_argument("num_groups = ", num_groups,
                              " does not divide num_experts = ", num_experts);
    }
    if (group_topk < 1 || group_topk > num_groups) {
      return invalid_argument("group_topk = ", group_topk, " is outside [1, ", num_groups, "]");
    }
    const int group_size = num_experts / num_groups;
    if (num_topk < group_topk || num_topk / group_topk > group_size) {
      return invalid_argument("num_topk = ", num_topk, " / group_topk = ", group_topk,
                              " experts per group must be in [1, ", group_size, "]");
    }
    if (num_topk > group_topk * group_size) {
      return invalid_argument("num_topk = ", num_topk, " exceeds the ", group_topk * group_size,
                              " experts of group_topk = ", group_topk, " groups");
    }
  }
  if (topk_scaling_factor.has_value() && !std::isfinite(*topk_scaling_factor)) {
    return invalid_argument("topk_scaling_factor = ", *topk_scaling_factor, " is not finite");
  }
  if (!std::isfinite(expert_bias_update_rate) || expert_bias_update_rate < 0.0f) {
    return invalid_argument("expert_bias_update_rate = ", expert_bias_update_rate,
                            " must be finite and >= 0");
  }
  if (load_balancing != LoadBalancing::kNone && load_balancing != LoadBalancing::kAuxLoss &&
      load_balancing != LoadBalancing::kSeqAuxLoss) {
    return invalid_argument("load_balancing = ", int(load_balancing), " is not a load balancing");
  }
  if (!std::isfinite(aux_loss_coeff) || aux_loss_coeff < 0.0) {
    return invalid_argument("aux_loss_coeff = ", aux_loss_coeff, " must be finite and >= 0");
  }
  if (!std::isfinite(z_loss_coeff) || z_loss_coeff < 0.0) {
    return invalid_argument("z_loss_coeff = ", z_loss_coeff, " must be finite and >= 0");
  }
  if (load_balancing == LoadBalancing::kSeqAuxLoss && seq_length < 1) {
    return invalid_argument("seq_length = ", seq_length, " must be >= 1 with seq_aux_loss");
  }
  return layout.validate();
}

Router::Router(const RouterConfig& config) : config_(config) {
  if (config_.enable_expert_bias) expert_bias_.assign(size_t(config_.num_experts), 0.0f);
}

StatusOr<Router> Router::create(const RouterConfig& config) {
  MOED_RETURN_IF_ERROR(config.validate());
  return Router(config);
}

Status Router::set_expert_bias(std::vector<float> bias) {
  if (!config_.enable_expert_bias) {
    return failed_precondition("set_expert_bias needs enable_expert_bias");
  }
  if (bias.size() != size_t(config_.num_experts)) {
    return invalid_argument("expert_bias has ", bias.size(),
                            " entries, expected num_experts = ", config_.num_experts);
  }
  for (size_t e = 0; e < bias.size(); ++e) {
    if (!std::isfinite(bias[e])) {
      return invalid_argument("expert_bias[", e, "] = ", bias[e], " is not finite");
    }
  }
  expert_bias_ = std::move(bias);
  return ok_status();
}

Status Router::update_expert_bias(std::span<const int64_t> tokens_per_expert) {
  if (!config_.enable_expert_bias) {
    return failed_precondition("update_expert_bias needs enable_expert_bias");
  }
  MOED_ASSIGN_OR_RETURN(expert_bias_, updated_expert_bias(tokens_per_expert, expert_bias_,
                                                          config_.expert_bias_update_rate));
  return ok_status();
}

Status Router::check_logits(std::span<const float> logits, int64_t num_tokens) const {
  if (num_tokens < 0) return invalid_argument("num_tokens = ", num_tokens, " must be >= 0");
  const size_t E = size_t(config_.num_experts);
  if (logits.size() != size_t(num_tokens) * E) {
    return invalid_argument("logits has ", logits.size(), " entries, expected num_tokens * ",
                            "num_experts = ", num_tokens, " * ", E, " = ", size_t(num_tokens) * E);
  }
  for (size_t i = 0; i < logits.size(); ++i) {
    if (!std::isfinite(logits[i])) {
      return invalid_argument("logits[", i / E, "][", i % E, "] = ", logits[i], " is not finite");
    }
  }
  if (config_.load_balancing == LoadBalancing::kSeqAuxLoss &&
      num_tokens % config_.seq_length != 0) {
    return invalid_argument("num_tokens = ", num_tokens,
                            " is not a multiple of seq_length = ", config_.seq_length);
  }
  return ok_status();
}

StatusOr<RouterOutput> Router::forward(std::span<const float> logits, int64_t num_tokens) const {
  MOED_RETURN_IF_ERROR(check_logits(logits, num_tokens));
  const RouterConfig& c = config_;
  const int E = c.num_experts, K = c.num_topk;
  const bool grouped = c.num_groups > 0;

  RouterOutput out;
  out.selected.num_tokens = num_tokens;
  out.selected.num_topk = K;
  out.selected.topk_idx.resize(size_t(num_tokens) * size_t(K));
  out.selected.topk_weights.resize(size_t(num_tokens) * size_t(K));

  TopkScratch scratch;
  scratch.reserve(E, c.num_groups);
  std::vector<float> scores(static_cast<size_t>(E)), biased(static_cast<size_t>(E)),
      chosen_values(static_cast<size_t>(K));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* x = logits.data() + size_t(t) * size_t(E);
    // Selection values: the logits for plain softmax, the scores otherwise.
    const float* values = x;
    if (c.score_function == ScoreFunction::kSoftmax) {
      if (c.pre_softmax) {
        router_internal::softmax(x, E, scores.data());
        values = scores.data();
      }
    } else {
      for (int e = 0; e < E; ++e) {
        scores[size_t(e)] = c.score_function == ScoreFunction::kSigmoid
                                ? router_internal::sigmoid_score(x[e])
                                : router_internal::sqrt_softplus_score(x[e]);
      }
      values = scores.data();
    }
    const float* unbiased = values;
    if (c.enable_expert_bias) {
      for (int e = 0; e < E; ++e) biased[size_t(e)] = values[e] + expert_bias_[size_t(e)];
      values = biased.data();
    }
    int32_t* idx = out.selected.topk_idx.data() + size_t(t) * size_t(K);
    if (grouped) {
      router_internal::select_group_limited_topk(values, E, K, c.num_groups, c.group_topk, idx,
                                                 scratch);
    } else {
      router_internal::select_topk(values, E, K, idx, scratch);
    }

    float* probs = out.selected.topk_weights.data() + size_t(t) * size_t(K);
    for (int k = 0; k < K; ++k) chosen_values[size_t(k)] = unbiased[idx[k]];
    if (c.score_function == ScoreFunction::kSoftmax) {
      if (c.pre_softmax) {
        std::copy(chosen_values.begin(), chosen_values.end(), probs);
      } else {
        router_internal::softmax(chosen_values.data(), K, probs);
      }
    } else if (K > 1) {
      float sum = 0.0f;
      for (int k = 0; k < K; ++k) sum += chosen_values[size_t(k)];
      for (int k = 0; k < K; ++k) probs[k] = chosen_values[size_t(k)] / (sum + 1e-20f);
    } else {
      probs[0] = chosen_values[0];
    }
    if (c.topk_scaling_factor.has_value()) {
      for (int k = 0; k < K; ++k) probs[k] = probs[k] * *c.topk_scaling_factor;
    }
  }

  // Capacity dropping, then router padding, each through apply_layout_options on the sparse
  // form; dropping runs on its own first so the slots it removed are known (they, and padded
  // entries, carry no gradient back to the logits).
  SparseRouting dropped = to_sparse(TopkView::of(out.selected), E);
  if (c.layout.capacity_factor.has_value()) {
    LayoutOptions drop;
    drop.capacity_factor = c.layout.capacity_factor;
    drop.drop_policy = c.layout.drop_policy;
    MOED_ASSIGN_OR_RETURN(dropped, apply_layout_options(dropped, drop));
  }
  out.kept.resize(out.selected.topk_idx.size());
  for (int64_t t = 0; t < num_tokens; ++t) {
    const auto first = dropped.expert.begin() + dropped.begin[size_t(t)];
    const auto last = dropped.expert.begin() + dropped.begin[size_t(t) + 1];
    for (int k = 0; k < K; ++k) {
      out.kept[size_t(t) * size_t(K) + size_t(k)] =
          std::binary_search(first, last, out.selected.idx(t, k));
    }
  }
  if (c.layout.router_padding_multiple > 0) {
    LayoutOptions pad;
    pad.router_padding_multiple = c.layout.router_padding_multiple;
    MOED_ASSIGN_OR_RETURN(out.sparse, apply_layout_options(dropped, pad));
  } else {
    out.sparse = std::move(dropped);
  }
  out.routing = to_map(out.sparse);

  StatusOr<TopkRouting> topk = to_topk(out.sparse, K);
  if (!topk.ok()) topk = to_topk(out.sparse);  // padding made some token wider than K
  MOED_RETURN_IF_ERROR(topk.status());
  out.topk = std::move(topk).value();
  out.tokens_per_expert = out.sparse.tokens_per_expert();

  if (c.load_balancing == LoadBalancing::kAuxLoss) {
    out.aux_loss = router_internal::switch_aux_loss_impl(
        logits.data(), num_tokens, E, K, c.score_function, c.aux_loss_coeff, 0.0, nullptr);
  } else if (c.load_balancing == LoadBalancing::kSeqAuxLoss) {
    out.aux_loss =
        router_internal::sequence_aux_loss_impl(logits.data(), num_tokens, E, K, c.seq_length,
                                                c.score_function, c.aux_loss_coeff, 0.0, nullptr);
  }
  if (c.z_loss_coeff > 0.0) {
    out.z_loss =
        router_internal::z_loss_impl(logits.data(), num_tokens, E, c.z_loss_coeff, 0.0, nullptr);
  }
  return out;
}

StatusOr<std::vector<float>> Router::backward(std::span<const float> logits,
                                              const RouterOutput& out,
                                              std::span<const float> grad_probs,
                                              double loss_scale) const {
  const RouterConfig& c = config_;
  const int E = c.num_experts, K = c.num_topk;
  const int64_t num_tokens = out.selected.num_tokens;
  MOED_RETURN_IF_ERROR(check_logits(logits, num_tokens));
  const size_t slots = size_t(num_tokens) * size_t(K);
  if (out.selected.num_topk != K || out.selected.topk_idx.size() != slots ||
      out.kept.size() != slots) {
    return invalid_argument("router output has num_topk = ", out.selected.num_topk, " and ",
                            out.selected.topk_idx.size(), " slots, expected num_topk = ", K,
                            " and ", slots);
  }
  if (grad_probs.size() != logits.size()) {
    return invalid_argument("grad_probs has ", grad_probs.size(), " entries, expected ", num_tokens,
                            " * ", E, " = ", logits.size());
  }
  if (!std::isfinite(loss_scale)) {
    return invalid_argument("loss_scale = ", loss_scale, " is not finite");
  }

  std::vector<double> grad(logits.size(), 0.0);
  const double scaling = c.topk_scaling_factor.has_value() ? *c.topk_scaling_factor : 1.0;
  std::vector<double> g(static_cast<size_t>(std::max(E, 1))),
      tmp(static_cast<size_t>(std::max(E, 1))), gx(static_cast<size_t>(std::max(E, 1)));
  std::vector<float> chosen_logits(static_cast<size_t>(K));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* x = logits.data() + size_t(t) * size_t(E);
    double* grad_row = grad.data() + size_t(t) * size_t(E);
    const int32_t* idx = out.selected.topk_idx.data() + size_t(t) * size_t(K);
    const uint8_t* kept = out.kept.data() + size_t(t) * size_t(K);
    for (int k = 0; k < K; ++k) {
      MOED_CHECK(idx[k] >= 0 && idx[k] < E, "selected expert ", idx[k]);
      g[size_t(k)] =
          kept[k] ? scaling * double(grad_probs[size_t(t) * size_t(E) + size_t(idx[k])]) : 0.0;
    }
    if (c.score_function == ScoreFunction::kSoftmax && c.pre_softmax) {
      // probs = softmax over all E, read at the chosen experts.
      std::fill(gx.begin(), gx.begin() + E, 0.0);
      for (int k = 0; k < K; ++k) gx[size_t(idx[k])] = g[size_t(k)];
      router_internal::score_backward(ScoreFunction::kSoftmax, false, x, E, gx.data(), 1.0,
                                      grad_row, tmp.data());
      continue;
    }
    // probs are a function of the chosen experts' logits only.
    for (int k = 0; k < K; ++k) chosen_logits[size_t(k)] = x[idx[k]];
    std::fill(gx.begin(), gx.begin() + K, 0.0);
    router_internal::score_backward(c.score_function, K > 1, chosen_logits.data(), K, g.data(), 1.0,
                                    gx.data(), tmp.data());
    for (int k = 0; k < K; ++k) grad_row[idx[k]] += gx[size_t(k)];
  }

  if (c.load_balancing == LoadBalancing::kAuxLoss) {
    router_internal::switch_aux_loss_impl(logits.data(), num_tokens, E, K, c.score_function,
                                          c.aux_loss_coeff, loss_scale, grad.data());
  } else if (c.load_balancing == LoadBalancing::kSeqAuxLoss) {
    router_internal::sequence_aux_loss_impl(logits.data(), num_tokens, E, K, c.seq_length,
                                            c.score_function, c.aux_loss_coeff, loss_scale,
                                            grad.data());
  }
  if (c.z_loss_coeff > 0.0) {
    router_internal::z_loss_impl(logits.data(), num_tokens, E, c.z_loss_coeff, loss_scale,
                                 grad.data());
  }
  std::vector<float> result(grad.size());
  for (size_t i = 0; i < grad.size(); ++i) result[i] = float(grad[i]);
  return result;
}

StatusOr<std::vector<float>> Router::backward_topk(std::span<const float> logits,
                                                   const RouterOutput& out,
                                                   std::span<const float> grad_topk_weights,
                                                   double loss_scale) const {
  const TopkRouting& topk = out.topk;
  const size_t expected = size_t(topk.num_tokens) * size_t(std::max(topk.num_topk, 0));
  if (grad_topk_weights.size() != expected || topk.topk_idx.size() != expected) {
    return invalid_argument("grad_topk_weights has ", grad_topk_weights.size(),
                            " entries, expected num_tokens * num_topk = ", topk.num_tokens, " * ",
                            topk.num_topk, " = ", expected);
  }
  const int E = config_.num_experts;
  MOED_RETURN_IF_ERROR(validate(TopkView{topk.topk_idx.data(), false, nullptr, topk.num_tokens,
                                         topk.num_topk},
                                E));
  std::vector<float> grad_probs(size_t(topk.num_tokens) * size_t(E), 0.0f);
  for (int64_t t = 0; t < topk.num_tokens; ++t) {
    for (int k = 0; k < topk.num_topk; ++k) {
      const int32_t e = topk.idx(t, k);
      if (e < 0) continue;
      grad_probs[size_t(t) * size_t(E) + size_t(e)] =
          grad_topk_weights[size_t(t) * size_t(topk.num_topk) + size_t(k)];
    }
  }
  return backward(logits, out, grad_probs, loss_scale);
}

}  // namespace moed
