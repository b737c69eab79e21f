// FaultHook: makes this rank fail at its nth call on a world (World::set_call_hook), the way a
// rank that crashes there would: the failure is announced to the others (World::abort) and
// the call returns the reason. So a test can fail a rank at every communication point of a
// dispatch or a combine (after the count exchange, between the pushes, before the combine
// reads). Calls from any thread are counted.
//
//   FaultHook faults(w);                          // w: the world of run_world's body
//   if (w.rank() == 2) faults.arm(5, internal_error("injected"));  // the 5th call from now
//   ... d->dispatch(...) ...
#pragma once

#include <atomic>
#include <mutex>

#include "moed/world.h"

namespace moed::testing {

class FaultHook {
 public:
  explicit FaultHook(World& w);
  ~FaultHook();  // takes the hook off the world
  FaultHook(const FaultHook&) = delete;
  FaultHook& operator=(const FaultHook&) = delete;

  // Fails this rank at its nth (1-based) world call from now, with `reason` (the message gets
  // " at <call>" appended). nth <= 0 disarms.
  void arm(int nth, const Status& reason);
  // World calls this rank made since the last arm() (or construction).
  int calls() const { return calls_.load() - armed_at_.load(); }
  // Whether the armed fault has fired.
  bool fired() const { return fired_.load(); }

 private:
  // Counts a call; the armed fault fires here.
  Status hit(const char* call);

  World& w_;
  std::atomic<int> calls_{0};
  std::atomic<int> armed_at_{0};
  std::atomic<int> countdown_{0};
  std::atomic<bool> fired_{false};
  std::mutex mu_;
  Status reason_;
};

}  // namespace moed::testing
