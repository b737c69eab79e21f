// Flex's rank-major receive layout (DeepEP's normal mode, moed/deep_ep.h): the buffer's
// state, the layout of one rank's receive block and its two-hop messages. Built from
// Flex's pieces: the topology, node-shared regions and per-pair signals (flex/topology.h,
// flex/buffers.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "dispatch/flex/buffers.h"
#include "dispatch/flex/layout.h"
#include "dispatch/flex/topology.h"
#include "moed/deep_ep.h"

namespace moed::deep_ep {

// One receiving rank's block: rows, scales, then the per-row metadata DeepEP returns.
struct RecvLayout {
  int64_t cap_rows = 0;
  size_t row_bytes = 0, scale_bytes = 0;
  int num_topk = 0;  // 0: no top-k metadata (no top-k, or cached mode)
  int num_ranks = 0, num_channels = 0;
  size_t scales_off = 0, src_idx_off = 0, topk_idx_off = 0, weights_off = 0, rcpm_off = 0;
  size_t bytes = 0;
  static RecvLayout of(int64_t cap_rows, size_t row_bytes, size_t scale_bytes, int num_topk,
                       int num_ranks, int num_channels);
};

// Source -> forwarder messages are Flex's (flex::MessageLayout): per token a header (source
// token, mask of the node's ranks that receive it) and its K top-k entries (global expert, or
// -1, and weight; the slot is k), then the rows and scales, then the source's channel prefix
// rows for the G ranks of the node as the tail.
flex::MessageLayout rm_message(int64_t n, size_t row_bytes, size_t scale_bytes, int num_topk,
                               int ranks_per_node, int num_channels);

// topk's indices (validated against num_experts first) route token t only to ranks that
// is_token_in_rank [T, R] names for it; `exact`: to every rank it names, too. `what` and
// `layout` name the two in the error.
Status check_topk_in_layout(const TopkView& topk, std::span<const uint8_t> is_token_in_rank,
                            int num_experts, int num_ranks, bool exact, const char* what,
                            const char* layout);

// The home side's channel split, derived from is_token_in_rank by each call that needs it
// (O(T x R), small beside the rows).
struct RmSendPlan {
  int num_channels = 0;
  std::vector<int64_t> channel_begin;  // [C + 1]
  std::vector<int64_t> node_tokens;    // [(C + 1) * N] prefix: tokens needing node m
  std::vector<int64_t> node_pairs;     // [(C + 1) * N] prefix: (token, rank of m) pairs
};
RmSendPlan make_rm_send_plan(const flex::Topology& topo, const NormalHandle& h, ThreadPool& pool);

struct NormalBuffer::State {
  World* world = nullptr;
  int num_experts = 0;  // E of the call in progress
  int num_channels = 0;
  flex::Topology topo;
  bool in_place = false;  // threads world: every rank's memory is node-shared
  flex::Signals signals;
  // The receive blocks, a ring of regions kept across calls (recv_slot: this dispatch's); in
  // worlds without one address space (MPI, gloo) the combine's pull region too.
  flex::OutputRing recv_ring;
  int recv_slot = 0;
  flex::Region pull_region;
  // The messages to and from other nodes, kept between calls (dispatch and combine apart).
  flex::NetScratch dispatch_net, combine_net;
  uint64_t epoch = 0;

  // The handle's dispatch ran over this world with this channel split, so its arrays fit
  // this buffer (errors say which part does not).
  Status check_handle(const NormalHandle* h) const;
  // Rows of the largest receive block of this node's ranks (all local ranks agree on it).
  int64_t node_cap_rows(const NormalHandle& h, int64_t worst) const;
};

// Phases (rank_major_dispatch.cc / rank_major_combine.cc).
StatusOr<NormalDispatchOutput> rm_dispatch(NormalBuffer::State& s, const NormalDispatchInput& in,
                                           const Status& caller_error);
StatusOr<NormalCombineOutput> rm_combine(NormalBuffer::State& s, const NormalCombineInput& in,
                                         const Status& caller_error);
// The data movement of both dispatch modes (rank_major_push.cc): x's rows (its dtype and
// hidden size, the same on every rank), the top-k when topk.num_topk > 0, and with `plan`
// (uncached mode) the source indices and the receive channel prefix matrix, whose forwarder
// plans are then stored in h.
StatusOr<NormalDispatchOutput> rm_push(NormalBuffer::State& s, NormalHandle& h, const TokenRows& x,
                                       const TopkView& topk, bool with_plan,
                                       const std::optional<TensorView>& out_rows);

inline int popcount64(uint64_t m) { return __builtin_popcountll(m); }

}  // namespace moed::deep_ep
