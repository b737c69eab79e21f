// Router GEMMs, the shared expert, and the elementwise sums around the experts.
#include "moe/blas.h"
#include "moe/layer_internal.h"

namespace moed::moe {

StatusOr<RouteContext> route(const Router& router, const Tensor& router_weight, const TensorView& x,
                             ThreadPool* pool) {
  RouteContext ctx;
  const int64_t T = x.rows, H = x.cols;
  const int E = int(router_weight.rows());
  ctx.x_f32 = Tensor::empty(DType::kF32, T, H);
  for_rows(pool, T, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      convert_row(x.row_ptr(t), x.dtype, ctx.x_f32.row<float>(t), DType::kF32, size_t(H));
    }
  });
  ctx.logits = Tensor::empty(DType::kF32, T, E);
  run_gemms({{.trans_b = true,
              .m = T,
              .n = E,
              .k = H,
              .a = ctx.x_f32.data(),
              .lda = H,
              .b = router_weight.data(),
              .ldb = H,
              .c = ctx.logits.row<float>(0),
              .ldc = E}},
            DType::kF32, pool);
  const float* lp = static_cast<const float*>(ctx.logits.data());
  MOED_ASSIGN_OR_RETURN(ctx.out, router.forward(std::span<const float>(lp, size_t(T * E)), T));
  return ctx;
}

StatusOr<RouteGrad> route_backward(const Router& router, const Tensor& router_weight,
                                   const RouteContext& ctx, std::span<const float> grad_probs,
                                   ThreadPool* pool) {
  const int64_t T = ctx.x_f32.rows(), H = ctx.x_f32.cols();
  const int E = int(router_weight.rows());
  const float* lp = static_cast<const float*>(ctx.logits.data());
  MOED_ASSIGN_OR_RETURN(
      std::vector<float> gl,
      router.backward(std::span<const float>(lp, size_t(T * E)), ctx.out, grad_probs));
  RouteGrad g;
  g.grad_router = Tensor::empty(DType::kF32, E, H);
  g.grad_x = Tensor::empty(DType::kF32, T, H);
  run_gemms({{.trans_a = true,
              .m = E,
              .n = H,
              .k = T,
              .a = gl.data(),
              .lda = E,
              .b = ctx.x_f32.data(),
              .ldb = H,
              .c = g.grad_router.row<float>(0),
              .ldc = H},
             {.m = T,
              .n = H,
              .k = E,
              .a = gl.data(),
              .lda = E,
              .b = router_weight.data(),
              .ldb = H,
              .c = g.grad_x.row<float>(0),
              .ldc = H}},
            DType::kF32, pool);
  return g;
}

void shared_forward(const MoEWeights& w, const TensorView& x, ThreadPool* pool, ExpertContext* ctx,
                    const TensorView& y) {
  expert_forward(x, {}, {Segment{0, x.rows}}, {w.shared_fc1.view()}, {w.shared_fc2.view()}, pool,
                 ctx, y);
}

void shared_backward(const MoEWeights& w, const ExpertContext& ctx, const TensorView& dy,
                     ThreadPool* pool, const TensorView& dx, MoEGrads* grads) {
  std::vector<Tensor> d1, d2;
  expert_backward(ctx, dy, {w.shared_fc1.view()}, {w.shared_fc2.view()}, pool, dx, {}, &d1, &d2);
  grads->grad_shared_fc1 = std::move(d1[0]);
  grads->grad_shared_fc2 = std::move(d2[0]);
}

void add_rows(const TensorView& combined, const TensorView& shared, ThreadPool* pool) {
  if (shared.data == nullptr) return;
  const int64_t H = combined.cols;
  for_rows(pool, combined.rows, [&](int64_t b, int64_t e) {
    std::vector<float> acc(static_cast<size_t>(H));
    for (int64_t t = b; t < e; ++t) {
      convert_row(combined.row_ptr(t), combined.dtype, acc.data(), DType::kF32, size_t(H));
      accumulate_row_f32(acc.data(), shared.row_ptr(t), shared.dtype, size_t(H));
      store_row(acc.data(), combined.row_ptr(t), combined.dtype, size_t(H));
    }
  });
}

Tensor sum_input_grads(const TensorView& a, const Tensor& b, const TensorView& c,
                       ThreadPool* pool) {
  const int64_t T = a.rows, H = a.cols;
  Tensor out = Tensor::empty(a.dtype, T, H);
  for_rows(pool, T, [&](int64_t lo, int64_t hi) {
    std::vector<float> acc(static_cast<size_t>(H));
    for (int64_t t = lo; t < hi; ++t) {
      convert_row(a.row_ptr(t), a.dtype, acc.data(), DType::kF32, size_t(H));
      accumulate_row_f32(acc.data(), b.row<float>(t), DType::kF32, size_t(H));
      if (c.data != nullptr) accumulate_row_f32(acc.data(), c.row_ptr(t), c.dtype, size_t(H));
      store_row(acc.data(), out.view().row_ptr(t), a.dtype, size_t(H));
    }
  });
  return out;
}

std::vector<Segment> canonical_segments(std::span<const int64_t> tokens_per_expert) {
  std::vector<Segment> segs;
  int64_t row = 0;
  for (int64_t n : tokens_per_expert) {
    segs.push_back({row, n});
    row += n;
  }
  return segs;
}

std::vector<TensorView> views(const std::vector<Tensor>& ts) {
  std::vector<TensorView> v;
  for (const Tensor& t : ts) v.push_back(t.view());
  return v;
}

}  // namespace moed::moe
