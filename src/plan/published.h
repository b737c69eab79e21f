// The published tables behind `moed plan --validate` (data in published.cc, run by validate.cc).
#pragma once

#include <cstdint>
#include <span>

#include "moed/plan.h"

namespace moed::published {

// How a design moves bytes and how its source counts GB/s: one parameter set per design, from
// the design's own documentation or code (published.cc says where).
struct Design {
  const char* key;
  const char* algorithm;  // one of kPlanAlgorithms
  bool cpu_proxy;         // network messages posted by CPU proxy threads
  Convention convention;
  bool nvlink;            // false: every peer over the network, even on the own node
  // Per-SM copy rate of the intra-node copies, GB/s: fp8 dispatch, bf16 dispatch, combine
  // (0 = none documented: not SM-limited).
  double sm_fp8_gbps = 0, sm_bf16_gbps = 0, sm_combine_gbps = 0;
};

// One setting of a source's table: both phases where the source gives both. Every row uses
// DeepSeek-V3's hidden 7168 and top-8 (every source here states them).
struct Setting {
  const char* source;  // key into kSources
  const char* table;   // the table / column, as the source names it
  const char* cluster;
  const char* design;  // key into kDesigns
  int ep;
  int64_t tokens;  // per rank
  int experts;
  bool fp8;             // dispatch payload fp8 (+ fp32 scale per 128), else bf16
  bool group_routing;   // DeepSeek's group-limited gating (one group per node, top 4), else uniform
  double dispatch_gbps, dispatch_us, combine_gbps, combine_us;  // 0 = not given
  const char* dispatch_note;
  const char* combine_note;
  int sms = 0;  // the SMs the source ran with (0 = not stated or not limiting)
};

std::span<const Design> designs();
std::span<const Setting> settings();
std::span<const PublishedSource> sources();

}  // namespace moed::published
