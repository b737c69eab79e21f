// Grouped SwiGLU experts: GEMMs on OpenBLAS (blas.h), elementwise steps in fp32 per row.
#include "moe/experts.h"

#include <cmath>

#include "moe/blas.h"
#include "moed/status.h"

namespace moed::moe {

void for_rows(ThreadPool* pool, int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (pool == nullptr || n < 64) {
    fn(0, n);
    return;
  }
  pool->parallel_for(
      n, [&](int64_t b, int64_t e, int) { fn(b, e); }, 16);
}

namespace {

inline float sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }

// The f32 result rows of a GEMM land straight in an f32 destination; a bf16 destination gets
// them through a staging buffer and one rounding.
struct Staged {
  Tensor tmp;
  float* rows(const TensorView& dst, int64_t row0, int64_t compact_row0, int64_t* ld) {
    if (dst.dtype == DType::kF32) {
      *ld = dst.row_stride;
      return dst.row<float>(row0);
    }
    *ld = tmp.cols();
    return tmp.row<float>(compact_row0);
  }
};

void store_staged(const Staged& s, const TensorView& dst, const std::vector<Segment>& segs,
                  const std::vector<int64_t>& compact_row0, ThreadPool* pool) {
  if (dst.dtype == DType::kF32) return;
  for (size_t j = 0; j < segs.size(); ++j) {
    for_rows(pool, segs[j].rows, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        store_row(s.tmp.row<float>(compact_row0[j] + i), dst.row_ptr(segs[j].row0 + i), dst.dtype,
                  size_t(dst.cols));
      }
    });
  }
}

}  // namespace

void expert_forward(const TensorView& x, std::span<const float> probs,
                    const std::vector<Segment>& segments, const std::vector<TensorView>& fc1,
                    const std::vector<TensorView>& fc2, ThreadPool* pool, ExpertContext* ctx,
                    const TensorView& y) {
  MOED_CHECK(fc1.size() == segments.size() && fc2.size() == segments.size());
  const DType dt = x.dtype;
  const int64_t H = x.cols;
  const int F = segments.empty() ? 0 : int(fc2[0].rows);
  ctx->dtype = dt;
  ctx->ffn = F;
  ctx->segments = segments;
  ctx->x = x;
  ctx->compact_row0.assign(segments.size(), 0);
  int64_t rows = 0;
  for (size_t j = 0; j < segments.size(); ++j) {
    ctx->compact_row0[j] = rows;
    rows += segments[j].rows;
  }
  ctx->pre = Tensor::empty(DType::kF32, rows, 2 * int64_t(F));
  ctx->act = Tensor::empty(DType::kF32, rows, F);
  ctx->h = Tensor::empty(dt, rows, F);
  ctx->probs.clear();
  if (!probs.empty()) {
    ctx->probs.resize(size_t(rows));
    for (size_t j = 0; j < segments.size(); ++j) {
      for (int64_t i = 0; i < segments[j].rows; ++i) {
        ctx->probs[size_t(ctx->compact_row0[j] + i)] = probs[size_t(segments[j].row0 + i)];
      }
    }
  }

  std::vector<Gemm> g1;
  for (size_t j = 0; j < segments.size(); ++j) {
    const Segment& s = segments[j];
    g1.push_back({.m = s.rows,
                  .n = 2 * int64_t(F),
                  .k = H,
                  .a = s.rows ? x.row_ptr(s.row0) : x.data,
                  .lda = x.row_stride,
                  .b = fc1[j].data,
                  .ldb = fc1[j].row_stride,
                  .c = ctx->pre.row<float>(ctx->compact_row0[j]),
                  .ldc = 2 * int64_t(F)});
  }
  run_gemms(g1, dt, pool);

  const bool with_probs = !ctx->probs.empty();
  for_rows(pool, rows, [&](int64_t b, int64_t e) {
    std::vector<float> hrow(static_cast<size_t>(F));
    for (int64_t r = b; r < e; ++r) {
      const float* pre = ctx->pre.row<float>(r);
      float* act = ctx->act.row<float>(r);
      const float p = with_probs ? ctx->probs[size_t(r)] : 1.0f;
      for (int f = 0; f < F; ++f) {
        const float g = pre[f];
        act[f] = g * sigmoid(g) * pre[F + f];
        hrow[size_t(f)] = with_probs ? act[f] * p : act[f];
      }
      store_row(hrow.data(), ctx->h.view().row_ptr(r), dt, size_t(F));
    }
  });

  Staged staged;
  if (dt != DType::kF32) staged.tmp = Tensor::empty(DType::kF32, rows, H);
  std::vector<Gemm> g2;
  for (size_t j = 0; j < segments.size(); ++j) {
    const Segment& s = segments[j];
    int64_t ldc = 0;
    float* c = staged.rows(y, s.row0, ctx->compact_row0[j], &ldc);
    g2.push_back({.m = s.rows,
                  .n = H,
                  .k = F,
                  .a = ctx->h.view().row_ptr(ctx->compact_row0[j]),
                  .lda = F,
                  .b = fc2[j].data,
                  .ldb = fc2[j].row_stride,
                  .c = c,
                  .ldc = ldc});
  }
  run_gemms(g2, dt, pool);
  store_staged(staged, y, segments, ctx->compact_row0, pool);
}

void expert_backward(const ExpertContext& ctx, const TensorView& dy,
                     const std::vector<TensorView>& fc1, const std::vector<TensorView>& fc2,
                     ThreadPool* pool, const TensorView& dx, std::span<float> dprobs,
                     std::vector<Tensor>* dfc1, std::vector<Tensor>* dfc2) {
  const DType dt = ctx.dtype;
  const int64_t H = ctx.x.cols;
  const int F = ctx.ffn;
  const int64_t rows = ctx.rows();
  const auto& segs = ctx.segments;
  MOED_CHECK(dy.dtype == dt && dx.dtype == dt, "expert backward dtypes");
  dfc1->clear();
  dfc2->clear();
  for (size_t j = 0; j < segs.size(); ++j) {
    dfc1->push_back(Tensor::empty(DType::kF32, H, 2 * int64_t(F)));
    dfc2->push_back(Tensor::empty(DType::kF32, F, H));
  }

  // dh = dY @ fc2^T and dfc2 = h^T @ dY.
  Tensor dh = Tensor::empty(DType::kF32, rows, F);
  std::vector<Gemm> g1;
  for (size_t j = 0; j < segs.size(); ++j) {
    const Segment& s = segs[j];
    const void* dyp = s.rows ? dy.row_ptr(s.row0) : dy.data;
    g1.push_back({.trans_b = true,
                  .m = s.rows,
                  .n = F,
                  .k = H,
                  .a = dyp,
                  .lda = dy.row_stride,
                  .b = fc2[j].data,
                  .ldb = fc2[j].row_stride,
                  .c = dh.row<float>(ctx.compact_row0[j]),
                  .ldc = F});
    g1.push_back({.trans_a = true,
                  .m = F,
                  .n = H,
                  .k = s.rows,
                  .a = ctx.h.view().row_ptr(ctx.compact_row0[j]),
                  .lda = F,
                  .b = dyp,
                  .ldb = dy.row_stride,
                  .c = (*dfc2)[j].row<float>(0),
                  .ldc = H});
  }
  run_gemms(g1, dt, pool);

  // d act = dh * p; d gate = d act * up * silu'(gate); d up = d act * silu(gate);
  // d p = sum over f ascending of dh * act (fp32).
  const bool with_probs = !ctx.probs.empty();
  Tensor da = Tensor::empty(DType::kF32, rows, 2 * int64_t(F));
  Tensor da_store = dt == DType::kF32 ? Tensor() : Tensor::empty(dt, rows, 2 * int64_t(F));
  std::vector<float> dp(size_t(with_probs ? rows : 0));
  for_rows(pool, rows, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* pre = ctx.pre.row<float>(r);
      const float* act = ctx.act.row<float>(r);
      const float* d = dh.row<float>(r);
      float* out = da.row<float>(r);
      const float p = with_probs ? ctx.probs[size_t(r)] : 1.0f;
      float acc = 0.0f;
      for (int f = 0; f < F; ++f) {
        if (with_probs) acc += d[f] * act[f];
        const float dact = with_probs ? d[f] * p : d[f];
        const float g = pre[f], up = pre[F + f];
        const float sg = sigmoid(g);
        const float silu = g * sg;
        const float dsilu = sg * (1.0f + g * (1.0f - sg));
        out[f] = dact * up * dsilu;
        out[F + f] = dact * silu;
      }
      if (with_probs) dp[size_t(r)] = acc;
      if (dt != DType::kF32) store_row(out, da_store.row<bf16>(r), dt, size_t(2 * F));
    }
  });
  if (with_probs) {
    for (size_t j = 0; j < segs.size(); ++j) {
      for (int64_t i = 0; i < segs[j].rows; ++i) {
        dprobs[size_t(segs[j].row0 + i)] = dp[size_t(ctx.compact_row0[j] + i)];
      }
    }
  }

  // dfc1 = X^T @ dA and dX = dA @ fc1^T.
  const TensorView dav = dt == DType::kF32 ? da.view() : da_store.view();
  Staged staged;
  if (dt != DType::kF32) staged.tmp = Tensor::empty(DType::kF32, rows, H);
  std::vector<Gemm> g2;
  for (size_t j = 0; j < segs.size(); ++j) {
    const Segment& s = segs[j];
    const void* dap = dav.row_ptr(ctx.compact_row0[j]);
    g2.push_back({.trans_a = true,
                  .m = H,
                  .n = 2 * int64_t(F),
                  .k = s.rows,
                  .a = s.rows ? ctx.x.row_ptr(s.row0) : ctx.x.data,
                  .lda = ctx.x.row_stride,
                  .b = dap,
                  .ldb = 2 * int64_t(F),
                  .c = (*dfc1)[j].row<float>(0),
                  .ldc = 2 * int64_t(F)});
    int64_t ldc = 0;
    float* c = staged.rows(dx, s.row0, ctx.compact_row0[j], &ldc);
    g2.push_back({.trans_b = true,
                  .m = s.rows,
                  .n = H,
                  .k = 2 * int64_t(F),
                  .a = dap,
                  .lda = 2 * int64_t(F),
                  .b = fc1[j].data,
                  .ldb = fc1[j].row_stride,
                  .c = c,
                  .ldc = ldc});
  }
  run_gemms(g2, dt, pool);
  store_staged(staged, dx, segs, ctx.compact_row0, pool);
}

}  // namespace moed::moe
