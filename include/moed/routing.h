// Routing in its two forms (spec §2), converters between them, their validation, and the
// layout options that change what dispatch produces (spec §3): capacity dropping, router
// padding for quantisation, pad_to_capacity and expert_alignment.
//
//   moed::TopkRouting topk = ...;                        // topk_idx [T, K], topk_weights [T, K]
//   MOED_RETURN_IF_ERROR(moed::validate(topk, num_experts));
//   moed::RoutingMap map = moed::to_map(topk, num_experts);  // routing_map [T, E], probs [T, E]
//
// The map form is what the layout is defined on: after capacity dropping and router padding a
// token may route to more than K experts (padding) or fewer (dropping), which the top-k form
// cannot say with a fixed K.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moed/status.h"

namespace moed {

class ThreadPool;

// Top-k form: topk_idx int32 [T, K] in [-1, E) (-1 = no expert), topk_weights float32 [T, K].
struct TopkRouting {
  int64_t num_tokens = 0;
  int num_topk = 0;
  std::vector<int32_t> topk_idx;      // row-major [num_tokens][num_topk]
  std::vector<float> topk_weights;    // row-major [num_tokens][num_topk]

  int32_t idx(int64_t t, int k) const { return topk_idx[size_t(t) * num_topk + k]; }
  float weight(int64_t t, int k) const { return topk_weights[size_t(t) * num_topk + k]; }
};

// Map form (Megatron): routing_map bool [T, E] (stored as uint8 0/1), probs float32 [T, E].
struct RoutingMap {
  int64_t num_tokens = 0;
  int num_experts = 0;
  int num_topk = 0;  // K of the router that made it (the capacity formula needs it); to_map sets it
  std::vector<uint8_t> routing_map;  // row-major [num_tokens][num_experts]
  std::vector<float> probs;          // row-major [num_tokens][num_experts]; 0 where unrouted

  bool routed(int64_t t, int e) const { return routing_map[size_t(t) * num_experts + e] != 0; }
  float prob(int64_t t, int e) const { return probs[size_t(t) * num_experts + e]; }
  static RoutingMap empty(int64_t num_tokens, int num_experts);
};

// Checks spec §2's rules: sizes match num_tokens x num_topk, indices in [-1, E), no expert
// repeated within a token, weights not NaN and not negative. Message names the value, e.g.
// "topk_idx[17][3] = 300 is outside [-1, 256)".
Status validate(const TopkRouting& routing, int num_experts);
// Sizes match, probs not NaN / negative where routed, num_experts == expected_experts.
Status validate(const RoutingMap& routing, int expected_experts);

// top-k -> map: -1 entries are skipped; probs of unrouted experts are 0.
RoutingMap to_map(const TopkRouting& routing, int num_experts);
// map -> top-k with K = max experts per token (or `num_topk` if given and large enough, else
// an error naming the token); experts listed in ascending id, unused slots -1 with weight 0.
StatusOr<TopkRouting> to_topk(const RoutingMap& routing, std::optional<int> num_topk = {});

enum class DropPolicy : uint8_t { kProbs = 0, kPosition = 1 };
const char* drop_policy_name(DropPolicy p);
StatusOr<DropPolicy> parse_drop_policy(std::string_view name);  // "probs" | "position"

// Layout options (spec §3); identical meaning in every dispatcher and in the reference.
struct LayoutOptions {
  // Token dropping: capacity C_s = ceil(T_s * K / E * capacity_factor) per source rank s and
  // expert, where K is the routing's top-k (num_topk). Unset = dropless.
  std::optional<double> capacity_factor;
  DropPolicy drop_policy = DropPolicy::kProbs;
  // Every (source, expert) chunk exactly C_s rows, zero-padded (needs capacity_factor).
  bool pad_to_capacity = false;
  // Each expert segment padded at its end to a multiple of this (1 = off).
  int expert_alignment = 1;
  // Megatron's pad_routing_map: per expert, route the lowest-index unrouted tokens (prob 0)
  // until the count is a multiple of this (0 = off). Applied after dropping.
  int router_padding_multiple = 0;

  // cf > 0, alignment >= 1, padding multiple >= 0, pad_to_capacity only with cf, and
  // pad_to_capacity not combined with router padding.
  Status validate() const;
};

// Capacity for one source rank: ceil(num_tokens * num_topk / num_experts * capacity_factor).
int64_t expert_capacity(int64_t num_tokens, int num_topk, int num_experts, double capacity_factor);

// Applies capacity dropping then router padding to one source rank's map (spec §3).
// `num_topk` is K of the routing this map came from (for the capacity formula).
// Fast, multithreaded path; the reference has its own independent version. Work is split by
// expert over ThreadPool::global() when the map is large (so don't call it from inside a job
// of the global pool); the overload below takes the pool to use (nullptr = calling thread).
StatusOr<RoutingMap> apply_layout_options(const RoutingMap& routing, int num_topk,
                                          const LayoutOptions& options);
StatusOr<RoutingMap> apply_layout_options(const RoutingMap& routing, int num_topk,
                                          const LayoutOptions& options, ThreadPool* pool);

}  // namespace moed
