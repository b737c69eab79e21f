// Flex internals shared by the phase files: the topology, what notify learns (the same on
// every rank), the handle (home-side send plan, forwarder plan, expert-side layout), the
// node-shared regions and the two engines every step is built from:
//   - push (dispatch, and the backward of combine): home rows written straight into their
//     canonical rows on the expert ranks; remote nodes through one forwarder each;
//   - pull (combine, and the backward of dispatch): each home token's expert terms read back
//     and folded in the fixed order of design.md §4.1; remote nodes send per-expert terms.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <type_traits>
#include <vector>

#include "core/row_kernels.h"
#include "dispatch/prepare.h"
#include "dispatch/scratch.h"
#include "moed/combine_recipe.h"
#include "moed/dispatch_layout.h"
#include "moed/dispatcher.h"
#include "moed/flex.h"
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

// The wire format of one dispatch message (source -> forwarder): headers, then the expert
// entries, then the payload rows, then the fp8 scales.
struct MessageHeader {
  int32_t src_token;
  int32_t num_entries;
  uint64_t rank_mask;  // local ranks of the destination node that need the token
  ChainLink chain;     // the destination node's place in the token's combine chain
};
struct MessageEntry {
  int32_t expert;
  float prob;
  int32_t slot;  // the entry's top-k column at its source (-1: none)
};
static_assert(sizeof(MessageHeader) == kFlexTokenHeaderBytes &&
              sizeof(MessageEntry) == kFlexEntryBytes);
struct MessageLayout {
  size_t entries_off = 0, payload_off = 0, scales_off = 0, bytes = 0;
  static MessageLayout of(int64_t tokens, int64_t entries, size_t row_bytes, size_t scale_bytes);
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

// A node-shared region that grows collectively. Every local rank computes the same `bytes`
// from the same global counts, so growth needs no extra agreement.
//
// NOTE: a replaced buffer is kept (retired) until release_retired(), which the owner calls
// once nothing can read it, at the same point of the same step on every local rank: freeing is
// local, and one fixed point is the simplest rule that no peer is still reading.
class Region {
 public:
  Status ensure(World& world, size_t bytes);
  void release_retired() { retired_.clear(); }
  const std::shared_ptr<SharedBuffer>& buffer() const { return buffer_; }
  char* local() const { return static_cast<char*>(buffer_->local()); }
  char* peer(int lr) const { return static_cast<char*>(buffer_->peer(lr)); }

 private:
  std::shared_ptr<SharedBuffer> buffer_;
  std::vector<std::shared_ptr<SharedBuffer>> retired_;
};

// Dispatch outputs live in a ring of node-shared regions (Flex's expert-major output and the
// rank-major receive in worlds without one address space). A slot is held while any copy of
// an output's storage made from it is alive on any local rank; the next dispatch writes into
// the lowest slot no local rank holds (every rank's held mask travels in the dispatch's first
// collective), adding a slot when all are held. So an output never changes while its caller
// holds it.
class OutputRing {
 public:
  static constexpr int kMaxSlots = 64;  // one bit each in the agreement's held mask

  // Slots whose output this rank's caller still holds (bit i = slot i).
  uint64_t held_mask() const;
  // From every rank's held mask (held_of(r), r < R): the lowest slot free on this node, a new
  // one when every slot is held; the same answer on every local rank. A node whose ring is
  // full is every rank's error (`who` names the dispatcher).
  StatusOr<int> pick(const Topology& topo, const std::function<uint64_t(int)>& held_of,
                     const char* who);
  Region& region(int slot) { return slots_[size_t(slot)]->region; }
  // What an output's storage holds: the slot's token (so the slot counts as held) and the
  // buffer itself (freed locally with its last owner), so an output may outlive the dispatcher.
  std::shared_ptr<void> hold(int slot) const;
  int size() const { return int(slots_.size()); }

 private:
  struct Slot {
    Region region;
    std::shared_ptr<int> token = std::make_shared<int>(0);
  };
  std::vector<std::unique_ptr<Slot>> slots_;
};

// Per-pair completion signals with an epoch (one counter per ordered pair of local ranks).
// NOTE: each op starts with a collective (notify or an agreement), so every rank has left
// the previous op before anyone writes into its memory; the signals then only order the
// writes (or publications) of this op, pair by pair, with no global barrier.
class Signals {
 public:
  Status init(World& world);
  void signal_all(uint64_t epoch);
  Status wait_all(uint64_t epoch);
  // A small per-rank board in node-shared memory for publishing addresses (threads world).
  void* board(int lr) const { return buffer_->peer(lr); }

