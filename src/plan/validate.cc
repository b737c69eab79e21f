// `moed plan --validate`: the model beside every published row (published.cc), each at the
// source's own settings, with the hardware's preset and the design's parameters.
#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "moed/plan.h"
#include "plan/published.h"

namespace moed {

namespace {

StatusOr<published::Design> find_design(const std::string& key) {
  for (const published::Design& d : published::designs()) {
    if (key == d.key) return d;
  }
  return internal_error("published row names design '", key, "', which is not in kDesigns");
}

}  // namespace

std::vector<PublishedSource> published_sources() {
  const auto s = published::sources();
  return {s.begin(), s.end()};
}

namespace {

// The rows of one setting, published figures only; `r` fills the model's side when given.
void append_rows(const published::Setting& p, const published::Design& d, int num_nodes,
                 const PlanResult* r, std::vector<ValidationRow>& out) {
  // NOTE: kept apart from the model run so the rows' fields read the same with and without it.
  for (int phase = 0; phase < 2; ++phase) {
    const double gbps = phase == 0 ? p.dispatch_gbps : p.combine_gbps;
    const double us = phase == 0 ? p.dispatch_us : p.combine_us;
    if (gbps <= 0 && us <= 0) continue;
    ValidationRow v;
    v.source = p.source;
    v.table = p.table;
    v.design = p.design;
    v.cluster = p.cluster;
    const std::string algorithm = d.algorithm;
    const bool ll = algorithm == "low-latency" || algorithm == "pplx";
    v.mode = ll ? "low-latency" : (num_nodes > 1 ? "internode" : "intranode");
    v.phase = phase == 0 ? "dispatch" : "combine";
    v.ep = p.ep;
    v.tokens = p.tokens;
    v.dtype = phase == 0 ? (p.fp8 ? "fp8" : "bf16") : "bf16";
    v.published_gbps = gbps;
    v.published_us = us;
    v.note = phase == 0 ? p.dispatch_note : p.combine_note;
    if (r != nullptr) {
      v.predicted_gbps = phase == 0 ? r->dispatch_gbps : r->combine_gbps;
      v.predicted_us = 1e6 * (phase == 0 ? r->dispatch_seconds : r->combine_seconds);
      v.ratio = gbps > 0 ? v.predicted_gbps / gbps : us / v.predicted_us;
      const double bytes = double(phase == 0 ? r->published.dispatch : r->published.combine);
      v.implied_us = us > 0 ? us : 1e6 * bytes / (gbps * 1e9);
    }
    out.push_back(std::move(v));
  }
}

}  // namespace

StatusOr<std::vector<ValidationRow>> validate_plan() { return validate_plan("", -1, -1); }

namespace {

// The model's options for one published setting: the source's own settings, the hardware's
// preset and the design's parameters.
StatusOr<PlanOptions> setting_options(const published::Setting& p, const published::Design& d) {
  PlanOptions o;
  MOED_ASSIGN_OR_RETURN(o.cluster, cluster_preset(p.cluster));
  o.ep = p.ep;
  // A design that keeps NVLink out treats every rank as a node of its own; a domain larger
  // than the EP group (GB200's 72) holds the whole group.
  o.ranks_per_node = d.nvlink ? std::min(o.cluster.ranks_per_node, p.ep) : 1;
  o.tokens = p.tokens;
  o.hidden = 7168;
  o.topk = 8;
  o.experts = p.experts;
  o.algorithm = d.algorithm;
  o.low_latency = o.algorithm == "low-latency";
  o.cpu_proxy = d.cpu_proxy;
  o.convention = d.convention;
  o.fp8_dispatch = p.fp8;
  // DeepEP's tests route group-limited with one group per node, top min(nodes, 4) groups
  // ("top-4 groups"); the others route uniformly.
  o.routing = p.group_routing ? PlanRouting::kGroup : PlanRouting::kUniform;
  o.sms = p.sms;
  o.sm_dispatch_gbps = p.fp8 ? d.sm_fp8_gbps : d.sm_bf16_gbps;
  o.sm_combine_gbps = d.sm_combine_gbps;
  return o;
}

// What a setting's routing depends on (group-limited gating's groups follow the node size).
using RoutingKey = std::tuple<int, int, int64_t, int, int, PlanRouting>;
RoutingKey routing_key(const PlanOptions& o) {
  return {o.ep,     o.routing == PlanRouting::kGroup ? o.ranks_per_node : 0,
          o.tokens, o.experts,
          o.topk,   o.routing};
}

// Every rank's routing of `o`, as a one-step trace (plan_routing reads a trace back as it
// would have made the routing).
StatusOr<RoutingTrace> routing_trace(const PlanOptions& o) {
  RoutingTrace t;
  t.name = "a published setting's routing";
  t.num_tokens = o.tokens * o.ep;
  t.num_topk = o.topk;
  t.topk_idx.reserve(size_t(t.num_tokens) * size_t(o.topk));
  for (int s = 0; s < o.ep; ++s) {
    MOED_ASSIGN_OR_RETURN(std::vector<int32_t> idx, plan_routing(o, s));
    t.topk_idx.insert(t.topk_idx.end(), idx.begin(), idx.end());
  }
  return t;
}

}  // namespace

StatusOr<std::vector<ValidationRow>> validate_plan(const std::string& cluster, int64_t tokens,
                                                   int ep) {
  struct Run {
    const published::Setting* setting;
    published::Design design;
    PlanOptions options;
    std::optional<PlanResult> result;
  };
  std::vector<Run> runs;
  for (const published::Setting& p : published::settings()) {
    if ((!cluster.empty() && cluster != p.cluster) || (tokens >= 0 && tokens != p.tokens) ||
        (ep >= 0 && ep != p.ep)) {
      continue;
    }
    MOED_ASSIGN_OR_RETURN(const published::Design d, find_design(p.design));
    MOED_ASSIGN_OR_RETURN(PlanOptions o, setting_options(p, d));
    runs.push_back({&p, d, std::move(o), std::nullopt});
  }
  // NOTE: making routings is most of the model's time, and the settings route far fewer ways
  // than there are settings (126 settings, 30 routings): each routing is made once and every
  // setting that shares it reads it as a trace.
  std::map<RoutingKey, std::vector<Run*>> by_routing;
  for (Run& run : runs) by_routing[routing_key(run.options)].push_back(&run);
  for (const auto& [key, group] : by_routing) {
    MOED_ASSIGN_OR_RETURN(const RoutingTrace trace, routing_trace(group.front()->options));
    for (Run* run : group) {
      PlanOptions o = run->options;
      o.routing = PlanRouting::kTrace;
      o.trace = &trace;
      o.trace_step = 0;
      MOED_ASSIGN_OR_RETURN(run->result, plan(o));
      run->result->options.trace = nullptr;  // the trace goes with this group
    }
  }
  std::vector<ValidationRow> out;
  for (const Run& run : runs) {
    append_rows(*run.setting, run.design, run.result->num_nodes, &*run.result, out);
  }
  return out;
}

}  // namespace moed
