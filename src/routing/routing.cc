// Routing forms (design.md §2.2): validation and the converters between top-k, map and sparse form.
#include "moed/routing.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "core/enum_names.h"

namespace moed {

namespace {

// A prob the library accepts: finite and not negative (-0.0 is fine).
bool valid_prob(float p) { return std::isfinite(p) && !(p < 0.0f); }

// `name` holds num_tokens * width entries (`per` names the width).
Status check_entries(const char* name, size_t entries, int64_t num_tokens, const char* per,
                     int64_t width) {
  const size_t expected = size_t(num_tokens) * size_t(width);
  if (entries == expected) return ok_status();
  return invalid_argument(name, " has ", entries, " entries, expected num_tokens * ", per, " = ",
                          num_tokens, " * ", width, " = ", expected);
}

// The sizes of every routing form: E >= 1, T >= 0, K >= 0.
Status check_sizes(int num_experts, int64_t num_tokens, int num_topk) {
  if (num_experts < 1) return invalid_argument("num_experts = ", num_experts, " must be >= 1");
  if (num_tokens < 0) return invalid_argument("num_tokens = ", num_tokens, " must be >= 0");
  if (num_topk < 0) return invalid_argument("num_topk = ", num_topk, " must be >= 0");
  return ok_status();
}

// Calls f(e, row[e]) for each nonzero byte of row[0, E), e ascending, while f returns true.
// NOTE: a map row is mostly zeros (K of E cells), so it is read a word at a time and only
// words with a routed cell are looked into: O(T * E / 8 + entries) instead of O(T * E).
static_assert(std::endian::native == std::endian::little, "for_each_routed reads bytes as words");
template <typename F>
void for_each_routed(const uint8_t* row, int E, F&& f) {
  int e = 0;
  for (; e + 8 <= E; e += 8) {
    uint64_t w;
    std::memcpy(&w, row + e, sizeof w);
    if (w == 0) continue;
    // Bit 8j set where byte j is nonzero; visited by count-trailing-zeros, so the branches
    // follow the routed cells, not every byte.
    w |= w >> 4;
    w |= w >> 2;
    w |= w >> 1;
    w &= 0x0101010101010101ull;
    for (; w != 0; w &= w - 1) {
      const int j = e + (std::countr_zero(w) >> 3);
      if (!f(j, row[j])) return;
    }
  }
  for (; e < E; ++e) {
    if (row[e] != 0 && !f(e, row[e])) return;
  }
}

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
  MOED_RETURN_IF_ERROR(check_sizes(num_experts, num_tokens, num_topk));
  MOED_RETURN_IF_ERROR(
      check_entries("topk_idx", routing.topk_idx.size(), num_tokens, "num_topk", num_topk));
  MOED_RETURN_IF_ERROR(
      check_entries("topk_weights", routing.topk_weights.size(), num_tokens, "num_topk", num_topk));
  return validate(TopkView::of(routing), num_experts);
}

Status validate(const TopkView& routing, int num_experts) {
  const int64_t num_tokens = routing.num_tokens;
  const int num_topk = routing.num_topk;
  MOED_RETURN_IF_ERROR(check_sizes(num_experts, num_tokens, num_topk));
  if (num_tokens > 0 && num_topk > 0 && routing.idx == nullptr) {
    return invalid_argument("topk_idx has no data for its ", num_tokens, " x ", num_topk,
                            " entries (a TopkRouting's arrays must hold num_tokens * num_topk "
                            "each)");
  }
  // NOTE: a repeat is looked for among the token's earlier picks while K is small (no
  // allocation, as on a decode step's every call); past that with one stamp per expert (the
  // last token that used it and at which k), O(T * K). Both name the same two picks.
  constexpr int kScanTopk = 16;
  std::vector<int64_t> seen_token(num_topk > kScanTopk ? size_t(num_experts) : 0, -1);
  std::vector<int> seen_k(seen_token.size(), 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int k = 0; k < num_topk; ++k) {
      const int64_t e = routing.at(t, k);
      if (e < -1 || e >= num_experts) {
        return invalid_argument("topk_idx[", t, "][", k, "] = ", e, " is outside [-1, ",
                                num_experts, ")");
      }
      if (e == -1) continue;  // an unused slot; its weight is ignored
      int earlier = -1;
      if (seen_token.empty()) {
        for (int j = 0; j < k && earlier < 0; ++j) earlier = routing.at(t, j) == e ? j : -1;
      } else if (seen_token[size_t(e)] == t) {
        earlier = seen_k[size_t(e)];
      } else {
        seen_token[size_t(e)] = t;
        seen_k[size_t(e)] = k;
      }
      if (earlier >= 0) {
        return invalid_argument("topk_idx[", t, "] repeats expert ", e, " (at k = ", earlier,
                                " and k = ", k, ")");
      }
      const float w = routing.weight(t, k);
      if (!valid_prob(w)) {
        return invalid_argument("topk_weights[", t, "][", k, "] = ", w, " is not a valid prob");
      }
    }
  }
  return ok_status();
}

