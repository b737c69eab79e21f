// The two engines every Flex step is built from, and notify:
//   - push (dispatch, and the backward of combine): home rows written straight into their
//     canonical rows on the expert ranks; remote nodes through one forwarder each;
//   - pull (combine, and the backward of dispatch): each home token's expert terms read back
//     and folded in the fixed order of design.md §4.1; remote nodes send per-expert terms.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/row_kernels.h"
#include "dispatch/flex/buffers.h"
#include "dispatch/flex/layout.h"
#include "dispatch/prepare.h"
#include "moed/combine_recipe.h"

namespace moed::flex {

// ---- the weighted choice over core's row kernels (core/row_kernels.h) ----
// acc[i] = acc[i] + (0 + float(src[i]))     (weighted: acc[i] + w * (0 + float(src[i])))
inline void add_term_raw(float* acc, const void* src, DType dt, bool weighted, float w, int64_t n) {
  const internal::RowKernels& k = internal::row_kernels();
  if (weighted) {
    k.add_term_weighted(acc, src, dt, w, size_t(n));
  } else {
    k.add_term(acc, src, dt, size_t(n));
  }
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

// ---- engines ----
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
// and in the forward dispatch the prob and source. finish() before the owners are signalled.
class RowWriter {
 public:
  explicit RowWriter(const PushSpec& spec)
      : spec_(spec), copier_(spec.layout.row_bytes, spec.layout.stream) {}
  void write(char* segment, int64_t row, const void* payload, const void* scales, float prob,
             int32_t src_rank, int32_t src_token, int32_t src_slot);
  void finish() { copier_.finish(); }

 private:
  const PushSpec& spec_;
  internal::RowCopier copier_;
};
// Remote nodes, in two halves so the local copies overlap the network: start posts the
// receives of the forwarder role and packs and sends this rank's tokens (one message per
// remote node); finish waits for the messages, places the forwarded rows into the local
// ranks' segments (filling ctx.forward_out from the headers in uncached mode) and waits for
// the sends.
struct RemoteOps {
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
// table[r * stride + offset]) into what this rank keeps of them (Notified) and the
// expert-side fields.
inline size_t notify_row_width(const Topology& topo) {
  return 2 + size_t(topo.num_experts) + size_t(topo.num_nodes);
}
std::shared_ptr<FlexHandle> notify_local(World& world, const DispatchConfig& config,
                                         PreparedInput input, uint64_t dispatcher_id,
                                         std::vector<int64_t>* row);
Status notify_finish(const DispatchConfig& config, FlexHandle& h, std::span<const int64_t> table,
                     size_t stride, size_t offset);

}  // namespace moed::flex
