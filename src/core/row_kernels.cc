// The scalar row kernels (the definition every vector table must match), the choice of the
// table, and the copy helpers.
#include "core/row_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "moed/thread_pool.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace moed::internal {
namespace {

// NOTE: the element type is switched on once per row, not per element: body(load) gets a
// typed reader (with_store: a typed writer), so each loop is compiled per type and runs at
// memory speed even without vector code. The formulas are those of moed/dtype.h.
template <class Body>
void with_load(DType t, Body body) {
  switch (t) {
    case DType::kF32:
      return body([](const void* p, size_t i) { return static_cast<const float*>(p)[i]; });
    case DType::kBF16:
      return body(
          [](const void* p, size_t i) { return bf16_to_float(static_cast<const bf16*>(p)[i]); });
    case DType::kFP8:
      return body([](const void* p, size_t i) {
        return fp8_e4m3_to_float(static_cast<const fp8_e4m3*>(p)[i]);
      });
  }
  MOED_CHECK(false, "bad dtype ", int(t));
}

template <class Body>
void with_store(DType t, Body body) {
  switch (t) {
    case DType::kF32:
      return body([](void* p, size_t i, float v) { static_cast<float*>(p)[i] = v; });
    case DType::kBF16:
      return body([](void* p, size_t i, float v) { static_cast<bf16*>(p)[i] = float_to_bf16(v); });
    case DType::kFP8:
      return body(
          [](void* p, size_t i, float v) { static_cast<fp8_e4m3*>(p)[i] = float_to_fp8_e4m3(v); });
  }
  MOED_CHECK(false, "bad dtype ", int(t));
}

void convert_scalar(const void* src, DType st, void* dst, DType dt, size_t n) {
  if (st == dt) {
    if (n) std::memmove(dst, src, n * dtype_size(st));
    return;
  }
  with_load(st, [&](auto load) {
    with_store(dt, [&](auto store) {
      for (size_t i = 0; i < n; ++i) store(dst, i, load(src, i));
    });
  });
}

void accumulate_scalar(float* acc, const void* x, DType t, size_t n) {
  with_load(t, [&](auto load) {
    for (size_t i = 0; i < n; ++i) acc[i] = acc[i] + load(x, i);
  });
}

void accumulate_weighted_scalar(float* acc, const void* x, DType t, float w, size_t n) {
  with_load(t, [&](auto load) {
    for (size_t i = 0; i < n; ++i) acc[i] = acc[i] + w * load(x, i);
  });
}

void start_scalar(float* acc, const void* x, DType t, size_t n) {
  with_load(t, [&](auto load) {
    for (size_t i = 0; i < n; ++i) acc[i] = 0.0f + load(x, i);
  });
}

void start_weighted_scalar(float* acc, const void* x, DType t, float w, size_t n) {
  with_load(t, [&](auto load) {
    for (size_t i = 0; i < n; ++i) acc[i] = 0.0f + w * load(x, i);
  });
}

void add_term_scalar(float* acc, const void* x, DType t, size_t n) {
  with_load(t, [&](auto load) {
    for (size_t i = 0; i < n; ++i) acc[i] = acc[i] + (0.0f + load(x, i));
  });
}

void add_term_weighted_scalar(float* acc, const void* x, DType t, float w, size_t n) {
  with_load(t, [&](auto load) {
    for (size_t i = 0; i < n; ++i) acc[i] = acc[i] + w * (0.0f + load(x, i));
  });
}

void scale_scalar(void* dst, const void* x, DType t, float w, size_t n) {
  with_load(t, [&](auto load) {
    with_store(t, [&](auto store) {
      for (size_t i = 0; i < n; ++i) store(dst, i, w * load(x, i));
    });
  });
}

void store_row_scalar(const float* acc, void* dst, DType t, size_t n) {
  convert_scalar(acc, DType::kF32, dst, t, n);
}

void fold_rows_scalar(const void* const* rows, DType t, const float* w, int count, void* dst,
                      DType dt, size_t n, bool, const float* init) {
  fold_rows_range(rows, t, w, count, dst, dt, 0, n, init);
}

void quantize_fp8_scalar(const void* x, DType t, bool round_scale, fp8_e4m3* out, float* scales_inv,
                         size_t n) {
  for (size_t b = 0; b < n / kFp8BlockSize; ++b) {
    const size_t base = b * kFp8BlockSize;
    // NaN inputs do not take part in amax (std::max keeps its first argument).
    with_load(t, [&](auto load) {
      float amax = 0.0f;
      for (int i = 0; i < kFp8BlockSize; ++i) amax = std::max(amax, std::fabs(load(x, base + i)));
      const float scale = fp8_block_scale(amax, round_scale, &scales_inv[b]);
      for (int i = 0; i < kFp8BlockSize; ++i) {
        out[base + i] = float_to_fp8_e4m3(load(x, base + i) * scale);
      }
    });
  }
}

void dequantize_fp8_scalar(const fp8_e4m3* q, const float* scales_inv, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = fp8_e4m3_to_float(q[i]) * scales_inv[i / kFp8BlockSize];
}

// ---- dot: Q chains interleaved, the element types known at compile time ----
template <DType T>
float load_typed(const void* p, size_t i) {
  if constexpr (T == DType::kF32) return static_cast<const float*>(p)[i];
  if constexpr (T == DType::kBF16) return bf16_to_float(static_cast<const bf16*>(p)[i]);
  if constexpr (T == DType::kFP8) return fp8_e4m3_to_float(static_cast<const fp8_e4m3*>(p)[i]);
}

template <DType A, DType B, int Q>
void dot_group(const void* const* a, const void* const* b, size_t n, float* out) {
  float d[Q];
  for (int q = 0; q < Q; ++q) d[q] = 0.0f;
  for (size_t h = 0; h < n; ++h) {
    for (int q = 0; q < Q; ++q) d[q] = d[q] + load_typed<A>(a[q], h) * load_typed<B>(b[q], h);
  }
  for (int q = 0; q < Q; ++q) out[q] = d[q];
}

template <DType A, DType B>
void dot_typed(const void* const* a, const void* const* b, int count, size_t n, float* out) {
  int q = 0;
  for (; q + 4 <= count; q += 4) dot_group<A, B, 4>(a + q, b + q, n, out + q);
  for (; q < count; ++q) dot_group<A, B, 1>(a + q, b + q, n, out + q);
}

template <DType A>
void dot_from(const void* const* a, const void* const* b, DType bt, int count, size_t n,
              float* out) {
  switch (bt) {
    case DType::kF32:
      return dot_typed<A, DType::kF32>(a, b, count, n, out);
    case DType::kBF16:
      return dot_typed<A, DType::kBF16>(a, b, count, n, out);
    case DType::kFP8:
      return dot_typed<A, DType::kFP8>(a, b, count, n, out);
  }
}

const RowKernels kScalar = {"scalar",
                            convert_scalar,
                            accumulate_scalar,
                            accumulate_weighted_scalar,
                            start_scalar,
                            start_weighted_scalar,
                            add_term_scalar,
                            add_term_weighted_scalar,
                            scale_scalar,
                            store_row_scalar,
                            fold_rows_scalar,
                            dot_chains,
                            quantize_fp8_scalar,
                            dequantize_fp8_scalar};

const RowKernels& choose_kernels() {
  // MOED_ISA lowers the choice; it never picks a table the CPU cannot run.
  const char* env = std::getenv("MOED_ISA");
  const std::string_view cap = env ? env : "";
  if (cap != "scalar" && cap != "avx2") {
    if (const RowKernels* k = avx512_kernels()) return *k;
  }
  if (cap != "scalar") {
    if (const RowKernels* k = avx2_kernels()) return *k;
  }
  return kScalar;
}

}  // namespace

