// Node-shared memory for Flex: regions that grow collectively, and the per-pair epoch signals.
#include <algorithm>

#include "dispatch/flex/flex_internal.h"

namespace moed::flex {

Status Region::ensure(World& world, size_t bytes) {
  if (buffer_ && buffer_->bytes() >= bytes) return ok_status();
  // NOTE: every local rank asks for the same size (computed from the same global counts),
  // so they all reach this collective together. A quarter more than asked keeps slowly
  // growing traffic from reallocating on every call. The old buffer is retired, not freed:
  // the caller may still read from it in this step (release_retired).
  const size_t grown = std::max(bytes, buffer_ ? buffer_->bytes() + buffer_->bytes() / 4 : 0);
  MOED_ASSIGN_OR_RETURN(std::shared_ptr<SharedBuffer> fresh, world.alloc_shared(grown));
  if (buffer_) retired_.push_back(std::move(buffer_));
  buffer_ = std::move(fresh);
  return ok_status();
}

Bytes NetScratch::at(std::vector<ScratchBuffer>& v, int node, size_t bytes) {
  if (v.size() <= size_t(node)) v.resize(size_t(node) + 1);
  if (bytes == 0) return Bytes{};
  return Bytes{static_cast<char*>(v[size_t(node)].view(DType::kFP8, 1, int64_t(bytes)).data),
               bytes};
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
