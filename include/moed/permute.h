// Permute / unpermute / sort_chunks_by_idxs and their backward (Megatron-Core's moe_utils): the
// single-rank token path of every dispatcher (docs/design.md §1.4). permute turns tokens [T, H]
// and an *effective* RoutingMap [T, E] (run apply_layout_options first) into expert-major rows
// in the canonical order (design.md §3.1), with Megatron's drop_and_pad (pad_to_capacity) and
// DeepEP's expert_alignment; unpermute sums the rows back per token in design.md §4.1's order.
// Padding rows are zero bytes (prob 0, sorted index -1). All deterministic, the same bits for
// any thread count.
//
//   MOED_ASSIGN_OR_RETURN(moed::PermuteOutput p, moed::permute(tokens, effective_map));
//   ... experts read p.rows; segment j has p.layout.tokens_per_expert[j] rows ...
//   MOED_ASSIGN_OR_RETURN(moed::Tensor out,
//                         moed::unpermute(y, p.layout.sorted_indices, num_tokens));
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "moed/routing.h"
#include "moed/status.h"
#include "moed/tensor.h"
#include "moed/thread_pool.h"

namespace moed {

struct PermuteOptions {
  // Experts [expert_begin, expert_end) produce output segments, in ascending order;
  // expert_end = -1 means num_experts. Rows routed to other experts are skipped.
  int expert_begin = 0;
  int expert_end = -1;
  // Megatron's drop_and_pad: every (source, expert) chunk is exactly `capacity` rows, its
  // tokens first, then zero rows. Unset = off. A chunk with more tokens is an error (drop
  // them first with apply_layout_options).
  std::optional<int64_t> capacity;
  // Each expert segment is zero-padded at its end to a multiple of this (1 = off).
  int expert_alignment = 1;
  // Several source ranks' tokens concatenated in `tokens` (the AllGather dispatcher): source s
  // owns token rows [source_offsets[s], source_offsets[s + 1]); first 0, last T,
  // non-decreasing. Empty = one source owning all tokens.
  std::span<const int64_t> source_offsets;
  // Per-source capacity (C_s), one per source: pad_to_capacity with a different C per source.
  // Empty = use `capacity` for every source. Not together with `capacity`.
  std::span<const int64_t> source_capacities;
};

// Where every routed (token, expert) pair goes: Megatron's sorted_indices plus the counts.
struct PermuteLayout {
  int64_t num_tokens = 0;  // T of the map (all sources)
  int num_experts = 0;     // E of the map
  int expert_begin = 0;    // output segment j is expert expert_begin + j
  int expert_end = 0;
  int64_t num_rows = 0;
  std::vector<int32_t> sorted_indices;              // [num_rows] token of each row; -1 = padding
  std::vector<float> permuted_probs;                // [num_rows] prob of each row; 0 on padding
  std::vector<int64_t> tokens_per_expert;           // [n] padded segment lengths
  std::vector<int64_t> tokens_per_expert_unpadded;  // [n] rows with a token
  std::vector<int64_t> expert_offsets;              // [n + 1] first row of each segment

