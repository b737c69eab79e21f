// Routing in its forms, converters between them, their validation, and the layout options that
// change what dispatch produces (docs/design.md §2, §3).
//
// TopkRouting owns topk_idx / topk_weights [T, K] (-1 = no expert); TopkView borrows them
// (int32 or int64 indices); RoutingMap is Megatron's dense routing_map / probs [T, E], MapView
// borrows one; SparseRouting (CSR: per token its experts ascending and their probs) is what moed
// works on inside (design.md §2.2).
//
//   moed::TopkRouting topk = ...;
//   MOED_RETURN_IF_ERROR(moed::validate(topk, num_experts));
//   moed::SparseRouting s = moed::to_sparse(moed::TopkView::of(topk), num_experts);
//   MOED_ASSIGN_OR_RETURN(s, moed::apply_layout_options(s, options));  // dropping, padding
//   moed::RoutingMap map = moed::to_map(s);   // only when a dense map is really wanted
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
  std::vector<int32_t> topk_idx;    // row-major [num_tokens][num_topk]
  std::vector<float> topk_weights;  // row-major [num_tokens][num_topk]

  int32_t idx(int64_t t, int k) const { return topk_idx[size_t(t) * num_topk + k]; }
  float weight(int64_t t, int k) const { return topk_weights[size_t(t) * num_topk + k]; }
};

// Top-k form, borrowed: idx [T, K] int64 (DeepEP's topk_idx_t) or int32, values in [-1, E);
// weights [T, K] f32 (null: every weight 0). Both row-major and contiguous. Made by its
// constructor (or TopkView::of), not as an aggregate, so that a field written `.topk = &routing`
// does not compile into a view of nothing.
struct TopkView {
  TopkView() = default;
  TopkView(const void* idx_, bool idx_int64_, const float* weights_, int64_t num_tokens_,
           int num_topk_)
      : idx(idx_),
        idx_int64(idx_int64_),
        weights(weights_),
        num_tokens(num_tokens_),
        num_topk(num_topk_) {}

  const void* idx = nullptr;
  bool idx_int64 = true;
  const float* weights = nullptr;
  int64_t num_tokens = 0;
  int num_topk = 0;

  int64_t at(int64_t t, int k) const {
    const size_t i = size_t(t) * size_t(num_topk) + size_t(k);
    return idx_int64 ? static_cast<const int64_t*>(idx)[i] : static_cast<const int32_t*>(idx)[i];
  }
  float weight(int64_t t, int k) const {
    return weights ? weights[size_t(t) * size_t(num_topk) + size_t(k)] : 0.0f;
  }
  // A routing whose arrays do not hold num_tokens * num_topk entries each (the weights may be
  // empty: all 0) gives a view without data, which validate() rejects.
  static TopkView of(const TopkRouting& r) {
    const size_t n = size_t(r.num_tokens) * size_t(r.num_topk > 0 ? r.num_topk : 0);
    const bool weights = r.topk_weights.size() == n;
    const bool sized = r.topk_idx.size() == n && (weights || r.topk_weights.empty());
    return {sized ? r.topk_idx.data() : nullptr, false,
            sized && weights ? r.topk_weights.data() : nullptr, r.num_tokens, r.num_topk};
  }
  // The same indices without weights: what validate() checks where weights are only carried.
  TopkView indices() const { return {idx, idx_int64, nullptr, num_tokens, num_topk}; }
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

// Map form, borrowed: map [T, E] bytes (0/1, e.g. a torch bool tensor) and probs [T, E] f32,
// both row-major and contiguous, e.g. a caller's tensors (converted without a copy).
struct MapView {
  const uint8_t* map = nullptr;
  const float* probs = nullptr;
  int64_t num_tokens = 0;
  int num_experts = 0;
  int num_topk = 0;  // as RoutingMap::num_topk

  // A map whose arrays do not hold num_tokens * num_experts cells each gives a view without
  // data, which validate() rejects.
  static MapView of(const RoutingMap& r) {
    const size_t n = size_t(r.num_tokens) * size_t(r.num_experts > 0 ? r.num_experts : 0);
    const bool sized = r.routing_map.size() == n && r.probs.size() == n;
    return {sized ? r.routing_map.data() : nullptr, sized ? r.probs.data() : nullptr, r.num_tokens,
            r.num_experts, r.num_topk};
  }
};

// Sparse form (CSR), the internal currency: token t routes to expert[i] with prob[i] for i in
// [begin[t], begin[t + 1]), experts strictly ascending within a token (the order in which the
// map form lists them, so every sum over a token's experts runs in design.md §4.1's order).
struct SparseRouting {
  int num_experts = 0;
  int num_topk = 0;               // K of the router that made it (the capacity formula needs it)
  std::vector<int64_t> begin{0};  // [T + 1]
  std::vector<int32_t> expert;    // [entries]
  std::vector<float> prob;        // [entries]
  // [entries] or empty: each entry's column in the top-k form it was converted from (DeepEP's
  // top-k slot). Empty when the routing came from a map, or when dropping or router padding
  // rewrote it.
  std::vector<int32_t> slot;

