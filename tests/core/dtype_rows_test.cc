// Row conversions: every vector table this CPU can run equals the scalar table bit for bit,
// and FP8 block quantisation follows spec §6 on hand-worked blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/dtype_kernels.h"
#include "moed/dtype.h"

namespace moed {
namespace {

using internal::RowKernels;

std::vector<const RowKernels*> vector_tables() {
  std::vector<const RowKernels*> t;
  if (auto* k = internal::avx2_kernels()) t.push_back(k);
  if (auto* k = internal::avx512_kernels()) t.push_back(k);
  // The one the public functions use (scalar on a CPU without AVX2, or under MOED_ISA).
  const RowKernels* active = &internal::active_kernels();
  if (std::find(t.begin(), t.end(), active) == t.end()) t.push_back(active);
  return t;
}

const size_t kLengths[] = {0, 1, 7, 8, 9, 15, 16, 17, 31, 127, 128, 129, 1000};

// Random floats with specials sprinkled in: NaNs (several payloads), infinities, zeros,
// f32 and fp8 subnormals, values around 448.
std::vector<float> special_floats(size_t n, uint32_t seed, bool allow_nan = true) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_real_distribution<float> normal(-3.0f, 3.0f);
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {0.0f,   -0.0f,   inf,     -inf,     448.0f,      -448.0f,  464.0f,
                            1e-40f, -1e-45f, 0x1p-9f, 0x1p-10f, 1.00390625f, 65504.0f, 3e38f};
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    switch (bits(rng) % 8) {
      case 0:
        v[i] = specials[bits(rng) % std::size(specials)];
        break;
      case 1:
        v[i] = allow_nan ? bits_to_float(0x7f800001u | (bits(rng) & 0x803fffffu)) : 1.0f;
        break;
      case 2:
        v[i] = bits_to_float(bits(rng));
        break;
      case 3:
        v[i] = bits_to_float((bits(rng) & 0x807fffffu));
        break;  // f32 subnormal
      default:
        v[i] = normal(rng);
        break;
    }
    if (!allow_nan && std::isnan(v[i])) v[i] = 2.5f;
  }
  return v;
}

