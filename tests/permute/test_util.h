// Shared by the permute tests: random inputs from fixed seeds and a brute-force layout,
// unpermute and backward written straight from design.md §3-§4, sharing no code with src/permute.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "moed/permute.h"

namespace moed::permute_test {

// One pool per thread count (1, 2, 3), kept for the whole test binary.
inline ThreadPool& pool_of(int threads) {
  static std::unique_ptr<ThreadPool> pools[4];
  if (!pools[threads]) pools[threads] = std::make_unique<ThreadPool>(threads);
  return *pools[threads];
}

enum class Skew { kUniform, kOneExpert, kAllExperts };

// K distinct experts per token (fewer when K > E); probs random in (0, 1] or dyadic.
inline RoutingMap random_map(int64_t T, int E, int K, uint32_t seed, Skew skew = Skew::kUniform,
                             bool dyadic = false) {
  RoutingMap m = RoutingMap::empty(T, E);
  m.num_topk = K;
  std::mt19937 rng(seed);
  std::vector<int> experts(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) experts[size_t(e)] = e;
    std::shuffle(experts.begin(), experts.end(), rng);
    int k = std::min(K, E);
    if (skew == Skew::kOneExpert) experts[0] = 0, k = 1;
    if (skew == Skew::kAllExperts) k = E;
    for (int i = 0; i < k; ++i) {
      const int e = experts[size_t(i)];
      m.routing_map[size_t(t) * E + e] = 1;
      m.probs[size_t(t) * E + e] = dyadic ? float(1 + rng() % 4) * 0.125f
                                          : std::uniform_real_distribution<float>(0.01f, 1.0f)(rng);
    }
  }
  return m;
}

// Random payload; fp8 gets random bytes (no NaN codes) and random scales.
inline TokenTensor random_tokens(DType dtype, int64_t T, int64_t H, uint32_t seed,
                                 bool exact = false) {
  std::mt19937 rng(seed);
  TokenTensor t;
  t.x = Tensor::empty(dtype, T, H);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int64_t r = 0; r < T; ++r) {
    for (int64_t h = 0; h < H; ++h) {
      // exact: small integers over 8, so products with dyadic probs and their sums are exact.
      const float v = exact ? float(int(rng() % 17) - 8) * 0.125f : u(rng);
      if (dtype == DType::kF32) t.x.row<float>(r)[h] = v;
      if (dtype == DType::kBF16) t.x.row<bf16>(r)[h] = float_to_bf16(v);
      if (dtype == DType::kFP8) t.x.row<fp8_e4m3>(r)[h] = fp8_e4m3{uint8_t(rng() % 0x7f)};
    }
  }
  if (dtype == DType::kFP8) {
    t.scales = Tensor::empty(DType::kF32, T, H / kFp8BlockSize);
    for (int64_t r = 0; r < T; ++r) {
      for (int64_t b = 0; b < H / kFp8BlockSize; ++b) t.scales.row<float>(r)[b] = u(rng) + 3.0f;
    }
  }
  return t;
}

inline float to_float(const TensorView& v, int64_t r, int64_t h) {
  return v.dtype == DType::kF32 ? v.row<float>(r)[h] : bf16_to_float(v.row<bf16>(r)[h]);
}

struct BruteLayout {
  std::vector<int32_t> sorted_indices;
  std::vector<float> probs;
  std::vector<int64_t> tokens_per_expert;
  std::vector<int64_t> unpadded;
  std::vector<int> row_expert;  // -1 on padding rows
};

// design.md §3.1 for one rank: experts ascending, sources ascending, tokens ascending, chunk
// padding to capacity, segment padding to the alignment.
inline BruteLayout brute_layout(const RoutingMap& m, int eb, int ee, std::optional<int64_t> cap,
                                int align, std::vector<int64_t> sources = {},
                                std::vector<int64_t> caps = {}) {
  if (sources.empty()) sources = {0, m.num_tokens};
  BruteLayout l;
  for (int e = eb; e < ee; ++e) {
    const size_t start = l.sorted_indices.size();
    int64_t real = 0;
    for (size_t s = 0; s + 1 < sources.size(); ++s) {
      int64_t n = 0;
      for (int64_t t = sources[s]; t < sources[s + 1]; ++t) {
        if (!m.routed(t, e)) continue;
        l.sorted_indices.push_back(int32_t(t));
        l.probs.push_back(m.prob(t, e));
        l.row_expert.push_back(e);
        ++n;
      }
      real += n;
      const std::optional<int64_t> c = caps.empty() ? cap : std::optional<int64_t>(caps[s]);
      for (; c && n < *c; ++n) {
        l.sorted_indices.push_back(-1);
        l.probs.push_back(0.0f);
        l.row_expert.push_back(-1);
      }
    }
    while ((l.sorted_indices.size() - start) % size_t(align) != 0) {
      l.sorted_indices.push_back(-1);
      l.probs.push_back(0.0f);
      l.row_expert.push_back(-1);
    }
    l.tokens_per_expert.push_back(int64_t(l.sorted_indices.size() - start));
    l.unpadded.push_back(real);
  }
  return l;
}

// design.md §4.1 with one rank: for each expert ascending, the token's row in that expert's
// segment.
inline std::vector<float> brute_unpermute_f32(const TensorView& rows, const BruteLayout& l,
                                              int64_t T, int E, bool weighted) {
  std::vector<float> out(size_t(T * rows.cols), 0.0f);
  std::vector<int64_t> row_of(size_t(T) * E, -1);
  for (size_t r = 0; r < l.sorted_indices.size(); ++r) {
    if (l.sorted_indices[r] >= 0)
      row_of[size_t(l.sorted_indices[r]) * E + l.row_expert[r]] = int64_t(r);
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < rows.cols; ++h) {
      float acc = 0.0f;
      for (int e = 0; e < E; ++e) {
        const int64_t r = row_of[size_t(t) * E + e];
        if (r < 0) continue;
        const float y = to_float(rows, r, h);
        acc = weighted ? acc + l.probs[size_t(r)] * y : acc + y;
      }
      out[size_t(t * rows.cols + h)] = acc;
    }
  }
  return out;
}

// Rounds brute_unpermute_f32's result to `dtype` and compares bits with `got`.
inline bool equals_rounded(const std::vector<float>& want, const TensorView& got) {
  for (int64_t t = 0; t < got.rows; ++t) {
    for (int64_t h = 0; h < got.cols; ++h) {
      const float w = want[size_t(t * got.cols + h)];
      if (got.dtype == DType::kF32) {
        if (float_to_bits(w) != float_to_bits(got.row<float>(t)[h])) return false;
      } else if (float_to_bf16(w).bits != got.row<bf16>(t)[h].bits) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace moed::permute_test
