// TokenDispatcher::create: the one place that names every dispatcher.
#include "dispatch/allgather/allgather.h"
#include "dispatch/alltoall/alltoall.h"
#include "dispatch/flex/flex_dispatcher.h"
#include "moed/dispatcher.h"

namespace moed {

StatusOr<std::unique_ptr<TokenDispatcher>> TokenDispatcher::create(World& world,
                                                                   const DispatchConfig& config) {
  // Each factory validates the config in its opening agreement: a bad config on any rank is
  // an error on every rank.
  switch (config.kind) {
    case DispatcherKind::kAllGather: return make_allgather_dispatcher(world, config);
    case DispatcherKind::kAlltoAll: return make_alltoall_dispatcher(world, config);
    case DispatcherKind::kFlex:
      return make_flex_dispatcher(world, config);
  }
  return internal_error("unreachable dispatcher kind");
}

}  // namespace moed
