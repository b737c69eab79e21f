// unpermute and the two backward passes.
//
// unpermute parallelises over tokens: each worker owns a token range, finds its tokens' rows
// with one scan of sorted_indices (kept in row order, which for expert-major rows is the expert
// order of design.md §4.1) and sums them per token in fp32, blocked over H so the accumulator stays
// in L1. Every output element is the same chain of single fp32 operations whatever the split, so the
// result is bitwise identical for any thread count.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/row_checks.h"
#include "core/row_kernels.h"
#include "moed/permute.h"

namespace moed {

using internal::check_float_rows;
using internal::row_kernels;
using internal::RowKernels;

namespace {

// Accumulator block: 8192 floats = 32 KB (a whole row for the standard shapes, so each
// input row is read as one long stream the hardware prefetchers follow; the accumulator
// stays in L1 / L2).
constexpr int64_t kBlock = 8192;

Status check_indices(std::span<const int32_t> sorted_indices, int64_t num_tokens) {
  for (size_t i = 0; i < sorted_indices.size(); ++i) {
    const int32_t t = sorted_indices[i];
    if (t < -1 || t >= num_tokens) {
      return invalid_argument("sorted_indices[", i, "] = ", t, " is outside [-1, ", num_tokens,
                              ")");
    }
  }
  return ok_status();
}

// One token: out = round(fp32 0 + sum over its rows in order of (p *) float(row)).
// stream: write the output row around the caches (through `tmp`, one block of the output).
void reduce_token(const RowKernels& k, const TensorView& rows, const int64_t* list, int64_t count,
                  const float* probs, void* out_row, float* acc, bool stream, bf16* tmp) {
  const int64_t H = rows.cols;
  const DType dt = rows.dtype;
  const bool bf = dt == DType::kBF16;
  if (count == 0) {
    std::memset(out_row, 0, rows.row_bytes());
    return;
  }
  for (int64_t hb = 0; hb < H; hb += kBlock) {
    const int64_t n = std::min(kBlock, H - hb);
    for (int64_t c = 0; c < count; ++c) {
      const int64_t r = list[c];
      const void* y = static_cast<const char*>(rows.row_ptr(r)) + size_t(hb) * dtype_size(dt);
      if (probs) {
        (c == 0 ? k.start_weighted : k.accumulate_weighted)(acc, y, dt, probs[r], size_t(n));
      } else {
        (c == 0 ? k.start : k.accumulate)(acc, y, dt, size_t(n));
      }
    }
    if (bf && stream) {
      k.store(acc, tmp, DType::kBF16, size_t(n));
      internal::stream_copy(static_cast<bf16*>(out_row) + hb, tmp, size_t(n) * 2);
    } else if (bf) {
      k.store(acc, static_cast<bf16*>(out_row) + hb, DType::kBF16, size_t(n));
    } else if (stream) {
      internal::stream_copy(static_cast<float*>(out_row) + hb, acc, size_t(n) * 4);
    } else {
      std::memcpy(static_cast<float*>(out_row) + hb, acc, size_t(n) * 4);
    }
  }
}

// d = fp32 0; for h ascending: d += float(g[h]) * float(y[h]) for rows b..e of one worker.
// Each chain is sequential by definition; the kernel keeps up to 4 chains in flight.
void dot_rows(const RowKernels& k, const TensorView& grad_out, const TensorView& rows,
              const int32_t* idx, int64_t b, int64_t e, float* out) {
  const void* g[4];
  const void* y[4];
  int64_t group[4];
  float d[4];
  int n = 0;
  auto flush = [&] {
    k.dot(g, grad_out.dtype, y, rows.dtype, n, size_t(rows.cols), d);
    for (int q = 0; q < n; ++q) out[group[q]] = d[q];
    n = 0;
  };
  for (int64_t i = b; i < e; ++i) {
    if (idx[i] < 0) {
      out[i] = 0.0f;
      continue;
    }
    g[n] = grad_out.row_ptr(idx[i]);
    y[n] = rows.row_ptr(i);
    group[n++] = i;
    if (n == 4) flush();
  }
  if (n) flush();
}

}  // namespace

Status unpermute_into(const TensorView& rows, std::span<const int32_t> sorted_indices,
                      std::span<const float> probs, const TensorView& out, ThreadPool& pool) {
  MOED_RETURN_IF_ERROR(check_float_rows("rows", rows, -1, -1));
  const int64_t N = rows.rows;
  if (int64_t(sorted_indices.size()) != N) {
    return invalid_argument("sorted_indices has ", sorted_indices.size(), " entries for ", N,
                            " rows");
  }
  if (!probs.empty() && int64_t(probs.size()) != N) {
    return invalid_argument("probs has ", probs.size(), " entries for ", N,
                            " rows (give none for an unweighted unpermute)");
  }
  MOED_RETURN_IF_ERROR(internal::check_view("out", out, -1, rows.cols));
  if (out.dtype != rows.dtype) {
    return invalid_argument("out is ", dtype_name(out.dtype), "; rows are ",
                            dtype_name(rows.dtype));
  }
  const int64_t T = out.rows;
  MOED_RETURN_IF_ERROR(check_indices(sorted_indices, T));

  const RowKernels& k = row_kernels();
  const int32_t* idx = sorted_indices.data();
  const float* p = probs.empty() ? nullptr : probs.data();
  const bool stream = size_t(T) * out.row_bytes() >= internal::kStreamThresholdBytes;
  pool.parallel_for(T, [&](int64_t tb, int64_t te, int) {
    // This worker's tokens' rows, grouped by token, each group in row order (counting sort).
    std::vector<int64_t> start(size_t(te - tb) + 1, 0);
    for (int64_t i = 0; i < N; ++i) {
      if (idx[i] >= tb && idx[i] < te) ++start[size_t(idx[i] - tb) + 1];
    }
    for (size_t t = 1; t < start.size(); ++t) start[t] += start[t - 1];
    std::vector<int64_t> list(size_t(start.back()));
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < N; ++i) {
      if (idx[i] >= tb && idx[i] < te) list[size_t(fill[size_t(idx[i] - tb)]++)] = i;
    }
    const size_t block = size_t(std::min(kBlock, std::max<int64_t>(rows.cols, 1)));
    std::vector<float> acc(block);
    std::vector<bf16> tmp(stream ? block : 0);
    for (int64_t t = tb; t < te; ++t) {
      const size_t j = size_t(t - tb);
      reduce_token(k, rows, list.data() + start[j], start[j + 1] - start[j], p, out.row_ptr(t),
                   acc.data(), stream, tmp.data());
    }
    if (stream) internal::stream_fence();
  });
  return ok_status();
}

