// What notify leaves each rank, the plans and the handle made from it, and the
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

// What notify leaves this rank (design.md §5.2). Notify exchanges every rank's counts ([R x E]);
// a rank keeps of them only what its own sends, forwards and output need, so a handle holds
// O(E + L x R + R) integers however large R x E is.
struct Notified {
  ExpertLayout mine;                // this rank's canonical layout (design.md §3.1)
  std::vector<int64_t> rank_rows;   // [R] rows of each rank's canonical layout
  std::vector<int64_t> send_chunk;  // [E] first row of this rank's chunk on expert e's ranks
  // Per other node m, what this rank forwards from m's source forwarder_on(m) (its tokens and
  // (token, expert) pairs for this node), and where that source's chunk starts on each expert
  // of this node ([N * node_experts], node-major from expert first_node_expert).
  std::vector<int64_t> forward_tokens;   // [N]
  std::vector<int64_t> forward_entries;  // [N]
  std::vector<int64_t> forward_chunk;    // [N * node_experts]
  int first_node_expert = 0;
  int node_experts = 0;

  int64_t forward_chunk_of(int m, int e) const {
    return forward_chunk[size_t(m) * size_t(node_experts) + size_t(e - first_node_expert)];
  }
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
  Notified notified;
  SendPlan send;
  std::vector<ForwardPlan> forward;  // one per other node (sources with my local index)
  int64_t exact_rows = 0;            // rows before num_worst_tokens padding
  int64_t worst_rows = 0;            // num_rows of every rank's output (max with worst)
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
