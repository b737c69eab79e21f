// The grouped SwiGLU expert MLP (and the shared expert, which is one more SwiGLU MLP with no
// prob), forward and backward, over segments of rows: one segment per local expert.
//
// Per segment (rows X [n, H], probs p [n]):
//   pre = X @ fc1 = [gate | up]   (fp32)
//   act = silu(gate) * up          (fp32)
//   h   = act * p                  (stored in the dtype: the fc2 GEMM's input)
//   Y   = h @ fc2                  (fp32, rounded once to the dtype)
// silu(g) = g * sigmoid(g), sigmoid(g) = 1 / (1 + exp(-g)), each operation fp32.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "moed/tensor.h"
#include "moed/thread_pool.h"

namespace moed::moe {

// fn(begin, end) over [0, n) rows, split over `pool` (null or under 64 rows: this thread).
void for_rows(ThreadPool* pool, int64_t n, const std::function<void(int64_t, int64_t)>& fn);

struct Segment {
  int64_t row0 = 0;  // first row in the caller's X / Y
  int64_t rows = 0;
};

// What backward needs; rows are compact (segment after segment).
struct ExpertContext {
  DType dtype = DType::kF32;
  int ffn = 0;  // F of this shard
  std::vector<Segment> segments;
  std::vector<int64_t> compact_row0;  // [segments]
  TensorView x;                       // caller's rows, kept alive by the caller
  std::vector<float> probs;           // compact [rows]; empty = no prob (shared expert)
  Tensor pre;                         // [rows, 2F] f32
  Tensor act;                         // [rows, F] f32
  Tensor h;                           // [rows, F] dtype
  int64_t rows() const { return pre.rows(); }
};

// y rows of each segment = the segment's expert applied to x rows (other rows untouched).
// probs: per caller row (empty = none). fc1[j] [H, 2F], fc2[j] [F, H] in x's dtype.
void expert_forward(const TensorView& x, std::span<const float> probs,
                    const std::vector<Segment>& segments, const std::vector<TensorView>& fc1,
                    const std::vector<TensorView>& fc2, ThreadPool* pool, ExpertContext* ctx,
                    const TensorView& y);

// dy: caller rows (x's dtype). Writes dx rows of each segment (x's dtype), dprobs per caller
// row (when the forward had probs; the fp32 dot of d h / d p over this shard's F), and the
// weight gradients dfc1[j] [H, 2F], dfc2[j] [F, H] (f32, overwritten).
void expert_backward(const ExpertContext& ctx, const TensorView& dy,
                     const std::vector<TensorView>& fc1, const std::vector<TensorView>& fc2,
                     ThreadPool* pool, const TensorView& dx, std::span<float> dprobs,
                     std::vector<Tensor>* dfc1, std::vector<Tensor>* dfc2);

}  // namespace moed::moe
