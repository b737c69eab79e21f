// What every dispatcher does first, in one place: check the DispatchInput against the config,
// turn the routing, whatever its form, into the sparse form once (moed/routing.h), apply
// capacity dropping and router padding on it (the effective routing), count it, and compute the
// canonical layout (design.md §3.1) from everybody's per-expert counts. The checks are local
// (dispatch_preprocess is local in every dispatcher); the communicating step agrees on their
// verdict and on the shapes in its one collective (comm/agreement.h), so a bad input on one rank
// is every rank's error there.
//
//   MOED_ASSIGN_OR_RETURN(PreparedInput in, prepare_dispatch_input(config, input, pool));
//   ... agree; exchange in.tokens_per_expert ([E]) so each rank has counts[s][e] ...
//   ExpertLayout layout = compute_expert_layout(config, world.size(), world.rank(),
//                                               {counts.data(), size_t(E), caps.data()});
#pragma once

#include <cstdint>
#include <vector>

#include "moed/dispatcher.h"

namespace moed {

struct PreparedInput {
  int64_t num_tokens = 0;  // T on this rank
  int hidden = 0;          // H, the same on every rank (checked)
  DType dtype = DType::kF32;
  int num_topk = 0;      // K, the same on every rank (checked)
  SparseRouting effective;  // after dropping and router padding
  // Rows this rank sends to each global expert (entries of `effective` per expert), [E].
  std::vector<int64_t> tokens_per_expert;
  // C_s of this rank when capacity_factor is set (else 0).
  int64_t capacity = 0;
  int64_t out_rows = -1;  // DispatchInput::out's rows, -1 without one
};

// Local checks (shapes, dtype, fp8 scales present and shaped [T, H/128], exactly one routing
// form, routing valid for E), then the effective routing. No collective: the caller agrees on
// the verdict and on hidden, dtype and num_topk (agree_in_one, comm/agreement.h).
StatusOr<PreparedInput> prepare_dispatch_input(const DispatchConfig& config,
                                               const DispatchInput& input, ThreadPool& pool);

// DispatchInput::out's dtype, columns and stride against the hidden states (local; its rows
// are known only after the count exchange, where each dispatcher checks them).
Status check_dispatch_out_columns(const DispatchInput& input);

// Every rank's counts where an exchange left them: rows source s sends to global expert e at
// counts[s * stride + e], its C_s at capacity[s * capacity_stride].
struct CountsView {
  const int64_t* counts = nullptr;
  size_t stride = 0;
  const int64_t* capacity = nullptr;
  size_t capacity_stride = 1;

  int64_t count(int s, int e) const { return counts[size_t(s) * stride + size_t(e)]; }
  int64_t capacity_of(int s) const { return capacity[size_t(s) * capacity_stride]; }
};

// The canonical layout of rank `rank` (design.md §3.1), from every rank's counts (C_s is used
// only with pad_to_capacity).
struct ExpertLayout {
  int num_local_experts = 0;  // L
  int world_size = 0;         // R
  // [L * R]: where the (local expert j, source s) chunk starts inside the rank's output, how
  // many rows it occupies (C_s with pad_to_capacity) and how many of those are real tokens.
  std::vector<int64_t> chunk_offset;
  std::vector<int64_t> chunk_rows;
  std::vector<int64_t> chunk_tokens;
  std::vector<int64_t> segment_offset;              // [L + 1]
  std::vector<int64_t> tokens_per_expert;           // [L], padded
  std::vector<int64_t> tokens_per_expert_unpadded;  // [L]
  int64_t num_rows = 0;

  int64_t offset(int j, int s) const { return chunk_offset[size_t(j) * world_size + s]; }
  int64_t rows(int j, int s) const { return chunk_rows[size_t(j) * world_size + s]; }
  int64_t tokens(int j, int s) const { return chunk_tokens[size_t(j) * world_size + s]; }
};

// Rank g's local experts are ep(g) * L + j (g = (ep, p), ep = g / etp_size).
ExpertLayout compute_expert_layout(const DispatchConfig& config, int world_size, int rank,
                                   const CountsView& counts);

// First global expert of rank g and the ep index of expert e.
inline int first_local_expert(const DispatchConfig& c, int world_size, int rank) {
  return (rank / c.etp_size) * c.num_local_experts(world_size);
}
inline int ep_of_expert(const DispatchConfig& c, int world_size, int e) {
  return e / c.num_local_experts(world_size);
}

}  // namespace moed
