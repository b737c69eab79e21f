// The built `moed` program end to end, on .npy files written here: `moed route` against
// moed::Router run in this process, `moed dispatch` against the reference (reference_dispatch /
// reference_combine) bit for bit for each dispatcher, `moed replay` against hand counts, and
// bad input exiting non-zero with a message that names the file and the value.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "moed/dispatch_layout.h"
#include "moed/npy.h"
#include "moed/reference.h"
#include "moed/router.h"
#include "tools/cli_support.h"

namespace moed {
namespace {

using namespace cli_test;  // NOLINT: run_cli, TempDir, read, save, ...

// ---- moed route ----

TEST(CliRoute, MatchesRouter) {
  TempDir dir("route");
  const int64_t T = 36;
  const int E = 16;
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 2.0f);
  std::vector<float> logits(static_cast<size_t>(T * E)), bias(static_cast<size_t>(E));
  for (float& v : logits) v = n(rng);
  for (float& v : bias) v = 0.1f * n(rng);
  save(dir / "logits.npy", NpyDType::kF32, {T, E}, logits.data());
  save(dir / "bias.npy", NpyDType::kF32, {E}, bias.data());

  struct Case {
    std::string flags;
    RouterConfig config;
    bool with_bias = false;
  };
  std::vector<Case> cases;
  {
    Case c{"--topk 2 --aux-loss-coeff 0.01 --z-loss-coeff 0.001", {}};
    c.config.num_topk = 2;
    c.config.load_balancing = LoadBalancing::kAuxLoss;
    c.config.aux_loss_coeff = 0.01;
    c.config.z_loss_coeff = 0.001;
    cases.push_back(c);
  }
  {
    Case c{
        "--topk 4 --score-function sigmoid --num-groups 4 --group-topk 2 --scaling-factor 2.5 "
        "--expert-bias " +
            dir / "bias.npy" + " --capacity-factor 1.0 --router-padding 4",
        {},
        true};
    c.config.num_topk = 4;
    c.config.score_function = ScoreFunction::kSigmoid;
    c.config.num_groups = 4;
    c.config.group_topk = 2;
    c.config.topk_scaling_factor = 2.5f;
    c.config.enable_expert_bias = true;
    c.config.layout.capacity_factor = 1.0;
    c.config.layout.router_padding_multiple = 4;
    cases.push_back(c);
  }
  {
    Case c{
        "--topk 3 --pre-softmax --seq-aux-loss-coeff 0.1 --seq-length 12 "
        "--capacity-factor 0.8 --drop-policy position",
        {}};
    c.config.num_topk = 3;
    c.config.pre_softmax = true;
    c.config.load_balancing = LoadBalancing::kSeqAuxLoss;
    c.config.aux_loss_coeff = 0.1;
    c.config.seq_length = 12;
    c.config.layout.capacity_factor = 0.8;
    c.config.layout.drop_policy = DropPolicy::kPosition;
    cases.push_back(c);
  }
  {
    Case c{"--topk 1 --score-function sqrtsoftplus", {}};
    c.config.num_topk = 1;
    c.config.score_function = ScoreFunction::kSqrtSoftplus;
    cases.push_back(c);
  }
  for (Case& c : cases) {
    SCOPED_TRACE(c.flags);
    c.config.num_experts = E;
    StatusOr<Router> router = Router::create(c.config);
    ASSERT_TRUE(router.ok()) << router.status().to_string();
    if (c.with_bias) {
      ASSERT_TRUE(router->set_expert_bias(bias).ok());
    }
    StatusOr<RouterOutput> want = router->forward(logits, T);
    ASSERT_TRUE(want.ok()) << want.status().to_string();

    const std::string out = dir / "routed";
    std::filesystem::remove_all(out);
    const CliResult r =
        run_cli("route --logits " + dir / "logits.npy" + " --out " + out + " " + c.flags);
    ASSERT_EQ(r.rc, 0) << r.output;
    const NpyArray idx = read(out + "/topk_idx.npy");
    const NpyArray probs = read(out + "/topk_probs.npy");
    const NpyArray map = read(out + "/routing_map.npy");
    const NpyArray map_probs = read(out + "/probs.npy");
    const int Kp = want->topk.num_topk;
    EXPECT_EQ(idx.dtype, NpyDType::kI32);
    EXPECT_EQ(idx.shape, (std::vector<int64_t>{T, Kp}));
    EXPECT_EQ(as_vector<int32_t>(idx), want->topk.topk_idx);
    EXPECT_EQ(probs.dtype, NpyDType::kF32);
    EXPECT_EQ(as_vector<float>(probs), want->topk.topk_weights);
    EXPECT_EQ(map.dtype, NpyDType::kBool);
    EXPECT_EQ(map.shape, (std::vector<int64_t>{T, E}));
    EXPECT_EQ(as_vector<uint8_t>(map), want->routing.routing_map);
    EXPECT_EQ(as_vector<float>(map_probs), want->routing.probs);

    std::ifstream f(out + "/losses.json");
    const nlohmann::json losses = nlohmann::json::parse(f);
    EXPECT_EQ(losses["aux_loss"]["value"].get<double>(), want->aux_loss);
    EXPECT_EQ(losses["aux_loss"]["coeff"].get<double>(), c.config.aux_loss_coeff);
    EXPECT_EQ(losses["z_loss"]["value"].get<double>(), want->z_loss);
    EXPECT_EQ(losses["z_loss"]["coeff"].get<double>(), c.config.z_loss_coeff);
    EXPECT_EQ(losses["load_balancing"].get<std::string>(),
              load_balancing_name(c.config.load_balancing));
    EXPECT_EQ(losses["tokens_per_expert"].get<std::vector<int64_t>>(), want->tokens_per_expert);
  }
}

// ---- moed dispatch ----

struct DispatchCase {
  const char* dispatcher;
  int ranks, ranks_per_node, etp;
  DType dtype;
  std::string flags;
  LayoutOptions layout;
};

std::vector<DispatchCase> dispatch_cases() {
  std::vector<DispatchCase> c;
  c.push_back({"allgather", 3, 3, 1, DType::kF32, "", {}});
  c.push_back({"alltoall", 3, 1, 1, DType::kBF16, "", {}});
  c.push_back({"flex", 4, 2, 1, DType::kBF16, "", {}});
  c.push_back({"flex", 3, 3, 1, DType::kF32, "", {}});
  {
    DispatchCase d{"alltoall",  4,
                   2,           2,
                   DType::kF32, "--capacity-factor 1.0 --drop-policy position --expert-alignment 4",
                   {}};
    d.layout.capacity_factor = 1.0;
    d.layout.drop_policy = DropPolicy::kPosition;
    d.layout.expert_alignment = 4;
    c.push_back(d);
  }
  {
    DispatchCase d{"allgather", 2, 1, 1, DType::kBF16, "--capacity-factor 1.5 --pad-to-capacity",
                   {}};
    d.layout.capacity_factor = 1.5;
    d.layout.pad_to_capacity = true;
    c.push_back(d);
  }
  {
    DispatchCase d{"flex", 4, 4, 1, DType::kBF16, "--capacity-factor 0.75 --router-padding 2", {}};
    d.layout.capacity_factor = 0.75;
    d.layout.router_padding_multiple = 2;
    c.push_back(d);
  }
  return c;
}

// The identity experts of `moed dispatch`, written again here: y = x * prob in fp32, rounded.
Tensor identity_experts(const TensorView& rows, const std::vector<float>& probs) {
  Tensor y = Tensor::empty(rows.dtype, rows.rows, rows.cols);
  for (int64_t i = 0; i < rows.rows; ++i) {
    for (int64_t h = 0; h < rows.cols; ++h) {
      if (rows.dtype == DType::kF32) {
        y.row<float>(i)[h] = rows.row<float>(i)[h] * probs[size_t(i)];
      } else {
        y.row<bf16>(i)[h] = float_to_bf16(bf16_to_float(rows.row<bf16>(i)[h]) * probs[size_t(i)]);
      }
    }
  }
  return y;
}

TEST(CliDispatch, EqualsReferenceForEachDispatcher) {
  TempDir dir("dispatch");
  const int E = 12, K = 3;
  const int64_t T = 6, H = 16;
  uint32_t seed = 11;
  for (const DispatchCase& c : dispatch_cases()) {
    SCOPED_TRACE(::testing::Message()
                 << c.dispatcher << " R=" << c.ranks << " G=" << c.ranks_per_node
                 << " etp=" << c.etp << " " << dtype_name(c.dtype) << " " << c.flags);
    const int R = c.ranks;
    const int64_t rows = R * T;
    const DispatchInputs inputs = write_dispatch_inputs(dir, c.dtype, rows, H, K, E, seed);
    seed += 2;
    const NpyDType payload = c.dtype == DType::kF32 ? NpyDType::kF32 : NpyDType::kU16;
    const std::string out = dir / "out";
    std::filesystem::remove_all(out);
    const CliResult r = run_cli(
        "dispatch --x " + dir / "x.npy" + " --topk-idx " + dir / "idx.npy" + " --topk-probs " +
        dir / "probs.npy" + " --ranks " + std::to_string(R) + " --experts " + std::to_string(E) +
        " --dispatcher " + c.dispatcher + " --ranks-per-node " + std::to_string(c.ranks_per_node) +
        " --etp " + std::to_string(c.etp) + " " + c.flags + " --out " + out);
    ASSERT_EQ(r.rc, 0) << r.output;

    ReferenceProblem p;
    p.num_experts = E;
    p.ep_size = R / c.etp;
    p.etp_size = c.etp;
    p.layout = c.layout;
    p.num_topk = K;
    for (int s = 0; s < R; ++s) {
      TopkRouting mine;
      mine.num_tokens = T;
      mine.num_topk = K;
      mine.topk_idx.assign(inputs.idx.begin() + s * T * K, inputs.idx.begin() + (s + 1) * T * K);
      mine.topk_weights.assign(inputs.probs.begin() + s * T * K,
                               inputs.probs.begin() + (s + 1) * T * K);
      p.routing.push_back(to_map(mine, E));
      p.hidden.push_back(TokenRows{inputs.x.view().slice_rows(s * T, T), {}});
    }
    StatusOr<std::vector<ReferenceRankDispatch>> want = reference_dispatch(p);
    ASSERT_TRUE(want.ok()) << want.status().to_string();
    const int64_t L = E / (R / c.etp);
    std::vector<int64_t> tokens_per_expert;
    std::vector<Tensor> ys;
    std::vector<TensorView> y_views;
    for (int g = 0; g < R; ++g) {
      const ReferenceRankDispatch& w = (*want)[size_t(g)];
      const NpyArray in = read(out + "/expert_input_rank" + std::to_string(g) + ".npy");
      EXPECT_EQ(in.dtype, payload);
      EXPECT_EQ(in.shape, (std::vector<int64_t>{w.expert_input.x.rows(), H}));
      ASSERT_EQ(in.data.size(), w.expert_input.x.bytes());
      EXPECT_EQ(std::memcmp(in.data.data(), w.expert_input.x.data(), in.data.size()), 0)
          << "rank " << g;
      EXPECT_EQ(as_vector<float>(read(out + "/permuted_probs_rank" + std::to_string(g) + ".npy")),
                w.permuted_probs);
      tokens_per_expert.insert(tokens_per_expert.end(), w.tokens_per_expert.begin(),
                               w.tokens_per_expert.end());
      ys.push_back(identity_experts(w.expert_input.x.view(), w.permuted_probs));
      y_views.push_back(ys.back().view());
    }
    const NpyArray tpe = read(out + "/tokens_per_expert.npy");
    EXPECT_EQ(tpe.dtype, NpyDType::kI64);
    EXPECT_EQ(tpe.shape, (std::vector<int64_t>{R, L}));
    EXPECT_EQ(as_vector<int64_t>(tpe), tokens_per_expert);

    StatusOr<std::vector<Tensor>> combined = reference_combine(p, y_views);
    ASSERT_TRUE(combined.ok()) << combined.status().to_string();
    const NpyArray got = read(out + "/combined.npy");
    EXPECT_EQ(got.shape, (std::vector<int64_t>{rows, H}));
    ASSERT_EQ(got.data.size(), inputs.x.bytes());
    for (int s = 0; s < R; ++s) {
      const Tensor& w = (*combined)[size_t(s)];
      EXPECT_EQ(std::memcmp(got.data.data() + w.bytes() * size_t(s), w.data(), w.bytes()), 0)
          << "combined rows of rank " << s;
    }
  }
}

// ---- moed replay ----

TEST(CliReplay, CountsMatchTheHandCount) {
  TempDir dir("replay");
  // 4 tokens (2 per rank), top-2, experts 0..3 on 2 ranks of one node each.
  const std::vector<int32_t> idx = {0, 2, 1, -1, 2, 3, 0, 3};
  save(dir / "trace.npy", NpyDType::kI32, {4, 2}, idx.data());
  const std::string base = "replay --trace " + dir / "trace.npy" +
                           " --ranks 2 --ranks-per-node 1 --hidden 4 --dtype-bytes 2 "
                           "--shared-gbps 100 --network-gbps 10 --capacity-factor 0.5 --out " +
                           dir / "pics";
  const CliResult r = run_cli(base + " --json", /*with_stderr=*/false);
  ASSERT_EQ(r.rc, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["num_experts"], 4);
  EXPECT_EQ(j["capacity"], 1);
  EXPECT_EQ(j["routed_per_expert"].get<std::vector<int64_t>>(), (std::vector<int64_t>{2, 1, 2, 2}));
  // C = 1: rank 1 routes t2 and t3 to expert 3, so t3 is dropped there.
  EXPECT_EQ(j["tokens_per_expert"].get<std::vector<int64_t>>(), (std::vector<int64_t>{2, 1, 2, 1}));
  EXPECT_EQ(j["dropped"], 1);
  EXPECT_EQ(j["rows_per_rank"].get<std::vector<int64_t>>(), (std::vector<int64_t>{3, 3}));
  // t3 still goes to expert 0 (rank 0); rank 1 keeps only t2.
  EXPECT_EQ(j["traffic"], nlohmann::json::parse("[[2, 1], [1, 1]]"));
  EXPECT_EQ(j["flat"]["network_bytes"].get<std::vector<int64_t>>(), (std::vector<int64_t>{8, 8}));
  // Flex: one row (8) + the header + one entry per rank.
  const int64_t flex_bytes = 8 + kFlexTokenHeaderBytes + kFlexEntryBytes;
  EXPECT_EQ(j["flex"]["network_bytes"].get<std::vector<int64_t>>(),
            (std::vector<int64_t>{flex_bytes, flex_bytes}));
  EXPECT_EQ(j["flat"]["shared_bytes"].get<std::vector<int64_t>>(), (std::vector<int64_t>{16, 8}));
  EXPECT_EQ(j["flex"]["shared_bytes"].get<std::vector<int64_t>>(), (std::vector<int64_t>{24, 16}));
  EXPECT_DOUBLE_EQ(j["flat"]["seconds"].get<double>(), 16 / 100e9 + 8 / 10e9);
  EXPECT_DOUBLE_EQ(j["flex"]["seconds"].get<double>(), 24 / 100e9 + double(flex_bytes) / 10e9);
  EXPECT_EQ(j["flex_token_header_bytes"], 24);
  EXPECT_TRUE(std::filesystem::exists(dir / "pics/traffic.svg"));
  EXPECT_TRUE(std::filesystem::exists(dir / "pics/expert_load.svg"));

  const CliResult table = run_cli(base);
  ASSERT_EQ(table.rc, 0) << table.output;
  for (const char* s : {"dropped 1 of 7 token-expert pairs", "flat all-to-all", "Flex (two hops)",
                        "predicted time per step", "traffic.svg", "expert_load.svg"}) {
    EXPECT_NE(table.output.find(s), std::string::npos) << s << "\n" << table.output;
  }
}

// ---- bad input ----

TEST(CliErrors, NameTheFileAndTheValue) {
  TempDir dir("errors");
  const std::vector<int32_t> trace = {0, 2, 1, -1, 2, 3, 0, 3};
  save(dir / "trace.npy", NpyDType::kI32, {4, 2}, trace.data());
  const std::vector<float> x(6 * 4, 1.0f);
  save(dir / "x.npy", NpyDType::kF32, {6, 4}, x.data());
  std::vector<int32_t> idx = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2};
  const std::vector<float> p(15, 0.5f);
  save(dir / "idx5.npy", NpyDType::kI32, {5, 3}, idx.data());
  save(dir / "p5.npy", NpyDType::kF32, {5, 3}, p.data());
  idx.insert(idx.end(), {3, 12, 4});
  const std::vector<float> p6(18, 0.5f);
  save(dir / "idx6.npy", NpyDType::kI32, {6, 3}, idx.data());
  save(dir / "p6.npy", NpyDType::kF32, {6, 3}, p6.data());
  const std::vector<float> logits(4 * 8, 0.0f), bias(4, 0.0f);
  save(dir / "logits.npy", NpyDType::kF32, {4, 8}, logits.data());
  save(dir / "bias.npy", NpyDType::kF32, {4}, bias.data());
  const std::string out = " --out " + dir / "o";
  const std::string dispatch_x = "dispatch --x " + dir / "x.npy" + " --experts 12 ";
  const std::string replay = "replay --trace " + dir / "trace.npy";
  // x with six rows of good routing: the cases below change one option each.
  const std::string dispatch6 =
      dispatch_x + "--topk-idx " + dir / "idx6.npy" + " --topk-probs " + dir / "p6.npy";

