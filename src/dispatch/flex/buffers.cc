// Node-shared memory for Flex: regions that grow collectively, the output ring, the per-pair
// epoch signals and the rounds of a step that publishes memory (PublishRound).
#include <algorithm>
#include <atomic>
#include <bit>

#include "comm/wait.h"
#include "dispatch/flex/buffers.h"

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

uint64_t OutputRing::held_mask() const {
  uint64_t mask = 0;
  for (size_t i = 0; i < slots_.size() && i < size_t(kMaxSlots); ++i) {
    // NOTE: the ring's own reference plus one per live OutputHold; a hold being dropped on
    // another thread right now reads as held, which only costs a slot.
    if (slots_[i]->token.use_count() > 1) mask |= uint64_t(1) << i;
  }
  return mask;
}

int OutputRing::pick(const Topology& topo, const std::function<uint64_t(int)>& held_of) {
  uint64_t mask = 0;
  for (int lr = 0; lr < topo.ranks_per_node; ++lr)
    mask |= held_of(topo.node * topo.ranks_per_node + lr);
  const int free_slot = std::countr_one(mask);
  if (free_slot < std::min(size(), kMaxSlots)) return free_slot;
  // Every slot is held somewhere on the node: the same conclusion on every local rank, so
  // they all add the slot (its region is allocated, collectively, by the dispatch).
  if (size() < kMaxSlots) {
    slots_.push_back(std::make_unique<Slot>());
    return size() - 1;
  }
  // The overflow slot, afresh: the outputs of the one before keep its memory and token.
  if (size() == kMaxSlots) slots_.emplace_back();
  slots_[size_t(kOverflow)] = std::make_unique<Slot>();
  return kOverflow;
}

namespace {
// DispatchOutput.storage of a Flex output.
struct OutputHold {
  std::shared_ptr<int> token;
  std::shared_ptr<SharedBuffer> memory;  // freed locally with the last owner, in every world
};
}  // namespace

std::shared_ptr<void> OutputRing::hold(int slot) const {
  const Slot& s = *slots_[size_t(slot)];
  auto h = std::make_shared<OutputHold>();
  h->token = s.token;
  h->memory = s.region.buffer();
  return h;
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

PublishRound::PublishRound(World& world, Signals& signals, uint64_t& epoch, bool in_place,
                           Role role)
    : world_(world),
      signals_(signals),
      published_(epoch + 1),
      released_(epoch + 2),
      in_place_(in_place),
      role_(role) {
  epoch = released_;
}

PublishRound::~PublishRound() {
  if (!closed_)
    close(aborted("rank ", world_.rank(), " left a step with its memory published")).ignore();
}

Status PublishRound::open() {
  signals_.signal_all(published_);
  MOED_RETURN_IF_ERROR(signals_.wait_all(published_));
  if (!in_place_) return ok_status();
  std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with close()'s (class comment)
  return world_.failure();
}

Status PublishRound::close(const Status& step) {
  closed_ = true;
  if (!in_place_) {
    if (step.ok() || role_ == Role::kReads) signals_.signal_all(released_);
    MOED_RETURN_IF_ERROR(step);
    return signals_.wait_all(released_);
  }
  if (!step.ok()) world_.abort(step);
  signals_.signal_all(released_);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with open()'s
  SharedBuffer& b = *signals_.buffer_;
  for (int lr = 0; lr < b.local_size(); ++lr) {
    if (lr == b.local_rank()) continue;
    if (!by_collective_ && b.signal_value(lr) < published_) continue;  // never opened
    MOED_RETURN_IF_ERROR(internal::poll_released(
        world_, [&] { return b.signal_value(lr) >= released_; },
        [&] {
          return str_cat("rank ", world_.rank(), " waiting for local rank ", lr,
                         " to be done with its memory (epoch ", released_, ")");
        }));
  }
  MOED_RETURN_IF_ERROR(step);
  return world_.failure();
}

}  // namespace moed::flex
