// sort_chunks_by_idxs (Megatron's moe_utils.sort_chunks_by_idxs) and its backward.
//
// Both directions become one list of moves covering the destination rows in order (copy
// `count` rows from a source row, or zero them); the pool splits the destination rows, so a
// worker copies whole runs with one memcpy where both sides are packed.
#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/row_checks.h"
#include "core/row_kernels.h"
#include "moed/permute.h"

namespace moed {

using internal::check_token_rows;

namespace {

struct Move {
  int64_t dst;
  int64_t src;  // -1: zero rows
  int64_t count;
};

// The chunks of the forward direction: chunk_begin[c] = first input row of input chunk c, and
// out_begin[i] = first output row of output chunk i. Checks the arguments.
struct ChunkPlan {
  std::vector<int64_t> chunk_begin;
  std::vector<int64_t> out_begin;
  int64_t input_rows = 0;
  int64_t output_end = 0;  // one past the last row written by a chunk
};

StatusOr<ChunkPlan> make_plan(std::span<const int64_t> split_sizes,
                              std::span<const int32_t> sorted_idxs,
                              std::span<const int64_t> output_offsets) {
  const size_t n = split_sizes.size();
  if (sorted_idxs.size() != n) {
    return invalid_argument("sorted_idxs has ", sorted_idxs.size(), " entries for ", n,
                            " chunks (split_sizes)");
  }
  if (!output_offsets.empty() && output_offsets.size() != n) {
    return invalid_argument("output_offsets has ", output_offsets.size(), " entries for ", n,
                            " chunks");
  }
  ChunkPlan p;
  p.chunk_begin.resize(n);
  for (size_t c = 0; c < n; ++c) {
    if (split_sizes[c] < 0) {
      return invalid_argument("split_sizes[", c, "] = ", split_sizes[c], " is negative");
    }
    p.chunk_begin[c] = p.input_rows;
    p.input_rows += split_sizes[c];
  }
  std::vector<uint8_t> seen(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const int32_t c = sorted_idxs[i];
    if (c < 0 || size_t(c) >= n) {
      return invalid_argument("sorted_idxs[", i, "] = ", c, " is outside [0, ", n, ")");
    }
    if (seen[size_t(c)]) {
      return invalid_argument("sorted_idxs[", i, "] = ", c,
                              " repeats an earlier entry; sorted_idxs must be a permutation");
    }
    seen[size_t(c)] = 1;
  }
  p.out_begin.resize(n);
  int64_t end = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t size = split_sizes[size_t(sorted_idxs[i])];
    const int64_t begin = output_offsets.empty() ? end : output_offsets[i];
    if (begin < end) {
      return invalid_argument("output_offsets[", i, "] = ", begin, " overlaps the previous chunk,",
                              " which ends at row ", end);
    }
    p.out_begin[i] = begin;
    end = begin + size;
  }
  p.output_end = end;
  return p;
}

void zero_rows(const TensorView& dst, int64_t dst_row, int64_t count) {
  if (count <= 0 || dst.cols == 0) return;
  if (dst.contiguous()) {
    std::memset(dst.row_ptr(dst_row), 0, size_t(count) * dst.row_bytes());
    return;
  }
  for (int64_t r = 0; r < count; ++r) std::memset(dst.row_ptr(dst_row + r), 0, dst.row_bytes());
}

// moves cover [0, total) in order; `views` pairs (dst, src) are handled alike (payload and
// fp8 scales).
void run_moves(const std::vector<Move>& moves, int64_t total,
               std::span<const std::pair<TensorView, TensorView>> views, ThreadPool* pool) {
  auto work = [&](int64_t b, int64_t e, int) {
    // The move holding row b: the last one starting at or before it.
    size_t m = size_t(std::upper_bound(moves.begin(), moves.end(), b,
                                       [](int64_t row, const Move& mv) { return row < mv.dst; }) -
                      moves.begin()) -
               1;
    for (int64_t r = b; r < e; ++m) {
      const Move& mv = moves[m];
      const int64_t stop = std::min(e, mv.dst + mv.count);
      for (const auto& [dst, src] : views) {
        if (mv.src < 0) {
          zero_rows(dst, r, stop - r);
        } else {
          internal::copy_rows(dst, r, src, mv.src + (r - mv.dst), stop - r);
        }
      }
      r = stop;
    }
  };
  if (pool) {
    pool->parallel_for(total, work, 64);
  } else {
    work(0, total, 0);
  }
}

// Forward moves: output chunk i from input chunk sorted_idxs[i]; gaps and the tail zeroed.
std::vector<Move> forward_moves(const ChunkPlan& p, std::span<const int64_t> split_sizes,
                                std::span<const int32_t> sorted_idxs, int64_t output_rows) {
  std::vector<Move> moves;
  int64_t row = 0;
  for (size_t i = 0; i < sorted_idxs.size(); ++i) {
    const int64_t size = split_sizes[size_t(sorted_idxs[i])];
    if (p.out_begin[i] > row) moves.push_back(Move{row, -1, p.out_begin[i] - row});
    if (size > 0)
      moves.push_back(Move{p.out_begin[i], p.chunk_begin[size_t(sorted_idxs[i])], size});
    row = p.out_begin[i] + size;
  }
  if (output_rows > row) moves.push_back(Move{row, -1, output_rows - row});
  return moves;
}

// Backward moves: input chunk c (packed) from the output rows where it was placed.
std::vector<Move> backward_moves(const ChunkPlan& p, std::span<const int64_t> split_sizes,
                                 std::span<const int32_t> sorted_idxs) {
  std::vector<int64_t> placed(split_sizes.size());
  for (size_t i = 0; i < sorted_idxs.size(); ++i) placed[size_t(sorted_idxs[i])] = p.out_begin[i];
  std::vector<Move> moves;
  for (size_t c = 0; c < split_sizes.size(); ++c) {
    if (split_sizes[c] > 0) moves.push_back(Move{p.chunk_begin[c], placed[c], split_sizes[c]});
  }
  return moves;
}

Status check_pair(const char* in_name, const TokenRows& in, const char* out_name,
                  const TokenRows& out, int64_t in_rows, int64_t out_rows) {
  MOED_RETURN_IF_ERROR(check_token_rows(in_name, in, in_rows));
  MOED_RETURN_IF_ERROR(check_token_rows(out_name, out, out_rows));
  if (in.x.dtype != out.x.dtype || in.x.cols != out.x.cols) {
    return invalid_argument(out_name, " is ", dtype_name(out.x.dtype), " with ", out.x.cols,
                            " columns; ", in_name, " is ", dtype_name(in.x.dtype), " with ",
                            in.x.cols);
  }
  return ok_status();
}

std::vector<std::pair<TensorView, TensorView>> view_pairs(const TokenRows& dst,
                                                          const TokenRows& src) {
  std::vector<std::pair<TensorView, TensorView>> v = {{dst.x, src.x}};
  if (src.has_scales()) v.emplace_back(dst.scales, src.scales);
  return v;
}

template <typename T>
Status sort_values(std::span<const T> input, std::span<const int64_t> split_sizes,
                   std::span<const int32_t> sorted_idxs, std::span<T> output,
                   std::span<const int64_t> output_offsets) {
  MOED_ASSIGN_OR_RETURN(ChunkPlan p, make_plan(split_sizes, sorted_idxs, output_offsets));
  if (int64_t(input.size()) != p.input_rows) {
    return invalid_argument("input has ", input.size(), " values; split_sizes sum to ",
                            p.input_rows);
  }
  if (int64_t(output.size()) < p.output_end) {
    return invalid_argument("output has ", output.size(), " values; the chunks need ",
                            p.output_end);
  }
  // Values are 4 bytes; a [n, 1] f32 view moves them bit for bit.
  static_assert(sizeof(T) == 4);
  const TensorView in(const_cast<T*>(input.data()), DType::kF32, int64_t(input.size()), 1);
  const TensorView out(output.data(), DType::kF32, int64_t(output.size()), 1);
  const std::pair<TensorView, TensorView> views[1] = {{out, in}};
  run_moves(forward_moves(p, split_sizes, sorted_idxs, int64_t(output.size())),
            int64_t(output.size()), views, nullptr);
  return ok_status();
}

}  // namespace

