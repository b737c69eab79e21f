// `moed plan --validate`: the model beside every published row (published.cc), each at the
// source's own settings, with the hardware's preset and the design's parameters.
#include <algorithm>
#include <string>

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

StatusOr<std::vector<ValidationRow>> validate_plan(const std::string& cluster, int64_t tokens,
                                                   int ep) {
  std::vector<ValidationRow> out;
  for (const published::Setting& p : published::settings()) {
    if ((!cluster.empty() && cluster != p.cluster) || (tokens >= 0 && tokens != p.tokens) ||
        (ep >= 0 && ep != p.ep)) {
      continue;
    }
    MOED_ASSIGN_OR_RETURN(const published::Design d, find_design(p.design));
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
    MOED_ASSIGN_OR_RETURN(PlanResult r, plan(o));
    append_rows(p, d, r.num_nodes, &r, out);
  }
  return out;
}

}  // namespace moed
