// Score functions and top-k selection (plain and group-limited) for the router.
#include <algorithm>
#include <cmath>
#include <functional>

#include "routing/router_internal.h"

namespace moed::router_internal {

float sigmoid_score(float x) { return 1.0f / (1.0f + std::exp(-x)); }

float sqrt_softplus_score(float x) {
  // NOTE: torch's softplus (beta 1, threshold 20) returns x itself above the threshold.
  const float softplus = x > 20.0f ? x : std::log1p(std::exp(x));
  return std::sqrt(softplus);
}

void softmax(const float* in, int n, float* out) {
  if (n <= 0) return;
  float max_value = in[0];
  for (int i = 1; i < n; ++i) max_value = std::max(max_value, in[i]);
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    out[i] = std::exp(in[i] - max_value);
    sum += out[i];
  }
  for (int i = 0; i < n; ++i) out[i] = out[i] / sum;
}

void TopkScratch::reserve(int num_experts, int num_groups) {
  order.resize(size_t(num_experts));
  if (num_groups > 0) {
    group_values.resize(size_t(num_experts / num_groups));
    group_scores.resize(size_t(num_groups));
    group_order.resize(size_t(num_groups));
  }
}

namespace {

// Orders candidate indices best first: larger value, then lower index (the documented tie
// rule).
struct Better {
  const float* values;
  bool operator()(int32_t a, int32_t b) const {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  }
};

}  // namespace

void select_topk(const float* values, int n, int k, int32_t* out, TopkScratch& scratch) {
  int32_t* order = scratch.order.data();
  for (int i = 0; i < n; ++i) order[i] = i;
  std::partial_sort(order, order + k, order + n, Better{values});
  std::copy(order, order + k, out);
}

void select_group_limited_topk(const float* values, int n, int k, int num_groups, int group_topk,
                               int32_t* out, TopkScratch& scratch) {
  const int group_size = n / num_groups;
  const int per_group = k / group_topk;
  float* group_values = scratch.group_values.data();
  for (int g = 0; g < num_groups; ++g) {
    std::copy(values + g * group_size, values + (g + 1) * group_size, group_values);
    std::partial_sort(group_values, group_values + per_group, group_values + group_size,
                      std::greater<float>());
    // Summed best first, as torch sums the sorted output of topk.
    float sum = 0.0f;
    for (int i = 0; i < per_group; ++i) sum += group_values[i];
    scratch.group_scores[size_t(g)] = sum;
  }
  int32_t* group_order = scratch.group_order.data();
  for (int g = 0; g < num_groups; ++g) group_order[g] = g;
  std::partial_sort(group_order, group_order + group_topk, group_order + num_groups,
                    Better{scratch.group_scores.data()});
  // The experts of the kept groups are the only candidates (Megatron masks the rest to -inf).
  int32_t* order = scratch.order.data();
  int candidates = 0;
  for (int i = 0; i < group_topk; ++i) {
    const int g = group_order[i];
    for (int e = g * group_size; e < (g + 1) * group_size; ++e) order[candidates++] = e;
  }
  std::partial_sort(order, order + k, order + candidates, Better{values});
  std::copy(order, order + k, out);
}

void score_backward(ScoreFunction f, bool normalize, const float* x, int n, const double* g,
                    double scale, double* gx, double* tmp) {
  if (n <= 0) return;
  if (f == ScoreFunction::kSoftmax) {
    double max_value = x[0];
    for (int i = 1; i < n; ++i) max_value = std::max(max_value, double(x[i]));
    double sum = 0.0;
    for (int i = 0; i < n; ++i) {
      tmp[i] = std::exp(double(x[i]) - max_value);
      sum += tmp[i];
    }
    double dot = 0.0;
    for (int i = 0; i < n; ++i) {
      tmp[i] /= sum;
      dot += g[i] * tmp[i];
    }
    for (int i = 0; i < n; ++i) gx[i] += scale * tmp[i] * (g[i] - dot);
    return;
  }
  // s(x) and, for the normalised form, dL/ds = (g_i - sum_j g_j s_j / D) / D.
  double denominator = 1e-20;
  double dot = 0.0;
  for (int i = 0; i < n; ++i) {
    const double xi = x[i];
    tmp[i] = f == ScoreFunction::kSigmoid ? 1.0 / (1.0 + std::exp(-xi))
                                          : std::sqrt(xi > 20.0 ? xi : std::log1p(std::exp(xi)));
    denominator += tmp[i];
    dot += g[i] * tmp[i];
  }
  for (int i = 0; i < n; ++i) {
    const double xi = x[i];
    const double grad_score = normalize ? (g[i] - dot / denominator) / denominator : g[i];
    double dscore_dx;
    if (f == ScoreFunction::kSigmoid) {
      dscore_dx = tmp[i] * (1.0 - tmp[i]);
    } else if (tmp[i] == 0.0) {
      dscore_dx = 0.0;  // the limit of sigmoid(x) / (2 sqrt(softplus(x))) as x -> -inf
    } else {
      const double dsoftplus = xi > 20.0 ? 1.0 : 1.0 / (1.0 + std::exp(-xi));
      dscore_dx = dsoftplus / (2.0 * tmp[i]);
    }
    gx[i] += scale * grad_score * dscore_dx;
  }
}

}  // namespace moed::router_internal
