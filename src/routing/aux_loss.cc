// Router losses (Megatron's moe_utils): switch and sequence load-balancing aux losses, z-loss,
// and the aux-loss-free expert bias update.
#include <algorithm>
#include <cmath>

#include "routing/router_internal.h"

namespace moed {

namespace router_internal {

namespace {

// Megatron's compute_routing_scores_for_aux_loss: scores [T, E] in float32 (softmax over E, or
// sigmoid / sqrt-softplus normalised over E when K > 1) and their plain top-k map.
void aux_scores(const float* logits, int64_t num_tokens, int num_experts, int num_topk,
                ScoreFunction f, std::vector<float>& scores, std::vector<uint8_t>& map) {
  const size_t E = size_t(num_experts);
  scores.resize(size_t(num_tokens) * E);
  map.assign(size_t(num_tokens) * E, 0);
  TopkScratch scratch;
  scratch.reserve(num_experts, 0);
  std::vector<int32_t> chosen(static_cast<size_t>(num_topk));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* x = logits + size_t(t) * E;
    float* s = scores.data() + size_t(t) * E;
    if (f == ScoreFunction::kSoftmax) {
      softmax(x, num_experts, s);
    } else {
      float sum = 0.0f;
      for (size_t e = 0; e < E; ++e) {
        s[e] = f == ScoreFunction::kSigmoid ? sigmoid_score(x[e]) : sqrt_softplus_score(x[e]);
        sum += s[e];
      }
      if (num_topk > 1) {
        for (size_t e = 0; e < E; ++e) s[e] = s[e] / (sum + 1e-20f);
      }
    }
    select_topk(s, num_experts, num_topk, chosen.data(), scratch);
    for (int k = 0; k < num_topk; ++k) map[size_t(t) * E + size_t(chosen[size_t(k)])] = 1;
  }
}

// Adds scale * d/dlogits of sum_{t,e} grad_scores[t][e] * scores[t][e] into grad.
void backward_through_aux_scores(const float* logits, int64_t num_tokens, int num_experts,
                                 int num_topk, ScoreFunction f, const std::vector<double>& g,
                                 double scale, double* grad) {
  const size_t E = size_t(num_experts);
  std::vector<double> tmp(E);
  const bool normalize = f != ScoreFunction::kSoftmax && num_topk > 1;
  for (int64_t t = 0; t < num_tokens; ++t) {
    score_backward(f, normalize, logits + size_t(t) * E, num_experts, g.data() + size_t(t) * E,
                   scale, grad + size_t(t) * E, tmp.data());
  }
}

}  // namespace

double switch_aux_loss_impl(const float* logits, int64_t num_tokens, int num_experts, int num_topk,
                            ScoreFunction f, double coeff, double scale, double* grad) {
  if (num_tokens == 0) return 0.0;
  const size_t E = size_t(num_experts);
  std::vector<float> scores;
  std::vector<uint8_t> map;
  aux_scores(logits, num_tokens, num_experts, num_topk, f, scores, map);
  std::vector<double> tokens_per_expert(E, 0.0), probs_per_expert(E, 0.0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (size_t e = 0; e < E; ++e) {
      tokens_per_expert[e] += map[size_t(t) * E + e];
      probs_per_expert[e] += scores[size_t(t) * E + e];
    }
  }
  const double T = double(num_tokens);
  const double c = double(num_experts) * coeff / (double(num_topk) * T * T);
  double loss = 0.0;
  for (size_t e = 0; e < E; ++e) loss += probs_per_expert[e] * tokens_per_expert[e];
  loss *= c;
  if (grad != nullptr) {
    std::vector<double> g(size_t(num_tokens) * E);
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (size_t e = 0; e < E; ++e) g[size_t(t) * E + e] = tokens_per_expert[e] * c;
    }
    backward_through_aux_scores(logits, num_tokens, num_experts, num_topk, f, g, scale, grad);
  }
  return loss;
}

