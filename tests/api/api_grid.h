// What both API test files run: the grid of every backend of the binary times the three
// six-step dispatchers (test names such as "threads_allgather"), and their small cases.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "dispatch/harness.h"
#include "moed/dispatcher.h"
#include "support/world_test.h"

namespace moed::testing {

using BackendAndKind = std::tuple<Backend, DispatcherKind>;

// A test over the grid: `const auto [backend, kind] = GetParam();`.
class BackendAndKindTest : public ::testing::TestWithParam<BackendAndKind> {};

inline auto six_step_grid() {
  return ::testing::Combine(::testing::ValuesIn(backends()),
                            ::testing::Values(DispatcherKind::kAllGather, DispatcherKind::kAlltoAll,
                                              DispatcherKind::kFlex));
}

inline std::string six_step_grid_name(const ::testing::TestParamInfo<BackendAndKind>& info) {
  return std::string(backend_name(std::get<0>(info.param))) + "_" +
         dispatcher_kind_name(std::get<1>(info.param));
}

// R ranks, E = 2R, K = 2; rank r has first_tokens + 3r tokens, but rank 1 none; H = hidden
// (the callers pick one that is not a multiple of 16).
inline DispatchCase api_case(int ranks, int g, int first_tokens, int hidden, uint64_t seed) {
  DispatchCase c;
  c.ranks = ranks;
  c.ranks_per_node = g;
  c.num_experts = 2 * ranks;
  c.num_topk = 2;
  c.tokens.assign(size_t(ranks), 0);
  for (int r = 0; r < ranks; ++r) c.tokens[size_t(r)] = first_tokens + 3 * r;
  if (ranks > 1) c.tokens[1] = 0;  // a rank with no tokens
  c.hidden = hidden;
  c.seed = seed;
  return c;
}

}  // namespace moed::testing
