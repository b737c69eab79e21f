// The AllGather dispatcher (Megatron-Core's MoEAllGatherTokenDispatcher), design.md §1.3:
//   dispatch_preprocess   effective routing, one count exchange
//   token_dispatch        all-gather of every rank's tokens (+ fp8 scales), effective routing
//                         map and probs (all_gather_v: ranks differ in T)
//   dispatch_postprocess  permute the gathered tokens, keeping this rank's local experts, in
//                         the canonical layout (design.md §3.1)
//   combine               rows home and summed there in the fixed order (RowExchangeDispatcher;
//                         see its NOTE on why this is not a reduce-scatter of partial sums)
//   combine backward      all-gather of grad_out, then each rank picks its rows
//
//   moed::DispatchConfig c{.kind = moed::DispatcherKind::kAllGather, .num_experts = 8};
//   MOED_ASSIGN_OR_RETURN(auto d, moed::TokenDispatcher::create(world, c));
#pragma once

#include <memory>

#include "moed/dispatcher.h"

namespace moed {

StatusOr<std::unique_ptr<TokenDispatcher>> make_allgather_dispatcher(World& world,
                                                                     const DispatchConfig& config);

}  // namespace moed
