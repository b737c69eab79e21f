// The plan model's mechanisms against a direct count written here from the routing alone
// (plan_routing): CPU-proxy message costs, SM-limited copies, one- and two-round floors, the
// sources' bandwidth conventions, pplx's one write per peer; then the validation table's
// invariants (every source present, every miss with its reason) and the presets' citations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "moed/plan.h"
#include "support/sanitizers.h"

namespace moed {
namespace {

// Per source rank s: pairs[d] (token, expert) pairs on rank d, toks[d] tokens with an expert on
// d, tok_node[m] tokens with an expert on node m.
struct Counts {
  std::vector<std::vector<int64_t>> pairs, toks, tok_node;
};

Counts count(const PlanOptions& o) {
  const int R = o.ep, G = o.ranks_per_node, L = o.experts / R;
  Counts c;
  for (int s = 0; s < R; ++s) {
    std::vector<int32_t> idx = plan_routing(o, s).value();
    std::vector<int64_t> pairs(size_t(R), 0), toks(size_t(R), 0), nodes(size_t(R / G), 0);
    for (int64_t t = 0; t < o.tokens; ++t) {
      std::set<int> ranks, ns;
      for (int k = 0; k < o.topk; ++k) {
        const int32_t e = idx[size_t(t * o.topk + k)];
        if (e < 0) continue;
        ++pairs[size_t(e / L)];
        ranks.insert(e / L);
        ns.insert(e / L / G);
      }
      for (int d : ranks) ++toks[size_t(d)];
      for (int m : ns) ++nodes[size_t(m)];
    }
    c.pairs.push_back(pairs);
    c.toks.push_back(toks);
    c.tok_node.push_back(nodes);
  }
  return c;
}

PlanOptions base(const char* cluster, int ep, int G, int64_t T) {
  PlanOptions o;
  o.cluster = cluster_preset(cluster).value();
  o.ep = ep;
  o.ranks_per_node = G;
  o.tokens = T;
  o.hidden = 1024;
  o.topk = 4;
  o.experts = 4 * ep;
  o.seed = 7;
  return o;
}

// Low-latency through a CPU proxy on EFA: each rank's network time is its bytes at line rate
// plus Cluster::proxy_message_us per (token, expert) message to another node; one round.
TEST(PlanModel, ProxyMessagesCostEachOnEfa) {
  PlanOptions o = base("h200-efa", 8, 2, 96);
  o.low_latency = true;
  o.cpu_proxy = true;
  const PlanResult r = plan(o).value();
  const Counts c = count(o);
  const int R = o.ep, G = o.ranks_per_node;
  const int64_t row = o.hidden + o.hidden / 128 * 4 + 16;
  const Cluster& k = o.cluster;
  ASSERT_DOUBLE_EQ(k.proxy_message_us, 0.40);
  double worst = 0;
  for (int r0 = 0; r0 < R; ++r0) {
    int64_t nvl_s = 0, nvl_r = 0, net_s = 0, net_r = 0, msgs = 0;
    for (int d = 0; d < R; ++d) {
      const bool same = d / G == r0 / G;
      (same ? nvl_s : net_s) += c.pairs[size_t(r0)][size_t(d)] * row;
      (same ? nvl_r : net_r) += c.pairs[size_t(d)][size_t(r0)] * row;
      if (!same) msgs += c.pairs[size_t(r0)][size_t(d)];
    }
    const double t = std::max(double(std::max(nvl_s, nvl_r)) / (k.nvl_gbps * 1e9),
                              double(std::max(net_s, net_r)) / (k.net_gbps * 1e9) +
                                  1e-6 * k.proxy_message_us * double(msgs));
    worst = std::max(worst, t);
    EXPECT_EQ(r.algorithm("low-latency").dispatch.net_messages[size_t(r0)], msgs) << r0;
  }
  EXPECT_NEAR(r.dispatch_seconds, worst + 1e-6 * (k.fixed_us / 2 + k.net_latency_us), 1e-12);
  // GPU-initiated: the same bytes without the messages.
  o.cpu_proxy = false;
  EXPECT_LT(plan(o).value().dispatch_seconds, r.dispatch_seconds);
}

// Flex on one node with too few SMs: the intra-node bytes move at SMs x the per-SM rate.
TEST(PlanModel, SmLimitedCopies) {
  PlanOptions o = base("b200", 8, 8, 256);
  o.sms = 4;
  o.sm_dispatch_gbps = 10.0;  // 40 GB/s in all, far below B200's NVLink
  o.sm_combine_gbps = 20.0;
  const PlanResult r = plan(o).value();
  const Counts c = count(o);
  const int64_t row_d = o.hidden + o.hidden / 128 * 4, row_c = 2 * o.hidden;
  int64_t busiest = 0;
  for (int s = 0; s < o.ep; ++s) {
    int64_t sent = 0, recv = 0;
    for (int d = 0; d < o.ep; ++d) {
      sent += c.toks[size_t(s)][size_t(d)];
      recv += c.toks[size_t(d)][size_t(s)];
    }
    busiest = std::max({busiest, sent, recv});
  }
  const Cluster& k = o.cluster;
  EXPECT_NEAR(r.dispatch_seconds,
              double(busiest * row_d) / 40e9 + 1e-6 * (k.fixed_us + k.nvl_latency_us), 1e-12);
  EXPECT_NEAR(r.combine_seconds,
              double(busiest * row_c) / 80e9 + 1e-6 * (k.fixed_us + k.nvl_latency_us), 1e-12);
  o.sms = 0;  // unlimited: NVLink's own rate
  EXPECT_NEAR(plan(o).value().dispatch_seconds,
              double(busiest * row_d) / (k.nvl_gbps * 1e9) + 1e-6 * (k.fixed_us + k.nvl_latency_us),
              1e-12);
}

// The numerators of the sources' GB/s: DeepEP's, V2's (index and weight per slot), MORI's
// (payload only), at 2 nodes where (token, node) pairs count, own node included.
TEST(PlanModel, Conventions) {
  PlanOptions o = base("h100", 8, 4, 64);
  const Counts c = count(o);
  int64_t pairs = 0;
  for (const auto& n : c.tok_node) {
    for (int64_t v : n) pairs += v;
  }
  const int64_t H = o.hidden, K = o.topk, R = o.ep;
  const int64_t row = H + H / 128 * 4;
  struct Case {
    Convention conv;
    bool fp8;
    int64_t d, c;
  };
  for (const Case& k : {Case{Convention::kDeepEP, true, row, 2 * H},
                        Case{Convention::kDeepEPv2, true, row + 12 * K, 2 * H + 4 * K},
                        Case{Convention::kPayload, true, H, 2 * H},
                        Case{Convention::kPayload, false, 2 * H, 2 * H}}) {
    o.convention = k.conv;
    o.fp8_dispatch = k.fp8;
    const PlanResult r = plan(o).value();
    EXPECT_EQ(r.published.dispatch, pairs * k.d / R);
    EXPECT_EQ(r.published.combine, pairs * k.c / R);
    EXPECT_EQ(r.published.link, "RDMA");
    EXPECT_DOUBLE_EQ(r.dispatch_gbps, double(r.published.dispatch) / r.dispatch_seconds / 1e9);
  }
}

// pplx: the low-latency rows without their 16-byte header, one write per peer on another node,
// and two network rounds (counts, then rows) in dispatch.
TEST(PlanModel, PplxOneWritePerPeer) {
  PlanOptions o = base("h200-efa", 16, 8, 4);  // 4 tokens: not every peer gets rows
  o.algorithm = "pplx";
  o.cpu_proxy = true;
  const PlanResult r = plan(o).value();
  const Counts c = count(o);
  const LinkCost& d = r.algorithm("pplx").dispatch;
  for (int s = 0; s < o.ep; ++s) {
    int64_t peers = 0;
    for (int q = 0; q < o.ep; ++q) peers += q / 8 != s / 8 && c.pairs[size_t(s)][size_t(q)] > 0;
    EXPECT_EQ(d.net_messages[size_t(s)], peers) << s;
  }
  const Cluster& k = o.cluster;
  EXPECT_GT(d.seconds, 1e-6 * (k.fixed_us + 2 * k.net_latency_us));
  EXPECT_EQ(r.reported, "pplx");
  EXPECT_EQ(r.published.link, "RDMA");
  PlanOptions bad = o;
  bad.algorithm = "ring";
  EXPECT_EQ(plan(bad).status().message(),
            "--algorithm 'ring' is not one of flat, alltoall, flex, low-latency, pplx");
}

TEST(PlanValidate, EverySourceAndEveryMissHasItsReason) {
  if (testing::kUnderTsan) GTEST_SKIP() << "no threads of its own (support/sanitizers.h)";
  const std::vector<ValidationRow> rows = validate_plan().value();
  std::set<std::string> seen;
  int within = 0;
  for (const ValidationRow& v : rows) {
    seen.insert(v.source);
    within += v.within();
    EXPECT_TRUE(v.published_gbps > 0 || v.published_us > 0);
    const double want = v.published_gbps > 0 ? v.predicted_gbps / v.published_gbps
                                             : v.published_us / v.predicted_us;
    EXPECT_DOUBLE_EQ(v.ratio, want);
    if (!v.within()) {
      EXPECT_FALSE(v.note.empty()) << v.source << " " << v.table << " EP" << v.ep;
    }
  }
  for (const PublishedSource& s : published_sources()) {
    EXPECT_TRUE(seen.count(s.name)) << s.name;
    EXPECT_FALSE(s.citation.empty());
  }
  EXPECT_EQ(seen.size(), published_sources().size());
  EXPECT_EQ(validation_summary(rows).rfind(std::to_string(within) + " of " +
                                               std::to_string(rows.size()) + " rows within",
                                           0),
            0u);
  // Today's DeepEP V1 tables (docs/legacy.md) are all within the target.
  for (const ValidationRow& v : rows) {
    if (v.source == "DeepEP V1" && v.table.find('@') == std::string::npos) {
      EXPECT_TRUE(v.within()) << v.table << " EP" << v.ep << " " << v.phase;
    }
  }
}

TEST(PlanValidate, PresetsFollowTheirSpecifications) {
  for (const Cluster& c : cluster_presets()) {
    SCOPED_TRACE(c.name);
    EXPECT_FALSE(c.sources.empty());
    EXPECT_DOUBLE_EQ(c.net_gbps, 50.0);  // every preset's NIC is 400 Gb/s per GPU
    const bool efa = c.name.find("efa") != std::string::npos;
    EXPECT_DOUBLE_EQ(c.proxy_message_us, efa ? 0.40 : 0.0);
    EXPECT_DOUBLE_EQ(c.net_latency_us, efa ? 15.0 : 3.0);
  }
  EXPECT_DOUBLE_EQ(cluster_preset("h800").value().nvl_gbps, 160.0);   // DeepEP's ~160 GB/s
  EXPECT_DOUBLE_EQ(cluster_preset("b200").value().nvl_gbps, 720.0);   // 0.8 x 1800 / 2
  EXPECT_DOUBLE_EQ(cluster_preset("mi300x").value().nvl_gbps, 358.4);  // 0.8 x 896 / 2
  EXPECT_EQ(cluster_preset("gb200").value().ranks_per_node, 72);
}

// A sweep is plan() at each value, every algorithm; E rises to a multiple of EP past it; the
// published rows beside it are those of its cluster and tokens, their GB/s turned into time.
TEST(PlanSweep, PointsArePlanAtEachValue) {
  PlanOptions o = base("h800", 8, 8, 128);
  o.hidden = 7168;
  o.topk = 8;
  o.experts = 16;
  o.low_latency = true;
  const SweepResult sw = plan_sweep(o, "ep=8,16,32").value();
  ASSERT_EQ(sw.points.size(), 3u);
  EXPECT_EQ(sw.algorithms.size(), 5u);
  for (const SweepPoint& p : sw.points) {
    PlanOptions x = o;
    x.ep = int(p.value);
    x.experts = p.value <= 16 ? 16 : 32;
    EXPECT_EQ(p.experts, x.experts);
    const PlanResult r = plan(x).value();
    for (size_t a = 0; a < sw.algorithms.size(); ++a) {
      const AlgorithmCost& c = r.algorithm(sw.algorithms[a]);
      EXPECT_DOUBLE_EQ(p.dispatch_us[a], c.dispatch.seconds * 1e6);
      EXPECT_DOUBLE_EQ(p.combine_gbps[a],
                       double(r.published_for(sw.algorithms[a]).combine) / c.combine.seconds / 1e9);
    }
  }
  ASSERT_FALSE(sw.published.empty());
  for (const ValidationRow& v : sw.published) {
    EXPECT_EQ(v.cluster, "h800");
    EXPECT_EQ(v.tokens, 128);
    if (v.published_us > 0) {
      EXPECT_EQ(v.implied_us, v.published_us);
    } else {
      EXPECT_NEAR(v.implied_us * v.published_gbps, v.predicted_us * v.predicted_gbps, 1e-6);
    }
  }
  EXPECT_EQ(plan_sweep(o, "ep=16,8").status().message(),
            "--sweep 'ep=16,8': values must ascend (8 after 16)");
  EXPECT_EQ(plan_sweep(o, "gpus=8").status().message(),
            "--sweep 'gpus=8' is not ep=V1,V2,... or tokens=V1,V2,...");
  EXPECT_EQ(plan_sweep(o, "ep=8,x").status().message(),
            "--sweep 'ep=8,x': 'x' is not a whole number >= 1");
  EXPECT_EQ(plan_sweep(o, "ep=8,4096").status().message(), "--sweep 'ep=8,4096': EP 4096 is above 2048");
  const SweepResult tok = plan_sweep(o, "tokens=1,128,4096").value();
  EXPECT_EQ(tok.points[2].value, 4096);
  EXPECT_LT(tok.points[0].dispatch_us[3], tok.points[2].dispatch_us[3]);
}

}  // namespace
}  // namespace moed
