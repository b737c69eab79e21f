// The one table of row kernels (core/row_kernels.h): every table this CPU can run equals the
// scalar table bit for bit, for every kernel, over hidden sizes that leave vector tails (1, 7,
// 15, 17, 127, 129, 4096 + 3), f32 / bf16 / fp8 sources, weighted and not, with NaN, infinity,
// denormal and negative-zero inputs. Run it under each MOED_ISA value too: the active table
// must follow the cap.
#include "core/row_kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "moed/dtype.h"
#include "support/bits.h"

namespace moed {
namespace internal {
// gtest prints a parameter into ctest's test list: the table's ISA, not its address (which
// changes from build to build).
void PrintTo(const RowKernels* k, std::ostream* os) { *os << k->isa; }
}  // namespace internal

namespace {

using internal::RowKernels;

std::vector<const RowKernels*> vector_tables() {
  std::vector<const RowKernels*> t;
  if (auto* k = internal::avx2_kernels()) t.push_back(k);
  if (auto* k = internal::avx512_kernels()) t.push_back(k);
  // The one every caller uses (scalar on a CPU without AVX2, or under MOED_ISA).
  const RowKernels* active = &internal::row_kernels();
  if (std::find(t.begin(), t.end(), active) == t.end()) t.push_back(active);
  return t;
}

// Vector tails of every width (8, 16), the prefetch blocks (512) and a long row.
const size_t kLengths[] = {0, 1, 7, 8, 9, 15, 16, 17, 31, 127, 128, 129, 1000, 4096 + 3};
const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kFP8};

// Random floats with specials sprinkled in: NaNs (several payloads), infinities, zeros of
// both signs, f32 and fp8 subnormals, values around 448.
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
        v[i] = bits_to_float((bits(rng) & 0x807fffffu));  // f32 subnormal
        break;
      default:
        v[i] = normal(rng);
        break;
    }
    if (!allow_nan && std::isnan(v[i])) v[i] = 2.5f;
  }
  return v;
}

// A row of `n` elements of t: specials for f32, random raw bit patterns for the 1- and
// 2-byte formats (every NaN encoding, subnormals and -0 among them).
std::vector<uint8_t> random_row(DType t, size_t n, uint32_t seed, bool allow_nan = true) {
  std::vector<uint8_t> row(n * dtype_size(t));
  if (t == DType::kF32) {
    const auto f = special_floats(n, seed, allow_nan);
    if (n) std::memcpy(row.data(), f.data(), row.size());
    return row;
  }
  std::mt19937 rng(seed);
  for (auto& b : row) b = uint8_t(rng());
  if (!allow_nan) {
    for (size_t i = 0; i < n; ++i) {
      uint8_t* p = row.data() + i * dtype_size(t);
      if (t == DType::kFP8 && (p[0] & 0x7f) == 0x7f) p[0] = 0x38;
      if (t == DType::kBF16 && (p[1] & 0x7f) == 0x7f && (p[0] & 0x80)) p[1] = 0x3f;
    }
  }
  return row;
}

template <typename... A>
std::string fmt(const A&... a) {
  std::ostringstream o;
  (o << ... << a);
  return o.str();
}

using testing::same_bits;

template <typename T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// f's values as f32 or bf16 (rounded to nearest even) bytes.
std::vector<uint8_t> rows_as(const std::vector<float>& f, DType t) {
  if (t == DType::kF32) return bytes_of(f);
  std::vector<bf16> b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = float_to_bf16(f[i]);
  return bytes_of(b);
}

// Runs `run(table, dst)` for the scalar table and for k into `bytes` bytes plus a guard byte;
// the outputs must be equal bit for bit and the guard untouched.
template <class Run>
void expect_same_output(const RowKernels& k, size_t bytes, const std::string& what, Run run) {
  std::vector<uint8_t> want(bytes + 1, 0xcd), got(want);
  run(internal::scalar_kernels(), want.data());
  run(k, got.data());
  EXPECT_TRUE(same_bits(got, want)) << k.isa << " " << what;
  EXPECT_EQ(got.back(), 0xcd) << k.isa << " " << what << " wrote past the end";
}

// Weights: ordinary, negative, both zeros, tiny (denormal products), huge (overflow to inf).
const float kWeights[] = {1.0f, 0.3f, -2.5f, 0.0f, -0.0f, 1e-30f, 3e38f};

