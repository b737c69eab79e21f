// DeepEP V2's ElasticBuffer (deep_ep/buffers/elastic.py) on moed's engines, the C++ half of
// moed.deep_ep.ElasticBuffer (docs/design.md §8.2). do_expand = false is DeepEP's rank-major
// receive (NormalBuffer's); do_expand = true one row per (token, local expert), expert-major with
// each segment padded to expert_alignment (Flex's canonical layout). Combine sums in DeepEP V2's
// order for the buffer's recipe (moed/combine_recipe.h). Every call is collective; bad input on
// any rank is an error on every rank.
//
//   MOED_ASSIGN_OR_RETURN(auto buffer, moed::deep_ep::ElasticBuffer::create(world, {}));
//   MOED_ASSIGN_OR_RETURN(moed::deep_ep::ElasticDispatchOutput d, buffer->dispatch(
//       {.x = {x, {}}, .topk = topk, .num_experts = 256, .num_max_tokens_per_rank = 4096}));
//   ... experts read d.recv_x and d.recv_topk_idx (local expert ids, -1 elsewhere) ...
//   MOED_ASSIGN_OR_RETURN(moed::deep_ep::ElasticCombineOutput c,
//                         buffer->combine({.x = y, .handle = d.handle}));
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "moed/combine_recipe.h"
#include "moed/deep_ep.h"
#include "moed/dispatcher.h"
#include "moed/status.h"
#include "moed/tensor.h"
#include "moed/world.h"

