// ElasticBuffer's state (moed/elastic_buffer.h) and the handle metadata of its two layouts
// (elastic_metadata.cc), built from the engines' own handles: NormalBuffer's rank-major one and
// the Flex dispatcher's expert-major one.
#pragma once

#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "dispatch/flex/flex_dispatcher.h"
#include "dispatch/flex/layout.h"
#include "moed/elastic_buffer.h"

namespace moed::deep_ep {

struct ElasticBuffer::State {
  World* world = nullptr;
  ElasticConfig config;
  std::unique_ptr<NormalBuffer> normal;
  // The Flex dispatchers of the expanded layout, by (num_experts, expert_alignment,
  // num_worst_tokens): making one is collective, and every rank asks for the same one after
  // the call's agreement.
  using FlexKey = std::tuple<int, int, int64_t>;
  std::map<FlexKey, std::unique_ptr<FlexDispatcher>> flex;
  int scaleout = 1, scaleup = 1;  // the logical domains

  StatusOr<FlexDispatcher*> flex_for(const FlexKey& key);
};

// What one dispatch call is, every field agreed across ranks.
struct ElasticCall {
  bool cached = false;
  bool expand = false;
  bool cpu_sync = true;
  int num_experts = 0;
  int64_t max_tokens = 0;  // num_max_tokens_per_rank
  int alignment = 1;
  int num_topk = 0;
  bool weights = false;  // topk_weights given on this rank
};

// The metadata of a non-expanded dispatch (rank-major receive): everything but the routing.
void fill_rank_major_metadata(const ElasticCall& call, int scaleup, const NormalHandle& nh,
                              std::span<const int64_t> recv_topk_idx, const TopkView& topk,
                              ElasticHandle& h);
// The metadata of an expanded dispatch (Flex's canonical layout).
void fill_expanded_metadata(const ElasticCall& call, int scaleup, const flex::FlexHandle& fh,
                            ElasticHandle& h);

}  // namespace moed::deep_ep
