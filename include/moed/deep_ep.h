// DeepEP's normal (high-throughput) mode with its rank-major receive, the C++ half of
// moed.deep_ep (docs/design.md §8.1): every receiving rank gets each token once, source rank
// ascending then source token ascending, its top-k rewritten as local expert ids (-1 elsewhere);
// combine sums, in a fixed order, the rows the receiving ranks send back. Every call is
// collective over the world; bad input on any rank is an error on every rank.
//
//   MOED_ASSIGN_OR_RETURN(auto buffer, moed::deep_ep::NormalBuffer::create(world));
//   MOED_ASSIGN_OR_RETURN(moed::DispatchLayout layout, buffer->get_dispatch_layout(topk, 256));
//   MOED_ASSIGN_OR_RETURN(moed::deep_ep::NormalDispatchOutput d, buffer->dispatch(
//       {.x = {x, {}}, .topk = topk, .layout = moed::deep_ep::LayoutView::of(layout)}));
//   ... experts read d.recv_x (rows of source 0, then source 1, ...) and d.recv_topk_idx ...
//   MOED_ASSIGN_OR_RETURN(moed::deep_ep::NormalCombineOutput c,
//                         buffer->combine({.x = y, .handle = d.handle}));
//   // c.combined_x[t] = bias_0[t] + bias_1[t] + sum over ranks r ascending that got t of y_r
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "moed/combine_recipe.h"
#include "moed/dispatch_layout.h"
#include "moed/status.h"
#include "moed/tensor.h"
#include "moed/world.h"

namespace moed::deep_ep {

// topk_idx [T, K] int64 (DeepEP's topk_idx_t) or int32, values in [-1, E); topk_weights
// [T, K] f32 or null (then the received weights are 0). Both row-major and contiguous.
// num_topk = 0: no top-k (dispatch moves x only).
// The one borrowed top-k form of moed/routing.h.
using TopkView = moed::TopkView;

// What get_dispatch_layout returned, as the caller passes it back to dispatch (DeepEP's
// num_tokens_per_rank [R], is_token_in_rank [T, R] bool, num_tokens_per_expert [E]).
// is_token_in_rank says where each token goes (with or without top-k).
struct LayoutView {
  std::span<const int32_t> num_tokens_per_rank;
  std::span<const uint8_t> is_token_in_rank;
  std::span<const int32_t> num_tokens_per_expert;
  std::vector<int32_t> owned_rank, owned_expert;  // set by of()

  static LayoutView of(const DispatchLayout& l);
};

// DeepEP's intranode handle (the same six arrays, the same meanings) plus what moed's
// two-hop path needs to rerun without a count exchange.
struct NormalHandle {
  // The world of the dispatch that made it: any NormalBuffer over the same world (and with the
  // same channel split) may run the cached dispatch or the combine of this handle.
  const World* world = nullptr;
  int num_ranks = 0;            // R
  int num_channels = 0;         // C: token ranges of the senders (DeepEP's SM pairs)
  int num_experts = 0;          // E of the dispatch
  int64_t num_tokens = 0;       // T of this rank
  int64_t num_recv_tokens = 0;  // rows this rank received
  int64_t num_rows = 0;         // rows of recv_x (num_worst_tokens when given)
  int64_t num_worst_tokens = 0;
  int hidden = 0;
  DType dtype = DType::kBF16;
  // [R, R]: rank_prefix_matrix[i][j] = tokens ranks 0..i send to rank j (inclusive prefix).
  std::vector<int32_t> rank_prefix_matrix;
  // [R, C], home side: tokens of channels 0..c of this rank bound for rank r (inclusive).
  std::vector<int32_t> channel_prefix_matrix;
  // [R, C], receive side: where channel c of source s starts inside s's rows (exclusive).
  std::vector<int32_t> recv_channel_prefix_matrix;
  std::vector<int32_t> recv_src_idx;      // [num_rows]: source token index (-1 on padding)
  std::vector<uint8_t> is_token_in_rank;  // [T, R]
  std::vector<int32_t> send_head;         // [T, R]: index of t among its channel's tokens
                                          // for r (-1 when not sent)
  // moed's own: tokens that the forwarder role receives from each other node's source
  // (rank node * G + my local index), [N]; and per remote source the tokens' rank masks.
  std::vector<int64_t> forward_tokens;
  std::vector<std::vector<int32_t>> forward_src_token;  // [N][n]
  std::vector<std::vector<uint64_t>> forward_mask;      // [N][n]

