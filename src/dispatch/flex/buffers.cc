// Node-shared memory for Flex: regions that grow collectively, and the per-pair epoch signals.
#include <algorithm>

#include "dispatch/flex/flex_internal.h"

namespace moed::flex {

Status Region::ensure(World& world, size_t bytes) {
  if (buffer_ && buffer_->bytes() >= bytes) return ok_status();
  // NOTE: every local rank asks for the same size (computed from the same global counts),
  // so they all reach this collective together. A quarter more than asked keeps slowly
  // growing traffic from reallocating on every call. Outputs that point into the old buffer
  // stay valid (it is retired, not freed).
  const size_t grown = std::max(bytes, buffer_ ? buffer_->bytes() + buffer_->bytes() / 4 : 0);
  MOED_ASSIGN_OR_RETURN(std::shared_ptr<SharedBuffer> fresh, world.alloc_shared(grown));
  if (buffer_) retired_.push_back(std::move(buffer_));
  buffer_ = std::move(fresh);
  return ok_status();
}

Status Signals::init(World& world) {
  MOED_ASSIGN_OR_RETURN(buffer_, world.alloc_shared(256));
  return ok_status();
}

void Signals::signal_all(uint64_t epoch) {
  for (int lr = 0; lr < buffer_->local_size(); ++lr) {
    if (lr != buffer_->local_rank()) buffer_->signal(lr, epoch);
  }
}

Status Signals::wait_all(uint64_t epoch) {
  for (int lr = 0; lr < buffer_->local_size(); ++lr) {
    if (lr != buffer_->local_rank()) MOED_RETURN_IF_ERROR(buffer_->wait_signal(lr, epoch));
  }
  return ok_status();
}

}  // namespace moed::flex
