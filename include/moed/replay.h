// Replaying a routing trace: what dispatch would move, without moving a token (docs/planner.md).
// A trace is the top-k indices a router chose, [T, K] or [steps, T, K] (.npy, int32 or int64,
// -1 = no expert); each step's tokens are split evenly over R source ranks. Replay counts tokens
// per expert and per rank, tokens dropped under a capacity factor, the rank-to-rank traffic
// matrix, the network bytes of a flat all-to-all against Flex's two hops, and a predicted
// dispatch time, and draws the traffic matrix and the load per expert as SVG.
//
//   MOED_ASSIGN_OR_RETURN(moed::RoutingTrace trace, moed::read_routing_trace("topk_idx.npy"));
//   moed::ReplayOptions o;
//   o.num_ranks = 16;
//   o.ranks_per_node = 8;  // two nodes
//   MOED_ASSIGN_OR_RETURN(moed::ReplayResult r, moed::replay_trace(trace, o));
//   std::fputs(moed::replay_table(r).c_str(), stdout);
//   MOED_ASSIGN_OR_RETURN(moed::ReplayPictures p, moed::write_replay_pictures(r, "out/"));
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moed/dispatch_layout.h"  // Flex's wire sizes
#include "moed/routing.h"
#include "moed/status.h"

namespace moed {

// Top-k indices [num_steps, num_tokens, num_topk], row-major; -1 = no expert.
struct RoutingTrace {
  std::string name;  // the file it came from, for messages
  int64_t num_steps = 1;
  int64_t num_tokens = 0;  // per step, all ranks together
  int num_topk = 0;
  std::vector<int32_t> topk_idx;

  int32_t idx(int64_t step, int64_t t, int k) const {
    return topk_idx[(size_t(step) * size_t(num_tokens) + size_t(t)) * size_t(num_topk) + size_t(k)];
  }
  // Largest index in the trace, -1 when it holds none.
  int32_t max_index() const;
};

// Reads a [T, K] or [steps, T, K] int32 / int64 .npy file. Errors name the file and the value
// ("trace.npy: topk_idx[0][5][1] = -3 is below -1").
StatusOr<RoutingTrace> read_routing_trace(const std::string& path);

struct ReplayOptions {
  int num_experts = 0;     // 0 = trace max index + 1
  int num_ranks = 1;       // R; E % R == 0 and T % R == 0
  int ranks_per_node = 0;  // G; 0 = R (one node). G must divide R
  // Capacity dropping per source rank and step, C = ceil(T_s * K / E * cf); unset = dropless.
  std::optional<double> capacity_factor;
  // Only kPosition: a trace carries no probs, so kProbs is an error.
  DropPolicy drop_policy = DropPolicy::kPosition;
  int64_t hidden = 7168;
  int dtype_bytes = 2;  // bf16 payload
  // Bandwidths of the prediction, GB/s (1e9 bytes per second) per rank. The defaults are
  // DeepEP's H800 figures: ~160 GB/s NVLink, ~50 GB/s RDMA (400 Gb/s InfiniBand).
  double shared_gbps = 160.0;
  double network_gbps = 50.0;
};

// Bytes and predicted time of one dispatch scheme, summed over steps.
struct SchemeCost {
  std::vector<int64_t> shared_bytes;   // [R] written by rank r over node-shared memory
  std::vector<int64_t> network_bytes;  // [R] sent by rank r over the network
  std::vector<double> step_seconds;    // [steps] max over ranks of that step's time
  double seconds = 0.0;                // sum of step_seconds
  int64_t total_shared_bytes() const;
  int64_t total_network_bytes() const;
};

struct ReplayResult {
  std::string trace_name;
  int64_t num_steps = 0;
  int64_t num_tokens = 0;  // per step, all ranks together
  int num_topk = 0;
  int num_experts = 0;
  int num_ranks = 0;
  int ranks_per_node = 0;
  int num_nodes = 0;
  int num_local_experts = 0;
  int64_t hidden = 0;
  int dtype_bytes = 0;
  std::optional<double> capacity_factor;
  int64_t capacity = 0;  // C per (source rank, expert, step); 0 when dropless
  double shared_gbps = 0.0;
  double network_gbps = 0.0;

  // Summed over steps.
  std::vector<int64_t> routed_per_expert;   // [E] token-expert pairs before dropping
  std::vector<int64_t> tokens_per_expert;   // [E] kept
  std::vector<int64_t> dropped_per_expert;  // [E]
  int64_t dropped = 0;
  std::vector<int64_t> rows_per_rank;    // [R] kept token-expert pairs its experts receive
  std::vector<int64_t> tokens_per_rank;  // [R] tokens it receives, each once
  std::vector<int64_t> traffic;          // [R * R] traffic[s * R + d]: tokens s sends to d
  double expert_imbalance = 0.0;         // max / mean of tokens_per_expert (0 when empty)
  double rank_imbalance = 0.0;           // max / mean of rows_per_rank
  SchemeCost flat;                       // flat all-to-all
  SchemeCost flex;                       // Flex, two hops

  int64_t traffic_at(int s, int d) const { return traffic[size_t(s) * size_t(num_ranks) + d]; }
  int64_t row_bytes() const { return hidden * dtype_bytes; }
};

// Errors name the trace and the value: an index >= E, E not a multiple of R, T not a multiple
// of R, G not dividing R, kProbs asked for.
StatusOr<ReplayResult> replay_trace(const RoutingTrace& trace, const ReplayOptions& options);
// max / mean of counts (0 when empty or all zero): ReplayResult's imbalances.
double imbalance(const std::vector<int64_t>& counts);

// A fixed-width text report (what `moed replay` prints).
std::string replay_table(const ReplayResult& r);
// The same as one JSON object (what `moed replay --json` prints).
std::string replay_json(const ReplayResult& r);

// The pictures as SVG documents: the traffic matrix as a heatmap (source rank down, destination
// rank across, colour legend, node boundaries when G < R) and the load per expert as bars
// (kept, and dropped stacked above when a capacity factor dropped any; mean line).
std::string traffic_heatmap_svg(const ReplayResult& r);
std::string expert_load_svg(const ReplayResult& r);

struct ReplayPictures {
  std::vector<std::string> files;  // paths written, SVG first then PNG
  std::string converter;           // "rsvg-convert", "convert", or "" when no PNG was made
};
// Writes traffic.svg and expert_load.svg into `dir` (created if missing), and a PNG beside
// each when rsvg-convert or ImageMagick's convert is on PATH and succeeds (tried in that
// order; otherwise no PNG, silently).
StatusOr<ReplayPictures> write_replay_pictures(const ReplayResult& r, const std::string& dir);

// Several router calls of one step (a model's layers), each replayed on its own: imbalance differs
// per layer, so the pictures show every layer at once.
struct LayerReplay {
  std::string label;    // "decoder layer 3"
  ReplayResult result;  // replay_trace of that call alone
};
// Layers down, experts across: the tokens each expert receives (viridis), with each layer's
// max / mean at the right.
std::string layer_load_svg(const std::vector<LayerReplay>& layers);
// Layers down, ranks across: the token-expert rows each rank's experts receive, with each layer's
// rank max / mean and Flex's network megabytes of its busiest rank at the right.
std::string layer_traffic_svg(const std::vector<LayerReplay>& layers);
// Writes layer_load.svg and layer_traffic.svg into `dir` (PNG beside them as
// write_replay_pictures does).
StatusOr<ReplayPictures> write_layer_pictures(const std::vector<LayerReplay>& layers,
                                              const std::string& dir);

}  // namespace moed
