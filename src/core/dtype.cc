#include "moed/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/dtype_kernels.h"

namespace moed {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kFP8:
      return "fp8";
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

namespace internal {
namespace {

float load_scalar(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kBF16:
      return bf16_to_float(static_cast<const bf16*>(p)[i]);
    case DType::kFP8:
      return fp8_e4m3_to_float(static_cast<const fp8_e4m3*>(p)[i]);
  }
  MOED_CHECK(false, "bad dtype ", int(t));
}

void store_scalar(void* p, DType t, size_t i, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(p)[i] = v;
      return;
    case DType::kBF16:
      static_cast<bf16*>(p)[i] = float_to_bf16(v);
      return;
    case DType::kFP8:
      static_cast<fp8_e4m3*>(p)[i] = float_to_fp8_e4m3(v);
      return;
  }
  MOED_CHECK(false, "bad dtype ", int(t));
}

void convert_scalar(const void* src, DType st, void* dst, DType dt, size_t n) {
  if (st == dt) {
    if (n) std::memmove(dst, src, n * dtype_size(st));
    return;
  }
  for (size_t i = 0; i < n; ++i) store_scalar(dst, dt, i, load_scalar(src, st, i));
}

void accumulate_scalar(float* acc, const void* src, DType t, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += load_scalar(src, t, i);
}

void accumulate_weighted_scalar(float* acc, const void* src, DType t, float w, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float term = w * load_scalar(src, t, i);
    acc[i] += term;
  }
}

void store_row_scalar(const float* acc, void* dst, DType t, size_t n) {
  convert_scalar(acc, DType::kF32, dst, t, n);
}

void quantize_fp8_scalar(const void* x, DType t, bool round_scale, fp8_e4m3* out, float* scales_inv,
                         size_t n) {
  for (size_t b = 0; b < n / kFp8BlockSize; ++b) {
    const size_t base = b * kFp8BlockSize;
    // NaN inputs do not take part in amax (std::max keeps its first argument).
    float amax = 0.0f;
    for (int i = 0; i < kFp8BlockSize; ++i)
      amax = std::max(amax, std::fabs(load_scalar(x, t, base + i)));
    const float scale = fp8_block_scale(amax, round_scale, &scales_inv[b]);
    for (int i = 0; i < kFp8BlockSize; ++i) {
      out[base + i] = float_to_fp8_e4m3(load_scalar(x, t, base + i) * scale);
    }
  }
}

void dequantize_fp8_scalar(const fp8_e4m3* q, const float* scales_inv, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = fp8_e4m3_to_float(q[i]) * scales_inv[i / kFp8BlockSize];
}

const RowKernels kScalar = {
    "scalar",         convert_scalar,      accumulate_scalar,    accumulate_weighted_scalar,
    store_row_scalar, quantize_fp8_scalar, dequantize_fp8_scalar};

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

const RowKernels& scalar_kernels() { return kScalar; }

const RowKernels& active_kernels() {
  static const RowKernels& kernels = choose_kernels();
  return kernels;
}

}  // namespace internal

const char* row_kernel_isa() { return internal::active_kernels().isa; }

void convert_f32_to_bf16(std::span<const float> src, std::span<bf16> dst) {
  MOED_CHECK(src.size() == dst.size(), src.size(), " != ", dst.size());
  internal::active_kernels().convert(src.data(), DType::kF32, dst.data(), DType::kBF16, src.size());
}

void convert_bf16_to_f32(std::span<const bf16> src, std::span<float> dst) {
  MOED_CHECK(src.size() == dst.size(), src.size(), " != ", dst.size());
  internal::active_kernels().convert(src.data(), DType::kBF16, dst.data(), DType::kF32, src.size());
}

void quantize_fp8_row(std::span<const float> x, bool round_scale, std::span<fp8_e4m3> out,
                      std::span<float> scales_inv) {
  const size_t n = x.size();
  MOED_CHECK(n % kFp8BlockSize == 0 && out.size() == n && scales_inv.size() == n / kFp8BlockSize,
             "hidden = ", n, ", out = ", out.size(), ", scales = ", scales_inv.size());
  internal::active_kernels().quantize_fp8(x.data(), DType::kF32, round_scale, out.data(),
                                          scales_inv.data(), n);
}

void quantize_fp8_row(std::span<const bf16> x, bool round_scale, std::span<fp8_e4m3> out,
                      std::span<float> scales_inv) {
  const size_t n = x.size();
  MOED_CHECK(n % kFp8BlockSize == 0 && out.size() == n && scales_inv.size() == n / kFp8BlockSize,
             "hidden = ", n, ", out = ", out.size(), ", scales = ", scales_inv.size());
  internal::active_kernels().quantize_fp8(x.data(), DType::kBF16, round_scale, out.data(),
                                          scales_inv.data(), n);
}

void dequantize_fp8_row(std::span<const fp8_e4m3> q, std::span<const float> scales_inv,
                        std::span<float> out) {
  const size_t n = q.size();
  MOED_CHECK(n % kFp8BlockSize == 0 && out.size() == n && scales_inv.size() == n / kFp8BlockSize,
             "hidden = ", n, ", out = ", out.size(), ", scales = ", scales_inv.size());
  internal::active_kernels().dequantize_fp8(q.data(), scales_inv.data(), out.data(), n);
}

void convert_row(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  internal::active_kernels().convert(src, src_type, dst, dst_type, n);
}

void accumulate_row_f32(float* acc, const void* src, DType t, size_t n) {
  internal::active_kernels().accumulate(acc, src, t, n);
}

void accumulate_row_weighted_f32(float* acc, const void* src, DType t, float w, size_t n) {
  internal::active_kernels().accumulate_weighted(acc, src, t, w, n);
}

void store_row(const float* acc, void* dst, DType t, size_t n) {
  internal::active_kernels().store(acc, dst, t, n);
}

}  // namespace moed
