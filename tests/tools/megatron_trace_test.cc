// Megatron-Core routing traces (moed/megatron_trace.h) written here record by record as
// RouterTracer writes them (router_trace.py: one JSONL file per rank, the bf16 sidecar), then
// read back: rank-order joining, the selection options, each bad file's exact error, and the
// commands that read them: `moed dispatch --trace` against the reference bit for bit for every
// dispatcher, `moed replay --trace` against a direct count, `moed plan --trace`.
#include "moed/megatron_trace.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "moed/reference.h"
#include "tools/cli_support.h"

namespace moed {
namespace {

using cli_test::as_vector;
using cli_test::CliResult;
using cli_test::read;
using cli_test::run_cli;
using cli_test::TempDir;
using json = nlohmann::ordered_json;

// One router call of one rank, as RouterTracer._record / _flush_records_to_disk write it.
struct Call {
  int64_t step = 0;
  int layer = 0;
  std::vector<std::vector<int32_t>> top;  // [T][K]
  std::vector<uint16_t> rows;             // [T * H] bf16 bits; empty = no sidecar
  int64_t hidden = 0;
  std::string block = "decoder";
  int mtp_idx = -1;
};

// Writes rank r's JSONL (and sidecar when a call has rows) from `calls`, in order.
void write_rank(const std::string& dir, int r, const std::vector<Call>& calls) {
  std::ofstream f(dir + "/router_trace_rank" + std::to_string(r) + ".jsonl");
  std::ofstream hs;
  int64_t offset = 0;
  for (const Call& c : calls) {
    json rec = {{"step", c.step}, {"stage", "pre_dispatch"}, {"block", c.block},
                {"layer", c.layer}, {"rank", r}, {"num_tokens", c.top.size()},
                {"topk", c.top.empty() ? 0 : c.top[0].size()}};
    if (c.mtp_idx >= 0) rec["mtp_idx"] = c.mtp_idx;
    if (!c.rows.empty()) {
      if (!hs.is_open()) {
        hs.open(dir + "/hidden_states_rank" + std::to_string(r) + ".bin", std::ios::binary);
      }
      hs.write(reinterpret_cast<const char*>(c.rows.data()), std::streamsize(c.rows.size() * 2));
      rec["hs_offset"] = offset;
      rec["hs_bytes"] = c.rows.size() * 2;
      rec["hs_shape"] = {c.top.size(), c.hidden};
      offset += int64_t(c.rows.size() * 2);
    }
    rec["top_indices"] = c.top;
    f << rec.dump(-1, ' ', false) << "\n";
  }
}

// Token t of rank r at (step, layer): K distinct experts of E, a -1 now and then; rows of H
// bf16 values (when H > 0) that depend on all four.
Call make_call(int r, int64_t step, int layer, int64_t T, int K, int E, int64_t H) {
  Call c;
  c.step = step;
  c.layer = layer;
  c.hidden = H;
  std::mt19937 rng(uint32_t(1000 * r + 100 * step + layer));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> e(static_cast<size_t>(E));
    for (int i = 0; i < E; ++i) e[size_t(i)] = i;
    std::shuffle(e.begin(), e.end(), rng);
    e.resize(size_t(K));
    if (rng() % 5 == 0) e[rng() % K] = -1;
    c.top.push_back(e);
  }
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int64_t i = 0; i < T * H; ++i) c.rows.push_back(float_to_bf16(u(rng)).bits);
  return c;
}

// R ranks x steps {0, 1} x decoder layers {1, 2, 3}, with rows.
std::vector<std::vector<Call>> make_trace(int R, int64_t T, int K, int E, int64_t H) {
  std::vector<std::vector<Call>> ranks(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    for (int64_t step = 0; step < 2; ++step) {
      for (int layer = 1; layer <= 3; ++layer) ranks[size_t(r)].push_back(make_call(r, step, layer, T, K, E, H));
    }
  }
  return ranks;
}

