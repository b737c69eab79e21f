#include "moed/dtype.h"

#include <algorithm>
#include <cmath>

namespace moed {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kFP8: return "fp8";
  }
  return "?";
}

StatusOr<DType> parse_dtype(std::string_view name) {
  if (name == "f32" || name == "float32" || name == "fp32") return DType::kF32;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "fp8" || name == "e4m3") return DType::kFP8;
  return invalid_argument("dtype '", name, "' is not one of f32, bf16, fp8");
}

float fp8_scale_inv(float amax, bool round_scale) {
  amax = std::max(amax, 1e-4f);
  float scale_inv = amax / kFp8Max;
  if (round_scale) {
    // Round up to a power of two (UE8M0): keep the exponent, bump it if any mantissa bit set.
    uint32_t u = float_to_bits(scale_inv);
    if (u & 0x007fffffu) u = (u & 0xff800000u) + 0x00800000u;
    scale_inv = bits_to_float(u);
  }
  return scale_inv;
}

void convert_f32_to_bf16(std::span<const float> src, std::span<bf16> dst) {
  MOED_CHECK(src.size() == dst.size());
  for (size_t i = 0; i < src.size(); ++i) dst[i] = float_to_bf16(src[i]);
}

void convert_bf16_to_f32(std::span<const bf16> src, std::span<float> dst) {
  MOED_CHECK(src.size() == dst.size());
  for (size_t i = 0; i < src.size(); ++i) dst[i] = bf16_to_float(src[i]);
}

namespace {
template <typename Load>
void quantize_blocks(size_t n, Load load, bool round_scale, std::span<fp8_e4m3> out,
                     std::span<float> scales_inv) {
  MOED_CHECK(n % kFp8BlockSize == 0 && out.size() == n && scales_inv.size() == n / kFp8BlockSize);
  for (size_t b = 0; b < n / kFp8BlockSize; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < kFp8BlockSize; ++i) amax = std::max(amax, std::fabs(load(b * kFp8BlockSize + i)));
    const float scale_inv = fp8_scale_inv(amax, round_scale);
    const float scale = round_scale ? 1.0f / scale_inv : kFp8Max / std::max(amax, 1e-4f);
    scales_inv[b] = scale_inv;
    for (int i = 0; i < kFp8BlockSize; ++i) {
      const size_t j = b * kFp8BlockSize + i;
      out[j] = float_to_fp8_e4m3(load(j) * scale);
    }
  }
}
}  // namespace

void quantize_fp8_row(std::span<const float> x, bool round_scale, std::span<fp8_e4m3> out,
                      std::span<float> scales_inv) {
  quantize_blocks(x.size(), [&](size_t i) { return x[i]; }, round_scale, out, scales_inv);
}

void quantize_fp8_row(std::span<const bf16> x, bool round_scale, std::span<fp8_e4m3> out,
                      std::span<float> scales_inv) {
  quantize_blocks(x.size(), [&](size_t i) { return bf16_to_float(x[i]); }, round_scale, out,
                  scales_inv);
}

void dequantize_fp8_row(std::span<const fp8_e4m3> q, std::span<const float> scales_inv,
                        std::span<float> out) {
  MOED_CHECK(q.size() == out.size() && scales_inv.size() == q.size() / kFp8BlockSize);
  for (size_t i = 0; i < q.size(); ++i) out[i] = fp8_e4m3_to_float(q[i]) * scales_inv[i / kFp8BlockSize];
}

}  // namespace moed
