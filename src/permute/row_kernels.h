// Row kernels of the permute area: fp32 accumulation of f32 / bf16 rows in spec §4's order
// and the weighted row scaling of unpermute's backward. Each has a portable body compiled
// three times (baseline, AVX2, AVX-512) and picked once at run time; every element is the same
// single fp32 operation in each, so all three are bit-identical.
//
// NOTE: these would belong in moed/dtype.h (accumulate_row_f32 and friends) once the core
// area provides them; until then they live here, private to src/permute.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moed/dtype.h"

namespace moed::permute_internal {

struct RowKernels {
  // acc[h] = 0.0f + float(y[h])        (first contribution; 0 + -0 = +0 as the reference)
  void (*first_f32)(float* acc, const float* y, int64_t n);
  void (*first_bf16)(float* acc, const bf16* y, int64_t n);
  // acc[h] = acc[h] + float(y[h])
  void (*add_f32)(float* acc, const float* y, int64_t n);
  void (*add_bf16)(float* acc, const bf16* y, int64_t n);
  // acc[h] = 0.0f + p * float(y[h])
  void (*first_weighted_f32)(float* acc, const float* y, float p, int64_t n);
  void (*first_weighted_bf16)(float* acc, const bf16* y, float p, int64_t n);
  // acc[h] = acc[h] + p * float(y[h])
  void (*add_weighted_f32)(float* acc, const float* y, float p, int64_t n);
  void (*add_weighted_bf16)(float* acc, const bf16* y, float p, int64_t n);
  // out[h] = round(acc[h]) (bf16: nearest even)
  void (*store_bf16)(bf16* out, const float* acc, int64_t n);
  // out[h] = round(p * float(g[h]))
  void (*scale_f32)(float* out, const float* g, float p, int64_t n);
  void (*scale_bf16)(bf16* out, const bf16* g, float p, int64_t n);
};

// Copies `bytes` with non-temporal stores (no read-for-ownership of the destination, which a
// plain memcpy of a row pays and a large memcpy avoids): for outputs much larger than the
// caches. Call stream_fence() before the data is handed to another thread.
void stream_copy(void* dst, const void* src, size_t bytes);
void stream_fence();
// Asks for a row about to be read (rows land at random places, so the hardware prefetchers,
// which stop at page boundaries, find them late).
inline void prefetch_row(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}
// Outputs at least this large are written with stream_copy.
inline constexpr size_t kStreamThresholdBytes = size_t(8) << 20;

// The best kernels this CPU runs ("avx512", "avx2" or "portable" in name()).
const RowKernels& row_kernels();
const char* row_kernels_name();
// A specific variant, for tests that compare them: "portable", "avx2", "avx512"; nullptr when
// the CPU lacks it.
const RowKernels* row_kernels_variant(const char* name);

}  // namespace moed::permute_internal
