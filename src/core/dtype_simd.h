// The vector row kernels of core/row_kernels.h, written once over an instruction-set traits
// class V (Avx2 in dtype_avx2.cc, Avx512 in dtype_avx512.cc). Include it only from those
// files, after their target pragma, and include every other header (this one's includes too)
// *before* that pragma: everything defined here has internal linkage, so no copy compiled for
// one ISA can be picked by the linker for another, while inline functions from other headers
// keep the baseline ISA. For the same reason nothing here calls a template from another header.
//
// Each conversion is the integer form of the scalar one in moed/dtype.h, lane by lane, so the
// results are equal bit for bit; tails shorter than a vector go to the scalar table.
//
// V provides: F / I / M (float vector, int32 vector, lane mask), kWidth, and
//   loadf storef streamf load_u16 load_u8 store_u16 store_u8 set1f set1i
//   addf mulf maxf add sub and_ or_ srli<k> slli<k> min max gt select castf casti cvtf
//   isnan (lane mask), any (a lane of a mask set), store_u16x2 (two vectors of values
//   < 2^16, a's lanes then b's), stream_u16x2 (the same, non-temporal), store_u8x4 (four
//   vectors of values < 2^8, in order), hmaxf (the largest lane of a vector without NaN).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/row_kernels.h"

