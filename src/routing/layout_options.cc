// Layout options (design.md §3.2): their validation, the capacity formula, and the effective
// routing of one source rank (capacity dropping, then router padding), worked out on the sparse
// form.
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

// One source rank's routing by expert (CSC): entries [begin[e], begin[e + 1]) are expert e's,
// tokens ascending.
struct Columns {
  std::vector<int64_t> begin;
  std::vector<int64_t> token;
  std::vector<float> prob;
};

Columns columns_of(const SparseRouting& r) {
  const int E = r.num_experts;
  Columns c;
  c.begin.assign(size_t(E) + 1, 0);
  for (const int32_t e : r.expert) ++c.begin[size_t(e) + 1];
  for (int e = 0; e < E; ++e) c.begin[size_t(e) + 1] += c.begin[size_t(e)];
  std::vector<int64_t> cursor(c.begin.begin(), c.begin.end() - 1);
  c.token.resize(r.expert.size());
  c.prob.resize(r.expert.size());
  for (int64_t t = 0; t < r.num_tokens(); ++t) {
    for (int64_t i = r.begin[size_t(t)]; i < r.begin[size_t(t) + 1]; ++i) {
      const int64_t j = cursor[size_t(r.expert[size_t(i)])]++;
      c.token[size_t(j)] = t;
      c.prob[size_t(j)] = r.prob[size_t(i)];
    }
  }
  return c;
}

// Drops then pads expert e's column: clears keep[] of the dropped entries and appends the
// padded tokens (prob 0) to `padded`. `scratch` holds (prob, t) pairs for the probs policy.
void apply_to_expert(const Columns& c, int e, int64_t num_tokens, std::optional<int64_t> capacity,
                     DropPolicy policy, int padding_multiple, uint8_t* keep,
                     std::vector<int64_t>& padded,
                     std::vector<std::pair<float, int64_t>>& scratch) {
  const int64_t b = c.begin[size_t(e)], end = c.begin[size_t(e) + 1];
  int64_t count = end - b;
  if (capacity.has_value() && count > *capacity) {
    const int64_t cap = *capacity;
    if (policy == DropPolicy::kPosition || cap == 0) {
      for (int64_t i = b + cap; i < end; ++i) keep[i] = 0;
    } else {
      // Highest prob first, ties to the lower token: the cap-th entry of this order is the
      // last one kept, and an entry is kept iff it does not come after it.
      scratch.clear();
      for (int64_t i = b; i < end; ++i) scratch.emplace_back(c.prob[size_t(i)], c.token[size_t(i)]);
      const auto before = [](const std::pair<float, int64_t>& x,
                             const std::pair<float, int64_t>& y) {
        return x.first > y.first || (x.first == y.first && x.second < y.second);
      };
      std::nth_element(scratch.begin(), scratch.begin() + (cap - 1), scratch.end(), before);
      const std::pair<float, int64_t> last = scratch[size_t(cap - 1)];
      for (int64_t i = b; i < end; ++i) {
        if (before(last, {c.prob[size_t(i)], c.token[size_t(i)]})) keep[i] = 0;
      }
    }
    count = cap;
  }
  if (padding_multiple > 0) {
    // The lowest-index tokens not (or no longer) routed to e, merged against the kept ones.
    int64_t missing = (padding_multiple - count % padding_multiple) % padding_multiple;
    int64_t i = b;
    for (int64_t t = 0; t < num_tokens && missing > 0; ++t) {
      while (i < end && (!keep[i] || c.token[size_t(i)] < t)) ++i;
      if (i < end && c.token[size_t(i)] == t) continue;
      padded.push_back(t);
      --missing;
    }
  }
}

// Below this many entries the pool's hand-off costs more than the work.
constexpr int64_t kParallelEntries = int64_t(1) << 15;

