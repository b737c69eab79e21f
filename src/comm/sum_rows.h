// Internal: the deterministic fp32 sum that every backend's reduce-scatter / all-reduce uses
// on gathered contributions (world.h: acc = 0; for r ascending: acc += x_r).
#pragma once

#include <cstddef>
#include <cstdint>

#include "moed/thread_pool.h"

namespace moed::internal {

// out[i] = sum over r ascending of row_of(r)[i], from 0, in fp32.
template <typename RowOf>
void sum_rows(ThreadPool& pool, int ranks, size_t n, float* out, const RowOf& row_of) {
  pool.parallel_for(
      int64_t(n),
      [&](int64_t b, int64_t e, int) {
        for (int64_t i = b; i < e; ++i) out[i] = 0.0f;
        for (int r = 0; r < ranks; ++r) {
          const float* x = row_of(r);
          for (int64_t i = b; i < e; ++i) out[i] += x[i];
        }
      },
      4096);
}

// out[i] = sum over r ascending of rows[r * n + i] (the rows gathered one after another).
inline void sum_rows(ThreadPool& pool, const float* rows, int ranks, size_t n, float* out) {
  sum_rows(pool, ranks, n, out, [&](int r) { return rows + size_t(r) * n; });
}

}  // namespace moed::internal
