// Internal: the dispatch layout without the checks, for callers that validated already (Flex).
#pragma once

#include "moed/dispatch_layout.h"

namespace moed {

// get_dispatch_layout for a valid routing and topology (not checked): one pass over the
// entries, O(T * R + entries * P).
DispatchLayout count_dispatch_layout(const SparseRouting& routing, int world_size,
                                     int ranks_per_node, int etp_size);

}  // namespace moed