Status validate(const SparseRouting& routing, int expected_experts) {
  const int E = routing.num_experts;
  if (E != expected_experts) {
    return invalid_argument("sparse routing has num_experts = ", E, ", expected ",
                            expected_experts);
  }
  if (E < 1) return invalid_argument("num_experts = ", E, " must be >= 1");
  if (routing.num_topk < 0)
    return invalid_argument("num_topk = ", routing.num_topk, " must be >= 0");
  if (routing.begin.empty() || routing.begin[0] != 0) {
    return invalid_argument("sparse routing begin must start at 0");
  }
  const size_t n = size_t(routing.begin.back());
  if (routing.expert.size() != n || routing.prob.size() != n) {
    return invalid_argument("sparse routing has ", routing.expert.size(), " experts and ",
                            routing.prob.size(), " probs; begin says ", n, " entries");
  }
  for (int64_t t = 0; t < routing.num_tokens(); ++t) {
    const int64_t b = routing.begin[size_t(t)], e = routing.begin[size_t(t) + 1];
    if (e < b) return invalid_argument("sparse routing begin[", t + 1, "] = ", e, " < ", b);
    for (int64_t i = b; i < e; ++i) {
      const int32_t x = routing.expert[size_t(i)];
      if (x < 0 || x >= E) {
        return invalid_argument("token ", t, " routes to expert ", x, ", outside [0, ", E, ")");
      }
      if (i > b && x <= routing.expert[size_t(i) - 1]) {
        return invalid_argument("token ", t, "'s experts are not strictly ascending (",
                                routing.expert[size_t(i) - 1], " then ", x, ")");
      }
      if (!valid_prob(routing.prob[size_t(i)])) {
        return invalid_argument("prob of token ", t, " at expert ", x, " = ",
                                routing.prob[size_t(i)], " is not a valid prob");
      }
    }
  }
  return ok_status();
}

