// The MoE router: Megatron-Core's TopKRouter on the CPU, forward and backward, every float32
// operation fixed (docs/design.md §1.6 gives the score functions, ties and orders). From router
// logits [T, E] (float32) it chooses K experts per token and their probs, applies the layout
// options that belong to routing (capacity dropping, router padding), and computes the
// load-balancing losses with their gradients. The output comes in both routing forms.
//
//   moed::RouterConfig config;
//   config.num_experts = 64;
//   config.num_topk = 4;
//   config.load_balancing = moed::LoadBalancing::kAuxLoss;
//   config.aux_loss_coeff = 1e-2;
//   MOED_ASSIGN_OR_RETURN(moed::Router router, moed::Router::create(config));
//   MOED_ASSIGN_OR_RETURN(moed::RouterOutput out, router.forward(logits, num_tokens));
//   MOED_ASSIGN_OR_RETURN(auto grad_logits, router.backward(logits, out, grad_probs));
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "moed/routing.h"
#include "moed/status.h"

namespace moed {

enum class ScoreFunction : uint8_t { kSoftmax = 0, kSigmoid = 1, kSqrtSoftplus = 2 };
const char* score_function_name(ScoreFunction f);
StatusOr<ScoreFunction> parse_score_function(
    std::string_view name);  // softmax|sigmoid|sqrtsoftplus

// Megatron's moe_router_load_balancing_type (sinkhorn is not provided).
enum class LoadBalancing : uint8_t { kNone = 0, kAuxLoss = 1, kSeqAuxLoss = 2 };
const char* load_balancing_name(LoadBalancing l);
StatusOr<LoadBalancing> parse_load_balancing(std::string_view name);  // none|aux_loss|seq_aux_loss

struct RouterConfig {
  int num_experts = 0;
  int num_topk = 0;
  ScoreFunction score_function = ScoreFunction::kSoftmax;
  bool pre_softmax = false;  // softmax only
  // Group-limited routing (DeepSeek's node-limited routing); both 0 = off.
  int num_groups = 0;
  int group_topk = 0;
  std::optional<float> topk_scaling_factor;
  // Aux-loss-free load balancing: a per-expert bias for selection, updated by
  // update_expert_bias() with this rate.
  bool enable_expert_bias = false;
  float expert_bias_update_rate = 1e-3f;
  LoadBalancing load_balancing = LoadBalancing::kNone;
  double aux_loss_coeff = 0.0;
  // kSeqAuxLoss: tokens are Megatron's [seq_length, batch] order, t = s * batch + b, with
  // batch = T / seq_length.
  int64_t seq_length = 0;
  double z_loss_coeff = 0.0;  // 0 = off
  // Capacity dropping (capacity_factor, drop_policy) and router padding are applied by the
  // router (apply_layout_options). pad_to_capacity and expert_alignment only shape the
  // dispatch layout: give the same options to the dispatcher, whose dropping is then a no-op.
  LayoutOptions layout;

  Status validate() const;
};

struct RouterOutput {
  // The router's choice before dropping and padding: K experts per token, best first, with
  // their probs (after scaling).
  TopkRouting selected;
  // kept[t * K + k] = 1 where selected slot (t, k) survived capacity dropping.
  std::vector<uint8_t> kept;
  // The effective routing (after dropping and router padding), map form; num_topk = K.
  RoutingMap routing;
  // The same, sparse (moed/routing.h): what the MoE layer dispatches, with layout_applied.
  SparseRouting sparse;
  // The same in top-k form: K' = max(K, widest token) slots, ascending expert id, -1 unused.
  TopkRouting topk;
  // Tokens per expert of the effective routing (Megatron's local_tokens_per_expert), the
  // input of update_expert_bias once summed over ranks / micro-batches.
  std::vector<int64_t> tokens_per_expert;
  double aux_loss = 0.0;  // switch or sequence aux loss, coefficient applied; 0 when off
  double z_loss = 0.0;    // coefficient applied; 0 when off
};

// A loss and its gradient w.r.t. the logits [T, E] (computed in double, rounded once).
struct LossAndGrad {
  double loss = 0.0;
  std::vector<float> grad_logits;
};

class Router {
 public:
  static StatusOr<Router> create(const RouterConfig& config);

  const RouterConfig& config() const { return config_; }
  // Zeros until set or updated; empty when enable_expert_bias is off.
  const std::vector<float>& expert_bias() const { return expert_bias_; }
  Status set_expert_bias(std::vector<float> bias);
  // bias_e += rate * sign(mean_e' n_e' - n_e): the aux-loss-free update. The caller sums
  // tokens_per_expert over the data-parallel group and micro-batches first.
  Status update_expert_bias(std::span<const int64_t> tokens_per_expert);

  // logits: row-major [num_tokens, num_experts], finite.
  StatusOr<RouterOutput> forward(std::span<const float> logits, int64_t num_tokens) const;

  // d(objective)/d logits, given d(objective)/d probs of out.routing ([T, E]; entries that
  // were dropped or router-padded get no gradient) plus loss_scale * the gradients of the
  // aux loss and z-loss that forward computed (Megatron's MoEAuxLossAutoScaler scale).
  StatusOr<std::vector<float>> backward(std::span<const float> logits, const RouterOutput& out,
                                        std::span<const float> grad_probs,
                                        double loss_scale = 1.0) const;
  // The same with the probs gradient given for out.topk.topk_weights [T, out.topk.num_topk].
  StatusOr<std::vector<float>> backward_topk(std::span<const float> logits, const RouterOutput& out,
                                             std::span<const float> grad_topk_weights,
                                             double loss_scale = 1.0) const;

 private:
  explicit Router(const RouterConfig& config);
  Status check_logits(std::span<const float> logits, int64_t num_tokens) const;

  RouterConfig config_;
  std::vector<float> expert_bias_;
};

// Megatron's switch_load_balancing_loss_func on the aux-loss scores of `logits`:
// coeff * E / (K * T * T) * sum_e (sum_t score[t][e]) * tokens_per_expert[e].
StatusOr<LossAndGrad> switch_aux_loss(std::span<const float> logits, int64_t num_tokens,
                                      int num_experts, int num_topk, ScoreFunction f, double coeff);
// Megatron's sequence_load_balancing_loss_func: per sequence b (tokens t = s * B + b),
// coeff * mean_b sum_e (count_b[e] / (S * K / E)) * mean_s score[s, b, e].
StatusOr<LossAndGrad> sequence_aux_loss(std::span<const float> logits, int64_t num_tokens,
                                        int num_experts, int num_topk, int64_t seq_length,
                                        ScoreFunction f, double coeff);
// Megatron's z_loss_func: coeff * mean_t logsumexp(logits[t])^2.
StatusOr<LossAndGrad> z_loss(std::span<const float> logits, int64_t num_tokens, int num_experts,
                             double coeff);
// Megatron's get_updated_expert_bias (without the all-reduce): the sign is taken exactly, on
// sum(n) - E * n_e in integers.
StatusOr<std::vector<float>> updated_expert_bias(std::span<const int64_t> tokens_per_expert,
                                                 std::span<const float> expert_bias,
                                                 float update_rate);

}  // namespace moed
