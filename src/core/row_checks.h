// The checks of the rows a call is given, one form for every entry point (dispatchers, DeepEP's
// calls, the permute functions): a view's shape, stride and data, token rows (x, with their fp8
// scales), float rows (expert outputs, gradients) and a caller-owned output buffer. A message
// names the argument (`what`) and the value. A dispatcher's verdict joins the call's agreement,
// so a bad input on one rank is every rank's error and no rank writes into a buffer it rejected.
#pragma once

#include <cstdint>

#include "moed/status.h"
#include "moed/tensor.h"

namespace moed::internal {

// `v` is [rows, cols] (either -1: any), sizes >= 0, row_stride >= cols, data unless empty.
Status check_view(const char* what, const TensorView& v, int64_t rows, int64_t cols);

// Token rows of `rows` (-1: any): f32, bf16 or fp8, with a positive hidden size (also with 0
// rows); fp8 rows have a hidden that is a multiple of 128 and f32 scales [rows, hidden / 128].
Status check_token_rows(const char* what, const TokenRows& x, int64_t rows = -1);

// f32 or bf16 rows (expert outputs, gradients), as check_view.
Status check_float_rows(const char* what, const TensorView& v, int64_t rows, int64_t cols);

// A caller-owned output buffer: [rows, cols] of `dtype`, the dtype of the input `dtype_of`.
Status check_out_buffer(const char* what, const TensorView& out, int64_t rows, int64_t cols,
                        DType dtype, const char* dtype_of);

}  // namespace moed::internal