namespace {

Status check_map_header(const MapView& routing, int expected_experts) {
  const int num_experts = routing.num_experts;
  if (num_experts != expected_experts) {
    return invalid_argument("routing map has num_experts = ", num_experts, ", expected ",
                            expected_experts);
  }
  return check_sizes(num_experts, routing.num_tokens, routing.num_topk);
}

// The map's routed cells in the sparse form (experts ascending per token), with the first cell
// whose byte is not 0 or 1 in *bad_cell (-1: none). The probs are read after the scan, in a loop
// with no branch: the probs of a large map are mostly out of cache by the time it is read (a
// dispatch's rows went through the cache since), and loads that no branch waits on overlap,
// while the scan's branches (which cells are routed) mispredict and would serialise them.
SparseRouting sparse_cells(const MapView& routing, int64_t* bad_cell) {
  const int64_t T = routing.num_tokens;
  const int E = routing.num_experts;
  SparseRouting s;
  s.num_experts = E;
  s.num_topk = routing.num_topk;
  s.begin.resize(size_t(T) + 1);
  if (routing.num_topk > 0) s.expert.reserve(size_t(T) * size_t(routing.num_topk));
  *bad_cell = -1;
  for (int64_t t = 0; t < T; ++t) {
    const size_t row = size_t(t) * size_t(E);
    for_each_routed(routing.map + row, E, [&](int e, uint8_t m) {
      if (m > 1 && *bad_cell < 0) *bad_cell = int64_t(row) + e;
      s.expert.push_back(e);
      return true;
    });
    s.begin[size_t(t) + 1] = int64_t(s.expert.size());
  }
  s.prob.resize(s.expert.size());
  for (int64_t t = 0; t < T; ++t) {
    const float* probs = routing.probs + size_t(t) * size_t(E);
    for (int64_t i = s.begin[size_t(t)]; i < s.begin[size_t(t) + 1]; ++i) {
      s.prob[size_t(i)] = probs[s.expert[size_t(i)]];
    }
  }
  return s;
}

// design.md §2.3 on the cells: each byte 0 or 1, each routed prob valid; the first bad cell
// (row-major) is named.
Status check_map_cells(const MapView& routing) {
  const int E = routing.num_experts;
  int64_t bad = -1;
  const SparseRouting s = sparse_cells(routing, &bad);
  for (int64_t t = 0; t < s.num_tokens(); ++t) {
    for (int64_t i = s.begin[size_t(t)]; i < s.begin[size_t(t) + 1]; ++i) {
      const int64_t cell = t * E + s.expert[size_t(i)];
      if (bad >= 0 && cell >= bad) break;
      if (!valid_prob(s.prob[size_t(i)])) {
        return invalid_argument("probs[", t, "][", s.expert[size_t(i)], "] = ", s.prob[size_t(i)],
                                " is not a valid prob");
      }
    }
    if (bad >= 0 && (t + 1) * E > bad) break;
  }
  if (bad >= 0) {
    return invalid_argument("routing_map[", bad / E, "][", bad % E, "] = ", int(routing.map[bad]),
                            " is not 0 or 1");
  }
  return ok_status();
}

}  // namespace

Status validate(const RoutingMap& routing, int expected_experts) {
  const MapView view = MapView::of(routing);
  MOED_RETURN_IF_ERROR(check_map_header(view, expected_experts));
  MOED_RETURN_IF_ERROR(check_entries("routing_map", routing.routing_map.size(), routing.num_tokens,
                                     "num_experts", routing.num_experts));
  MOED_RETURN_IF_ERROR(check_entries("probs", routing.probs.size(), routing.num_tokens,
                                     "num_experts", routing.num_experts));
  return check_map_cells(view);
}

Status validate(const MapView& routing, int expected_experts) {
  MOED_RETURN_IF_ERROR(check_map_header(routing, expected_experts));
  if (routing.num_tokens > 0 && (routing.map == nullptr || routing.probs == nullptr)) {
    return invalid_argument(routing.map ? "probs" : "routing_map", " has no data for its ",
                            routing.num_tokens, " x ", routing.num_experts,
                            " cells (a RoutingMap's arrays must hold num_tokens * num_experts "
                            "each)");
  }
  return check_map_cells(routing);
}

TopkRouting to_topk(const TopkView& routing) {
  TopkRouting r;
  r.num_tokens = routing.num_tokens;
  r.num_topk = routing.num_topk;
  r.topk_idx.resize(size_t(r.num_tokens) * size_t(r.num_topk));
  r.topk_weights.resize(r.topk_idx.size());
  for (int64_t t = 0; t < r.num_tokens; ++t) {
    for (int k = 0; k < r.num_topk; ++k) {
      r.topk_idx[size_t(t) * r.num_topk + k] = int32_t(routing.at(t, k));
      r.topk_weights[size_t(t) * r.num_topk + k] = routing.weight(t, k);
    }
  }
  return r;
}

RoutingMap to_map(const TopkRouting& routing, int num_experts) {
  return to_map(to_sparse(TopkView::of(routing), num_experts));
}

StatusOr<TopkRouting> to_topk(const RoutingMap& routing, std::optional<int> num_topk) {
  MOED_RETURN_IF_ERROR(validate(routing, routing.num_experts));
  return to_topk(to_sparse(routing), num_topk);
}

