// `moed route`: runs the router (moed::Router, Megatron's TopKRouter) on logits from a .npy
// file and writes its routing and losses as files.
//
//   moed route --logits logits.npy --topk 8 --score-function sigmoid --num-groups 8
//              --group-topk 4 --expert-bias bias.npy --aux-loss-coeff 1e-3 --out routed/
//
// DIR receives the effective routing (after capacity dropping and router padding, as the
// dispatcher needs it):
//   topk_idx.npy    int32   [T, K']  experts ascending, -1 in unused slots (K' = K unless router
//                                    padding gave a token more experts)
//   topk_probs.npy  float32 [T, K']
//   routing_map.npy bool    [T, E]
//   probs.npy       float32 [T, E]   0 where not routed
//   losses.json     aux / seq-aux and z losses (coefficient applied) with their coefficients,
//                   tokens per expert and the number of dropped (token, expert) pairs.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <string>

#include "cli/registry.h"
#include "moed/npy.h"
#include "moed/router.h"

namespace moed::cli::route_command {
namespace {

struct RouteArgs {
  std::string logits;
  std::string out;
  int topk = 0;
  std::string score_function = "softmax";
  bool pre_softmax = false;
  int num_groups = 0;
  int group_topk = 0;
  std::optional<float> scaling_factor;
  std::string expert_bias;
  std::optional<double> capacity_factor;
  std::string drop_policy = "probs";
  int router_padding = 0;
  std::optional<double> aux_loss_coeff;
  std::optional<double> seq_aux_loss_coeff;
  int64_t seq_length = 0;
  std::optional<double> z_loss_coeff;
};

[[noreturn]] void fail(const Status& s) { fail_command("moed route", s.message()); }
template <typename T>
T value_or_fail(StatusOr<T> v) {
  if (!v.ok()) fail(v.status());
  return std::move(v).value();
}

// What the options ask of the router; every check names the option and the value.
RouterConfig make_config(const RouteArgs& a, int num_experts) {
  RouterConfig c;
  c.num_experts = num_experts;
  c.num_topk = a.topk;
  c.score_function = value_or_fail(parse_score_function(a.score_function));
  c.pre_softmax = a.pre_softmax;
  c.num_groups = a.num_groups;
  c.group_topk = a.group_topk;
  c.topk_scaling_factor = a.scaling_factor;
  c.enable_expert_bias = !a.expert_bias.empty();
  if (a.aux_loss_coeff && a.seq_aux_loss_coeff) {
    fail(
        invalid_argument("--aux-loss-coeff and --seq-aux-loss-coeff are exclusive (one load "
                         "balancing loss per router)"));
  }
  if (a.aux_loss_coeff) {
    c.load_balancing = LoadBalancing::kAuxLoss;
    c.aux_loss_coeff = *a.aux_loss_coeff;
  }
  if (a.seq_aux_loss_coeff) {
    if (a.seq_length <= 0) fail(invalid_argument("--seq-aux-loss-coeff needs --seq-length > 0"));
    c.load_balancing = LoadBalancing::kSeqAuxLoss;
    c.aux_loss_coeff = *a.seq_aux_loss_coeff;
    c.seq_length = a.seq_length;
  }
  if (a.z_loss_coeff) c.z_loss_coeff = *a.z_loss_coeff;
  c.layout.capacity_factor = a.capacity_factor;
  c.layout.drop_policy = value_or_fail(parse_drop_policy(a.drop_policy));
  c.layout.router_padding_multiple = a.router_padding;
  if (Status s = c.validate(); !s.ok()) fail(s);
  return c;
}

void write(const std::string& dir, const char* name, NpyDType t,
           std::initializer_list<int64_t> shape, const void* data) {
  const std::string path = (std::filesystem::path(dir) / name).string();
  if (Status s = write_npy(path, t, shape, data); !s.ok()) fail(s);
}

void run(const RouteArgs& a) {
  const NpyArray logits_file = value_or_fail(read_npy(a.logits));
  if (logits_file.shape.size() != 2) {
    fail(invalid_argument(a.logits, ": shape ", logits_file.shape_string(),
                          "; logits are [tokens, experts]"));
  }
  const int64_t T = logits_file.shape[0];
  if (logits_file.shape[1] < 1 || logits_file.shape[1] > (int64_t(1) << 20)) {
    fail(invalid_argument(a.logits, ": shape ", logits_file.shape_string(), " has ",
                          logits_file.shape[1], " experts"));
  }
  const int E = int(logits_file.shape[1]);
  const std::vector<float> logits = value_or_fail(npy_to_f32(logits_file));
  Router router = value_or_fail(Router::create(make_config(a, E)));
  if (!a.expert_bias.empty()) {
    const NpyArray bias_file = value_or_fail(read_npy(a.expert_bias));
    if (bias_file.shape.size() != 1 || bias_file.shape[0] != E) {
      fail(invalid_argument(a.expert_bias, ": shape ", bias_file.shape_string(), " but ", a.logits,
                            " has ", E, " experts; the bias is [", E, "]"));
    }
    if (Status s = router.set_expert_bias(value_or_fail(npy_to_f32(bias_file))); !s.ok()) {
      fail(s.with_context(a.expert_bias));
    }
  }
  StatusOr<RouterOutput> routed = router.forward(logits, T);
  if (!routed.ok()) fail(routed.status().with_context(a.logits));
  const RouterOutput& out = *routed;

  std::error_code ec;
  std::filesystem::create_directories(a.out, ec);
  if (ec) fail(invalid_argument(a.out, ": cannot create the directory: ", ec.message()));
  const int Kp = out.topk.num_topk;
  write(a.out, "topk_idx.npy", NpyDType::kI32, {T, Kp}, out.topk.topk_idx.data());
  write(a.out, "topk_probs.npy", NpyDType::kF32, {T, Kp}, out.topk.topk_weights.data());
  write(a.out, "routing_map.npy", NpyDType::kBool, {T, E}, out.routing.routing_map.data());
  write(a.out, "probs.npy", NpyDType::kF32, {T, E}, out.routing.probs.data());

  int64_t dropped = 0;
  for (uint8_t k : out.kept) dropped += k == 0;
  const RouterConfig& c = router.config();
  const nlohmann::json losses = {
      {"num_tokens", T},
      {"num_experts", E},
      {"num_topk", c.num_topk},
      {"load_balancing", load_balancing_name(c.load_balancing)},
      {"aux_loss", {{"coeff", c.aux_loss_coeff}, {"value", out.aux_loss}}},
      {"z_loss", {{"coeff", c.z_loss_coeff}, {"value", out.z_loss}}},
      {"note", "values have their coefficient applied (Megatron's convention)"},
      {"tokens_per_expert", out.tokens_per_expert},
      {"dropped", dropped}};
  const std::string losses_path = (std::filesystem::path(a.out) / "losses.json").string();
  std::ofstream f(losses_path);
  f << losses.dump(2) << "\n";
  f.close();
  if (!f) fail(invalid_argument(losses_path, ": cannot write"));

  std::printf("moed route: %lld tokens, %d experts, top-%d (%s%s) -> %s\n", (long long)T, E,
              c.num_topk, score_function_name(c.score_function),
              c.pre_softmax ? ", pre-softmax" : "", a.out.c_str());
  std::printf(
      "  topk_idx.npy / topk_probs.npy [%lld, %d], routing_map.npy / probs.npy [%lld, %d], "
      "losses.json\n",
      (long long)T, Kp, (long long)T, E);
  std::printf("  %s = %.9g (coeff %g), z_loss = %.9g (coeff %g), dropped %lld of %lld\n",
              load_balancing_name(c.load_balancing), out.aux_loss, c.aux_loss_coeff, out.z_loss,
              c.z_loss_coeff, (long long)dropped, (long long)out.kept.size());
}

void setup(CLI::App& app) {
  auto a = std::make_shared<RouteArgs>();
  CLI::App* c = app.add_subcommand(
      "route", "route logits [T, E] with Megatron's TopKRouter; write the routing and losses");
  c->add_option("--logits", a->logits, "router logits, float32 [T, E] .npy")->required();
  c->add_option("--out", a->out, "output directory")->required();
  c->add_option("--topk", a->topk, "experts per token (K)")->required();
  c->add_option("--score-function", a->score_function, "softmax | sigmoid | sqrtsoftplus")
      ->capture_default_str();
  c->add_flag("--pre-softmax", a->pre_softmax, "softmax over all experts before top-k");
  c->add_option("--num-groups", a->num_groups, "expert groups for group-limited top-k");
  c->add_option("--group-topk", a->group_topk, "groups kept per token");
  c->add_option("--scaling-factor", a->scaling_factor, "multiplies the chosen probs");
  c->add_option("--expert-bias", a->expert_bias,
                "float32 [E] .npy: selection bias (aux-loss-free balancing)");
  c->add_option("--capacity-factor", a->capacity_factor, "drop tokens above the capacity");
  c->add_option("--drop-policy", a->drop_policy, "probs | position")->capture_default_str();
  c->add_option("--router-padding", a->router_padding,
                "pad each expert's token count to a multiple of this (0 = off)");
  c->add_option("--aux-loss-coeff", a->aux_loss_coeff, "switch load-balancing loss coefficient");
  c->add_option("--seq-aux-loss-coeff", a->seq_aux_loss_coeff,
                "sequence load-balancing loss coefficient (needs --seq-length)");
  c->add_option("--seq-length", a->seq_length, "tokens are [seq_length, batch], t = s * B + b");
  c->add_option("--z-loss-coeff", a->z_loss_coeff, "router z-loss coefficient");
  c->callback([a] { run(*a); });
}

}  // namespace

MOED_CLI_COMMAND("", setup);

}  // namespace moed::cli::route_command
