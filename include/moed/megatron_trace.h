// Megatron-Core's routing traces (RouterTracer's router_trace_rank{r}.jsonl and the optional
// hidden_states_rank{r}.bin) as input to replay, plan and dispatch. docs/planner.md describes
// the format and how a step's records are joined over ranks; errors name the file, the line and
// the value.
//
//   moed::MegatronTraceSelection sel;
//   sel.step = 3;                       // default: the lowest step in rank 0's file
//   sel.layer = 5;                      // default: every layer of the step
//   sel.num_experts = 256;              // indices are checked against it
//   MOED_ASSIGN_OR_RETURN(moed::MegatronTrace t, moed::read_megatron_trace("traces/", sel));
//   MOED_ASSIGN_OR_RETURN(moed::RoutingTrace r, moed::megatron_routing_trace(t));  // replay_trace
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moed/replay.h"
#include "moed/status.h"

namespace moed {

struct MegatronTraceSelection {
  std::optional<int64_t> step;     // default: the lowest step in rank 0's file
  std::string block = "decoder";   // "decoder" or "mtp"
  std::optional<int> mtp_idx;      // block "mtp": which head (default: every head)
  std::optional<int> layer;        // default: every layer of the step
  std::optional<int> microbatch;   // default: every call
  int num_experts = 0;             // > 0: every index must be < it
  bool load_hidden_states = false;  // read the sidecar rows (every selected record must have them)
};

// One router call of every rank, joined in rank order.
struct MegatronLayerCall {
  std::string block;
  int mtp_idx = -1;  // -1 for decoder layers
  int layer = 0;
  int microbatch = 0;
  int64_t tokens_per_rank = 0;
  int num_topk = 0;
  std::vector<int32_t> topk_idx;  // [num_ranks * tokens_per_rank, num_topk], -1 = none
  int64_t hidden = 0;             // the sidecar's H; 0 when the records carry no hidden states
  std::vector<uint16_t> hidden_states;  // [num_ranks * tokens_per_rank, hidden] bf16 bits, when loaded

  // "decoder layer 3", "mtp 0 layer 1", with " microbatch 2" when > 0.
  std::string label() const;
};

struct MegatronTrace {
  std::string dir;
  int num_ranks = 0;
  int64_t step = 0;
  std::vector<int64_t> steps;            // every step in rank 0's file, ascending
  std::vector<MegatronLayerCall> calls;  // by (block, mtp_idx, layer, microbatch)
};

// True when `path` is a directory holding router_trace_rank0.jsonl.
bool is_megatron_trace_dir(const std::string& path);
// The number of ranks whose files are in `dir` (router_trace_rank0..R-1.jsonl, none missing).
StatusOr<int> megatron_trace_ranks(const std::string& dir);

StatusOr<MegatronTrace> read_megatron_trace(const std::string& dir,
                                            const MegatronTraceSelection& selection);

// The calls as one RoutingTrace, one step per call (what replay_trace and plan read). The calls
// must agree on tokens and top-k (they do within one Megatron step).
StatusOr<RoutingTrace> megatron_routing_trace(const MegatronTrace& trace);

}  // namespace moed
