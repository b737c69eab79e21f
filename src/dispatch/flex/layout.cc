// Flex phase 1, layout (local, spec §5.1): DeepEP's get_dispatch_layout, the token -> experts
// lists the other phases walk, and the rank arithmetic and wire/segment layouts they share.
#include <algorithm>

#include "dispatch/flex/flex_internal.h"

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
  const int R = world_size, E = map.num_experts, G = ranks_per_node, N = R / G;
  const int L = E / (R / etp_size);
  DispatchLayout l;
  l.num_ranks = R;
  l.num_nodes = N;
  l.num_tokens_per_rank.assign(size_t(R), 0);
  l.num_tokens_per_node.assign(size_t(N), 0);
  l.num_tokens_per_expert.assign(size_t(E), 0);
  l.is_token_in_rank.assign(size_t(map.num_tokens) * R, 0);
  std::vector<uint8_t> in_node(static_cast<size_t>(N));
  for (int64_t t = 0; t < map.num_tokens; ++t) {
    uint8_t* in_rank = &l.is_token_in_rank[size_t(t) * R];
    std::fill(in_node.begin(), in_node.end(), 0);
    for (int e = 0; e < E; ++e) {
      if (!map.routed(t, e)) continue;
      ++l.num_tokens_per_expert[size_t(e)];
      for (int p = 0; p < etp_size; ++p) {
        const int r = (e / L) * etp_size + p;
        in_rank[r] = 1;
        in_node[size_t(r / G)] = 1;
      }
    }
    for (int r = 0; r < R; ++r) l.num_tokens_per_rank[size_t(r)] += in_rank[r];
    for (int m = 0; m < N; ++m) l.num_tokens_per_node[size_t(m)] += in_node[size_t(m)];
  }
  return l;
}

StatusOr<DispatchLayout> get_dispatch_layout(const TopkRouting& topk, int num_experts,
                                             int world_size, int ranks_per_node, int etp_size) {
  MOED_RETURN_IF_ERROR(check_topology(num_experts, world_size, ranks_per_node, etp_size));
  MOED_RETURN_IF_ERROR(validate(topk, num_experts));
  return get_dispatch_layout(to_map(topk, num_experts), world_size, ranks_per_node, etp_size);
}

namespace flex {

Topology Topology::of(const World& world, const DispatchConfig& config) {
  Topology t;
  t.num_ranks = world.size();
  t.ranks_per_node = world.ranks_per_node();
  t.num_nodes = world.num_nodes();
  t.etp_size = config.etp_size;
  t.num_experts = config.num_experts;
  t.num_local_experts = config.num_local_experts(world.size());
  t.rank = world.rank();
  t.node = world.node();
  t.local_rank = world.local_rank();
  return t;
}

TokenRoutes make_token_routes(const RoutingMap& map, ThreadPool& pool) {
  const int64_t T = map.num_tokens;
  const int E = map.num_experts;
  TokenRoutes r;
  r.begin.assign(size_t(T) + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    const uint8_t* row = &map.routing_map[size_t(t) * E];
    int64_t n = 0;
    for (int e = 0; e < E; ++e) n += row[e];
    r.begin[size_t(t) + 1] = r.begin[size_t(t)] + n;
  }
  r.expert.resize(size_t(r.begin.back()));
  r.prob.resize(size_t(r.begin.back()));
  pool.parallel_for(
      T,
      [&](int64_t b, int64_t end, int) {
        for (int64_t t = b; t < end; ++t) {
          int64_t k = r.begin[size_t(t)];
          for (int e = 0; e < E; ++e) {
            if (!map.routed(t, e)) continue;
            r.expert[size_t(k)] = e;
            r.prob[size_t(k)] = map.prob(t, e);
            ++k;
          }
        }
      },
      256);
  return r;
}

int64_t GlobalInfo::node_entries(const Topology& topo, int s, int m) const {
  int64_t q = 0;
  for (int e = 0; e < num_experts; ++e) {
    if (topo.node_of_expert(e) == m) q += count(s, e);
  }
  return q;
}

MessageLayout MessageLayout::of(int64_t tokens, int64_t entries, size_t row_bytes,
                                size_t scale_bytes) {
  MessageLayout l;
  l.entries_off = size_t(tokens) * sizeof(MessageHeader);
  l.payload_off = l.entries_off + size_t(entries) * sizeof(MessageEntry);
  l.scales_off = l.payload_off + size_t(tokens) * row_bytes;
  l.bytes = l.scales_off + size_t(tokens) * scale_bytes;
  return l;
}

PushLayout PushLayout::of(int64_t cap_rows, size_t row_bytes, size_t scale_bytes, bool meta) {
  auto up = [](size_t b) { return (b + 63) / 64 * 64; };
  PushLayout l;
  l.cap_rows = cap_rows;
  l.row_bytes = row_bytes;
  l.scale_bytes = scale_bytes;
  l.meta = meta;
  const size_t rows = size_t(cap_rows);
  l.scales_off = up(rows * row_bytes);
  l.prob_off = up(l.scales_off + rows * scale_bytes);
  const size_t meta_bytes = meta ? rows * 4 : 0;
  l.src_rank_off = up(l.prob_off + meta_bytes);
  l.src_token_off = up(l.src_rank_off + meta_bytes);
  l.bytes = std::max<size_t>(64, up(l.src_token_off + meta_bytes));
  return l;
}

size_t dtype_row_bytes(DType dt, int64_t hidden) { return size_t(hidden) * dtype_size(dt); }
size_t scale_row_bytes(DType dt, int64_t hidden) {
  return dt == DType::kFP8 ? size_t(hidden / kFp8BlockSize) * sizeof(float) : 0;
}

}  // namespace flex
}  // namespace moed
