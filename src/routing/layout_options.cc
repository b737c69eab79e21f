// Layout options (spec §3): their validation, the capacity formula, and the effective routing
// of one source rank (capacity dropping, then router padding).
#include <algorithm>
#include <cmath>
#include <utility>

#include "moed/routing.h"
#include "moed/thread_pool.h"

namespace moed {

Status LayoutOptions::validate() const {
  if (capacity_factor.has_value()) {
    const double cf = *capacity_factor;
    if (!(cf > 0.0)) return invalid_argument("capacity_factor = ", cf, " must be > 0");
    if (!std::isfinite(cf)) return invalid_argument("capacity_factor = ", cf, " must be finite");
  }
  if (drop_policy != DropPolicy::kProbs && drop_policy != DropPolicy::kPosition) {
    return invalid_argument("drop_policy = ", int(drop_policy), " is not probs or position");
  }
  if (expert_alignment < 1) {
    return invalid_argument("expert_alignment = ", expert_alignment, " must be >= 1");
  }
  if (router_padding_multiple < 0) {
    return invalid_argument("router_padding_multiple = ", router_padding_multiple, " must be >= 0");
  }
  if (pad_to_capacity && !capacity_factor.has_value()) {
    return invalid_argument("pad_to_capacity needs capacity_factor");
  }
  // NOTE: router padding would push chunks past C, so "every chunk is exactly C rows" could
  // not hold.
  if (pad_to_capacity && router_padding_multiple > 0) {
    return invalid_argument("pad_to_capacity cannot be combined with router_padding_multiple = ",
                            router_padding_multiple);
  }
  return ok_status();
}

int64_t expert_capacity(int64_t num_tokens, int num_topk, int num_experts, double capacity_factor) {
  return int64_t(
      std::ceil(double(num_tokens) * double(num_topk) / double(num_experts) * capacity_factor));
}

namespace {

// Drops then pads expert e's column of `out` in place. `scratch` holds (prob, t) pairs for the
// probs policy; it is the worker's, sized num_tokens once per call.
void apply_to_expert(RoutingMap& out, int e, std::optional<int64_t> capacity, DropPolicy policy,
                     int padding_multiple, std::vector<std::pair<float, int64_t>>& scratch) {
  const int64_t num_tokens = out.num_tokens;
  const size_t stride = size_t(out.num_experts);
  uint8_t* map = out.routing_map.data() + e;
  float* probs = out.probs.data() + e;
  int64_t count = 0;
  for (int64_t t = 0; t < num_tokens; ++t) count += map[size_t(t) * stride];

  if (capacity.has_value() && count > *capacity) {
    const int64_t cap = *capacity;
    if (policy == DropPolicy::kPosition || cap == 0) {
      int64_t kept = 0;
      for (int64_t t = 0; t < num_tokens; ++t) {
        const size_t i = size_t(t) * stride;
        if (!map[i]) continue;
        if (kept < cap) {
          ++kept;
        } else {
          map[i] = 0;
          probs[i] = 0.0f;
        }
      }
    } else {
      // Highest prob first, ties to the lower token: the cap-th entry of this order is the
      // last one kept, and an entry is kept iff it does not come after it.
      scratch.clear();
      for (int64_t t = 0; t < num_tokens; ++t) {
        const size_t i = size_t(t) * stride;
        if (map[i]) scratch.emplace_back(probs[i], t);
      }
      const auto before = [](const std::pair<float, int64_t>& a,
                             const std::pair<float, int64_t>& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      };
      std::nth_element(scratch.begin(), scratch.begin() + (cap - 1), scratch.end(), before);
      const std::pair<float, int64_t> last = scratch[size_t(cap - 1)];
      for (int64_t t = 0; t < num_tokens; ++t) {
        const size_t i = size_t(t) * stride;
        if (map[i] && before(last, {probs[i], t})) {
          map[i] = 0;
          probs[i] = 0.0f;
        }
      }
    }
    count = cap;
  }

  if (padding_multiple > 0) {
    int64_t missing = (padding_multiple - count % padding_multiple) % padding_multiple;
    for (int64_t t = 0; t < num_tokens && missing > 0; ++t) {
      const size_t i = size_t(t) * stride;
      if (map[i]) continue;
      map[i] = 1;
      probs[i] = 0.0f;
      --missing;
    }
  }
}

// Below this many map entries the pool's hand-off costs more than the work.
constexpr int64_t kParallelEntries = int64_t(1) << 16;

}  // namespace

StatusOr<RoutingMap> apply_layout_options(const RoutingMap& routing, int num_topk,
                                          const LayoutOptions& options, ThreadPool* pool) {
  MOED_RETURN_IF_ERROR(options.validate());
  MOED_RETURN_IF_ERROR(validate(routing, routing.num_experts));
  if (num_topk < 0) return invalid_argument("num_topk = ", num_topk, " must be >= 0");
  if (num_topk > 0 && routing.num_topk > 0 && num_topk != routing.num_topk) {
    return invalid_argument("num_topk = ", num_topk,
                            " disagrees with the routing's num_topk = ", routing.num_topk);
  }
  std::optional<int64_t> capacity;
  if (options.capacity_factor.has_value()) {
    if (num_topk <= 0) {
      return invalid_argument("num_topk = ", num_topk,
                              " must be >= 1 with capacity_factor (the capacity formula needs K)");
    }
    capacity = expert_capacity(routing.num_tokens, num_topk, routing.num_experts,
                               *options.capacity_factor);
  }

  RoutingMap out = routing;
  if (num_topk > 0) out.num_topk = num_topk;
  if (!capacity.has_value() && options.router_padding_multiple == 0) return out;

  const int num_experts = routing.num_experts;
  const int64_t entries = routing.num_tokens * int64_t(num_experts);
  // NOTE: each expert's column is dropped and padded independently, so workers own disjoint
  // expert ranges and the result does not depend on the split.
  const auto run = [&](int64_t begin, int64_t end, int /*worker*/) {
    std::vector<std::pair<float, int64_t>> scratch;
    if (capacity.has_value() && options.drop_policy == DropPolicy::kProbs) {
      scratch.reserve(size_t(routing.num_tokens));
    }
    for (int64_t e = begin; e < end; ++e) {
      apply_to_expert(out, int(e), capacity, options.drop_policy, options.router_padding_multiple,
                      scratch);
    }
  };
  if (pool == nullptr || entries < kParallelEntries || num_experts == 1) {
    run(0, num_experts, 0);
  } else {
    pool->parallel_for(num_experts, run);
  }
  return out;
}

StatusOr<RoutingMap> apply_layout_options(const RoutingMap& routing, int num_topk,
                                          const LayoutOptions& options) {
  const bool large = routing.num_tokens * int64_t(routing.num_experts) >= kParallelEntries;
  return apply_layout_options(routing, num_topk, options, large ? &ThreadPool::global() : nullptr);
}

}  // namespace moed
