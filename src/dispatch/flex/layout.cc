// Flex phase 1, layout (local, design.md §5.1): the rank arithmetic and wire/segment layouts the
// other phases share. The token -> experts lists they walk are the handle's sparse routing
// (moed/routing.h, made once by prepare_dispatch_input); the dispatch layout itself
// (DeepEP's get_dispatch_layout) is routing's (src/routing/dispatch_layout.cc); notify uses it.
#include <algorithm>

#include "core/row_kernels.h"
#include "dispatch/flex/layout.h"
#include "dispatch/sections.h"

namespace moed {

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

uint32_t chain_classes(const Topology& topo, const int32_t* experts, int64_t k, int home,
                       std::vector<int>* nodes) {
  nodes->clear();
  int64_t remote = 0;
  for (int64_t i = 0; i < k; ++i) {
    const int m = topo.node_of_expert(experts[i]);
    if (nodes->empty() || nodes->back() != m) nodes->push_back(m);
    if (m != home) ++remote;
  }
  if (nodes->empty()) return 0;
  // Network bytes (in units of H): the chain sends an fp32 partial between its nodes and a
  // rounded row from the last one home; the terms are one per remote expert.
  const int64_t inner = int64_t(nodes->size()) - 1, home_hop = nodes->back() != home ? 1 : 0;
  constexpr int64_t kTerm[kChainClasses] = {2, 4, 4}, kRow[kChainClasses] = {2, 4, 2};
  uint32_t classes = 0;
  for (int c = 0; c < kChainClasses; ++c) {
    if (4 * inner + kRow[c] * home_hop < kTerm[c] * remote) classes |= 1u << c;
  }
  return classes;
}

ChainLink chain_link(std::span<const int> nodes, uint32_t classes, int m, int home) {
  ChainLink l;
  l.classes = uint8_t(classes);
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i] != m) continue;
    l.prev = int16_t(i == 0 ? -1 : nodes[i - 1]);
    l.next = int16_t(i + 1 < nodes.size() ? nodes[i + 1] : home);
    l.last = i + 1 == nodes.size() ? 1 : 0;
    return l;
  }
  MOED_CHECK(false, "node ", m, " holds none of the token's experts");
  return l;
}

PushLayout PushLayout::of(int64_t cap_rows, size_t row_bytes, size_t scale_bytes, bool meta) {
  const size_t rows = size_t(cap_rows);
  PushLayout l{.cap_rows = cap_rows,
               .row_bytes = row_bytes,
               .scale_bytes = scale_bytes,
               .meta = meta,
               .stream = rows * row_bytes >= internal::kStreamThresholdBytes};
  const size_t meta_bytes = meta ? rows * 4 : 0;
  Sections s(64);
  s.add(rows * row_bytes);
  l.scales_off = s.add(rows * scale_bytes);
  l.prob_off = s.add(meta_bytes);
  l.src_rank_off = s.add(meta_bytes);
  l.src_token_off = s.add(meta_bytes);
  l.src_slot_off = s.add(meta_bytes);
  l.bytes = std::max<size_t>(64, s.aligned_end());
  return l;
}

size_t dtype_row_bytes(DType dt, int64_t hidden) { return size_t(hidden) * dtype_size(dt); }
size_t scale_row_bytes(DType dt, int64_t hidden) {
  return dt == DType::kFP8 ? size_t(hidden / kFp8BlockSize) * sizeof(float) : 0;
}

}  // namespace flex
}  // namespace moed
