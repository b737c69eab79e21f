// The dispatch layout of one rank's routing (DeepEP's get_dispatch_layout): which ranks and
// nodes need each token, and the per-rank, per-node and per-expert counts. Local, no world
// needed: tools replay routing with it without moving tokens, and the Flex dispatcher takes
// its counts for the one exchange before data moves (notify) from it.
//
//   MOED_ASSIGN_OR_RETURN(moed::DispatchLayout l,
//                         moed::get_dispatch_layout(topk, /*num_experts=*/256, /*world_size=*/16,
//                                                   /*ranks_per_node=*/8));
//   // l.num_tokens_per_rank[r]: tokens of this rank that rank r needs (each token once).
#pragma once

#include <cstdint>
#include <vector>

#include "moed/routing.h"
#include "moed/status.h"

namespace moed {

// Flex's wire format across nodes (design.md §5.5), for every figure that counts its bytes: per
// token sent to a remote node, its token index, its number of entries, the bitmask of the
// node's ranks that need it and the node's place in the token's combine chain; per (token,
// expert on that node), the expert id, its prob and its top-k slot. src/dispatch/flex's
// MessageHeader / MessageEntry are asserted to these sizes.
inline constexpr int64_t kFlexTokenHeaderBytes = 24;
inline constexpr int64_t kFlexEntryBytes = 12;
// Inside a node, each row Flex's dispatch writes carries its prob, source rank, source token and
// top-k slot beside the payload.
inline constexpr int64_t kFlexRowMetaBytes = 16;

// DeepEP's get_dispatch_layout, computed from one rank's routing. With expert tensor
// parallelism (etp_size P > 1) a token routed to expert e is needed by all P ranks
// (ep(e), p), and counts once on each.
struct DispatchLayout {
  int num_ranks = 0;
  int num_nodes = 0;
  std::vector<int64_t> num_tokens_per_rank;    // [R]: a token counts once per rank
  std::vector<int64_t> num_tokens_per_node;    // [N]: once per node (DeepEP's per-RDMA-rank)
  std::vector<int64_t> num_tokens_per_expert;  // [E]: once per (token, expert)
  std::vector<uint8_t> is_token_in_rank;       // [T, R] 0/1

  bool in_rank(int64_t t, int r) const {
    return is_token_in_rank[size_t(t) * size_t(num_ranks) + size_t(r)] != 0;
  }
};

// Top-k form (validated: indices in [-1, E), no repeats). world_size must be a multiple of
// ranks_per_node and of etp_size, and num_experts of world_size / etp_size.
StatusOr<DispatchLayout> get_dispatch_layout(const TopkRouting& topk, int num_experts,
                                             int world_size, int ranks_per_node, int etp_size = 1);
StatusOr<DispatchLayout> get_dispatch_layout(const TopkView& topk, int num_experts,
                                             int world_size, int ranks_per_node, int etp_size = 1);
// Map form (e.g. the effective routing after dropping and router padding).
StatusOr<DispatchLayout> get_dispatch_layout(const RoutingMap& map, int world_size,
                                             int ranks_per_node, int etp_size = 1);

}  // namespace moed