 private:
  friend class PublishRound;
  std::shared_ptr<SharedBuffer> buffer_;
};

// The two rounds of a step in which the local ranks read or write each other's memory where it
// is (in place: the threads world, addresses on the board), or a node-shared region (else).
// open() tells the node this rank's memory is published and waits until every local rank's is;
// close() tells the node this rank is done with theirs and waits until they are done with its
// own. Takes two epochs whichever way the step ends, so the ranks stay in step.
//
// NOTE: in place, the caller may free its memory once the step returns, so close() waits for
// every local rank that published, through a failed world too (bounded by the timeout); a rank
// leaving with an error fails the world before it looks, so that a rank which has not opened yet
// sees the failure at the end of its open() and never touches this rank's memory (a store, a
// fence and a load on each side: one of the two sees the other). The destructor closes a round
// left open on an error path.
//
// Not in place, a reader (kReads: the peers read its published region) releases even after an
// error, so no peer waits for it in vain; a writer's release (kWrites) says that its writes
// into the peers' memory are done, so after an error it sends none and the peers wait until
// they see the failure.
class PublishRound {
 public:
  enum class Role { kReads, kWrites };
  PublishRound(World& world, Signals& signals, uint64_t& epoch, bool in_place, Role role);
  PublishRound(const PublishRound&) = delete;
  PublishRound& operator=(const PublishRound&) = delete;
  ~PublishRound();
  Status open();
  // `step`: how the step went; an error fails the world first (in place).
  Status close(const Status& step = Status());

 private:
  World& world_;
  Signals& signals_;
  const uint64_t published_, released_;  // the round's two epochs
  const bool in_place_;
  const Role role_;
  bool closed_ = false;
};

// In place: opens `round` with this rank's `mine` posted on its board (local rank `local_rank`),
// then reads every local rank's into `all` [ranks per node]. A failed open closes the round.
template <typename T>
Status open_with_board(PublishRound& round, Signals& signals, int local_rank, const T& mine,
                       std::vector<T>& all) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 64,
                "the signal board holds one T per rank");
  std::memcpy(signals.board(local_rank), &mine, sizeof(T));
  Status opened = round.open();
  if (!opened.ok()) return round.close(opened);
  for (size_t lr = 0; lr < all.size(); ++lr) {
    std::memcpy(&all[lr], signals.board(int(lr)), sizeof(T));
  }
  return ok_status();
}

// ---- row kernels: thin names over core's one table (core/row_kernels.h) ----
// acc[i] = acc[i] + (0 + float(src[i]))     (weighted: acc[i] + w * (0 + float(src[i])))
inline void add_term_raw(float* acc, const void* src, DType dt, bool weighted, float w, int64_t n) {
  const internal::RowKernels& k = internal::row_kernels();
  if (weighted) {
    k.add_term_weighted(acc, src, dt, w, size_t(n));
  } else {
    k.add_term(acc, src, dt, size_t(n));
  }
}
// term[i] = term[i] + float(src[i])
inline void accumulate_raw(float* term, const void* src, DType dt, int64_t n) {
  internal::row_kernels().accumulate(term, src, dt, size_t(n));
}
// acc[i] = acc[i] + term[i]   (weighted: acc[i] + w * term[i])
inline void add_term_f32(float* acc, const float* term, bool weighted, float w, int64_t n) {
  const internal::RowKernels& k = internal::row_kernels();
  if (weighted) {
    k.accumulate_weighted(acc, term, DType::kF32, w, size_t(n));
  } else {
    k.accumulate(acc, term, DType::kF32, size_t(n));
  }
}
// dst = round(w * float(src)) in dt
inline void scale_row(void* dst, const void* src, DType dt, float w, int64_t n) {
  internal::row_kernels().scale(dst, src, dt, w, size_t(n));
}
// f32 acc -> dt (bf16: round to nearest even)
inline void store_row(void* dst, const float* acc, DType dt, int64_t n) {
  internal::row_kernels().store(acc, dst, dt, size_t(n));
}
// d = 0; for h ascending: d += float(g[h]) * term[h]
inline float dot_row(const void* g, DType dt, const float* term, int64_t n) {
  const void* t = term;
  float d;
  internal::row_kernels().dot(&g, dt, &t, DType::kF32, 1, size_t(n), &d);
  return d;
}

