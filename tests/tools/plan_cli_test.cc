// `moed plan` and `moed replay --cluster` end to end: the JSON equals the library's plan() for
// the same options, --validate prints every published row, and bad options exit non-zero
// with a message naming the value.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include <nlohmann/json.hpp>
#include <string>

#include "moed/plan.h"
#include "support/sanitizers.h"
#include "tools/cli_support.h"

namespace moed {
namespace {

using namespace cli_test;  // NOLINT: run_cli, TempDir, save

TEST(CliPlan, JsonEqualsLibrary) {
  const CliResult r = run_cli(
      "plan --cluster h800 --ep 32 --ranks-per-node 8 --tokens 512 --hidden 7168 --topk 8 "
      "--experts 256 --routing group --json",
      false);
  ASSERT_EQ(r.rc, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  PlanOptions o;
  o.cluster = *cluster_preset("h800");
  o.ep = 32;
  o.tokens = 512;
  o.routing = PlanRouting::kGroup;
  StatusOr<PlanResult> want = plan(o);
  ASSERT_TRUE(want.ok()) << want.status().to_string();
  for (const char* key : {"dispatch_seconds", "combine_seconds", "dispatch_gbps", "combine_gbps"}) {
    ASSERT_TRUE(j.contains(key)) << key;
    EXPECT_GT(j[key].get<double>(), 0.0) << key;
  }
  EXPECT_EQ(j["dispatch_seconds"].get<double>(), want->dispatch_seconds);
  EXPECT_EQ(j["combine_gbps"].get<double>(), want->combine_gbps);
  EXPECT_EQ(j["gbps_link"], "RDMA");
  EXPECT_EQ(j["num_nodes"], 4);
}

TEST(CliPlan, LowLatencyAndOverrides) {
  const CliResult a = run_cli("plan --ep 256 --tokens 128 --mode low-latency --json", false);
  ASSERT_EQ(a.rc, 0) << a.output;
  // Half the network bandwidth: the network-bound time roughly doubles.
  const CliResult b =
      run_cli("plan --ep 256 --tokens 128 --mode low-latency --net-gbps 25 --json", false);
  ASSERT_EQ(b.rc, 0) << b.output;
  const double ta = nlohmann::json::parse(a.output)["dispatch_seconds"].get<double>();
  const double tb = nlohmann::json::parse(b.output)["dispatch_seconds"].get<double>();
  EXPECT_GT(tb, 1.5 * ta);
  const CliResult text = run_cli("plan --ep 2048 --tokens 16 --experts 2048 --mode low-latency");
  ASSERT_EQ(text.rc, 0) << text.output;
  EXPECT_NE(text.output.find("low-latency mode: dispatch"), std::string::npos) << text.output;
}

TEST(CliPlan, ValidatePrintsEveryPublishedRow) {
  if (testing::kUnderTsan) GTEST_SKIP() << "no threads of its own (support/sanitizers.h)";
  const CliResult r = run_cli("plan --validate", false);
  ASSERT_EQ(r.rc, 0) << r.output;
  StatusOr<std::vector<ValidationRow>> rows = validate_plan();
  ASSERT_TRUE(rows.ok()) << rows.status().to_string();
  EXPECT_NE(r.output.find(validation_summary(*rows)), std::string::npos) << r.output;
  for (const PublishedSource& s : published_sources()) {
    EXPECT_NE(r.output.find("\n" + s.name + " "), std::string::npos) << s.name;
  }
  // One line per row (and the header and two summary lines); every MISS names its reason.
  size_t lines = 0, pos = 0;
  while ((pos = r.output.find('\n', pos)) != std::string::npos) ++lines, ++pos;
  EXPECT_EQ(lines, rows->size() + 3);
  pos = 0;
  while ((pos = r.output.find("MISS:", pos)) != std::string::npos) {
    EXPECT_NE(r.output[pos + 6], '\n');
    pos += 5;
  }
  const CliResult md = run_cli("plan --validate --markdown", false);
  ASSERT_EQ(md.rc, 0);
  EXPECT_NE(md.output.find("| source | table | design | cluster |"), std::string::npos);
  // docs/planner.md carries this very table: regenerate it there when the model or a row changes.
  std::ifstream doc(std::string(MOED_SOURCE_DIR) + "/docs/planner.md");
  const std::string text((std::istreambuf_iterator<char>(doc)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find(md.output), std::string::npos)
      << "docs/planner.md does not carry the current `moed plan --validate --markdown`";
}

TEST(CliPlan, TraceAndReplayUseTheSameModel) {
  TempDir dir("plan_trace");
  std::vector<int32_t> idx;
  std::vector<float> probs;
  random_topk(64, 4, 16, 5, idx, probs);
  save(dir / "t.npy", NpyDType::kI32, {64, 4}, idx.data());
  const CliResult p = run_cli(
      "plan --cluster h100 --ep 8 --ranks-per-node 2 --experts 16 "
      "--hidden 256 --dispatch-dtype bf16 --json --trace " +
          dir / "t.npy",
      false);
  ASSERT_EQ(p.rc, 0) << p.output;
  const CliResult r = run_cli("replay --trace " + dir / "t.npy" +
                                  " --ranks 8 --ranks-per-node 2 --experts 16 --hidden 256 "
                                  "--cluster h100 --json --out " +
                                  dir / "out",
                              false);
  ASSERT_EQ(r.rc, 0) << r.output;
  const nlohmann::json jp = nlohmann::json::parse(p.output);
  const nlohmann::json jr = nlohmann::json::parse(r.output);
  EXPECT_EQ(jp["tokens"], 8);
  EXPECT_EQ(jr["plan"]["dispatch_seconds"].get<double>(), jp["dispatch_seconds"].get<double>());
  EXPECT_EQ(jr["plan"]["combine_seconds"].get<double>(), jp["combine_seconds"].get<double>());
}

TEST(CliPlan, SweepPrintsEveryAlgorithmAndWritesTheChart) {
  TempDir dir("plan_sweep");
  const CliResult r = run_cli("plan --cluster h800 --tokens 128 --mode low-latency --sweep "
                              "ep=8,16,32 --sweep-metric gbps --out " + dir / "out", false);
  ASSERT_EQ(r.rc, 0) << r.output;
  for (const char* s : {"flat", "alltoall", "flex", "low-latency", "pplx", "published on h800",
                        "DeepEP V1", "sweep.svg"}) {
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  }
  EXPECT_TRUE(std::filesystem::exists(dir / "out/sweep.svg"));
  const CliResult bad = run_cli("plan --sweep ep=8 --sweep-metric fast");
  EXPECT_EQ(bad.rc, 1);
  EXPECT_NE(bad.output.find("moed plan: --sweep-metric 'fast' is not one of gbps, us"),
            std::string::npos) << bad.output;
}

TEST(CliPlan, BadOptionsAreClearErrors) {
  struct Case {
    std::string args, want;
  };
  const Case cases[] = {
      {"plan --cluster a100", "--cluster 'a100' is not one of h800"},
      {"plan --mode fast", "--mode 'fast'"},
      {"plan --dispatch-dtype fp16", "--dispatch-dtype 'fp16'"},
      {"plan --routing skewed", "--routing 'skewed'"},
      {"plan --ep 4096 --experts 4096", "--ep = 4096 is outside [1, 2048]"},
      {"plan --ep 16 --ranks-per-node 3", "--ranks-per-node = 3 does not divide --ep = 16"},
      {"plan --ep 16 --experts 24", "--experts = 24 is not a positive multiple of --ep = 16"},
      {"plan --hidden 100", "--hidden = 100 is not a multiple of 128"},
      {"plan --net-gbps 0", "bandwidths must be > 0"},
      {"plan --trace /nonexistent/t.npy", "/nonexistent/t.npy"},
      {"plan --sweep ep=16,8", "--sweep 'ep=16,8': values must ascend (8 after 16)"},
      {"plan --algorithm ring", "--algorithm 'ring' is not one of flat, alltoall, flex"},
      {"replay --trace /nonexistent/t.npy --out /tmp --cluster a100", "'a100'"},
  };
  for (const Case& c : cases) {
    const CliResult r = run_cli(c.args);
    EXPECT_NE(r.rc, 0) << c.args;
    EXPECT_NE(r.output.find(c.want), std::string::npos) << c.args << "\n" << r.output;
  }
}

}  // namespace
}  // namespace moed
