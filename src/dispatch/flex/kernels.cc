// Row kernels of the Flex hot loops. One generic loop per kernel, compiled three times
// (AVX-512, AVX2, portable) and picked once at run time. Every lane does the same single fp32
// operations in the same order as the scalar loop (no FMA: -ffp-contract=off), so all three
// are bitwise identical.
#include <algorithm>
#include <cstring>

#include "dispatch/flex/flex_internal.h"

namespace moed::flex {

namespace {

#define MOED_INLINE inline __attribute__((always_inline))

MOED_INLINE float load_f(const float* p, int64_t i) { return p[i]; }
MOED_INLINE float load_f(const uint16_t* p, int64_t i) {
  return bits_to_float(uint32_t(p[i]) << 16);
}

// NOTE: rows are read from peers' segments in expert-major order, so each term starts a new
// stream and every 4 KiB page boundary stops the hardware prefetcher; the loops below walk a
// row in blocks and prefetch two blocks ahead. The arithmetic per element is unchanged.
constexpr int64_t kBlock = 512;

template <typename T>
MOED_INLINE void prefetch_ahead(const T* src, int64_t b, int64_t n) {
  const int64_t ahead = b + 2 * kBlock;
  if (ahead >= n) return;
  const char* p = reinterpret_cast<const char*>(src + ahead);
  const int64_t bytes = std::min<int64_t>(kBlock, n - ahead) * int64_t(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 0);
}

template <typename T>
MOED_INLINE void add_term_raw_loop(float* __restrict acc, const T* __restrict src, int64_t n) {
  for (int64_t b = 0; b < n; b += kBlock) {
    prefetch_ahead(src, b, n);
    const int64_t e = std::min(n, b + kBlock);
    for (int64_t i = b; i < e; ++i) acc[i] = acc[i] + (0.0f + load_f(src, i));
  }
}
template <typename T>
MOED_INLINE void add_term_raw_weighted_loop(float* __restrict acc, const T* __restrict src, float w,
                                            int64_t n) {
  for (int64_t b = 0; b < n; b += kBlock) {
    prefetch_ahead(src, b, n);
    const int64_t e = std::min(n, b + kBlock);
    for (int64_t i = b; i < e; ++i) acc[i] = acc[i] + w * (0.0f + load_f(src, i));
  }
}
template <typename T>
MOED_INLINE void accumulate_loop(float* __restrict term, const T* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) term[i] = term[i] + load_f(src, i);
}
MOED_INLINE void add_f32_loop(float* __restrict acc, const float* __restrict term, bool weighted,
                              float w, int64_t n) {
  if (weighted) {
    for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + w * term[i];
  } else {
    for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + term[i];
  }
}

struct Table {
  void (*add_term_raw)(float*, const void*, DType, bool, float, int64_t);
  void (*accumulate_raw)(float*, const void*, DType, int64_t);
  void (*add_term_f32)(float*, const float*, bool, float, int64_t);
};

#define MOED_FLEX_KERNELS(NS, ATTR)                                                          \
  namespace NS {                                                                             \
  ATTR void add_term_raw(float* acc, const void* src, DType dt, bool weighted, float w,      \
                         int64_t n) {                                                        \
    if (dt == DType::kF32) {                                                                 \
      if (weighted)                                                                          \
        add_term_raw_weighted_loop(acc, static_cast<const float*>(src), w, n);               \
      else                                                                                   \
        add_term_raw_loop(acc, static_cast<const float*>(src), n);                           \
    } else {                                                                                 \
      if (weighted)                                                                          \
        add_term_raw_weighted_loop(acc, static_cast<const uint16_t*>(src), w, n);            \
      else                                                                                   \
        add_term_raw_loop(acc, static_cast<const uint16_t*>(src), n);                        \
    }                                                                                        \
  }                                                                                          \
  ATTR void accumulate_raw(float* term, const void* src, DType dt, int64_t n) {              \
    if (dt == DType::kF32)                                                                   \
      accumulate_loop(term, static_cast<const float*>(src), n);                              \
    else                                                                                     \
      accumulate_loop(term, static_cast<const uint16_t*>(src), n);                           \
  }                                                                                          \
  ATTR void add_term_f32(float* acc, const float* term, bool weighted, float w, int64_t n) { \
    add_f32_loop(acc, term, weighted, w, n);                                                 \
  }                                                                                          \
  constexpr Table kTable = {add_term_raw, accumulate_raw, add_term_f32};                     \
  }

MOED_FLEX_KERNELS(portable, )
MOED_FLEX_KERNELS(avx2, __attribute__((target("avx2"))))
MOED_FLEX_KERNELS(avx512, __attribute__((target("avx512f,avx512bw"))))

const Table& table() {
  static const Table* t = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
      return &avx512::kTable;
    }
    if (__builtin_cpu_supports("avx2")) return &avx2::kTable;
    return &portable::kTable;
  }();
  return *t;
}

}  // namespace

void add_term_raw(float* acc, const void* src, DType dt, bool weighted, float w, int64_t n) {
  table().add_term_raw(acc, src, dt, weighted, w, n);
}
void accumulate_raw(float* term, const void* src, DType dt, int64_t n) {
  table().accumulate_raw(term, src, dt, n);
}
void add_term_f32(float* acc, const float* term, bool weighted, float w, int64_t n) {
  table().add_term_f32(acc, term, weighted, w, n);
}

void scale_row(void* dst, const void* src, DType dt, float w, int64_t n) {
  if (dt == DType::kF32) {
    const float* s = static_cast<const float*>(src);
    float* d = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = w * s[i];
  } else {
    const bf16* s = static_cast<const bf16*>(src);
    bf16* d = static_cast<bf16*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(w * bf16_to_float(s[i]));
  }
}

void store_row(void* dst, const float* acc, DType dt, int64_t n) {
  if (dt == DType::kF32) {
    std::memcpy(dst, acc, size_t(n) * sizeof(float));
  } else {
    convert_f32_to_bf16(std::span<const float>(acc, size_t(n)),
                        std::span<bf16>(static_cast<bf16*>(dst), size_t(n)));
  }
}

float dot_row(const void* g, DType dt, const float* term, int64_t n) {
  float d = 0.0f;
  if (dt == DType::kF32) {
    const float* s = static_cast<const float*>(g);
    for (int64_t i = 0; i < n; ++i) d += s[i] * term[i];
  } else {
    const bf16* s = static_cast<const bf16*>(g);
    for (int64_t i = 0; i < n; ++i) d += bf16_to_float(s[i]) * term[i];
  }
  return d;
}

}  // namespace moed::flex