void dot_chains(const void* const* a, DType at, const void* const* b, DType bt, int count, size_t n,
                float* out) {
  switch (at) {
    case DType::kF32:
      return dot_from<DType::kF32>(a, b, bt, count, n, out);
    case DType::kBF16:
      return dot_from<DType::kBF16>(a, b, bt, count, n, out);
    case DType::kFP8:
      return dot_from<DType::kFP8>(a, b, bt, count, n, out);
  }
}

void fold_rows_range(const void* const* rows, DType t, const float* w, int count, void* dst,
                     DType dt, size_t begin, size_t end, const float* init) {
  // In chunks, each term a pass over the chunk's fp32 sums: per element the chain is unchanged.
  constexpr size_t kChunk = 256;
  float acc[kChunk];
  with_load(t, [&](auto load) {
    with_store(dt, [&](auto store) {
      for (size_t c = begin; c < end; c += kChunk) {
        const size_t m = std::min(kChunk, end - c);
        if (init) {
          std::copy(init + c, init + c + m, acc);
        } else {
          std::fill(acc, acc + m, 0.0f);
        }
        for (int q = 0; q < count; ++q) {
          const void* x = rows[q];
          if (w) {
            const float wq = w[q];
            for (size_t i = 0; i < m; ++i) acc[i] = acc[i] + wq * (0.0f + load(x, c + i));
          } else {
            for (size_t i = 0; i < m; ++i) acc[i] = acc[i] + (0.0f + load(x, c + i));
          }
        }
        for (size_t i = 0; i < m; ++i) store(dst, c + i, acc[i]);
      }
    });
  });
}

