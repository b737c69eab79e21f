// Generated routings of the plan model (moed/plan.h plan_routing): uniform, Zipf-skewed,
// DeepSeek's group-limited gating, or one step of a trace.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "moed/plan.h"

namespace moed {

namespace {

// splitmix64: small, seedable, the same on every platform.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }
  uint64_t below(uint64_t n) { return n == 0 ? 0 : next() % n; }
};

}  // namespace

StatusOr<PlanRouting> parse_plan_routing(const std::string& name) {
  if (name == "uniform") return PlanRouting::kUniform;
  if (name == "zipf") return PlanRouting::kZipf;
  if (name == "group") return PlanRouting::kGroup;
  if (name == "trace") return PlanRouting::kTrace;
  return invalid_argument("--routing '", name, "' is not one of uniform, zipf, group");
}

StatusOr<std::vector<int32_t>> plan_routing(const PlanOptions& options, int rank) {
  PlanOptions o = options;
  if (o.routing == PlanRouting::kGroup) {
    if (o.num_groups == 0 && o.ranks_per_node > 0) o.num_groups = o.ep / o.ranks_per_node;
    if (o.group_topk == 0) o.group_topk = std::min(o.num_groups, 4);
    if (o.num_groups < 1 || o.experts % o.num_groups != 0 || o.group_topk < 1 ||
        o.group_topk > o.num_groups ||
        int64_t(o.group_topk) * (o.experts / o.num_groups) < o.topk) {
      return invalid_argument("--groups = ", o.num_groups, ", --group-topk = ", o.group_topk,
                              " cannot route --topk = ", o.topk, " of --experts = ", o.experts);
    }
  }
  if (o.topk < 1 || o.experts < o.topk || o.tokens < 0) {
    return invalid_argument("--topk = ", o.topk, " is outside [1, --experts = ", o.experts, "]");
  }
  const int E = o.experts, K = o.topk;
  const int64_t T = o.tokens;
  std::vector<int32_t> idx(size_t(T) * size_t(K), -1);
  if (o.routing == PlanRouting::kTrace) {
    if (o.trace == nullptr) return invalid_argument("--routing trace needs --trace");
    if (o.trace_step < 0 || o.trace_step >= o.trace->num_steps ||
        (int64_t(rank) + 1) * T > o.trace->num_tokens || o.topk != o.trace->num_topk) {
      return invalid_argument(o.trace->name, ": step ", o.trace_step, " rank ", rank,
                              " is outside the trace");
    }
    const int64_t first = int64_t(rank) * T;
    for (int64_t t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) idx[size_t(t * K + k)] = o.trace->idx(o.trace_step, first + t, k);
    }
    return idx;
  }
  Rng rng{o.seed * 0x100000001B3ull + uint64_t(rank) + 1};
  if (o.routing == PlanRouting::kUniform) {
    // Partial Fisher-Yates: each token's K experts are a uniform K-subset.
    std::vector<int32_t> perm(static_cast<size_t>(E));
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {
        const size_t j = size_t(k) + size_t(rng.below(uint64_t(E - k)));
        std::swap(perm[size_t(k)], perm[j]);
        idx[size_t(t * K + k)] = perm[size_t(k)];
      }
    }
  } else if (o.routing == PlanRouting::kZipf) {
    // Expert i has the i-th popularity, P ~ 1 / (i + 1)^s; K distinct, drawn one by one
    // without replacement (renormalised over the experts not yet taken).
    std::vector<double> w(static_cast<size_t>(E));
    for (int e = 0; e < E; ++e) w[size_t(e)] = 1.0 / std::pow(double(e + 1), o.zipf_s);
    std::vector<double> cdf(static_cast<size_t>(E));
    std::partial_sum(w.begin(), w.end(), cdf.begin());
    for (int64_t t = 0; t < T; ++t) {
      double taken = 0.0;
      for (int k = 0; k < K; ++k) {
        int e = -1;
        for (int tries = 0; tries < 64 && e < 0; ++tries) {
          const double u = rng.uniform() * cdf.back();
          const int c = int(std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
          const int pick = std::min(c, E - 1);
          bool seen = false;
          for (int k2 = 0; k2 < k; ++k2) seen = seen || idx[size_t(t * K + k2)] == pick;
          if (!seen) e = pick;
        }
        if (e < 0) {  // the rest of the mass is in taken experts: scan by weight
          double u = rng.uniform() * (cdf.back() - taken), acc = 0.0;
          for (int c = 0; c < E && e < 0; ++c) {
            bool seen = false;
            for (int k2 = 0; k2 < k; ++k2) seen = seen || idx[size_t(t * K + k2)] == c;
            if (seen) continue;
            acc += w[size_t(c)];
            if (acc >= u) e = c;
          }
          for (int c = E - 1; e < 0 && c >= 0; --c) {
            bool seen = false;
            for (int k2 = 0; k2 < k; ++k2) seen = seen || idx[size_t(t * K + k2)] == c;
            if (!seen) e = c;
          }
        }
        taken += w[size_t(e)];
        idx[size_t(t * K + k)] = e;
      }
    }
  } else {
    // DeepSeek's group-limited gating, as DeepEP's tests route: iid scores per expert, a
    // group's score is its best expert's, the top group_topk groups are kept, and the top K
    // experts among them are chosen.
    const int NG = o.num_groups, GK = o.group_topk, per = E / NG;
    std::vector<double> score(static_cast<size_t>(E)), gscore(static_cast<size_t>(NG));
    std::vector<int> groups(static_cast<size_t>(NG));
    for (int64_t t = 0; t < T; ++t) {
      for (int e = 0; e < E; ++e) score[size_t(e)] = rng.uniform();
      for (int g = 0; g < NG; ++g) {
        gscore[size_t(g)] =
            *std::max_element(score.begin() + g * per, score.begin() + (g + 1) * per);
      }
      std::iota(groups.begin(), groups.end(), 0);
      std::partial_sort(groups.begin(), groups.begin() + GK, groups.end(),
                        [&](int a, int b) { return gscore[size_t(a)] > gscore[size_t(b)]; });
      // The K best of the kept groups' experts, best first, kept sorted as they come: most
      // experts score below the K-th so far and cost one comparison.
      int32_t* top = &idx[size_t(t * K)];
      int n = 0;
      for (int i = 0; i < GK; ++i) {
        for (int e = groups[size_t(i)] * per; e < (groups[size_t(i)] + 1) * per; ++e) {
          const double v = score[size_t(e)];
          if (n == K && v <= score[size_t(top[K - 1])]) continue;
          int at = n < K ? n++ : K - 1;
          for (; at > 0 && score[size_t(top[at - 1])] < v; --at) top[at] = top[at - 1];
          top[at] = e;
        }
      }
    }
  }
  return idx;
}

}  // namespace moed
