#include "moed/tensor.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace moed {
namespace {

TEST(Tensor, ZerosIsAlignedAndZero) {
  Tensor t = Tensor::zeros(DType::kBF16, 5, 7);
  EXPECT_EQ(t.rows(), 5);
  EXPECT_EQ(t.cols(), 7);
  EXPECT_EQ(t.bytes(), 5u * 7u * 2u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u);
  const auto* p = static_cast<const uint8_t*>(t.data());
  for (size_t i = 0; i < t.bytes(); ++i) ASSERT_EQ(p[i], 0) << i;
  EXPECT_TRUE(t.view().contiguous());
}

TEST(Tensor, EmptyShapes) {
  Tensor a = Tensor::zeros(DType::kF32, 0, 16);
  Tensor b = Tensor::zeros(DType::kF32, 3, 0);
  EXPECT_EQ(a.bytes(), 0u);
  EXPECT_TRUE(a.view().empty());
  EXPECT_TRUE(bitwise_equal(b, Tensor::copy_of(b.view())));
  EXPECT_FALSE(bitwise_equal(a, b));
  EXPECT_TRUE(bitwise_equal(TensorView(nullptr, DType::kF32, 0, 16), a.view().slice_rows(0, 0)));
}

TEST(Tensor, MoveTransfersOwnership) {
  Tensor a = Tensor::zeros(DType::kF32, 2, 3);
  void* data = a.data();
  Tensor b = std::move(a);
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(a.rows(), 0);
  Tensor c = Tensor::zeros(DType::kFP8, 1, 1);
  c = std::move(b);
  EXPECT_EQ(c.data(), data);
  EXPECT_EQ(c.dtype(), DType::kF32);
  c = std::move(c);  // self-move keeps the data
  EXPECT_EQ(c.data(), data);
}

TEST(Tensor, SliceRowsWithStrideAndCopyOf) {
  // A 6 x 4 f32 view inside a buffer of stride 10.
  std::vector<float> buf(6 * 10);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = float(i);
  TensorView v(buf.data(), DType::kF32, 6, 4, 10);
  EXPECT_FALSE(v.contiguous());
  TensorView s = v.slice_rows(2, 3);
  EXPECT_EQ(s.rows, 3);
  EXPECT_EQ(s.row_stride, 10);
  EXPECT_EQ(s.row<float>(0)[0], 20.0f);
  EXPECT_EQ(s.row_span<float>(2)[3], 43.0f);

  Tensor c = Tensor::copy_of(s);
  EXPECT_TRUE(c.view().contiguous());
  for (int r = 0; r < 3; ++r) {
    for (int k = 0; k < 4; ++k) EXPECT_EQ(c.row<float>(r)[k], float((r + 2) * 10 + k));
  }
  // bitwise_equal compares the rows, not the strides.
  EXPECT_TRUE(bitwise_equal(c, s));
  c.row<float>(1)[3] = -1.0f;
  EXPECT_FALSE(bitwise_equal(c, s));
  // Same bytes, different shape or dtype: not equal.
  TensorView as_u8(buf.data(), DType::kFP8, 1, 16);
  TensorView as_f32(buf.data(), DType::kF32, 1, 4);
  EXPECT_FALSE(bitwise_equal(as_u8, as_f32));
  // +0 and -0 compare equal as floats but not bitwise.
  float pz = 0.0f, nz = -0.0f;
  EXPECT_FALSE(
      bitwise_equal(TensorView(&pz, DType::kF32, 1, 1), TensorView(&nz, DType::kF32, 1, 1)));
}

TEST(Tensor, TokenTensorRows) {
  TokenTensor t{Tensor::zeros(DType::kFP8, 3, 256), Tensor::zeros(DType::kF32, 3, 2)};
  TokenRows r = t.rows();
  EXPECT_TRUE(r.has_scales());
  EXPECT_EQ(r.scales.cols, 2);
  EXPECT_EQ(r.x.row_bytes(), 256u);
}

// The cache for large blocks (off under the sanitizers: the tests then check only that).
TEST(TensorCache, ReusesLargeBlocksOfTheSameSize) {
  if (tensor_cache_stats().limit_bytes == 0) {
    Tensor a = Tensor::zeros(DType::kF32, 1024, 1024);
    EXPECT_EQ(tensor_cache_stats().cached_bytes, 0u);
    GTEST_SKIP() << "tensor cache is off in this build";
  }
  release_tensor_cache();
  void* first = nullptr;
  {
    Tensor a = Tensor::empty(DType::kBF16, 2048, 4096);  // 16 MiB
    first = a.data();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
  }
  EXPECT_EQ(tensor_cache_stats().cached_bytes, size_t(16) << 20);
  const TensorCacheStats before = tensor_cache_stats();
  Tensor b = Tensor::empty(DType::kF32, 1024, 4096);  // the same 16 MiB, another shape
  EXPECT_EQ(b.data(), first);
  EXPECT_EQ(tensor_cache_stats().hits, before.hits + 1);
  EXPECT_EQ(tensor_cache_stats().cached_bytes, 0u);
  // zeros() still zeroes a reused block.
  std::memset(b.data(), 0xff, b.bytes());
  b = Tensor();
  Tensor z = Tensor::zeros(DType::kF32, 1024, 4096);
  EXPECT_EQ(z.data(), first);
  const auto* p = static_cast<const uint8_t*>(z.data());
  for (size_t i = 0; i < z.bytes(); i += 4093) ASSERT_EQ(p[i], 0) << i;
}

TEST(TensorCache, SmallBlocksAreNotCached) {
  if (tensor_cache_stats().limit_bytes == 0) GTEST_SKIP() << "tensor cache is off in this build";
  release_tensor_cache();
  { Tensor a = Tensor::zeros(DType::kF32, 16, 1024); }  // 64 KiB
  EXPECT_EQ(tensor_cache_stats().cached_bytes, 0u);
}

TEST(TensorCache, LimitEvictsLeastRecentlyFreed) {
  const size_t limit = tensor_cache_stats().limit_bytes;
  if (limit == 0) GTEST_SKIP() << "tensor cache is off in this build";
  release_tensor_cache();
  set_tensor_cache_limit(size_t(5) << 20);
  void* older = nullptr;
  void* newer = nullptr;
  {
    Tensor a = Tensor::empty(DType::kFP8, 2, size_t(2) << 20);  // 4 MiB
    Tensor b = Tensor::empty(DType::kFP8, 2, size_t(2) << 20);
    older = a.data();
    newer = b.data();
    a = Tensor();  // freed first
  }
  // Only one 4 MiB block fits under 5 MiB: the one freed last stays.
  EXPECT_EQ(tensor_cache_stats().cached_bytes, size_t(4) << 20);
  Tensor c = Tensor::empty(DType::kFP8, 2, size_t(2) << 20);
  EXPECT_NE(older, newer);
  EXPECT_EQ(c.data(), newer);
  c = Tensor();
  set_tensor_cache_limit(0);
  EXPECT_EQ(tensor_cache_stats().cached_bytes, 0u);
  set_tensor_cache_limit(limit);
  release_tensor_cache();
  EXPECT_EQ(tensor_cache_stats().cached_bytes, 0u);
  EXPECT_EQ(tensor_cache_stats().limit_bytes, limit);
}

}  // namespace
}  // namespace moed
