// Shared by the low-latency tests: a global problem built on every rank from a seed, its
// reference (design.md §3, §6), the checks of one rank's dispatch and combine against it, and
// the fixture over both worlds (instantiated once, in low_latency_test_util.cc).
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <functional>
#include <vector>

#include "moed/low_latency.h"
#include "moed/reference.h"
#include "moed/routing.h"
#include "support/world_test.h"

namespace moed::low_latency_test {

using ::moed::testing::Backend;

class LowLatencyTest : public ::testing::TestWithParam<Backend> {};

struct Case {
  int ranks, per_node, num_experts, hidden, num_topk;
  int64_t max_tokens;
  uint32_t seed;
  bool skewed = false;     // every token's first expert is expert 0
  bool all_empty = false;  // every rank has T = 0
};

// The global problem: every rank builds all of it from the seed and uses its own part.
struct Problem {
  Case c;                         // what it is built from
  std::vector<Tensor> x;          // per rank [T_s, H] bf16
  std::vector<TopkRouting> topk;  // per rank
  std::vector<Tensor> y;          // per rank: expert outputs in the canonical layout
  std::vector<ReferenceRankDispatch> ref;
  std::vector<Tensor> ref_out;  // per rank: weighted combine [T_s, H] bf16
};

StatusOr<Problem> make_problem(const Case& c);

// Checks one rank's dispatch output against the reference.
Status check_dispatch(const Problem& p, int rank, const LowLatencyDispatchOutput& d, bool fp8,
                      bool round_scale);

// Expert outputs in the low-latency layout: the reference's rows of expert j at its packed
// rows, NaN in every unused slot (combine must never read them).
Tensor expert_output(const Problem& p, int rank, const LowLatencyDispatchOutput& d);

Status check_combine(const Problem& p, int rank, const Tensor& out);

// Runs body on every rank of case c with a LowLatencyBuffer sized for c.
Status run_with_buffer(Backend backend, const Case& c,
                       const std::function<Status(World&, LowLatencyBuffer&)>& body);

// Two problems of c's shape (the second from seed + 1000), for two operations in flight.
StatusOr<std::array<Problem, 2>> two_problems(const Case& c);

}  // namespace moed::low_latency_test
