// Flex dispatcher extras (DeepEP's design, spec §5): the dispatch layout on its own, for tools
// that replay routing without moving tokens, and the shared combine buffer that lets experts
// write their outputs where peers can read them without a copy.
//
//   MOED_ASSIGN_OR_RETURN(moed::DispatchLayout l,
//                         moed::get_dispatch_layout(topk, /*num_experts=*/256, /*world_size=*/16,
//                                                   /*ranks_per_node=*/8));
//   // l.num_tokens_per_rank[r]: tokens of this rank that rank r needs (each token once).
//
// The Flex dispatcher itself is made by TokenDispatcher::create with kind = kFlex.
#pragma once

#include <cstdint>
#include <vector>

#include "moed/dispatcher.h"
#include "moed/routing.h"
#include "moed/status.h"
#include "moed/tensor.h"

namespace moed {

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
// Map form (e.g. the effective routing after dropping and router padding).
StatusOr<DispatchLayout> get_dispatch_layout(const RoutingMap& map, int world_size,
                                             int ranks_per_node, int etp_size = 1);

// A view of `rows` x hidden rows of `dtype` (f32 or bf16) in node-shared memory, for the
// experts of the dispatch that made `handle` to write their outputs into. Passing it (or a
// view of its first handle->num_rows rows) as CombineInput.expert_output lets combine read the
// rows in place; any other memory is first copied there (in the MPI world; in the threads
// world every rank's memory is already node-shared and is read in place). Collective over the
// node: every rank of the node calls it after the same dispatch with the same dtype. Valid
// until the next call or the next combine with other memory.
StatusOr<TensorView> flex_expert_output_buffer(TokenDispatcher& dispatcher,
                                               const DispatchHandle& handle, DType dtype);

}  // namespace moed