  int num_segments() const { return expert_end - expert_begin; }
  // The expert of a row (binary search over expert_offsets); -1 when row is out of range.
  int expert_of_row(int64_t row) const;
};

// Computes the layout of `routing` (an effective map; probs are taken as they are).
// Errors: bad map sizes, expert range outside [0, E], capacity < 0, alignment < 1, bad
// source_offsets, or a chunk with more tokens than its capacity.
StatusOr<PermuteLayout> make_permute_layout(const RoutingMap& routing,
                                            const PermuteOptions& options = {},
                                            ThreadPool& pool = ThreadPool::global());
// The same from the sparse form (moed/routing.h; the dispatchers' own), O(entries).
StatusOr<PermuteLayout> make_permute_layout(const SparseRouting& routing,
                                            const PermuteOptions& options = {},
                                            ThreadPool& pool = ThreadPool::global());

// Copies token rows into the layout's order. tokens: [T, H] f32, bf16, or fp8 with scales
// [T, H/128]; out: [num_rows, H] of the same dtype (+ scales), caller-owned.
Status permute_rows_into(const TokenRows& tokens, const PermuteLayout& layout, const TokenRows& out,
                         ThreadPool& pool = ThreadPool::global());
StatusOr<TokenTensor> permute_rows(const TokenRows& tokens, const PermuteLayout& layout,
                                   ThreadPool& pool = ThreadPool::global());

struct PermuteOutput {
  TokenTensor rows;      // [num_rows, H], tokens' dtype (+ scales for fp8)
  PermuteLayout layout;  // sorted_indices, permuted_probs, tokens_per_expert (padded, unpadded)
};
// make_permute_layout + permute_rows.
StatusOr<PermuteOutput> permute(const TokenRows& tokens, const RoutingMap& routing,
                                const PermuteOptions& options = {},
                                ThreadPool& pool = ThreadPool::global());

// out[t] = fp32 0 + sum over the rows i with sorted_indices[i] == t, in row order, of
// (probs.empty() ? float(rows[i]) : probs[i] * float(rows[i])), rounded once to the rows'
// dtype; 0 for tokens without rows. With expert-major rows, row order is design.md §4.1's expert
// order. rows: [N, H] f32 or bf16; sorted_indices [N] in [-1, T); probs [N] or empty.
Status unpermute_into(const TensorView& rows, std::span<const int32_t> sorted_indices,
                      std::span<const float> probs, const TensorView& out,
                      ThreadPool& pool = ThreadPool::global());
StatusOr<Tensor> unpermute(const TensorView& rows, std::span<const int32_t> sorted_indices,
                           int64_t num_tokens, std::span<const float> probs = {},
                           ThreadPool& pool = ThreadPool::global());

// Backward of permute: grad_tokens = unpermute(grad_rows) (unweighted, grad_rows' dtype);
// grad_probs [T, E] map form = fp32 0 + grad_permuted_probs[row] at (token, expert) of each
// non-padding row, 0 elsewhere and everywhere when grad_permuted_probs is empty.
struct PermuteGrad {
  Tensor grad_tokens;             // [T, H]
  std::vector<float> grad_probs;  // [T, E]
};
StatusOr<PermuteGrad> permute_backward(const TensorView& grad_rows,
                                       std::span<const float> grad_permuted_probs,
                                       const PermuteLayout& layout,
                                       ThreadPool& pool = ThreadPool::global());

// Backward of unpermute. Row i (token t = sorted_indices[i]) gets grad_out[t], or
// round(probs[i] * float(grad_out[t][h])) when probs is given (weighted); padding rows 0.
// grad_row_probs[i] (weighted only, else empty) = fp32 d = 0; for h ascending:
// d += float(grad_out[t][h]) * float(rows[i][h]); 0 on padding rows. rows is needed only when
// weighted. grad_out: [T, H] f32 or bf16; the result has grad_out's dtype.
struct UnpermuteGrad {
  Tensor grad_rows;                   // [N, H]
  std::vector<float> grad_row_probs;  // [N] when weighted, else empty
};
StatusOr<UnpermuteGrad> unpermute_backward(const TensorView& grad_out,
                                           std::span<const int32_t> sorted_indices,
                                           std::span<const float> probs, const TensorView& rows,
                                           ThreadPool& pool = ThreadPool::global());

// Per-row values (grad_row_probs, grad_permuted_probs) to map form [T, E]: fp32 0 + value at
// (token, expert) of each non-padding row, 0 elsewhere. row_values: [num_rows].
StatusOr<std::vector<float>> row_values_to_map(const PermuteLayout& layout,
                                               std::span<const float> row_values);

// Megatron's sort_chunks_by_idxs: input rows split into consecutive chunks of split_sizes
// (sum = input rows); output chunk i is input chunk sorted_idxs[i] (a permutation of
// [0, num_chunks)), copied contiguously. output_offsets (empty = packed) gives the row where
// output chunk i starts: non-decreasing with room for each chunk; rows between chunks and
// after the last one are zeroed (the alignment padding of the AlltoAll dispatcher).
Status sort_chunks_by_idxs_into(const TokenRows& input, std::span<const int64_t> split_sizes,
                                std::span<const int32_t> sorted_idxs, const TokenRows& output,
                                std::span<const int64_t> output_offsets = {},
                                ThreadPool& pool = ThreadPool::global());
// Packed output ([sum of split_sizes, H]).
StatusOr<TokenTensor> sort_chunks_by_idxs(const TokenRows& input,
                                          std::span<const int64_t> split_sizes,
                                          std::span<const int32_t> sorted_idxs,
                                          ThreadPool& pool = ThreadPool::global());
// The same for one value per row (probs, source indices): [rows] spans.
Status sort_chunks_by_idxs_into(std::span<const float> input, std::span<const int64_t> split_sizes,
                                std::span<const int32_t> sorted_idxs, std::span<float> output,
                                std::span<const int64_t> output_offsets = {});
Status sort_chunks_by_idxs_into(std::span<const int32_t> input,
                                std::span<const int64_t> split_sizes,
                                std::span<const int32_t> sorted_idxs, std::span<int32_t> output,
                                std::span<const int64_t> output_offsets = {});

// Backward (sort back): grad_input chunk sorted_idxs[i] = grad_output rows
// [output_offsets[i], + split_sizes[sorted_idxs[i]]) (packed when output_offsets is empty);
// the gap rows are dropped. grad_input: [sum of split_sizes, H].
Status sort_chunks_by_idxs_backward_into(const TokenRows& grad_output,
                                         std::span<const int64_t> split_sizes,
                                         std::span<const int32_t> sorted_idxs,
                                         const TokenRows& grad_input,
                                         std::span<const int64_t> output_offsets = {},
                                         ThreadPool& pool = ThreadPool::global());
StatusOr<TokenTensor> sort_chunks_by_idxs_backward(const TokenRows& grad_output,
                                                   std::span<const int64_t> split_sizes,
                                                   std::span<const int32_t> sorted_idxs,
                                                   std::span<const int64_t> output_offsets = {},
                                                   ThreadPool& pool = ThreadPool::global());

}  // namespace moed
