// Low-latency dispatch and combine for decoding (docs/design.md §6; DeepEP's
// low_latency_dispatch / low_latency_combine): fixed receive slots per expert, each row pushed
// once into its receiver's, packed source rank ascending then token ascending, and two halves,
// so two dispatches and two combines may be in flight. Every call is collective over
// the world (all ranks, same order); bad input on any rank is an error on every rank. Shrink mode
// (LowLatencyOptions::enable_shrink) masks a rank that misses its deadline (design.md §6.6).
//
//   MOED_ASSIGN_OR_RETURN(auto buffer, moed::LowLatencyBuffer::create(world, 128, 7168, 256));
//   MOED_ASSIGN_OR_RETURN(moed::LowLatencyDispatchOutput d, buffer->low_latency_dispatch(
//       {.x = x, .topk = moed::TopkView::of(routing), .use_fp8 = true, .return_recv_hook = true}));
//   MOED_RETURN_IF_ERROR(d.hook->wait());  // receive; d's views are now valid
//   MOED_ASSIGN_OR_RETURN(moed::LowLatencyCombineOutput c, buffer->low_latency_combine(
//       {.x = expert_out, .topk = moed::TopkView::of(routing), .handle = d.handle}));
//   // c.combined_x [T, H] bf16 = sum over the token's experts e ascending of w_e * y_e
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "moed/routing.h"
#include "moed/status.h"
#include "moed/tensor.h"
#include "moed/world.h"

namespace moed {

// Bytes of the node-shared segment one rank's LowLatencyBuffer needs (both halves; DeepEP's
// get_low_latency_rdma_size_hint), in shrink mode too. Per half: shrink mode's dispatch slots
// [E * M] rows of hidden bf16 (FP8 rows and their scales fit in the same layout), scales,
// source indices and counts; combine slots [E * M] rows of hidden bf16. Dispatch outputs
// live apart, in blocks of their own.
size_t get_low_latency_size_hint(int64_t max_tokens_per_rank, int hidden, int num_ranks,
                                 int num_experts);

// Where the rows of one source rank sit inside an expert's packed rows.
struct LowLatencyRange {
  int32_t begin = 0;
  int32_t count = 0;
};

// What combine needs from its dispatch. Filled when the dispatch's receive completes.
struct LowLatencyHandle {
  uint64_t buffer_id = 0;         // the LowLatencyBuffer that made it
  int64_t num_tokens = 0;         // T on this rank
  int num_topk = 0;               // K
  bool received = false;          // the dispatch's receive has completed
  std::vector<int32_t> topk_idx;  // [T, K], as dispatched
  // Home side: position of (t, k) inside its (this rank, expert) chunk (-1 when unrouted);
  // tokens this rank sent to each global expert.
  std::vector<int32_t> slot;        // [T, K]
  std::vector<int32_t> send_count;  // [E]
  // Expert side: the packed (begin, count) of every (local expert, source rank) chunk.
  std::vector<LowLatencyRange> layout_range;  // [L, R]
};

struct LowLatencyDispatchInput {
  TensorView x;                       // [T, H] bf16, T <= max_tokens_per_rank (T may be 0)
  TopkView topk;  // topk_idx [T, K] in [-1, E), read in the call; weights travel as recv_probs
  bool use_fp8 = false;               // cast to FP8 E4M3 on the sending side, per 128 channels
  bool round_scale = false;           // FP8 scales rounded up to powers of two (UE8M0)
  bool return_recv_hook = false;      // return after the send phase; hook->wait() receives
};

// Views of memory the output owns: valid and unchanged while any copy of `storage` is held,
// whatever later calls do (the lifetime rule of moed/dispatcher.h), also after the buffer and
// its world are gone. With return_recv_hook their contents are valid only after hook->wait().
struct LowLatencyDispatchOutput {
  int num_local_experts = 0;    // L
  int64_t rows_per_expert = 0;  // R * max_tokens_per_rank
  // recv_x: [L * R * M, H] bf16 or fp8; expert j's rows start at j * rows_per_expert and the
  // first recv_count[j] are valid. recv_scales: [L * R * M, H / 128] f32 (fp8 only).
  TokenRows recv;
  std::span<const int32_t> recv_count;  // [L]
  std::span<const int32_t> src_info;    // [L * R * M] source token index of each row
  // [L * R * M] each row's prob: its token's topk_weights entry for the row's expert (0 when
  // the dispatch's routing had no weights), so the expert side needs no routing of its own.
  std::span<const float> recv_probs;
  std::span<const LowLatencyRange> layout_range;  // [L * R]: rows of source s in expert j
  std::shared_ptr<const LowLatencyHandle> handle;
  // Never null: with return_recv_hook the receive half (wait() runs it; ready() is false
  // until then), else an already-completed request.
  Request hook;
  std::shared_ptr<void> storage;  // holds every view above

