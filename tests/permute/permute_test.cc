// permute / unpermute and their backward against a brute force written from design.md §3-§4, for
// every option, dtype and thread count (1, 2, 3), bit for bit.
#include "moed/permute.h"

#include <gtest/gtest.h>

#include <memory>

#include "permute/test_util.h"

namespace moed {
namespace {

using permute_test::brute_layout;
using permute_test::brute_unpermute_f32;
using permute_test::BruteLayout;
using permute_test::equals_rounded;
using permute_test::pool_of;
using permute_test::random_map;
using permute_test::random_tokens;
using permute_test::Skew;

// Row r of `rows` equals token `t` of `tokens` (or zero bytes when t = -1), payload and scales.
void expect_rows(const TokenRows& tokens, const TokenRows& rows, const BruteLayout& l) {
  ASSERT_EQ(rows.x.rows, int64_t(l.sorted_indices.size()));
  std::vector<uint8_t> zero(rows.x.row_bytes(), 0);
  for (int64_t r = 0; r < rows.x.rows; ++r) {
    const int32_t t = l.sorted_indices[size_t(r)];
    const void* want = t >= 0 ? tokens.x.row_ptr(t) : zero.data();
    ASSERT_EQ(std::memcmp(rows.x.row_ptr(r), want, rows.x.row_bytes()), 0) << "row " << r;
    if (rows.has_scales()) {
      const void* ws = t >= 0 ? tokens.scales.row_ptr(t) : zero.data();
      ASSERT_EQ(std::memcmp(rows.scales.row_ptr(r), ws, rows.scales.row_bytes()), 0)
          << "scales row " << r;
    }
  }
}

void expect_layout(const PermuteLayout& got, const BruteLayout& want) {
  EXPECT_EQ(got.sorted_indices, want.sorted_indices);
  ASSERT_EQ(got.permuted_probs.size(), want.probs.size());
  for (size_t r = 0; r < want.probs.size(); ++r) {
    ASSERT_EQ(float_to_bits(got.permuted_probs[r]), float_to_bits(want.probs[r])) << "row " << r;
  }
  EXPECT_EQ(got.tokens_per_expert, want.tokens_per_expert);
  EXPECT_EQ(got.tokens_per_expert_unpadded, want.unpadded);
  EXPECT_EQ(got.num_rows, int64_t(want.sorted_indices.size()));
  for (int64_t r = 0; r < got.num_rows; ++r) {
    if (want.row_expert[size_t(r)] >= 0) {
      ASSERT_EQ(got.expert_of_row(r), want.row_expert[size_t(r)]);
    }
  }
}

TEST(Permute, SeedWorkedExample) {
  RoutingMap m = RoutingMap{};
  m.num_tokens = 4;
  m.num_experts = 3;
  m.num_topk = 2;
  m.routing_map = {1, 1, 0, 0, 1, 1, 1, 0, 1, 0, 1, 0};
  m.probs = {0.5f, 0.5f, 0, 0, 0.25f, 0.75f, 0.125f, 0, 0.875f, 0, 1.0f, 0};
  TokenTensor x = random_tokens(DType::kF32, 4, 8, 1);
  StatusOr<PermuteOutput> p = permute(x.rows(), m);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->layout.sorted_indices, (std::vector<int32_t>{0, 2, 0, 1, 3, 1, 2}));
  EXPECT_EQ(p->layout.permuted_probs,
            (std::vector<float>{0.5f, 0.125f, 0.5f, 0.25f, 1.0f, 0.75f, 0.875f}));
  EXPECT_EQ(p->layout.tokens_per_expert, (std::vector<int64_t>{2, 3, 2}));
  EXPECT_EQ(p->layout.expert_offsets, (std::vector<int64_t>{0, 2, 5, 7}));
  expect_rows(x.rows(), p->rows.rows(), brute_layout(m, 0, 3, {}, 1));
}

struct Case {
  int64_t T;
  int E;
  int K;
  Skew skew;
  int eb, ee;  // ee = -1: E
  std::optional<int64_t> cap;
  int align;
};

std::vector<Case> cases() {
  return {
      {0, 4, 2, Skew::kUniform, 0, -1, {}, 1},     {0, 4, 2, Skew::kUniform, 0, -1, 3, 4},
      {1, 1, 1, Skew::kUniform, 0, -1, {}, 1},     {37, 8, 2, Skew::kUniform, 0, -1, {}, 1},
      {37, 8, 1, Skew::kUniform, 0, -1, {}, 3},    {37, 8, 8, Skew::kAllExperts, 0, -1, {}, 1},
      {37, 8, 2, Skew::kOneExpert, 0, -1, {}, 16}, {37, 8, 2, Skew::kOneExpert, 0, -1, 37, 1},
      {50, 6, 3, Skew::kUniform, 2, 5, {}, 4},     {50, 6, 3, Skew::kUniform, 3, 3, {}, 1},
      {64, 4, 2, Skew::kUniform, 0, -1, 64, 8},    {129, 16, 4, Skew::kUniform, 4, 12, 129, 5},
  };
}

TEST(Permute, MatchesBruteForceEveryOptionDtypeAndThreadCount) {
  for (const Case& c : cases()) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kFP8}) {
      const int64_t H = dtype == DType::kFP8 ? 256 : 24;
      const uint32_t seed = uint32_t(c.T * 131 + c.E * 7 + c.K);
      const RoutingMap m = random_map(c.T, c.E, c.K, seed, c.skew);
      const TokenTensor x = random_tokens(dtype, c.T, H, seed + 1);
      const int ee = c.ee < 0 ? c.E : c.ee;
      const BruteLayout want = brute_layout(m, c.eb, ee, c.cap, c.align);
      for (int threads : {1, 2, 3}) {
        SCOPED_TRACE(::testing::Message()
                     << "T=" << c.T << " E=" << c.E << " K=" << c.K << " [" << c.eb << "," << ee
                     << ") cap=" << c.cap.value_or(-1) << " align=" << c.align << " "
                     << dtype_name(dtype) << " threads=" << threads);
        PermuteOptions o;
        o.expert_begin = c.eb;
        o.expert_end = c.ee;
        o.capacity = c.cap;
        o.expert_alignment = c.align;
        StatusOr<PermuteOutput> p = permute(x.rows(), m, o, pool_of(threads));
        ASSERT_TRUE(p.ok()) << p.status().to_string();
        expect_layout(p->layout, want);
        expect_rows(x.rows(), p->rows.rows(), want);
      }
    }
  }
}

