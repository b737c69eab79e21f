// Internal state of a LowLatencyBuffer, shared by its phase files:
//   buffer.cc            creation, the segment layout, the size hint
//   dispatch.cc          low_latency_dispatch: the push (below), or the segments in shrink mode
//   segment_dispatch.cc  a dispatch through the node-shared segments (segment_peers.h), and
//   segment_combine.cc   every combine: in-node rows from the segments, or in place
//   combine.cc           low_latency_combine: its checks and opening agreement
//
// A dispatch outside shrink mode pushes: its opening agreement gathers every rank's counts per
// expert (so every sender knows where its rows go in each receiver's packed layout) and which
// of the node's receive blocks are free; each sender then writes every row once, straight into
// its in-node receiver's block (a slot of the node-shared OutputRing, held by the output), and
// signals it; other nodes' rows come as one message per rank, placed by the receiver.
//
// Segment of every rank (node-shared, `SegmentLayout`), written only by its rank, per half h:
//   counts[h][e]     uint64: the rows this rank sends to expert e (in-node receivers read it)
//   slots[h]         shrink mode: [E * M] rows (slot_block: payloads, FP8 scales, source
//                    tokens, probs); slot e * M + i is this rank's row i for expert e. The
//                    receiver packs expert j's rows to row j * R * M + begin(j, s) + i of its
//                    receive block. Shrink mode pulls so: a peer it masks may still be writing,
//                    and a pushed row could then land in a block already handed to the caller.
//   combine_y[h]     [L * R * M]: this rank's expert outputs for in-node homes, packed as x
//   ranges[h] [L][R] this rank's dispatch layout, for the combine's in-node homes
//   words     the sequence words and the mask (segment_peers.h)
//
// In-place combine (the threads world, where every rank's memory is readable by its node;
// calls without a receive hook): an expert rank's outputs are not copied into its segment; the
// call's opening collective gathers where every rank's rows are (InPlaceRows) and the home
// reduces them where they are. The call then closes a round of Flex's (flex::PublishRound), on
// every way out, error or not: it returns only once no local rank reads its rows any more,
// even when another rank has failed. With a hook the combine goes through the segments, so
// that its rows are free once the send phase returns (DeepEP's contract), whenever the peers
// run their hooks.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "comm/tags.h"
#include "core/row_kernels.h"
#include "dispatch/flex/buffers.h"
#include "moed/low_latency.h"
#include "moed/tensor.h"
#include "moed/world.h"

namespace moed {

namespace low_latency {

// Where a block of rows keeps them (a receive block, shrink mode's dispatch slots): the
// payloads (bf16, or FP8 at half the stride: the call's RowFormat), then their FP8 scales,
// source tokens and probs, each a region of its own.
struct BlockLayout {
  size_t x = 0, scales = 0, src = 0, prob = 0, bytes = 0;
  static BlockLayout of(int64_t rows, int hidden, int num_scales);
};

// Every region starts on 64 bytes (dispatch/sections.h).
struct SegmentLayout {
  int64_t max_tokens = 0;     // M
  int hidden = 0;             // H
  int num_ranks = 0;          // R
  int num_experts = 0;        // E
  int num_local_experts = 0;  // L
  int num_scales = 0;         // H / 128 (0 when H is not a multiple of 128: no FP8)
  size_t counts[2] = {0, 0};
  BlockLayout slot_block;  // shrink mode's dispatch slots, [E * M] rows (none outside it)
  size_t slots[2] = {0, 0};
  size_t combine_y[2] = {0, 0};
  // The segment protocol (segment_peers.h): this rank's words (SegmentWord) and its mask [R],
  // uint64 each; this rank's dispatch layout [L][R] (LowLatencyRange) for the combine.
  size_t words = 0;
  size_t ranges[2] = {0, 0};
  size_t total = 0;