// The traits AVX2 and AVX-512 spell alike but for the intrinsics' prefix P (_mm256, _mm512)
// and the integer vector's suffix SI (si256, si512); expanded inside each V, after F and I.
// NOTE: vmaxps (maxf) returns its second operand when either is NaN.
#define MOED_SIMD_LANE_OPS(P, SI)                             \
  static F loadf(const float* p) { return P##_loadu_ps(p); }  \
  static void storef(float* p, F v) { P##_storeu_ps(p, v); }  \
  static void streamf(float* p, F v) { P##_stream_ps(p, v); } \
  static F set1f(float v) { return P##_set1_ps(v); }          \
  static I set1i(int32_t v) { return P##_set1_epi32(v); }     \
  static F addf(F a, F b) { return P##_add_ps(a, b); }        \
  static F mulf(F a, F b) { return P##_mul_ps(a, b); }        \
  static F maxf(F a, F b) { return P##_max_ps(a, b); }        \
  static I add(I a, I b) { return P##_add_epi32(a, b); }      \
  static I sub(I a, I b) { return P##_sub_epi32(a, b); }      \
  static I and_(I a, I b) { return P##_and_##SI(a, b); }      \
  static I or_(I a, I b) { return P##_or_##SI(a, b); }        \
  template <int k>                                            \
  static I srli(I a) {                                        \
    return P##_srli_epi32(a, k);                              \
  }                                                           \
  template <int k>                                            \
  static I slli(I a) {                                        \
    return P##_slli_epi32(a, k);                              \
  }                                                           \
  static I min(I a, I b) { return P##_min_epi32(a, b); }      \
  static I max(I a, I b) { return P##_max_epi32(a, b); }      \
  static F castf(I a) { return P##_cast##SI##_ps(a); }        \
  static I casti(F a) { return P##_castps_##SI(a); }          \
  static F cvtf(I a) { return P##_cvtepi32_ps(a); }

namespace moed::internal {
namespace {

template <class V>
struct Simd {
  using F = typename V::F;
  using I = typename V::I;

  static F absf(F a) { return V::castf(V::and_(V::casti(a), V::set1i(0x7fffffff))); }

  // bf16 -> f32: the bits shifted into the high half.
  static F decode_bf16(I u16) { return V::castf(V::template slli<16>(u16)); }

  // f32 -> bf16 (float_to_bf16): round to nearest even; NaN keeps its sign, gets the quiet bit.
  static I encode_bf16(F x) {
    const I u = V::casti(x);
    const I hi = V::template srli<16>(u);
    const I rounded =
        V::template srli<16>(V::add(u, V::add(V::set1i(0x7fff), V::and_(hi, V::set1i(1)))));
    const I quiet = V::or_(hi, V::set1i(0x40));
    return V::select(V::isnan(x), quiet, rounded);
  }

  // E4M3FN -> f32 (fp8_e4m3_to_float).
  static F decode_fp8(I b) {
    const I sign = V::template slli<24>(V::and_(b, V::set1i(0x80)));
    const I a = V::and_(b, V::set1i(0x7f));
    // Normal: exponent rebiased 7 -> 127 is + (120 << 23) on the shifted bits.
    const I normal = V::add(V::template slli<20>(a), V::set1i(120 << 23));
    // Subnormal (exponent 0, so a is the mantissa): man * 2^-9, as the scalar path computes.
    const I subnormal = V::casti(V::mulf(V::cvtf(a), V::set1f(1.0f / 512.0f)));
    I mag = V::select(V::gt(V::set1i(8), a), subnormal, normal);
    mag = V::select(V::gt(a, V::set1i(0x7e)), V::set1i(0x7fc00000), mag);
    return V::castf(V::or_(mag, sign));
  }

  // f32 -> E4M3FN (float_to_fp8_e4m3): nearest even, saturating at 448, NaN -> 0x7f | sign.
  static I encode_fp8(F x) {
    const I u = V::casti(x);
    const I sign = V::and_(V::template srli<24>(u), V::set1i(0x80));
    const I a = V::and_(u, V::set1i(0x7fffffff));
    // Below 2^-6: adding 2^14 (ulp 2^-9) lets the fp32 adder round at the subnormal step.
    const I magic = V::set1i(0x46800000);  // 16384.0f
    const I subnormal = V::sub(V::casti(V::addf(V::castf(a), V::castf(magic))), magic);
    // Normal: exponent and 3 mantissa bits are the top bits after rounding the dropped 20;
    // (t >> 20) - (120 << 3) rebiases the exponent in place.
    const I lsb = V::and_(V::template srli<20>(a), V::set1i(1));
    const I t = V::add(a, V::add(V::set1i(0x7ffff), lsb));
    // The min saturates 448 and above, inf included, at 0x7e (448).
    const I normal = V::min(V::sub(V::template srli<20>(t), V::set1i(120 << 3)), V::set1i(0x7e));
    I r = V::select(V::gt(V::set1i(0x3c800000), a), subnormal, normal);
    r = V::select(V::gt(a, V::set1i(0x7f800000)), V::set1i(0x7f), r);  // NaN
    return V::or_(r, sign);
  }

  template <DType T>
  static F load(const void* p, size_t i) {
    if constexpr (T == DType::kF32) return V::loadf(static_cast<const float*>(p) + i);
    if constexpr (T == DType::kBF16)
      return decode_bf16(V::load_u16(static_cast<const uint16_t*>(p) + i));
    if constexpr (T == DType::kFP8)
      return decode_fp8(V::load_u8(static_cast<const uint8_t*>(p) + i));
  }

  template <DType T>
  static void store(void* p, size_t i, F v) {
    if constexpr (T == DType::kF32) V::storef(static_cast<float*>(p) + i, v);
    if constexpr (T == DType::kBF16) V::store_u16(static_cast<uint16_t*>(p) + i, encode_bf16(v));
    if constexpr (T == DType::kFP8) V::store_u8(static_cast<uint8_t*>(p) + i, encode_fp8(v));
  }

  // Two vectors, elements i .. i + 2 * kWidth (bf16: one pack for both).
  template <DType T>
  static void store2(void* p, size_t i, F a, F b) {
    if constexpr (T == DType::kBF16) {
      V::store_u16x2(static_cast<uint16_t*>(p) + i, encode_bf16(a), encode_bf16(b));
    } else {
      store<T>(p, i, a);
      store<T>(p, i + V::kWidth, b);
    }
  }

  // Whether stream2<D> exists: two vectors of D are whole aligned units of kWidth * 4 bytes.
  template <DType D>
  static constexpr bool kStreams = D == DType::kBF16 || D == DType::kF32;
  // store2 with non-temporal stores; p + i * dtype_size(D) is kWidth * 4 byte aligned.
  template <DType D>
  static void stream2(void* p, size_t i, F a, F b) {
    if constexpr (D == DType::kBF16) {
      V::stream_u16x2(static_cast<uint16_t*>(p) + i, encode_bf16(a), encode_bf16(b));
    } else if constexpr (D == DType::kF32) {
      V::streamf(static_cast<float*>(p) + i, a);
      V::streamf(static_cast<float*>(p) + i + V::kWidth, b);
    }
  }

  // Elements [done, n) go to the scalar table.
  static size_t vector_end(size_t n) { return n - n % V::kWidth; }

  // K::template run<T>(a...) for the element type t: the one switch over DTypes.
  template <class K, class... A>
  static void on_dtype(DType t, A... a) {
    switch (t) {
      case DType::kF32:
        return K::template run<DType::kF32>(a...);
      case DType::kBF16:
        return K::template run<DType::kBF16>(a...);
      case DType::kFP8:
        return K::template run<DType::kFP8>(a...);
    }
  }

  template <DType S>
  struct ConvertFrom {
    template <DType D>
    static void run(const void* src, void* dst, size_t n) {
      const size_t end = vector_end(n);
      for (size_t i = 0; i < end; i += V::kWidth) store<D>(dst, i, load<S>(src, i));
      scalar_kernels().convert(static_cast<const char*>(src) + end * dtype_size(S), S,
                               static_cast<char*>(dst) + end * dtype_size(D), D, n - end);
    }
  };
  struct Convert {
    template <DType S>
    static void run(const void* src, void* dst, DType dt, size_t n) {
      on_dtype<ConvertFrom<S>>(dt, src, dst, n);
    }
  };

  static void convert(const void* src, DType st, void* dst, DType dt, size_t n) {
    if (st == dt) return scalar_kernels().convert(src, st, dst, dt, n);  // a copy
    on_dtype<Convert>(st, src, dst, dt, n);
  }

  // ---- the accumulate family: acc[i] = Op(acc[i], x[i], w) ----
  // NOTE: rows are read from other ranks' memory at scattered places, so each one starts a
  // new stream and every 4 KiB page boundary stops the hardware prefetcher: the loop walks a
  // row in blocks and asks for the block two ahead. The arithmetic per element is unchanged.
  static constexpr size_t kBlock = 512;

  template <DType S>
  static void prefetch_ahead(const void* src, size_t b, size_t n) {
    const size_t ahead = b + 2 * kBlock;
    if (ahead >= n) return;
    const char* p = static_cast<const char*>(src) + ahead * dtype_size(S);
    constexpr size_t kFull = kBlock * dtype_size(S);
    if (n - ahead >= kBlock) {  // a constant count: unrolled
      for (size_t off = 0; off < kFull; off += 64) __builtin_prefetch(p + off, 0, 0);
      return;
    }
    const size_t bytes = (n - ahead) * dtype_size(S);
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 0);
  }

  // Each Op: kReadsAcc, apply() on one vector (a separate multiply and add, never an FMA, as
  // the scalar path rounds twice) and tail(), the scalar entry for the last elements.
  struct Add {
    static constexpr bool kReadsAcc = true;
    static F apply(F acc, F x, F) { return V::addf(acc, x); }
    static void tail(float* a, const void* x, DType t, float, size_t n) {
      scalar_kernels().accumulate(a, x, t, n);
    }
  };
  struct AddWeighted {
    static constexpr bool kReadsAcc = true;
    static F apply(F acc, F x, F w) { return V::addf(acc, V::mulf(w, x)); }
    static void tail(float* a, const void* x, DType t, float w, size_t n) {
      scalar_kernels().accumulate_weighted(a, x, t, w, n);
    }
  };
  struct Start {
    static constexpr bool kReadsAcc = false;
    static F apply(F, F x, F) { return V::addf(V::set1f(0.0f), x); }
    static void tail(float* a, const void* x, DType t, float, size_t n) {
      scalar_kernels().start(a, x, t, n);
    }
  };
  struct StartWeighted {
    static constexpr bool kReadsAcc = false;
    static F apply(F, F x, F w) { return V::addf(V::set1f(0.0f), V::mulf(w, x)); }
    static void tail(float* a, const void* x, DType t, float w, size_t n) {
      scalar_kernels().start_weighted(a, x, t, w, n);
    }
  };
  struct Term {
    static constexpr bool kReadsAcc = true;
    static F apply(F acc, F x, F) { return V::addf(acc, V::addf(V::set1f(0.0f), x)); }
    static void tail(float* a, const void* x, DType t, float, size_t n) {
      scalar_kernels().add_term(a, x, t, n);
    }
  };
  struct TermWeighted {
    static constexpr bool kReadsAcc = true;
    static F apply(F acc, F x, F w) { return V::addf(acc, V::mulf(w, V::addf(V::set1f(0.0f), x))); }
    static void tail(float* a, const void* x, DType t, float w, size_t n) {
      scalar_kernels().add_term_weighted(a, x, t, w, n);
    }
  };

  template <class Op>
  struct Fold {
    template <DType S>
    static void run(float* acc, const void* src, float w, size_t n) {
      const F wv = V::set1f(w);
      const size_t end = vector_end(n);
      for (size_t b = 0; b < end; b += kBlock) {
        prefetch_ahead<S>(src, b, n);
        const size_t e = end - b < kBlock ? end : b + kBlock;
        for (size_t i = b; i < e; i += V::kWidth) {
          const F a = Op::kReadsAcc ? V::loadf(acc + i) : V::set1f(0.0f);
          V::storef(acc + i, Op::apply(a, load<S>(src, i), wv));
        }
      }
      Op::tail(acc + end, static_cast<const char*>(src) + end * dtype_size(S), S, w, n - end);
    }
  };

  template <class Op>
  static void fold(float* acc, const void* src, DType t, float w, size_t n) {
    on_dtype<Fold<Op>>(t, acc, src, w, n);
  }

  template <class Op>
  static void fold_unweighted(float* acc, const void* src, DType t, size_t n) {
    fold<Op>(acc, src, t, 0.0f, n);
  }

  // ---- fold_rows: the sum of a token's rows in registers, four vectors at a time ----
  // fold_rows asks for each row this many bytes ahead, one line per line read (a burst per
  // block, as prefetch_ahead does, comes too late for rows that stream past once).
  static constexpr size_t kFoldAheadBytes = 2048;

  // The first kFoldAheadBytes of rows (those the loop's own prefetches never ask for).
  template <DType S>
  static void prefetch_heads(const void* const* rows, int count, size_t n) {
    const size_t bytes = n * dtype_size(S) < kFoldAheadBytes ? n * dtype_size(S) : kFoldAheadBytes;
    for (int q = 0; q < count; ++q) {
      const char* p = static_cast<const char*>(rows[q]);
      for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
    }
  }

  template <DType S, DType D, bool kWeighted>
  static void fold_rows_typed(const void* const* rows, const float* w, int count, void* dst,
                              size_t n, bool stream, const float* init) {
    constexpr size_t kOut = dtype_size(D);
    constexpr size_t kAhead = kFoldAheadBytes / dtype_size(S);    // elements
    constexpr size_t kStepBytes = 4 * V::kWidth * dtype_size(S);  // read per row per step
    const F zero = V::set1f(0.0f);
    const size_t end = vector_end(n);
    // Streamed: straight from the registers where whole aligned units allow (bf16 and f32
    // outputs at an aligned dst), else through a block in L1 and stream_copy.
    const bool direct = stream && kStreams<D> &&
                        reinterpret_cast<uintptr_t>(dst) % (V::kWidth * sizeof(float)) == 0;
    const bool bounce = stream && !direct;
    alignas(64) unsigned char buf[kBlock * sizeof(float)];  // a streamed block, in L1
    prefetch_heads<S>(rows, count, n);
    for (size_t b = 0; b < end; b += kBlock) {
      const size_t e = end - b < kBlock ? end : b + kBlock;
      unsigned char* out = bounce ? buf : static_cast<unsigned char*>(dst) + b * kOut;
      // NOTE: the term is a + w * x, not a + w * (0 + x): the same bits. 0 + x differs from x
      // only for x = -0 (+0), and a sum that starts at +0 is never -0, so a + (+-0) = a
      // either way (weighted: w * (+-0) is +-0 or the same NaN); a NaN x stays that NaN.
      auto term = [&](F a, const void* x, F wq, size_t i) {
        const F v = load<S>(x, i);
        if constexpr (kWeighted) return V::addf(a, V::mulf(wq, v));
        return V::addf(a, v);
      };
      size_t i = b;
      // Four vectors per row visit (one 64-byte line of bf16 at AVX2), four independent sums.
      for (; i + 4 * V::kWidth <= e; i += 4 * V::kWidth) {
        F a0 = zero, a1 = zero, a2 = zero, a3 = zero;
        if (init) {
          a0 = load<DType::kF32>(init, i);
          a1 = load<DType::kF32>(init, i + V::kWidth);
          a2 = load<DType::kF32>(init, i + 2 * V::kWidth);
          a3 = load<DType::kF32>(init, i + 3 * V::kWidth);
        }
        for (int q = 0; q < count; ++q) {
          const void* x = rows[q];
          if (i + kAhead < n) {
            const char* p = static_cast<const char*>(x) + (i + kAhead) * dtype_size(S);
            for (size_t off = 0; off < kStepBytes; off += 64) __builtin_prefetch(p + off, 0, 3);
          }
          const F wq = kWeighted ? V::set1f(w[q]) : zero;
          a0 = term(a0, x, wq, i);
          a1 = term(a1, x, wq, i + V::kWidth);
          a2 = term(a2, x, wq, i + 2 * V::kWidth);
          a3 = term(a3, x, wq, i + 3 * V::kWidth);
        }
        if constexpr (kStreams<D>) {
          if (direct) {
            stream2<D>(dst, i, a0, a1);
            stream2<D>(dst, i + 2 * V::kWidth, a2, a3);
            continue;
          }
        }
        store2<D>(out, i - b, a0, a1);
        store2<D>(out, i - b + 2 * V::kWidth, a2, a3);
      }
      for (; i < e; i += V::kWidth) {
        F a = init ? load<DType::kF32>(init, i) : zero;
        for (int q = 0; q < count; ++q) {
          a = term(a, rows[q], kWeighted ? V::set1f(w[q]) : zero, i);
        }
        store<D>(out, i - b, a);
      }
      if (bounce) stream_copy(static_cast<unsigned char*>(dst) + b * kOut, buf, (e - b) * kOut);
    }
    fold_rows_range(rows, S, w, count, dst, D, end, n, init);
  }

  template <DType S>
  struct FoldRowsFrom {
    template <DType D>
    static void run(const void* const* rows, const float* w, int count, void* dst, size_t n,
                    bool stream, const float* init) {
      if (w) return fold_rows_typed<S, D, true>(rows, w, count, dst, n, stream, init);
      fold_rows_typed<S, D, false>(rows, w, count, dst, n, stream, init);
    }
  };
  struct FoldRows {
    template <DType S>
    static void run(const void* const* rows, const float* w, int count, void* dst, DType dt,
                    size_t n, bool stream, const float* init) {
      on_dtype<FoldRowsFrom<S>>(dt, rows, w, count, dst, n, stream, init);
    }
  };

  static void fold_rows(const void* const* rows, DType t, const float* w, int count, void* dst,
                        DType dt, size_t n, bool stream, const float* init) {
    on_dtype<FoldRows>(t, rows, w, count, dst, dt, n, stream, init);
  }

  struct Scale {
    template <DType T>
    static void run(void* dst, const void* src, float w, size_t n) {
      const F wv = V::set1f(w);
      const size_t end = vector_end(n);
      for (size_t i = 0; i < end; i += V::kWidth) store<T>(dst, i, V::mulf(wv, load<T>(src, i)));
      scalar_kernels().scale(static_cast<char*>(dst) + end * dtype_size(T),
                             static_cast<const char*>(src) + end * dtype_size(T), T, w, n - end);
    }
  };

  static void scale(void* dst, const void* src, DType t, float w, size_t n) {
    on_dtype<Scale>(t, dst, src, w, n);
  }

  static void store_row(const float* acc, void* dst, DType t, size_t n) {
    convert(acc, DType::kF32, dst, t, n);
  }

  // f32 -> E4M3FN for |x| in [2^-6, 448] (a normal code, no NaN): encode_fp8 without its
  // subnormal and NaN lanes.
  static I encode_fp8_normal(F x) {
    const I u = V::casti(x);
    const I a = V::and_(u, V::set1i(0x7fffffff));
    const I lsb = V::and_(V::template srli<20>(a), V::set1i(1));
    const I t = V::add(a, V::add(V::set1i(0x7ffff), lsb));
    const I normal = V::min(V::sub(V::template srli<20>(t), V::set1i(120 << 3)), V::set1i(0x7e));
    return V::or_(normal, V::and_(V::template srli<24>(u), V::set1i(0x80)));
  }

  // The scale of the block at x + base (its scale_inv stored), and in *normal whether every
  // scaled |x| of it is a normal code (the common block, which takes encode_fp8_normal).
  template <DType S>
  static float block_scale(const void* x, size_t base, bool round_scale, float* scale_inv,
                           bool* normal) {
    constexpr int kVectors = kFp8BlockSize / V::kWidth;
    // The largest and smallest |x| of each lane, as bits: for finite values their order is the
    // floats' order.
    I hi = V::set1i(0), lo = V::set1i(0x7fffffff);
    for (int i = 0; i < kVectors; ++i) {
      const I a = V::casti(absf(load<S>(x, base + size_t(i) * V::kWidth)));
      hi = V::max(a, hi);
      lo = V::min(a, lo);
    }
    const bool finite = !V::any(V::gt(hi, V::set1i(0x7f7fffff)));
    F vmax = V::castf(hi);
    if (!finite) {
      // maxf(v, acc) returns acc when v is NaN: NaN inputs do not take part, as in scalar.
      vmax = V::set1f(0.0f);
      for (int i = 0; i < kVectors; ++i)
        vmax = V::maxf(absf(load<S>(x, base + size_t(i) * V::kWidth)), vmax);
    }
    const float scale = fp8_block_scale(V::hmaxf(vmax), round_scale, scale_inv);
    // Rounding is monotonic: the smallest scaled |x| is the smallest |x| scaled.
    const I smallest = V::casti(V::mulf(V::castf(lo), V::set1f(scale)));
    *normal = finite && !V::any(V::gt(V::set1i(0x3c800000), smallest));
    return scale;
  }

  template <DType S>
  static void quantize_fp8_typed(const void* x, bool round_scale, fp8_e4m3* out, float* scales_inv,
                                 size_t n) {
    // Blocks go in groups: every block's scale first, then their codes (the group read again,
    // from L1), so the scales' reductions and divisions overlap instead of each one stalling
    // its block's encode.
    constexpr int kVectors = kFp8BlockSize / V::kWidth;
    constexpr size_t kGroup = 4;
    static_assert(kFp8BlockSize % V::kWidth == 0 && kVectors % 4 == 0);
    auto* codes = reinterpret_cast<uint8_t*>(out);
    const size_t blocks = n / kFp8BlockSize;
    for (size_t g = 0; g < blocks; g += kGroup) {
      const size_t count = blocks - g < kGroup ? blocks - g : kGroup;
      float scale[kGroup];
      bool normal[kGroup];
      for (size_t i = 0; i < count; ++i) {
        scale[i] =
            block_scale<S>(x, (g + i) * kFp8BlockSize, round_scale, &scales_inv[g + i], &normal[i]);
      }
      for (size_t i = 0; i < count; ++i) {
        const size_t base = (g + i) * kFp8BlockSize;
        const F sc = V::set1f(scale[i]);
        for (int v = 0; v < kVectors; v += 4) {
          I c[4];
          for (int j = 0; j < 4; ++j) {
            const F y = V::mulf(load<S>(x, base + size_t(v + j) * V::kWidth), sc);
            c[j] = normal[i] ? encode_fp8_normal(y) : encode_fp8(y);
          }
          V::store_u8x4(codes + base + size_t(v) * V::kWidth, c[0], c[1], c[2], c[3]);
        }
      }
    }
  }

  static void quantize_fp8(const void* x, DType t, bool round_scale, fp8_e4m3* out,
                           float* scales_inv, size_t n) {
    // dtype.cc passes f32 or bf16 only.
    if (t == DType::kBF16)
      return quantize_fp8_typed<DType::kBF16>(x, round_scale, out, scales_inv, n);
    quantize_fp8_typed<DType::kF32>(x, round_scale, out, scales_inv, n);
  }

  static void dequantize_fp8(const fp8_e4m3* q, const float* scales_inv, float* out, size_t n) {
    for (size_t b = 0; b < n / kFp8BlockSize; ++b) {
      const size_t base = b * kFp8BlockSize;
      const F s = V::set1f(scales_inv[b]);
      for (int i = 0; i < kFp8BlockSize; i += V::kWidth) {
        V::storef(out + base + i, V::mulf(load<DType::kFP8>(q, base + i), s));
      }
    }
  }

  static constexpr RowKernels table(const char* isa) {
    return RowKernels{isa,
                      convert,
                      fold_unweighted<Add>,
                      fold<AddWeighted>,
                      fold_unweighted<Start>,
                      fold<StartWeighted>,
                      fold_unweighted<Term>,
                      fold<TermWeighted>,
                      scale,
                      store_row,
                      fold_rows,
                      dot_chains,
                      quantize_fp8,
                      dequantize_fp8};
  }
};

}  // namespace
}  // namespace moed::internal
