// Pieces the distributed layer (moe_layer.cc, low_latency_path.cc) and the reference layer
// (reference_layer.cc) share, so that both run exactly the same arithmetic.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "moe/experts.h"
#include "moed/flex.h"
#include "moed/low_latency.h"
#include "moed/moe_layer.h"

namespace moed::moe {

// The router on one rank's tokens: logits = x (as f32) @ router^T, then Router::forward.
struct RouteContext {
  Tensor x_f32;   // [T, H]
  Tensor logits;  // [T, E]
  RouterOutput out;
};
StatusOr<RouteContext> route(const Router& router, const Tensor& router_weight, const TensorView& x,
                             ThreadPool* pool);
// grad_probs [T, E] -> d router weight [E, H] and d x [T, H] (f32), through Router::backward.
struct RouteGrad {
  Tensor grad_router;  // [E, H]
  Tensor grad_x;       // [T, H] f32
};
StatusOr<RouteGrad> route_backward(const Router& router, const Tensor& router_weight,
                                   const RouteContext& ctx, std::span<const float> grad_probs,
                                   ThreadPool* pool);

// The shared expert on [T, H] rows (no prob).
void shared_forward(const MoEWeights& w, const TensorView& x, ThreadPool* pool, ExpertContext* ctx,
                    const TensorView& y);
void shared_backward(const MoEWeights& w, const ExpertContext& ctx, const TensorView& dy,
                     ThreadPool* pool, const TensorView& dx, MoEGrads* grads);

// out[t] = round(float(combined[t]) + float(shared[t])) in place on `combined`; shared may be
// empty (no shared expert).
void add_rows(const TensorView& combined, const TensorView& shared, ThreadPool* pool);
// grad_input = round(float(a) + b + float(c)): dispatch grad (dtype), router grad (f32),
// shared grad (dtype, may be empty).
Tensor sum_input_grads(const TensorView& a, const Tensor& b, const TensorView& c, ThreadPool* pool);

// Segments of the canonical layout from tokens_per_expert.
std::vector<Segment> canonical_segments(std::span<const int64_t> tokens_per_expert);
std::vector<TensorView> views(const std::vector<Tensor>& ts);

inline double seconds_since(std::chrono::steady_clock::time_point a) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
}

}  // namespace moed::moe

namespace moed {

struct MoELayer::State {
  World* world = nullptr;
  MoEConfig config;
  int ep_size = 1, ep_rank = 0, etp_rank = 0;
  MoEWeights weights;
  std::unique_ptr<Router> router;
  std::unique_ptr<TokenDispatcher> dispatcher;  // allgather / alltoall / flex
  FlexDispatcher* flex = nullptr;               // the dispatcher, when it is Flex
  std::unique_ptr<LowLatencyBuffer> ll_buffer;  // low-latency
  MoEStepStats stats;

  // Saved by forward for backward.
  bool have_forward = false;
  Tensor x;  // the caller's input, copied
  moe::RouteContext route;
  DispatchOutput dispatched;  // normal dispatchers
  moe::ExpertContext experts;
  moe::ExpertContext shared;
  Tensor expert_y;  // expert outputs (combine's input); Flex: its node-shared buffer instead
  // Low-latency only.
  LowLatencyDispatchOutput ll_dispatched;
  TopkRouting ll_unit_topk;              // the effective routing with unit weights
  std::vector<float> ll_probs;           // per received row
  std::vector<int32_t> ll_row_src_rank;  // per received row (-1 outside recv_count)
};

}  // namespace moed

namespace moed::moe {
// Low-latency forward / backward (low_latency_path.cc).
StatusOr<Tensor> ll_forward(MoELayer::State& s, const TensorView& x);
StatusOr<MoEGrads> ll_backward(MoELayer::State& s, const TensorView& grad_output);
}  // namespace moed::moe
