#include "moed/dtype.h"

#include <algorithm>

#include "core/enum_names.h"
#include "core/row_kernels.h"

namespace moed {

namespace {
constexpr EnumName<DType> kDTypeNames[] = {
    {DType::kF32, "f32"},         {DType::kBF16, "bf16"},
    {DType::kFP8, "fp8"},         {DType::kF32, "float32", false},
    {DType::kF32, "fp32", false}, {DType::kBF16, "bfloat16", false},
    {DType::kFP8, "e4m3", false},
};

// A row of n values has n fp8 codes and one scale per kFp8BlockSize block.
void check_fp8_row(size_t n, size_t out, size_t scales) {
  MOED_CHECK(n % kFp8BlockSize == 0 && out == n && scales == n / kFp8BlockSize, "hidden = ", n,
             ", out = ", out, ", scales = ", scales);
}

void quantize_row(const void* x, DType t, size_t n, bool round_scale, std::span<fp8_e4m3> out,
                  std::span<float> scales_inv) {
  check_fp8_row(n, out.size(), scales_inv.size());
  internal::row_kernels().quantize_fp8(x, t, round_scale, out.data(), scales_inv.data(), n);
}
}  // namespace

const char* dtype_name(DType t) { return enum_name(kDTypeNames, t, "?"); }

StatusOr<DType> parse_dtype(std::string_view name) {
  return parse_enum(kDTypeNames, name, "dtype", "is not one of");
}

float fp8_scale_inv(float amax, bool round_scale) {
  amax = std::max(amax, 1e-4f);
  // NOTE: DeepEP's kernel multiplies by the float constant 1 / 448 (kFinfoAmaxInvE4M3) rather
  // than dividing by 448; the two differ in the last bit for some amax, so moed multiplies too.
  constexpr float kInvFp8Max = 1.0f / kFp8Max;
  float scale_inv = amax * kInvFp8Max;
  if (round_scale) {
    // Round up to a power of two (UE8M0): keep the exponent, bump it if any mantissa bit set.
    uint32_t u = float_to_bits(scale_inv);
    if (u & 0x007fffffu) u = (u & 0xff800000u) + 0x00800000u;
    scale_inv = bits_to_float(u);
  }
  return scale_inv;
}

const char* active_isa_name() { return internal::row_kernels().isa; }

void convert_f32_to_bf16(std::span<const float> src, std::span<bf16> dst) {
  MOED_CHECK(src.size() == dst.size(), src.size(), " != ", dst.size());
  internal::row_kernels().convert(src.data(), DType::kF32, dst.data(), DType::kBF16, src.size());
}

void convert_bf16_to_f32(std::span<const bf16> src, std::span<float> dst) {
  MOED_CHECK(src.size() == dst.size(), src.size(), " != ", dst.size());
  internal::row_kernels().convert(src.data(), DType::kBF16, dst.data(), DType::kF32, src.size());
}

void quantize_fp8_row(std::span<const float> x, bool round_scale, std::span<fp8_e4m3> out,
                      std::span<float> scales_inv) {
  quantize_row(x.data(), DType::kF32, x.size(), round_scale, out, scales_inv);
}

void quantize_fp8_row(std::span<const bf16> x, bool round_scale, std::span<fp8_e4m3> out,
                      std::span<float> scales_inv) {
  quantize_row(x.data(), DType::kBF16, x.size(), round_scale, out, scales_inv);
}

void dequantize_fp8_row(std::span<const fp8_e4m3> q, std::span<const float> scales_inv,
                        std::span<float> out) {
  const size_t n = q.size();
  check_fp8_row(n, out.size(), scales_inv.size());
  internal::row_kernels().dequantize_fp8(q.data(), scales_inv.data(), out.data(), n);
}

void convert_row(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  internal::row_kernels().convert(src, src_type, dst, dst_type, n);
}

void accumulate_row_f32(float* acc, const void* src, DType t, size_t n) {
  internal::row_kernels().accumulate(acc, src, t, n);
}

void accumulate_row_weighted_f32(float* acc, const void* src, DType t, float w, size_t n) {
  internal::row_kernels().accumulate_weighted(acc, src, t, w, n);
}

void store_row(const float* acc, void* dst, DType t, size_t n) {
  internal::row_kernels().store(acc, dst, t, n);
}

}  // namespace moed