  int64_t num_tokens() const { return int64_t(begin.size()) - 1; }
  int64_t num_entries() const { return begin.back(); }
  // Rows per expert [E]: entries whose expert is e.
  std::vector<int64_t> tokens_per_expert() const;
  // [T] fp32 sum of each token's probs, experts ascending (DeepEP's combined weights).
  std::vector<float> prob_sums() const;
};

// Checks design.md §2.3's rules: sizes match num_tokens x num_topk, indices in [-1, E), no expert
// repeated within a token, weights not NaN and not negative. Message names the value, e.g.
// "topk_idx[17][3] = 300 is outside [-1, 256)".
Status validate(const TopkRouting& routing, int num_experts);
// Sizes match, probs not NaN / negative where routed, num_experts == expected_experts.
Status validate(const RoutingMap& routing, int expected_experts);
// The view's cells as validate(RoutingMap) checks them (sizes are the caller's; a view without
// data for its cells is an error).
Status validate(const MapView& routing, int expected_experts);
// The view's indices and weights as validate(TopkRouting) checks them (sizes are the caller's).
Status validate(const TopkView& routing, int num_experts);
// begin runs from 0 up to the entries, experts in [0, E) strictly ascending within a token,
// probs valid, num_experts == expected_experts.
Status validate(const SparseRouting& routing, int expected_experts);

// An owned copy of a view (indices as int32: validate the view first; weights 0 without any).
TopkRouting to_topk(const TopkView& routing);
// top-k -> map: -1 entries are skipped; probs of unrouted experts are 0.
RoutingMap to_map(const TopkRouting& routing, int num_experts);
// Into the sparse form (inputs validated): top-k skips -1 slots and sorts each token's experts;
// a map lists its routed cells. num_topk: the view's K / the map's num_topk.
SparseRouting to_sparse(const TopkView& routing, int num_experts);
SparseRouting to_sparse(const RoutingMap& routing);
SparseRouting to_sparse(const MapView& routing);
// sparse -> map (a dense [T, E]; probs 0 where unrouted).
RoutingMap to_map(const SparseRouting& routing);
// sparse -> top-k with K = max experts per token, or num_topk if given and that is at least
// the max (else an error naming the widest token); unused slots -1 with weight 0.
StatusOr<TopkRouting> to_topk(const SparseRouting& routing, std::optional<int> num_topk = {});
// map -> top-k with K = max experts per token (or `num_topk` if given and large enough, else
// an error naming the token); experts listed in ascending id, unused slots -1 with weight 0.
StatusOr<TopkRouting> to_topk(const RoutingMap& routing, std::optional<int> num_topk = {});

enum class DropPolicy : uint8_t { kProbs = 0, kPosition = 1 };
const char* drop_policy_name(DropPolicy p);
StatusOr<DropPolicy> parse_drop_policy(std::string_view name);  // "probs" | "position"

// Layout options (design.md §3.2); identical meaning in every dispatcher and in the reference.
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

// Applies capacity dropping then router padding to one source rank's routing (design.md §3.3),
// on the sparse form: O(entries + E * padding multiple). The capacity formula takes K from
// routing.num_topk. Each expert is dropped and padded on its own; with a pool and many
// entries the experts are split over its workers (the result does not depend on the split).
StatusOr<SparseRouting> apply_layout_options(const SparseRouting& routing,
                                             const LayoutOptions& options,
                                             ThreadPool* pool = nullptr);
// The same on a map (converted to the sparse form and back; cells the options do not touch,
// unrouted probs included, are left as they are).
// `num_topk` is K of the routing this map came from (for the capacity formula).
// Fast, multithreaded path; the reference has its own independent version. Work is split by
// expert over ThreadPool::global() when the map is large (so don't call it from inside a job
// of the global pool); the overload below takes the pool to use (nullptr = calling thread).
StatusOr<RoutingMap> apply_layout_options(const RoutingMap& routing, int num_topk,
                                          const LayoutOptions& options);
StatusOr<RoutingMap> apply_layout_options(const RoutingMap& routing, int num_topk,
                                          const LayoutOptions& options, ThreadPool* pool);

}  // namespace moed
