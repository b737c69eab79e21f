// Small builders for the reference tests: hand-written maps, hidden states whose values name
// their token, and random problems from fixed seeds.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "moed/reference.h"
#include "moed/routing.h"
#include "moed/tensor.h"

namespace moed::testing {

// A map from 0/1 rows; probs given per cell (0 where unrouted), or 1.0 on every routed cell.
inline RoutingMap make_map(const std::vector<std::vector<int>>& routed,
                           const std::vector<std::vector<float>>& probs = {},
                           int num_experts = -1) {
  RoutingMap m;
  m.num_tokens = int64_t(routed.size());
  m.num_experts = num_experts >= 0 ? num_experts : int(routed.empty() ? 0 : routed[0].size());
  for (size_t t = 0; t < routed.size(); ++t) {
    for (int e = 0; e < m.num_experts; ++e) {
      m.routing_map.push_back(uint8_t(routed[t][size_t(e)]));
      m.probs.push_back(probs.empty() ? (routed[t][size_t(e)] ? 1.0f : 0.0f) : probs[t][size_t(e)]);
    }
  }
  return m;
}

// f32 [T, H] with x[t][h] = 1000 * rank + 10 * t + h, so a row says where it came from.
inline Tensor named_hidden(int rank, int64_t num_tokens, int64_t hidden) {
  Tensor x = Tensor::zeros(DType::kF32, num_tokens, hidden);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < hidden; ++h) x.row<float>(t)[h] = float(1000 * rank + 10 * t + h);
  }
  return x;
}

// f32 [rows, cols] uniform in [-1, 1).
inline Tensor random_f32(std::mt19937& rng, int64_t rows, int64_t cols) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Tensor x = Tensor::zeros(DType::kF32, rows, cols);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t h = 0; h < cols; ++h) x.row<float>(i)[h] = dist(rng);
  }
  return x;
}

// Each token routes to num_topk distinct experts, probs uniform in (0, 1].
inline RoutingMap random_map(std::mt19937& rng, int64_t num_tokens, int num_experts, int num_topk) {
  RoutingMap m = RoutingMap::empty(num_tokens, num_experts);
  m.num_topk = num_topk;
  std::uniform_real_distribution<float> prob(0.0f, 1.0f);
  std::vector<int> experts(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int e = 0; e < num_experts; ++e) experts[size_t(e)] = e;
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int k = 0; k < num_topk; ++k) {
      const size_t cell = size_t(t) * num_experts + size_t(experts[size_t(k)]);
      m.routing_map[cell] = 1;
      m.probs[cell] = 1.0f - prob(rng);
    }
  }
  return m;
}

inline std::vector<TensorView> views_of(const std::vector<Tensor>& ts) {
  std::vector<TensorView> v;
  for (const Tensor& t : ts) v.push_back(t.view());
  return v;
}

inline std::vector<float> row_values(const TensorView& v, int64_t i) {
  std::vector<float> out;
  for (int64_t h = 0; h < v.cols; ++h) out.push_back(v.row<const float>(i)[h]);
  return out;
}

// A problem over `xs` (non-FP8 hidden states; the tensors must outlive it).
inline ReferenceProblem make_problem(int num_experts, int ep_size, int etp_size,
                                     std::vector<RoutingMap> maps, const std::vector<Tensor>& xs) {
  ReferenceProblem p;
  p.num_experts = num_experts;
  p.ep_size = ep_size;
  p.etp_size = etp_size;
  p.routing = std::move(maps);
  for (const Tensor& x : xs) p.hidden.push_back(TokenRows{x.view(), TensorView{}});
  return p;
}

// A problem over named_hidden inputs (rank s: maps[s].num_tokens rows of `hidden`) that holds
// them: p views xs, so a HeldProblem is never copied.
struct HeldProblem {
  std::vector<Tensor> xs;
  ReferenceProblem p;
  HeldProblem(int num_experts, int ep_size, int etp_size, std::vector<RoutingMap> maps,
              int64_t hidden) {
    for (size_t s = 0; s < maps.size(); ++s) {
      xs.push_back(named_hidden(int(s), maps[s].num_tokens, hidden));
    }
    p = make_problem(num_experts, ep_size, etp_size, std::move(maps), xs);
  }
  HeldProblem(const HeldProblem&) = delete;
  HeldProblem& operator=(const HeldProblem&) = delete;
};

inline uint32_t bits_of(float f) { return float_to_bits(f); }

}  // namespace moed::testing
