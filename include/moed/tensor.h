// Tensors: a non-owning 2-D view with a row stride, and an owning, 64-byte-aligned tensor.
//
// moed's API takes views, so callers (a PyTorch binding, a CUDA backend later) keep owning
// their memory; moed allocates only what it returns.
//
//   moed::Tensor t = moed::Tensor::zeros(moed::DType::kBF16, rows, hidden);
//   moed::TensorView v = t.view();
//   moed::bf16* r3 = v.row<moed::bf16>(3);
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "moed/dtype.h"
#include "moed/status.h"

namespace moed {

// rows x cols elements of `dtype`; row i starts at data + i * row_stride elements.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;  // in elements; >= cols

  TensorView() = default;
  TensorView(void* d, DType t, int64_t r, int64_t c, int64_t stride = -1)
      : data(d), dtype(t), rows(r), cols(c), row_stride(stride < 0 ? c : stride) {}

  size_t element_size() const { return dtype_size(dtype); }
  size_t row_bytes() const { return size_t(cols) * element_size(); }
  bool contiguous() const { return row_stride == cols; }
  bool empty() const { return rows == 0 || cols == 0; }

  void* row_ptr(int64_t i) const {
    return static_cast<char*>(data) + size_t(i) * size_t(row_stride) * element_size();
  }
  template <typename T>
  T* row(int64_t i) const {
    return static_cast<T*>(row_ptr(i));
  }
  template <typename T>
  std::span<T> row_span(int64_t i) const {
    return std::span<T>(row<T>(i), size_t(cols));
  }
  // Rows [begin, begin + count).
  TensorView slice_rows(int64_t begin, int64_t count) const {
    return TensorView(row_ptr(begin), dtype, count, cols, row_stride);
  }
};

// Token rows as dispatch moves them: the payload, plus its per-128-channel scales when the
// payload is FP8 (scales: float32 [rows, cols / 128]; empty otherwise).
struct TokenRows {
  TensorView x;
  TensorView scales;
  bool has_scales() const { return x.dtype == DType::kFP8; }
};

// Owning, move-only, 64-byte aligned, rows packed (row_stride == cols).
class Tensor {
 public:
  Tensor() = default;
  ~Tensor();
  Tensor(Tensor&& other) noexcept;
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  static Tensor empty(DType dtype, int64_t rows, int64_t cols);  // uninitialised
  static Tensor zeros(DType dtype, int64_t rows, int64_t cols);
  // A packed copy of any view.
  static Tensor copy_of(const TensorView& v);

  TensorView view() const { return TensorView(data_, dtype_, rows_, cols_, cols_); }
  operator TensorView() const { return view(); }  // NOLINT
  void* data() const { return data_; }
  DType dtype() const { return dtype_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  size_t bytes() const { return size_t(rows_) * size_t(cols_) * dtype_size(dtype_); }
  template <typename T>
  T* row(int64_t i) const {
    return view().row<T>(i);
  }

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  int64_t rows_ = 0;
  int64_t cols_ = 0;
};

// Owning counterpart of TokenRows.
struct TokenTensor {
  Tensor x;
  Tensor scales;  // FP8 only
  TokenRows rows() const { return TokenRows{x.view(), scales.view()}; }
};

// Large Tensor blocks (1 MiB and up) are kept when a Tensor is freed and reused for the next
// Tensor of the same size, so a step that returns a fresh output every call (combine, say)
// touches warm pages instead of faulting in new ones. The cache holds at most a limit of
// bytes (default 1 GiB; MOED_TENSOR_CACHE_BYTES sets it at start-up, 0 turns the cache off;
// off under the sanitizers), dropping the least recently freed blocks first.
struct TensorCacheStats {
  size_t cached_bytes = 0;  // held free, ready for reuse
  size_t limit_bytes = 0;
  uint64_t hits = 0;    // large allocations served from the cache
  uint64_t misses = 0;  // large allocations that went to the system
};
void set_tensor_cache_limit(size_t bytes);  // evicts down to the new limit at once
void release_tensor_cache();                // frees every cached block; the limit stays
TensorCacheStats tensor_cache_stats();

// True when both views have equal shape, dtype and bytes in every row (bitwise equality).
bool bitwise_equal(const TensorView& a, const TensorView& b);

}  // namespace moed