  struct Case {
    std::string args, message;
  };
  const Case cases[] = {
      {replay + " --ranks 2 --experts 2" + out,
       "moed replay: " + dir / "trace.npy" + ": step 0: topk_idx[0][1] = 2 is outside [-1, 2)"},
      {replay + " --ranks 3" + out,
       "moed replay: experts = 4 (the trace's max index + 1) is not a multiple of --ranks = 3"},
      {replay + " --ranks 3 --experts 6" + out, "moed replay: " + dir / "trace.npy" +
                                                    ": 4 tokens per step do not split evenly over "
                                                    "--ranks = 3"},
      {replay + " --ranks 2 --ranks-per-node 3" + out,
       "moed replay: --ranks-per-node = 3 does not divide --ranks = 2"},
      {replay + " --capacity-factor 1 --drop-policy probs" + out, "a trace has no probs"},
      {"replay --trace " + dir / "missing.npy" + out, dir / "missing.npy"},
      {dispatch_x + "--topk-idx " + dir / "idx5.npy" + " --topk-probs " + dir / "p5.npy" +
           " --ranks 2 --dispatcher flex" + out,
       "moed dispatch: " + dir / "idx5.npy" + ": shape (5, 3) but " + dir / "x.npy" +
           " has 6 rows; topk_idx is [6, K]"},
      {dispatch_x + "--topk-idx " + dir / "idx6.npy" + " --topk-probs " + dir / "p5.npy" +
           " --ranks 2 --dispatcher flex" + out,
       "moed dispatch: " + dir / "p5.npy" + ": shape (5, 3) differs from " + dir / "idx6.npy" +
           "'s (6, 3)"},
      {dispatch6 + " --ranks 4 --dispatcher alltoall" + out,
       "moed dispatch: " + dir / "x.npy" + ": 6 rows do not split evenly over --ranks = 4"},
      {dispatch6 + " --ranks 2 --dispatcher alltoall" + out,
       "moed dispatch: " + dir / "idx6.npy" + ": topk_idx[5][1] = 12 is outside [-1, 12)"},
      {dispatch6 + " --ranks 2 --dispatcher bogus" + out,
       "moed dispatch: dispatcher 'bogus' is not one of"},
      {dispatch6 + " --ranks 2 --ranks-per-node 3 --dispatcher flex" + out,
       "moed dispatch: --ranks-per-node = 3 does not divide --ranks = 2"},
      {dispatch6 + " --dispatcher flex" + out,
       "moed dispatch: --ranks is required with --world threads"},
      {dispatch6 + " --world mpi --dispatcher flex" + out,
       "moed dispatch: --world mpi needs the program started by mpirun"},
      {"route --logits " + dir / "logits.npy" + " --topk 2 --expert-bias " + dir / "bias.npy" + out,
       "moed route: " + dir / "bias.npy" + ": shape (4,) but " + dir / "logits.npy" +
           " has 8 experts; the bias is [8]"},
      {"route --logits " + dir / "bias.npy" + " --topk 2" + out,
       "moed route: " + dir / "bias.npy" + ": shape (4,); logits are [tokens, experts]"},
      {"route --logits " + dir / "logits.npy" + " --topk 9" + out,
       "moed route: num_topk = 9 is outside [1, 8]"},
      // A layer no machine holds fails at once, before anything is allocated.
      {"run --preset tiny --hidden 65536 --ffn 1048576 --experts 4096",
       "moed run: FAILED_PRECONDITION: --preset tiny with 4 ranks (hidden 65536, ffn 1048576, "
       "4096 experts, tokens 64, f32, flex) needs at least"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const CliResult r = run_cli(c.args);
    EXPECT_EQ(r.rc, 1) << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << r.output;
  }
}

// moed run --fail-rank: the decode loop goes on without the lost rank, every step of every live
// rank bitwise equal to the masked reference (the program checks; it exits 2 otherwise).
TEST(CliRun, ALostRankIsMaskedAndTheOthersGoOn) {
  struct Case {
    std::string args;
    std::string first_without;  // the table's first step without the rank
    std::string masked;         // its masked column
  };
  const Case cases[] = {
      {"--fail-rank 1 --at-step 2 --steps 4 --shrink-timeout 0.3", "    2", "1"},
      {"--fail-rank 2 --at-step 1 --steps 3 --fail-how raise --ranks 5 --experts 5 --topk 5 "
       "--hidden 100 --tokens 3",
       "    1", "2"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const CliResult r = run_cli("run --dispatcher low-latency " + c.args, /*with_stderr=*/false);
    EXPECT_EQ(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("verify: every live rank's output of every step is bitwise equal"),
              std::string::npos)
        << r.output;
    const size_t row = r.output.find("\n" + c.first_without + " ");
    ASSERT_NE(row, std::string::npos) << r.output;
    const std::string line = r.output.substr(row + 1, r.output.find('\n', row + 1) - row - 1);
    EXPECT_NE(line.find("  " + c.masked + "  "), std::string::npos) << line;
  }
  const std::pair<std::string, std::string> errors[] = {
      {"run --fail-rank 1", "--fail-rank runs the low-latency dispatcher in shrink mode"},
      {"run --dispatcher low-latency --fail-rank 4", "--fail-rank 4 is not a rank of 4"},
      {"run --dispatcher low-latency --fail-rank 1 --at-step 8", "--at-step 8 is not a step of 8"},
      {"run --dispatcher low-latency --fail-rank 1 --experts 6", "--experts 6 is not a multiple"},
  };
  for (const auto& [args, message] : errors) {
    SCOPED_TRACE(args);
    const CliResult r = run_cli(args);
    EXPECT_EQ(r.rc, 1) << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace moed
