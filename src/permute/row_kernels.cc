#include "permute/row_kernels.h"

#include <algorithm>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace moed::permute_internal {

namespace {

#define MOED_ALWAYS_INLINE inline __attribute__((always_inline))

MOED_ALWAYS_INLINE float load(const float* y, int64_t h) { return y[h]; }
MOED_ALWAYS_INLINE float load(const bf16* y, int64_t h) {
  uint16_t b;
  std::memcpy(&b, y + h, 2);
  return bits_to_float(uint32_t(b) << 16);
}

// float_to_bf16 written branch-free so that the vectoriser turns the NaN case into a blend.
MOED_ALWAYS_INLINE uint16_t round_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x0040u;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

template <typename T>
MOED_ALWAYS_INLINE void first_body(float* __restrict acc, const T* __restrict y, int64_t n) {
  for (int64_t h = 0; h < n; ++h) acc[h] = 0.0f + load(y, h);
}
template <typename T>
MOED_ALWAYS_INLINE void add_body(float* __restrict acc, const T* __restrict y, int64_t n) {
  for (int64_t h = 0; h < n; ++h) acc[h] = acc[h] + load(y, h);
}
template <typename T>
MOED_ALWAYS_INLINE void first_weighted_body(float* __restrict acc, const T* __restrict y, float p,
                                            int64_t n) {
  for (int64_t h = 0; h < n; ++h) acc[h] = 0.0f + p * load(y, h);
}
template <typename T>
MOED_ALWAYS_INLINE void add_weighted_body(float* __restrict acc, const T* __restrict y, float p,
                                          int64_t n) {
  for (int64_t h = 0; h < n; ++h) acc[h] = acc[h] + p * load(y, h);
}
MOED_ALWAYS_INLINE void store_bf16_body(bf16* __restrict out, const float* __restrict acc,
                                        int64_t n) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  for (int64_t h = 0; h < n; ++h) o[h] = round_bf16(acc[h]);
}
MOED_ALWAYS_INLINE void scale_f32_body(float* __restrict out, const float* __restrict g, float p,
                                       int64_t n) {
  for (int64_t h = 0; h < n; ++h) out[h] = p * g[h];
}
MOED_ALWAYS_INLINE void scale_bf16_body(bf16* __restrict out, const bf16* __restrict g, float p,
                                        int64_t n) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  for (int64_t h = 0; h < n; ++h) o[h] = round_bf16(p * load(g, h));
}

// One set of kernels per instruction set: the bodies above inlined into functions carrying
// the target attribute, so the compiler vectorises each for that ISA.
#define MOED_ROW_KERNELS(ns, attr)                                                        \
  namespace ns {                                                                          \
  attr void first_f32(float* a, const float* y, int64_t n) { first_body(a, y, n); }       \
  attr void first_bf16(float* a, const bf16* y, int64_t n) { first_body(a, y, n); }       \
  attr void add_f32(float* a, const float* y, int64_t n) { add_body(a, y, n); }           \
  attr void add_bf16(float* a, const bf16* y, int64_t n) { add_body(a, y, n); }           \
  attr void first_weighted_f32(float* a, const float* y, float p, int64_t n) {            \
    first_weighted_body(a, y, p, n);                                                      \
  }                                                                                       \
  attr void first_weighted_bf16(float* a, const bf16* y, float p, int64_t n) {            \
    first_weighted_body(a, y, p, n);                                                      \
  }                                                                                       \
  attr void add_weighted_f32(float* a, const float* y, float p, int64_t n) {              \
    add_weighted_body(a, y, p, n);                                                        \
  }                                                                                       \
  attr void add_weighted_bf16(float* a, const bf16* y, float p, int64_t n) {              \
    add_weighted_body(a, y, p, n);                                                        \
  }                                                                                       \
  attr void store_bf16(bf16* o, const float* a, int64_t n) { store_bf16_body(o, a, n); }  \
  attr void scale_f32(float* o, const float* g, float p, int64_t n) {                     \
    scale_f32_body(o, g, p, n);                                                           \
  }                                                                                       \
  attr void scale_bf16(bf16* o, const bf16* g, float p, int64_t n) {                      \
    scale_bf16_body(o, g, p, n);                                                          \
  }                                                                                       \
  const RowKernels kKernels = {first_f32,        first_bf16,         add_f32,             \
                               add_bf16,         first_weighted_f32, first_weighted_bf16, \
                               add_weighted_f32, add_weighted_bf16,  store_bf16,          \
                               scale_f32,        scale_bf16};                             \
  }

MOED_ROW_KERNELS(portable, )
MOED_ROW_KERNELS(avx2, __attribute__((target("avx2"))))
MOED_ROW_KERNELS(avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))))

#undef MOED_ROW_KERNELS

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}
bool has_avx2() { return __builtin_cpu_supports("avx2"); }

}  // namespace

void stream_copy(void* dst, const void* src, size_t bytes) {
#if defined(__SSE2__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const size_t head = std::min(bytes, (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15);
  std::memcpy(d, s, head);
  d += head, s += head, bytes -= head;
  for (; bytes >= 64; d += 64, s += 64, bytes -= 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  std::memcpy(d, s, bytes);
#else
  std::memcpy(dst, src, bytes);
#endif
}

void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

const RowKernels* row_kernels_variant(const char* name) {
  if (std::strcmp(name, "portable") == 0) return &portable::kKernels;
  if (std::strcmp(name, "avx2") == 0) return has_avx2() ? &avx2::kKernels : nullptr;
  if (std::strcmp(name, "avx512") == 0) return has_avx512() ? &avx512::kKernels : nullptr;
  return nullptr;
}

const char* row_kernels_name() {
  static const char* const name = has_avx512() ? "avx512" : has_avx2() ? "avx2" : "portable";
  return name;
}

const RowKernels& row_kernels() {
  static const RowKernels* const k = row_kernels_variant(row_kernels_name());
  return *k;
}

}  // namespace moed::permute_internal
