// The grid both API test files run over: every backend of the binary times the three
// six-step dispatchers, with test names such as "threads_allgather".
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <tuple>

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

}  // namespace moed::testing
