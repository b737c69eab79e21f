// sort_chunks_by_idxs and its backward against a brute force: packed, with gaps (output
// offsets), fp8 scales, value spans, thread counts 1/2/3, and error messages.
#include <gtest/gtest.h>

#include <memory>
#include <numeric>

#include "moed/permute.h"
#include "permute/test_util.h"

namespace moed {
namespace {

using permute_test::pool_of;
using permute_test::random_tokens;

struct Problem {
  std::vector<int64_t> split_sizes;
  std::vector<int32_t> sorted_idxs;
  std::vector<int64_t> offsets;  // empty = packed
  int64_t output_rows;
};

// Megatron's AlltoAll case: chunks of (source rank, local expert) reordered to (local expert,
// source rank), with random sizes (zeros included), optionally with gaps.
Problem make_problem(int ranks, int local, uint32_t seed, bool gaps) {
  std::mt19937 rng(seed);
  Problem p;
  for (int i = 0; i < ranks * local; ++i) p.split_sizes.push_back(int64_t(rng() % 5));
  for (int j = 0; j < local; ++j) {
    for (int s = 0; s < ranks; ++s) p.sorted_idxs.push_back(s * local + j);
  }
  int64_t row = 0;
  for (int32_t c : p.sorted_idxs) {
    if (gaps) row += int64_t(rng() % 3);
    if (gaps) p.offsets.push_back(row);
    row += p.split_sizes[size_t(c)];
  }
  p.output_rows = row + (gaps ? 2 : 0);
  return p;
}

// out row -> input row (-1 = gap).
std::vector<int64_t> brute_sources(const Problem& p) {
  std::vector<int64_t> src(size_t(p.output_rows), -1);
  std::vector<int64_t> begin(p.split_sizes.size() + 1, 0);
  for (size_t c = 0; c < p.split_sizes.size(); ++c) begin[c + 1] = begin[c] + p.split_sizes[c];
  int64_t row = 0;
  for (size_t i = 0; i < p.sorted_idxs.size(); ++i) {
    const size_t c = size_t(p.sorted_idxs[i]);
    if (!p.offsets.empty()) row = p.offsets[i];
    for (int64_t k = 0; k < p.split_sizes[c]; ++k) src[size_t(row + k)] = begin[c] + k;
    row += p.split_sizes[c];
  }
  return src;
}

TEST(SortChunks, MatchesBruteForceWithAndWithoutGaps) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kFP8}) {
    for (bool gaps : {false, true}) {
      for (int ranks : {1, 3, 4}) {
        const Problem p = make_problem(ranks, 3, uint32_t(ranks * 10 + gaps), gaps);
        const int64_t in_rows =
            std::accumulate(p.split_sizes.begin(), p.split_sizes.end(), int64_t(0));
        const int64_t H = dtype == DType::kFP8 ? 128 : 20;
        const TokenTensor x = random_tokens(dtype, in_rows, H, 3);
        const std::vector<int64_t> src = brute_sources(p);
        for (int threads : {1, 2, 3}) {
          SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " gaps=" << gaps
                                            << " ranks=" << ranks << " threads=" << threads);
          TokenTensor out;
          out.x = Tensor::empty(dtype, p.output_rows, H);
          std::memset(out.x.data(), 0xab, out.x.bytes());  // gaps must be zeroed
          if (dtype == DType::kFP8) {
            out.scales = Tensor::empty(DType::kF32, p.output_rows, 1);
            std::memset(out.scales.data(), 0xab, out.scales.bytes());
          }
          ASSERT_TRUE(sort_chunks_by_idxs_into(x.rows(), p.split_sizes, p.sorted_idxs, out.rows(),
                                               p.offsets, pool_of(threads))
                          .ok());
          std::vector<uint8_t> zero(out.x.view().row_bytes(), 0);
          for (int64_t r = 0; r < p.output_rows; ++r) {
            const int64_t s = src[size_t(r)];
            ASSERT_EQ(std::memcmp(out.x.row<uint8_t>(r), s >= 0 ? x.x.row<uint8_t>(s) : zero.data(),
                                  out.x.view().row_bytes()),
                      0)
                << r;
            if (dtype == DType::kFP8) {
              ASSERT_EQ(out.scales.row<float>(r)[0], s >= 0 ? x.scales.row<float>(s)[0] : 0.0f);
            }
          }
          if (!gaps) {
            StatusOr<TokenTensor> packed =
                sort_chunks_by_idxs(x.rows(), p.split_sizes, p.sorted_idxs, pool_of(threads));
            ASSERT_TRUE(packed.ok());
            EXPECT_TRUE(bitwise_equal(packed->x.view(), out.x.view()));
          }
          // Backward sorts back: the input again, bit for bit.
          StatusOr<TokenTensor> back = sort_chunks_by_idxs_backward(
              out.rows(), p.split_sizes, p.sorted_idxs, p.offsets, pool_of(threads));
          ASSERT_TRUE(back.ok()) << back.status().to_string();
          EXPECT_TRUE(bitwise_equal(back->x.view(), x.x.view()));
          if (dtype == DType::kFP8) {
            EXPECT_TRUE(bitwise_equal(back->scales.view(), x.scales.view()));
          }
        }
      }
    }
  }
}

