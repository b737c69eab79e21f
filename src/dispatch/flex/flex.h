// The Flex dispatcher's factory (DeepEP's design, spec §5); TokenDispatcher::create calls it.
#pragma once

#include <memory>

#include "moed/dispatcher.h"

namespace moed {

StatusOr<std::unique_ptr<TokenDispatcher>> make_flex_dispatcher(World& world,
                                                                const DispatchConfig& config);

}  // namespace moed
