// permute / unpermute and their backward equal moed's reference (ep_size = 1) bit for bit:
// every layout option, f32 / bf16 / fp8, weighted and not, thread counts 1, 2, 3.
#include "moed/reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "moed/permute.h"
#include "permute/test_util.h"

namespace moed {
namespace {

using permute_test::pool_of;
using permute_test::random_map;
using permute_test::random_tokens;
using permute_test::Skew;

struct Case {
  int64_t T;
  int E;
  int K;
  Skew skew;
  LayoutOptions layout;
};

std::vector<Case> cases() {
  const DropPolicy kP = DropPolicy::kProbs, kPos = DropPolicy::kPosition;
  // T, E, K, skew, layout {capacity_factor, drop_policy, pad_to_capacity, expert_alignment,
  // router_padding_multiple}.
  return {
      {0, 4, 2, Skew::kUniform, {{}, kP, false, 1, 0}},
      {0, 4, 2, Skew::kUniform, {1.0, kP, true, 4, 0}},
      {37, 8, 2, Skew::kUniform, {{}, kP, false, 1, 0}},
      {37, 8, 1, Skew::kUniform, {{}, kP, false, 8, 0}},
      {37, 8, 8, Skew::kAllExperts, {{}, kP, false, 3, 0}},
      {37, 8, 2, Skew::kOneExpert, {{}, kP, false, 16, 0}},
      {37, 8, 2, Skew::kOneExpert, {1.0, kP, false, 1, 0}},
      {60, 8, 2, Skew::kUniform, {1.0, kP, true, 1, 0}},
      {60, 8, 3, Skew::kUniform, {0.5, kPos, true, 8, 0}},
      {60, 8, 2, Skew::kUniform, {1.25, kPos, false, 3, 0}},
      {60, 6, 2, Skew::kUniform, {{}, kP, false, 1, 4}},
      {60, 6, 2, Skew::kOneExpert, {0.75, kP, false, 2, 8}},
  };
}

TEST(PermuteVsReference, DispatchCombineAndBothBackwardsBitForBit) {
  uint32_t seed = 100;
  for (const Case& c : cases()) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kFP8}) {
      ++seed;
      const int64_t H = dtype == DType::kFP8 ? 256 : 40;
      const RoutingMap raw = random_map(c.T, c.E, c.K, seed, c.skew);
      const TokenTensor x = random_tokens(dtype, c.T, H, seed + 1);
      ReferenceProblem p;
      p.num_experts = c.E;
      p.num_topk = c.K;
      p.layout = c.layout;
      p.routing = {raw};
      p.hidden = {x.rows()};
      StatusOr<std::vector<RoutingMap>> eff = reference_effective_routing(p);
      ASSERT_TRUE(eff.ok()) << eff.status().to_string();
      StatusOr<std::vector<ReferenceRankDispatch>> ref = reference_dispatch(p);
      ASSERT_TRUE(ref.ok()) << ref.status().to_string();
      const ReferenceRankDispatch& d = (*ref)[0];

      PermuteOptions o;
      o.expert_alignment = c.layout.expert_alignment;
      if (c.layout.pad_to_capacity) {
        o.capacity =
            int64_t(std::ceil(double(c.T) * double(c.K) / double(c.E) * *c.layout.capacity_factor));
      }
      const int64_t N = d.expert_input.x.rows();
      const TokenTensor y =
          random_tokens(dtype == DType::kF32 ? DType::kF32 : DType::kBF16, N, H, seed + 2);
      const TokenTensor grad_out = random_tokens(y.x.dtype(), c.T, H, seed + 3);
      std::vector<float> grad_pprobs(static_cast<size_t>(N));
      for (int64_t r = 0; r < N; ++r) grad_pprobs[size_t(r)] = float(r % 7) * 0.375f - 1.0f;

      for (int threads : {1, 2, 3}) {
        SCOPED_TRACE(::testing::Message() << "T=" << c.T << " E=" << c.E << " K=" << c.K
                                          << " align=" << c.layout.expert_alignment
                                          << " cf=" << c.layout.capacity_factor.value_or(0)
                                          << " pad=" << c.layout.pad_to_capacity
                                          << " m=" << c.layout.router_padding_multiple << " "
                                          << dtype_name(dtype) << " threads=" << threads);
        ThreadPool& pool = pool_of(threads);
        StatusOr<PermuteOutput> got = permute(x.rows(), (*eff)[0], o, pool);
        ASSERT_TRUE(got.ok()) << got.status().to_string();
        const PermuteLayout& l = got->layout;
        ASSERT_TRUE(bitwise_equal(got->rows.x.view(), d.expert_input.x.view()));
        if (dtype == DType::kFP8) {
          ASSERT_TRUE(bitwise_equal(got->rows.scales.view(), d.expert_input.scales.view()));
        }
        EXPECT_EQ(l.permuted_probs, d.permuted_probs);
        EXPECT_EQ(l.tokens_per_expert, d.tokens_per_expert);
        EXPECT_EQ(l.tokens_per_expert_unpadded, d.tokens_per_expert_unpadded);
        EXPECT_EQ(l.sorted_indices, d.row_src_token);

        for (bool weighted : {false, true}) {
          p.weighted_combine = weighted;
          const std::span<const float> probs =
              weighted ? std::span<const float>(l.permuted_probs) : std::span<const float>();
          StatusOr<std::vector<Tensor>> want = reference_combine(p, {y.x.view()});
          ASSERT_TRUE(want.ok()) << want.status().to_string();
          StatusOr<Tensor> out = unpermute(y.x.view(), l.sorted_indices, c.T, probs, pool);
          ASSERT_TRUE(out.ok()) << out.status().to_string();
          EXPECT_TRUE(bitwise_equal(out->view(), (*want)[0].view())) << "weighted=" << weighted;

          StatusOr<ReferenceCombineGrad> cg =
              reference_combine_backward(p, {grad_out.x.view()}, {y.x.view()});
          ASSERT_TRUE(cg.ok()) << cg.status().to_string();
          StatusOr<UnpermuteGrad> ug =
              unpermute_backward(grad_out.x.view(), l.sorted_indices, probs, y.x.view(), pool);
          ASSERT_TRUE(ug.ok()) << ug.status().to_string();
          EXPECT_TRUE(bitwise_equal(ug->grad_rows.view(), cg->grad_expert_output[0].view()));
          std::vector<float> grad_probs(size_t(c.T) * c.E, 0.0f);
          if (weighted) {
            StatusOr<std::vector<float>> m = row_values_to_map(l, ug->grad_row_probs);
            ASSERT_TRUE(m.ok());
            grad_probs = *m;
          }
          EXPECT_EQ(grad_probs, cg->grad_probs[0]) << "weighted=" << weighted;
        }
        p.weighted_combine = false;

        StatusOr<ReferenceDispatchGrad> dg =
            reference_dispatch_backward(p, {y.x.view()}, {grad_pprobs});
        ASSERT_TRUE(dg.ok()) << dg.status().to_string();
        StatusOr<PermuteGrad> pg = permute_backward(y.x.view(), grad_pprobs, l, pool);
        ASSERT_TRUE(pg.ok()) << pg.status().to_string();
        EXPECT_TRUE(bitwise_equal(pg->grad_tokens.view(), dg->grad_hidden[0].view()));
        EXPECT_EQ(pg->grad_probs, dg->grad_probs[0]);
      }
    }
  }
}

}  // namespace
}  // namespace moed
