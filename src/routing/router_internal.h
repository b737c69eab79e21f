// Pieces of the router shared by its forward, backward and losses (not public API).
#pragma once

#include <cstdint>
#include <vector>

#include "moed/router.h"

namespace moed::router_internal {

// Score functions in float32, exactly as documented in moed/router.h.
float sigmoid_score(float x);
float sqrt_softplus_score(float x);
// softmax of in[0..n) in index order: exp(in_i - max) / sum; out may alias in.
void softmax(const float* in, int n, float* out);

// Reusable buffers for one thread's top-k selections (sized once per call, not per token).
struct TopkScratch {
  std::vector<int32_t> order;        // [E]
  std::vector<float> group_values;   // [E / num_groups]
  std::vector<float> group_scores;   // [num_groups]
  std::vector<int32_t> group_order;  // [num_groups]
  void reserve(int num_experts, int num_groups);
};

// The k best of values[0..n) by (value descending, index ascending), best first, into out[k].
void select_topk(const float* values, int n, int k, int32_t* out, TopkScratch& scratch);
// Megatron's group_limited_topk: n experts in num_groups equal groups; keep the group_topk
// groups with the largest sum of their top (k / group_topk) values (ties to the lower group),
// then the k best experts inside those groups.
void select_group_limited_topk(const float* values, int n, int k, int num_groups, int group_topk,
                               int32_t* out, TopkScratch& scratch);

// Gradient through a score function, in double. Outputs y = softmax(x) (kSoftmax), or
// y = s(x) / (sum s + 1e-20) (normalize) or y = s(x) with s = sigmoid / sqrt-softplus.
// g = dL/dy [n]; adds scale * dL/dx into gx [n]. tmp holds n doubles.
void score_backward(ScoreFunction f, bool normalize, const float* x, int n, const double* g,
                    double scale, double* gx, double* tmp);

// The loss terms of forward(), each adding scale * its gradient into grad ([T, E] doubles)
// when grad is not null. Inputs already checked.
double switch_aux_loss_impl(const float* logits, int64_t num_tokens, int num_experts, int num_topk,
                            ScoreFunction f, double coeff, double scale, double* grad);
double sequence_aux_loss_impl(const float* logits, int64_t num_tokens, int num_experts,
                              int num_topk, int64_t seq_length, ScoreFunction f, double coeff,
                              double scale, double* grad);
double z_loss_impl(const float* logits, int64_t num_tokens, int num_experts, double coeff,
                   double scale, double* grad);

}  // namespace moed::router_internal
