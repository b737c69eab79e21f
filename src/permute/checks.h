// Input checks shared by the permute area's entry points (messages name the argument).
#pragma once

#include <cstdint>
#include <string>

#include "moed/status.h"
#include "moed/tensor.h"

namespace moed::permute_internal {

// A view of `rows` x `cols` (either may be checked as -1 = any), valid stride and data.
Status check_view(const char* what, const TensorView& v, int64_t rows, int64_t cols);

// Token rows: f32 / bf16 / fp8 (fp8 with f32 scales [rows, cols / 128]). rows = -1: any.
Status check_token_rows(const char* what, const TokenRows& t, int64_t rows);

// f32 or bf16 only (expert outputs, gradients).
Status check_float_rows(const char* what, const TensorView& v, int64_t rows, int64_t cols);

}  // namespace moed::permute_internal