// apply_layout_options on checked arguments.
SparseRouting apply_sparse(const SparseRouting& r, std::optional<int64_t> capacity,
                           const LayoutOptions& options, ThreadPool* pool) {
  const int E = r.num_experts;
  const int64_t T = r.num_tokens();
  const Columns c = columns_of(r);
  std::vector<uint8_t> keep(c.token.size(), 1);
  std::vector<std::vector<int64_t>> padded(static_cast<size_t>(E));
  const auto run = [&](int64_t begin, int64_t end, int /*worker*/) {
    std::vector<std::pair<float, int64_t>> scratch;
    for (int64_t e = begin; e < end; ++e) {
      apply_to_expert(c, int(e), T, capacity, options.drop_policy,
                      options.router_padding_multiple, keep.data(), padded[size_t(e)], scratch);
    }
  };
  if (pool == nullptr || r.num_entries() < kParallelEntries || E == 1) {
    run(0, E, 0);
  } else {
    pool->parallel_for(E, run);
  }
  // Back to CSR: experts visited ascending, so each token's list comes out ascending.
  SparseRouting out;
  out.num_experts = E;
  out.num_topk = r.num_topk;
  out.begin.assign(size_t(T) + 1, 0);
  for (int e = 0; e < E; ++e) {
    for (int64_t i = c.begin[size_t(e)]; i < c.begin[size_t(e) + 1]; ++i)
      out.begin[size_t(c.token[size_t(i)]) + 1] += keep[size_t(i)];
    for (const int64_t t : padded[size_t(e)]) ++out.begin[size_t(t) + 1];
  }
  for (int64_t t = 0; t < T; ++t) out.begin[size_t(t) + 1] += out.begin[size_t(t)];
  out.expert.resize(size_t(out.begin.back()));
  out.prob.resize(size_t(out.begin.back()));
  std::vector<int64_t> cursor(out.begin.begin(), out.begin.end() - 1);
  const auto put = [&](int64_t t, int e, float p) {
    const int64_t j = cursor[size_t(t)]++;
    out.expert[size_t(j)] = e;
    out.prob[size_t(j)] = p;
  };
  for (int e = 0; e < E; ++e) {
    // Kept and padded tokens of one expert are distinct, so their order here does not matter.
    for (int64_t i = c.begin[size_t(e)]; i < c.begin[size_t(e) + 1]; ++i) {
      if (keep[size_t(i)]) put(c.token[size_t(i)], e, c.prob[size_t(i)]);
    }
    for (const int64_t t : padded[size_t(e)]) put(t, e, 0.0f);
  }
  return out;
}

// The capacity of `options` for a routing of num_tokens x num_topk over num_experts.
StatusOr<std::optional<int64_t>> capacity_of(const LayoutOptions& options, int64_t num_tokens,
                                             int num_topk, int num_experts) {
  if (!options.capacity_factor.has_value()) return std::optional<int64_t>();
  if (num_topk <= 0) {
    return invalid_argument("num_topk = ", num_topk,
                            " must be >= 1 with capacity_factor (the capacity formula needs K)");
  }
  return std::optional<int64_t>(
      expert_capacity(num_tokens, num_topk, num_experts, *options.capacity_factor));
}

}  // namespace

StatusOr<SparseRouting> apply_layout_options(const SparseRouting& routing,
                                             const LayoutOptions& options, ThreadPool* pool) {
  MOED_RETURN_IF_ERROR(options.validate());
  MOED_RETURN_IF_ERROR(validate(routing, routing.num_experts));
  MOED_ASSIGN_OR_RETURN(const std::optional<int64_t> capacity,
                        capacity_of(options, routing.num_tokens(), routing.num_topk,
                                    routing.num_experts));
  if (!capacity.has_value() && options.router_padding_multiple == 0) return routing;
  return apply_sparse(routing, capacity, options, pool);
}

StatusOr<RoutingMap> apply_layout_options(const RoutingMap& routing, int num_topk,
                                          const LayoutOptions& options, ThreadPool* pool) {
  MOED_RETURN_IF_ERROR(options.validate());
  MOED_RETURN_IF_ERROR(validate(routing, routing.num_experts));
  if (num_topk < 0) return invalid_argument("num_topk = ", num_topk, " must be >= 0");
  if (num_topk > 0 && routing.num_topk > 0 && num_topk != routing.num_topk) {
    return invalid_argument("num_topk = ", num_topk,
                            " disagrees with the routing's num_topk = ", routing.num_topk);
  }
  MOED_ASSIGN_OR_RETURN(const std::optional<int64_t> capacity,
                        capacity_of(options, routing.num_tokens, num_topk, routing.num_experts));
  RoutingMap out = routing;
  if (num_topk > 0) out.num_topk = num_topk;
  if (!capacity.has_value() && options.router_padding_multiple == 0) return out;
  const SparseRouting in = to_sparse(routing);
  const SparseRouting applied = apply_sparse(in, capacity, options, pool);
  // Written back over the input's cells: the routed ones cleared, the result's set.
  const size_t E = size_t(routing.num_experts);
  for (int64_t t = 0; t < in.num_tokens(); ++t) {
    for (int64_t i = in.begin[size_t(t)]; i < in.begin[size_t(t) + 1]; ++i) {
      const size_t cell = size_t(t) * E + size_t(in.expert[size_t(i)]);
      out.routing_map[cell] = 0;
      out.probs[cell] = 0.0f;
    }
    for (int64_t i = applied.begin[size_t(t)]; i < applied.begin[size_t(t) + 1]; ++i) {
      const size_t cell = size_t(t) * E + size_t(applied.expert[size_t(i)]);
      out.routing_map[cell] = 1;
      out.probs[cell] = applied.prob[size_t(i)];
    }
  }
  return out;
}

StatusOr<RoutingMap> apply_layout_options(const RoutingMap& routing, int num_topk,
                                          const LayoutOptions& options) {
  const bool large = routing.num_tokens * int64_t(routing.num_experts) >= kParallelEntries;
  return apply_layout_options(routing, num_topk, options, large ? &ThreadPool::global() : nullptr);
}

}  // namespace moed