// ---- engines ----
// Bytes of one network message, inside a NetScratch.
struct Bytes {
  char* ptr = nullptr;
  size_t bytes = 0;
  char* data() const { return ptr; }
  size_t size() const { return bytes; }
  bool empty() const { return bytes == 0; }
};
// The network messages of one kind of step, kept between calls: per remote node one send and
// one receive buffer that only grow (contents unspecified), so a step allocates (and
// page-faults) its messages once, not on every call. Each step kind has its own, so steps in
// flight at once never share one.
class NetScratch {
 public:
  Bytes send(int node, size_t bytes) { return at(send_, node, bytes); }
  Bytes recv(int node, size_t bytes) { return at(recv_, node, bytes); }
  // The chain messages of the node-reduced combine (in flight with the terms' messages).
  Bytes chain_send(int node, size_t bytes) { return at(chain_send_, node, bytes); }
  Bytes chain_recv(int node, size_t bytes) { return at(chain_recv_, node, bytes); }

 private:
  static Bytes at(std::vector<ScratchBuffer>& v, int node, size_t bytes);
  std::vector<ScratchBuffer> send_, recv_, chain_send_, chain_recv_;
};

struct DispatchContext {
  World* world;
  const DispatchConfig* config;
  const FlexHandle* handle;  // forwarder plans may be filled in by the push (uncached mode)
  std::vector<ForwardPlan>* forward_out = nullptr;  // non-null: scan headers into these
  NetScratch* net = nullptr;                        // the step's message buffers
};

// What the push writes: home rows (x with scales, or grad_out) into a target region.
struct PushSpec {
  TokenRows rows;
  bool scale_by_prob = false;  // combine backward with weighted combine
  Region* target = nullptr;
  PushLayout layout;
};
// Local node: each channel writes its tokens' rows into the local ranks' segments; the
// owner zeroes its own padding rows. Adds shared bytes/rows to the world's counters.
void push_local(const DispatchContext& ctx, const PushSpec& spec);
void zero_padding_rows(const DispatchContext& ctx, const PushSpec& spec);
// Writes output rows into a segment of the push target, for the local path and the
// forwarders alike: payload (copied, or scaled by the prob for the combine backward), scales,
// and in the forward dispatch the prob and source. Streamed payloads go out a few at a time
// side by side (internal::StreamBatch); finish() before the owners are signalled.
class RowWriter {
 public:
  explicit RowWriter(const PushSpec& spec) : spec_(spec), batch_(spec.layout.row_bytes) {}
  void write(char* segment, int64_t row, const void* payload, const void* scales, float prob,
             int32_t src_rank, int32_t src_token, int32_t src_slot);
  void finish();

 private:
  const PushSpec& spec_;
  internal::StreamBatch batch_;
};
// Remote nodes, in two halves so the local copies overlap the network: start posts the
// receives of the forwarder role and packs and sends this rank's tokens (one message per
// remote node); finish waits for the messages, places the forwarded rows into the local
// ranks' segments (filling ctx.forward_out from the headers in uncached mode) and waits for
// the sends.
struct RemoteOps {
  std::vector<Bytes> send_buffers;    // [N]
  std::vector<Bytes> recv_buffers;    // [N]
  std::vector<Request> sends, recvs;  // recvs[m]: from the source on node m
};
StatusOr<RemoteOps> push_remote_start(const DispatchContext& ctx, const PushSpec& spec, int tag);
Status push_remote_finish(const DispatchContext& ctx, const PushSpec& spec, RemoteOps& ops);

// Pull sources: each local rank's rows in the dispatch layout (f32 or bf16) and an optional
// per-row scalar (grad of permuted_probs), readable by every local rank.
struct PullSource {
  const char* rows = nullptr;
  size_t row_stride_bytes = 0;
  const float* scalars = nullptr;  // may be null
};
enum class PullMode { kCombine, kDispatchBackward, kProbGrad };
struct PullSpec {
  PullMode mode = PullMode::kCombine;
  DType dtype = DType::kF32;        // of the source rows
  std::vector<PullSource> sources;  // [G]
  bool weighted = false;            // kCombine
  bool with_scalars = false;        // kDispatchBackward with grad_permuted_probs
  TensorView out;                   // kCombine / kDispatchBackward: [T, H] in dtype
  TensorView grad_out;              // kProbGrad: home gradient [T, H]
  float* out_probs = nullptr;       // [T, E] (kDispatchBackward, kProbGrad)
  // kCombine in DeepEP V2's order instead of design.md §4.1's (ElasticBuffer; P = 1, no chain):
  // each token's sum starts from bias_0 + bias_1 (when given) and folds its terms by *recipe at
  // their top-k slots (routing.slot); with_scalars: each term's row scalar lands in
  // out_slot_weights[t * num_topk + slot] ([T, K], zeros elsewhere).
  const CombineRecipe* recipe = nullptr;
  TensorView bias_0, bias_1;
  float* out_slot_weights = nullptr;
  int num_topk = 0;
};
// Forwarder role: terms of the remote homes' tokens from this node, one message per home.
// Home role: receive those, fold each token's terms in ascending expert order.
Status pull(const DispatchContext& ctx, const PullSpec& spec, int tag);

