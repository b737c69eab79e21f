// The plan model (moed/plan.h) against moed itself: for the same routing, the model's per-rank
// shared / network bytes equal what AlltoAll and Flex add to World::counters() on the threads
// world, dispatch and combine, at several node splits. Control traffic (count all-gathers,
// agreements) does not depend on the routing; it is measured once with a routing that routes
// nothing and taken off, and a second, different routing checks that it really is constant.
#include "moed/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <mutex>

#include "moed/dispatcher.h"
#include "moed/low_latency.h"
#include "moed/threads_world.h"

namespace moed {
namespace {

struct Measured {
  std::vector<int64_t> d_shared, d_network, c_shared, c_network;
};

// One rank's counters of a dispatch and of the combine after it.
struct StepCounters {
  TrafficCounters dispatch, combine;
};
using RunSteps = std::function<StatusOr<StepCounters>(World&, const TopkRouting&)>;

// Runs run_steps on every rank of o's threads world with the routing plan_routing(o, rank)
// (or one that routes nothing) and collects every rank's shared and network bytes.
StatusOr<Measured> measure_steps(const PlanOptions& o, bool empty, const RunSteps& run_steps) {
  const int R = o.ep;
  Measured m;
  for (auto* v : {&m.d_shared, &m.d_network, &m.c_shared, &m.c_network}) v->assign(size_t(R), 0);
  std::mutex mu;
  WorldOptions wo;
  wo.ranks_per_node = o.ranks_per_node;
  wo.threads_per_rank = 1;
  Status s = run_threads(R, wo, [&](World& w) -> Status {
    const int r = w.rank();
    TopkRouting topk;
    topk.num_tokens = o.tokens;
    topk.num_topk = o.topk;
    if (empty) {
      topk.topk_idx.assign(size_t(o.tokens) * o.topk, -1);
    } else {
      MOED_ASSIGN_OR_RETURN(topk.topk_idx, plan_routing(o, r));
    }
    topk.topk_weights.assign(topk.topk_idx.size(), 0.5f);
    MOED_ASSIGN_OR_RETURN(const StepCounters c, run_steps(w, topk));
    std::lock_guard<std::mutex> lock(mu);
    m.d_shared[size_t(r)] = int64_t(c.dispatch.shared_bytes);
    m.d_network[size_t(r)] = int64_t(c.dispatch.network_bytes);
    m.c_shared[size_t(r)] = int64_t(c.combine.shared_bytes);
    m.c_network[size_t(r)] = int64_t(c.combine.network_bytes);
    return ok_status();
  });
  if (!s.ok()) return s;
  return m;
}

// Dispatch + combine of bf16 (or fp8) rows with a dispatcher of `kind`.
StatusOr<Measured> measure(const PlanOptions& o, DispatcherKind kind, bool empty) {
  return measure_steps(o, empty, [&](World& w, const TopkRouting& topk) -> StatusOr<StepCounters> {
    DispatchConfig cfg{.kind = kind, .num_experts = o.experts};
    MOED_ASSIGN_OR_RETURN(auto d, TokenDispatcher::create(w, cfg));
    // fp8 rows carry one fp32 scale per 128 values, as the model charges.
    Tensor x = Tensor::zeros(o.fp8_dispatch ? DType::kFP8 : DType::kBF16, o.tokens, o.hidden);
    Tensor sc = o.fp8_dispatch ? Tensor::zeros(DType::kF32, o.tokens, o.hidden / 128) : Tensor();
    StepCounters c;
    w.reset_counters();
    MOED_ASSIGN_OR_RETURN(
        DispatchOutput out,
        d->dispatch({.hidden = {x.view(), o.fp8_dispatch ? sc.view() : TensorView()},
                     .topk = TopkView::of(topk)}));
    c.dispatch = w.counters();
    Tensor y = Tensor::zeros(DType::kBF16, out.num_rows(), o.hidden);
    w.reset_counters();
    MOED_RETURN_IF_ERROR(
        d->combine({.expert_output = {y.view(), TensorView()}, .handle = out.handle}).status());
    c.combine = w.counters();
    return c;
  });
}

// The same for moed's low-latency buffer (M = T, fp8 cast on the way when asked).
StatusOr<Measured> measure_low_latency(const PlanOptions& o, bool empty) {
  return measure_steps(o, empty, [&](World& w, const TopkRouting& topk) -> StatusOr<StepCounters> {
    MOED_ASSIGN_OR_RETURN(auto buf,
                          LowLatencyBuffer::create(w, o.tokens, int(o.hidden), o.experts));
    Tensor x = Tensor::zeros(DType::kBF16, o.tokens, o.hidden);
    StepCounters c;
    w.reset_counters();
    MOED_ASSIGN_OR_RETURN(
        LowLatencyDispatchOutput d,
        buf->low_latency_dispatch(
            {.x = x.view(), .topk = TopkView::of(topk), .use_fp8 = o.fp8_dispatch}));
    c.dispatch = w.counters();
    Tensor y = Tensor::zeros(DType::kBF16, d.num_local_experts * d.rows_per_expert, o.hidden);
    w.reset_counters();
    MOED_RETURN_IF_ERROR(
        buf->low_latency_combine({.x = y.view(), .topk = TopkView::of(topk), .handle = d.handle})
            .status());
    c.combine = w.counters();
    return c;
  });
}

std::vector<int64_t> minus(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  std::vector<int64_t> v(a.size());
  for (size_t i = 0; i < a.size(); ++i) v[i] = a[i] - b[i];
  return v;
}

struct Split {
  int ranks, per_node, experts, topk;
  int64_t tokens, hidden;
  PlanRouting routing;
  bool fp8 = false;
};

class PlanCounters : public ::testing::TestWithParam<Split> {};

TEST_P(PlanCounters, ModelBytesEqualMeasuredCounters) {
  const Split sp = GetParam();
  PlanOptions o;
  o.cluster = *cluster_preset("h800");
  o.ep = sp.ranks;
  o.ranks_per_node = sp.per_node;
  o.tokens = sp.tokens;
  o.hidden = sp.hidden;
  o.topk = sp.topk;
  o.experts = sp.experts;
  o.fp8_dispatch = sp.fp8;
  o.routing = sp.routing;
  o.zipf_s = 1.2;
  for (uint64_t seed : {1u, 7u}) {
    o.seed = seed;
    StatusOr<PlanResult> r = plan(o);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    for (DispatcherKind kind : {DispatcherKind::kAlltoAll, DispatcherKind::kFlex}) {
      const bool flex = kind == DispatcherKind::kFlex;
      SCOPED_TRACE(std::string(flex ? "flex" : "alltoall") + " seed " + std::to_string(seed));
      StatusOr<Measured> base = measure(o, kind, true);
      StatusOr<Measured> got = measure(o, kind, false);
      ASSERT_TRUE(base.ok()) << base.status().to_string();
      ASSERT_TRUE(got.ok()) << got.status().to_string();
      const CounterBytes& d = flex ? r->moed.flex_dispatch : r->moed.alltoall_dispatch;
      const CounterBytes& c = flex ? r->moed.flex_combine : r->moed.alltoall_combine;
      EXPECT_EQ(minus(got->d_shared, base->d_shared), d.shared) << "dispatch shared";
      EXPECT_EQ(minus(got->d_network, base->d_network), d.network) << "dispatch network";
      EXPECT_EQ(minus(got->c_shared, base->c_shared), c.shared) << "combine shared";
      EXPECT_EQ(minus(got->c_network, base->c_network), c.network) << "combine network";
    }
    SCOPED_TRACE("low-latency seed " + std::to_string(seed));
    StatusOr<Measured> base = measure_low_latency(o, true);
    StatusOr<Measured> got = measure_low_latency(o, false);
    ASSERT_TRUE(base.ok()) << base.status().to_string();
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(minus(got->d_shared, base->d_shared), r->moed.low_latency_dispatch.shared);
    EXPECT_EQ(minus(got->d_network, base->d_network), r->moed.low_latency_dispatch.network);
    EXPECT_EQ(minus(got->c_shared, base->c_shared), r->moed.low_latency_combine.shared);
    EXPECT_EQ(minus(got->c_network, base->c_network), r->moed.low_latency_combine.network);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Splits, PlanCounters,
    ::testing::Values(Split{4, 4, 8, 2, 32, 40, PlanRouting::kUniform},  // one node
                      Split{4, 2, 8, 2, 32, 40, PlanRouting::kUniform},  // 2 x 2
                      Split{8, 2, 16, 4, 24, 24, PlanRouting::kZipf},    // 4 x 2, skewed
                      Split{6, 3, 12, 3, 18, 56, PlanRouting::kGroup},   // 2 x 3, grouped
                      Split{5, 1, 5, 5, 10, 16, PlanRouting::kUniform},  // 5 nodes of 1, k = E
                      Split{7, 7, 7, 1, 21, 32, PlanRouting::kZipf},     // odd, k = 1
                      Split{4, 2, 8, 3, 16, 256, PlanRouting::kGroup, true}));  // fp8 dispatch

// A trace with -1 slots and a rank whose tokens route nothing, on 2 nodes of 3.
TEST(Plan, TraceWithEmptyRankMatchesCounters) {
  RoutingTrace trace;
  trace.name = "test";
  trace.num_tokens = 6 * 10;
  trace.num_topk = 3;
  uint64_t x = 12345;
  for (int64_t t = 0; t < trace.num_tokens; ++t) {
    std::vector<int32_t> row;
    while (row.size() < 3) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const int32_t e = int32_t((x >> 33) % 13) - 1;  // -1 .. 11
      if (e >= 0 && std::find(row.begin(), row.end(), e) != row.end()) continue;
      row.push_back(t / 10 == 4 ? -1 : e);  // rank 4 routes nothing
    }
    trace.topk_idx.insert(trace.topk_idx.end(), row.begin(), row.end());
  }
  PlanOptions o;
  o.cluster = *cluster_preset("h100");
  o.ep = 6;
  o.ranks_per_node = 3;
  o.hidden = 48;
  o.experts = 12;
  o.fp8_dispatch = false;
  o.routing = PlanRouting::kTrace;
  o.trace = &trace;
  StatusOr<PlanResult> r = plan(o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->options.tokens, 10);
  o.tokens = 10;
  o.topk = 3;
  for (DispatcherKind kind : {DispatcherKind::kAlltoAll, DispatcherKind::kFlex}) {
    const bool flex = kind == DispatcherKind::kFlex;
    StatusOr<Measured> base = measure(o, kind, true);
    StatusOr<Measured> got = measure(o, kind, false);
    ASSERT_TRUE(base.ok() && got.ok());
    const CounterBytes& d = flex ? r->moed.flex_dispatch : r->moed.alltoall_dispatch;
    const CounterBytes& c = flex ? r->moed.flex_combine : r->moed.alltoall_combine;
    EXPECT_EQ(minus(got->d_shared, base->d_shared), d.shared);
    EXPECT_EQ(minus(got->d_network, base->d_network), d.network);
    EXPECT_EQ(minus(got->c_shared, base->c_shared), c.shared);
    EXPECT_EQ(minus(got->c_network, base->c_network), c.network);
  }
}

// No tokens: only the fixed cost and the hops remain.
TEST(Plan, ZeroTokens) {
  PlanOptions o;
  o.cluster = *cluster_preset("h800");
  o.ep = 16;
  o.tokens = 0;
  StatusOr<PlanResult> r = plan(o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->dispatch_seconds, 1e-6 * (40.0 + 1.0 + 3.0));
  EXPECT_EQ(r->dispatch_gbps, 0.0);
}

TEST(Plan, BadOptionsNameTheValue) {
  PlanOptions o;
  o.cluster = *cluster_preset("h800");
  struct Case {
    void (*set)(PlanOptions&);
    const char* message;
  };
  const Case cases[] = {
      {[](PlanOptions& x) { x.ep = 4096; }, "--ep = 4096"},
      {[](PlanOptions& x) { x.ranks_per_node = 3; }, "--ranks-per-node = 3"},
      {[](PlanOptions& x) { x.experts = 12; }, "--experts = 12"},
      {[](PlanOptions& x) { x.topk = 300; }, "--topk = 300"},
      {[](PlanOptions& x) { x.hidden = 100; }, "--hidden = 100"},
      {[](PlanOptions& x) {
         x.routing = PlanRouting::kGroup;
         x.num_groups = 8;
         x.group_topk = 9;
       },
       "--group-topk = 9"},
  };
  for (const Case& c : cases) {
    PlanOptions x = o;
    c.set(x);
    StatusOr<PlanResult> r = plan(x);
    const std::string got = r.ok() ? std::string("ok") : r.status().message();
    EXPECT_NE(got.find(c.message), std::string::npos) << got;
  }
  EXPECT_FALSE(cluster_preset("a100").ok());
  EXPECT_NE(cluster_preset("a100").status().message().find("'a100'"), std::string::npos);
  EXPECT_FALSE(parse_plan_routing("skewed").ok());
}

// Up to EP 2048 without trouble, and the time grows with the network share.
TEST(Plan, LargeEpAndMonotone) {
  PlanOptions o;
  o.cluster = *cluster_preset("h800");
  o.low_latency = true;
  o.tokens = 128;
  o.experts = 2048;
  double last = 0.0;
  for (int ep : {8, 64, 2048}) {
    o.ep = ep;
    StatusOr<PlanResult> r = plan(o);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_GT(r->dispatch_seconds, last);
    last = r->dispatch_seconds;
  }
}

// Generated routings are what they claim: K distinct experts per token, groups respected.
TEST(Plan, RoutingsAreValid) {
  PlanOptions o;
  o.ep = 16;
  o.tokens = 64;
  o.topk = 8;
  o.experts = 64;
  for (PlanRouting kind : {PlanRouting::kUniform, PlanRouting::kZipf, PlanRouting::kGroup}) {
    o.routing = kind;
    o.num_groups = 8;
    o.group_topk = 2;
    StatusOr<std::vector<int32_t>> idx = plan_routing(o, 3);
    ASSERT_TRUE(idx.ok());
    for (int64_t t = 0; t < o.tokens; ++t) {
      std::vector<int> groups;
      for (int k = 0; k < o.topk; ++k) {
        const int e = (*idx)[size_t(t * o.topk + k)];
        ASSERT_TRUE(e >= 0 && e < o.experts);
        for (int k2 = 0; k2 < k; ++k2) ASSERT_NE(e, (*idx)[size_t(t * o.topk + k2)]);
        if (std::find(groups.begin(), groups.end(), e / 8) == groups.end()) groups.push_back(e / 8);
      }
      if (kind == PlanRouting::kGroup) {
        EXPECT_LE(groups.size(), 2u);
      }
    }
  }
}

}  // namespace
}  // namespace moed
