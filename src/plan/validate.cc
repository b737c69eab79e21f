// `moed plan --validate`: the model beside published figures. Every figure below is quoted
// from the named file (README "Planning clusters: moed plan" gives the tables in full); the
// settings are the ones each table states.
#include <string>

#include "moed/plan.h"

namespace moed {

namespace {

struct Published {
  const char* source;  // repository, file, table
  const char* cluster;
  bool low_latency;
  int ep;
  int64_t tokens;
  int experts;
  double dispatch_gbps, dispatch_us, combine_gbps, combine_us;  // 0 = not given
  const char* dispatch_note;
  const char* combine_note;
};

constexpr const char* kDeepEPNormal = "DeepEP normal";  // deepseek-ai/DeepEP README.md, V1 tables
constexpr const char* kDeepEPLL = "DeepEP low-latency";
constexpr const char* kUcclNormal = "UCCL-EP p5en normal";  // uccl-project/uccl ep/README.md
constexpr const char* kUcclLL = "UCCL-EP p5en low-lat.";

// Why the UCCL-EP rows on EFA miss (the model assumes the NIC runs at line rate, as IBGDA's
// GPU-posted writes do on DeepEP's H800).
constexpr const char* kProxy =
    "EFA below its line rate: UCCL-EP posts RDMA from CPU proxy threads; not modelled";
constexpr const char* kCombine =
    "UCCL-EP's combine takes 2.4-5.3x its dispatch time for 1.9x the bytes: not a byte count";
constexpr const char* kMessages =
    "per-message cost: 128 x 8 (token, expert) writes through CPU proxies on EFA; not modelled";

// clang-format off
const Published kRows[] = {
  {kDeepEPNormal, "h800", false, 8, 4096, 256, 153, 0, 158, 0, "", ""},
  {kDeepEPNormal, "h800", false, 16, 4096, 256, 43, 0, 43, 0, "NVL-bound: forwarding ~3.2 ranks per node", "NVL-bound"},
  {kDeepEPNormal, "h800", false, 32, 4096, 256, 58, 0, 57, 0, "", ""},
  {kDeepEPNormal, "h800", false, 64, 4096, 256, 51, 0, 50, 0, "", ""},
  {kDeepEPLL, "h800", true, 8, 128, 256, 98, 77, 127, 114, "", ""},
  {kDeepEPLL, "h800", true, 16, 128, 256, 63, 118, 74, 195, "", ""},
  {kDeepEPLL, "h800", true, 32, 128, 256, 48, 155, 53, 273, "", ""},
  {kDeepEPLL, "h800", true, 64, 128, 256, 43, 173, 46, 314, "", ""},
  {kDeepEPLL, "h800", true, 128, 128, 256, 39, 192, 39, 369, "", ""},
  {kDeepEPLL, "h800", true, 256, 128, 256, 39, 194, 40, 360, "", ""},
  {kUcclNormal, "h200-efa", false, 8, 4096, 256, 320, 500, 319, 973, "", ""},
  {kUcclNormal, "h200-efa", false, 16, 4096, 288, 50, 1196, 18, 6379, kProxy, kCombine},
  {kUcclNormal, "h200-efa", false, 24, 4096, 288, 53, 1633, 26, 6365, kProxy, kCombine},
  {kUcclNormal, "h200-efa", false, 32, 4096, 288, 54, 2022, 43, 4899, "", kCombine},
  {kUcclLL, "h200-efa", true, 16, 128, 288, 36, 226, 48, 293, kMessages, kMessages},
  {kUcclLL, "h200-efa", true, 24, 128, 288, 20, 386, 26, 580, kMessages, kMessages},
  {kUcclLL, "h200-efa", true, 32, 128, 288, 16, 465, 25, 694, kMessages, kMessages},
};
// clang-format on

}  // namespace

StatusOr<std::vector<ValidationRow>> validate_plan() {
  std::vector<ValidationRow> out;
  for (const Published& p : kRows) {
    PlanOptions o;
    MOED_ASSIGN_OR_RETURN(o.cluster, cluster_preset(p.cluster));
    o.ep = p.ep;
    o.ranks_per_node = 8;
    o.tokens = p.tokens;
    o.hidden = 7168;
    o.topk = 8;
    o.experts = p.experts;
    o.low_latency = p.low_latency;
    o.fp8_dispatch = true;
    // Normal kernels: DeepEP's tests route group-limited with one group per node, top
    // min(nodes, 4) groups ("top-4 groups"); low-latency: plain top-8.
    o.routing = p.low_latency ? PlanRouting::kUniform : PlanRouting::kGroup;
    MOED_ASSIGN_OR_RETURN(PlanResult r, plan(o));
    for (int phase = 0; phase < 2; ++phase) {
      ValidationRow v;
      v.source = p.source;
      v.cluster = p.cluster;
      v.mode = p.low_latency ? "low-latency" : (r.num_nodes > 1 ? "internode" : "intranode");
      v.phase = phase == 0 ? "dispatch" : "combine";
      v.ep = p.ep;
      v.published_gbps = phase == 0 ? p.dispatch_gbps : p.combine_gbps;
      v.published_us = phase == 0 ? p.dispatch_us : p.combine_us;
      v.predicted_gbps = phase == 0 ? r.dispatch_gbps : r.combine_gbps;
      v.predicted_us = 1e6 * (phase == 0 ? r.dispatch_seconds : r.combine_seconds);
      v.ratio = v.predicted_gbps / v.published_gbps;
      v.note = phase == 0 ? p.dispatch_note : p.combine_note;
      out.push_back(v);
    }
  }
  return out;
}

}  // namespace moed
