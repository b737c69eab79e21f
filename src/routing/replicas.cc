// ExpertReplicas (moed/replicas.h): the replica map, checked once, and the deterministic
// choice of a live replica per top-k slot.
#include "moed/replicas.h"

namespace moed {

StatusOr<ExpertReplicas> ExpertReplicas::create(std::vector<std::vector<int32_t>> replicas,
                                                int num_physical, int num_ranks) {
  if (num_ranks <= 0 || num_physical <= 0 || num_physical % num_ranks != 0) {
    return invalid_argument("num_physical = ", num_physical,
                            " must be a positive multiple of num_ranks = ", num_ranks);
  }
  if (replicas.empty()) return invalid_argument("the replica map has no logical expert");
  std::vector<int> owner(size_t(num_physical), -1);
  for (size_t e = 0; e < replicas.size(); ++e) {
    if (replicas[e].empty()) return invalid_argument("logical expert ", e, " has no replica");
    for (int32_t p : replicas[e]) {
      if (p < 0 || p >= num_physical) {
        return invalid_argument("replica ", p, " of logical expert ", e, " is outside [0, ",
                                num_physical, ")");
      }
      if (owner[size_t(p)] >= 0) {
        return invalid_argument("physical expert ", p, " is a replica of logical experts ",
                                owner[size_t(p)], " and ", e);
      }
      owner[size_t(p)] = int(e);
    }
  }
  ExpertReplicas m;
  m.replicas_ = std::move(replicas);
  m.num_physical_ = num_physical;
  m.num_ranks_ = num_ranks;
  return m;
}

StatusOr<ReplicaRoute> ExpertReplicas::route(const TopkRouting& logical,
                                             std::span<const int32_t> masked) const {
  if (!masked.empty() && masked.size() != size_t(num_ranks_)) {
    return invalid_argument("the mask has ", masked.size(), " entries for ", num_ranks_, " ranks");
  }
  if (logical.topk_idx.size() != size_t(logical.num_tokens) * size_t(logical.num_topk)) {
    return invalid_argument("topk_idx has ", logical.topk_idx.size(), " entries, expected ",
                            logical.num_tokens, " x ", logical.num_topk);
  }
  // The weights travel unchanged with the physical picks; checked where they are used.
  MOED_RETURN_IF_ERROR(validate(TopkView{logical.topk_idx.data(), false, nullptr,
                                         logical.num_tokens, logical.num_topk},
                                num_logical()));
  auto live = [&](int32_t p) { return masked.empty() || masked[size_t(rank_of(p))] == 0; };
  ReplicaRoute r;
  r.topk = logical;
  const int K = logical.num_topk;
  for (int64_t t = 0; t < logical.num_tokens; ++t) {
    for (int k = 0; k < K; ++k) {
      int32_t& slot = r.topk.topk_idx[size_t(t) * K + k];
      const int32_t e = slot;
      if (e < 0) continue;
      const std::vector<int32_t>& reps = replicas_[size_t(e)];
      const size_t n = reps.size(), first = size_t(t + k) % n;
      slot = -1;
      for (size_t i = 0; i < n && slot < 0; ++i) {
        if (live(reps[(first + i) % n])) slot = reps[(first + i) % n];
      }
      if (slot < 0) ++r.lost;
    }
  }
  return r;
}

}  // namespace moed
