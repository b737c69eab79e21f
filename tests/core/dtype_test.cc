// The scalar number formats against independent references: every bf16 and FP8 bit pattern,
// and a million random floats through float -> FP8 / float -> bf16.
#include "moed/dtype.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace moed {
namespace {

bool is_fp8_nan(uint8_t b) { return (b & 0x7f) == 0x7f; }

// E4M3FN decoded from its definition, in double.
double fp8_value(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xf, man = b & 7;
  const double mag = exp == 0 ? std::ldexp(man / 8.0, -6) : std::ldexp(1.0 + man / 8.0, exp - 7);
  return sign ? -mag : mag;
}

// Nearest of the 127 non-negative finite E4M3 values (codes 0x00..0x7e, increasing), ties to
// the even code (= even mantissa), saturating at 448; NaN -> 0x7f with the sign.
uint8_t reference_fp8(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return sign | 0x7f;
  const double a = std::fabs(double(f));
  if (a >= 448.0) return sign | 0x7e;
  static const std::vector<double> grid = [] {
    std::vector<double> g;
    for (int c = 0; c <= 0x7e; ++c) g.push_back(fp8_value(uint8_t(c)));
    return g;
  }();
  // First value > a; a lies in [grid[hi - 1], grid[hi]).
  const int hi = int(std::upper_bound(grid.begin(), grid.end(), a) - grid.begin());
  const int lo = hi - 1;
  const double mid = (grid[lo] + grid[hi]) / 2;  // exact: few significant bits
  int code;
  if (a < mid)
    code = lo;
  else if (a > mid)
    code = hi;
  else
    code = (lo % 2 == 0) ? lo : hi;
  return sign | uint8_t(code);
}

// bf16 by scaling to an integer count of bf16 quanta in double and rounding with nearbyint
// (ties to even); the quantum is 2^(e - 8) for 8 significant bits, at least 2^-133.
uint16_t reference_bf16(float f) {
  if (std::isnan(f)) return uint16_t((float_to_bits(f) >> 16) | 0x40);
  if (std::isinf(f) || f == 0.0f) return uint16_t(float_to_bits(f) >> 16);
  int e;
  std::frexp(double(f), &e);
  const int qexp = std::max(e - 8, -133);
  const double r = std::ldexp(std::nearbyint(std::ldexp(double(f), -qexp)), qexp);
  const float rf = float(r);  // exact, or overflows to inf exactly when RNE does
  return uint16_t(float_to_bits(rf) >> 16);
}

TEST(Bf16, EveryPatternRoundTrips) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_to_float(bf16{uint16_t(b)});
    EXPECT_EQ(float_to_bits(f), b << 16);
    const uint16_t back = float_to_bf16(f).bits;
    if ((b & 0x7fff) > 0x7f80) {
      ASSERT_TRUE(std::isnan(f));
      EXPECT_EQ(back, b | 0x40) << std::hex << b;  // NaN stays NaN, quieted, sign kept
    } else {
      EXPECT_EQ(back, b) << std::hex << b;
    }
  }
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is the midpoint of 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f).bits, 0x3f80);
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f + 0x1p-23f).bits, 0x3f81);
  // 1 + 3 * 2^-8 is the midpoint of 1 + 2^-7 (odd) and 1 + 2^-6: up to even.
  EXPECT_EQ(float_to_bf16(1.0f + 3 * 0x1p-8f).bits, 0x3f82);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()).bits, 0x7f80);  // -> inf
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::infinity()).bits, 0xff80);
  EXPECT_EQ(float_to_bf16(bits_to_float(0x00000001)).bits, 0x0000);  // smallest subnormal
  EXPECT_EQ(float_to_bf16(bits_to_float(0x00008000)).bits, 0x0000);  // tie to even 0
  EXPECT_EQ(float_to_bf16(bits_to_float(0x00018000)).bits, 0x0002);  // tie to even 2
  EXPECT_EQ(float_to_bf16(bits_to_float(0xff800001)).bits, 0xffc0);  // signalling NaN
}

TEST(Fp8, EveryPatternDecodesAndRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    const float f = fp8_e4m3_to_float(fp8_e4m3{uint8_t(b)});
    const uint8_t back = float_to_fp8_e4m3(f).bits;
    if (is_fp8_nan(uint8_t(b))) {
      EXPECT_TRUE(std::isnan(f)) << b;
      EXPECT_EQ(back, b) << b;  // NaN -> NaN, sign kept
    } else {
      EXPECT_EQ(double(f), fp8_value(uint8_t(b))) << b;
      EXPECT_EQ(std::signbit(f), b >= 0x80) << b;  // 0x80 is -0
      EXPECT_EQ(back, b) << b;
    }
  }
  EXPECT_EQ(fp8_e4m3_to_float(fp8_e4m3{0x7e}), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_float(fp8_e4m3{0x01}), 0x1p-9f);
  EXPECT_EQ(fp8_e4m3_to_float(fp8_e4m3{0x08}), 0x1p-6f);
}

