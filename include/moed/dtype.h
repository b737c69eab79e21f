// Number formats: float32, bfloat16 and FP8 (OCP E4M3FN) with per-128-channel block scales.
//
// Scalar conversions live here, inline, and are the definition of every format. The row
// conversions below are vectorised where the CPU allows (chosen at run time) and equal the
// scalar ones bit for bit; tests check that.
//
//   moed::bf16 b = moed::float_to_bf16(1.5f);        // round to nearest even, NaN kept
//   float f = moed::bf16_to_float(b);
//   moed::fp8_e4m3 q = moed::float_to_fp8_e4m3(300.f);  // saturates at 448, no infinities
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>

#include "moed/status.h"

namespace moed {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kFP8 = 2 };

// FP8 block scaling: one scale per this many channels of a row (design.md §6.2).
inline constexpr int kFp8BlockSize = 128;
// Largest finite E4M3FN value.
inline constexpr float kFp8Max = 448.0f;

inline constexpr size_t dtype_size(DType t) {
  return t == DType::kF32 ? 4 : t == DType::kBF16 ? 2 : 1;
}
const char* dtype_name(DType t);  // "f32", "bf16", "fp8"
StatusOr<DType> parse_dtype(std::string_view name);

struct bf16 {
  uint16_t bits = 0;
};
struct fp8_e4m3 {
  uint8_t bits = 0;
};

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_float(bf16 b) { return bits_to_float(uint32_t(b.bits) << 16); }

// Round to nearest, ties to even. NaN stays NaN (quiet bit set, sign kept).
inline bf16 float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x0040u)};
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return bf16{uint16_t(u >> 16)};
}

// E4M3FN: 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7f / 0xff are NaN; no infinities.
inline float fp8_e4m3_to_float(fp8_e4m3 v) {
  const uint32_t sign = (v.bits & 0x80u) << 24;
  const uint32_t exp = (v.bits >> 3) & 0xfu;
  const uint32_t man = v.bits & 0x7u;
  if (exp == 0xf && man == 0x7) return bits_to_float(sign | 0x7fc00000u);
  if (exp == 0) {
    // Subnormal: man * 2^-9.
    float mag = float(man) * (1.0f / 512.0f);
    return sign ? -mag : mag;
  }
  return bits_to_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// Round to nearest even; |f| beyond 448 (and +-inf) saturates to +-448; NaN -> NaN (0x7f|sign).
inline fp8_e4m3 float_to_fp8_e4m3(float f) {
  uint32_t u = float_to_bits(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return fp8_e4m3{uint8_t(sign | 0x7f)};
  if (u >= 0x43e00000u) return fp8_e4m3{uint8_t(sign | 0x7e)};  // >= 448 (incl. inf)
  if (u < 0x3c800000u) {
    // Below 2^-6, the smallest normal: subnormal steps of 2^-9. Adding 2^14 (whose float ulp
    // is 2^-9) makes the float adder round to nearest even at exactly that step; a result of
    // 8 steps is 2^-6, which is also the code of the smallest normal.
    const float magic = 16384.0f;
    uint32_t m = float_to_bits(bits_to_float(u) + magic) - float_to_bits(magic);
    return fp8_e4m3{uint8_t(sign | m)};
  }
  // Normal: keep 3 mantissa bits, round to nearest even on the 20 dropped bits.
  uint32_t lsb = (u >> 20) & 1u;
  u += 0x7ffffu + lsb;
  uint32_t exp = (u >> 23) - 120u;
  uint32_t man = (u >> 20) & 0x7u;
  uint32_t r = (exp << 3) | man;
  if (r > 0x7e) r = 0x7e;  // rounding up past 448 saturates
  return fp8_e4m3{uint8_t(sign | r)};
}

// Row conversions (vectorised; bit-identical to the scalar functions above).
void convert_f32_to_bf16(std::span<const float> src, std::span<bf16> dst);
void convert_bf16_to_f32(std::span<const bf16> src, std::span<float> dst);

// FP8 block quantisation of one row of `hidden` channels (hidden % 128 == 0), design.md §6.2,
// DeepEP's low-latency cast to the bit: per block amax = max(max|x|, 1e-4f),
// scale_inv = amax * (1 / 448) (a multiply by the float constant, as DeepEP's kernel does, not a
// division; rounded up to a power of two when round_scale), value = float_to_fp8_e4m3(x * scale)
// with scale = 448 / amax, or 1 / scale_inv (exact, a power of two) when round_scale. All in
// float32. scales_inv has hidden / 128 entries.
void quantize_fp8_row(std::span<const float> x, bool round_scale, std::span<fp8_e4m3> out,
                      std::span<float> scales_inv);
void quantize_fp8_row(std::span<const bf16> x, bool round_scale, std::span<fp8_e4m3> out,
                      std::span<float> scales_inv);
// value * scale_inv, per block.
void dequantize_fp8_row(std::span<const fp8_e4m3> q, std::span<const float> scales_inv,
                        std::span<float> out);

// The scale rule on its own, so tests and other paths share its definition.
float fp8_scale_inv(float amax, bool round_scale);

// Untyped row helpers for the combine / unpermute hot paths. `n` counts elements; the DType
// says how each row is stored. FP8 here means raw E4M3 values with no block scale (block-scaled
// rows go through quantize_fp8_row / dequantize_fp8_row). Every element is read as
// float(x) (exact for all three formats) and written with the scalar rounding above, so the
// result is the same on every CPU.
//
//   moed::convert_row(y_bf16, moed::DType::kBF16, y_f32, moed::DType::kF32, hidden);
//   moed::accumulate_row_weighted_f32(acc, y_row, moed::DType::kBF16, prob, hidden);
//   moed::store_row(acc, out_row, moed::DType::kBF16, hidden);  // rounds once
//
// dst[i] = src[i] converted to dst_type (a plain copy when the types are equal).
void convert_row(const void* src, DType src_type, void* dst, DType dst_type, size_t n);
// acc[i] += float(src[i]).
void accumulate_row_f32(float* acc, const void* src, DType t, size_t n);
// acc[i] += w * float(src[i]): the product rounded to fp32, then the sum (never fused).
void accumulate_row_weighted_f32(float* acc, const void* src, DType t, float w, size_t n);
// dst[i] = acc[i] rounded once to t.
void store_row(const float* acc, void* dst, DType t, size_t n);

// The instruction set every row kernel of moed runs on (these row functions, permute, the
// dispatchers' combine loops): "avx512", "avx2" or "scalar". Chosen once from the CPU; the
// environment variable MOED_ISA=scalar|avx2|avx512 can lower it (benchmarks, checking a
// fallback), never raise it past what the CPU supports.
const char* active_isa_name();

}  // namespace moed
