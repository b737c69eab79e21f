// FaultWorld: a World that forwards every call to a real one (threads or MPI) and can make
// this rank fail at its n-th world call, the way a rank that crashes there would: the failure
// is announced to the others (World::abort of the real world) and
// the call returns the reason. So a test can fail a rank at every communication point of a
// dispatch or a combine (after the count exchange, between the pushes, before the combine
// reads) without hooks in the library.
//
//   FaultWorld fw(w);                       // w: the world of run_world's body
//   MOED_ASSIGN_OR_RETURN(auto d, TokenDispatcher::create(fw, config));
//   if (fw.rank() == 2) fw.arm(5, internal_error("injected"));  // fail at the 5th call from now
//   ... d->dispatch(...) ...
//
// Shared buffers are the real world's (their signals and waits see its failures); counters
// are this world's own. Calls from any thread are counted.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "moed/world.h"

namespace moed::testing {

class FaultWorld final : public World {
 public:
  explicit FaultWorld(World& inner);

  // Fails this rank at its nth (1-based) world call from now, with `reason` (the message gets
  // " at <call>" appended). nth <= 0 disarms.
  void arm(int nth, const Status& reason);
  // World calls this rank made since the last arm() (or construction).
  int calls() const { return calls_.load() - armed_at_.load(); }
  // Whether the armed fault has fired.
  bool fired() const { return fired_.load(); }

  const char* backend_name() const override { return inner_.backend_name(); }
  bool shares_address_space() const override { return inner_.shares_address_space(); }
  bool calls_from_any_thread() const override { return inner_.calls_from_any_thread(); }
  Status barrier() override;
  Status broadcast_bytes(void* data, size_t bytes, int root) override;
  Status all_gather_v_bytes(const void* send, size_t send_bytes, void* recv,
                            std::span<const size_t> recv_bytes) override;
  Status all_to_all_v_bytes(const void* send, std::span<const size_t> send_bytes,
                            std::span<const size_t> send_offsets, void* recv,
                            std::span<const size_t> recv_bytes,
                            std::span<const size_t> recv_offsets) override;
  Status reduce_scatter_v_f32(const float* send, std::span<const size_t> counts,
                              float* recv) override;
  Status all_reduce_f32(const float* send, float* recv, size_t count) override;
  StatusOr<std::shared_ptr<SharedBuffer>> alloc_shared(size_t bytes) override;
  StatusOr<Request> isend(int dst, int tag, const void* data, size_t bytes) override;
  StatusOr<Request> irecv(int src, int tag, void* data, size_t bytes) override;
  // Marks this rank failed now, as a crash would: abort() of the real world, so the other
  // ranks are told (the armed fault calls it too).
  // NOTE: a rank that merely returns its error is announced by run_world only after the body's
  // locals are gone; calling abort() first tells the others at once, as a crash would be seen.
  void abort(const Status& reason) override { inner_.abort(reason); }
  Status failure() const override { return inner_.failure(); }
  bool rank_failed(int r) const override { return inner_.rank_failed(r); }
  Status after_timeout(Status timed_out) override {
    return inner_.after_timeout(std::move(timed_out));
  }

 private:
  // Counts a call; the armed fault fires here.
  Status hit(const char* call);

  World& inner_;
  std::atomic<int> calls_{0};
  std::atomic<int> armed_at_{0};
  std::atomic<int> countdown_{0};
  std::atomic<bool> fired_{false};
  std::mutex mu_;
  Status reason_;
};

}  // namespace moed::testing
