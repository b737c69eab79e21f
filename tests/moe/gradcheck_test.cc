// The layer's f32 gradients against central finite differences of the loss
// L = sum over ranks, tokens and channels of out * G, accumulated in double: an input element,
// a router weight, gate and up columns of fc1, fc2, and the shared expert, on 2 ranks (rank 0
// perturbs; every rank re-runs forward so the loss stays collective).
#include <gtest/gtest.h>

#include <cmath>

#include "moe/moe_test_util.h"
#include "moed/moe_layer.h"
#include "support/world_test.h"

namespace moed {
namespace {

using moe_test::random_rows;
using testing::Backend;

class MoEGradCheckTest : public ::testing::TestWithParam<Backend> {};

StatusOr<double> loss(World& w, MoELayer& layer, const Tensor& x, const Tensor& g) {
  MOED_ASSIGN_OR_RETURN(Tensor y, layer.forward(x));
  double local = 0;
  for (int64_t t = 0; t < y.rows(); ++t) {
    for (int64_t h = 0; h < y.cols(); ++h)
      local += double(y.row<float>(t)[h]) * double(g.row<float>(t)[h]);
  }
  MOED_ASSIGN_OR_RETURN(std::vector<double> all,
                        all_gather<double>(w, std::span<const double>(&local, 1)));
  double sum = 0;
  for (double v : all) sum += v;
  return sum;
}

TEST_P(MoEGradCheckTest, FiniteDifferences) {
  for (DispatcherKind kind : {DispatcherKind::kFlex, DispatcherKind::kAlltoAll}) {
    SCOPED_TRACE(dispatcher_kind_name(kind));
    const MoEConfig c = moe_test::layer_config(
        {.hidden = 16, .ffn_hidden = 12, .num_experts = 4, .num_topk = 2, .shared_expert_ffn = 8},
        DType::kF32, kind, 3);
    Status s = testing::run_world(GetParam(), 2, 0, [&](World& w) -> Status {
      MOED_ASSIGN_OR_RETURN(std::unique_ptr<MoELayer> layer, MoELayer::create(w, c));
      Tensor x = random_rows(DType::kF32, 6 + 3 * w.rank(), c.hidden, 10u + uint32_t(w.rank()));
      Tensor g = random_rows(DType::kF32, x.rows(), c.hidden, 20u + uint32_t(w.rank()));
      MOED_ASSIGN_OR_RETURN(Tensor y, layer->forward(x));
      MOED_ASSIGN_OR_RETURN(MoEGrads grads, layer->backward(g));
      MoEWeights& wt = layer->mutable_weights();
      const int F = c.ffn_hidden;
      struct Probe {
        const char* name;
        float* param;  // on rank 0 (nullptr elsewhere)
        float analytic;
      };
      const bool me = w.rank() == 0;
      auto at = [&](const Tensor& t, int64_t r, int64_t col) {
        return me ? &t.row<float>(r)[col] : nullptr;
      };
      auto ga = [&](const Tensor& t, int64_t r, int64_t col) {
        return me ? t.row<float>(r)[col] : 0.0f;
      };
      std::vector<Probe> probes = {
          {"x[1][3]", at(x, 1, 3), ga(grads.grad_input, 1, 3)},
          {"x[4][10]", at(x, 4, 10), ga(grads.grad_input, 4, 10)},
          {"router[1][2]", at(wt.router, 1, 2), ga(grads.grad_router, 1, 2)},
          {"router[3][7]", at(wt.router, 3, 7), ga(grads.grad_router, 3, 7)},
          {"fc1[0] gate", at(wt.fc1[0], 1, 2), ga(grads.grad_fc1[0], 1, 2)},
          {"fc1[1] up", at(wt.fc1[1], 5, F + 4), ga(grads.grad_fc1[1], 5, F + 4)},
          {"fc2[0]", at(wt.fc2[0], 3, 9), ga(grads.grad_fc2[0], 3, 9)},
          {"fc2[1]", at(wt.fc2[1], 0, 1), ga(grads.grad_fc2[1], 0, 1)},
          {"shared_fc1", at(wt.shared_fc1, 2, 3), ga(grads.grad_shared_fc1, 2, 3)},
          {"shared_fc2", at(wt.shared_fc2, 1, 0), ga(grads.grad_shared_fc2, 1, 0)},
      };
      const float eps = 1e-2f;
      int nonzero = 0;
      for (const Probe& p : probes) nonzero += std::fabs(p.analytic) > 1e-3f ? 1 : 0;
      // NOTE: a probe whose gradient is 0 (an expert no token reached) would check nothing.
      if (me && nonzero < int(probes.size()) - 1) {
        return internal_error("only ", nonzero, " of ", probes.size(), " probes have a gradient");
      }
      for (const Probe& p : probes) {
        float v = me ? *p.param : 0.0f;
        float up = v + eps, down = v - eps;
        if (me) *p.param = up;
        MOED_ASSIGN_OR_RETURN(double lu, loss(w, *layer, x, g));
        if (me) *p.param = down;
        MOED_ASSIGN_OR_RETURN(double ld, loss(w, *layer, x, g));
        if (me) *p.param = v;
        if (!me) continue;
        const double fd = (lu - ld) / (double(up) - double(down));
        const double tol = 1e-3 + 2e-2 * std::fabs(fd);
        if (std::fabs(fd - double(p.analytic)) > tol) {
          return internal_error(p.name, ": analytic ", p.analytic, ", finite difference ", fd);
        }
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, MoEGradCheckTest, ::testing::ValuesIn(testing::backends()),
                         testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed
