// An independent oracle for the expert MLP the MoE layer's reference uses (moe/experts.h,
// moe/blas.h; reference_moe_layer calls expert_forward): plain loops written here, not the
// layer's code.
//
// Bitwise where the orders can be made to match: OpenBLAS's sgemm sums in its own order, not
// a plain loop's, so the GEMM tests use small-integer inputs whose every partial sum is an
// exact float (then any order gives the same bits), and the SwiGLU test picks gate values
// where silu is exact in fp32 (g >= 17: sigmoid = 1; g <= -96: exp overflows, sigmoid = 0;
// g = 0). For general values the elementwise steps (act, h) are still compared bit for bit
// against the loop applied to the layer's own fp32 pre-activations (elementwise: no order),
// and only the GEMM results carry a documented tolerance (the fp32 summation bound).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "moe/blas.h"
#include "moe/experts.h"
#include "moed/tensor.h"
#include "moed/thread_pool.h"

namespace moed::moe {
namespace {

float load(const TensorView& v, int64_t r, int64_t c) {
  return v.dtype == DType::kF32 ? v.row<float>(r)[c] : bf16_to_float(v.row<bf16>(r)[c]);
}
void store(const TensorView& v, int64_t r, int64_t c, float x) {
  if (v.dtype == DType::kF32) {
    v.row<float>(r)[c] = x;
  } else {
    v.row<bf16>(r)[c] = float_to_bf16(x);
  }
}
// A [rows, cols] matrix with leading dimension cols + pad, small integers in [lo, hi].
Tensor ints(DType dt, int64_t rows, int64_t cols, int lo, int hi, std::mt19937& rng) {
  Tensor t = Tensor::empty(dt, rows, cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c)
      store(t.view(), r, c, float(lo + int(rng() % (hi - lo + 1))));
  }
  return t;
}
bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// run_gemms against C = op(A) op(B) (+ C) by a triple loop, every transpose, bf16 and f32
// operands, leading dimensions wider than the rows, shapes across the 64-row blocks, k = 0.
TEST(ExpertOracle, GemmHelperEqualsAPlainLoop) {
  std::mt19937 rng(7);
  ThreadPool pool(3);
  struct Shape {
    int64_t m, n, k;
  };
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (int trans = 0; trans < 4; ++trans) {
      for (bool acc : {false, true}) {
        std::vector<Gemm> gemms;
        std::vector<Tensor> as, bs, cs, want;
        for (const Shape s : {Shape{1, 1, 1}, Shape{5, 17, 3}, Shape{130, 33, 100}, Shape{0, 4, 4},
                              Shape{3, 5, 0}, Shape{64, 7, 9}}) {
          const bool ta = trans & 1, tb = trans & 2;
          // Stored shapes, 3 columns wider than used (the leading dimension is the width).
          Tensor a = ints(dt, ta ? s.k : s.m, (ta ? s.m : s.k) + 3, -4, 4, rng);
          Tensor b = ints(dt, tb ? s.n : s.k, (tb ? s.k : s.n) + 3, -4, 4, rng);
          Tensor c = ints(DType::kF32, s.m, s.n + 2, -9, 9, rng);
          Tensor w = Tensor::copy_of(c.view());
          for (int64_t i = 0; i < s.m; ++i) {
            for (int64_t j = 0; j < s.n; ++j) {
              float sum = acc ? c.row<float>(i)[j] : 0.0f;
              for (int64_t l = 0; l < s.k; ++l) {
                sum +=
                    load(a.view(), ta ? l : i, ta ? i : l) * load(b.view(), tb ? j : l, tb ? l : j);
              }
              w.row<float>(i)[j] = sum;
            }
          }
          gemms.push_back({.trans_a = ta,
                           .trans_b = tb,
                           .m = s.m,
                           .n = s.n,
                           .k = s.k,
                           .a = a.data(),
                           .lda = a.cols(),
                           .b = b.data(),
                           .ldb = b.cols(),
                           .c = c.rows() ? c.row<float>(0) : nullptr,
                           .ldc = c.cols(),
                           .accumulate = acc});
          as.push_back(std::move(a));
          bs.push_back(std::move(b));
          cs.push_back(std::move(c));
          want.push_back(std::move(w));
        }
        run_gemms(gemms, dt, &pool);
        for (size_t g = 0; g < gemms.size(); ++g) {
          SCOPED_TRACE(::testing::Message()
                       << dtype_name(dt) << " trans " << trans << " acc " << acc << " gemm " << g);
          // The whole C, padding columns too: run_gemms writes only [m, n].
          ASSERT_TRUE(bitwise_equal(cs[g].view(), want[g].view()));
        }
      }
    }
  }
}

