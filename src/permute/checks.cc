#include "permute/checks.h"

namespace moed::permute_internal {

Status check_view(const char* what, const TensorView& v, int64_t rows, int64_t cols) {
  if (v.rows < 0 || v.cols < 0) {
    return invalid_argument(what, " is [", v.rows, ", ", v.cols, "]; sizes must be >= 0");
  }
  if (rows >= 0 && v.rows != rows) {
    return invalid_argument(what, " has ", v.rows, " rows; expected ", rows);
  }
  if (cols >= 0 && v.cols != cols) {
    return invalid_argument(what, " has ", v.cols, " columns; expected ", cols);
  }
  if (v.row_stride < v.cols) {
    return invalid_argument(what, " row_stride = ", v.row_stride, " < cols = ", v.cols);
  }
  if (!v.empty() && v.data == nullptr) return invalid_argument(what, " data is null");
  return ok_status();
}

Status check_token_rows(const char* what, const TokenRows& t, int64_t rows) {
  MOED_RETURN_IF_ERROR(check_view(what, t.x, rows, -1));
  if (t.x.dtype != DType::kFP8) return ok_status();
  if (t.x.cols % kFp8BlockSize != 0) {
    return invalid_argument(what, ": fp8 hidden = ", t.x.cols, " is not a multiple of ",
                            kFp8BlockSize);
  }
  if (t.scales.dtype != DType::kF32) {
    return invalid_argument(what, ": fp8 scales must be f32; got ", dtype_name(t.scales.dtype));
  }
  return check_view(str_cat(what, " scales").c_str(), t.scales, t.x.rows, t.x.cols / kFp8BlockSize);
}

Status check_float_rows(const char* what, const TensorView& v, int64_t rows, int64_t cols) {
  if (v.dtype != DType::kF32 && v.dtype != DType::kBF16) {
    return invalid_argument(what, " must be f32 or bf16; got ", dtype_name(v.dtype));
  }
  return check_view(what, v, rows, cols);
}

}  // namespace moed::permute_internal
