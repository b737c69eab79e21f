#include "moed/tensor.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "core/block_cache.h"

namespace moed {

Tensor::~Tensor() { internal::release_block(data_, bytes()); }

Tensor::Tensor(Tensor&& o) noexcept
    : data_(o.data_), dtype_(o.dtype_), rows_(o.rows_), cols_(o.cols_) {
  o.data_ = nullptr;
  o.rows_ = o.cols_ = 0;
}

Tensor& Tensor::operator=(Tensor&& o) noexcept {
  if (this != &o) {
    internal::release_block(data_, bytes());
    data_ = o.data_;
    dtype_ = o.dtype_;
    rows_ = o.rows_;
    cols_ = o.cols_;
    o.data_ = nullptr;
    o.rows_ = o.cols_ = 0;
  }
  return *this;
}

Tensor Tensor::empty(DType dtype, int64_t rows, int64_t cols) {
  MOED_CHECK(rows >= 0 && cols >= 0, "rows = ", rows, ", cols = ", cols);
  MOED_CHECK(cols == 0 || rows <= INT64_MAX / cols / int64_t(dtype_size(dtype)), "rows = ", rows,
             ", cols = ", cols, " overflows the byte count");
  Tensor t;
  t.dtype_ = dtype;
  t.rows_ = rows;
  t.cols_ = cols;
  t.data_ = internal::allocate_block(t.bytes());
  return t;
}

Tensor Tensor::zeros(DType dtype, int64_t rows, int64_t cols) {
  Tensor t = empty(dtype, rows, cols);
  if (t.data_) std::memset(t.data_, 0, t.bytes());
  return t;
}

Tensor Tensor::copy_of(const TensorView& v) {
  Tensor t = empty(v.dtype, v.rows, v.cols);
  // NOTE: empty views may carry a null data pointer, which memcpy must never see.
  if (t.bytes() == 0) return t;
  if (v.contiguous()) {
    std::memcpy(t.data_, v.data, t.bytes());
    return t;
  }
  for (int64_t i = 0; i < v.rows; ++i)
    std::memcpy(t.view().row_ptr(i), v.row_ptr(i), v.row_bytes());
  return t;
}

bool bitwise_equal(const TensorView& a, const TensorView& b) {
  if (a.dtype != b.dtype || a.rows != b.rows || a.cols != b.cols) return false;
  if (a.empty()) return true;
  for (int64_t i = 0; i < a.rows; ++i) {
    if (std::memcmp(a.row_ptr(i), b.row_ptr(i), a.row_bytes()) != 0) return false;
  }
  return true;
}

}  // namespace moed
