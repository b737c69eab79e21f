// The replay library (moed/replay.h) against a direct count written here from the trace
// alone: per expert, per rank, the traffic matrix, drops (position policy), and both schemes'
// bytes and predicted times. Plus the SVG helpers and what the pictures must show.
#include "moed/replay.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>
#include <set>

#include "moed/npy.h"
#include "replay/svg.h"

namespace moed {
namespace {

RoutingTrace make_trace(int64_t steps, int64_t T, int K, std::vector<int32_t> idx) {
  RoutingTrace t;
  t.name = "trace.npy";
  t.num_steps = steps;
  t.num_tokens = T;
  t.num_topk = K;
  t.topk_idx = std::move(idx);
  return t;
}

// Random trace: K distinct experts per token, some slots -1.
RoutingTrace random_trace(int64_t steps, int64_t T, int K, int E, uint32_t seed, bool skewed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> idx;
  for (int64_t i = 0; i < steps * T; ++i) {
    std::vector<int> experts(static_cast<size_t>(E));
    for (int e = 0; e < E; ++e) experts[size_t(e)] = e;
    // Skewed: half the tokens go to experts 0..K-1.
    if (!skewed || rng() % 2 == 0) std::shuffle(experts.begin(), experts.end(), rng);
    for (int k = 0; k < K; ++k) idx.push_back(rng() % 7 == 0 ? -1 : experts[size_t(k)]);
  }
  return make_trace(steps, T, K, idx);
}

// The direct count: token by token, from the definitions in moed/replay.h.
ReplayResult direct(const RoutingTrace& tr, const ReplayOptions& o) {
  const int E = o.num_experts, R = o.num_ranks, G = o.ranks_per_node, N = R / G, L = E / R;
  const int K = tr.num_topk;
  const int64_t Ts = tr.num_tokens / R, rb = o.hidden * o.dtype_bytes;
  ReplayResult r;
  r.routed_per_expert.assign(size_t(E), 0);
  r.tokens_per_expert.assign(size_t(E), 0);
  r.dropped_per_expert.assign(size_t(E), 0);
  r.rows_per_rank.assign(size_t(R), 0);
  r.tokens_per_rank.assign(size_t(R), 0);
  r.traffic.assign(size_t(R * R), 0);
  r.num_ranks = R;
  for (SchemeCost* c : {&r.flat, &r.flex}) {
    c->shared_bytes.assign(size_t(R), 0);
    c->network_bytes.assign(size_t(R), 0);
  }
  const int64_t C =
      o.capacity_factor ? int64_t(std::ceil(double(Ts) * K / E * *o.capacity_factor)) : INT64_MAX;
  for (int64_t st = 0; st < tr.num_steps; ++st) {
    const size_t nr = size_t(R);
    std::vector<int64_t> fs(nr), fn(nr), xs(nr), xn(nr);
    for (int s = 0; s < R; ++s) {
      std::vector<int64_t> taken(size_t(E), 0);
      for (int64_t t = s * Ts; t < (s + 1) * Ts; ++t) {
        std::set<int> kept;
        for (int k = 0; k < K; ++k) {
          const int e = tr.idx(st, t, k);
          if (e < 0) continue;
          ++r.routed_per_expert[size_t(e)];
          if (taken[size_t(e)] < C) {  // position policy: the first C tokens in order stay
            ++taken[size_t(e)];
            kept.insert(e);
          } else {
            ++r.dropped_per_expert[size_t(e)];
          }
        }
        std::set<int> dests;
        std::map<int, int> entries_on_node;
        for (int e : kept) {
          ++r.tokens_per_expert[size_t(e)];
          ++r.rows_per_rank[size_t(e / L)];
          dests.insert(e / L);
          ++entries_on_node[e / L / G];
        }
        for (int d : dests) {
          ++r.traffic[size_t(s * R + d)];
          ++r.tokens_per_rank[size_t(d)];
          if (d / G == s / G) {
            fs[size_t(s)] += rb;
            xs[size_t(s)] += rb;
          } else {
            fn[size_t(s)] += rb;
            xs[size_t(d / G * G + s % G)] += rb;
          }
        }
        for (auto [m, n] : entries_on_node) {
          if (m != s / G) xn[size_t(s)] += rb + kFlexTokenHeaderBytes + kFlexEntryBytes * n;
        }
      }
    }
    double tf = 0, tx = 0;
    for (int q = 0; q < R; ++q) {
      tf = std::max(tf, double(fs[size_t(q)]) / (o.shared_gbps * 1e9) +
                            double(fn[size_t(q)]) / (o.network_gbps * 1e9));
      tx = std::max(tx, double(xs[size_t(q)]) / (o.shared_gbps * 1e9) +
                            double(xn[size_t(q)]) / (o.network_gbps * 1e9));
      r.flat.shared_bytes[size_t(q)] += fs[size_t(q)];
      r.flat.network_bytes[size_t(q)] += fn[size_t(q)];
      r.flex.shared_bytes[size_t(q)] += xs[size_t(q)];
      r.flex.network_bytes[size_t(q)] += xn[size_t(q)];
    }
    r.flat.seconds += tf;
    r.flex.seconds += tx;
    (void)N;
  }
  for (int64_t d : r.dropped_per_expert) r.dropped += d;
  return r;
}

void expect_same_counts(const ReplayResult& got, const ReplayResult& want) {
  EXPECT_EQ(got.routed_per_expert, want.routed_per_expert);
  EXPECT_EQ(got.tokens_per_expert, want.tokens_per_expert);
  EXPECT_EQ(got.dropped_per_expert, want.dropped_per_expert);
  EXPECT_EQ(got.dropped, want.dropped);
  EXPECT_EQ(got.rows_per_rank, want.rows_per_rank);
  EXPECT_EQ(got.tokens_per_rank, want.tokens_per_rank);
  EXPECT_EQ(got.traffic, want.traffic);
  EXPECT_EQ(got.flat.shared_bytes, want.flat.shared_bytes);
  EXPECT_EQ(got.flat.network_bytes, want.flat.network_bytes);
  EXPECT_EQ(got.flex.shared_bytes, want.flex.shared_bytes);
  EXPECT_EQ(got.flex.network_bytes, want.flex.network_bytes);
  EXPECT_DOUBLE_EQ(got.flat.seconds, want.flat.seconds);
  EXPECT_DOUBLE_EQ(got.flex.seconds, want.flex.seconds);
}

// The worked example: 4 tokens, top-2, 4 experts on 2 ranks, one rank per node, rows of 8 bytes.
TEST(Replay, HandCountedExample) {
  const RoutingTrace tr = make_trace(1, 4, 2, {0, 2, 1, -1, 2, 3, 0, 3});
  ReplayOptions o{.num_ranks = 2,
                  .ranks_per_node = 1,
                  .capacity_factor = std::nullopt,  // dropless; cf 0.5 below
                  .hidden = 4,
                  .dtype_bytes = 2};
  StatusOr<ReplayResult> r = replay_trace(tr, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->num_experts, 4);  // max index + 1
  EXPECT_EQ(r->tokens_per_expert, (std::vector<int64_t>{2, 1, 2, 2}));
  EXPECT_EQ(r->rows_per_rank, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(r->traffic, (std::vector<int64_t>{2, 1, 1, 2}));
  EXPECT_EQ(r->tokens_per_rank, (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(r->dropped, 0);
  // Flat: t0 (rank 0 -> rank 1) and t3 (rank 1 -> rank 0) cross, 8 bytes each.
  EXPECT_EQ(r->flat.network_bytes, (std::vector<int64_t>{8, 8}));
  // Flex: the same two tokens, each 8 + the header + one expert entry.
  const int64_t flex_bytes = 8 + kFlexTokenHeaderBytes + kFlexEntryBytes;
  EXPECT_EQ(r->flex.network_bytes, (std::vector<int64_t>{flex_bytes, flex_bytes}));
  EXPECT_EQ(r->flat.shared_bytes, (std::vector<int64_t>{16, 16}));
  // Flex: rank 0 writes t0, t1 to itself and forwards t3 (for rank 0): 3 rows.
  EXPECT_EQ(r->flex.shared_bytes, (std::vector<int64_t>{24, 24}));
  EXPECT_DOUBLE_EQ(r->expert_imbalance, 2.0 / 1.75);
  EXPECT_DOUBLE_EQ(r->flat.seconds, 16 / 160e9 + 8 / 50e9);

  // cf 0.5: C = ceil(2 * 2 / 4 * 0.5) = 1; rank 1 sends t2 and t3 to expert 3: t3 is dropped.
  o.capacity_factor = 0.5;
  r = replay_trace(tr, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->capacity, 1);
  EXPECT_EQ(r->dropped, 1);
  EXPECT_EQ(r->dropped_per_expert, (std::vector<int64_t>{0, 0, 0, 1}));
  EXPECT_EQ(r->tokens_per_expert, (std::vector<int64_t>{2, 1, 2, 1}));
  EXPECT_EQ(r->routed_per_expert, (std::vector<int64_t>{2, 1, 2, 2}));
}

TEST(Replay, MatchesDirectCount) {
  struct Case {
    int64_t steps, T;
    int K, E, R, G;
    std::optional<double> cf;
    bool skewed;
  };
  const Case cases[] = {{1, 24, 2, 8, 4, 2, {}, false},   {3, 30, 3, 12, 3, 1, 1.0, true},
                        {2, 64, 8, 32, 8, 4, 1.2, false}, {1, 12, 1, 6, 6, 3, 0.5, true},
                        {2, 16, 4, 4, 4, 4, {}, true},    {1, 0, 2, 8, 2, 1, 1.0, false},
                        {1, 35, 7, 7, 7, 7, 2.0, false}};
  uint32_t seed = 1;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "T=" << c.T << " K=" << c.K << " E=" << c.E << " R=" << c.R << " G=" << c.G);
    const RoutingTrace tr = random_trace(c.steps, c.T, c.K, c.E, seed++, c.skewed);
    const ReplayOptions o{.num_experts = c.E,
                          .num_ranks = c.R,
                          .ranks_per_node = c.G,
                          .capacity_factor = c.cf,
                          .hidden = 96,
                          .dtype_bytes = 2,
                          .shared_gbps = 100,
                          .network_gbps = 25};
    StatusOr<ReplayResult> r = replay_trace(tr, o);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    expect_same_counts(*r, direct(tr, o));
    EXPECT_EQ(int64_t(r->flat.step_seconds.size()), c.steps);
    if (c.G == c.R) {
      EXPECT_EQ(r->flat.total_network_bytes(), 0);
      EXPECT_EQ(r->flex.total_network_bytes(), 0);
    }
  }
}

TEST(Replay, Errors) {
  const RoutingTrace tr = make_trace(1, 4, 2, {0, 2, 1, -1, 2, 3, 0, 3});
  ReplayOptions o;
  o.num_ranks = 2;
  o.num_experts = 3;
  auto message = [&](const ReplayOptions& opt) {
    StatusOr<ReplayResult> r = replay_trace(tr, opt);
    EXPECT_FALSE(r.ok());
    return r.ok() ? std::string() : r.status().message();
  };
  // E = 3 is not a multiple of 2 ranks; with E = 2 the index 3 is out of range.
  EXPECT_EQ(message(o), "experts = 3 is not a multiple of --ranks = 2");
  o.num_experts = 2;
  EXPECT_EQ(message(o), "trace.npy: step 0: topk_idx[0][1] = 2 is outside [-1, 2)");
  o.num_experts = 4;
  o.num_ranks = 4;
  o.ranks_per_node = 3;
  EXPECT_EQ(message(o), "--ranks-per-node = 3 does not divide --ranks = 4");
  o.ranks_per_node = 0;
  o.num_ranks = 4;
  const RoutingTrace odd = make_trace(1, 3, 2, {0, 1, 2, 3, 1, 0});
  StatusOr<ReplayResult> r = replay_trace(odd, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(),
            "trace.npy: 3 tokens per step do not split evenly over --ranks = 4");
  o.num_ranks = 2;
  o.capacity_factor = 1.0;
  o.drop_policy = DropPolicy::kProbs;
  EXPECT_EQ(message(o), "--drop-policy probs: a trace has no probs; use position");
  o.drop_policy = DropPolicy::kPosition;
  const RoutingTrace repeat = make_trace(1, 2, 2, {1, 1, 0, 1});
  r = replay_trace(repeat, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "trace.npy: step 0: topk_idx[0] repeats expert 1 (at k = 0 and k = 1)");
}

TEST(Replay, ReadsTraceFiles) {
  const std::string dir = ::testing::TempDir() + "moed_replay_read/";
  std::filesystem::create_directories(dir);
  const std::vector<int64_t> idx64 = {0, 3, -1, 2, 1, 0, 2, 3, 3, -1, 0, 1};
  ASSERT_TRUE(write_npy(dir + "t.npy", NpyDType::kI64, {2, 3, 2}, idx64.data()).ok());
  StatusOr<RoutingTrace> t = read_routing_trace(dir + "t.npy");
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->num_steps, 2);
  EXPECT_EQ(t->num_tokens, 3);
  EXPECT_EQ(t->num_topk, 2);
  EXPECT_EQ(t->idx(1, 1, 1), -1);
  EXPECT_EQ(t->max_index(), 3);

  const std::vector<int32_t> bad = {0, -2};
  ASSERT_TRUE(write_npy(dir + "bad.npy", NpyDType::kI32, {1, 2}, bad.data()).ok());
  t = read_routing_trace(dir + "bad.npy");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), dir + "bad.npy: topk_idx[0][0][1] = -2 is below -1");
  const std::vector<float> f = {0, 1};
  ASSERT_TRUE(write_npy(dir + "f.npy", NpyDType::kF32, {1, 2}, f.data()).ok());
  t = read_routing_trace(dir + "f.npy");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(),
            dir + "f.npy: dtype '<f4'; a trace holds int32 or int64 expert indices");
  ASSERT_TRUE(write_npy(dir + "1d.npy", NpyDType::kI32, {2}, bad.data()).ok());
  t = read_routing_trace(dir + "1d.npy");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(),
            dir + "1d.npy: shape (2,); a trace is [tokens, topk] or [steps, tokens, topk]");
  std::filesystem::remove_all(dir);
}