SparseRouting to_sparse(const TopkView& routing, int num_experts) {
  const int64_t T = routing.num_tokens;
  const int K = routing.num_topk;
  SparseRouting s;
  s.num_experts = num_experts;
  s.num_topk = K;
  s.begin.resize(size_t(T) + 1);
  s.expert.reserve(size_t(T) * size_t(K));
  s.prob.reserve(size_t(T) * size_t(K));
  s.slot.reserve(size_t(T) * size_t(K));
  for (int64_t t = 0; t < T; ++t) {
    const size_t first = s.expert.size();
    for (int k = 0; k < K; ++k) {
      const int64_t e = routing.at(t, k);
      if (e == -1) continue;
      MOED_CHECK(e >= 0 && e < num_experts, "to_sparse on unvalidated routing: topk_idx[", t, "][",
                 k, "] = ", e);
      // Insertion into the token's ascending run (K is small; experts are distinct).
      size_t i = s.expert.size();
      s.expert.push_back(int32_t(e));
      s.prob.push_back(routing.weight(t, k));
      s.slot.push_back(k);
      for (; i > first && s.expert[i - 1] > e; --i) {
        std::swap(s.expert[i - 1], s.expert[i]);
        std::swap(s.prob[i - 1], s.prob[i]);
        std::swap(s.slot[i - 1], s.slot[i]);
      }
    }
    s.begin[size_t(t) + 1] = int64_t(s.expert.size());
  }
  return s;
}

SparseRouting to_sparse(const RoutingMap& routing) { return to_sparse(MapView::of(routing)); }

SparseRouting to_sparse(const MapView& routing) {
  int64_t bad = -1;  // checked by validate, which the caller ran
  return sparse_cells(routing, &bad);
}

RoutingMap to_map(const SparseRouting& routing) {
  const int E = routing.num_experts;
  RoutingMap map = RoutingMap::empty(routing.num_tokens(), E);
  map.num_topk = routing.num_topk;
  for (int64_t t = 0; t < routing.num_tokens(); ++t) {
    for (int64_t i = routing.begin[size_t(t)]; i < routing.begin[size_t(t) + 1]; ++i) {
      const size_t c = size_t(t) * size_t(E) + size_t(routing.expert[size_t(i)]);
      map.routing_map[c] = 1;
      map.probs[c] = routing.prob[size_t(i)];
    }
  }
  return map;
}

StatusOr<TopkRouting> to_topk(const SparseRouting& routing, std::optional<int> num_topk) {
  const int64_t T = routing.num_tokens();
  int max_per_token = 0;
  int64_t widest_token = -1;
  for (int64_t t = 0; t < T; ++t) {
    const int n = int(routing.begin[size_t(t) + 1] - routing.begin[size_t(t)]);
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
  out.num_tokens = T;
  out.num_topk = k_out;
  out.topk_idx.assign(size_t(T) * size_t(k_out), -1);
  out.topk_weights.assign(size_t(T) * size_t(k_out), 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    size_t slot = size_t(t) * size_t(k_out);
    for (int64_t i = routing.begin[size_t(t)]; i < routing.begin[size_t(t) + 1]; ++i, ++slot) {
      out.topk_idx[slot] = routing.expert[size_t(i)];
      out.topk_weights[slot] = routing.prob[size_t(i)];
    }
  }
  return out;
}

std::vector<int64_t> SparseRouting::tokens_per_expert() const {
  std::vector<int64_t> n(size_t(std::max(0, num_experts)), 0);
  for (const int32_t e : expert) ++n[size_t(e)];
  return n;
}

std::vector<float> SparseRouting::prob_sums() const {
  std::vector<float> sums(size_t(num_tokens()), 0.0f);
  for (int64_t t = 0; t < num_tokens(); ++t) {
    float acc = 0.0f;
    for (int64_t i = begin[size_t(t)]; i < begin[size_t(t) + 1]; ++i) acc += prob[size_t(i)];
    sums[size_t(t)] = acc;
  }
  return sums;
}

namespace {
constexpr EnumName<DropPolicy> kDropPolicyNames[] = {
    {DropPolicy::kProbs, "probs"},
    {DropPolicy::kPosition, "position"},
};
}  // namespace

const char* drop_policy_name(DropPolicy p) { return enum_name(kDropPolicyNames, p, "unknown"); }

StatusOr<DropPolicy> parse_drop_policy(std::string_view name) {
  return parse_enum(kDropPolicyNames, name, "drop policy", "is not one of:");
}

}  // namespace moed
