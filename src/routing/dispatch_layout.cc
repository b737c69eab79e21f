// DeepEP's get_dispatch_layout (moed/dispatch_layout.h): one pass over a rank's routing.
#include "routing/dispatch_layout.h"

#include <algorithm>

namespace moed {

namespace {

Status check_topology(int num_experts, int world_size, int ranks_per_node, int etp_size) {
  if (world_size <= 0) return invalid_argument("world_size = ", world_size, " must be positive");
  if (ranks_per_node <= 0 || world_size % ranks_per_node != 0) {
    return invalid_argument("ranks_per_node = ", ranks_per_node,
                            " does not divide world_size = ", world_size);
  }
  if (etp_size <= 0 || world_size % etp_size != 0) {
    return invalid_argument("etp_size = ", etp_size, " does not divide world_size = ", world_size);
  }
  const int ep = world_size / etp_size;
  if (num_experts <= 0 || num_experts % ep != 0) {
    return invalid_argument("num_experts = ", num_experts,
                            " is not a positive multiple of ep_size = ", ep);
  }
  return ok_status();
}

}  // namespace

StatusOr<DispatchLayout> get_dispatch_layout(const RoutingMap& map, int world_size,
                                             int ranks_per_node, int etp_size) {
  MOED_RETURN_IF_ERROR(check_topology(map.num_experts, world_size, ranks_per_node, etp_size));
  MOED_RETURN_IF_ERROR(validate(map, map.num_experts));
  return count_dispatch_layout(to_sparse(map), world_size, ranks_per_node, etp_size);
}

StatusOr<DispatchLayout> get_dispatch_layout(const TopkView& topk, int num_experts,
                                             int world_size, int ranks_per_node, int etp_size) {
  MOED_RETURN_IF_ERROR(check_topology(num_experts, world_size, ranks_per_node, etp_size));
  MOED_RETURN_IF_ERROR(validate(topk, num_experts));
  return count_dispatch_layout(to_sparse(topk, num_experts), world_size, ranks_per_node,
                               etp_size);
}

StatusOr<DispatchLayout> get_dispatch_layout(const TopkRouting& topk, int num_experts,
                                             int world_size, int ranks_per_node, int etp_size) {
  MOED_RETURN_IF_ERROR(check_topology(num_experts, world_size, ranks_per_node, etp_size));
  MOED_RETURN_IF_ERROR(validate(topk, num_experts));
  return count_dispatch_layout(to_sparse(TopkView::of(topk), num_experts), world_size,
                               ranks_per_node, etp_size);
}

DispatchLayout count_dispatch_layout(const SparseRouting& routing, int world_size,
                                     int ranks_per_node, int etp_size) {
  const int R = world_size, E = routing.num_experts, G = ranks_per_node, N = R / G;
  const int L = E / (R / etp_size);
  const int64_t T = routing.num_tokens();
  DispatchLayout l;
  l.num_ranks = R;
  l.num_nodes = N;
  l.num_tokens_per_rank.assign(size_t(R), 0);
  l.num_tokens_per_node.assign(size_t(N), 0);
  l.num_tokens_per_expert = routing.tokens_per_expert();
  l.is_token_in_rank.assign(size_t(T) * R, 0);
  std::vector<int64_t> node_seen(size_t(N), -1);  // the last token counted on each node
  for (int64_t t = 0; t < T; ++t) {
    uint8_t* in_rank = &l.is_token_in_rank[size_t(t) * R];
    for (int64_t i = routing.begin[size_t(t)]; i < routing.begin[size_t(t) + 1]; ++i) {
      const int e = routing.expert[size_t(i)];
      for (int p = 0; p < etp_size; ++p) {
        const int r = (e / L) * etp_size + p;
        if (!in_rank[r]) {
          in_rank[r] = 1;
          ++l.num_tokens_per_rank[size_t(r)];
        }
        if (node_seen[size_t(r / G)] != t) {
          node_seen[size_t(r / G)] = t;
          ++l.num_tokens_per_node[size_t(r / G)];
        }
      }
    }
  }
  return l;
}

}  // namespace moed
