// The checks of the rows a dispatcher is given, one form for every dispatcher: token rows
// (x, with fp8 scales), a caller-owned output buffer (CombineInput::out, the `out` of the
// DeepEP-style calls) and float rows (Flex's and the rank-major combine's). Their verdicts
// join the call's own agreement, so a bad input on one rank is every rank's error and no rank
// writes into a buffer it rejected.
#pragma once

#include <cstdint>

#include "moed/status.h"
#include "moed/tensor.h"

namespace moed::internal {

// `what` (the argument's name) has a positive hidden size (also with 0 rows), row_stride >=
// hidden, data unless empty; fp8 rows have f32 scales [rows, hidden / 128] with row_stride >=
// their columns.
inline Status check_token_rows(const char* what, const TokenRows& x) {
  const TensorView &v = x.x, &sc = x.scales;
  if (v.rows < 0 || v.cols <= 0) {
    return invalid_argument(what, " is [", v.rows, ", ", v.cols,
                            "]; the hidden size must be positive (also on ranks with 0 tokens)");
  }
  if (v.rows > 0 && v.data == nullptr) return invalid_argument(what, ".data is null");
  if (v.row_stride < v.cols)
    return invalid_argument(what, " row_stride = ", v.row_stride, " < hidden = ", v.cols);
  if (v.dtype != DType::kFP8) return ok_status();
  if (v.cols % kFp8BlockSize != 0)
    return invalid_argument(what, " is fp8 with hidden = ", v.cols, ", not a multiple of ",
                            kFp8BlockSize);
  if (sc.dtype != DType::kF32 || sc.rows != v.rows || sc.cols != v.cols / kFp8BlockSize ||
      (v.rows > 0 && sc.data == nullptr) || sc.row_stride < sc.cols) {
    return invalid_argument(what, " scales must be f32 [", v.rows, ", ", v.cols / kFp8BlockSize,
                            "] with row_stride >= ", v.cols / kFp8BlockSize, "; got ",
                            dtype_name(sc.dtype), " [", sc.rows, ", ", sc.cols,
                            "] with row_stride ", sc.row_stride);
  }
  return ok_status();
}

// `what` is the argument's name ("out"); rows x cols of `dtype` (named by `dtype_of`, the input
// it must match), row_stride >= cols, data non-null unless empty.
inline Status check_out_buffer(const char* what, const TensorView& out, int64_t rows, int64_t cols,
                               DType dtype, const char* dtype_of) {
  if (out.rows != rows || out.cols != cols) {
    return invalid_argument(what, " is [", out.rows, ", ", out.cols, "]; expected [", rows, ", ",
                            cols, "]");
  }
  if (out.dtype != dtype) {
    return invalid_argument(what, " dtype is ", dtype_name(out.dtype), "; expected ",
                            dtype_name(dtype), " (the dtype of ", dtype_of, ")");
  }
  if (out.row_stride < out.cols) {
    return invalid_argument(what, " row_stride = ", out.row_stride, " < ", out.cols, " columns");
  }
  if (out.rows > 0 && out.cols > 0 && out.data == nullptr)
    return invalid_argument(what, ".data is null for [", rows, ", ", cols, "]");
  return ok_status();
}

// `what` is [rows, cols] of f32 or bf16, row_stride >= cols, data non-null unless empty.
inline Status check_float_rows(const char* what, const TensorView& v, int64_t rows, int64_t cols) {
  if (v.dtype != DType::kF32 && v.dtype != DType::kBF16) {
    return invalid_argument(what, " dtype is ", dtype_name(v.dtype), "; it must be f32 or bf16");
  }
  if (v.rows != rows || v.cols != cols) {
    return invalid_argument(what, " is [", v.rows, ", ", v.cols, "]; expected [", rows, ", ", cols,
                            "]");
  }
  if (v.rows > 0 && v.data == nullptr) return invalid_argument(what, ".data is null");
  if (v.row_stride < v.cols)
    return invalid_argument(what, " row_stride = ", v.row_stride, " < ", v.cols);
  return ok_status();
}

}  // namespace moed::internal