double sequence_aux_loss_impl(const float* logits, int64_t num_tokens, int num_experts,
                              int num_topk, int64_t seq_length, ScoreFunction f, double coeff,
                              double scale, double* grad) {
  if (num_tokens == 0) return 0.0;
  const size_t E = size_t(num_experts);
  const int64_t batch = num_tokens / seq_length;
  std::vector<float> scores;
  std::vector<uint8_t> map;
  aux_scores(logits, num_tokens, num_experts, num_topk, f, scores, map);
  // Token t = s * batch + b belongs to sequence b (Megatron's [s, b] layout).
  std::vector<double> cost(size_t(batch) * E, 0.0), mean_score(size_t(batch) * E, 0.0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const size_t b = size_t(t % batch);
    for (size_t e = 0; e < E; ++e) {
      cost[b * E + e] += map[size_t(t) * E + e];
      mean_score[b * E + e] += scores[size_t(t) * E + e];
    }
  }
  const double S = double(seq_length);
  const double expected = S * double(num_topk) / double(num_experts);
  double loss = 0.0;
  for (size_t i = 0; i < cost.size(); ++i) {
    cost[i] /= expected;
    loss += cost[i] * (mean_score[i] / S);
  }
  loss = loss / double(batch) * coeff;
  if (grad != nullptr) {
    std::vector<double> g(size_t(num_tokens) * E);
    const double c = coeff / (double(batch) * S);
    for (int64_t t = 0; t < num_tokens; ++t) {
      const size_t b = size_t(t % batch);
      for (size_t e = 0; e < E; ++e) g[size_t(t) * E + e] = cost[b * E + e] * c;
    }
    backward_through_aux_scores(logits, num_tokens, num_experts, num_topk, f, g, scale, grad);
  }
  return loss;
}

double z_loss_impl(const float* logits, int64_t num_tokens, int num_experts, double coeff,
                   double scale, double* grad) {
  if (num_tokens == 0) return 0.0;
  const size_t E = size_t(num_experts);
  const double T = double(num_tokens);
  double loss = 0.0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* x = logits + size_t(t) * E;
    double max_value = x[0];
    for (size_t e = 1; e < E; ++e) max_value = std::max(max_value, double(x[e]));
    double sum = 0.0;
    for (size_t e = 0; e < E; ++e) sum += std::exp(double(x[e]) - max_value);
    const double lse = max_value + std::log(sum);
    loss += lse * lse;
    if (grad != nullptr) {
      // d(lse^2)/dx_e = 2 * lse * softmax(x)_e
      for (size_t e = 0; e < E; ++e) {
        const double p = std::exp(double(x[e]) - max_value) / sum;
        grad[size_t(t) * E + e] += scale * coeff * 2.0 * lse * p / T;
      }
    }
  }
  return loss / T * coeff;
}

}  // namespace router_internal

namespace {

Status check_loss_input(std::span<const float> logits, int64_t num_tokens, int num_experts,
                        std::optional<int> num_topk, double coeff) {
  if (num_experts < 1) return invalid_argument("num_experts = ", num_experts, " must be >= 1");
  if (num_tokens < 0) return invalid_argument("num_tokens = ", num_tokens, " must be >= 0");
  if (num_topk.has_value() && (*num_topk < 1 || *num_topk > num_experts)) {
    return invalid_argument("num_topk = ", *num_topk, " is outside [1, ", num_experts, "]");
  }
  if (!std::isfinite(coeff))
    return invalid_argument("loss coefficient = ", coeff, " is not finite");
  const size_t expected = size_t(num_tokens) * size_t(num_experts);
  if (logits.size() != expected) {
    return invalid_argument("logits has ", logits.size(), " entries, expected ", num_tokens, " * ",
                            num_experts, " = ", expected);
  }
  for (size_t i = 0; i < logits.size(); ++i) {
    if (!std::isfinite(logits[i])) {
      return invalid_argument("logits[", i / size_t(num_experts), "][", i % size_t(num_experts),
                              "] = ", logits[i], " is not finite");
    }
  }
  return ok_status();
}

LossAndGrad round_grad(double loss, const std::vector<double>& grad) {
  LossAndGrad out;
  out.loss = loss;
  out.grad_logits.resize(grad.size());
  for (size_t i = 0; i < grad.size(); ++i) out.grad_logits[i] = float(grad[i]);
  return out;
}

}  // namespace