// The SwiGLU expert forward of experts.h, by plain loops:
//   pre = X fc1 = [gate | up]; act = silu(gate) * up; h = act * p (rounded to the dtype);
//   Y = h fc2 (rounded once to the dtype); silu(g) = g * (1 / (1 + exp(-g))).
struct Oracle {
  Tensor pre, act, h, y;
};
Oracle swiglu_loop(const TensorView& x, const std::vector<float>& probs,
                   const std::vector<Segment>& segs, const std::vector<Tensor>& fc1,
                   const std::vector<Tensor>& fc2, int F) {
  const int64_t H = x.cols;
  int64_t rows = 0;
  for (const Segment& s : segs) rows += s.rows;
  Oracle o{Tensor::zeros(DType::kF32, rows, 2 * F), Tensor::zeros(DType::kF32, rows, F),
           Tensor::zeros(x.dtype, rows, F), Tensor::zeros(x.dtype, x.rows, H)};
  int64_t cr = 0;
  for (size_t j = 0; j < segs.size(); ++j) {
    for (int64_t i = 0; i < segs[j].rows; ++i, ++cr) {
      const int64_t xr = segs[j].row0 + i;
      for (int c = 0; c < 2 * F; ++c) {
        float sum = 0.0f;
        for (int64_t k = 0; k < H; ++k) sum += load(x, xr, k) * load(fc1[j].view(), k, c);
        o.pre.row<float>(cr)[c] = sum;
      }
      for (int f = 0; f < F; ++f) {
        const float g = o.pre.row<float>(cr)[f];
        const float a = g * (1.0f / (1.0f + std::exp(-g))) * o.pre.row<float>(cr)[F + f];
        o.act.row<float>(cr)[f] = a;
        store(o.h.view(), cr, f, probs.empty() ? a : a * probs[size_t(xr)]);
      }
      for (int64_t c = 0; c < H; ++c) {
        float sum = 0.0f;
        for (int f = 0; f < F; ++f) sum += load(o.h.view(), cr, f) * load(fc2[j].view(), f, c);
        store(o.y.view(), xr, c, sum);
      }
    }
  }
  return o;
}

// Segments of 0, 70 (two GEMM blocks), 5 and 1 rows.
const std::vector<Segment> kSegments = {{0, 0}, {0, 70}, {70, 5}, {75, 1}};
constexpr int64_t kRows = 76;

TEST(ExpertOracle, SwigluForwardEqualsAPlainLoopBitForBit) {
  const int64_t H = 24;
  const int F = 16;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (bool with_probs : {true, false}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << (with_probs ? " probs" : " no probs"));
      std::mt19937 rng(11);
      // x in [1, 2]; gate column f: weights 1 (g in [24, 48]: sigmoid(g) = 1 in fp32), -4
      // (g <= -96: exp(-g) = inf, sigmoid = 0) or 0 (g = 0); up weights in [-2, 2]; fc2 in
      // [-2, 2]; probs in {1/4, 1/2, 1}. Every sum is then a multiple of 1/4 below 2^22.
      Tensor x = ints(dt, kRows, H, 1, 2, rng);
      std::vector<Tensor> fc1, fc2;
      for (size_t j = 0; j < kSegments.size(); ++j) {
        Tensor w1 = ints(dt, H, 2 * F, -2, 2, rng);
        for (int64_t k = 0; k < H; ++k) {
          for (int f = 0; f < F; ++f)
            store(w1.view(), k, f, f % 3 == 0 ? 1.0f : f % 3 == 1 ? -4.0f : 0.0f);
        }
        fc1.push_back(std::move(w1));
        fc2.push_back(ints(dt, F, H, -2, 2, rng));
      }
      std::vector<float> probs;
      if (with_probs) {
        for (int64_t r = 0; r < kRows; ++r) probs.push_back(std::ldexp(1.0f, -int(rng() % 3)));
      }
      const Oracle want = swiglu_loop(x.view(), probs, kSegments, fc1, fc2, F);
      ExpertContext ctx;
      Tensor y = Tensor::zeros(dt, kRows, H);
      ThreadPool pool(2);
      std::vector<TensorView> v1, v2;
      for (size_t j = 0; j < fc1.size(); ++j) {
        v1.push_back(fc1[j].view());
        v2.push_back(fc2[j].view());
      }
      expert_forward(x.view(), probs, kSegments, v1, v2, &pool, &ctx, y.view());
      EXPECT_TRUE(bitwise_equal(ctx.pre.view(), want.pre.view()));
      EXPECT_TRUE(bitwise_equal(ctx.act.view(), want.act.view()));
      EXPECT_TRUE(bitwise_equal(ctx.h.view(), want.h.view()));
      EXPECT_TRUE(bitwise_equal(y.view(), want.y.view()));
    }
  }
}

