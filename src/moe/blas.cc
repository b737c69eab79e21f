// OpenBLAS GEMMs in fixed row blocks (see blas.h for why).
#include "moe/blas.h"

#include <cblas.h>

#include <algorithm>
#include <mutex>

#include "moed/status.h"

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

void run_block(const Gemm& g, DType dtype, int64_t row0, int64_t rows) {
  const size_t es = dtype_size(dtype);
  // Block rows of C are rows of op(A): rows of A, or columns of A when transposed.
  const char* a = static_cast<const char*>(g.a) + size_t(g.trans_a ? row0 : row0 * g.lda) * es;
  float* c = g.c + row0 * g.ldc;
  const float beta = g.accumulate ? 1.0f : 0.0f;
  const CBLAS_TRANSPOSE ta = g.trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = g.trans_b ? CblasTrans : CblasNoTrans;
  if (g.k == 0) {
    // An empty inner dimension (an expert that received no rows): C = 0 (or unchanged).
    if (!g.accumulate) {
      for (int64_t i = 0; i < rows; ++i) std::fill(c + i * g.ldc, c + i * g.ldc + g.n, 0.0f);
    }
    return;
  }
  if (dtype == DType::kF32) {
    cblas_sgemm(CblasRowMajor, ta, tb, blasint(rows), blasint(g.n), blasint(g.k), 1.0f,
                reinterpret_cast<const float*>(a), blasint(g.lda), static_cast<const float*>(g.b),
                blasint(g.ldb), beta, c, blasint(g.ldc));
  } else {
    MOED_CHECK(dtype == DType::kBF16, "GEMM dtype ", dtype_name(dtype));
    cblas_sbgemm(CblasRowMajor, ta, tb, blasint(rows), blasint(g.n), blasint(g.k), 1.0f,
                 reinterpret_cast<const bfloat16*>(a), blasint(g.lda),
                 static_cast<const bfloat16*>(g.b), blasint(g.ldb), beta, c, blasint(g.ldc));
  }
}

}  // namespace

void run_gemms(const std::vector<Gemm>& gemms, DType dtype, ThreadPool* pool) {
  init_blas();
  std::vector<Block> blocks;
  for (size_t i = 0; i < gemms.size(); ++i) {
    const Gemm& g = gemms[i];
    if (g.m == 0 || g.n == 0) continue;
    for (int64_t r = 0; r < g.m; r += kGemmBlockRows) {
      blocks.push_back({i, r, std::min(kGemmBlockRows, g.m - r)});
    }
  }
  auto body = [&](int64_t begin, int64_t end, int) {
    for (int64_t b = begin; b < end; ++b) {
      const Block& blk = blocks[size_t(b)];
      run_block(gemms[blk.gemm], dtype, blk.row0, blk.rows);
    }
  };
  if (pool == nullptr || blocks.size() < 2) {
    body(0, int64_t(blocks.size()), 0);
  } else {
    pool->parallel_for(int64_t(blocks.size()), body);
  }
}

}  // namespace moed::moe