class RowTables : public ::testing::TestWithParam<const RowKernels*> {};

TEST_P(RowTables, ConvertEqualsScalar) {
  const RowKernels& k = *GetParam();
  for (size_t n : kLengths) {
    for (DType st : kTypes) {
      for (DType dt : kTypes) {
        const auto src = random_row(st, n, uint32_t(n * 9 + int(st) * 3 + int(dt)));
        expect_same_output(
            k, n * dtype_size(dt), fmt(dtype_name(st), " -> ", dtype_name(dt), " n = ", n),
            [&](const RowKernels& r, void* dst) { r.convert(src.data(), st, dst, dt, n); });
      }
    }
  }
}

// f32 -> FP8 where the encoder changes rule (subnormal codes up to 2^-6, saturation from 448,
// inf and NaN), both signs: every float near each boundary, and a stride over the ranges
// around them. The vector encoder's shortcuts (the min that saturates) against the scalar rule.
TEST_P(RowTables, Fp8EncodeEqualsScalarAtTheEdges) {
  const RowKernels& k = *GetParam();
  std::vector<float> src;
  auto add = [&](uint32_t lo, uint32_t hi, uint32_t step) {
    for (uint64_t u = lo; u <= hi; u += step) {
      for (uint32_t sign : {0u, 0x80000000u}) src.push_back(bits_to_float(uint32_t(u) | sign));
    }
  };
  add(0x3a800000, 0x3d000000, 61);    // 2^-10 .. 2^-5
  add(0x3c7f0000, 0x3c810000, 1);     // around 2^-6, the smallest normal
  add(0x43700000, 0x44800000, 29);    // 240 .. 1024
  add(0x43dfff00, 0x43e80100, 1);     // 448 .. 464, where the codes run out
  add(0x7f000000, 0x7fffffff, 4099);  // the largest floats, inf and the NaNs
  expect_same_output(k, src.size(), "f32 -> fp8 at the edges", [&](const RowKernels& r, void* d) {
    r.convert(src.data(), DType::kF32, d, DType::kFP8, src.size());
  });
}

// accumulate, accumulate_weighted, start, start_weighted, add_term, add_term_weighted.
TEST_P(RowTables, AccumulateFamilyEqualsScalar) {
  const RowKernels& k = *GetParam();
  const RowKernels& ref = internal::scalar_kernels();
  for (size_t n : kLengths) {
    for (DType t : kTypes) {
      const auto src = random_row(t, n, uint32_t(n + 100 * int(t)));
      // Accumulators without NaN: when both operands of an add are NaN, which payload wins
      // depends on operand order, which compilers may swap; one NaN operand is exact. The
      // start kernels get NaN-filled accumulators: they must not read them.
      const auto acc0 = special_floats(n + 1, uint32_t(n + 7), /*allow_nan=*/false);
      const std::vector<float> junk(n + 1, std::numeric_limits<float>::quiet_NaN());
      auto check = [&](const char* what, float w, const std::vector<float>& init, auto run) {
        auto want = init, got = init;
        run(ref, want.data());
        run(k, got.data());
        EXPECT_TRUE(same_bits(got, want))
            << k.isa << " " << what << " " << dtype_name(t) << " w = " << w << " n = " << n;
        EXPECT_TRUE(std::memcmp(&got[n], &init[n], 4) == 0) << what << " wrote past the end";
      };
      const void* x = src.data();
      check("accumulate", 1, acc0,
            [&](const RowKernels& r, float* a) { r.accumulate(a, x, t, n); });
      check("start", 1, junk, [&](const RowKernels& r, float* a) { r.start(a, x, t, n); });
      check("add_term", 1, acc0, [&](const RowKernels& r, float* a) { r.add_term(a, x, t, n); });
      for (float w : kWeights) {
        check("accumulate_weighted", w, acc0,
              [&](const RowKernels& r, float* a) { r.accumulate_weighted(a, x, t, w, n); });
        check("start_weighted", w, junk,
              [&](const RowKernels& r, float* a) { r.start_weighted(a, x, t, w, n); });
        check("add_term_weighted", w, acc0,
              [&](const RowKernels& r, float* a) { r.add_term_weighted(a, x, t, w, n); });
      }
    }
  }
}