namespace moed::deep_ep {

struct ElasticConfig {
  // The default num_max_tokens_per_rank of dispatch (0: every dispatch gives its own).
  int64_t num_max_tokens_per_rank = 0;
  // Across nodes: two hops (scale-out = the nodes, scale-up = the ranks of a node), and the
  // combine reduces inside each node first when allow_multiple_reduction.
  bool allow_hybrid_mode = true;
  bool allow_multiple_reduction = true;
};

// V2's EPHandle: the layout of one dispatch, for cached dispatches and the combine.
struct ElasticHandle {
  const World* world = nullptr;
  bool do_expand = false;
  int num_experts = 0;
  int expert_alignment = 1;
  int64_t num_max_tokens_per_rank = 0;
  int num_topk = 0;
  int64_t num_tokens = 0;         // T of this rank
  std::vector<int64_t> topk_idx;  // [T, K]: the dispatch's routing (global ids, -1 = none)
  int64_t num_recv_tokens = 0;    // tokens this rank received (each once)
  int64_t num_expanded_tokens = 0;  // rows of recv_x (expanded layout: with padding)
  // [L]: received (token, local expert) pairs per expert, rounded up to expert_alignment;
  // empty without a CPU sync (DeepEP's do_cpu_sync = False).
  std::vector<int32_t> num_recv_tokens_per_expert_list;
  // [scale-up ranks] inclusive prefix sum of received tokens by the source's scale-up index.
  std::vector<int32_t> psum_num_recv_tokens_per_scaleup_rank;
  // [L]: non-expanded, the inclusive prefix sum of the aligned counts; expanded, each
  // expert's first row plus its real count (DeepEP's convention).
  std::vector<int32_t> psum_num_recv_tokens_per_expert;
  std::vector<int32_t> num_unaligned_recv_tokens_per_expert;  // [L]
  // [num_recv_tokens, K + 2] per received token: src_rank * num_max_tokens_per_rank + token,
  // src_rank * K + its last top-k slot on this rank, then (expanded layout) the row of each
  // slot's expert (-1 for slots elsewhere; -1 everywhere in the non-expanded layout).
  std::vector<int32_t> recv_src_metadata;
  // [T, K]: the row each (token, slot) lands in on its expert's rank (-1 for -1 slots).
  std::vector<int32_t> dst_buffer_slot_idx;
  std::shared_ptr<const NormalHandle> normal;    // non-expanded
  std::shared_ptr<const DispatchHandle> expand;  // expanded (Flex's)
  int64_t expand_worst_rows = 0;                 // expanded: the Flex dispatcher it came from
};

struct ElasticDispatchInput {
  // [T, H] bf16 or f32, or fp8 with f32 scales [T, H / 128]. T <= num_max_tokens_per_rank.
  TokenRows x;
  // Uncached: topk_idx [T, K] (-1 = none) and optionally topk_weights. Cached: num_topk = 0
  // (the handle's routing is used).
  TopkView topk;
  // Cached mode only: optional weights [T, K] for the handle's routing (they travel too).
  std::span<const float> cached_weights;
  int num_experts = 0;                  // uncached; 0 in cached mode (the handle's)
  int64_t num_max_tokens_per_rank = 0;  // 0: the handle's, else the buffer's default
  int expert_alignment = 0;             // 0: the handle's, else 1
  bool do_expand = false;               // uncached; the handle's in cached mode
  // false: the outputs are sized for the worst case (DeepEP's do_cpu_sync = False; the rows
  // past the received ones are zero, their indices -1). Unset: true, and in cached mode the
  // handle's sizes (true there is an error, as in DeepEP).
  std::optional<bool> do_cpu_sync;
  std::shared_ptr<const ElasticHandle> handle;  // cached mode
  std::span<int32_t> cumulative_local_expert_recv_stats;  // [L] or empty: += the real counts
};

struct ElasticDispatchOutput {
  TokenRows recv_x;
  // Non-expanded: [rows, K] local expert ids or -1 (also in cached mode). Expanded: empty.
  std::span<const int64_t> recv_topk_idx;
  // Non-expanded [rows, K] (0 where the id is -1); expanded [rows], one per row (0 on
  // padding). Empty when no weights were given.
  std::span<const float> recv_topk_weights;
  std::shared_ptr<const ElasticHandle> handle;
  std::shared_ptr<void> storage;  // holds every view above (the lifetime rule of dispatcher.h)
};

struct ElasticCombineInput {
  TensorView x;  // [rows, H] bf16 or f32, rows as recv_x (expert outputs)
  // Optional, returned combined per slot: non-expanded [rows, K]; expanded [rows].
  const float* topk_weights = nullptr;
  TensorView bias_0, bias_1;  // optional [T, H], x's dtype
  std::shared_ptr<const ElasticHandle> handle;
  std::optional<TensorView> out = std::nullopt;  // optional caller-owned [T, H]
};

struct ElasticCombineOutput {
  Tensor combined_x;  // [T, H]; empty when ElasticCombineInput::out was given
  // [T, K]: each slot's weight as its expert's rank returned it (0 for -1 slots); empty
  // without topk_weights.
  std::vector<float> combined_topk_weights;
  std::optional<TensorView> out = std::nullopt;
  TensorView result() const { return out ? *out : combined_x.view(); }
};

class ElasticBuffer {
 public:
  static StatusOr<std::unique_ptr<ElasticBuffer>> create(World& world, const ElasticConfig& config);
  ~ElasticBuffer();
  ElasticBuffer(const ElasticBuffer&) = delete;
  ElasticBuffer& operator=(const ElasticBuffer&) = delete;

  // (scale-out ranks, scale-up ranks): (nodes, ranks per node) with hybrid mode across
  // nodes, else (1, R). physical_domain: (nodes, ranks per node) as the world has them.
  std::pair<int, int> logical_domain() const;
  std::pair<int, int> physical_domain() const;
  // The combine recipe of this buffer for a layout (DeepEP's choice).
  CombineRecipe recipe(bool do_expand) const;

  // caller_error: a binding's parse error, reported on every rank (as NormalBuffer's).
  StatusOr<ElasticDispatchOutput> dispatch(const ElasticDispatchInput& input,
                                           const Status& caller_error = Status());
  StatusOr<ElasticCombineOutput> combine(const ElasticCombineInput& input,
                                         const Status& caller_error = Status());

  const ElasticConfig& config() const;
  World& world() const;

  struct State;  // internal (src/dispatch/deep_ep/elastic_*.cc)

 private:
  explicit ElasticBuffer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace moed::deep_ep