TEST(Fp8, Specials) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(float_to_fp8_e4m3(448.0f).bits, 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(-448.0f).bits, 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(449.0f).bits, 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(1e30f).bits, 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(inf).bits, 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(-inf).bits, 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(std::nanf("")).bits, 0x7f);
  EXPECT_EQ(float_to_fp8_e4m3(-std::nanf("")).bits, 0xff);
  EXPECT_EQ(float_to_fp8_e4m3(-0.0f).bits, 0x80);
  EXPECT_EQ(float_to_fp8_e4m3(0x1p-10f).bits, 0x00);            // half the smallest: tie to 0
  EXPECT_EQ(float_to_fp8_e4m3(0x1p-10f * 3).bits, 0x02);        // 1.5 steps: tie to even 2
  EXPECT_EQ(float_to_fp8_e4m3(0x1p-6f - 0x1p-10f).bits, 0x08);  // 7.5 steps: up to 2^-6
  EXPECT_EQ(float_to_fp8_e4m3(400.0f).bits, 0x7c);              // tie of 384 / 416: even man 4
  EXPECT_EQ(float_to_fp8_e4m3(432.0f).bits, 0x7e);              // tie of 416 / 448: even man 6
  EXPECT_EQ(float_to_fp8_e4m3(bits_to_float(0x00000001)).bits, 0x00);
}

std::vector<float> fp8_random_inputs() {
  std::mt19937 rng(20240607);
  std::vector<float> v;
  const float inf = std::numeric_limits<float>::infinity();
  for (float f : {0.0f,
                  -0.0f,
                  448.0f,
                  -448.0f,
                  447.99997f,
                  448.00003f,
                  464.0f,
                  480.0f,
                  1e38f,
                  inf,
                  -inf,
                  std::nanf(""),
                  -std::nanf(""),
                  bits_to_float(0x7f800001),
                  bits_to_float(0x00000001),
                  bits_to_float(0x807fffff),
                  0x1p-6f,
                  0x1p-9f,
                  0x1p-10f,
                  0x1p-7f})
    v.push_back(f);
  // Every grid value, every midpoint between neighbours and one float ulp either side.
  for (int c = 0; c < 0x7e; ++c) {
    for (int s : {1, -1}) {
      const float g = float(fp8_value(uint8_t(c))) * s;
      const float mid = float((fp8_value(uint8_t(c)) + fp8_value(uint8_t(c + 1))) / 2) * s;
      for (float x : {g, mid}) {
        v.push_back(x);
        v.push_back(std::nextafter(x, inf));
        v.push_back(std::nextafter(x, -inf));
      }
    }
  }
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_real_distribution<float> wide(-600.0f, 600.0f);
  std::uniform_real_distribution<float> small(-0x1p-5f, 0x1p-5f);  // fp8 subnormal range
  std::uniform_int_distribution<uint32_t> f32_subnormal(0, 0x007fffff);
  while (v.size() < 1'100'000) {
    switch (v.size() % 4) {
      case 0:
        v.push_back(bits_to_float(bits(rng)));
        break;
      case 1:
        v.push_back(wide(rng));
        break;
      case 2:
        v.push_back(small(rng));
        break;
      case 3:
        v.push_back(bits_to_float(f32_subnormal(rng) | (bits(rng) & 0x80000000u)));
        break;
    }
  }
  return v;
}

TEST(Fp8, MatchesNearestGridValueOnAMillionFloats) {
  int mismatches = 0;
  for (float f : fp8_random_inputs()) {
    const uint8_t got = float_to_fp8_e4m3(f).bits, want = reference_fp8(f);
    if (got != want && ++mismatches <= 10) {
      ADD_FAILURE() << "float_to_fp8_e4m3(" << std::hexfloat << f << ") = 0x" << std::hex
                    << int(got) << ", reference 0x" << int(want);
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Bf16, MatchesDoubleReferenceOnRandomFloats) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  int mismatches = 0;
  for (int i = 0; i < 1'000'000; ++i) {
    uint32_t u = bits(rng);
    if (i % 3 == 0) u = (u & 0xffff0000u) | 0x8000u;  // exact ties
    if (i % 7 == 0) u &= 0x807fffffu;                 // f32 subnormals
    const float f = bits_to_float(u);
    const uint16_t got = float_to_bf16(f).bits, want = reference_bf16(f);
    if (got != want && ++mismatches <= 10) {
      ADD_FAILURE() << "float_to_bf16(0x" << std::hex << u << ") = 0x" << got << ", reference 0x"
                    << want;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(DTypeNames, ParseAndName) {
  EXPECT_STREQ(dtype_name(DType::kBF16), "bf16");
  EXPECT_EQ(*parse_dtype("fp32"), DType::kF32);
  EXPECT_EQ(*parse_dtype("e4m3"), DType::kFP8);
  EXPECT_EQ(parse_dtype("f16").status().message(), "dtype 'f16' is not one of f32, bf16, fp8");
  EXPECT_EQ(dtype_size(DType::kFP8), 1u);
}

}  // namespace
}  // namespace moed
