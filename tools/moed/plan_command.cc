// `moed plan`: predicted dispatch and combine time on a GPU cluster from the explicit cost
// model (moed/plan.h), and `moed plan --validate`: the model beside published tables.
//
//   moed plan --cluster h800 --ep 64 --ranks-per-node 8 --tokens 4096 --hidden 7168 --topk 8
//             --experts 256 --routing group
//   moed plan --validate [--markdown]
//   moed plan --cluster h800 --tokens 4096 --routing group --sweep ep=8,16,32,64,128,256 --out d/
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "cli/registry.h"
#include "moed/plan.h"
#include "replay/svg.h"
#include "tools/moed/trace_input.h"

namespace moed::cli::plan_command {
namespace {

struct PlanArgs {
  std::string cluster = "h800", mode = "normal", dtype = "fp8", routing = "uniform", trace;
  std::optional<double> nvl_gbps, net_gbps, hbm_gbps, nvl_latency_us, net_latency_us, fixed_us;
  PlanOptions options;
  std::optional<int> ep;  // default: a Megatron trace's ranks, else 8
  TraceArgs trace_args;
  std::string sweep, metric = "us", out;
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
  if (!a.sweep.empty()) {
    if (a.metric != "gbps" && a.metric != "us") {
      fail(invalid_argument("--sweep-metric '", a.metric, "' is not one of gbps, us"));
    }
    if (!a.trace.empty()) fail(invalid_argument("--sweep generates its routing; drop --trace"));
    StatusOr<PlanRouting> r = parse_plan_routing(a.routing);
    if (!r.ok()) fail(r.status());
    o.routing = *r;
    o.ep = a.ep.value_or(8);
    StatusOr<SweepResult> sw = plan_sweep(o, a.sweep);
    if (!sw.ok()) fail(sw.status());
    const bool gbps = a.metric == "gbps";
    std::fputs(sweep_table(*sw, gbps).c_str(), stdout);
    if (!a.out.empty()) {
      StatusOr<ReplayPictures> pics = svg::write_pictures(a.out, {{"sweep", sweep_svg(*sw, gbps)}});
      if (!pics.ok()) fail(pics.status());
      std::printf("\npicture:");
      for (const std::string& f : pics->files) std::printf(" %s", f.c_str());
      std::printf("\n");
    }
    return;
  }
  std::optional<LoadedTrace> trace;
  o.ep = a.ep.value_or(8);
  if (!a.trace.empty()) {
    StatusOr<LoadedTrace> t = a.trace_args.load(a.trace, o.experts, false);
    if (!t.ok()) fail(t.status());
    trace = std::move(*t);
    if (trace->megatron && !a.ep) o.ep = trace->megatron->num_ranks;
    o.trace = &trace->routing;
    o.routing = PlanRouting::kTrace;
  } else {
    StatusOr<PlanRouting> r = parse_plan_routing(a.routing);
    if (!r.ok() || *r == PlanRouting::kTrace) {
      fail(invalid_argument("--routing '", a.routing, "' is not one of uniform, zipf, group"));
    }
    o.routing = *r;
  }
  // A trace with several steps (a Megatron step's layer calls): each planned, then summed.
  StatusOr<TracePlans> plans = plan_trace_steps(o);
  if (!plans.ok()) fail(plans.status());
  const std::vector<PlanResult>& results = plans->steps;
  const int64_t calls = int64_t(results.size());
  auto label = [&](int64_t st) {
    return trace && trace->megatron ? trace->megatron->calls[size_t(st)].label()
                                    : "step " + std::to_string(st);
  };
  if (a.json) {
    if (calls == 1) {
      std::printf("%s\n", plan_json(results.front()).c_str());
      return;
    }
    nlohmann::json j;
    for (int64_t st = 0; st < calls; ++st) {
      nlohmann::json one = nlohmann::json::parse(plan_json(results[size_t(st)]));
      one["label"] = label(st);
      j["calls"].push_back(one);
    }
    j["dispatch_seconds"] = plans->dispatch_s;
    j["combine_seconds"] = plans->combine_s;
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::fputs(plan_table(results.front()).c_str(), stdout);
  if (calls > 1) {
    std::printf("\n%zu router calls (%s):\n  %-28s %12s %12s\n", size_t(calls), a.trace.c_str(),
                "call", "disp us", "comb us");
    for (int64_t st = 0; st < calls; ++st) {
      const PlanResult& r = results[size_t(st)];
      std::printf("  %-28s %12.1f %12.1f\n", label(st).c_str(), r.dispatch_seconds * 1e6,
                  r.combine_seconds * 1e6);
    }
    std::printf("  %-28s %12.1f %12.1f\n", "sum", plans->dispatch_s * 1e6, plans->combine_s * 1e6);
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
  c->add_option("--ep", a->ep, "EP size R (ranks), up to 2048 (default: a Megatron trace's ranks, else 8)");
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
  c->add_option("--trace", a->trace,
                "routing from a top-k indices .npy (each step planned, T * R tokens) or a "
                "Megatron-Core trace directory (each selected layer call planned)");
  a->trace_args.add_options(c);
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
  c->add_option("--algorithm", a->options.algorithm,
                "the reported algorithm: flat | alltoall | flex | low-latency | pplx (default: flex, "
                "or low-latency with --mode low-latency)");
  c->add_flag("--cpu-proxy", a->options.cpu_proxy,
              "network messages posted by CPU proxy threads (UCCL-EP, pplx-garden): each pays the "
              "cluster's per-message cost");
  c->add_option("--sweep", a->sweep,
                "ep=8,16,... or tokens=128,4096,...: every algorithm over that range (table; "
                "with --out, sweep.svg)");
  c->add_option("--sweep-metric", a->metric, "with --sweep: gbps | us")->capture_default_str();
  c->add_option("--out", a->out, "with --sweep: directory for sweep.svg (and sweep.png)");
  c->add_flag("--json", a->json, "print one JSON object");
  c->add_flag("--validate", a->validate,
              "print the model beside every published table (DeepEP, HybridEP, NCCL EP, UCCL-EP, "
              "pplx, MORI, Triton-distributed)");
  c->add_flag("--markdown", a->markdown, "with --validate: a Markdown table");
  c->callback([a] { run(*a); });
}

}  // namespace

MOED_CLI_COMMAND("", setup);

}  // namespace moed::cli::plan_command
