#include "core/row_checks.h"

namespace moed::internal {

Status check_view(const char* what, const TensorView& v, int64_t rows, int64_t cols) {
  if (v.rows < 0 || v.cols < 0) {
    return invalid_argument(what, " is [", v.rows, ", ", v.cols, "]; sizes must be >= 0");
  }
  if ((rows >= 0 && v.rows != rows) || (cols >= 0 && v.cols != cols)) {
    return invalid_argument(what, " is [", v.rows, ", ", v.cols, "]; expected [",
                            rows >= 0 ? rows : v.rows, ", ", cols >= 0 ? cols : v.cols, "]");
  }
  if (v.row_stride < v.cols) {
    return invalid_argument(what, " row_stride = ", v.row_stride, " < cols = ", v.cols);
  }
  if (v.rows > 0 && v.cols > 0 && v.data == nullptr) {
    return invalid_argument(what, ".data is null");
  }
  return ok_status();
}

Status check_token_rows(const char* what, const TokenRows& x, int64_t rows) {
  const TensorView &v = x.x, &sc = x.scales;
  if (v.rows >= 0 && v.cols <= 0) {
    return invalid_argument(what, " is [", v.rows, ", ", v.cols,
                            "]; the hidden size must be positive (also on ranks with 0 tokens)");
  }
  MOED_RETURN_IF_ERROR(check_view(what, v, rows, -1));
  if (v.dtype != DType::kFP8) return ok_status();
  if (v.cols % kFp8BlockSize != 0) {
    return invalid_argument(what, " is fp8 with hidden = ", v.cols, ", not a multiple of ",
                            kFp8BlockSize);
  }
  const int64_t scales = v.cols / kFp8BlockSize;
  if (sc.dtype != DType::kF32 || sc.rows != v.rows || sc.cols != scales ||
      (v.rows > 0 && sc.data == nullptr) || sc.row_stride < sc.cols) {
    return invalid_argument(what, " scales must be f32 [", v.rows, ", ", scales,
                            "] with row_stride >= ", scales, "; got ", dtype_name(sc.dtype), " [",
                            sc.rows, ", ", sc.cols, "] with row_stride ", sc.row_stride);
  }
  return ok_status();
}

Status check_float_rows(const char* what, const TensorView& v, int64_t rows, int64_t cols) {
  if (v.dtype != DType::kF32 && v.dtype != DType::kBF16) {
    return invalid_argument(what, " dtype is ", dtype_name(v.dtype), "; expected f32 or bf16");
  }
  return check_view(what, v, rows, cols);
}

Status check_out_buffer(const char* what, const TensorView& out, int64_t rows, int64_t cols,
                        DType dtype, const char* dtype_of) {
  if (out.rows == rows && out.cols == cols && out.dtype != dtype) {  // a wrong shape comes first
    return invalid_argument(what, " dtype is ", dtype_name(out.dtype), "; expected ",
                            dtype_name(dtype), " (the dtype of ", dtype_of, ")");
  }
  return check_view(what, out, rows, cols);
}

}  // namespace moed::internal