Status sort_chunks_by_idxs_into(const TokenRows& input, std::span<const int64_t> split_sizes,
                                std::span<const int32_t> sorted_idxs, const TokenRows& output,
                                std::span<const int64_t> output_offsets, ThreadPool& pool) {
  MOED_ASSIGN_OR_RETURN(ChunkPlan p, make_plan(split_sizes, sorted_idxs, output_offsets));
  MOED_RETURN_IF_ERROR(check_pair("input", input, "output", output, p.input_rows, -1));
  if (output.x.rows < p.output_end) {
    return invalid_argument("output has ", output.x.rows, " rows; the chunks need ", p.output_end);
  }
  run_moves(forward_moves(p, split_sizes, sorted_idxs, output.x.rows), output.x.rows,
            view_pairs(output, input), &pool);
  return ok_status();
}

StatusOr<TokenTensor> sort_chunks_by_idxs(const TokenRows& input,
                                          std::span<const int64_t> split_sizes,
                                          std::span<const int32_t> sorted_idxs, ThreadPool& pool) {
  MOED_RETURN_IF_ERROR(check_token_rows("input", input, -1));
  TokenTensor out;
  out.x = Tensor::empty(input.x.dtype, input.x.rows, input.x.cols);
  if (input.has_scales()) {
    out.scales = Tensor::empty(DType::kF32, input.x.rows, input.x.cols / kFp8BlockSize);
  }
  MOED_RETURN_IF_ERROR(
      sort_chunks_by_idxs_into(input, split_sizes, sorted_idxs, out.rows(), {}, pool));
  return out;
}

