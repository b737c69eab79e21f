// AVX-512 row kernels (16 lanes, AVX512F and AVX512BW); the algorithms are in dtype_simd.h.
//
// NOTE: no AVX512-BF16 here: VCVTNEPS2BF16 flushes subnormal inputs to zero, so it is not
// bit-equal to float_to_bf16; the integer rounding in dtype_simd.h is.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "core/row_kernels.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")
// NOTE: GCC 12's avx512fintrin.h trips -Wmaybe-uninitialized on its own _mm512_undefined_*.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "core/dtype_simd.h"

namespace moed::internal {
namespace {

struct Avx512 {
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;
  static constexpr int kWidth = 16;
  MOED_SIMD_LANE_OPS(_mm512, si512)

  static I load_u16(const uint16_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static I load_u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // Truncating narrows (VPMOVDW / VPMOVDB); lanes hold values < 2^16 / < 2^8.
  static void store_u16(uint16_t* p, I v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(v));
  }
  static void store_u16x2(uint16_t* p, I a, I b) {
    store_u16(p, a);
    store_u16(p + kWidth, b);
  }
  // Non-temporal; p is 64-byte aligned.
  static void stream_u16x2(uint16_t* p, I a, I b) {
    const I packed = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(a)),
                                        _mm512_cvtepi32_epi16(b), 1);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), packed);
  }
  static void store_u8(uint8_t* p, I v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
  }
  // Two packs per 128-bit lane k give the dwords (a, b, c, d)[4k .. 4k + 3]; the permute puts
  // a's four first. Three shuffles and a store where four VPMOVDB stores were slow (Zen 4).
  static void store_u8x4(uint8_t* p, I a, I b, I c, I d) {
    const I bytes = _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_packus_epi32(c, d));
    const I order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_si512(p, _mm512_permutexvar_epi32(order, bytes));
  }
  static float hmaxf(F v) { return _mm512_reduce_max_ps(v); }

  // Signed compare; every caller compares values in [0, 2^31).
  static M gt(I a, I b) { return _mm512_cmpgt_epi32_mask(a, b); }
  static M isnan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  static bool any(M m) { return m != 0; }
  // mask_blend(k, a, b) takes b where k is set.
  static I select(M m, I if_true, I if_false) {
    return _mm512_mask_blend_epi32(m, if_false, if_true);
  }
};

constexpr RowKernels kAvx512 = Simd<Avx512>::table("avx512");

}  // namespace
}  // namespace moed::internal

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

namespace moed::internal {

const RowKernels* avx512_kernels() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? &kAvx512
                                                                                 : nullptr;
}

}  // namespace moed::internal