StatusOr<Tensor> unpermute(const TensorView& rows, std::span<const int32_t> sorted_indices,
                           int64_t num_tokens, std::span<const float> probs, ThreadPool& pool) {
  MOED_RETURN_IF_ERROR(check_float_rows("rows", rows, -1, -1));
  if (num_tokens < 0) return invalid_argument("num_tokens = ", num_tokens, " is negative");
  Tensor out = Tensor::empty(rows.dtype, num_tokens, rows.cols);
  MOED_RETURN_IF_ERROR(unpermute_into(rows, sorted_indices, probs, out.view(), pool));
  return out;
}

StatusOr<PermuteGrad> permute_backward(const TensorView& grad_rows,
                                       std::span<const float> grad_permuted_probs,
                                       const PermuteLayout& layout, ThreadPool& pool) {
  MOED_RETURN_IF_ERROR(check_float_rows("grad_rows", grad_rows, layout.num_rows, -1));
  if (!grad_permuted_probs.empty() && int64_t(grad_permuted_probs.size()) != layout.num_rows) {
    return invalid_argument("grad_permuted_probs has ", grad_permuted_probs.size(), " entries for ",
                            layout.num_rows, " rows");
  }
  PermuteGrad g;
  MOED_ASSIGN_OR_RETURN(g.grad_tokens,
                        unpermute(grad_rows, layout.sorted_indices, layout.num_tokens, {}, pool));
  if (grad_permuted_probs.empty()) {
    g.grad_probs.assign(size_t(layout.num_tokens) * layout.num_experts, 0.0f);
  } else {
    MOED_ASSIGN_OR_RETURN(g.grad_probs, row_values_to_map(layout, grad_permuted_probs));
  }
  return g;
}

StatusOr<UnpermuteGrad> unpermute_backward(const TensorView& grad_out,
                                           std::span<const int32_t> sorted_indices,
                                           std::span<const float> probs, const TensorView& rows,
                                           ThreadPool& pool) {
  MOED_RETURN_IF_ERROR(check_float_rows("grad_out", grad_out, -1, -1));
  const int64_t N = int64_t(sorted_indices.size());
  const bool weighted = !probs.empty();
  if (weighted) {
    if (int64_t(probs.size()) != N) {
      return invalid_argument("probs has ", probs.size(), " entries for ", N,
                              " sorted_indices (give none for an unweighted unpermute)");
    }
    MOED_RETURN_IF_ERROR(check_float_rows("rows", rows, N, grad_out.cols));
  }
  MOED_RETURN_IF_ERROR(check_indices(sorted_indices, grad_out.rows));

  UnpermuteGrad g;
  g.grad_rows = Tensor::empty(grad_out.dtype, N, grad_out.cols);
  if (weighted) g.grad_row_probs.assign(size_t(N), 0.0f);
  const TensorView out = g.grad_rows.view();
  const RowKernels& k = row_kernels();
  const int32_t* idx = sorted_indices.data();
  const size_t row_bytes = grad_out.row_bytes();
  pool.parallel_for(
      N,
      [&](int64_t b, int64_t e, int) {
        for (int64_t i = b; i < e; ++i) {
          const int32_t t = idx[i];
          if (t < 0) {
            std::memset(out.row_ptr(i), 0, row_bytes);
          } else if (!weighted) {
            std::memcpy(out.row_ptr(i), grad_out.row_ptr(t), row_bytes);
          } else {
            k.scale(out.row_ptr(i), grad_out.row_ptr(t), grad_out.dtype, probs[size_t(i)],
                    size_t(out.cols));
          }
        }
        if (!weighted) return;
        dot_rows(k, grad_out, rows, idx, b, e, g.grad_row_probs.data());
      },
      16);
  return g;
}

}  // namespace moed