Status sort_chunks_by_idxs_into(std::span<const float> input, std::span<const int64_t> split_sizes,
                                std::span<const int32_t> sorted_idxs, std::span<float> output,
                                std::span<const int64_t> output_offsets) {
  return sort_values(input, split_sizes, sorted_idxs, output, output_offsets);
}

Status sort_chunks_by_idxs_into(std::span<const int32_t> input,
                                std::span<const int64_t> split_sizes,
                                std::span<const int32_t> sorted_idxs, std::span<int32_t> output,
                                std::span<const int64_t> output_offsets) {
  return sort_values(input, split_sizes, sorted_idxs, output, output_offsets);
}

Status sort_chunks_by_idxs_backward_into(const TokenRows& grad_output,
                                         std::span<const int64_t> split_sizes,
                                         std::span<const int32_t> sorted_idxs,
                                         const TokenRows& grad_input,
                                         std::span<const int64_t> output_offsets,
                                         ThreadPool& pool) {
  MOED_ASSIGN_OR_RETURN(ChunkPlan p, make_plan(split_sizes, sorted_idxs, output_offsets));
  MOED_RETURN_IF_ERROR(
      check_pair("grad_output", grad_output, "grad_input", grad_input, -1, p.input_rows));
  if (grad_output.x.rows < p.output_end) {
    return invalid_argument("grad_output has ", grad_output.x.rows, " rows; the chunks need ",
                            p.output_end);
  }
  run_moves(backward_moves(p, split_sizes, sorted_idxs), p.input_rows,
            view_pairs(grad_input, grad_output), &pool);
  return ok_status();
}

StatusOr<TokenTensor> sort_chunks_by_idxs_backward(const TokenRows& grad_output,
                                                   std::span<const int64_t> split_sizes,
                                                   std::span<const int32_t> sorted_idxs,
                                                   std::span<const int64_t> output_offsets,
                                                   ThreadPool& pool) {
  MOED_RETURN_IF_ERROR(check_token_rows("grad_output", grad_output, -1));
  int64_t rows = 0;
  for (const int64_t s : split_sizes) rows += std::max<int64_t>(s, 0);
  TokenTensor out;
  out.x = Tensor::empty(grad_output.x.dtype, rows, grad_output.x.cols);
  if (grad_output.has_scales()) {
    out.scales = Tensor::empty(DType::kF32, rows, grad_output.x.cols / kFp8BlockSize);
  }
  MOED_RETURN_IF_ERROR(sort_chunks_by_idxs_backward_into(grad_output, split_sizes, sorted_idxs,
                                                         out.rows(), output_offsets, pool));
  return out;
}

}  // namespace moed
