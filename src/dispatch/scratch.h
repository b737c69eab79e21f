// Memory the dispatchers keep between steps and calls.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moed/dispatcher.h"

namespace moed {

// Bytes kept between steps and calls: they grow and are never freed in between, so the big
// per-step buffers are allocated (and page-faulted) once, not once per dispatch.
// First-touch page faults of fresh multi-hundred-MB buffers cost more than the copies
// themselves; reusing them is what brings a dispatch near its limit (docs/benchmarks.md).
class ScratchBuffer {
 public:
  // A packed [rows, cols] view of `dtype` over this buffer; contents unspecified. Valid until
  // the next view() call that needs more bytes.
  TensorView view(DType dtype, int64_t rows, int64_t cols);

 private:
  Tensor bytes_;
};

// Dispatch outputs (DispatchOutput::storage) reused once the caller has dropped every copy of
// an earlier output's storage (use_count 1: only the pool holds it, so nobody can still read
// it or copy it concurrently). A caller that keeps outputs gets fresh buffers.
class OutputPool {
 public:
  // Storage with room for [rows, cols] of dtype (+ fp8 scales); `rows_out` views into it
  // (without x: the scales only, the rows being the caller's).
  std::shared_ptr<void> acquire(DType dtype, int64_t rows, int64_t cols, TokenRows& rows_out,
                                bool with_x = true);

 private:
  struct Entry {
    ScratchBuffer x;
    ScratchBuffer scales;
  };
  std::vector<std::shared_ptr<Entry>> entries_;
};

}  // namespace moed
