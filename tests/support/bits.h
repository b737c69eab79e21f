// Bitwise comparison for the tests: the contract promises bits (design.md §4.2), so tests compare
// bits.
#pragma once

#include <cstring>
#include <vector>

namespace moed::testing {

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

}  // namespace moed::testing
