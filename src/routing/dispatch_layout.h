// Internal: the dispatch layout without the checks, for callers that validated already (Flex).
#pragma once

#include "moed/dispatch_layout.h"

namespace moed {

// get_dispatch_layout(map, ...) for a valid map and topology (not checked).
DispatchLayout count_dispatch_layout(const RoutingMap& map, int world_size, int ranks_per_node,
                                     int etp_size);

}  // namespace moed