const RowKernels& scalar_kernels() { return kScalar; }

const RowKernels& row_kernels() {
  static const RowKernels& kernels = choose_kernels();
  return kernels;
}

FoldAhead::FoldAhead(DType t, DType dt, size_t n, bool weighted, bool stream)
    : t_(t),
      dt_(dt),
      n_(n),
      // The distance fold_rows's own prefetches keep (dtype_simd.h, kFoldAheadBytes).
      lead_bytes_(std::min(size_t(2048), n * dtype_size(t))),
      weighted_(weighted),
      stream_(stream) {}

void FoldAhead::push(void* dst) {
  for (const void* r : next_rows_) prefetch_row(r, lead_bytes_);
  flush();
  std::swap(rows_, next_rows_);
  std::swap(w_, next_w_);
  next_rows_.clear();
  next_w_.clear();
  dst_ = dst;
}

void FoldAhead::flush() {
  if (dst_ == nullptr) return;
  row_kernels().fold_rows(rows_.data(), t_, weighted_ ? w_.data() : nullptr, int(rows_.size()),
                          dst_, dt_, n_, stream_, nullptr);
  dst_ = nullptr;
}

#if defined(__SSE2__)
namespace {
// One 64-byte line with non-temporal stores; d is 16-byte aligned.
void stream_line(char* d, const char* s) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
  const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
  _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
  _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
  _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
  _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
}
}  // namespace
#endif

void stream_copy(void* dst, const void* src, size_t bytes) {
#if defined(__SSE2__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const size_t head = std::min(bytes, (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15);
  std::memcpy(d, s, head);
  d += head, s += head, bytes -= head;
  for (; bytes >= 64; d += 64, s += 64, bytes -= 64) stream_line(d, s);
  std::memcpy(d, s, bytes);
#else
  std::memcpy(dst, src, bytes);
#endif
}

void stream_copy_rows(const RowCopy* rows, size_t count, size_t bytes) {
#if defined(__SSE2__)
  bool aligned = true;
  for (size_t r = 0; r < count; ++r) {
    aligned &= (reinterpret_cast<uintptr_t>(rows[r].dst) & 15) == 0;
  }
  if (aligned) {
    size_t off = 0;
    for (; off + 64 <= bytes; off += 64) {
      for (size_t r = 0; r < count; ++r) {
        stream_line(static_cast<char*>(rows[r].dst) + off,
                    static_cast<const char*>(rows[r].src) + off);
      }
    }
    for (size_t r = 0; r < count; ++r) {
      std::memcpy(static_cast<char*>(rows[r].dst) + off,
                  static_cast<const char*>(rows[r].src) + off, bytes - off);
    }
    return;
  }
#endif
  for (size_t r = 0; r < count; ++r) stream_copy(rows[r].dst, rows[r].src, bytes);
}

void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

void copy_rows(const TensorView& dst, int64_t dst_row, const TensorView& src, int64_t src_row,
               int64_t count, ThreadPool* pool, bool stream_pieces) {
  const size_t row_bytes = dst.row_bytes();
  if (count <= 0 || row_bytes == 0) return;
  const bool packed = dst.contiguous() && src.contiguous();
  const bool fenced = size_t(count) * row_bytes >= kStreamThresholdBytes;
  const bool stream = stream_pieces || fenced;
  auto run = [&](int64_t b, int64_t e, int) {
    const int64_t runs = packed ? 1 : e - b;
    const size_t bytes = packed ? size_t(e - b) * row_bytes : row_bytes;
    for (int64_t r = 0; r < runs; ++r) {
      void* to = dst.row_ptr(dst_row + b + r);
      const void* from = src.row_ptr(src_row + b + r);
      if (stream) {
        stream_copy(to, from, bytes);
      } else {
        std::memcpy(to, from, bytes);
      }
    }
    if (fenced) stream_fence();
  };
  if (pool) {
    pool->parallel_for(count, run, 16);
  } else {
    run(0, count, 0);
  }
}

}  // namespace moed::internal