TEST(Permute, SeveralSourcesWithTheirOwnCapacity) {
  // The AllGather dispatcher's use: three sources (one empty) gathered into one map.
  const RoutingMap m = random_map(40, 6, 2, 7);
  const std::vector<int64_t> sources = {0, 17, 17, 40};
  const TokenTensor x = random_tokens(DType::kBF16, 40, 16, 8);
  for (bool padded : {false, true}) {
    const std::vector<int64_t> caps =
        padded ? std::vector<int64_t>{17, 2, 23} : std::vector<int64_t>{};
    const BruteLayout want = brute_layout(m, 2, 6, {}, 4, sources, caps);
    for (int threads : {1, 2, 3}) {
      PermuteOptions o;
      o.expert_begin = 2;
      o.expert_alignment = 4;
      o.source_offsets = sources;
      o.source_capacities = caps;
      StatusOr<PermuteOutput> p = permute(x.rows(), m, o, pool_of(threads));
      ASSERT_TRUE(p.ok()) << p.status().to_string();
      expect_layout(p->layout, want);
      expect_rows(x.rows(), p->rows.rows(), want);
    }
  }
}

TEST(Unpermute, MatchesBruteForceWeightedAndUnweighted) {
  for (const Case& c : cases()) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const int64_t H = 2100;  // crosses the 2048-float accumulator block
      const uint32_t seed = uint32_t(c.T * 17 + c.E * 3 + c.K);
      const RoutingMap m = random_map(c.T, c.E, c.K, seed, c.skew);
      const int ee = c.ee < 0 ? c.E : c.ee;
      const BruteLayout l = brute_layout(m, c.eb, ee, c.cap, c.align);
      const TokenTensor y = random_tokens(dtype, int64_t(l.sorted_indices.size()), H, seed + 5);
      for (bool weighted : {false, true}) {
        const std::vector<float> want = brute_unpermute_f32(y.x.view(), l, c.T, c.E, weighted);
        for (int threads : {1, 2, 3}) {
          SCOPED_TRACE(::testing::Message()
                       << "T=" << c.T << " E=" << c.E << " K=" << c.K << " " << dtype_name(dtype)
                       << " weighted=" << weighted << " threads=" << threads);
          StatusOr<Tensor> out =
              unpermute(y.x.view(), l.sorted_indices, c.T,
                        weighted ? std::span<const float>(l.probs) : std::span<const float>(),
                        pool_of(threads));
          ASSERT_TRUE(out.ok()) << out.status().to_string();
          ASSERT_EQ(out->rows(), c.T);
          EXPECT_TRUE(equals_rounded(want, out->view()));
        }
      }
    }
  }
}