TEST(Svg, Helpers) {
  EXPECT_EQ(svg::escape("a<b & \"c\">'"), "a&lt;b &amp; &quot;c&quot;&gt;&apos;");
  EXPECT_EQ(svg::nice_ticks(0, 5), (std::vector<double>{0, 1}));
  EXPECT_EQ(svg::nice_ticks(3, 5), (std::vector<double>{0, 1, 2, 3}));
  EXPECT_EQ(svg::nice_ticks(97, 5), (std::vector<double>{0, 20, 40, 60, 80, 100}));
  EXPECT_EQ(svg::nice_ticks(1000, 5), (std::vector<double>{0, 200, 400, 600, 800, 1000}));
  EXPECT_EQ(svg::index_ticks(256, 16).size(), 16u);
  EXPECT_EQ(svg::index_ticks(256, 16)[1], 16);
  EXPECT_EQ(svg::index_ticks(64, 16)[1], 4);
  EXPECT_EQ(svg::index_ticks(7, 16).size(), 7u);
  EXPECT_EQ(svg::short_number(1500), "1500");
  EXPECT_EQ(svg::short_number(25000), "25k");
  EXPECT_EQ(svg::short_number(3.5e6), "3.5M");
  EXPECT_EQ(svg::viridis(0), "#440154");
  EXPECT_EQ(svg::viridis(1), "#fde725");
}

