// Inputs and comparisons shared by the MoE layer tests.
#pragma once

#include <random>
#include <string>
#include <vector>

#include "moed/moe_layer.h"

namespace moed::moe_test {

inline Tensor random_rows(DType dt, int64_t rows, int64_t cols, uint32_t seed) {
  Tensor t = Tensor::empty(dt, rows, cols);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float v = u(rng);
      if (dt == DType::kF32) {
        t.row<float>(r)[c] = v;
      } else {
        t.row<bf16>(r)[c] = float_to_bf16(v);
      }
    }
  }
  return t;
}

// A test layer's config: its sizes, dtype, dispatcher and seed; every other field at its
// default (layout and router written out, as -Wextra asks of members without an initializer).
struct LayerSizes {
  int hidden, ffn_hidden, num_experts, num_topk, shared_expert_ffn;
};
inline MoEConfig layer_config(const LayerSizes& s, DType dtype, DispatcherKind kind,
                              uint64_t seed) {
  return {.hidden = s.hidden,
          .ffn_hidden = s.ffn_hidden,
          .num_experts = s.num_experts,
          .num_topk = s.num_topk,
          .shared_expert_ffn = s.shared_expert_ffn,
          .dtype = dtype,
          .dispatcher = kind,
          .layout = {},
          .router = {},
          .seed = seed};
}

// Tokens per rank: uneven, and one rank with none when there are several.
inline std::vector<int64_t> tokens_per_rank(int ranks) {
  static const int64_t kTokens[] = {13, 0, 21, 6, 9, 17, 2, 11};
  if (ranks == 1) return {13};
  return std::vector<int64_t>(kTokens, kTokens + ranks);
}

inline Status expect_bitwise(const TensorView& got, const TensorView& want,
                             const std::string& what) {
  if (got.rows != want.rows || got.cols != want.cols || got.dtype != want.dtype) {
    return internal_error(what, ": shape [", got.rows, ", ", got.cols, "] ", dtype_name(got.dtype),
                          " vs [", want.rows, ", ", want.cols, "] ", dtype_name(want.dtype));
  }
  if (!bitwise_equal(got, want)) {
    for (int64_t r = 0; r < got.rows; ++r) {
      for (int64_t c = 0; c < got.cols; ++c) {
        float a, b;
        if (got.dtype == DType::kF32) {
          a = got.row<float>(r)[c];
          b = want.row<float>(r)[c];
        } else {
          a = bf16_to_float(got.row<bf16>(r)[c]);
          b = bf16_to_float(want.row<bf16>(r)[c]);
        }
        if (float_to_bits(a) != float_to_bits(b)) {
          return internal_error(what, "[", r, "][", c, "] = ", a, ", reference ", b);
        }
      }
    }
  }
  return ok_status();
}

inline Status expect_grads_bitwise(const MoEGrads& got, const MoEGrads& want, int rank) {
  const std::string p = "rank " + std::to_string(rank) + ": ";
  MOED_RETURN_IF_ERROR(expect_bitwise(got.grad_input, want.grad_input, p + "grad_input"));
  MOED_RETURN_IF_ERROR(expect_bitwise(got.grad_router, want.grad_router, p + "grad_router"));
  if (got.grad_fc1.size() != want.grad_fc1.size()) return internal_error(p, "expert count differs");
  for (size_t j = 0; j < got.grad_fc1.size(); ++j) {
    MOED_RETURN_IF_ERROR(expect_bitwise(got.grad_fc1[j], want.grad_fc1[j],
                                        p + "grad_fc1[" + std::to_string(j) + "]"));
    MOED_RETURN_IF_ERROR(expect_bitwise(got.grad_fc2[j], want.grad_fc2[j],
                                        p + "grad_fc2[" + std::to_string(j) + "]"));
  }
  MOED_RETURN_IF_ERROR(
      expect_bitwise(got.grad_shared_fc1, want.grad_shared_fc1, p + "grad_shared_fc1"));
  return expect_bitwise(got.grad_shared_fc2, want.grad_shared_fc2, p + "grad_shared_fc2");
}

}  // namespace moed::moe_test
