// reference_dispatch without layout options: the seed's worked example, several source ranks
// (one with T = 0), ETP = 2, and the payload formats (bf16 bits kept, FP8 with its scales).
#include <gtest/gtest.h>

#include <cstring>

#include "moed/reference.h"
#include "reference/reference_test_util.h"

namespace moed::testing {
namespace {

// design.md §3.1's worked example; probs chosen so every permuted prob says where it came from.
RoutingMap worked_example_map() {
  return make_map({{1, 1, 0}, {0, 1, 1}, {1, 0, 1}, {0, 1, 0}},
                  {{0.6f, 0.4f, 0.0f}, {0.0f, 0.7f, 0.3f}, {0.2f, 0.0f, 0.8f}, {0.0f, 1.0f, 0.0f}});
}

TEST(ReferenceDispatch, WorkedExample) {
  std::vector<Tensor> xs;
  xs.push_back(named_hidden(0, 4, 2));
  ReferenceProblem p = make_problem(3, 1, 1, {worked_example_map()}, xs);
  auto d = reference_dispatch(p);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  ASSERT_EQ(d->size(), 1u);
  const ReferenceRankDispatch& r = (*d)[0];
  EXPECT_EQ(r.row_src_token, (std::vector<int32_t>{0, 2, 0, 1, 3, 1, 2}));
  EXPECT_EQ(r.row_src_rank, (std::vector<int32_t>{0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(r.tokens_per_expert, (std::vector<int64_t>{2, 3, 2}));
  EXPECT_EQ(r.tokens_per_expert_unpadded, (std::vector<int64_t>{2, 3, 2}));
  EXPECT_EQ(r.permuted_probs, (std::vector<float>{0.6f, 0.2f, 0.4f, 0.7f, 1.0f, 0.3f, 0.8f}));
  ASSERT_EQ(r.expert_input.x.rows(), 7);
  ASSERT_EQ(r.expert_input.x.cols(), 2);
  EXPECT_EQ(r.expert_input.x.dtype(), DType::kF32);
  const std::vector<std::vector<float>> rows = {{0, 1},   {20, 21}, {0, 1},  {10, 11},
                                                {30, 31}, {10, 11}, {20, 21}};
  for (int i = 0; i < 7; ++i) EXPECT_EQ(row_values(r.expert_input.x, i), rows[size_t(i)]) << i;
}

TEST(ReferenceDispatch, SourceRanksInOrderWithDifferentTIncludingZero) {
  // 3 ranks, one expert each; rank 1 has no tokens.
  std::vector<RoutingMap> maps = {make_map({{1, 0, 1}, {0, 1, 1}}),
                                  make_map({}, {}, /*num_experts=*/3),
                                  make_map({{0, 0, 1}, {1, 1, 0}, {1, 0, 1}})};
  std::vector<Tensor> xs;
  xs.push_back(named_hidden(0, 2, 1));
  xs.push_back(named_hidden(1, 0, 1));
  xs.push_back(named_hidden(2, 3, 1));
  ReferenceProblem p = make_problem(3, 3, 1, maps, xs);
  auto d = reference_dispatch(p);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  ASSERT_EQ(d->size(), 3u);
  EXPECT_EQ((*d)[0].row_src_rank, (std::vector<int32_t>{0, 2, 2}));
  EXPECT_EQ((*d)[0].row_src_token, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ((*d)[1].row_src_rank, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ((*d)[1].row_src_token, (std::vector<int32_t>{1, 1}));
  EXPECT_EQ((*d)[2].row_src_rank, (std::vector<int32_t>{0, 0, 2, 2}));
  EXPECT_EQ((*d)[2].row_src_token, (std::vector<int32_t>{0, 1, 0, 2}));
  EXPECT_EQ((*d)[0].tokens_per_expert, (std::vector<int64_t>{3}));
  EXPECT_EQ((*d)[1].tokens_per_expert, (std::vector<int64_t>{2}));
  EXPECT_EQ((*d)[2].tokens_per_expert, (std::vector<int64_t>{4}));
  EXPECT_EQ(row_values((*d)[2].expert_input.x, 0), (std::vector<float>{0}));
  EXPECT_EQ(row_values((*d)[2].expert_input.x, 1), (std::vector<float>{10}));
  EXPECT_EQ(row_values((*d)[2].expert_input.x, 2), (std::vector<float>{2000}));
  EXPECT_EQ(row_values((*d)[2].expert_input.x, 3), (std::vector<float>{2020}));
  EXPECT_EQ(row_values((*d)[0].expert_input.x, 1), (std::vector<float>{2010}));
}

TEST(ReferenceDispatch, AllRanksWithoutTokens) {
  std::vector<Tensor> xs;
  xs.push_back(named_hidden(0, 0, 4));
  xs.push_back(named_hidden(1, 0, 4));
  ReferenceProblem p = make_problem(4, 2, 1, {make_map({}, {}, 4), make_map({}, {}, 4)}, xs);
  auto d = reference_dispatch(p);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  for (const ReferenceRankDispatch& r : *d) {
    EXPECT_EQ(r.expert_input.x.rows(), 0);
    EXPECT_EQ(r.expert_input.x.cols(), 4);
    EXPECT_EQ(r.tokens_per_expert, (std::vector<int64_t>{0, 0}));
  }
}

TEST(ReferenceDispatch, ExpertTensorParallelRanksHoldIdenticalRows) {
  // EP = 2, ETP = 2: ranks 0, 1 hold experts 0-1, ranks 2, 3 experts 2-3; rank 2 has T = 0
  // and rank 3's token 1 routes nowhere.
  std::vector<RoutingMap> maps = {make_map({{1, 0, 1, 0}, {0, 1, 0, 0}}),
                                  make_map({{0, 0, 0, 1}, {1, 0, 0, 0}}), make_map({}, {}, 4),
                                  make_map({{1, 1, 1, 1}, {0, 0, 0, 0}})};
  std::vector<Tensor> xs;
  for (int s = 0; s < 4; ++s) xs.push_back(named_hidden(s, s == 2 ? 0 : 2, 3));
  ReferenceProblem p = make_problem(4, 2, 2, maps, xs);
  auto d = reference_dispatch(p);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  ASSERT_EQ(d->size(), 4u);
  EXPECT_EQ((*d)[0].row_src_rank, (std::vector<int32_t>{0, 1, 3, 0, 3}));
  EXPECT_EQ((*d)[0].row_src_token, (std::vector<int32_t>{0, 1, 0, 1, 0}));
  EXPECT_EQ((*d)[0].tokens_per_expert, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ((*d)[2].row_src_rank, (std::vector<int32_t>{0, 3, 1, 3}));
  EXPECT_EQ((*d)[2].row_src_token, (std::vector<int32_t>{0, 0, 0, 0}));
  EXPECT_EQ((*d)[2].tokens_per_expert, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(row_values((*d)[0].expert_input.x, 1), (std::vector<float>{1010, 1011, 1012}));
  for (int g : {0, 2}) {
    const ReferenceRankDispatch& a = (*d)[size_t(g)];
    const ReferenceRankDispatch& b = (*d)[size_t(g + 1)];
    EXPECT_TRUE(bitwise_equal(a.expert_input.x.view(), b.expert_input.x.view())) << g;
    EXPECT_EQ(a.row_src_rank, b.row_src_rank);
    EXPECT_EQ(a.row_src_token, b.row_src_token);
    EXPECT_EQ(a.permuted_probs, b.permuted_probs);
    EXPECT_EQ(a.tokens_per_expert, b.tokens_per_expert);
  }
}

TEST(ReferenceDispatch, Bf16PayloadBitsAreKept) {
  // Any bit pattern, NaN included, travels unchanged.
  Tensor x = Tensor::zeros(DType::kBF16, 4, 3);
  for (int t = 0; t < 4; ++t) {
    for (int h = 0; h < 3; ++h) x.row<bf16>(t)[h] = bf16{uint16_t(0x7fc1 + 0x100 * t + h)};
  }
  std::vector<Tensor> xs;
  xs.push_back(std::move(x));
  ReferenceProblem p = make_problem(3, 1, 1, {worked_example_map()}, xs);
  auto d = reference_dispatch(p);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  const Tensor& in = (*d)[0].expert_input.x;
  ASSERT_EQ(in.dtype(), DType::kBF16);
  const int tokens[7] = {0, 2, 0, 1, 3, 1, 2};
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(std::memcmp(in.row<bf16>(i), xs[0].row<bf16>(tokens[i]), 6), 0) << i;
  }
  EXPECT_EQ((*d)[0].expert_input.scales.rows(), 0);
}

TEST(ReferenceDispatch, Fp8PayloadCarriesScalesAndPaddingIsZero) {
  const int64_t H = 256;  // two scale blocks
  Tensor x = Tensor::zeros(DType::kFP8, 4, H);
  Tensor scales = Tensor::zeros(DType::kF32, 4, H / kFp8BlockSize);
  for (int t = 0; t < 4; ++t) {
    for (int64_t h = 0; h < H; ++h) x.row<fp8_e4m3>(t)[h] = fp8_e4m3{uint8_t(1 + t * 16 + h % 16)};
    scales.row<float>(t)[0] = 0.5f + float(t);
    scales.row<float>(t)[1] = 0.25f + float(t);
  }
  ReferenceProblem p;
  p.num_experts = 3;
  p.routing = {worked_example_map()};
  p.hidden = {TokenRows{x.view(), scales.view()}};
  p.layout.expert_alignment = 4;
  auto d = reference_dispatch(p);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  const ReferenceRankDispatch& r = (*d)[0];
  EXPECT_EQ(r.tokens_per_expert, (std::vector<int64_t>{4, 4, 4}));
  EXPECT_EQ(r.row_src_token, (std::vector<int32_t>{0, 2, -1, -1, 0, 1, 3, -1, 1, 2, -1, -1}));
  ASSERT_EQ(r.expert_input.x.dtype(), DType::kFP8);
  ASSERT_EQ(r.expert_input.scales.rows(), 12);
  ASSERT_EQ(r.expert_input.scales.cols(), 2);
  for (int i = 0; i < 12; ++i) {
    const int t = r.row_src_token[size_t(i)];
    const uint8_t* row = &r.expert_input.x.row<fp8_e4m3>(i)->bits;
    for (int64_t h = 0; h < H; ++h) {
      EXPECT_EQ(row[h], t < 0 ? 0 : uint8_t(1 + t * 16 + h % 16)) << i << " " << h;
    }
    EXPECT_EQ(r.expert_input.scales.row<float>(i)[0], t < 0 ? 0.0f : 0.5f + float(t)) << i;
    EXPECT_EQ(r.expert_input.scales.row<float>(i)[1], t < 0 ? 0.0f : 0.25f + float(t)) << i;
    if (t < 0) {
      EXPECT_EQ(testing::bits_of(r.expert_input.scales.row<float>(i)[0]), 0u);
    }
  }
}

}  // namespace
}  // namespace moed::testing