  TensorView expert_x(int j) const {
    return recv.x.slice_rows(j * rows_per_expert, rows_per_expert);
  }
};

struct LowLatencyOptions {
  bool enable_shrink = false;  // shrink mode (above)
  // How long a rank waits for a peer in shrink mode before it masks it (DeepEP's timeout),
  // rather than the world's timeout; a node-mate held up by a wait of its own gets until that
  // wait's end plus this (design.md §6.6).
  std::chrono::milliseconds shrink_timeout = std::chrono::seconds(10);
  // A node-shared segment made earlier, zeroed on every rank (World::alloc_shared; DeepEP's
  // num_rdma_bytes, get_low_latency_size_hint bytes or more): create() then makes no
  // collective call, so the buffer can be made after a rank is lost (shrink mode). Every rank
  // must then pass the same shape, as in DeepEP (it is not checked across ranks).
  std::shared_ptr<SharedBuffer> segment = nullptr;
};

struct LowLatencyCombineInput {
  // Expert outputs bf16 [L * R * M, H] in the dispatch's layout (rows past recv_count[j] are
  // not read). NOTE: rows bound for other nodes are sent from here, so x must stay valid and
  // unchanged until the combine has completed (the hook has run).
  TensorView x;
  // The dispatch's topk_idx and the topk_weights, read in the call (a hook keeps a copy).
  TopkView topk;
  std::shared_ptr<const LowLatencyHandle> handle;
  bool return_recv_hook = false;
  // Optional caller-owned [T, H] bf16 (row_stride >= H; DeepEP's `out`): the receive stores
  // each token's sum there. With a hook it is written when the hook runs, so it must stay
  // valid until then.
  std::optional<TensorView> out = std::nullopt;
  // Optional [T, K]: each token's terms are summed in ascending order of this key instead of
  // the expert id (copied; read by the receive). With redundant experts (moed/replicas.h): the
  // logical ids, so that the sum does not depend on which replica served a slot.
  std::span<const int32_t> order = {};
};

struct LowLatencyCombineOutput {
  // [T, H] bf16: for each token, fp32 acc = 0; for its experts e ascending (by `order` where
  // given): acc += w_e * y_e; rounded once. Tokens with no expert are 0. Valid after hook->wait()
  // with a hook. Empty (0 x 0) when LowLatencyCombineInput::out was given: the result is there.
  Tensor combined_x;
  Request hook;  // never null: the receive half with return_recv_hook, else completed
  std::optional<TensorView> out = std::nullopt;  // LowLatencyCombineInput::out, when given
  TensorView result() const { return out ? *out : combined_x.view(); }
};

class LowLatencyBuffer {
 public:
  // Collective. max_tokens_per_rank (M), hidden (H) and num_experts (E) must be the same on
  // every rank and E a multiple of the world size (one expert-parallel group, EP = R).
  static StatusOr<std::unique_ptr<LowLatencyBuffer>> create(World& world,
                                                            int64_t max_tokens_per_rank, int hidden,
                                                            int num_experts,
                                                            const LowLatencyOptions& options = {});
  ~LowLatencyBuffer();
  LowLatencyBuffer(const LowLatencyBuffer&) = delete;
  LowLatencyBuffer& operator=(const LowLatencyBuffer&) = delete;

  // Collective. Sends each token's row to the ranks of its experts (in-node: a copy into this
  // rank's node-shared slots, or none where the peers read x in place; other nodes: the
  // network), then receives (now, or in the hook).
  // caller_error: an error the caller found in its own arguments (a binding's parsing),
  // reported on every rank through the call's agreement, which it makes anyway, so no rank
  // waits for it.
  StatusOr<LowLatencyDispatchOutput> low_latency_dispatch(const LowLatencyDispatchInput& input,
                                                          const Status& caller_error = Status());
  // Collective. Sends every received row's expert output back to its home rank, then
  // receives and reduces (now, or in the hook). caller_error: as in low_latency_dispatch.
  StatusOr<LowLatencyCombineOutput> low_latency_combine(const LowLatencyCombineInput& input,
                                                        const Status& caller_error = Status());

  // Collective (DeepEP's clean_low_latency_buffer): a barrier; in shrink mode over the unmasked
  // ranks only, masking those that do not come within the shrink timeout.
  Status clean();

  // Shrink mode's mask (DeepEP's mask buffer): query_mask()[r] = 1 when this rank masked rank r.
  // update_mask masks or unmasks one rank by hand; clean_mask unmasks all. An unmasked rank must
  // be in step with the others (the same number of calls), or it is masked again at the next
  // call's deadline. FailedPrecondition outside shrink mode; InvalidArgument for a bad rank.
  std::vector<int32_t> query_mask() const;
  Status update_mask(int rank, bool mask);
  Status clean_mask();

  World& world() const;
  int64_t max_tokens_per_rank() const;
  int hidden() const;
  int num_experts() const;
  int num_local_experts() const;
  size_t bytes() const;  // bytes of this rank's node-shared segment (outputs apart)

  struct State;  // internal (src/dispatch/low_latency)

 private:
  explicit LowLatencyBuffer(std::shared_ptr<State> state);
  // The buffer over options.segment or a fresh segment, without a collective call of its own
  // but alloc_shared's.
  static StatusOr<std::unique_ptr<LowLatencyBuffer>> make_state(World& world,
                                                                int64_t max_tokens_per_rank,
                                                                int hidden, int num_experts,
                                                                const LowLatencyOptions& options);
  std::shared_ptr<State> state_;
};

}  // namespace moed
