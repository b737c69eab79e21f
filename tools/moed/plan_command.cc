// `moed plan`: predicted dispatch and combine time on a GPU cluster from the explicit cost
// model (moed/plan.h), and `moed plan --validate`: the model beside published tables.
//
//   moed plan --cluster h800 --ep 64 --ranks-per-node 8 --tokens 4096 --hidden 7168 --topk 8
//             --experts 256 --routing group
//   moed plan --validate [--markdown]
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "moed/plan.h"
#include "tools/moed/registry.h"

namespace moed::cli {
namespace {

struct PlanArgs {
  std::string cluster = "h800", mode = "normal", dtype = "fp8", routing = "uniform", trace;
  std::optional<double> nvl_gbps, net_gbps, hbm_gbps, nvl_latency_us, net_latency_us, fixed_us;
  PlanOptions options;
  bool json = false, validate = false, markdown = false;
};

[[noreturn]] void fail(const Status& s) { fail_command("moed plan", s.message()); }

void run(PlanArgs a) {
  if (a.validate) {
    StatusOr<std::vector<ValidationRow>> rows = validate_plan();
    if (!rows.ok()) fail(rows.status());
    std::fputs(validation_table(*rows, a.markdown).c_str(), stdout);
    return;
  }
  PlanOptions& o = a.options;
  StatusOr<Cluster> c = cluster_preset(a.cluster);
  if (!c.ok()) fail(c.status());
  o.cluster = *c;
  // User overrides of single numbers; the rest of the preset stays.
  if (a.nvl_gbps) o.cluster.nvl_gbps = *a.nvl_gbps;
  if (a.net_gbps) o.cluster.net_gbps = *a.net_gbps;
  if (a.hbm_gbps) o.cluster.hbm_gbps = *a.hbm_gbps;
  if (a.nvl_latency_us) o.cluster.nvl_latency_us = *a.nvl_latency_us;
  if (a.net_latency_us) o.cluster.net_latency_us = *a.net_latency_us;
  if (a.fixed_us) o.cluster.fixed_us = *a.fixed_us;
  if (a.mode != "normal" && a.mode != "low-latency") {
    fail(invalid_argument("--mode '", a.mode, "' is not one of normal, low-latency"));
  }
  o.low_latency = a.mode == "low-latency";
  if (a.dtype != "fp8" && a.dtype != "bf16") {
    fail(invalid_argument("--dispatch-dtype '", a.dtype, "' is not one of fp8, bf16"));
  }
  o.fp8_dispatch = a.dtype == "fp8";
  RoutingTrace trace;
  if (!a.trace.empty()) {
    StatusOr<RoutingTrace> t = read_routing_trace(a.trace);
    if (!t.ok()) fail(t.status());
    trace = std::move(*t);
    o.trace = &trace;
    o.routing = PlanRouting::kTrace;
  } else {
    StatusOr<PlanRouting> r = parse_plan_routing(a.routing);
    if (!r.ok() || *r == PlanRouting::kTrace) {
      fail(invalid_argument("--routing '", a.routing, "' is not one of uniform, zipf, group"));
    }
    o.routing = *r;
  }
  StatusOr<PlanResult> r = plan(o);
  if (!r.ok()) fail(r.status());
  if (a.json) {
    std::printf("%s\n", plan_json(*r).c_str());
  } else {
    std::fputs(plan_table(*r).c_str(), stdout);
  }
}

void setup(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  CLI::App* c =
      app.add_subcommand("plan",
                         "predict dispatch / combine time on a GPU cluster (explicit cost model); "
                         "--validate compares it with published tables");
  std::string presets;
  for (const std::string& n : cluster_preset_names()) presets += (presets.empty() ? "" : ", ") + n;
  c->add_option("--cluster", a->cluster, "hardware preset: " + presets)->capture_default_str();
  c->add_option("--ep", a->options.ep, "EP size R (ranks), up to 2048")->capture_default_str();
  c->add_option("--ranks-per-node", a->options.ranks_per_node, "G ranks per node")
      ->capture_default_str();
  c->add_option("--tokens", a->options.tokens, "tokens per rank T (with --trace: its tokens / R)")
      ->capture_default_str();
  c->add_option("--hidden", a->options.hidden, "hidden size H")->capture_default_str();
  c->add_option("--topk", a->options.topk, "experts per token K")->capture_default_str();
  c->add_option("--experts", a->options.experts, "experts E (a multiple of R)")
      ->capture_default_str();
  c->add_option("--mode", a->mode, "normal | low-latency")->capture_default_str();
  c->add_option("--dispatch-dtype", a->dtype, "fp8 | bf16 (combine is bf16)")
      ->capture_default_str();
  c->add_option("--routing", a->routing, "uniform | zipf | group (generated routing)")
      ->capture_default_str();
  c->add_option("--trace", a->trace, "top-k indices .npy (step 0, T * R tokens) instead");
  c->add_option("--zipf-s", a->options.zipf_s, "zipf exponent s")->capture_default_str();
  c->add_option("--groups", a->options.num_groups, "group routing: groups (0 = nodes)")
      ->capture_default_str();
  c->add_option("--group-topk", a->options.group_topk,
                "group routing: groups kept (0 = min(groups, 4))")
      ->capture_default_str();
  c->add_option("--seed", a->options.seed, "seed of the generated routing")->capture_default_str();
  c->add_option("--nvl-gbps", a->nvl_gbps, "override: intra-node GB/s per GPU, one direction");
  c->add_option("--net-gbps", a->net_gbps, "override: network GB/s per GPU");
  c->add_option("--hbm-gbps", a->hbm_gbps, "override: memory GB/s per GPU");
  c->add_option("--nvl-latency-us", a->nvl_latency_us, "override: intra-node hop latency");
  c->add_option("--net-latency-us", a->net_latency_us, "override: network hop latency");
  c->add_option("--fixed-us", a->fixed_us, "override: fixed cost per call");
  c->add_flag("--json", a->json, "print one JSON object");
  c->add_flag("--validate", a->validate, "print the model beside DeepEP's and UCCL-EP's tables");
  c->add_flag("--markdown", a->markdown, "with --validate: a Markdown table");
  c->callback([a] { run(*a); });
}

}  // namespace

MOED_CLI_COMMAND("", setup);

}  // namespace moed::cli
