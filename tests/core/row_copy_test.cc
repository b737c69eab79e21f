// copy_rows (core/row_kernels.h): the rows land where asked, bytes outside them (other rows,
// a strided side's padding) stay untouched, packed and strided alike, on this thread and
// split across a pool, below and past the size from which it streams. stream_copy_rows: every
// row count of a batch, row sizes around the 16-byte stores and 64-byte lines, destinations
// aligned and not.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/row_kernels.h"
#include "moed/thread_pool.h"

namespace moed {
namespace {

struct Case {
  int64_t rows, cols, src_pad, dst_pad, src_row, dst_row, count;
};

void check(const Case& c, ThreadPool* pool) {
  SCOPED_TRACE(::testing::Message()
               << "rows " << c.rows << " cols " << c.cols << " pads " << c.src_pad << "/"
               << c.dst_pad << " count " << c.count << (pool ? " pooled" : ""));
  const int64_t ss = c.cols + c.src_pad, ds = c.cols + c.dst_pad;
  std::vector<float> src(size_t(c.rows * ss)), dst(size_t(c.rows * ds));
  std::mt19937 rng(uint32_t(c.rows * 31 + c.cols));
  for (float& v : src) v = float(rng() % 1000);
  for (float& v : dst) v = -1.0f;
  const std::vector<float> before = dst;
  const TensorView s(src.data(), DType::kF32, c.rows, c.cols, ss);
  const TensorView d(dst.data(), DType::kF32, c.rows, c.cols, ds);
  internal::copy_rows(d, c.dst_row, s, c.src_row, c.count, pool);
  for (int64_t r = 0; r < c.rows; ++r) {
    const bool copied = r >= c.dst_row && r < c.dst_row + c.count;
    const float* want =
        copied ? &src[size_t((c.src_row + r - c.dst_row) * ss)] : &before[size_t(r * ds)];
    ASSERT_EQ(std::memcmp(&dst[size_t(r * ds)], want, size_t(c.cols) * sizeof(float)), 0)
        << "row " << r;
    for (int64_t p = c.cols; p < ds; ++p)
      ASSERT_EQ(dst[size_t(r * ds + p)], -1.0f) << "pad of row " << r;
  }
}

TEST(CopyRows, PackedStridedPooledAndStreamed) {
  ThreadPool pool(3);
  const Case cases[] = {
      {8, 5, 0, 0, 0, 0, 0},           {8, 5, 0, 0, 2, 1, 5},
      {64, 17, 3, 0, 5, 9, 40},        {64, 17, 0, 7, 0, 0, 64},
      {64, 16, 4, 4, 10, 3, 37},       {1100, 2048, 0, 0, 0, 0, 1100},  // 9 MB: streamed
      {1100, 2048, 0, 16, 4, 0, 1096},
  };
  for (const Case& c : cases) {
    check(c, nullptr);
    check(c, &pool);
  }
}

TEST(StreamCopyRows, EveryRowLandsAndNothingElseMoves) {
  constexpr size_t kGuard = 64;
  std::mt19937 rng(5);
  for (size_t count = 0; count <= 8; ++count) {
    for (size_t bytes : {size_t(0), size_t(1), size_t(15), size_t(16), size_t(63), size_t(64),
                         size_t(65), size_t(4100), size_t(8192)}) {
      for (size_t misalign : {size_t(0), size_t(4), size_t(16)}) {
        SCOPED_TRACE(::testing::Message() << count << " rows of " << bytes << " bytes, dst + "
                                          << misalign);
        const size_t stride = (bytes + 2 * kGuard + 63) / 64 * 64;
        std::vector<unsigned char> src(count * stride + 64), dst(count * stride + 64);
        for (unsigned char& b : src) b = static_cast<unsigned char>(rng());
        std::fill(dst.begin(), dst.end(), 0xAB);
        unsigned char* s0 = src.data() + (64 - reinterpret_cast<uintptr_t>(src.data()) % 64);
        unsigned char* d0 = dst.data() + (64 - reinterpret_cast<uintptr_t>(dst.data()) % 64);
        std::vector<internal::RowCopy> rows;
        // Rows in reverse order, one of them (the second) unaligned where misalign says.
        for (size_t r = 0; r < count; ++r) {
          const size_t at = (count - 1 - r) * stride + kGuard + (r == 1 ? misalign : 0);
          rows.push_back({d0 + at, s0 + r * stride});
        }
        internal::stream_copy_rows(rows.data(), rows.size(), bytes);
        internal::stream_fence();
        std::vector<unsigned char> want(dst.size(), 0xAB);
        for (const internal::RowCopy& row : rows) {
          std::memcpy(want.data() + (static_cast<unsigned char*>(row.dst) - dst.data()), row.src,
                      bytes);
        }
        ASSERT_EQ(std::memcmp(dst.data(), want.data(), dst.size()), 0);
      }
    }
  }
}

}  // namespace
}  // namespace moed
