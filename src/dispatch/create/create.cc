// TokenDispatcher::create: the one place that names every dispatcher.
#include "dispatch/allgather/allgather.h"
#include "dispatch/alltoall/alltoall.h"
#include "dispatch/flex/flex_dispatcher.h"
#include "moed/dispatcher.h"

namespace moed {

StatusOr<std::unique_ptr<TokenDispatcher>> TokenDispatcher::create(World& world,
                                                                   const DispatchConfig& config) {
  // Validation is collective: a bad config on any rank is an error on every rank.
  Status local = config.validate(world.size());
  if (local.ok() && config.kind == DispatcherKind::kLowLatency) {
    local = invalid_argument(
        "the low-latency dispatcher has its own API (moed/low_latency.h: LowLatencyBuffer); "
        "TokenDispatcher::create takes allgather, alltoall or flex");
  }
  MOED_RETURN_IF_ERROR(world.agree(local));
  switch (config.kind) {
    case DispatcherKind::kAllGather: return make_allgather_dispatcher(world, config);
    case DispatcherKind::kAlltoAll: return make_alltoall_dispatcher(world, config);
    case DispatcherKind::kFlex: return make_flex_dispatcher(world, config);
    case DispatcherKind::kLowLatency: break;
  }
  return internal_error("unreachable dispatcher kind");
}

}  // namespace moed
