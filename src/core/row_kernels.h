// The one table of row kernels every layer uses (permute, Flex, low-latency, the MoE layer,
// the public row functions of moed/dtype.h), one table per instruction set. The table is
// chosen once per process (CPU support, lowered by MOED_ISA=scalar|avx2|avx512) and costs a
// load per call after that. Every vector entry equals the scalar one bit for bit: each element
// is the same chain of single fp32 operations (no FMA, -ffp-contract=off), lane by lane;
// tests/core/row_kernels_test.cc checks every table this CPU runs against the scalar one.
//
//   const auto& k = moed::internal::row_kernels();
//   k.start_weighted(acc, row0, DType::kBF16, p0, hidden);  // acc = 0 + p0 * row0
//   k.accumulate_weighted(acc, row1, DType::kBF16, p1, hidden);
//   k.store(acc, out, DType::kBF16, hidden);                // rounded once
//
// Rows are `n` elements of the given DType, read as float(x) (exact for all three formats) and
// written with the scalar rounding of moed/dtype.h. FP8 here means raw E4M3 values without
// block scale; block-scaled rows go through quantize_fp8 / dequantize_fp8.
#pragma once

#include <array>
#include <cstddef>
#include <cstring>
#include <vector>

#include "moed/dtype.h"
#include "moed/tensor.h"

namespace moed {
class ThreadPool;
}

namespace moed::internal {

struct RowKernels {
  const char* isa;  // "scalar", "avx2", "avx512"
  // dst[i] = src[i] converted to dst_type (a plain copy when the types are equal).
  void (*convert)(const void* src, DType src_type, void* dst, DType dst_type, size_t n);
  // acc[i] = acc[i] + x[i]
  void (*accumulate)(float* acc, const void* x, DType t, size_t n);
  // acc[i] = acc[i] + w * x[i]        (the product rounded, then the sum)
  void (*accumulate_weighted)(float* acc, const void* x, DType t, float w, size_t n);
  // acc[i] = 0 + x[i]                 (a first term: acc is only written; -0 becomes +0)
  void (*start)(float* acc, const void* x, DType t, size_t n);
  // acc[i] = 0 + w * x[i]
  void (*start_weighted)(float* acc, const void* x, DType t, float w, size_t n);
  // acc[i] = acc[i] + (0 + x[i])      (design.md §4.1 literally: a one-partial term summed from 0)
  void (*add_term)(float* acc, const void* x, DType t, size_t n);
  // acc[i] = acc[i] + w * (0 + x[i])
  void (*add_term_weighted)(float* acc, const void* x, DType t, float w, size_t n);
  // dst[i] = round_t(w * x[i])        (x and dst both of type t)
  void (*scale)(void* dst, const void* x, DType t, float w, size_t n);
  // dst[i] = round_t(acc[i])          (once)
  void (*store)(const float* acc, void* dst, DType t, size_t n);
  // A whole fold in one pass (the combine of one token): for each i,
  //   a = init ? init[i] : 0; a = a + w[q] * (0 + rows[q][i]) for q < count; dst[i] = round_dt(a)
  // (w == nullptr: a = a + (0 + rows[q][i])): the chain of add_term / add_term_weighted on an
  // acc zeroed (or holding init, a sum carried on from elsewhere: no -0 in it, as a sum started
  // at +0 never is), then store, without the fp32 row in memory (the sum stays in registers while
  // the rows stream past). stream: dst is written with non-temporal stores (call stream_fence()
  // before another thread reads it); the scalar table ignores it.
  void (*fold_rows)(const void* const* rows, DType t, const float* w, int count, void* dst,
                    DType dt, size_t n, bool stream, const float* init);
  // out[q] = ((0 + a_q[0] * b_q[0]) + a_q[1] * b_q[1]) + ... for q < count: one sequential
  // chain per pair of rows (the same code in every table: a vector sum would change the
  // order); the chains run interleaved, so several in one call overlap their latencies.
  void (*dot)(const void* const* a, DType at, const void* const* b, DType bt, int count, size_t n,
              float* out);
  // x is f32 or bf16; n % kFp8BlockSize == 0; scales_inv gets n / kFp8BlockSize entries.
  void (*quantize_fp8)(const void* x, DType t, bool round_scale, fp8_e4m3* out, float* scales_inv,
                       size_t n);
  void (*dequantize_fp8)(const fp8_e4m3* q, const float* scales_inv, float* out, size_t n);
};

// Always available; the definition the vector tables must match.
const RowKernels& scalar_kernels();
// nullptr when this CPU (or this build) cannot run them.
const RowKernels* avx2_kernels();
const RowKernels* avx512_kernels();
// The table every caller uses: the best this CPU runs, capped by MOED_ISA; chosen once.
const RowKernels& row_kernels();

// The shared scalar dot (every table's `dot`).
void dot_chains(const void* const* a, DType at, const void* const* b, DType bt, int count, size_t n,
                float* out);
// fold_rows over elements [begin, end) only (the scalar definition; the vector tables' tail).
void fold_rows_range(const void* const* rows, DType t, const float* w, int count, void* dst,
                     DType dt, size_t begin, size_t end, const float* init);

// Per block: scale_inv as stored, and the factor the values are multiplied by (design.md §6.2).
// Shared by every table so the scale arithmetic is written once.
inline float fp8_block_scale(float amax, bool round_scale, float* scale_inv) {
  *scale_inv = fp8_scale_inv(amax, round_scale);
  // NOTE: with round_scale the scale is 1 / scale_inv, exact because scale_inv is a power of
  // two; otherwise 448 / amax, which is not always the reciprocal of amax / 448 in fp32.
  return round_scale ? 1.0f / *scale_inv : kFp8Max / (amax < 1e-4f ? 1e-4f : amax);
}

// ---- memory helpers of the same hot loops (no arithmetic) ----
// Copies `bytes` with non-temporal stores (no read-for-ownership of the destination, which a
// plain memcpy of a row pays and a large memcpy avoids): for outputs much larger than the
// caches. Call stream_fence() before the data is handed to another thread.
void stream_copy(void* dst, const void* src, size_t bytes);
void stream_fence();
// stream_copy of several rows of `bytes` each, walked side by side a line at a time: a core
// keeps more misses in flight over several streams than over one (docs/benchmarks.md,
// "Measurements behind design choices").
struct RowCopy {
  void* dst;
  const void* src;
};
void stream_copy_rows(const RowCopy* rows, size_t count, size_t bytes);
// Rows of one size copied one by one to scattered places. With `stream` (outputs of
// kStreamThresholdBytes and up), non-temporal stores, a few rows side by side, so no
// destination line is read first; finish() (flush, fence) before another thread reads them.
class RowCopier {
 public:
  RowCopier(size_t row_bytes, bool stream) : row_bytes_(row_bytes), stream_(stream) {}
  void copy(void* dst, const void* src) {
    if (!stream_) {
      std::memcpy(dst, src, row_bytes_);
      return;
    }
    rows_[count_++] = {dst, src};
    if (count_ == rows_.size()) flush();
  }
  void finish() {
    if (!stream_) return;
    flush();
    stream_fence();
  }

