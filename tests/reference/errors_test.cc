// Every input the reference rejects, with its code and the message naming the value.
#include <gtest/gtest.h>

#include "moed/reference.h"
#include "reference/reference_test_util.h"

namespace moed::testing {
namespace {

// Two ranks (EP = 2), E = 4, H = 2; rank 0 has 3 tokens, rank 1 has 1.
struct Fixture : HeldProblem {
  Fixture()
      : HeldProblem(
            4, 2, 1,
            {make_map({{1, 0, 1, 0}, {0, 1, 0, 0}, {0, 0, 1, 1}}), make_map({{1, 1, 0, 0}})},
            /*hidden=*/2) {}
};

void expect_error(const Status& s, const std::string& message) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_EQ(s.message(), message);
}

// reference_dispatch on the fixture with one change rejects it with `message`.
void expect_dispatch_error(void (*change)(Fixture&), const std::string& message) {
  SCOPED_TRACE(message);
  Fixture f;
  change(f);
  expect_error(reference_dispatch(f.p).status(), message);
}

TEST(ReferenceErrors, ProblemShape) {
  expect_dispatch_error(
      [](Fixture& f) {
        f.p.ep_size = 1;
        f.p.etp_size = 3;
      },
      "routing has 2 ranks but world size = ep_size * etp_size = 1 * 3 = 3");
  expect_dispatch_error([](Fixture& f) { f.p.hidden.pop_back(); },
                        "hidden has 1 ranks but routing has 2");
  expect_dispatch_error(
      [](Fixture& f) {
        f.p.num_experts = 6;
        f.p.ep_size = 4;
        f.p.etp_size = 1;
      },
      "num_experts = 6 is not divisible by ep_size = 4");
  expect_dispatch_error([](Fixture& f) { f.p.num_experts = 0; }, "num_experts = 0 must be > 0");
  {
    Fixture f;
    f.p.routing[1].num_experts = 2;
    expect_error(reference_effective_routing(f.p).status(),
                 "routing[1].num_experts = 2 differs from num_experts = 4");
  }
  expect_dispatch_error(
      [](Fixture& f) { f.p.routing[0].probs.pop_back(); },
      "routing[0].probs has 11 entries, expected num_tokens * num_experts = 3 * 4 = 12");
  expect_dispatch_error([](Fixture& f) { f.p.routing[0].probs[2 * 4 + 3] = -0.5f; },
                        "routing[0].probs[2][3] = -0.5 is NaN or negative");
}

TEST(ReferenceErrors, HiddenStates) {
  expect_dispatch_error([](Fixture& f) { f.p.hidden[1].x = f.xs[0].view(); },
                        "hidden[1] has 3 rows but routing[1] has T = 1 tokens");
  {
    Fixture f;
    Tensor wide = named_hidden(1, 1, 3);
    f.p.hidden[1].x = wide.view();
    expect_error(reference_dispatch(f.p).status(), "hidden[1] has H = 3 but hidden[0] has H = 2");
  }
  {
    Fixture f;
    Tensor b = Tensor::zeros(DType::kBF16, 1, 2);
    f.p.hidden[1].x = b.view();
    expect_error(reference_dispatch(f.p).status(), "hidden[1] is bf16 but hidden[0] is f32");
  }
  {
    Fixture f;
    Tensor q0 = Tensor::zeros(DType::kFP8, 3, 64), q1 = Tensor::zeros(DType::kFP8, 1, 64);
    f.p.hidden = {TokenRows{q0.view(), {}}, TokenRows{q1.view(), {}}};
    expect_error(reference_dispatch(f.p).status(),
                 "hidden[0] is fp8 with H = 64, not a multiple of 128");
  }
  {
    Fixture f;
    Tensor q0 = Tensor::zeros(DType::kFP8, 3, 128), q1 = Tensor::zeros(DType::kFP8, 1, 128);
    Tensor s0 = Tensor::zeros(DType::kF32, 3, 1), s1 = Tensor::zeros(DType::kF32, 1, 2);
    f.p.hidden = {TokenRows{q0.view(), s0.view()}, TokenRows{q1.view(), s1.view()}};
    expect_error(reference_dispatch(f.p).status(),
                 "hidden[1].scales is f32 [1, 2], expected f32 [1, 1]");
  }
}

TEST(ReferenceErrors, LayoutOptions) {
  expect_dispatch_error([](Fixture& f) { f.p.layout.capacity_factor = 1.5; },
                        "capacity_factor = 1.5 needs num_topk > 0 (got 0)");
  expect_dispatch_error(
      [](Fixture& f) {
        f.p.layout.capacity_factor = 1.0;
        f.p.num_topk = 2;
        f.p.routing[1].num_topk = 3;
      },
      "routing[1].num_topk = 3 differs from num_topk = 2");
  expect_dispatch_error([](Fixture& f) { f.p.layout.capacity_factor = 0.0; },
                        "capacity_factor = 0 must be finite and > 0");
  expect_dispatch_error([](Fixture& f) { f.p.layout.pad_to_capacity = true; },
                        "pad_to_capacity needs a capacity_factor");
  expect_dispatch_error(
      [](Fixture& f) {
        f.p.layout.capacity_factor = 1.0;
        f.p.num_topk = 2;
        f.p.layout.pad_to_capacity = true;
        f.p.layout.router_padding_multiple = 4;
      },
      "pad_to_capacity cannot be combined with router_padding_multiple = 4");
  expect_dispatch_error([](Fixture& f) { f.p.layout.expert_alignment = 0; },
                        "expert_alignment = 0 must be >= 1");
  expect_dispatch_error([](Fixture& f) { f.p.layout.router_padding_multiple = -2; },
                        "router_padding_multiple = -2 must be >= 0");
}

TEST(ReferenceErrors, ExpertOutputsAndGradients) {
  Fixture f;
  // Rank 0 (experts 0-1): (0,t0) (1,t0) | (0,t1) (1,t0); rank 1 (experts 2-3): (0,t0) (0,t2) |
  // (0,t2).
  auto d = reference_dispatch(f.p);
  ASSERT_TRUE(d.ok());
  const int64_t rows0 = (*d)[0].expert_input.x.rows(), rows1 = (*d)[1].expert_input.x.rows();
  ASSERT_EQ(rows0, 4);
  ASSERT_EQ(rows1, 3);
  std::vector<Tensor> y;
  y.push_back(Tensor::zeros(DType::kF32, rows0, 2));
  y.push_back(Tensor::zeros(DType::kF32, rows1 + 1, 2));
  expect_error(reference_combine(f.p, views_of(y)).status(),
               "expert_output[1] has 4 rows but rank 1's dispatch layout has 3");
  y[1] = Tensor::zeros(DType::kBF16, rows1, 2);
  expect_error(reference_combine(f.p, views_of(y)).status(),
               "expert_output[1] is bf16 but expert_output[0] is f32");
  y[1] = Tensor::zeros(DType::kF32, rows1, 3);
  expect_error(reference_combine(f.p, views_of(y)).status(),
               "expert_output[1] has 3 columns, expected H = 2");
  y[0] = Tensor::zeros(DType::kFP8, rows0, 2);
  expect_error(reference_combine(f.p, views_of(y)).status(),
               "expert_output[0] is fp8; only f32 and bf16 allowed");
  expect_error(reference_combine(f.p, {}).status(), "expert_output has 0 ranks, expected 2");

  std::vector<Tensor> rows;
  rows.push_back(Tensor::zeros(DType::kF32, rows0, 2));
  rows.push_back(Tensor::zeros(DType::kF32, rows1, 2));
  expect_error(reference_dispatch_backward(f.p, views_of(rows), {{0, 0, 0, 0}}).status(),
               "grad_pprobs has 1 ranks, expected 2 (or none)");
  expect_error(reference_dispatch_backward(f.p, views_of(rows), {{0, 0, 0, 0}, {0}}).status(),
               "grad_pprobs[1] has 1 entries but rank 1's dispatch layout has 3 rows");

  std::vector<Tensor> grad_out;
  grad_out.push_back(Tensor::zeros(DType::kF32, 3, 2));
  grad_out.push_back(Tensor::zeros(DType::kF32, 2, 2));
  expect_error(reference_combine_backward(f.p, views_of(grad_out), {}).status(),
               "grad_out[1] has 2 rows but source rank 1 has T = 1");
  grad_out[1] = Tensor::zeros(DType::kF32, 1, 2);
  f.p.weighted_combine = true;
  expect_error(reference_combine_backward(f.p, views_of(grad_out), {}).status(),
               "expert_output has 0 ranks, expected 2");
  f.p.weighted_combine = false;
  EXPECT_TRUE(reference_combine_backward(f.p, views_of(grad_out), {}).ok());
}

}  // namespace
}  // namespace moed::testing
