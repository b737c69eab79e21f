// The (world size, ranks per node) grid every comm test runs: sizes 1, 2, 3, 4, 7, 8 and
// G = 1, 2, 4, size where G divides the size.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moed::testing {

inline std::vector<std::pair<int, int>> world_grid() {
  std::vector<std::pair<int, int>> out;
  for (int r : {1, 2, 3, 4, 7, 8}) {
    for (int g : {1, 2, 4, r}) {
      if (r % g != 0) continue;
      bool seen = false;
      for (auto& p : out) seen |= (p.first == r && p.second == g);
      if (!seen) out.emplace_back(r, g);
    }
  }
  return out;
}

// A fixed hash for test data that every rank can recompute for any other rank.
inline uint32_t mix(uint32_t a, uint32_t b, uint32_t c = 0) {
  uint32_t h = a * 0x9E3779B1u ^ (b + 0x7F4A7C15u) * 0x85EBCA77u ^ (c + 0x165667B1u) * 0xC2B2AE3Du;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  return h;
}

// Floats of very different magnitudes and both signs, so that the summation order shows.
inline float test_float(uint32_t rank, uint32_t i, uint32_t salt) {
  const uint32_t h = mix(rank, i, salt);
  const float mantissa = float(int(h % 2001u) - 1000);
  const int exponent = int((h >> 12) % 24u) - 12;
  float scale = 1.0f;
  for (int e = 0; e < exponent; ++e) scale *= 2.0f;
  for (int e = 0; e > exponent; --e) scale *= 0.5f;
  return mantissa * scale + 0.1f;
}

inline std::string grid_name(int r, int g) {
  return "R=" + std::to_string(r) + " G=" + std::to_string(g);
}

}  // namespace moed::testing
