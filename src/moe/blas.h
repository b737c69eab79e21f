// GEMMs for the MoE layer on OpenBLAS (cblas_sgemm): f32, or bf16 operands widened exactly to
// f32 (bf16 storage, fp32 products and accumulation), always writing fp32.
//
// NOTE: a call's result per element must not depend on how many threads run it, so that the
// layer is bitwise reproducible across ranks, worlds and pools. OpenBLAS runs single-threaded
// here (set once, process wide) and a GEMM is cut into blocks of kGemmBlockRows output rows,
// a fixed function of the shape; the blocks (of every GEMM in a group) are spread over the
// rank's pool. The same shapes on the same data then give the same bits everywhere.
#pragma once

#include <cstdint>
#include <vector>

#include "moed/dtype.h"
#include "moed/thread_pool.h"

namespace moed::moe {

inline constexpr int64_t kGemmBlockRows = 64;

// C[M, N] (row-major, ldc) = op(A) @ op(B) (+ C when accumulate), A and B row-major in
// `dtype` (f32 or bf16): op(A) is [M, K] (A stored [K, M] when trans_a), op(B) is [K, N]
// (B stored [N, K] when trans_b).
struct Gemm {
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  float* c = nullptr;
  int64_t ldc = 0;
  bool accumulate = false;
};

// Runs every GEMM of the group, block rows in parallel over `pool` (nullptr = this thread).
void run_gemms(const std::vector<Gemm>& gemms, DType dtype, ThreadPool* pool);

// Sets OpenBLAS to one thread (once per process); run_gemms calls it too.
void init_blas();

}  // namespace moed::moe