TEST(Unpermute, SignedZeroAndNaNFollowTheReference) {
  // One token, two experts: -0 + -0 must come out +0 (fp32 0 + ...), NaN stays NaN.
  Tensor y = Tensor::empty(DType::kF32, 2, 3);
  const float nan = bits_to_float(0x7fc00001u);
  const float v[6] = {-0.0f, nan, 1.0f, -0.0f, 2.0f, -1.0f};
  std::memcpy(y.data(), v, sizeof(v));
  const std::vector<int32_t> idx = {0, 0};
  StatusOr<Tensor> out = unpermute(y.view(), idx, 1);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(float_to_bits(out->row<float>(0)[0]), 0u);
  EXPECT_TRUE(std::isnan(out->row<float>(0)[1]));
  EXPECT_EQ(out->row<float>(0)[2], 0.0f);
}

TEST(PermuteBackward, UnpermutesGradRowsAndScattersProbGrads) {
  const RoutingMap m = random_map(45, 8, 3, 11);
  const BruteLayout l = brute_layout(m, 0, 8, 30, 4);
  PermuteOptions o;
  o.capacity = 30;
  o.expert_alignment = 4;
  StatusOr<PermuteLayout> layout = make_permute_layout(m, o);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  const int64_t N = layout->num_rows;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const TokenTensor g = random_tokens(dtype, N, 40, 12);
    std::vector<float> gp(static_cast<size_t>(N));
    for (int64_t r = 0; r < N; ++r) gp[size_t(r)] = float(r) * 0.5f - 3.0f;
    const std::vector<float> want = brute_unpermute_f32(g.x.view(), l, 45, 8, false);
    for (int threads : {1, 2, 3}) {
      StatusOr<PermuteGrad> grad = permute_backward(g.x.view(), gp, *layout, pool_of(threads));
      ASSERT_TRUE(grad.ok()) << grad.status().to_string();
      EXPECT_TRUE(equals_rounded(want, grad->grad_tokens.view()));
      ASSERT_EQ(grad->grad_probs.size(), size_t(45 * 8));
      for (int64_t t = 0; t < 45; ++t) {
        for (int e = 0; e < 8; ++e) {
          float w = 0.0f;
          for (size_t r = 0; r < l.sorted_indices.size(); ++r) {
            if (l.sorted_indices[r] == t && l.row_expert[r] == e) w = 0.0f + gp[r];
          }
          ASSERT_EQ(grad->grad_probs[size_t(t * 8 + e)], w) << t << "," << e;
        }
      }
      StatusOr<PermuteGrad> none = permute_backward(g.x.view(), {}, *layout, pool_of(threads));
      ASSERT_TRUE(none.ok());
      EXPECT_EQ(none->grad_probs, std::vector<float>(45 * 8, 0.0f));
    }
  }
}

