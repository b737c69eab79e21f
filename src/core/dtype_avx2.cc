// AVX2 row kernels (8 lanes); the algorithms are in dtype_simd.h.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "core/row_kernels.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2")
#endif

#include "core/dtype_simd.h"

namespace moed::internal {
namespace {

struct Avx2 {
  using F = __m256;
  using I = __m256i;
  using M = __m256i;
  static constexpr int kWidth = 8;
  MOED_SIMD_LANE_OPS(_mm256, si256)

  static I load_u16(const uint16_t* p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I load_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  // Lanes hold values < 2^16 (< 2^8 for store_u8), so unsigned saturation never changes them;
  // packs work per 128-bit half, hence the lane permutes.
  static void store_u16(uint16_t* p, I v) {
    const I packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  // One pack of both (per 128-bit half: a0-3 b0-3 | a4-7 b4-7), then the quarters in order.
  static void store_u16x2(uint16_t* p, I a, I b) {
    const I packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  }
  // Non-temporal; p is 32-byte aligned.
  static void stream_u16x2(uint16_t* p, I a, I b) {
    const I packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), packed);
  }
  static void store_u8(uint8_t* p, I v) {
    const I w = _mm256_packus_epi16(_mm256_packus_epi32(v, v), _mm256_setzero_si256());
    const I packed = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  // Per 128-bit half h the packs give the dwords (a, b, c, d)[4h .. 4h + 3]; the permute
  // interleaves the halves back into order.
  static void store_u8x4(uint8_t* p, I a, I b, I c, I d) {
    const I bytes = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
    const I order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permutevar8x32_epi32(bytes, order));
  }
  static float hmaxf(F v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }

  // Signed compare; every caller compares values in [0, 2^31).
  static M gt(I a, I b) { return _mm256_cmpgt_epi32(a, b); }
  static M isnan(F a) { return _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
  static bool any(M m) { return !_mm256_testz_si256(m, m); }
  static I select(M m, I if_true, I if_false) { return _mm256_blendv_epi8(if_false, if_true, m); }
};

constexpr RowKernels kAvx2 = Simd<Avx2>::table("avx2");

}  // namespace
}  // namespace moed::internal

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace moed::internal {

const RowKernels* avx2_kernels() { return __builtin_cpu_supports("avx2") ? &kAvx2 : nullptr; }

}  // namespace moed::internal
