// Redundant experts (EPLB-style placement, as DeepSeek's EPLB, vLLM and SGLang use them): each
// logical expert has one or more physical replicas, given by the caller (physical expert p lives
// on rank p / num_local_experts). route() turns a token's logical top-k into physical expert ids,
// skipping replicas on masked ranks, by a fixed rule (docs/design.md §12.4): the same choice on
// every run and world, and a slot with no live replica is -1 and counted as lost. Combining in
// the order of the logical ids (LowLatencyCombineInput::order) makes the output independent of
// which replica served a token.
//
//   MOED_ASSIGN_OR_RETURN(moed::ExpertReplicas map,
//                         moed::ExpertReplicas::create({{0, 5}, {1, 6}, ...}, 8, 4));
//   MOED_ASSIGN_OR_RETURN(moed::ReplicaRoute r, map.route(logical, buffer.query_mask()));
//   // dispatch r.topk; combine with .order = logical.topk_idx; r.lost slots had no replica
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moed/routing.h"
#include "moed/status.h"

namespace moed {

struct ReplicaRoute {
  TopkRouting topk;  // physical expert ids (-1 where the logical slot was -1 or lost), weights
  int64_t lost = 0;  // slots whose logical expert had no replica on an unmasked rank
};

class ExpertReplicas {
 public:
  // replicas[e]: the physical experts of logical expert e (at least one each, distinct, every
  // one in [0, num_physical), no physical expert used twice); num_physical a multiple of
  // num_ranks.
  static StatusOr<ExpertReplicas> create(std::vector<std::vector<int32_t>> replicas,
                                         int num_physical, int num_ranks);

  int num_logical() const { return int(replicas_.size()); }
  int num_physical() const { return num_physical_; }
  const std::vector<int32_t>& replicas(int logical) const { return replicas_[size_t(logical)]; }
  int rank_of(int32_t physical) const { return physical / (num_physical_ / num_ranks_); }

  // `logical`: [T, K] logical ids in [-1, num_logical); `masked`: [num_ranks], nonzero where a
  // rank is masked (LowLatencyBuffer::query_mask), or empty (none).
  StatusOr<ReplicaRoute> route(const TopkRouting& logical, std::span<const int32_t> masked) const;

 private:
  std::vector<std::vector<int32_t>> replicas_;
  int num_physical_ = 0;
  int num_ranks_ = 1;
};

}  // namespace moed
