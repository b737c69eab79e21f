// The reference's internal plan: the validated global problem, every source rank's effective
// routing and every expert-parallel group's canonical layout, computed once and shared by
// reference_dispatch, reference_combine and both backward passes (src/reference/*.cc).
//
// NOTE: nothing here may call the fast paths (apply_layout_options, expert_capacity,
// src/permute, src/dispatch): the reference is what they are checked against.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moed/dtype.h"
#include "moed/reference.h"
#include "moed/routing.h"
#include "moed/status.h"
#include "moed/tensor.h"

namespace moed::reference_internal {

// The canonical layout (design.md §3.1) of the ranks of one ep index; all P of them hold the same
// rows.
struct EpLayout {
  std::vector<int32_t> row_src_rank;       // -1 on padding rows
  std::vector<int32_t> row_src_token;      // -1 on padding rows
  std::vector<int32_t> row_expert;         // global expert of the row's segment (padding rows too)
  std::vector<int64_t> tokens_per_expert;  // [L], padded
  std::vector<int64_t> tokens_per_expert_unpadded;  // [L], rows with a source

  int64_t num_rows() const { return int64_t(row_src_rank.size()); }
};

struct Plan {
  int num_experts = 0;
  int ep_size = 1;
  int etp_size = 1;
  int world_size = 1;
  int num_local_experts = 0;
  int64_t hidden = 0;
  DType dtype = DType::kF32;          // payload dtype of the hidden states
  std::vector<int64_t> capacity;      // per source rank; only meaningful with capacity_factor
  std::vector<RoutingMap> effective;  // per source rank, after dropping and router padding
  std::vector<EpLayout> layouts;      // per ep index
  // row_of[s][t * E + e]: row of (s, t, e) on every rank (ep(e), p); -1 where not routed.
  std::vector<std::vector<int64_t>> row_of;

  int64_t num_tokens(int s) const { return effective[size_t(s)].num_tokens; }
  int ep_of_rank(int r) const { return r / etp_size; }
  int ep_of_expert(int e) const { return e / num_local_experts; }
  int rank_of(int ep, int p) const { return ep * etp_size + p; }
  const EpLayout& layout_of_rank(int r) const { return layouts[size_t(ep_of_rank(r))]; }
};

// Validates the problem (routing, hidden states, options) and builds the plan.
StatusOr<Plan> make_plan(const ReferenceProblem& p);

// Checks one view per rank: count, rows (expected_rows[r]), cols, dtype f32 or bf16 and the
// same on every rank. `what(r)` completes "<name>[r] has N rows but ..." with the expected
// count and where it comes from.
Status check_float_views(const std::string& name, const std::vector<TensorView>& views,
                         const std::vector<int64_t>& expected_rows, int64_t expected_cols,
                         const std::function<std::string(int)>& what);

// Rows expected per rank: the dispatch layout's (per group rank) or T_s (per source rank).
std::vector<int64_t> layout_rows(const Plan& plan);
std::vector<int64_t> token_rows(const Plan& plan);

// Element h of row i as float (f32 or bf16 view).
inline float load_float(const TensorView& v, int64_t i, int64_t h) {
  if (v.dtype == DType::kF32) return v.row<const float>(i)[h];
  return bf16_to_float(v.row<const bf16>(i)[h]);
}
// Stores `value` rounded once to the view's dtype (bf16: round to nearest even).
inline void store_float(const TensorView& v, int64_t i, int64_t h, float value) {
  if (v.dtype == DType::kF32) {
    v.row<float>(i)[h] = value;
  } else {
    v.row<bf16>(i)[h] = float_to_bf16(value);
  }
}

}  // namespace moed::reference_internal