void write_trace(const std::string& dir, const std::vector<std::vector<Call>>& ranks) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  for (size_t r = 0; r < ranks.size(); ++r) write_rank(dir, int(r), ranks[r]);
}

std::vector<int32_t> joined(const std::vector<std::vector<Call>>& ranks, size_t call) {
  std::vector<int32_t> out;
  for (const auto& rank : ranks) {
    for (const auto& row : rank[call].top) out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

TEST(MegatronTrace, JoinsRanksInOrderAndSelects) {
  TempDir dir("mt_read");
  const int R = 3, K = 2, E = 6;
  const int64_t T = 4, H = 8;
  auto ranks = make_trace(R, T, K, E, H);
  // Step 1 calls layer 2 twice on every rank (two micro-batches), and an MTP layer.
  for (int r = 0; r < R; ++r) {
    ranks[size_t(r)].push_back(make_call(r, 1, 2, T, K, E, H));
    Call m = make_call(r, 1, 2, T, K, E, 0);
    m.block = "mtp";
    m.mtp_idx = 0;
    ranks[size_t(r)].push_back(m);
  }
  write_trace(dir.path(), ranks);
  ASSERT_TRUE(is_megatron_trace_dir(dir.path()));

  MegatronTraceSelection sel;
  sel.num_experts = E;
  sel.load_hidden_states = true;
  StatusOr<MegatronTrace> t = read_megatron_trace(dir.path(), sel);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->num_ranks, R);
  EXPECT_EQ(t->step, 0);
  EXPECT_EQ(t->steps, (std::vector<int64_t>{0, 1}));
  ASSERT_EQ(t->calls.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const MegatronLayerCall& c = t->calls[i];
    EXPECT_EQ(c.label(), "decoder layer " + std::to_string(i + 1));
    EXPECT_EQ(c.tokens_per_rank, T);
    EXPECT_EQ(c.num_topk, K);
    EXPECT_EQ(c.topk_idx, joined(ranks, i));
    EXPECT_EQ(c.hidden, H);
    std::vector<uint16_t> rows;
    for (const auto& rank : ranks) rows.insert(rows.end(), rank[i].rows.begin(), rank[i].rows.end());
    EXPECT_EQ(c.hidden_states, rows);
  }
  StatusOr<RoutingTrace> rt = megatron_routing_trace(*t);
  ASSERT_TRUE(rt.ok());
  EXPECT_EQ(rt->num_steps, 3);
  EXPECT_EQ(rt->num_tokens, R * T);
  EXPECT_EQ(rt->idx(2, T, 1), ranks[1][2].top[0][1]);  // call 2, rank 1's first token

  sel.step = 1;
  sel.layer = 2;
  t = read_megatron_trace(dir.path(), sel);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ASSERT_EQ(t->calls.size(), 2u);
  EXPECT_EQ(t->calls[1].label(), "decoder layer 2 microbatch 1");
  EXPECT_EQ(t->calls[0].topk_idx, joined(ranks, 4));
  EXPECT_EQ(t->calls[1].topk_idx, joined(ranks, 6));
  sel.microbatch = 1;
  t = read_megatron_trace(dir.path(), sel);
  ASSERT_TRUE(t.ok());
  ASSERT_EQ(t->calls.size(), 1u);
  EXPECT_EQ(t->calls[0].topk_idx, joined(ranks, 6));

  MegatronTraceSelection mtp;
  mtp.step = 1;
  mtp.block = "mtp";
  t = read_megatron_trace(dir.path(), mtp);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ASSERT_EQ(t->calls.size(), 1u);
  EXPECT_EQ(t->calls[0].label(), "mtp 0 layer 2");
  EXPECT_EQ(t->calls[0].hidden, 0);
  EXPECT_EQ(t->calls[0].topk_idx, joined(ranks, 7));
}

// Each bad file, its exact message: the file, the line and the value.
TEST(MegatronTrace, BadFilesAreClearErrors) {
  TempDir dir("mt_bad");
  const int R = 2, K = 2, E = 4;
  const int64_t T = 3, H = 4;
  const std::string d = dir / "t";
  const std::string f0 = d + "/router_trace_rank0.jsonl", f1 = d + "/router_trace_rank1.jsonl";
  struct Case {
    std::string name;
    std::function<void(std::vector<std::vector<Call>>&)> spoil;  // before writing
    std::function<void()> after;                                 // after writing
    MegatronTraceSelection sel;
    std::string message;
  };
  MegatronTraceSelection with_e;
  with_e.num_experts = E;
  MegatronTraceSelection hidden = with_e;
  hidden.load_hidden_states = true;
  MegatronTraceSelection step5 = with_e;
  step5.step = 5;
  MegatronTraceSelection layer9 = with_e;
  layer9.layer = 9;
  auto append = [](const std::string& path, const std::string& text) {
    std::ofstream(path, std::ios::app) << text;
  };
  const std::vector<Case> cases = {
      {"missing rank", nullptr,
       [&] {
         std::filesystem::rename(f1, d + "/router_trace_rank2.jsonl");
       },
       with_e, f1 + " is missing (found ranks 0, 2); a step's routing needs every rank"},
      {"cut short", nullptr, [&] { append(f1, "{\"step\": 1, \"stage\": \"pre_dispatch\", \"blo"); },
       with_e,
       f1 + ":7: not a complete JSON record ({\"step\": 1, \"stage\": \"pre_dispatch\", \"bl...); "
            "was the file cut short?"},
      {"layer absent", [](auto& ranks) { ranks[1].erase(ranks[1].begin() + 2); }, nullptr, with_e,
       f1 + ": no record for step 0, decoder layer 3 (rank 0 has one at line 3)"},
      {"index out of range", [](auto& ranks) { ranks[1][1].top[2][1] = 4; }, nullptr, with_e,
       f1 + ":2: top_indices[2][1] = 4 is outside [-1, 4) (--experts)"},
      {"index below -1", [](auto& ranks) { ranks[0][0].top[1][0] = -2; }, nullptr,
       MegatronTraceSelection{},
       f0 + ":1: top_indices[1][0] = -2 is outside [-1, 2^31)"},
      {"num_tokens differ", [](auto& ranks) { ranks[1][0].top.pop_back(); ranks[1][0].rows.clear(); },
       nullptr, with_e,
       f1 + ":1: num_tokens = 2, but rank 0's record (" + f0 +
           ":1) has 3; moed splits a step's tokens evenly over the ranks"},
      {"row too short", [](auto& ranks) { ranks[0][2].top[1].pop_back(); }, nullptr, with_e,
       f0 + ":3: top_indices[1] = ["},
      {"rank field", nullptr,
       [&] { std::filesystem::copy_file(f0, f1, std::filesystem::copy_options::overwrite_existing); },
       with_e, f1 + ":1: rank = 0, but the file is rank 1's"},
      {"step absent", nullptr, nullptr, step5,
       f0 + ": no record for step 5 (steps present: 0, 1)"},
      {"layer not in trace", nullptr, nullptr, layer9,
       f0 + ": no record for step 0, block 'decoder' layer 9 (layers of that step: decoder layer 1, "
            "decoder layer 2, decoder layer 3)"},
      {"sidecar short", nullptr,
       [&] { std::filesystem::resize_file(d + "/hidden_states_rank1.bin", 30); }, hidden,
       d + "/hidden_states_rank1.bin: the record at " + f1 +
           ":2 needs bytes [24, 48) but the file has 30 bytes"},
      {"no sidecar", [](auto& ranks) { ranks[0][0].rows.clear(); }, nullptr, hidden,
       f0 + ":1: the record has no hidden states (hs_offset); RouterTracer writes them with "
            "capture_hidden_states=True"},
      {"no files", nullptr, [&] { std::filesystem::remove(f0); std::filesystem::remove(f1); }, with_e,
       d + ": no router_trace_rank*.jsonl files (Megatron-Core's RouterTracer writes one per rank)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto ranks = make_trace(R, T, K, E, H);
    if (c.spoil) c.spoil(ranks);
    write_trace(d, ranks);
    if (c.after) c.after();
    StatusOr<MegatronTrace> t = read_megatron_trace(d, c.sel);
    ASSERT_FALSE(t.ok());
    if (c.name == "row too short") {
      EXPECT_EQ(t.status().message().rfind(c.message, 0), 0u) << t.status().message();
      EXPECT_NE(t.status().message().find("] does not hold topk = 2 indices"), std::string::npos);
      continue;
    }
    EXPECT_EQ(t.status().message(), c.message);
    // The commands say the same, after their name.
    const CliResult r = run_cli("replay --trace " + d + " --out " + dir / "o" +
                                (c.sel.num_experts ? " --experts 4" : "") +
                                (c.sel.step ? " --step " + std::to_string(*c.sel.step) : "") +
                                (c.sel.layer ? " --layer " + std::to_string(*c.sel.layer) : ""));
    if (!c.sel.load_hidden_states) {
      EXPECT_EQ(r.rc, 1);
      EXPECT_NE(r.output.find("moed replay: " + c.message), std::string::npos) << r.output;
    }
  }
}

// `moed dispatch --trace DIR --layer L` against the reference, bit for bit, for every
// dispatcher: the rows from the sidecar, prob 1 per routed slot.
TEST(MegatronTrace, DispatchEqualsReference) {
  TempDir dir("mt_dispatch");
  const int R = 4, K = 3, E = 8;
  const int64_t T = 5, H = 16;
  const auto ranks = make_trace(R, T, K, E, H);
  write_trace(dir / "t", ranks);
  const size_t call = 4;  // step 1, layer 2
  struct Case {
    const char* dispatcher;
    int ranks_per_node;
  };
  for (const Case& c : {Case{"allgather", 4}, Case{"alltoall", 4}, Case{"alltoall", 2},
                        Case{"flex", 4}, Case{"flex", 2}, Case{"flex", 1}}) {
    SCOPED_TRACE(std::string(c.dispatcher) + " G=" + std::to_string(c.ranks_per_node));
    const std::string out = dir / "out";
    std::filesystem::remove_all(out);
    const CliResult r = run_cli("dispatch --trace " + dir / "t" + " --step 1 --layer 2 --experts 8 "
                                "--dispatcher " + c.dispatcher + " --ranks-per-node " +
                                std::to_string(c.ranks_per_node) + " --out " + out);
    ASSERT_EQ(r.rc, 0) << r.output;
    ReferenceProblem p;
    p.num_experts = E;
    p.ep_size = R;
    p.num_topk = K;
    std::vector<Tensor> xs;
    for (int s = 0; s < R; ++s) {
      TopkRouting mine;
      mine.num_tokens = T;
      mine.num_topk = K;
      for (const auto& row : ranks[size_t(s)][call].top) {
        for (int32_t e : row) {
          mine.topk_idx.push_back(e);
          mine.topk_weights.push_back(e >= 0 ? 1.0f : 0.0f);
        }
      }
      p.routing.push_back(to_map(mine, E));
      xs.push_back(Tensor::empty(DType::kBF16, T, H));
      std::memcpy(xs.back().data(), ranks[size_t(s)][call].rows.data(), size_t(T * H * 2));
    }
    for (const Tensor& x : xs) p.hidden.push_back(TokenRows{x.view(), {}});
    StatusOr<std::vector<ReferenceRankDispatch>> want = reference_dispatch(p);
    ASSERT_TRUE(want.ok()) << want.status().to_string();
    std::vector<TensorView> ys;
    for (int g = 0; g < R; ++g) {
      const ReferenceRankDispatch& w = (*want)[size_t(g)];
      const NpyArray in = read(out + "/expert_input_rank" + std::to_string(g) + ".npy");
      ASSERT_EQ(in.data.size(), w.expert_input.x.bytes());
      EXPECT_EQ(std::memcmp(in.data.data(), w.expert_input.x.data(), in.data.size()), 0) << g;
      EXPECT_EQ(as_vector<float>(read(out + "/permuted_probs_rank" + std::to_string(g) + ".npy")),
                w.permuted_probs);
      // Prob 1: the identity experts return the rows as they came.
      ys.push_back(w.expert_input.x.view());
    }
    StatusOr<std::vector<Tensor>> combined = reference_combine(p, ys);
    ASSERT_TRUE(combined.ok());
    const NpyArray got = read(out + "/combined.npy");
    for (int s = 0; s < R; ++s) {
      const Tensor& w = (*combined)[size_t(s)];
      EXPECT_EQ(std::memcmp(got.data.data() + w.bytes() * size_t(s), w.data(), w.bytes()), 0) << s;
    }
  }
  // One call only, and the rows must be there.
  const CliResult several = run_cli("dispatch --trace " + dir / "t" +
                                    " --experts 8 --dispatcher flex --out " + dir / "o");
  EXPECT_EQ(several.rc, 1);
  EXPECT_NE(several.output.find("moed dispatch: " + dir / "t" + ": 3 router calls selected "
                                "(decoder layer 1, decoder layer 2, decoder layer 3); moed "
                                "dispatch moves one: choose it with --layer (and --microbatch)"),
            std::string::npos)
      << several.output;
}

// `moed replay` and `moed plan` on a trace directory: per-layer counts against a direct count.
TEST(MegatronTrace, ReplayAndPlanReadIt) {
  TempDir dir("mt_replay");
  const int R = 4, K = 2, E = 8;
  const int64_t T = 6;
  const auto ranks = make_trace(R, T, K, E, 0);
  write_trace(dir / "t", ranks);
  const CliResult r = run_cli("replay --trace " + dir / "t" + " --experts 8 --ranks-per-node 2 "
                              "--hidden 128 --json --out " + dir / "pics", false);
  ASSERT_EQ(r.rc, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["num_ranks"], R);
  EXPECT_EQ(j["num_steps"], 3);
  ASSERT_EQ(j["megatron"]["layers"].size(), 3u);
  std::vector<int64_t> sum(size_t(E), 0);
  for (size_t l = 0; l < 3; ++l) {
    std::vector<int64_t> want(size_t(E), 0);
    for (int32_t e : joined(ranks, l)) {
      if (e >= 0) ++want[size_t(e)], ++sum[size_t(e)];
    }
    EXPECT_EQ(j["megatron"]["layers"][l]["label"], "decoder layer " + std::to_string(l + 1));
    EXPECT_EQ(j["megatron"]["layers"][l]["tokens_per_expert"].get<std::vector<int64_t>>(), want);
  }
  EXPECT_EQ(j["tokens_per_expert"].get<std::vector<int64_t>>(), sum);
  for (const char* f : {"layer_load.svg", "layer_traffic.svg", "traffic.svg", "expert_load.svg"}) {
    EXPECT_TRUE(std::filesystem::exists(dir / ("pics/" + std::string(f)))) << f;
  }
  const CliResult p = run_cli("plan --trace " + dir / "t" + " --experts 8 --ranks-per-node 2 "
                              "--hidden 128 --json", false);
  ASSERT_EQ(p.rc, 0) << p.output;
  const nlohmann::json jp = nlohmann::json::parse(p.output);
  ASSERT_EQ(jp["calls"].size(), 3u);
  EXPECT_EQ(jp["calls"][0]["ep"], R);
  EXPECT_EQ(jp["calls"][2]["label"], "decoder layer 3");
  EXPECT_EQ(jp["calls"][0]["tokens"], T);
  const CliResult npy_flag = run_cli("plan --trace " + dir / "x.npy" + " --layer 2");
  EXPECT_NE(npy_flag.output.find("--layer chooses from a Megatron trace directory"),
            std::string::npos)
      << npy_flag.output;
}

}  // namespace
}  // namespace moed