  // Shrink mode's dispatch slots only with `shrink` (a push needs none).
  static SegmentLayout make(int64_t max_tokens, int hidden, int num_ranks, int num_experts,
                            bool shrink);
  int64_t rows_per_expert() const { return int64_t(num_ranks) * max_tokens; }
};

// One dispatched row's bytes: its payload (bf16 or FP8 hidden), then its FP8 scales (none in
// bf16), as x's rows are cast (cast_fp8_rows) and as the slots and messages hold them.
struct RowFormat {
  size_t payload = 0, scale_bytes = 0;
  static RowFormat of(const SegmentLayout& lay, bool fp8) {
    return fp8 ? RowFormat{size_t(lay.hidden), size_t(lay.num_scales) * sizeof(float)}
               : RowFormat{size_t(lay.hidden) * sizeof(bf16), 0};
  }
  size_t row_bytes() const { return payload + scale_bytes; }  // a cast row: payload + scales
};

// As Flex's dispatch (flex/layout.cc), a large copy is written with non-temporal stores, which
// skip reading the destination lines first; "large" counts the node's ranks, which copy alike
// at once into one last-level cache (FP8 at decode, 7 MB a rank, R = 4).
inline bool stream_node_copy(const World& w, size_t bytes_per_rank) {
  return bytes_per_rank * size_t(w.ranks_per_node()) >= internal::kStreamThresholdBytes;
}

// What an in-node home reads in place from an expert rank in an in-place combine, published
// by the call's opening collective.
struct InPlaceRows {
  const std::byte* rows = nullptr;          // the expert outputs
  size_t stride = 0;                        // bytes from one row to the next
  const LowLatencyRange* ranges = nullptr;  // [L][R] this rank's dispatch layout
};
enum class CallKind : int { kDispatch = 0, kCombine = 1 };

// The words of a rank's words region (segment_peers.h says what each means), per
// (kind, half) where they have one; the mask [R] follows at kMask.
enum SegmentWord : size_t {
  kSent = 0,
  kVerdict = 4,
  kDone = 8,
  kCleaned = 12,
  kWaitUntil = 13,
  kMask = 14
};
inline constexpr size_t kWords = kMask;
inline size_t word_index(SegmentWord w, CallKind k, int half) {
  return size_t(w) + size_t(k) * 2 + size_t(half);
}

// Memory a dispatch receives into and its output views (LowLatencyDispatchOutput::storage):
// the caller's while any copy of the output's storage is held. A push receives into a slot of
// the node's OutputRing, which the block holds; a shrink-mode receive into memory of its own,
// which its half takes again for the dispatch two later only when nobody else holds it
// (take_receive_block).
struct ReceiveBlock {
  std::byte* base = nullptr;  // BlockLayout
  BlockLayout lay;
  bool fp8 = false;
  std::vector<int32_t> recv_count;            // [L]
  std::vector<LowLatencyRange> layout_range;  // [L * R]
  std::shared_ptr<void> memory;               // what base points into

  std::byte* x() const { return base + lay.x; }
  std::byte* scales() const { return base + lay.scales; }
  int32_t* src() const { return reinterpret_cast<int32_t*>(base + lay.src); }
  float* prob() const { return reinterpret_cast<float*>(base + lay.prob); }
};

// A dispatch's header to a rank on another node (segment_peers.h): [verdict, L counts, tokens],
// int32 each: the rows for each of its local experts and the tokens that carry them
// (dispatch_rows.h, NetPlan).
inline size_t header_ints(int num_local_experts) { return size_t(num_local_experts) + 2; }

// What a dispatch half keeps between its send and receive phases.
struct DispatchHalf {
  bool pending = false;  // send phase done, receive not yet
  std::shared_ptr<ReceiveBlock> received;  // shrink mode: this half's last receive
  // Network: headers from every source (counts per local expert), the rows received from
  // other nodes, and what this rank sends to other nodes (kept until the receive completes;
  // a push without a hook writes only the headers and entries there, its sends gather the rows).
  std::vector<int32_t> recv_header;  // [R][verdict, L counts, tokens]
  std::vector<std::byte> net_recv;
  std::vector<int32_t> send_header;  // [R][verdict, L counts, tokens]
  std::vector<std::byte> net_send;
  std::vector<Request> header_requests;  // [R] header receives of this op
  std::vector<Request> send_requests;    // this op's sends
  std::vector<int> send_peers;           // the rank of each send
  std::vector<std::byte> fp8_rows;       // [T] FP8 rows + scales, cast once per token
  // A push: every source's count for this rank's experts ([R][L]), from the opening agreement.
  std::vector<int32_t> agreed_count;
  Status local_check;  // segment calls: the call's verdict (this rank's input check)
};

struct CombineHalf {
  bool pending = false;
  Status local_check;  // segment calls: this rank's input check
  // Network (segment_peers.h, post_combine_messages): [R] blocks from other nodes' experts
  // (verdict, then rows), where each starts, the verdicts' receives [R] and the rows' (with
  // their ranks); to other nodes' homes: the verdicts, rows staged where they must be, and the
  // sends (with their ranks).
  std::vector<std::byte> net_recv;
  std::vector<size_t> net_block;
  std::vector<Request> recvs;
  std::vector<Request> row_recvs;
  std::vector<int> row_peers;
  std::vector<uint64_t> verdicts;
  std::vector<std::byte> net_send;
  std::vector<Request> requests;
  std::vector<int> send_peers;
};

}  // namespace low_latency

struct LowLatencyBuffer::State {
  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  // Drops the halves' requests first: a combine's pending sends gather rows from the receive
  // ring (its x is often a dispatch's recv_x), and a peer may match them until they are gone.
  ~State();