TEST(UnpermuteBackward, DispatchesGradOutAndDotsProbGrads) {
  const RoutingMap m = random_map(33, 6, 2, 21);
  const BruteLayout l = brute_layout(m, 0, 6, {}, 8);
  const int64_t N = int64_t(l.sorted_indices.size()), H = 300;
  for (DType gd : {DType::kF32, DType::kBF16}) {
    for (DType yd : {DType::kF32, DType::kBF16}) {
      const TokenTensor g = random_tokens(gd, 33, H, 22);
      const TokenTensor y = random_tokens(yd, N, H, 23);
      for (bool weighted : {false, true}) {
        for (int threads : {1, 2, 3}) {
          SCOPED_TRACE(::testing::Message() << dtype_name(gd) << "/" << dtype_name(yd)
                                            << " weighted=" << weighted << " threads=" << threads);
          StatusOr<UnpermuteGrad> grad = unpermute_backward(
              g.x.view(), l.sorted_indices,
              weighted ? std::span<const float>(l.probs) : std::span<const float>(), y.x.view(),
              pool_of(threads));
          ASSERT_TRUE(grad.ok()) << grad.status().to_string();
          ASSERT_EQ(grad->grad_rows.dtype(), gd);
          EXPECT_EQ(grad->grad_row_probs.size(), weighted ? size_t(N) : size_t(0));
          for (int64_t r = 0; r < N; ++r) {
            const int32_t t = l.sorted_indices[size_t(r)];
            float d = 0.0f;
            for (int64_t h = 0; h < H; ++h) {
              const float gv = t >= 0 ? permute_test::to_float(g.x.view(), t, h) : 0.0f;
              const float want = weighted ? l.probs[size_t(r)] * gv : gv;
              const float got = permute_test::to_float(grad->grad_rows.view(), r, h);
              const float rounded = gd == DType::kF32 ? want : bf16_to_float(float_to_bf16(want));
              ASSERT_EQ(float_to_bits(got), float_to_bits(rounded)) << r << "," << h;
              if (t >= 0) d = d + gv * permute_test::to_float(y.x.view(), r, h);
            }
            if (weighted) {
              ASSERT_EQ(float_to_bits(grad->grad_row_probs[size_t(r)]), float_to_bits(d)) << r;
            }
          }
        }
      }
    }
  }
}

TEST(RoundTrip, CombineOfDispatchIsXTimesSumOfProbs) {
  // Megatron's identity with exact numbers (eighths times dyadic probs): experts y = x * prob,
  // unweighted unpermute gives x * sum of kept probs; the weighted one of x gives the same.
  const int64_t T = 70, H = 48;
  const RoutingMap m = random_map(T, 8, 3, 31, Skew::kUniform, /*dyadic=*/true);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const TokenTensor x = random_tokens(dtype, T, H, 32, /*exact=*/true);
    PermuteOptions o;
    o.expert_alignment = 8;
    StatusOr<PermuteOutput> p = permute(x.rows(), m, o, pool_of(2));
    ASSERT_TRUE(p.ok());
    Tensor y = Tensor::empty(dtype, p->layout.num_rows, H);
    for (int64_t r = 0; r < p->layout.num_rows; ++r) {
      for (int64_t h = 0; h < H; ++h) {
        const float v =
            permute_test::to_float(p->rows.x.view(), r, h) * p->layout.permuted_probs[size_t(r)];
        if (dtype == DType::kF32)
          y.row<float>(r)[h] = v;
        else
          y.row<bf16>(r)[h] = float_to_bf16(v);
      }
    }
    StatusOr<Tensor> out = unpermute(y.view(), p->layout.sorted_indices, T, {}, pool_of(3));
    StatusOr<Tensor> weighted = unpermute(p->rows.x.view(), p->layout.sorted_indices, T,
                                          p->layout.permuted_probs, pool_of(1));
    // Backward of the weighted unpermute with grad = x, then permute backward: x * sum of probs.
    StatusOr<UnpermuteGrad> ug = unpermute_backward(x.x.view(), p->layout.sorted_indices,
                                                    p->layout.permuted_probs, p->rows.x.view());
    ASSERT_TRUE(out.ok() && weighted.ok() && ug.ok());
    StatusOr<PermuteGrad> pg = permute_backward(ug->grad_rows.view(), {}, p->layout);
    ASSERT_TRUE(pg.ok());
    for (int64_t t = 0; t < T; ++t) {
      float sum = 0.0f;
      for (int e = 0; e < 8; ++e) sum += m.prob(t, e);
      for (int64_t h = 0; h < H; ++h) {
        const float want = permute_test::to_float(x.x.view(), t, h) * sum;
        ASSERT_EQ(permute_test::to_float(out->view(), t, h), want);
        ASSERT_EQ(permute_test::to_float(weighted->view(), t, h), want);
        ASSERT_EQ(permute_test::to_float(pg->grad_tokens.view(), t, h), want);
      }
    }
  }
}

