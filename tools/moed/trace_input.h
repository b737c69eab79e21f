// The routing-trace input shared by `moed replay`, `moed plan` and `moed dispatch`: a .npy of
// top-k indices, or a directory of Megatron-Core's per-rank JSONL traces (moed/megatron_trace.h)
// with the options that choose its step, block and layer; and the plan model on each of its
// steps (`moed plan --trace`, `moed replay --cluster`).
//
//   TraceArgs t;
//   t.add_options(cmd);                 // --step --block --mtp --layer --microbatch
//   ... later, after parsing:
//   StatusOr<LoadedTrace> l = t.load(path, /*num_experts=*/E, /*hidden_states=*/false);
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <vector>

#include "moed/megatron_trace.h"
#include "moed/plan.h"
#include "moed/replay.h"

namespace moed::cli {

struct LoadedTrace {
  RoutingTrace routing;                 // one step per .npy step or per Megatron router call
  std::optional<MegatronTrace> megatron;  // set for a Megatron directory
};

struct TraceArgs {
  MegatronTraceSelection selection;

  // The selection options, described for a Megatron trace directory.
  void add_options(CLI::App* c);
  // Reads `path`: a Megatron directory when it holds router_trace_rank0.jsonl, else a .npy.
  // The selection options with a .npy are an error naming them.
  StatusOr<LoadedTrace> load(const std::string& path, int num_experts, bool hidden_states) const;
};

// The plan model on each step of `o.trace` (a .npy's steps, a Megatron step's layer calls),
// each planned alone, or once on o's generated routing when it has no trace.
struct TracePlans {
  std::vector<PlanResult> steps;
  double dispatch_s = 0.0, combine_s = 0.0;  // summed over the steps, in order
};
StatusOr<TracePlans> plan_trace_steps(PlanOptions o);

}  // namespace moed::cli
