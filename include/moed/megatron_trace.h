// Megatron-Core's routing traces as input to replay, plan and dispatch.
//
// Megatron-Core's RouterTracer (megatron/core/transformer/moe/router_trace.py, enabled with
// --moe-routing-trace-path) writes one JSONL file per rank, `router_trace_rank{r}.jsonl`, one
// record per router call:
//   {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0,
//    "num_tokens": 128, "topk": 8, "top_indices": [[12, 45, ...], ...]}
// MTP layers carry "mtp_idx" too ("block": "mtp"). With capture_hidden_states the router's input
// rows go to `hidden_states_rank{r}.bin`, bf16 [num_tokens, hidden] row-major, as the raw
// little-endian int16 bit patterns torch writes (`hs.view(torch.int16).numpy().tobytes()`), and
// the record gains "hs_offset", "hs_bytes" (num_tokens * hidden * 2) and "hs_shape" ([T, H]).
//
// A step's routing is every rank's record for the same (step, block, mtp_idx, layer) joined in
// rank order: rank 0's tokens first. A rank that called the same router more than once in a step
// (micro-batches of one training iteration, or a recomputed forward) has several such records;
// the n-th of each rank form call n (`microbatch` n).
//
//   moed::MegatronTraceSelection sel;
//   sel.step = 3;                       // default: the lowest step in rank 0's file
//   sel.layer = 5;                      // default: every layer of the step
//   sel.num_experts = 256;              // indices are checked against it
//   MOED_ASSIGN_OR_RETURN(moed::MegatronTrace t, moed::read_megatron_trace("traces/", sel));
//   MOED_ASSIGN_OR_RETURN(moed::RoutingTrace r, moed::megatron_routing_trace(t));  // replay_trace
//
// Errors name the file, the line and the value: a rank's file missing, a line that is not a
// complete JSON record (a file cut short), a field of the wrong type, top_indices whose shape
// disagrees with num_tokens / topk or whose value is outside [-1, E), a selected layer absent
// from one rank, ranks that disagree on num_tokens, a sidecar shorter than its records say.
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