 private:
  void flush() {
    if (count_ > 0) stream_copy_rows(rows_.data(), count_, row_bytes_);
    count_ = 0;
  }
  std::array<RowCopy, 8> rows_;  // 4 tokens' rows at top-2; 4 or 16 were slower
  size_t count_ = 0;
  size_t row_bytes_;
  bool stream_;
};
// Asks for a row about to be read (rows land at random places, so the hardware prefetchers,
// which stop at page boundaries, find them late).
inline void prefetch_row(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}
// Outputs at least this large are written with stream_copy.
inline constexpr size_t kStreamThresholdBytes = size_t(8) << 20;
// Rows [src_row, src_row + count) of src into rows [dst_row, dst_row + count) of dst (the same
// row bytes; either side may be strided): one memcpy per run where both sides are packed. A
// copy of kStreamThresholdBytes or more is written with stream_copy and fenced before the call
// returns. pool: the rows are split across its workers (16 at least each); nullptr: on this
// thread (a caller already inside a parallel_for). stream: stream_copy whatever the size, not
// fenced (the caller fences, after its other pieces of one large copy).
void copy_rows(const TensorView& dst, int64_t dst_row, const TensorView& src, int64_t src_row,
               int64_t count, ThreadPool* pool = nullptr, bool stream = false);

// fold_rows over a run of tokens, one token behind: push() asks for the first lines of the
// new token's rows, then folds the previous token, so those lines (each row starts at a
// scattered place, where no prefetcher has been) arrive while that token is summed; fold_rows
// asks for the rest itself. Each token is its own output row: the order changes no bits.
//
//   FoldAhead fold(DType::kBF16, DType::kBF16, hidden, stream);
//   for (t ...) { for (each term) fold.add(row, w); fold.push(out_row(t)); }
//   fold.flush();  // the last token (stream: then stream_fence())
class FoldAhead {
 public:
  FoldAhead(DType t, DType dt, size_t n, bool weighted, bool stream);
  void add(const void* row, float w) {
    next_rows_.push_back(row);
    next_w_.push_back(w);
  }
  // The rows added since the last push make dst.
  void push(void* dst);
  void flush();

 private:
  DType t_, dt_;
  size_t n_, lead_bytes_;
  bool weighted_, stream_;
  std::vector<const void*> next_rows_, rows_;
  std::vector<float> next_w_, w_;
  void* dst_ = nullptr;
};

}  // namespace moed::internal
