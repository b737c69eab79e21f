// Flex's rank arithmetic (ranks, nodes, experts and their expert-parallel groups), the chain
// of the node-reduced combine, and the channel split of a rank's tokens.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moed/dispatcher.h"
#include "moed/dtype.h"
#include "moed/world.h"

namespace moed::flex {

// Rank arithmetic. With several nodes an expert's P ranks must sit in one node (G % P == 0,
// checked at creation), so "the node of expert e" is well defined.
struct Topology {
  int num_ranks = 0;          // R
  int ranks_per_node = 0;     // G
  int num_nodes = 0;          // N
  int etp_size = 1;           // P
  int num_experts = 0;        // E
  int num_local_experts = 0;  // L
  int rank = 0;
  int node = 0;
  int local_rank = 0;

  static Topology of(const World& world, const DispatchConfig& config);
  int ep_of_expert(int e) const { return e / num_local_experts; }
  int first_rank_of_expert(int e) const { return ep_of_expert(e) * etp_size; }
  int node_of_rank(int g) const { return g / ranks_per_node; }
  int node_of_expert(int e) const { return node_of_rank(first_rank_of_expert(e)); }
  // The rank of `node` with this rank's local index: where this rank's tokens for `node` go.
  int forwarder_on(int n) const { return n * ranks_per_node + local_rank; }
};

// ---- the node-reduced combine (design.md §5.6): a chain per token over its nodes ascending ----
// A token's combine either ships per-expert terms to its home (the pull below), or chains: the
// lowest node holding its experts starts the fp32 running sum over them (ascending), sends the
// fp32 partial to the next such node, which continues the same sum, and the last one rounds it
// (once, as the home would) and sends the rounded row home. Per token, whichever crosses the
// network in fewer bytes. That depends on the sizes of a term and of an output row, so there
// are three classes (chain_class): 0, bf16 rows with P = 1 (a term is a 2H-byte row, the output
// row 2H); 1, f32 rows (4H, 4H); 2, bf16 rows with P > 1 (a term is the fp32 sum of the P
// partials, 4H; the output row 2H). An fp32 partial is 4H.
constexpr int kChainClasses = 3;
inline int chain_class(DType dt, int etp_size) {
  return dt != DType::kBF16 ? 1 : etp_size == 1 ? 0 : 2;
}
// The nodes holding a token's experts (ascending; experts are ascending) into *nodes, and the
// classes (bit c) in which the token chains, for a token of home node `home`.
uint32_t chain_classes(const Topology& topo, const int32_t* experts, int64_t k, int home,
                       std::vector<int>* nodes);
// Node m's place in a token's chain: where the partial comes from (-1: m starts it) and where
// it goes (the next node, or the home node when m is last: then it goes rounded). Sent in the
// dispatch header.
struct ChainLink {
  int16_t prev = -1;
  int16_t next = -1;
  uint8_t classes = 0;  // bit c: the token chains in class c
  uint8_t last = 0;     // m is the last node: it rounds and sends the row home
  uint16_t reserved = 0;
};
ChainLink chain_link(std::span<const int> nodes, uint32_t classes, int m, int home);

// The token ranges of C channels over T tokens (ThreadPool::split's): [C + 1] bounds.
inline std::vector<int64_t> channel_bounds(int64_t T, int C) {
  std::vector<int64_t> bounds(size_t(C) + 1, 0);
  for (int c = 0; c < C; ++c) {
    int64_t b, e;
    ThreadPool::split(T, C, c, &b, &e);
    bounds[size_t(c)] = b;
    bounds[size_t(c) + 1] = e;
  }
  return bounds;
}

// Per-channel counts [C * N] as prefixes over the channels: [(C + 1) * N], row c = the counts
// of channels 0..c-1 (so channel c writes from row c, and row C is the total).
inline std::vector<int64_t> channel_prefix(const std::vector<int64_t>& counts, int C, int N) {
  std::vector<int64_t> p(size_t(C + 1) * size_t(N), 0);
  for (int c = 0; c < C; ++c) {
    for (int m = 0; m < N; ++m) {
      const size_t i = size_t(c) * N + m;
      p[i + size_t(N)] = p[i] + counts[i];
    }
  }
  return p;
}

}  // namespace moed::flex
