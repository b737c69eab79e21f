// `moed replay`: what dispatching a routing trace would cost, without moving a token
// (moed/replay.h): load per expert and per rank, dropped tokens, the rank-to-rank traffic
// matrix, network bytes of a flat all-to-all against Flex's two hops, a predicted dispatch
// time for both, and two pictures (traffic.svg, expert_load.svg; PNG beside them where a
// converter is installed).
//
//   moed replay --trace topk_idx.npy --experts 256 --ranks 16 --ranks-per-node 8 --out replay/
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "moed/replay.h"
#include "tools/moed/registry.h"

namespace moed::cli {
namespace {

struct ReplayArgs {
  std::string trace, out;
  ReplayOptions options;
  std::optional<double> capacity_factor;
  std::string drop_policy = "position";
  bool json = false;
};

[[noreturn]] void fail(const Status& s) {
  std::fprintf(stderr, "moed replay: %s\n", s.message().c_str());
  throw CLI::RuntimeError(1);
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
  StatusOr<RoutingTrace> trace = read_routing_trace(a.trace);
  if (!trace.ok()) fail(trace.status());
  StatusOr<ReplayResult> r = replay_trace(*trace, a.options);
  if (!r.ok()) fail(r.status());
  StatusOr<ReplayPictures> pictures = write_replay_pictures(*r, a.out);
  if (!pictures.ok()) fail(pictures.status());
  if (a.json) {
    std::printf("%s\n", replay_json(*r).c_str());
    return;
  }
  std::fputs(replay_table(*r).c_str(), stdout);
  std::printf("\npictures:");
  for (const std::string& f : pictures->files) std::printf(" %s", f.c_str());
  std::printf("\n  %s\n", pictures->converter.empty()
                              ? "(no PNG: neither rsvg-convert nor ImageMagick's convert could "
                                "convert the SVGs)"
                              : ("(PNG by " + pictures->converter + ")").c_str());
}

void setup(CLI::App& app) {
  auto a = std::make_shared<ReplayArgs>();
  CLI::App* c = app.add_subcommand(
      "replay",
      "replay a top-k routing trace: load, drops, rank-to-rank traffic, flat vs Flex "
      "network bytes and predicted time, with SVG pictures");
  c->add_option("--trace", a->trace, "top-k indices [T, K] or [steps, T, K] .npy, -1 = none")
      ->required();
  c->add_option("--out", a->out, "directory for traffic.svg and expert_load.svg")->required();
  c->add_option("--experts", a->options.num_experts, "experts E (default: max index + 1)");
  c->add_option("--ranks", a->options.num_ranks, "ranks R (tokens split evenly)")
      ->capture_default_str();
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
  c->add_flag("--json", a->json, "print the result as JSON instead of the table");
  c->callback([a] { run(*a); });
}

}  // namespace

MOED_CLI_COMMAND("", setup);

}  // namespace moed::cli
