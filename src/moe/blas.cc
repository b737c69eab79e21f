// OpenBLAS GEMMs in fixed row blocks (see blas.h for why).
#include "moe/blas.h"

#include <cblas.h>

#include <algorithm>
#include <mutex>

#include "moed/status.h"
#include "moed/tensor.h"

namespace moed::moe {

void init_blas() {
  static std::once_flag once;
  // NOTE: every rank of the threads world calls into OpenBLAS at once, and each rank already
  // has its own pool; OpenBLAS's own threads would oversubscribe the cores and serialise on
  // its server lock.
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

namespace {

struct Block {
  size_t gemm;
  int64_t row0, rows;
};

void run_block(const Gemm& g, int64_t row0, int64_t rows) {
  // Block rows of C are rows of op(A): rows of A, or columns of A when transposed.
  const float* a = static_cast<const float*>(g.a) + (g.trans_a ? row0 : row0 * g.lda);
  float* c = g.c + row0 * g.ldc;
  if (g.k == 0) {
    // An empty inner dimension (an expert that received no rows): C = 0 (or unchanged).
    if (!g.accumulate) {
      for (int64_t i = 0; i < rows; ++i) std::fill(c + i * g.ldc, c + i * g.ldc + g.n, 0.0f);
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
              g.trans_b ? CblasTrans : CblasNoTrans, blasint(rows), blasint(g.n), blasint(g.k),
              1.0f, a, blasint(g.lda), static_cast<const float*>(g.b), blasint(g.ldb),
              g.accumulate ? 1.0f : 0.0f, c, blasint(g.ldc));
}

// A packed f32 copy of a stored bf16 matrix (rows x cols, leading dimension ld). Exact: every
// bf16 value is a float.
Tensor widen(const void* p, int64_t rows, int64_t cols, int64_t ld, ThreadPool* pool) {
  Tensor t = Tensor::empty(DType::kF32, rows, cols);
  const TensorView src(const_cast<void*>(p), DType::kBF16, rows, cols, ld);
  auto body = [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r) {
      convert_row(src.row_ptr(r), DType::kBF16, t.row<float>(r), DType::kF32, size_t(cols));
    }
  };
  if (pool == nullptr || rows < 64) {
    body(0, rows, 0);
  } else {
    pool->parallel_for(rows, body, 16);
  }
  return t;
}

}  // namespace

void run_gemms(const std::vector<Gemm>& gemms, DType dtype, ThreadPool* pool) {
  init_blas();
  MOED_CHECK(dtype == DType::kF32 || dtype == DType::kBF16, "GEMM dtype ", dtype_name(dtype));
  // NOTE: bf16 operands are widened to f32 (exactly) and multiplied by cblas_sgemm: bf16
  // storage, fp32 products and sums. Debian's OpenBLAS declares cblas_sbgemm but is built
  // without it (BUILD_BFLOAT16 off), and this keeps bf16 on the same deterministic kernel.
  std::vector<Tensor> wide;
  std::vector<Gemm> f32 = gemms;
  if (dtype == DType::kBF16) {
    for (Gemm& g : f32) {
      if (g.m == 0 || g.n == 0 || g.k == 0) continue;
      const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
      const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
      wide.push_back(widen(g.a, a_rows, a_cols, g.lda, pool));
      g.a = wide.back().data();
      g.lda = a_cols;
      wide.push_back(widen(g.b, b_rows, b_cols, g.ldb, pool));
      g.b = wide.back().data();
      g.ldb = b_cols;
    }
  }
  std::vector<Block> blocks;
  for (size_t i = 0; i < f32.size(); ++i) {
    const Gemm& g = f32[i];
    if (g.m == 0 || g.n == 0) continue;
    for (int64_t r = 0; r < g.m; r += kGemmBlockRows) {
      blocks.push_back({i, r, std::min(kGemmBlockRows, g.m - r)});
    }
  }
  auto body = [&](int64_t begin, int64_t end, int) {
    for (int64_t b = begin; b < end; ++b) {
      const Block& blk = blocks[size_t(b)];
      run_block(f32[blk.gemm], blk.row0, blk.rows);
    }
  };
  if (pool == nullptr || blocks.size() < 2) {
    body(0, int64_t(blocks.size()), 0);
  } else {
    pool->parallel_for(int64_t(blocks.size()), body);
  }
}

}  // namespace moed::moe
