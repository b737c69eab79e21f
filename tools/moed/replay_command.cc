// `moed replay`: what dispatching a routing trace would cost, without moving a token
// (moed/replay.h): load per expert and per rank, dropped tokens, the rank-to-rank traffic
// matrix, network bytes of a flat all-to-all against Flex's two hops, a predicted dispatch
// time for both, and two pictures (traffic.svg, expert_load.svg; PNG beside them where a
// converter is installed).
//
//   moed replay --trace topk_idx.npy --experts 256 --ranks 16 --ranks-per-node 8 --out replay/
//   moed replay --trace megatron_traces/ --step 3 --experts 64 --ranks-per-node 4 --out replay/
//
// A Megatron-Core trace directory (router_trace_rank*.jsonl) replays every selected layer call
// of one step as a step of its own; the sums cover the step's layers, and two more pictures show
// them one by one (layer_load.svg: layers x experts; layer_traffic.svg: layers x ranks).
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "cli/registry.h"
#include "moed/plan.h"
#include "moed/replay.h"
#include "tools/moed/trace_input.h"

namespace moed::cli::replay_command {
namespace {

struct ReplayArgs {
  std::string trace, out;
  ReplayOptions options;
  std::optional<int> ranks;  // default: a Megatron trace's ranks, else 1
  TraceArgs trace_args;
  std::optional<double> capacity_factor;
  std::string drop_policy = "position";
  std::string cluster;  // a plan preset: the time comes from moed/plan.h's model
  bool json = false;
};

[[noreturn]] void fail(const Status& s) { fail_command("moed replay", s.message()); }

// A Megatron step: each layer call replayed alone, for the per-layer pictures and table.
std::vector<LayerReplay> replay_layers(const LoadedTrace& loaded, const ReplayOptions& options,
                                       int num_experts) {
  std::vector<LayerReplay> layers;
  if (!loaded.megatron) return layers;
  const RoutingTrace& trace = loaded.routing;
  ReplayOptions one = options;
  one.num_experts = num_experts;
  const size_t per_call = size_t(trace.num_tokens) * size_t(trace.num_topk);
  for (size_t i = 0; i < loaded.megatron->calls.size(); ++i) {
    RoutingTrace t;
    t.name = trace.name;
    t.num_tokens = trace.num_tokens;
    t.num_topk = trace.num_topk;
    t.topk_idx.assign(trace.topk_idx.begin() + i * per_call,
                      trace.topk_idx.begin() + (i + 1) * per_call);
    StatusOr<ReplayResult> lr = replay_trace(t, one);
    if (!lr.ok()) fail(lr.status());
    layers.push_back({loaded.megatron->calls[i].label(), std::move(*lr)});
  }
  return layers;
}

// The cluster model on the same trace, every step (a capacity factor is not applied: the
// model sees the routing as the router chose it).
TracePlans plan_steps(const Cluster& cluster, const RoutingTrace& trace, const ReplayResult& r) {
  PlanOptions o;
  o.cluster = cluster;
  o.ep = r.num_ranks;
  o.ranks_per_node = r.ranks_per_node;
  o.hidden = r.hidden;
  o.experts = r.num_experts;
  o.fp8_dispatch = r.dtype_bytes == 1;
  o.routing = PlanRouting::kTrace;
  o.trace = &trace;
  StatusOr<TracePlans> plans = plan_trace_steps(o);
  if (!plans.ok()) fail(plans.status());
  return std::move(*plans);
}

// The replay's pictures and, for a Megatron step, the per-layer ones: SVGs first, then PNGs,
// as write_replay_pictures lists them.
ReplayPictures write_pictures(const ReplayResult& r, const std::vector<LayerReplay>& layers,
                              const std::string& out) {
  StatusOr<ReplayPictures> pictures = write_replay_pictures(r, out);
  if (!pictures.ok()) fail(pictures.status());
  if (layers.empty()) return *pictures;
  StatusOr<ReplayPictures> more = write_layer_pictures(layers, out);
  if (!more.ok()) fail(more.status());
  std::vector<std::string> files;
  for (const char* ext : {".svg", ".png"}) {
    for (const auto* p : {&*pictures, &*more}) {
      for (const std::string& f : p->files) {
        if (f.ends_with(ext)) files.push_back(f);
      }
    }
  }
  pictures->files = files;
  if (more->converter.empty()) pictures->converter.clear();
  return *pictures;
}

void print_json(const ReplayResult& r, const LoadedTrace& loaded,
                const std::vector<LayerReplay>& layers, const std::optional<TracePlans>& plans) {
  nlohmann::json j = nlohmann::json::parse(replay_json(r));
  if (loaded.megatron) {
    j["megatron"]["step"] = loaded.megatron->step;
    j["megatron"]["num_ranks"] = loaded.megatron->num_ranks;
    for (const LayerReplay& l : layers) {
      j["megatron"]["layers"].push_back({{"label", l.label},
                                         {"tokens_per_expert", l.result.tokens_per_expert},
                                         {"rows_per_rank", l.result.rows_per_rank},
                                         {"expert_imbalance", l.result.expert_imbalance},
                                         {"rank_imbalance", l.result.rank_imbalance},
                                         {"flex_network_bytes", l.result.flex.network_bytes}});
    }
  }
  if (plans) {
    j["plan"] = nlohmann::json::parse(plan_json(plans->steps.front()));
    j["plan"]["steps"] = plans->steps.size();
    j["plan"]["dispatch_seconds"] = plans->dispatch_s;
    j["plan"]["combine_seconds"] = plans->combine_s;
  }
  std::printf("%s\n", j.dump(2).c_str());
}

void print_tables(const ReplayResult& r, const LoadedTrace& loaded,
                  const std::vector<LayerReplay>& layers, const std::optional<TracePlans>& plans,
                  const ReplayPictures& pictures) {
  std::fputs(replay_table(r).c_str(), stdout);
  if (!layers.empty()) {
    std::printf("\nMegatron trace %s, step %lld, %d ranks: per layer call\n",
                loaded.megatron->dir.c_str(), (long long)loaded.megatron->step,
                loaded.megatron->num_ranks);
    std::printf("  %-28s %12s %12s %16s\n", "layer", "expert max/mean", "rank max/mean",
                "Flex net MB max");
    for (const LayerReplay& l : layers) {
      const std::vector<int64_t>& net = l.result.flex.network_bytes;
      std::printf("  %-28s %12.2f %12.2f %16.3f\n", l.label.c_str(), l.result.expert_imbalance,
                  l.result.rank_imbalance, double(*std::max_element(net.begin(), net.end())) / 1e6);
    }
  }
  if (plans) {
    const size_t n = plans->steps.size();
    std::printf("\n%s", plan_table(plans->steps.front()).c_str());
    std::printf("over %zu step%s: normal (flex) dispatch %.1f us, combine %.1f us\n", n,
                n == 1 ? "" : "s", plans->dispatch_s * 1e6, plans->combine_s * 1e6);
  }
  std::printf("\npictures:");
  for (const std::string& f : pictures.files) std::printf(" %s", f.c_str());
  std::printf("\n  %s\n", pictures.converter.empty()
                              ? "(no PNG: neither rsvg-convert nor ImageMagick's convert could "
                                "convert the SVGs)"
                              : ("(PNG by " + pictures.converter + ")").c_str());
}

void run(ReplayArgs a) {
  if (a.drop_policy == "probs") {
    fail(
        invalid_argument("--drop-policy probs: a trace has no probs (only expert indices); "
                         "replay drops by position"));
  }
  StatusOr<DropPolicy> policy = parse_drop_policy(a.drop_policy);
  if (!policy.ok()) fail(policy.status());
  a.options.drop_policy = *policy;
  a.options.capacity_factor = a.capacity_factor;
  std::optional<Cluster> cluster;
  if (!a.cluster.empty()) {
    StatusOr<Cluster> c = cluster_preset(a.cluster);
    if (!c.ok()) fail(c.status());
    cluster = *c;
    // The replay's own two-bandwidth figure uses the preset's links too.
    a.options.shared_gbps = c->nvl_gbps;
    a.options.network_gbps = c->net_gbps;
  }
  StatusOr<LoadedTrace> loaded = a.trace_args.load(a.trace, a.options.num_experts, false);
  if (!loaded.ok()) fail(loaded.status());
  a.options.num_ranks = a.ranks.value_or(loaded->megatron ? loaded->megatron->num_ranks : 1);
  StatusOr<ReplayResult> r = replay_trace(loaded->routing, a.options);
  if (!r.ok()) fail(r.status());
  const std::vector<LayerReplay> layers = replay_layers(*loaded, a.options, r->num_experts);
  std::optional<TracePlans> plans;
  if (cluster) plans = plan_steps(*cluster, loaded->routing, *r);
  const ReplayPictures pictures = write_pictures(*r, layers, a.out);
  if (a.json) {
    print_json(*r, *loaded, layers, plans);
  } else {
    print_tables(*r, *loaded, layers, plans, pictures);
  }
}

void setup(CLI::App& app) {
  auto a = std::make_shared<ReplayArgs>();
  CLI::App* c = app.add_subcommand(
      "replay",
      "replay a top-k routing trace: load, drops, rank-to-rank traffic, flat vs Flex "
      "network bytes and predicted time, with SVG pictures");
  c->add_option("--trace", a->trace,
                "top-k indices [T, K] or [steps, T, K] .npy (-1 = none), or a directory of "
                "Megatron-Core router_trace_rank*.jsonl files")
      ->required();
  a->trace_args.add_options(c);
  c->add_option("--out", a->out, "directory for traffic.svg and expert_load.svg")->required();
  c->add_option("--experts", a->options.num_experts, "experts E (default: max index + 1)");
  c->add_option("--ranks", a->ranks,
                "ranks R (tokens split evenly; default: a Megatron trace's ranks, else 1)");
  c->add_option("--ranks-per-node", a->options.ranks_per_node, "G ranks per node (0 = R)")
      ->capture_default_str();
  c->add_option("--capacity-factor", a->capacity_factor,
                "drop tokens above C = ceil(T_s * K / E * cf) per source rank and expert");
  c->add_option("--drop-policy", a->drop_policy, "position (a trace has no probs)")
      ->capture_default_str();
  c->add_option("--hidden", a->options.hidden, "hidden size H")->capture_default_str();
  c->add_option("--dtype-bytes", a->options.dtype_bytes, "bytes per element of the payload")
      ->capture_default_str();
  c->add_option("--shared-gbps", a->options.shared_gbps, "node-shared memory GB/s per rank")
      ->capture_default_str();
  c->add_option("--network-gbps", a->options.network_gbps, "network GB/s per rank")
      ->capture_default_str();
  c->add_option("--cluster", a->cluster,
                "also predict GPU time with moed plan's model for this preset (h800, h100, ...)");
  c->add_flag("--json", a->json, "print the result as JSON instead of the table");
  c->callback([a] { run(*a); });
}

}  // namespace

MOED_CLI_COMMAND("", setup);

}  // namespace moed::cli::replay_command
