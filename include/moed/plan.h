// Planning clusters: an explicit cost model of dispatch and combine on GPU clusters (`moed plan`;
// docs/planner.md).
//
// From a routing (a trace, or generated: uniform, Zipf-skewed, group-limited) it counts, per
// rank, the bytes each algorithm moves over the intra-node fabric and the network, and turns the
// busiest rank's into a time with a few public numbers per system (Cluster). PlanResult::moed
// holds what moed's own dispatchers count; PlanResult::algorithms the GPU kernels' link times.
//
//   moed::PlanOptions o;
//   o.cluster = *moed::cluster_preset("h800");
//   o.ep = 64; o.ranks_per_node = 8; o.tokens = 4096; o.hidden = 7168; o.topk = 8;
//   o.experts = 256; o.routing = moed::PlanRouting::kGroup; o.num_groups = 8; o.group_topk = 4;
//   MOED_ASSIGN_OR_RETURN(moed::PlanResult r, moed::plan(o));
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moed/replay.h"
#include "moed/status.h"

namespace moed {

// One parameter set per system, every number from the hardware's published specification
// (src/plan/cluster.cc cites each beside it; docs/planner.md has the table).
struct Cluster {
  std::string name;
  std::string description;
  double nvl_gbps = 0.0;      // per-GPU intra-node bandwidth, one direction, GB/s (1e9 B/s)
  double net_gbps = 0.0;      // per-GPU network bandwidth, one direction, GB/s
  double hbm_gbps = 0.0;      // per-GPU memory bandwidth (permute / sort passes), GB/s
  double nvl_latency_us = 0;  // one intra-node hop
  double net_latency_us = 0;  // one network hop
  double fixed_us = 0.0;      // per call: launch, count/flag round trip, completion
  // Per network message when a CPU proxy thread posts it (UCCL-EP, pplx-garden); 0 where the NIC
  // has no published figure (GPU-initiated designs never pay it).
  double proxy_message_us = 0.0;
  int ranks_per_node = 8;     // default G: the GPUs of one NVLink / xGMI domain
  std::string sources;        // where the numbers come from
};
StatusOr<Cluster> cluster_preset(const std::string& name);
std::vector<std::string> cluster_preset_names();
std::vector<Cluster> cluster_presets();

enum class PlanRouting { kUniform, kZipf, kGroup, kTrace };
StatusOr<PlanRouting> parse_plan_routing(const std::string& name);

// How a source counts the bytes of its GB/s figure. What is counted follows the algorithm
// (DeepEP's definitions, README of DeepEP and src/plan/model.cc): one node, received tokens; normal
// kernels across nodes, (token, node) pairs with the own node; low-latency and pplx, (token,
// expert) selections. The convention sets the bytes of one:
enum class Convention {
  kDeepEP,    // dispatch row (fp8: H + H/128 fp32 scales; low-latency + 16 B), combine 2H
  kDeepEPv2,  // DeepEP V2's tests/elastic/test_ep.py: the row plus top-k indices (int64) and
              // weights (fp32) per token; combine 2H plus the weights
  kPayload,   // MORI: H x the element size (fp8 1, bf16 2), no scales
};

// The algorithms the model knows: "flat" (one row per (token, rank), straight), "alltoall"
// (Megatron), "flex" (DeepEP's normal kernels: two hops), "low-latency" (one message per (token,
// expert)), "pplx" (the low-latency bytes in one write per peer, after a count exchange).
inline constexpr const char* kPlanAlgorithms[] = {"flat", "alltoall", "flex", "low-latency", "pplx"};

struct PlanOptions {
  Cluster cluster;
  int ep = 8;              // ranks R (EP size, ETP = 1)
  int ranks_per_node = 8;  // G, divides R
  int64_t tokens = 4096;   // per rank
  int64_t hidden = 7168;
  int topk = 8;
  int experts = 256;         // E, a multiple of R
  bool low_latency = false;  // the mode whose time is reported as dispatch_/combine_seconds
  // The algorithm reported; "" = "flex", or "low-latency" when low_latency is set.
  std::string algorithm;
  bool cpu_proxy = false;  // network messages posted by CPU proxy threads (Cluster::proxy_message_us)
  Convention convention = Convention::kDeepEP;
  // SM-limited copies: the kernel's SMs and each SM's copy rate (GB/s, dispatch and combine);
  // the intra-node bytes move at no more than their product. 0 = not limited.
  int sms = 0;
  double sm_dispatch_gbps = 0.0, sm_combine_gbps = 0.0;
  bool fp8_dispatch = true;  // dispatch payload fp8 (+ fp32 scale per 128); bf16 otherwise
  PlanRouting routing = PlanRouting::kUniform;
  double zipf_s = 1.0;  // kZipf: P(expert of popularity rank i) ~ 1 / (i + 1)^s
  int num_groups = 0;   // kGroup: 0 = one group per node (as DeepEP's tests route)
  int group_topk = 0;   // kGroup: 0 = min(num_groups, 4)
  uint64_t seed = 1;
  const RoutingTrace* trace = nullptr;  // kTrace: T * R tokens of one step split evenly
  int64_t trace_step = 0;               // kTrace: which step
};

// Per-rank bytes of one scheme, and its predicted time.
struct LinkCost {
  std::vector<int64_t> nvl_bytes;  // [R] max(sent, received) over the intra-node link
  std::vector<int64_t> net_bytes;  // [R] max(sent, received) over the network
  std::vector<int64_t> hbm_bytes;  // [R] extra local passes (read + write), AlltoAll only
  std::vector<int64_t> net_messages;  // [R] network messages the rank posts
  double seconds = 0.0;
  int64_t max_nvl() const;
  int64_t max_net() const;
};

struct AlgorithmCost {
  std::string name;  // one of kPlanAlgorithms
  LinkCost dispatch, combine;
};

// What moed's dispatchers count in World::counters() for the data path (ETP = 1, dropless,
// threads world, where Flex's combine reads expert outputs in place): per rank, shared /
// network bytes. Control traffic (count all-gathers, agreements) is left out.
struct CounterBytes {
  std::vector<int64_t> shared, network;
};
struct MoedCounters {
  CounterBytes alltoall_dispatch, alltoall_combine, flex_dispatch, flex_combine;
  CounterBytes low_latency_dispatch, low_latency_combine;
};

// The bandwidth numerator of the reported algorithm (DeepEP's definitions, with the bytes of
// the Convention): bytes of one rank divided by the time. One node ("NVL"): tokens it receives.
// Normal kernels across nodes ("RDMA"): its (token, node) pairs, own node included.
// Low-latency and pplx ("RDMA"): its (token, expert) selections.
struct PublishedBytes {
  int64_t dispatch = 0, combine = 0;
  std::string link;  // "NVL" or "RDMA"
};

struct PlanResult {
  PlanOptions options;
  int num_nodes = 0;
  int64_t dispatch_row_bytes = 0, combine_row_bytes = 0;
  std::vector<AlgorithmCost> algorithms;  // kPlanAlgorithms, in order
  MoedCounters moed;
  PublishedBytes published;  // mean over ranks, for the reported algorithm
  // The same for any algorithm (its count: received tokens, (token, node) pairs or selections).
  PublishedBytes published_for(const std::string& algorithm) const;
  PublishedBytes published_tokens, published_selections;  // the two counts behind it
  std::string reported;  // the reported algorithm
  double dispatch_seconds = 0.0, combine_seconds = 0.0;
  double dispatch_gbps = 0.0, combine_gbps = 0.0;  // published bytes / seconds
  const AlgorithmCost& algorithm(const std::string& name) const;
};

// Errors name the option and value: R < 1 or > 2048, G not dividing R, E % R, K > E, ...
StatusOr<PlanResult> plan(const PlanOptions& options);
// The routing plan() uses for source rank s: [tokens, topk] expert indices (-1 = none).
StatusOr<std::vector<int32_t>> plan_routing(const PlanOptions& options, int rank);

std::string plan_table(const PlanResult& r);
std::string plan_json(const PlanResult& r);

// The validation: every published row we found (src/plan/published.cc names each source, its
// file and commit) next to the model's prediction at the row's own settings, with one preset per
// hardware and one parameter set per design, nothing fitted per row.
struct ValidationRow {
  std::string source;  // "DeepEP V1", "HybridEP", "UCCL-EP", ...
  std::string table;   // the source's table or hardware column
  std::string design;  // the design's key (src/plan/published.cc kDesigns)
  std::string cluster, mode, phase;  // mode: intranode / internode / low-latency; phase: dispatch / combine
  int ep = 0;
  int64_t tokens = 0;
  std::string dtype;  // the dispatch payload: fp8 or bf16
  double published_gbps = 0.0, published_us = 0.0;  // 0 where the source gives none
  double predicted_gbps = 0.0, predicted_us = 0.0;
  // The published figure as a time: published_us, or the row's bytes as its source counts them
  // (the model's count at the row's settings) / published GB/s.
  double implied_us = 0.0;
  // model GB/s / published GB/s where the source gives GB/s, else published us / model us.
  double ratio = 0.0;
  bool within() const { return ratio >= 0.75 && ratio <= 1.25; }
  std::string note;  // why it misses (or what the row assumes)
};
StatusOr<std::vector<ValidationRow>> validate_plan();
// Only the rows on `cluster` (and, when >= 0, at `tokens` per rank and at EP `ep`).
StatusOr<std::vector<ValidationRow>> validate_plan(const std::string& cluster, int64_t tokens,
                                                   int ep);
// markdown: a table for docs; otherwise fixed-width text. Both end with the summary lines.
std::string validation_table(const std::vector<ValidationRow>& rows, bool markdown);
// "N of M rows within +-25%" and the same per source.
std::string validation_summary(const std::vector<ValidationRow>& rows);

// The published sources (for the docs and --validate --sources): key, citation.
struct PublishedSource {
  std::string name, citation;
};
std::vector<PublishedSource> published_sources();

// A sweep: the model for every algorithm over a range of EP sizes or of tokens per rank, the
// rest of the options fixed (`moed plan --sweep ep=8,16,32,...`), with the published rows of
// the same cluster and tokens beside it.
struct SweepPoint {
  int64_t value = 0;  // the EP size or the tokens per rank
  int experts = 0;    // E used there (raised to a multiple of EP where needed)
  std::vector<double> dispatch_us, combine_us, dispatch_gbps, combine_gbps;  // per algorithm
};
struct SweepResult {
  PlanOptions base;
  std::string axis;                     // "ep" or "tokens"
  std::vector<std::string> algorithms;  // kPlanAlgorithms
  std::vector<SweepPoint> points;
  std::vector<ValidationRow> published;  // rows on base's cluster (and tokens, for "ep")
};
// spec: "ep=8,16,32" or "tokens=128,4096" (values ascending, each >= 1; EP up to 2048).
StatusOr<SweepResult> plan_sweep(const PlanOptions& base, const std::string& spec);
std::string sweep_table(const SweepResult& r, bool gbps);
// Two panels (dispatch, combine): one line per algorithm against the axis (log scale), the
// published points as markers; gbps false: time in us (log scale).
std::string sweep_svg(const SweepResult& r, bool gbps);

}  // namespace moed