// The network half of pull: the home role's receives (one per remote node) and the
// forwarder role's terms, packed from the local sources and sent to each remote home.
struct PullRemote {
  std::vector<Bytes> recv_buffers;  // [N]: pieces from node m, in entry order
  std::vector<Bytes> send_buffers;
  std::vector<Request> recvs, sends;
  size_t piece_bytes = 0;  // a raw row (P = 1) or an fp32 term (P > 1)
};
StatusOr<PullRemote> pull_remote_start(const DispatchContext& ctx, const PullSpec& spec, int tag);

// The chain half of pull (chain_combine.cc), for the steps that chain: kCombine, and
// kDispatchBackward without prob gradients (kProbGrad needs every expert's term; the prob
// gradients of the dispatch backward are per expert). Tokens whose SendPlan::chain / ForwardPlan
// chain bit of chain_class(spec.dtype, P) is set take it; the others ship per-expert terms.
// chain_start posts this rank's chain receives, waits for those from lower nodes (all that its
// turns read), runs its turns (its own tokens where its node holds experts, and the forwarded
// tokens: fp32 sum continued over this node's experts ascending) and sends the partials on, one
// message per next node. chain_finish waits for the finished sums of this rank's tokens (from
// their last nodes), rounds them once into spec.out, and waits for the sends.
bool chain_enabled(const Topology& topo, const PullSpec& spec);
// One (home rank, token) this rank handles, in the order every message lists them: home rank
// ascending, then token ascending (sender and receiver enumerate the same pairs so).
struct ChainItem {
  int32_t home = 0, token = 0;
  int16_t prev = -1;  // node whose message holds the partial; -1: the sum starts here
  int16_t next = -1;  // node the partial goes to; -1: this rank is home and rounds it
  bool turn = true;   // false: only the rounded row arrives (home, from the last node)
  bool last = false;  // a turn that finishes the sum: rounds it (sends it to next, home)
  const ForwardPlan* plan = nullptr;  // forwarded token (its index in plan), or own token
  int64_t index = 0;
  // Row in the message from prev / to next, in its section: fp32 partials first, then rows
  // rounded by the last node (turn = false at the receiver, last = true at the sender).
  int64_t in_pos = 0, out_pos = 0;
};
struct ChainOps {
  std::vector<ChainItem> items;
  std::vector<Bytes> recv_buffers, send_buffers;     // [N]
  std::vector<size_t> recv_rows_off, send_rows_off;  // [N] where the rounded rows start
  std::vector<Request> recvs_low, recvs_high, sends;
};
StatusOr<ChainOps> chain_start(const DispatchContext& ctx, const PullSpec& spec, int tag);
Status chain_finish(const DispatchContext& ctx, const PullSpec& spec, ChainOps& ops);

// Phase 2, notify: the one count exchange (collective), then every rank's layout, the send
// plan and the handle. Errors (num_worst_tokens exceeded) are the same on every rank.
StatusOr<std::shared_ptr<FlexHandle>> notify(World& world, const DispatchConfig& config,
                                             PreparedInput input, uint64_t dispatcher_id);
// notify in two halves, for a caller that carries more in the same exchange (the Flex
// dispatcher folds its agreement into it, steps.h): notify_local makes the handle's home side
// (send plan; takes input.effective, sparse, as the handle's routing) and this rank's row of the
// exchange (notify_row_width(topo) int64); notify_finish reads every rank's row (rank r's at
// table[r * stride + offset]) into the GlobalInfo and the expert-side fields.
inline size_t notify_row_width(const Topology& topo) {
  return 2 + size_t(topo.num_experts) + size_t(topo.num_nodes);
}
std::shared_ptr<FlexHandle> notify_local(World& world, const DispatchConfig& config,
                                         PreparedInput input, uint64_t dispatcher_id,
                                         std::vector<int64_t>* row);
Status notify_finish(const DispatchConfig& config, FlexHandle& h, std::span<const int64_t> table,
                     size_t stride, size_t offset);

size_t dtype_row_bytes(DType dt, int64_t hidden);
size_t scale_row_bytes(DType dt, int64_t hidden);

}  // namespace moed::flex