// Every opened tag is closed in order (the Python CTest check parses the files fully).
bool tags_balanced(const std::string& doc) {
  std::vector<std::string> open;
  for (size_t i = doc.find('<'); i != std::string::npos; i = doc.find('<', i + 1)) {
    const size_t end = doc.find('>', i);
    if (end == std::string::npos) return false;
    const std::string tag = doc.substr(i + 1, end - i - 1);
    if (tag.empty() || tag[0] == '?' || tag[0] == '!') continue;
    if (tag[0] == '/') {
      if (open.empty() || open.back() != tag.substr(1)) return false;
      open.pop_back();
    } else if (tag.back() != '/') {
      open.push_back(tag.substr(0, tag.find_first_of(" \n")));
    }
  }
  return open.empty();
}

TEST(Svg, PicturesShowAxesLegendAndNodes) {
  const RoutingTrace tr = random_trace(2, 256, 8, 256, 7, true);
  ReplayOptions o{.num_experts = 256, .num_ranks = 16, .ranks_per_node = 8, .capacity_factor = 1.0};
  StatusOr<ReplayResult> r = replay_trace(tr, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_GT(r->dropped, 0);
  const std::string heat = traffic_heatmap_svg(*r);
  EXPECT_TRUE(tags_balanced(heat));
  for (const char* s : {"source rank", "destination rank", "tokens sent", "node boundary (8 ranks)",
                        "linearGradient", "Dispatch traffic"}) {
    EXPECT_NE(heat.find(s), std::string::npos) << s;
  }
  const std::string load = expert_load_svg(*r);
  EXPECT_TRUE(tags_balanced(load));
  for (const char* s :
       {">expert<", "tokens routed (token-expert pairs)", "legend", "mean routed = ", "dropped (",
        "capacity = ", "rank boundary (16 experts)", ">240<"}) {
    EXPECT_NE(load.find(s), std::string::npos) << s;
  }
  // One node: no boundary lines, no boundary legend.
  o.ranks_per_node = 16;
  r = replay_trace(tr, o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(traffic_heatmap_svg(*r).find("node boundary"), std::string::npos);

  const std::string dir = ::testing::TempDir() + "moed_replay_pictures/";
  StatusOr<ReplayPictures> p = write_replay_pictures(*r, dir);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  ASSERT_GE(p->files.size(), 2u);
  EXPECT_EQ(p->files[0], dir + "traffic.svg");
  EXPECT_EQ(p->files[1], dir + "expert_load.svg");
  EXPECT_EQ(p->files.size(), p->converter.empty() ? 2u : 4u);
  for (const std::string& f : p->files) EXPECT_GT(std::filesystem::file_size(f), 0u) << f;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moed