  World* world = nullptr;
  uint64_t id = 0;
  low_latency::SegmentLayout layout;
  low_latency::BlockLayout block_layout;  // of every dispatch's receive block
  std::shared_ptr<SharedBuffer> shared;
  bool in_place = false;  // in-node peers read each other's memory (World::shares_address_space)
  // Shrink mode (segment_peers.h): no collectives in the calls; a peer that misses a call's
  // deadline is masked. `removed`: a peer masked this rank; every later call returns it.
  bool shrink = false;
  std::chrono::milliseconds shrink_timeout{0};
  Status removed;
  uint64_t cleans = 0;
  // Every rank runs the same sequence of calls, so these agree across ranks.
  uint64_t seq = 0;  // operations started (dispatch and combine), 1-based tags
  uint64_t dispatches = 0;
  uint64_t combines = 0;
  low_latency::DispatchHalf dispatch_half[2];
  low_latency::CombineHalf combine_half[2];
  // A push (outside shrink mode): the node's receive blocks, and the signal each sender gives
  // each in-node receiver once its rows of dispatch n are written (epoch n).
  flex::Topology topo;
  flex::OutputRing recv_ring;
  flex::Signals dispatch_signals;
  // In-place combines: the rounds that keep each rank's rows until its node has read them.
  flex::Signals combine_signals;
  uint64_t combine_epoch = 0;

  std::byte* segment(int local_rank) const {
    return static_cast<std::byte*>(shared->peer(local_rank));
  }
  std::byte* local() const { return static_cast<std::byte*>(shared->local()); }
  std::atomic<uint64_t>* counts(int local_rank, int half) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(segment(local_rank) + layout.counts[half]);
  }
  int local_of(int rank) const { return rank % world->ranks_per_node(); }
  // Word `index` of local rank `local_rank`'s words (segment_peers.h).
  std::atomic<uint64_t>* segment_word(int local_rank, size_t index) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(segment(local_rank) + layout.words) + index;
  }
};

namespace low_latency {

// Shrink mode: the block a dispatch of `half` receives into: the half's last one when no output
// holds it any more, else a fresh one (Tensor's block cache makes that cheap in a steady loop).
// Its views are handed out at once; the receive fills them.
std::shared_ptr<ReceiveBlock> take_receive_block(LowLatencyBuffer::State& st, int half, bool fp8);
// A push: the block in ring slot `slot` of this rank, held by the block.
std::shared_ptr<ReceiveBlock> ring_receive_block(LowLatencyBuffer::State& st, int slot, bool fp8);
// The output's views of `block` and the storage that holds them.
void view_receive_block(const LowLatencyBuffer::State& st, std::shared_ptr<ReceiveBlock> block,
                        LowLatencyDispatchOutput& out);

}  // namespace low_latency

}  // namespace moed