// General values (full fp32 mantissas, silu's whole range): act and h bit for bit against the
// loop applied to the layer's own pre-activations (no sums involved); pre and Y against a
// double-precision loop within the fp32 summation bound n * 2^-24 * sum |terms| (times 2 for
// the input rounding of Y's terms), since OpenBLAS's order is not the loop's.
TEST(ExpertOracle, SwigluForwardGeneralValuesWithinTheSummationBound) {
  const int64_t H = 40;
  const int F = 24;
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  auto random = [&](int64_t r, int64_t c) {
    Tensor t = Tensor::empty(DType::kF32, r, c);
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = 0; j < c; ++j) t.row<float>(i)[j] = u(rng);
    }
    return t;
  };
  Tensor x = random(kRows, H);
  std::vector<Tensor> fc1, fc2;
  std::vector<TensorView> v1, v2;
  for (size_t j = 0; j < kSegments.size(); ++j) {
    fc1.push_back(random(H, 2 * F));
    fc2.push_back(random(F, H));
    v1.push_back(fc1.back().view());
    v2.push_back(fc2.back().view());
  }
  std::vector<float> probs;
  for (int64_t r = 0; r < kRows; ++r) probs.push_back(float(rng() % 1000) / 1000.0f);
  ExpertContext ctx;
  Tensor y = Tensor::zeros(DType::kF32, kRows, H);
  expert_forward(x.view(), probs, kSegments, v1, v2, nullptr, &ctx, y.view());
  const double eps = std::ldexp(1.0, -24);
  int64_t cr = 0;
  for (size_t j = 0; j < kSegments.size(); ++j) {
    for (int64_t i = 0; i < kSegments[j].rows; ++i, ++cr) {
      const int64_t xr = kSegments[j].row0 + i;
      for (int c = 0; c < 2 * F; ++c) {
        double sum = 0, mag = 0;
        for (int64_t k = 0; k < H; ++k) {
          const double t = double(x.row<float>(xr)[k]) * fc1[j].row<float>(k)[c];
          sum += t;
          mag += std::fabs(t);
        }
        ASSERT_LE(std::fabs(ctx.pre.row<float>(cr)[c] - sum), double(H) * eps * mag)
            << "pre[" << cr << "][" << c << "]";
      }
      for (int f = 0; f < F; ++f) {
        const float g = ctx.pre.row<float>(cr)[f];
        const float a = g * (1.0f / (1.0f + std::exp(-g))) * ctx.pre.row<float>(cr)[F + f];
        ASSERT_TRUE(same_bits(ctx.act.row<float>(cr)[f], a)) << "act[" << cr << "][" << f << "]";
        ASSERT_TRUE(same_bits(ctx.h.row<float>(cr)[f], a * probs[size_t(xr)]))
            << "h[" << cr << "][" << f << "]";
      }
      for (int64_t c = 0; c < H; ++c) {
        double sum = 0, mag = 0;
        for (int f = 0; f < F; ++f) {
          const double t = double(ctx.h.row<float>(cr)[f]) * fc2[j].row<float>(f)[c];
          sum += t;
          mag += std::fabs(t);
        }
        ASSERT_LE(std::fabs(y.row<float>(xr)[c] - sum), 2.0 * F * eps * mag)
            << "y[" << xr << "][" << c << "]";
      }
    }
  }
}

}  // namespace
}  // namespace moed::moe