StatusOr<LossAndGrad> switch_aux_loss(std::span<const float> logits, int64_t num_tokens,
                                      int num_experts, int num_topk, ScoreFunction f,
                                      double coeff) {
  MOED_RETURN_IF_ERROR(check_loss_input(logits, num_tokens, num_experts, num_topk, coeff));
  std::vector<double> grad(logits.size(), 0.0);
  const double loss = router_internal::switch_aux_loss_impl(logits.data(), num_tokens, num_experts,
                                                            num_topk, f, coeff, 1.0, grad.data());
  return round_grad(loss, grad);
}

StatusOr<LossAndGrad> sequence_aux_loss(std::span<const float> logits, int64_t num_tokens,
                                        int num_experts, int num_topk, int64_t seq_length,
                                        ScoreFunction f, double coeff) {
  MOED_RETURN_IF_ERROR(check_loss_input(logits, num_tokens, num_experts, num_topk, coeff));
  if (seq_length < 1) return invalid_argument("seq_length = ", seq_length, " must be >= 1");
  if (num_tokens % seq_length != 0) {
    return invalid_argument("num_tokens = ", num_tokens,
                            " is not a multiple of seq_length = ", seq_length);
  }
  std::vector<double> grad(logits.size(), 0.0);
  const double loss = router_internal::sequence_aux_loss_impl(
      logits.data(), num_tokens, num_experts, num_topk, seq_length, f, coeff, 1.0, grad.data());
  return round_grad(loss, grad);
}

StatusOr<LossAndGrad> z_loss(std::span<const float> logits, int64_t num_tokens, int num_experts,
                             double coeff) {
  MOED_RETURN_IF_ERROR(check_loss_input(logits, num_tokens, num_experts, std::nullopt, coeff));
  std::vector<double> grad(logits.size(), 0.0);
  const double loss =
      router_internal::z_loss_impl(logits.data(), num_tokens, num_experts, coeff, 1.0, grad.data());
  return round_grad(loss, grad);
}

StatusOr<std::vector<float>> updated_expert_bias(std::span<const int64_t> tokens_per_expert,
                                                 std::span<const float> expert_bias,
                                                 float update_rate) {
  if (tokens_per_expert.size() != expert_bias.size()) {
    return invalid_argument("tokens_per_expert has ", tokens_per_expert.size(),
                            " entries but expert_bias has ", expert_bias.size());
  }
  if (!std::isfinite(update_rate)) {
    return invalid_argument("expert_bias_update_rate = ", update_rate, " is not finite");
  }
  int64_t total = 0;
  for (size_t e = 0; e < tokens_per_expert.size(); ++e) {
    if (tokens_per_expert[e] < 0) {
      return invalid_argument("tokens_per_expert[", e, "] = ", tokens_per_expert[e],
                              " is negative");
    }
    total += tokens_per_expert[e];
  }
  const int64_t num_experts = int64_t(tokens_per_expert.size());
  std::vector<float> out(expert_bias.begin(), expert_bias.end());
  for (size_t e = 0; e < out.size(); ++e) {
    // sign(mean - n_e) = sign(total - E * n_e), exact in integers.
    const int64_t offset = total - num_experts * tokens_per_expert[e];
    const float sign = offset > 0 ? 1.0f : (offset < 0 ? -1.0f : 0.0f);
    out[e] = out[e] + sign * update_rate;
  }
  return out;
}

}  // namespace moed