TEST(SortChunks, ValueSpans) {
  const Problem p = make_problem(3, 2, 9, true);
  const int64_t in_rows = std::accumulate(p.split_sizes.begin(), p.split_sizes.end(), int64_t(0));
  std::vector<float> probs(static_cast<size_t>(in_rows));
  std::vector<int32_t> ids(static_cast<size_t>(in_rows));
  for (int64_t i = 0; i < in_rows; ++i)
    probs[size_t(i)] = float(i) + 0.5f, ids[size_t(i)] = int32_t(i);
  std::vector<float> out(size_t(p.output_rows), -1.0f);
  std::vector<int32_t> out_ids(size_t(p.output_rows), -7);
  ASSERT_TRUE(sort_chunks_by_idxs_into(std::span<const float>(probs), p.split_sizes, p.sorted_idxs,
                                       std::span<float>(out), p.offsets)
                  .ok());
  ASSERT_TRUE(sort_chunks_by_idxs_into(std::span<const int32_t>(ids), p.split_sizes, p.sorted_idxs,
                                       std::span<int32_t>(out_ids), p.offsets)
                  .ok());
  const std::vector<int64_t> src = brute_sources(p);
  for (int64_t r = 0; r < p.output_rows; ++r) {
    const int64_t s = src[size_t(r)];
    EXPECT_EQ(out[size_t(r)], s >= 0 ? probs[size_t(s)] : 0.0f);
    EXPECT_EQ(out_ids[size_t(r)], s >= 0 ? int32_t(s) : 0);
  }
}

TEST(SortChunks, EmptyInput) {
  const std::vector<int64_t> sizes = {0, 0};
  const std::vector<int32_t> idxs = {1, 0};
  Tensor x = Tensor::empty(DType::kBF16, 0, 8);
  StatusOr<TokenTensor> out = sort_chunks_by_idxs(TokenRows{x.view(), {}}, sizes, idxs);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->x.rows(), 0);
}

TEST(SortChunksErrors, NameTheOffendingValue) {
  Tensor x = Tensor::empty(DType::kBF16, 5, 8);
  const TokenRows in{x.view(), {}};
  auto expect_error = [](const Status& s, const std::string& text) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find(text), std::string::npos) << s.message();
  };
  const std::vector<int64_t> sizes = {2, 3};
  const std::vector<int32_t> repeat = {1, 1};
  expect_error(sort_chunks_by_idxs(in, sizes, repeat).status(),
               "sorted_idxs[1] = 1 repeats an earlier entry");
  const std::vector<int32_t> outside = {0, 2};
  expect_error(sort_chunks_by_idxs(in, sizes, outside).status(),
               "sorted_idxs[1] = 2 is outside [0, 2)");
  const std::vector<int64_t> negative = {-1, 6};
  const std::vector<int32_t> idxs = {1, 0};
  expect_error(sort_chunks_by_idxs(in, negative, idxs).status(), "split_sizes[0] = -1 is negative");
  const std::vector<int64_t> too_many = {2, 4};
  expect_error(sort_chunks_by_idxs(in, too_many, idxs).status(),
               "input is [5, 8]; expected [6, 8]");
  Tensor out = Tensor::empty(DType::kBF16, 6, 8);
  const std::vector<int64_t> overlap = {0, 2};  // chunk 0 (size 3) ends at 3 > 2
  expect_error(sort_chunks_by_idxs_into(in, sizes, idxs, TokenRows{out.view(), {}}, overlap),
               "output_offsets[1] = 2 overlaps the previous chunk, which ends at row 3");
  const std::vector<int64_t> past = {0, 5};
  expect_error(sort_chunks_by_idxs_into(in, sizes, idxs, TokenRows{out.view(), {}}, past),
               "output has 6 rows; the chunks need 7");
}

}  // namespace
}  // namespace moed
