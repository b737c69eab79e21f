// The Flex steps' one collective (agree_in_one) and the ring of dispatch-output regions.
#include <algorithm>
#include <bit>

#include "dispatch/flex/steps.h"

namespace moed::flex {

StatusOr<AgreedTable> agree_in_one(World& world, const Status& local,
                                   std::span<const AgreedField> fields,
                                   std::span<const int64_t> payload) {
  AgreedTable t;
  t.width = 1 + fields.size() + payload.size();
  std::vector<int64_t> mine(t.width, 0);
  mine[0] = int64_t(local.code());
  for (size_t i = 0; i < fields.size(); ++i) mine[1 + i] = fields[i].value;
  std::copy(payload.begin(), payload.end(), mine.begin() + 1 + ptrdiff_t(fields.size()));
  MOED_ASSIGN_OR_RETURN(t.table, all_gather<int64_t>(world, std::span<const int64_t>(mine)));
  const int R = world.size();
  for (int r = 1; r < R; ++r) {
    for (size_t i = 0; i < fields.size(); ++i) {
      const int64_t a = t.row(0)[1 + i], b = t.row(r)[1 + i];
      if (fields[i].kind == AgreedField::kFirst && a != b) {
        return invalid_argument(fields[i].name, " = ", a, " on rank 0 but ", b, " on rank ", r);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if (t.row(r)[0] != 0) {
      // NOTE: every rank saw the failure in the table, so every rank takes this path and
      // World::agree's collectives match; only the error path pays for the message.
      Status agreed = world.agree(local);
      if (agreed.ok()) return internal_error("rank ", r, " reported an error that agree() lost");
      return agreed;
    }
  }
  for (int r = 1; r < R; ++r) {
    for (size_t i = 0; i < fields.size(); ++i) {
      const AgreedField& f = fields[i];
      const int64_t a = t.row(0)[1 + i], b = t.row(r)[1 + i];
      if (f.kind == AgreedField::kFree || f.kind == AgreedField::kFirst || a == b) continue;
      if (f.kind == AgreedField::kAgreeDType) {
        return invalid_argument(f.name, " is ", dtype_name(DType(a)), " on rank 0 but ",
                                dtype_name(DType(b)), " on rank ", r);
      }
      return invalid_argument(f.name, " = ", a, " on rank 0 but ", b, " on rank ", r);
    }
  }
  return t;
}

uint64_t OutputRing::held_mask() const {
  uint64_t mask = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    // NOTE: the ring's own reference plus one per live OutputHold; a hold being dropped on
    // another thread right now reads as held, which only costs a slot.
    if (slots_[i]->token.use_count() > 1) mask |= uint64_t(1) << i;
  }
  return mask;
}

StatusOr<int> OutputRing::pick(uint64_t node_mask) {
  const int free_slot = std::countr_one(node_mask);
  if (free_slot < size()) return free_slot;
  // Every slot is held somewhere on the node: the same conclusion on every local rank, so
  // they all add the slot (its region is allocated, collectively, by the dispatch).
  if (size() >= kMaxSlots) {
    return failed_precondition("Flex: ", kMaxSlots,
                               " dispatch outputs of this dispatcher are held at once on this "
                               "node; drop some (DispatchOutput.storage) before dispatching again");
  }
  slots_.push_back(std::make_unique<Slot>());
  return size() - 1;
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

}  // namespace moed::flex