// A row of `n` elements of t built from floats (so its bits are valid patterns of t),
// plus random raw bit patterns for the 1- and 2-byte formats (every NaN encoding too).
std::vector<uint8_t> random_row(DType t, size_t n, uint32_t seed) {
  std::vector<uint8_t> row(n * dtype_size(t));
  if (t == DType::kF32) {
    const auto f = special_floats(n, seed);
    if (n) std::memcpy(row.data(), f.data(), row.size());
  } else {
    std::mt19937 rng(seed);
    for (auto& b : row) b = uint8_t(rng());
  }
  return row;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <typename T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

class RowTables : public ::testing::TestWithParam<const RowKernels*> {};

TEST_P(RowTables, ConvertEqualsScalar) {
  const RowKernels& k = *GetParam();
  const RowKernels& ref = internal::scalar_kernels();
  const DType types[] = {DType::kF32, DType::kBF16, DType::kFP8};
  for (size_t n : kLengths) {
    for (DType st : types) {
      for (DType dt : types) {
        const auto src = random_row(st, n, uint32_t(n * 9 + int(st) * 3 + int(dt)));
        std::vector<uint8_t> want(n * dtype_size(dt) + 1, 0xcd), got(want);
        ref.convert(src.data(), st, want.data(), dt, n);
        k.convert(src.data(), st, got.data(), dt, n);
        EXPECT_TRUE(same_bits(got, want))
            << k.isa << " " << dtype_name(st) << " -> " << dtype_name(dt) << " n = " << n;
        EXPECT_EQ(got.back(), 0xcd) << "wrote past the end";
      }
    }
  }
}

TEST_P(RowTables, AccumulateAndStoreEqualScalar) {
  const RowKernels& k = *GetParam();
  const RowKernels& ref = internal::scalar_kernels();
  for (size_t n : kLengths) {
    for (DType t : {DType::kF32, DType::kBF16, DType::kFP8}) {
      const auto src = random_row(t, n, uint32_t(n + 100 * int(t)));
      // Accumulators without NaN: when both operands of an add are NaN, which payload wins
      // depends on operand order, which compilers may swap; one NaN operand is exact.
      const auto acc0 = special_floats(n, uint32_t(n + 7), /*allow_nan=*/false);
      for (float w : {1.0f, 0.3f, -2.5f, 0.0f, 1e-30f}) {
        auto want = acc0, got = acc0;
        ref.accumulate_weighted(want.data(), src.data(), t, w, n);
        k.accumulate_weighted(got.data(), src.data(), t, w, n);
        EXPECT_TRUE(same_bits(got, want))
            << k.isa << " weighted " << dtype_name(t) << " w = " << w << " n = " << n;
      }
      auto want = acc0, got = acc0;
      ref.accumulate(want.data(), src.data(), t, n);
      k.accumulate(got.data(), src.data(), t, n);
      EXPECT_TRUE(same_bits(got, want)) << k.isa << " accumulate " << dtype_name(t) << " n = " << n;

      const auto acc = special_floats(n, uint32_t(n + 11));
      std::vector<uint8_t> out_want(n * dtype_size(t)), out_got(out_want.size());
      ref.store(acc.data(), out_want.data(), t, n);
      k.store(acc.data(), out_got.data(), t, n);
      EXPECT_TRUE(same_bits(out_got, out_want))
          << k.isa << " store " << dtype_name(t) << " n = " << n;
    }
  }
}

TEST_P(RowTables, QuantizeDequantizeEqualScalar) {
  const RowKernels& k = *GetParam();
  const RowKernels& ref = internal::scalar_kernels();
  for (size_t n : {size_t(0), size_t(128), size_t(384), size_t(7168)}) {
    for (DType t : {DType::kF32, DType::kBF16}) {
      for (bool round_scale : {false, true}) {
        // Blocks of very different magnitudes, some all zero, some with NaN / inf.
        std::vector<float> f = special_floats(n, uint32_t(n + round_scale));
        std::mt19937 rng(uint32_t(n * 3 + int(t)));
        for (size_t b = 0; b < n / 128; ++b) {
          const int kind = int(rng() % 4);
          for (size_t i = 0; i < 128; ++i) {
            float& x = f[b * 128 + i];
            if (kind == 0) x = 0.0f;
            if (kind == 1)
              x = std::ldexp(float(int(rng() % 2001) - 1000) / 1000.0f, int(rng() % 40) - 30);
            if (kind == 2 && std::isnan(x)) x = 1.0f;
          }
        }
        std::vector<uint8_t> x(n * dtype_size(t));
        if (t == DType::kF32) {
          x = bytes_of(f);
        } else {
          std::vector<bf16> b(n);
          for (size_t i = 0; i < n; ++i) b[i] = float_to_bf16(f[i]);
          x = bytes_of(b);
        }
        std::vector<fp8_e4m3> q_want(n), q_got(n);
        std::vector<float> s_want(n / 128), s_got(n / 128);
        ref.quantize_fp8(x.data(), t, round_scale, q_want.data(), s_want.data(), n);
        k.quantize_fp8(x.data(), t, round_scale, q_got.data(), s_got.data(), n);
        EXPECT_TRUE(same_bits(q_got, q_want)) << k.isa << " n = " << n;
        EXPECT_TRUE(same_bits(s_got, s_want)) << k.isa << " n = " << n;

        std::vector<float> d_want(n), d_got(n);
        ref.dequantize_fp8(q_want.data(), s_want.data(), d_want.data(), n);
        k.dequantize_fp8(q_want.data(), s_want.data(), d_got.data(), n);
        EXPECT_TRUE(same_bits(d_got, d_want)) << k.isa << " n = " << n;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, RowTables, ::testing::ValuesIn(vector_tables()),
                         [](const auto& info) { return std::string(info.param->isa); });

TEST(RowKernels, IsaIsReported) {
  const std::string isa = row_kernel_isa();
  EXPECT_TRUE(isa == "scalar" || isa == "avx2" || isa == "avx512") << isa;
  if (std::getenv("MOED_ISA") == nullptr && __builtin_cpu_supports("avx2")) {
    EXPECT_NE(isa, "scalar");
  }
}

// Spec §6 by hand: amax = max(|x|, 1e-4), scale_inv = amax / 448, value x * (448 / amax)
// rounded to nearest even; round_scale: scale_inv rounded up to a power of two.
TEST(Fp8Quantize, HandWorkedBlocks) {
  std::vector<float> x(4 * 128);
  for (int i = 0; i < 128; ++i) x[i] = float(i - 64) * 0.5f;  // block 0: amax 32
  // block 1: all zero -> amax is the 1e-4 floor
  for (int i = 0; i < 128; ++i) x[256 + i] = 1e-5f;  // block 2: below the floor
  x[256 + 5] = 5e-5f;
  for (int i = 0; i < 128; ++i) x[384 + i] = -1.0f;  // block 3: amax 1, one NaN
  x[384 + 9] = std::nanf("");

  std::vector<fp8_e4m3> q(x.size());
  std::vector<float> s(4);
  quantize_fp8_row(x, /*round_scale=*/false, q, s);
  EXPECT_EQ(s[0], 32.0f / 448.0f);
  EXPECT_EQ(s[1], 1e-4f / 448.0f);
  EXPECT_EQ(s[2], 1e-4f / 448.0f);
  EXPECT_EQ(s[3], 1.0f / 448.0f);
  // scale 448 / 32 = 14: -32 -> -448 (0xfe); 0.5 -> 7 = 1.75 * 2^2 (0x4e); 1.5 -> 21 -> 20
  // (between 20 and 22: tie, even mantissa 1.25 * 2^4 = 0x5a); 31.5 -> 441 -> 448 (0x7e).
  EXPECT_EQ(q[0].bits, 0xfe);
  EXPECT_EQ(q[65].bits, 0x4e);
  EXPECT_EQ(q[67].bits, 0x5a);
  EXPECT_EQ(q[127].bits, 0x7e);
  EXPECT_EQ(q[64].bits, 0x00);
  EXPECT_EQ(q[128].bits, 0x00);
  // scale 4.48e6: 5e-5 -> 224 = 1.75 * 2^7 (0x76); 1e-5 -> 44.8 -> 44 = 1.375 * 2^5 (0x63).
  EXPECT_EQ(q[256 + 5].bits, 0x76);
  EXPECT_EQ(q[256].bits, 0x63);
  EXPECT_EQ(q[384].bits, 0xfe);      // -1 * 448
  EXPECT_EQ(q[384 + 9].bits, 0x7f);  // NaN stays NaN and does not raise amax

  quantize_fp8_row(x, /*round_scale=*/true, q, s);
  EXPECT_EQ(s[0], 0.125f);       // 1/14 -> 2^-3
  EXPECT_EQ(s[1], 0x1p-22f);     // 2.23e-7 -> 2^-22
  EXPECT_EQ(s[3], 0x1p-8f);      // 1/448 -> 2^-8
  EXPECT_EQ(q[0].bits, 0xf8);    // -32 * 8 = -256 = -1.0 * 2^8
  EXPECT_EQ(q[65].bits, 0x48);   // 0.5 * 8 = 4
  EXPECT_EQ(q[384].bits, 0xf8);  // -1 * 256

  std::vector<float> d(x.size());
  dequantize_fp8_row(q, s, d);
  EXPECT_EQ(d[0], -256.0f * 0.125f);
  EXPECT_EQ(d[65], 0.5f);
  EXPECT_EQ(d[384], -1.0f);
  EXPECT_TRUE(std::isnan(d[384 + 9]));

  // bf16 input quantises its float value.
  std::vector<bf16> xb(128);
  for (int i = 0; i < 128; ++i) xb[i] = float_to_bf16(float(i - 64) * 0.5f);
  std::vector<fp8_e4m3> qb(128);
  std::vector<float> sb(1);
  quantize_fp8_row(xb, false, qb, sb);
  EXPECT_EQ(sb[0], 32.0f / 448.0f);
  EXPECT_EQ(qb[0].bits, 0xfe);
  EXPECT_EQ(qb[65].bits, 0x4e);
}

TEST(Fp8Quantize, ScaleRule) {
  EXPECT_EQ(fp8_scale_inv(0.0f, false), 1e-4f / 448.0f);
  EXPECT_EQ(fp8_scale_inv(448.0f, false), 1.0f);
  EXPECT_EQ(fp8_scale_inv(448.0f, true), 1.0f);  // already a power of two
  EXPECT_EQ(fp8_scale_inv(449.0f, true), 2.0f);
  EXPECT_EQ(fp8_scale_inv(224.0f, true), 0.5f);
}

TEST(RowHelpers, PublicFunctionsFollowTheSummationRules) {
  // acc += w * x with the product rounded first: 1 + 3 * (1/3 as f32) differs from an FMA.
  float acc[1] = {1.0f};
  const float third = 1.0f / 3.0f;
  const float y = 3.0f;
  accumulate_row_weighted_f32(acc, &y, DType::kF32, third, 1);
  const float product = third * 3.0f;
  EXPECT_EQ(acc[0], 1.0f + product);

  std::vector<bf16> src(33);
  for (size_t i = 0; i < src.size(); ++i) src[i] = float_to_bf16(float(i) * 0.25f);
  std::vector<float> sum(33, 1.0f);
  accumulate_row_f32(sum.data(), src.data(), DType::kBF16, sum.size());
  for (size_t i = 0; i < sum.size(); ++i) EXPECT_EQ(sum[i], 1.0f + float(i) * 0.25f);

  std::vector<bf16> out(33);
  store_row(sum.data(), out.data(), DType::kBF16, out.size());
  std::vector<float> back(33);
  convert_bf16_to_f32(out, back);
  for (size_t i = 0; i < sum.size(); ++i) EXPECT_EQ(out[i].bits, float_to_bf16(sum[i]).bits);
  convert_row(back.data(), DType::kF32, out.data(), DType::kBF16, out.size());
  std::vector<bf16> out2(33);
  convert_f32_to_bf16(back, out2);
  EXPECT_TRUE(same_bits(out, out2));
}

}  // namespace
}  // namespace moed
