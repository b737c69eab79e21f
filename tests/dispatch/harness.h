// Test harness for TokenDispatcher implementations: builds a global MoE input deterministically
// on every rank, runs dispatch, combine and both backward passes with a dispatcher on the
// world, and compares every output bit for bit with the reference (moed/reference.h), plus
// Megatron's round-trip identity computed independently.
//
// Generic over the dispatcher: the caller passes a factory, so a test binary links only the
// dispatchers it tests.
//
//   for (const DispatchCase& c : moed::testing::sweep_cases()) cases.push_back(c);
//   moed::Status s = moed::testing::run_cases(GetParam(), cases, moed::DispatcherKind::kFlex,
//                                             moed::make_flex_dispatcher);
//   ASSERT_TRUE(s.ok()) << s.to_string();   // "case R4 ETP2 ...: rank 1: combine out[3][17] ..."
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "moed/dispatcher.h"
#include "moed/routing.h"
#include "support/world_test.h"

namespace moed::testing {

struct DispatchCase {
  int ranks = 1;                // R
  int ranks_per_node = 0;       // G (0 = one node)
  int etp = 1;                  // P
  int num_experts = 1;          // E
  int num_topk = 1;             // K
  std::vector<int64_t> tokens;  // T per source rank (size R; zeros allowed)
  bool skewed = false;          // every token routes to one expert (plus random others when K > 1)
  LayoutOptions layout;
  bool weighted = false;
  DType dtype = DType::kF32;      // payload: f32, bf16 or fp8 (+ scales)
  DType out_dtype = DType::kF32;  // expert outputs and gradients: f32 or bf16
  int hidden = 128;
  bool map_form = false;  // pass the routing as a RoutingMap instead of top-k
  // Every input view (hidden, fp8 scales, expert outputs, gradients) strided: row_stride =
  // cols + a few elements of 0xff bytes, so a dispatcher that assumes packed rows shows.
  bool strided = false;
  uint64_t seed = 1;

  std::string name() const;
};

using DispatcherFactory =
    std::function<StatusOr<std::unique_ptr<TokenDispatcher>>(World&, const DispatchConfig&)>;

// The global input of a case, the same on every rank.
struct CaseInput {
  std::vector<TokenTensor> hidden;  // per source [T_s, H]
  std::vector<TopkRouting> topk;    // per source
  std::vector<RoutingMap> map;      // per source (to_map of topk)
};
CaseInput make_case_input(const DispatchCase& c);

// Runs one case on this rank of `w` (w.size() == c.ranks): every output against the
// reference. Returns the first mismatch as an error naming the output, rank, index and values.
Status check_case(World& w, const DispatchCase& c, DispatcherKind kind,
                  const DispatcherFactory& make);

// Runs cases on backend b, grouped by (ranks, ranks_per_node) so each group shares one world
// start; returns the first failure prefixed with the case name.
Status run_cases(Backend b, const std::vector<DispatchCase>& cases, DispatcherKind kind,
                 const DispatcherFactory& make);

// The standard sweep (every dispatcher runs it): R in {1, 2, 3, 4, 8}, ETP in {1, 2} where it
// divides, E in {EP, R, 4R, 8R}, K in {1, 2, L, E}, T per rank 0..13 differing across ranks,
// skewed routing, each layout option (dropless, cf 0.5 with each policy, pad_to_capacity,
// expert_alignment 16, router padding 16), weighted, dtypes f32 / bf16 / fp8, both routing
// forms, f32 and bf16 expert outputs. Not the full product: every value of every axis, and
// every (layout, dtype) pair for every (R, ETP).
std::vector<DispatchCase> sweep_cases();
// The sweep cases of `ranks` ranks (one ctest per rank count keeps each test short).
std::vector<DispatchCase> sweep_cases(int ranks);

// The corners the sweep leaves out, for every dispatcher: strided inputs (every dtype and
// layout), R = 5 and 7, every rank with T = 0 (R > 1, every layout), hidden sizes that are not
// a multiple of 16 (17, 100, 4099 with few tokens; fp8 needs H % 128 == 0 and keeps 128).
std::vector<DispatchCase> edge_cases();

// Every dispatcher's sweep and edge suites derive from these fixtures (so each keeps its own
// suite name) and run the cases with their kind and factory.
using BackendAndRanks = std::tuple<Backend, int>;
class SweepTest : public ::testing::TestWithParam<BackendAndRanks> {
 protected:
  // sweep_cases(ranks) on the parameter's backend.
  void run_sweep(DispatcherKind kind, const DispatcherFactory& make) const {
    const auto [backend, ranks] = GetParam();
    Status s = run_cases(backend, sweep_cases(ranks), kind, make);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
};
class EdgesTest : public ::testing::TestWithParam<Backend> {
 protected:
  void run_edges(DispatcherKind kind, const DispatcherFactory& make) const {
    Status s = run_cases(GetParam(), edge_cases(), kind, make);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
};

// A SweepTest's parameters: every backend of the binary times R in {1, 2, 3, 4, 8}, named
// "threads_R4".
inline auto sweep_grid() {
  return ::testing::Combine(::testing::ValuesIn(backends()), ::testing::Values(1, 2, 3, 4, 8));
}
inline std::string sweep_grid_name(const ::testing::TestParamInfo<BackendAndRanks>& info) {
  return std::string(backend_name(std::get<0>(info.param))) + "_R" +
         std::to_string(std::get<1>(info.param));
}

}  // namespace moed::testing