  int32_t rank_begin(int s, int r) const {  // first row of source s on rank r
    return s == 0 ? 0 : rank_prefix_matrix[size_t(s - 1) * size_t(num_ranks) + size_t(r)];
  }
};

struct NormalDispatchInput {
  TokenRows x;  // [T, H] f32 or bf16, or fp8 (E4M3FN) with scales f32 [T, H / 128]
  TopkView topk;  // optional; in cached mode too (then it must be the handle's routing)
  LayoutView layout;  // uncached mode: required
  // Cached mode: no count exchange. The handle fixes the layout only: x may have another
  // dtype or hidden size than the dispatch that made it (the same on every rank).
  std::shared_ptr<const NormalHandle> handle;
  int expert_alignment = 1;
  int64_t num_worst_tokens = 0;  // > 0: recv_x has this many rows (the rest zero)
  // Optional caller-owned rows of recv_x (moed's extension): [num_rows, H] of x's dtype,
  // row_stride >= H, not overlapping x. num_rows must be known before the count exchange, so
  // this needs num_worst_tokens > 0 or a cached handle. Each row is stored there once: in the
  // threads world by its sender, straight; in the MPI world copied out of the node-shared
  // receive block. recv_x.x is then this view (fp8 scales stay in moed's memory). A bad
  // buffer is an error on every rank, and then no rank's buffer is written.
  std::optional<TensorView> out = std::nullopt;
};

struct NormalDispatchOutput {
  TokenRows recv_x;  // [num_rows, H], the input dtype (+ scales)
  // [num_rows, K] local expert ids or -1, and the weights (0 where -1); empty without top-k.
  std::span<const int64_t> recv_topk_idx;
  std::span<const float> recv_topk_weights;
  // [L] received (token, local expert) pairs, each rounded up to expert_alignment; empty
  // with num_worst_tokens or in cached mode (as DeepEP).
  std::vector<int32_t> num_recv_tokens_per_expert;
  std::shared_ptr<const NormalHandle> handle;
  // Holds the memory above unchanged while any copy is alive, even past the buffer (the
  // lifetime rule of moed/dispatcher.h): a slot of the buffer's ring of node-shared receive
  // regions, which no later dispatch writes while it is held.
  std::shared_ptr<void> storage;
};

struct NormalCombineInput {
  TensorView x;                         // [num_rows, H] f32 or bf16, rows as in recv_x
  const float* topk_weights = nullptr;  // [num_rows, K] or null
  int num_topk = 0;
  TensorView bias_0, bias_1;  // optional [T, H] f32 or bf16 (home side)
  std::shared_ptr<const NormalHandle> handle;
  // DeepEP V2's order instead of the ranks ascending (ElasticBuffer): each rank's row stands
  // at its last top-k slot of `order_topk` (the dispatch's routing, [T, K]) and the rows are
  // summed by `recipe` (moed/combine_recipe.h); combined_topk_weights then give each slot the
  // weight of its expert's rank's row (V2's), not the sum over the ranks.
  const TopkView* order_topk = nullptr;
  CombineRecipe recipe;
  // Optional caller-owned [T, H] of x's dtype (row_stride >= H, not overlapping x or the
  // biases): the final fp32 -> dtype store of each token writes there (moed's extension).
  std::optional<TensorView> out = std::nullopt;
};

struct NormalCombineOutput {
  // [T, H], x's dtype: fp32 acc = bias_0 + bias_1 (0 where absent), then += the row of each
  // rank that received the token, ranks ascending; rounded once. 0 for unsent tokens.
  // Empty (0 x 0) when NormalCombineInput::out was given: the result is there.
  Tensor combined_x;
  std::vector<float> combined_topk_weights;      // [T, K] the same sum of the weights
  std::optional<TensorView> out = std::nullopt;  // NormalCombineInput::out, when given
  TensorView result() const { return out ? *out : combined_x.view(); }
};

class NormalBuffer {
 public:
  // Collective. num_channels = 0: the world pool's threads (rank 0's count is used on every
  // rank). The number of experts E is each dispatch's (the size of num_tokens_per_expert).
  static StatusOr<std::unique_ptr<NormalBuffer>> create(World& world, int num_channels = 0);
  ~NormalBuffer();
  NormalBuffer(const NormalBuffer&) = delete;
  NormalBuffer& operator=(const NormalBuffer&) = delete;

  // Local: DeepEP's layout (num_tokens_per_node = per RDMA rank) from this rank's top-k.
  StatusOr<DispatchLayout> get_dispatch_layout(const TopkView& topk, int num_experts) const;
  // caller_error: an error the caller found in its own arguments (a binding's parsing),
  // reported on every rank through the call's first collective instead of leaving the other
  // ranks waiting.
  StatusOr<NormalDispatchOutput> dispatch(const NormalDispatchInput& input,
                                          const Status& caller_error = Status());
  StatusOr<NormalCombineOutput> combine(const NormalCombineInput& input,
                                        const Status& caller_error = Status());

  World& world() const;

  struct State;  // internal (src/dispatch/flex/rank_major.h)

 private:
  explicit NormalBuffer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// DeepEP's UE8M0 scale format (low_latency_dispatch with use_ue8m0): each power-of-two float
// scale (round_scale = true) becomes its 8-bit biased exponent, four consecutive blocks packed
// little-endian into one int32, so [rows, H / 128] f32 becomes [rows, H / 512] int32. Errors
// name a scale that is not a power of two (0 packs as 0), or H / 128 not a multiple of 4.
Status pack_ue8m0(const TensorView& scales, std::span<int32_t> out);

}  // namespace moed::deep_ep
