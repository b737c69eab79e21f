// The AlltoAll dispatcher (Megatron-Core's MoEAlltoAllTokenDispatcher), design.md §1.4:
//   dispatch_preprocess   effective routing, one count exchange, permute by global expert
//                         (the rows for destination rank d, experts [ep(d)*L, (ep(d)+1)*L),
//                         are contiguous)
//   token_dispatch        all_to_all_v of rows, scales (fp8), probs and source token ids
//   dispatch_postprocess  sort_chunks_by_idxs into the canonical layout (design.md §3.1), with the
//                         pad_to_capacity and expert_alignment padding as gaps
//   combine               sort back, all_to_all_v home, ETP partials summed in p order,
//                         unpermute in the fixed order (RowExchangeDispatcher)
//
//   moed::DispatchConfig c{.kind = moed::DispatcherKind::kAlltoAll, .num_experts = 8};
//   MOED_ASSIGN_OR_RETURN(auto d, moed::TokenDispatcher::create(world, c));
#pragma once

#include <memory>

#include "moed/dispatcher.h"

namespace moed {

StatusOr<std::unique_ptr<TokenDispatcher>> make_alltoall_dispatcher(World& world,
                                                                    const DispatchConfig& config);

}  // namespace moed
