// Internal: the deterministic fp32 sum that every backend's reduce-scatter / all-reduce uses
// on gathered contributions (world.h: acc = 0; for r ascending: acc += x_r).
#pragma once

#include <cstddef>
#include <cstdint>

#include "moed/thread_pool.h"

namespace moed::internal {

// out[i] = sum over r ascending of rows[r * n + i], from 0, in fp32.
inline void sum_rows(ThreadPool& pool, const float* rows, int ranks, size_t n, float* out) {
  pool.parallel_for(
      int64_t(n),
      [&](int64_t b, int64_t e, int) {
        for (int64_t i = b; i < e; ++i) out[i] = 0.0f;
        for (int r = 0; r < ranks; ++r) {
          const float* x = rows + size_t(r) * n;
          for (int64_t i = b; i < e; ++i) out[i] += x[i];
        }
      },
      4096);
}

}  // namespace moed::internal