void expect_error(const Status& s, const std::string& text) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find(text), std::string::npos) << s.message();
}

TEST(PermuteErrors, NameTheOffendingValue) {
  const RoutingMap m = random_map(10, 4, 2, 41, Skew::kOneExpert);
  const TokenTensor x = random_tokens(DType::kBF16, 10, 16, 42);
  PermuteOptions o;
  o.capacity = -2;
  expect_error(permute(x.rows(), m, o).status(), "capacity = -2 must be >= 0");
  o = {};
  o.capacity = 4;
  expect_error(permute(x.rows(), m, o).status(),
               "expert 0 has 10 tokens, more than the capacity 4");
  o = {};
  o.expert_alignment = 0;
  expect_error(permute(x.rows(), m, o).status(), "expert_alignment = 0 must be >= 1");
  o = {};
  o.expert_begin = 3;
  o.expert_end = 5;
  expect_error(permute(x.rows(), m, o).status(), "expert range [3, 5) is not inside [0, 4]");
  o = {};
  const std::vector<int64_t> bad_sources = {0, 12, 10};
  o.source_offsets = bad_sources;
  expect_error(permute(x.rows(), m, o).status(), "source_offsets[2] = 10 < source_offsets[1] = 12");
  const TokenTensor x9 = random_tokens(DType::kBF16, 9, 16, 43);
  expect_error(permute(x9.rows(), m).status(), "tokens have 9 rows but the routing map has 10");
  RoutingMap short_map = m;
  short_map.probs.pop_back();
  expect_error(permute(x.rows(), short_map).status(),
               "routing probs has 39 entries; [10, 4] needs 40");
  TokenTensor fp8 = random_tokens(DType::kFP8, 10, 128, 44);
  TokenRows no_scales{fp8.x.view(), TensorView()};
  expect_error(
      permute(no_scales, m).status(),
      "tokens scales must be f32 [10, 1] with row_stride >= 1; got f32 [0, 0] with row_stride 0");

  StatusOr<PermuteLayout> l = make_permute_layout(m);
  ASSERT_TRUE(l.ok());
  Tensor wrong = Tensor::empty(DType::kF32, l->num_rows, 16);
  expect_error(permute_rows_into(x.rows(), *l, TokenRows{wrong.view(), {}}),
               "out is f32 [10, 16]; tokens need bf16 [10, 16]");

  Tensor y = Tensor::empty(DType::kBF16, 3, 8);
  const std::vector<int32_t> idx = {0, 7, -1};
  expect_error(unpermute(y.view(), idx, 5).status(), "sorted_indices[1] = 7 is outside [-1, 5)");
  const std::vector<int32_t> idx2 = {0, 1};
  expect_error(unpermute(y.view(), idx2, 5).status(), "sorted_indices has 2 entries for 3 rows");
  const std::vector<float> probs = {1.0f};
  const std::vector<int32_t> idx3 = {0, 1, 2};
  expect_error(unpermute(y.view(), idx3, 5, probs).status(), "probs has 1 entries for 3 rows");
  expect_error(unpermute(fp8.x.view(), l->sorted_indices, 10).status(),
               "rows dtype is fp8; expected f32 or bf16");
  expect_error(permute_backward(y.view(), {}, *l).status(),
               "grad_rows is [3, 8]; expected [10, 8]");
  expect_error(unpermute_backward(y.view(), idx3, probs, y.view()).status(),
               "probs has 1 entries for 3 sorted_indices");
}

}  // namespace
}  // namespace moed
