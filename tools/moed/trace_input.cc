// The routing-trace input of `moed replay`, `moed plan` and `moed dispatch`, and the plan model
// on its steps (trace_input.h).
#include "tools/moed/trace_input.h"

#include <filesystem>

namespace moed::cli {

void TraceArgs::add_options(CLI::App* c) {
  MegatronTraceSelection& s = selection;
  c->add_option("--step", s.step, "Megatron trace: the step (default: the first in rank 0's file)");
  c->add_option("--block", s.block, "Megatron trace: decoder | mtp")->capture_default_str();
  c->add_option("--mtp", s.mtp_idx, "Megatron trace, block mtp: the head (default: every head)");
  c->add_option("--layer", s.layer, "Megatron trace: the layer (default: every layer of the step)");
  c->add_option("--microbatch", s.microbatch,
                "Megatron trace: the n-th router call of a layer in the step (default: every one)");
}

StatusOr<LoadedTrace> TraceArgs::load(const std::string& path, int num_experts,
                                      bool hidden_states) const {
  LoadedTrace out;
  // A directory is a Megatron trace (its reader says what is wrong with it); a file a .npy.
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec)) {
    const MegatronTraceSelection& s = selection;
    const char* given = s.step         ? "--step"
                        : s.mtp_idx    ? "--mtp"
                        : s.layer      ? "--layer"
                        : s.microbatch ? "--microbatch"
                        : s.block != "decoder" ? "--block"
                                               : nullptr;
    if (given != nullptr) {
      return invalid_argument(given, " chooses from a Megatron trace directory (router_trace_rank*",
                              ".jsonl), but ", path, " is not one");
    }
    MOED_ASSIGN_OR_RETURN(out.routing, read_routing_trace(path));
    return out;
  }
  MegatronTraceSelection s = selection;
  s.num_experts = num_experts;
  s.load_hidden_states = hidden_states;
  MOED_ASSIGN_OR_RETURN(MegatronTrace t, read_megatron_trace(path, s));
  MOED_ASSIGN_OR_RETURN(out.routing, megatron_routing_trace(t));
  out.megatron = std::move(t);
  return out;
}

StatusOr<TracePlans> plan_trace_steps(PlanOptions o) {
  TracePlans plans;
  const int64_t steps = o.trace ? o.trace->num_steps : 1;
  for (int64_t st = 0; st < steps; ++st) {
    o.trace_step = st;
    MOED_ASSIGN_OR_RETURN(PlanResult p, plan(o));
    plans.dispatch_s += p.dispatch_seconds;
    plans.combine_s += p.combine_seconds;
    plans.steps.push_back(std::move(p));
  }
  return plans;
}

}  // namespace moed::cli
