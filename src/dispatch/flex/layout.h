// What notify learns (the same on every rank), the plans and the handle made from it, and the
// region layouts the rows are pushed into (layout.cc); the wire layout is message.h's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "dispatch/flex/message.h"
#include "dispatch/flex/topology.h"
#include "dispatch/prepare.h"
#include "moed/dispatch_layout.h"
#include "moed/dispatcher.h"
#include "moed/flex.h"

namespace moed::flex {

// What notify exchanges: every rank's counts, so every rank can compute every rank's
// canonical layout and every message size without asking again.
struct GlobalInfo {
  int num_ranks = 0;
  int num_experts = 0;
  int num_nodes = 0;
  std::vector<int64_t> num_tokens;       // [R]
  std::vector<int64_t> capacity;         // [R] C_s (0 without capacity_factor)
  std::vector<int64_t> counts;           // [R * E] rows source s sends to expert e
  std::vector<int64_t> tokens_per_node;  // [R * N] tokens of s that node m needs
  std::vector<ExpertLayout> layouts;     // [EP] canonical layout of the ranks of each ep
  std::vector<int64_t> exact_rows;       // [R] rows of each rank's canonical layout

  int64_t count(int s, int e) const { return counts[size_t(s) * num_experts + e]; }
  int64_t node_tokens(int s, int m) const { return tokens_per_node[size_t(s) * num_nodes + m]; }
  // (token, expert) pairs of source s whose expert lives on node m.
  int64_t node_entries(const Topology& topo, int s, int m) const;
};

// Home side: the channel split and the per-channel prefix matrices (DeepEP's
// channel_prefix_matrix), so each channel writes disjoint rows with no sort.
struct SendPlan {
  int num_channels = 0;
  std::vector<int64_t> channel_begin;  // [C + 1] token ranges
  std::vector<int64_t> expert_prefix;  // [C * E] rows for e in earlier channels
  std::vector<int64_t> node_tokens;    // [(C + 1) * N] prefix of tokens needing node m
  std::vector<int64_t> node_entries;   // [(C + 1) * N] prefix of (t, e on m) pairs
  // The node-reduced combine: bit c of chain[t] set when token t chains in class c, and the
  // prefix of the (t, e on m) pairs of the tokens that do not (the per-expert terms left).
  std::vector<uint8_t> chain;                        // [T]
  std::vector<int64_t> term_entries[kChainClasses];  // [(C + 1) * N]
};

// Forwarder side: what one remote source sent this rank to place into its node.
struct ForwardPlan {
  int src = 0;
  int64_t num_tokens = 0;
  int64_t num_entries = 0;
  std::vector<int32_t> src_token;     // [n]
  std::vector<int64_t> entry_begin;   // [n + 1]
  std::vector<int32_t> entry_expert;  // [q]
  std::vector<float> entry_prob;      // [q]
  std::vector<int32_t> entry_slot;    // [q] the entry's top-k column at its source (or -1)
  std::vector<int64_t> entry_row;     // [q] canonical row on every rank of the expert
  std::vector<ChainLink> chain;       // [n] this node's place in each token's combine chain
};

class FlexHandle final : public DispatchHandle {
 public:
  uint64_t dispatcher_id = 0;
  Topology topo;
  std::shared_ptr<const GlobalInfo> global;
  SendPlan send;
  std::vector<ForwardPlan> forward;  // one per other node (sources with my local index)
  int64_t exact_rows = 0;            // rows before num_worst_tokens padding
  int64_t worst_rows = 0;            // num_rows of every rank's output (max with worst)

  // Row of (source s, local expert j) chunk on the ranks of expert e's ep.
  const ExpertLayout& layout_of_expert(int e) const {
    return global->layouts[size_t(topo.ep_of_expert(e))];
  }
};

// Sections of a push target segment (the dispatch output, or the combine-backward rows).
struct PushLayout {
  int64_t cap_rows = 0;
  size_t row_bytes = 0, scale_bytes = 0;
  bool meta = false;  // probs, source indices and top-k slots travel too (forward dispatch)
  // Rows written with non-temporal stores (segments of kStreamThresholdBytes and up): no
  // read of the destination; writers stream_fence() before they signal.
  bool stream = false;
  size_t scales_off = 0, prob_off = 0, src_rank_off = 0, src_token_off = 0, src_slot_off = 0;
  size_t bytes = 0;
  // Bytes of one row's metadata (prob, source rank, token, slot) when meta.
  static constexpr size_t kMetaBytes = kFlexRowMetaBytes;
  static PushLayout of(int64_t cap_rows, size_t row_bytes, size_t scale_bytes, bool meta);
};

size_t dtype_row_bytes(DType dt, int64_t hidden);
size_t scale_row_bytes(DType dt, int64_t hidden);

}  // namespace moed::flex