TEST_P(RowTables, StoreAndScaleEqualScalar) {
  const RowKernels& k = *GetParam();
  for (size_t n : kLengths) {
    for (DType t : kTypes) {
      const auto acc = special_floats(n, uint32_t(n + 11));
      expect_same_output(k, n * dtype_size(t), fmt("store ", dtype_name(t), " n = ", n),
                         [&](const RowKernels& r, void* dst) { r.store(acc.data(), dst, t, n); });
      // Sources with NaN are fine here (w is never NaN, so a product has one NaN operand).
      const auto src = random_row(t, n, uint32_t(n + 13 * int(t)));
      for (float w : kWeights) {
        expect_same_output(
            k, n * dtype_size(t), fmt("scale ", dtype_name(t), " w = ", w, " n = ", n),
            [&](const RowKernels& r, void* dst) { r.scale(dst, src.data(), t, w, n); });
      }
    }
  }
}

TEST_P(RowTables, DotEqualsScalarAndAPlainLoop) {
  const RowKernels& k = *GetParam();
  const RowKernels& ref = internal::scalar_kernels();
  for (size_t n : kLengths) {
    for (DType at : kTypes) {
      for (DType bt : {DType::kF32, DType::kBF16}) {
        // Up to 9 pairs: two full groups of 4 chains and one alone. One operand may be NaN.
        std::vector<std::vector<uint8_t>> a, b;
        for (int q = 0; q < 9; ++q) {
          a.push_back(random_row(at, n, uint32_t(n * 31 + q * 7 + int(at))));
          b.push_back(random_row(bt, n, uint32_t(n * 37 + q * 5 + int(bt)), /*allow_nan=*/false));
        }
        std::vector<const void*> ap, bp;
        for (int q = 0; q < 9; ++q)
          ap.push_back(a[size_t(q)].data()), bp.push_back(b[size_t(q)].data());
        for (int count : {1, 4, 9}) {
          const size_t m = static_cast<size_t>(count);
          std::vector<float> want(m), got(m), plain(m);
          ref.dot(ap.data(), at, bp.data(), bt, count, n, want.data());
          k.dot(ap.data(), at, bp.data(), bt, count, n, got.data());
          for (int q = 0; q < count; ++q) {
            std::vector<float> fa(n), fb(n);
            ref.convert(ap[size_t(q)], at, fa.data(), DType::kF32, n);
            ref.convert(bp[size_t(q)], bt, fb.data(), DType::kF32, n);
            float d = 0.0f;
            for (size_t h = 0; h < n; ++h) d = d + fa[h] * fb[h];
            plain[size_t(q)] = d;
          }
          EXPECT_TRUE(same_bits(got, want)) << k.isa << " dot n = " << n << " count = " << count;
          // Two NaN operands may meet in a sum (payload then depends on operand order).
          for (int q = 0; q < count; ++q) {
            const float w = want[size_t(q)], p = plain[size_t(q)];
            EXPECT_TRUE(float_to_bits(w) == float_to_bits(p) || (std::isnan(w) && std::isnan(p)))
                << "dot n = " << n << " q = " << q << ": " << w << " vs " << p;
          }
        }
      }
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
        const std::vector<uint8_t> x = rows_as(f, t);
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

// Blocks whose scaled values are all normal codes take a shorter encode than blocks with a
// zero, a subnormal code or a non-finite value: both kinds, and the edge between them (the
// smallest |x| of a block scaled to just above, at and just below 2^-6), equal scalar's bits.
TEST_P(RowTables, QuantizeNormalBlocksEqualScalar) {
  const RowKernels& k = *GetParam();
  const RowKernels& ref = internal::scalar_kernels();
  constexpr size_t kBlocks = 2048, n = kBlocks * 128;
  std::mt19937 rng(7);
  std::vector<float> f(n);
  for (size_t b = 0; b < kBlocks; ++b) {
    // Spread of |x| inside the block: 2^spread, around 28672 = 448 / 2^-6 for some blocks.
    const int spread = int(rng() % 18);
    const int base = int(rng() % 60) - 30;
    for (size_t i = 0; i < 128; ++i) {
      const float m = 1.0f + float(rng() % 1024) / 1024.0f;
      const float sign = rng() % 2 ? -1.0f : 1.0f;
      f[b * 128 + i] = sign * std::ldexp(m, base - int(rng() % size_t(spread + 1)));
    }
    if (b % 3 == 0) {
      // amax and a smallest |x| at amax / 28672 (one ulp either side, or exact).
      const float amax = std::fabs(f[b * 128]), edge = amax / 28672.0f;
      const int side = int(rng() % 3);
      f[b * 128 + 1] = side == 1 ? edge : std::nextafter(edge, side == 0 ? 0.0f : amax);
      for (size_t i = 2; i < 128; ++i) f[b * 128 + i] = std::fmin(std::fabs(f[b * 128 + i]), amax);
    }
  }
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (bool round_scale : {false, true}) {
      const std::vector<uint8_t> x = rows_as(f, t);
      std::vector<fp8_e4m3> q_want(n), q_got(n);
      std::vector<float> s_want(kBlocks), s_got(kBlocks);
      ref.quantize_fp8(x.data(), t, round_scale, q_want.data(), s_want.data(), n);
      k.quantize_fp8(x.data(), t, round_scale, q_got.data(), s_got.data(), n);
      EXPECT_TRUE(same_bits(q_got, q_want)) << k.isa << " " << dtype_name(t) << " " << round_scale;
      EXPECT_TRUE(same_bits(s_got, s_want)) << k.isa << " " << dtype_name(t) << " " << round_scale;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, RowTables, ::testing::ValuesIn(vector_tables()),
                         [](const auto& info) { return std::string(info.param->isa); });

// The scalar table itself keeps what each formula says about the special values.
TEST(RowKernels, ScalarKeepsSpecialValues) {
  const RowKernels& s = internal::scalar_kernels();
  const float inf = std::numeric_limits<float>::infinity();
  const float x[4] = {-0.0f, inf, 1e-40f, -1e-45f};
  float acc[4];
  s.start(acc, x, DType::kF32, 4);  // 0 + -0 = +0; the rest unchanged
  EXPECT_EQ(float_to_bits(acc[0]), 0u);
  EXPECT_EQ(acc[1], inf);
  EXPECT_EQ(acc[2], 1e-40f);
  EXPECT_EQ(acc[3], -1e-45f);
  float neg[4] = {-0.0f, -0.0f, -0.0f, -0.0f};
  s.accumulate(neg, x, DType::kF32, 1);  // -0 + -0 = -0 is kept
  EXPECT_EQ(float_to_bits(neg[0]), 0x80000000u);
  s.add_term(neg + 1, x, DType::kF32, 1);  // -0 + (0 + -0) = +0
  EXPECT_EQ(float_to_bits(neg[1]), 0u);
  bf16 out[4];
  s.scale(out,
          std::vector<bf16>{float_to_bf16(-0.0f), bf16{0x7fc1}, bf16{0x0001}, bf16{0xff80}}.data(),
          DType::kBF16, 1.0f, 4);
  EXPECT_EQ(out[0].bits, 0x8000);  // -0 kept
  EXPECT_EQ(out[1].bits, 0x7fc1);  // NaN payload kept
  EXPECT_EQ(out[2].bits, 0x0001);  // bf16 denormal kept
  EXPECT_EQ(out[3].bits, 0xff80);  // -inf kept
  const float nan = bits_to_float(0xffc01234u);
  s.store(&nan, out, DType::kBF16, 1);
  EXPECT_EQ(out[0].bits, 0xffc0);  // NaN keeps its sign
}

// The active table follows MOED_ISA (a cap, never above what the CPU runs), and the public
// name reports it.
TEST(RowKernels, ActiveTableFollowsMoedIsa) {
  const std::string isa = active_isa_name();
  EXPECT_EQ(isa, internal::row_kernels().isa);
  const char* env = std::getenv("MOED_ISA");
  const std::string cap = env ? env : "";
  std::string want = internal::avx512_kernels() ? "avx512"
                     : internal::avx2_kernels() ? "avx2"
                                                : "scalar";
  if (cap == "scalar") want = "scalar";
  if (cap == "avx2" && want == "avx512") want = "avx2";
  EXPECT_EQ(isa, want) << "MOED_ISA = '" << cap << "'";
}

}  // namespace
}  // namespace moed
