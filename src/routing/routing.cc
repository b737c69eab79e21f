// Routing forms (spec §2): validation and the converters between top-k and map form.
#include "moed/routing.h"

#include <algorithm>
#include <cmath>

namespace moed {

namespace {

// A prob the library accepts: finite and not negative (-0.0 is fine).
bool valid_prob(float p) { return std::isfinite(p) && !(p < 0.0f); }

}  // namespace

RoutingMap RoutingMap::empty(int64_t num_tokens, int num_experts) {
  RoutingMap map;
  map.num_tokens = num_tokens;
  map.num_experts = num_experts;
  const size_t n = size_t(std::max<int64_t>(0, num_tokens)) * size_t(std::max(0, num_experts));
  map.routing_map.assign(n, 0);
  map.probs.assign(n, 0.0f);
  return map;
}

Status validate(const TopkRouting& routing, int num_experts) {
  const int64_t num_tokens = routing.num_tokens;
  const int num_topk = routing.num_topk;
  if (num_experts < 1) return invalid_argument("num_experts = ", num_experts, " must be >= 1");
  if (num_tokens < 0) return invalid_argument("num_tokens = ", num_tokens, " must be >= 0");
  if (num_topk < 0) return invalid_argument("num_topk = ", num_topk, " must be >= 0");
  const size_t expected = size_t(num_tokens) * size_t(num_topk);
  if (routing.topk_idx.size() != expected) {
    return invalid_argument("topk_idx has ", routing.topk_idx.size(),
                            " entries, expected num_tokens * num_topk = ", num_tokens, " * ",
                            num_topk, " = ", expected);
  }
  if (routing.topk_weights.size() != expected) {
    return invalid_argument("topk_weights has ", routing.topk_weights.size(),
                            " entries, expected num_tokens * num_topk = ", num_tokens, " * ",
                            num_topk, " = ", expected);
  }
  // NOTE: repeats are found with one stamp per expert (the last token that used it and at
  // which k), so the check is O(T * K) with no per-token allocation.
  std::vector<int64_t> seen_token(size_t(num_experts), -1);
  std::vector<int> seen_k(size_t(num_experts), 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int k = 0; k < num_topk; ++k) {
      const int32_t e = routing.idx(t, k);
      if (e < -1 || e >= num_experts) {
        return invalid_argument("topk_idx[", t, "][", k, "] = ", e, " is outside [-1, ",
                                num_experts, ")");
      }
      if (e == -1) continue;  // an unused slot; its weight is ignored
      if (seen_token[size_t(e)] == t) {
        return invalid_argument("topk_idx[", t, "] repeats expert ", e,
                                " (at k = ", seen_k[size_t(e)], " and k = ", k, ")");
      }
      seen_token[size_t(e)] = t;
      seen_k[size_t(e)] = k;
      const float w = routing.weight(t, k);
      if (!valid_prob(w)) {
        return invalid_argument("topk_weights[", t, "][", k, "] = ", w, " is not a valid prob");
      }
    }
  }
  return ok_status();
}

Status validate(const RoutingMap& routing, int expected_experts) {
  const int64_t num_tokens = routing.num_tokens;
  const int num_experts = routing.num_experts;
  if (num_experts != expected_experts) {
    return invalid_argument("routing map has num_experts = ", num_experts, ", expected ",
                            expected_experts);
  }
  if (num_experts < 1) return invalid_argument("num_experts = ", num_experts, " must be >= 1");
  if (num_tokens < 0) return invalid_argument("num_tokens = ", num_tokens, " must be >= 0");
  if (routing.num_topk < 0) {
    return invalid_argument("num_topk = ", routing.num_topk, " must be >= 0");
  }
  const size_t expected = size_t(num_tokens) * size_t(num_experts);
  if (routing.routing_map.size() != expected) {
    return invalid_argument("routing_map has ", routing.routing_map.size(),
                            " entries, expected num_tokens * num_experts = ", num_tokens, " * ",
                            num_experts, " = ", expected);
  }
  if (routing.probs.size() != expected) {
    return invalid_argument("probs has ", routing.probs.size(),
                            " entries, expected num_tokens * num_experts = ", num_tokens, " * ",
                            num_experts, " = ", expected);
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int e = 0; e < num_experts; ++e) {
      const size_t i = size_t(t) * size_t(num_experts) + size_t(e);
      const uint8_t m = routing.routing_map[i];
      if (m > 1) {
        return invalid_argument("routing_map[", t, "][", e, "] = ", int(m), " is not 0 or 1");
      }
      if (m == 1 && !valid_prob(routing.probs[i])) {
        return invalid_argument("probs[", t, "][", e, "] = ", routing.probs[i],
                                " is not a valid prob");
      }
    }
  }
  return ok_status();
}

RoutingMap to_map(const TopkRouting& routing, int num_experts) {
  RoutingMap map = RoutingMap::empty(routing.num_tokens, num_experts);
  map.num_topk = routing.num_topk;
  for (int64_t t = 0; t < routing.num_tokens; ++t) {
    for (int k = 0; k < routing.num_topk; ++k) {
      const int32_t e = routing.idx(t, k);
      if (e == -1) continue;
      MOED_CHECK(e >= 0 && e < num_experts, "to_map on unvalidated routing: topk_idx[", t, "][", k,
                 "] = ", e);
      const size_t i = size_t(t) * size_t(num_experts) + size_t(e);
      map.routing_map[i] = 1;
      map.probs[i] = routing.weight(t, k);
    }
  }
  return map;
}

StatusOr<TopkRouting> to_topk(const RoutingMap& routing, std::optional<int> num_topk) {
  MOED_RETURN_IF_ERROR(validate(routing, routing.num_experts));
  const int num_experts = routing.num_experts;
  int max_per_token = 0;
  int64_t widest_token = -1;
  for (int64_t t = 0; t < routing.num_tokens; ++t) {
    int n = 0;
    for (int e = 0; e < num_experts; ++e) n += routing.routed(t, e) ? 1 : 0;
    if (n > max_per_token) {
      max_per_token = n;
      widest_token = t;
    }
  }
  int k_out = max_per_token;
  if (num_topk.has_value()) {
    if (*num_topk < 0) return invalid_argument("num_topk = ", *num_topk, " must be >= 0");
    if (*num_topk < max_per_token) {
      return invalid_argument("token ", widest_token, " routes to ", max_per_token,
                              " experts, more than num_topk = ", *num_topk);
    }
    k_out = *num_topk;
  }
  TopkRouting out;
  out.num_tokens = routing.num_tokens;
  out.num_topk = k_out;
  out.topk_idx.assign(size_t(routing.num_tokens) * size_t(k_out), -1);
  out.topk_weights.assign(size_t(routing.num_tokens) * size_t(k_out), 0.0f);
  for (int64_t t = 0; t < routing.num_tokens; ++t) {
    size_t slot = size_t(t) * size_t(k_out);
    for (int e = 0; e < num_experts; ++e) {
      if (!routing.routed(t, e)) continue;
      out.topk_idx[slot] = e;
      out.topk_weights[slot] = routing.prob(t, e);
      ++slot;
    }
  }
  return out;
}

const char* drop_policy_name(DropPolicy p) {
  switch (p) {
    case DropPolicy::kProbs:
      return "probs";
    case DropPolicy::kPosition:
      return "position";
  }
  return "unknown";
}

StatusOr<DropPolicy> parse_drop_policy(std::string_view name) {
  if (name == "probs") return DropPolicy::kProbs;
  if (name == "position") return DropPolicy::kPosition;
  return invalid_argument("drop policy '", name, "' is not one of: probs, position");
}

}  // namespace moed
