// The MoE layer end to end (docs/design.md §1.5): router -> dispatch -> grouped expert MLP
// (Megatron's SwiGLU) -> combine, plus an optional shared expert that runs while token_dispatch
// moves the tokens, forward and backward, in f32 or bf16 (bf16 storage, fp32 accumulation).
// reference_moe_layer computes the same model in one process; tests and `moed run` compare
// against it.
//
//   moed::MoEConfig config;
//   config.hidden = 256; config.ffn_hidden = 512; config.num_experts = 8; config.num_topk = 2;
//   config.dispatcher = moed::DispatcherKind::kFlex;
//   MOED_ASSIGN_OR_RETURN(auto layer, moed::MoELayer::create(world, config));  // collective
//   MOED_ASSIGN_OR_RETURN(moed::Tensor y, layer->forward(x));                  // [T, H]
//   MOED_ASSIGN_OR_RETURN(moed::MoEGrads g, layer->backward(grad_y));
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moed/dispatcher.h"
#include "moed/router.h"
#include "moed/routing.h"
#include "moed/status.h"
#include "moed/tensor.h"
#include "moed/world.h"

namespace moed {

struct MoEConfig {
  int hidden = 0;             // H
  int ffn_hidden = 0;         // F, per expert (divisible by etp_size)
  int num_experts = 0;        // E
  int num_topk = 0;           // K
  int shared_expert_ffn = 0;  // F of the shared expert; 0 = none
  // Run the shared expert while the dispatch moves tokens (Megatron's shared-expert overlap);
  // false runs the dispatch to its end first (to measure what the overlap saves).
  bool overlap_shared_expert = true;
  int etp_size = 1;           // P; EP = world size / P
  DType dtype = DType::kF32;  // activations and weights: f32 or bf16
  DispatcherKind dispatcher = DispatcherKind::kFlex;
  // Move the tokens with the low-latency buffer (moed/low_latency.h) instead of a
  // TokenDispatcher (`dispatcher` is then unused).
  bool low_latency = false;
  // Capacity dropping and router padding are applied by the router and given to the
  // dispatcher too (where they are then a no-op); pad_to_capacity and expert_alignment only
  // shape the dispatch layout.
  LayoutOptions layout;
  // Score function, pre-softmax, groups, aux losses, ...; num_experts, num_topk and layout are
  // taken from the fields above.
  RouterConfig router;
  uint64_t seed = 0;

  RouterConfig router_config() const;
  // What moves the tokens: "low_latency", or dispatcher_kind_name(dispatcher).
  const char* dispatcher_name() const;
  // Shapes, divisibility (E % EP, F % P), dtype, the dispatcher's own limits (low-latency:
  // bf16, etp_size 1, no pad_to_capacity / expert_alignment).
  Status validate(int world_size) const;
};

// One rank's parameters. Expert weights are this rank's shard of its L local experts.
struct MoEWeights {
  Tensor router;            // [E, H] f32 (the router runs in f32 as Megatron's does)
  std::vector<Tensor> fc1;  // [L] of [H, 2 F/P], dtype: gate columns, then up columns
  std::vector<Tensor> fc2;  // [L] of [F/P, H], dtype
  Tensor shared_fc1;        // [H, 2 S], dtype (replicated on every rank); empty when S = 0
  Tensor shared_fc2;        // [S, H], dtype
};
// The weights of group rank (ep, p), generated deterministically from config.seed.
MoEWeights make_moe_weights(const MoEConfig& config, int ep_size, int ep_rank, int etp_rank);

// Gradients of one rank. Router and shared-expert gradients are this rank's tokens'
// contribution (sum over ranks for the data-parallel gradient); expert gradients are complete
// for this rank's shard (every token routed to it, from every rank).
struct MoEGrads {
  Tensor grad_input;             // [T, H], dtype
  Tensor grad_router;            // [E, H] f32
  std::vector<Tensor> grad_fc1;  // [L] of [H, 2 F/P] f32
  std::vector<Tensor> grad_fc2;  // [L] of [F/P, H] f32
  Tensor grad_shared_fc1;        // f32; empty without a shared expert
  Tensor grad_shared_fc2;
};

// What the last forward / backward did on this rank, for tools.
struct MoEStepStats {
  // Seconds on this rank: router, dispatch (the six-step halves, not counting the overlapped
  // shared expert), experts (grouped MLP), combine, shared expert, backward (all of it).
  double route_s = 0, dispatch_s = 0, experts_s = 0, combine_s = 0, shared_s = 0, backward_s = 0;
  int64_t dispatch_rows = 0;                     // rows this rank received (with padding)
  size_t row_bytes = 0;                          // payload bytes per row (H * dtype size)
  std::vector<int64_t> tokens_per_local_expert;  // unpadded, [L]
  int64_t routed = 0;   // (token, expert) pairs the router chose on this rank
  int64_t dropped = 0;  // of those, dropped by capacity
};

class MoELayer {
 public:
  // Collective over the world: builds the dispatcher (or the low-latency buffer) and this
  // rank's weights.
  static StatusOr<std::unique_ptr<MoELayer>> create(World& world, const MoEConfig& config);
  ~MoELayer();

  const MoEConfig& config() const;
  World& world() const;
  const MoEWeights& weights() const;
  // For tests (finite differences) and loading: change parameters between steps.
  MoEWeights& mutable_weights();

  // Collective. x: [T, H] in config.dtype (T may be 0 and differ per rank). Keeps what
  // backward needs until the next forward.
  StatusOr<Tensor> forward(const TensorView& x);
  // Collective. grad_output: [T, H] in config.dtype, for the last forward.
  StatusOr<MoEGrads> backward(const TensorView& grad_output);

  const MoEStepStats& last_stats() const;

  struct State;  // internal (src/moe)

 private:
  explicit MoELayer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// The same model on every rank's tokens in one process: x[s] and grad_output[s] are rank s's
// [T_s, H]; world_size = EP * etp_size. Returns output[s] and grads[r] (rank r's MoEGrads).
// grad_output empty = forward only.
struct ReferenceMoEResult {
  std::vector<Tensor> output;
  std::vector<MoEGrads> grads;
};
StatusOr<ReferenceMoEResult> reference_moe_layer(const MoEConfig& config, int world_size,
                                                 const std::vector<TensorView>& x,
                                                 const std::vector<TensorView>& grad_output);

}  // namespace moed
