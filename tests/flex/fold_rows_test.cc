// The one-pass fold Flex's combine calls per token (RowKernels::fold_rows, core/row_kernels.h)
// equals the chain it replaces, bit for bit, in every table this CPU runs: a zeroed fp32 row
// (or one holding a carried sum, `init`), add_term / add_term_weighted per row in order, then
// store, all from the scalar table. Over
// source and output types, lengths with vector tails and past the prefetch blocks (512), 0 to
// 9 rows, weighted and not, streamed and not (to 64-byte aligned and unaligned outputs), with
// raw bit patterns (NaN, infinity, -0, subnormals) among the values. NaNs only in the first
// row: where two NaNs meet in a sum, which payload wins depends on operand order, which
// compilers may swap (tests/core/row_kernels_test.cc keeps the same rule); one NaN operand is
// exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <utility>
#include <vector>

#include "core/row_kernels.h"
#include "moed/dtype.h"

namespace moed {
namespace {

using internal::RowKernels;

std::vector<const RowKernels*> tables() {
  std::vector<const RowKernels*> t{&internal::scalar_kernels(), &internal::row_kernels()};
  if (auto* k = internal::avx2_kernels()) t.push_back(k);
  if (auto* k = internal::avx512_kernels()) t.push_back(k);
  return t;
}

// n elements of type t: a quarter raw random bits (NaN ones replaced by 1.5 unless allow_nan),
// a quarter special values, the rest values in [-2, 2), each rounded to t.
std::vector<unsigned char> random_row(DType t, size_t n, bool allow_nan, std::mt19937& rng) {
  std::vector<unsigned char> row(n * dtype_size(t) + 1);  // + 1: data() is never null
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  for (size_t i = 0; i < n; ++i) {
    unsigned char* p = row.data() + i * dtype_size(t);
    const uint32_t bits = uint32_t(rng());
    const bool raw = bits % 4 == 0;
    // Zeros of both signs, infinities and a subnormal often (raw bits rarely hit them).
    const float specials[] = {-0.0f, 0.0f, INFINITY, -INFINITY, 1e-40f, -3.0e38f};
    const float v = bits % 4 == 1 ? specials[(bits >> 2) % std::size(specials)] : value(rng);
    const float nan_free = 1.5f;
    switch (t) {
      case DType::kF32:
        if (raw) {
          float f;
          std::memcpy(&f, &bits, 4);
          if (!allow_nan && std::isnan(f)) f = nan_free;
          std::memcpy(p, &f, 4);
        } else {
          std::memcpy(p, &v, 4);
        }
        break;
      case DType::kBF16: {
        bf16 b = raw ? bf16{uint16_t(bits >> 8)} : float_to_bf16(v);
        if (!allow_nan && std::isnan(bf16_to_float(b))) b = float_to_bf16(nan_free);
        std::memcpy(p, &b, 2);
        break;
      }
      case DType::kFP8: {
        fp8_e4m3 q = raw ? fp8_e4m3{uint8_t(bits >> 8)} : float_to_fp8_e4m3(v);
        if (!allow_nan && std::isnan(fp8_e4m3_to_float(q))) q = float_to_fp8_e4m3(nan_free);
        std::memcpy(p, &q, 1);
        break;
      }
    }
  }
  return row;
}

TEST(FlexFoldRows, EqualsTheTermByTermChain) {
  const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kFP8};
  const size_t kLengths[] = {0,  1,  7,   8,   15,       16,           17,
                             33, 64, 511, 512, 1024 + 9, 3 * 512 + 31, 4096};
  const RowKernels& scalar = internal::scalar_kernels();
  std::mt19937 rng(2026);
  for (const RowKernels* k : tables()) {
    for (DType t : kTypes) {
      for (DType dt : kTypes) {
        for (size_t n : kLengths) {
          for (int count : {0, 1, 2, 3, 9}) {
            std::vector<std::vector<unsigned char>> rows;
            std::vector<const void*> ptrs;
            std::vector<float> w;
            for (int q = 0; q < count; ++q) {
              rows.push_back(random_row(t, n, /*allow_nan=*/q == 0, rng));
              ptrs.push_back(rows.back().data());
              // Never 0: 0 * inf would make a NaN where a later row's NaN may meet it.
              w.push_back(std::uniform_real_distribution<float>(0.01f, 1.0f)(rng));
            }
            // A carried sum (a chain's fp32 partial): never -0, as a sum started at +0 is
            // not; no NaN, which row 0 may hold.
            const std::vector<unsigned char> bits = random_row(DType::kF32, n, false, rng);
            std::vector<float> carried(n);
            for (size_t i = 0; i < n; ++i) {
              std::memcpy(&carried[i], bits.data() + 4 * i, 4);
              if (carried[i] == 0.0f) carried[i] = 0.0f;
            }
            for (auto [weighted, init] : {std::pair{false, false}, std::pair{true, false},
                                          std::pair{false, true}, std::pair{true, true}}) {
              std::vector<float> acc = init ? carried : std::vector<float>(n, 0.0f);
              for (int q = 0; q < count; ++q) {
                if (weighted) {
                  scalar.add_term_weighted(acc.data(), ptrs[size_t(q)], t, w[size_t(q)], n);
                } else {
                  scalar.add_term(acc.data(), ptrs[size_t(q)], t, n);
                }
              }
              std::vector<unsigned char> want(n * dtype_size(dt) + 1, 0);
              scalar.store(acc.data(), want.data(), dt, n);
              // dst 64-byte aligned (streamed: straight from the registers for bf16 and f32)
              // and one element off (streamed through the L1 block).
              for (bool stream : {false, true}) {
                for (size_t skew : {size_t(0), dtype_size(dt)}) {
                  std::vector<unsigned char> space(want.size() + 128, 0xa5);
                  unsigned char* got = space.data() + (64 - uintptr_t(space.data()) % 64) + skew;
                  got[want.size() - 1] = 0;  // past the row: must stay untouched
                  k->fold_rows(ptrs.data(), t, weighted ? w.data() : nullptr, count, got, dt, n,
                               stream, init ? carried.data() : nullptr);
                  internal::stream_fence();
                  const size_t at =
                      size_t(std::mismatch(got, got + want.size(), want.begin()).first - got);
                  ASSERT_EQ(std::vector<unsigned char>(got, got + want.size()), want)
                      << "first byte " << at << ": " << k->isa << " " << dtype_name(t) << " -> "
                      << dtype_name(dt) << " n=" << n << " rows=" << count
                      << " weighted=" << weighted << " init=" << init << " stream=" << stream
                      << " skew=" << skew;
                }
              }
            }
          }
        }
      }
    }
  }
}

// FoldAhead (one token behind) writes what one fold_rows per token writes, tokens with no
// rows included, streamed or not.
TEST(FlexFoldRows, FoldAheadEqualsOneFoldPerToken) {
  const size_t n = 1000;
  const int kTokens = 5;
  const int kCount[kTokens] = {2, 0, 3, 1, 2};
  std::mt19937 rng(7);
  std::vector<std::vector<unsigned char>> rows;
  std::vector<std::vector<const void*>> ptrs(kTokens);
  std::vector<std::vector<float>> w(kTokens);
  for (int t = 0; t < kTokens; ++t) {
    for (int q = 0; q < kCount[t]; ++q) {
      rows.push_back(random_row(DType::kBF16, n, /*allow_nan=*/q == 0, rng));
      w[size_t(t)].push_back(std::uniform_real_distribution<float>(0.01f, 1.0f)(rng));
    }
  }
  size_t next = 0;
  for (int t = 0; t < kTokens; ++t) {
    for (int q = 0; q < kCount[t]; ++q) ptrs[size_t(t)].push_back(rows[next++].data());
  }
  const RowKernels& k = internal::row_kernels();
  for (bool stream : {false, true}) {
    std::vector<uint16_t> want(size_t(kTokens) * n), got(want.size(), 0xa5a5);
    for (int t = 0; t < kTokens; ++t) {
      k.fold_rows(ptrs[size_t(t)].data(), DType::kBF16, w[size_t(t)].data(), kCount[t],
                  want.data() + size_t(t) * n, DType::kBF16, n, false, nullptr);
    }
    internal::FoldAhead fold(DType::kBF16, DType::kBF16, n, /*weighted=*/true, stream);
    for (int t = 0; t < kTokens; ++t) {
      for (int q = 0; q < kCount[t]; ++q)
        fold.add(ptrs[size_t(t)][size_t(q)], w[size_t(t)][size_t(q)]);
      fold.push(got.data() + size_t(t) * n);
    }
    fold.flush();
    internal::stream_fence();
    EXPECT_EQ(got, want) << "stream=" << stream;
  }
}

}  // namespace
}  // namespace moed
