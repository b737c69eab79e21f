// The row kernels behind dtype.h, one table per instruction set. dtype.cc picks a table once
// (CPU support, capped by MOED_ISA); tests compare every table the CPU can run with the
// scalar one bit for bit.
#pragma once

#include <cstddef>

#include "moed/dtype.h"

namespace moed::internal {

struct RowKernels {
  const char* isa;
  void (*convert)(const void* src, DType src_type, void* dst, DType dst_type, size_t n);
  void (*accumulate)(float* acc, const void* src, DType t, size_t n);
  void (*accumulate_weighted)(float* acc, const void* src, DType t, float w, size_t n);
  void (*store)(const float* acc, void* dst, DType t, size_t n);
  // x is f32 or bf16; n % kFp8BlockSize == 0; scales_inv gets n / kFp8BlockSize entries.
  void (*quantize_fp8)(const void* x, DType t, bool round_scale, fp8_e4m3* out, float* scales_inv,
                       size_t n);
  void (*dequantize_fp8)(const fp8_e4m3* q, const float* scales_inv, float* out, size_t n);
};

// Always available; the definition the vector tables must match.
const RowKernels& scalar_kernels();
// nullptr when this CPU (or this build) cannot run them.
const RowKernels* avx2_kernels();
const RowKernels* avx512_kernels();
// The table the public row functions use.
const RowKernels& active_kernels();

// Per block: scale_inv as stored, and the factor the values are multiplied by (spec §6).
// Shared by every table so the scale arithmetic is written once.
inline float fp8_block_scale(float amax, bool round_scale, float* scale_inv) {
  *scale_inv = fp8_scale_inv(amax, round_scale);
  // NOTE: with round_scale the scale is 1 / scale_inv, exact because scale_inv is a power of
  // two; otherwise 448 / amax, which is not always the reciprocal of amax / 448 in fp32.
  return round_scale ? 1.0f / *scale_inv : kFp8Max / (amax < 1e-4f ? 1e-4f : amax);
}

}  // namespace moed::internal
