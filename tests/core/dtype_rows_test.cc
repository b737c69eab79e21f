// The public row functions: FP8 block quantisation follows design.md §6.2 on hand-worked blocks,
// and the accumulate / store helpers follow the summation rules. (Every vector table against the
// scalar one: row_kernels_test.cc.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "moed/dtype.h"
#include "support/bits.h"

namespace moed {
namespace {

// The float constant DeepEP's kernel multiplies by (kFinfoAmaxInvE4M3).
constexpr float kInv448 = 1.0f / 448.0f;

using testing::same_bits;

// design.md §6.2 by hand: amax = max(|x|, 1e-4), scale_inv = amax * (1 / 448),
// value x * (448 / amax) rounded to nearest even; round_scale: scale_inv rounded up to a power
// of two.
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
  EXPECT_EQ(s[0], 32.0f * kInv448);
  EXPECT_EQ(s[1], 1e-4f * kInv448);
  EXPECT_EQ(s[2], 1e-4f * kInv448);
  EXPECT_EQ(s[3], 1.0f * kInv448);
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
  EXPECT_EQ(sb[0], 32.0f * kInv448);
  EXPECT_EQ(qb[0].bits, 0xfe);
  EXPECT_EQ(qb[65].bits, 0x4e);
}

TEST(Fp8Quantize, ScaleRule) {
  EXPECT_EQ(fp8_scale_inv(0.0f, false), 1e-4f * kInv448);
  // DeepEP's kernel multiplies amax by the float 1 / 448; dividing by 448 differs in the last
  // bit here (0x1.dfe056p-23 against 0x1.dfe058p-23), and moed gives DeepEP's bits.
  EXPECT_EQ(float_to_bits(fp8_scale_inv(0.000100110003f, false)), 0x346ff02cu);
  EXPECT_NE(fp8_scale_inv(0.000100110003f, false), 0.000100110003f / 448.0f);
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
