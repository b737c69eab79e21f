#include "faults/fault_hook.h"

namespace moed::testing {

FaultHook::FaultHook(World& w) : w_(w) {
  w_.set_call_hook([this](const char* call) { return hit(call); });
}

FaultHook::~FaultHook() { w_.set_call_hook(nullptr); }

void FaultHook::arm(int nth, const Status& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  reason_ = reason;
  armed_at_.store(calls_.load());
  countdown_.store(nth > 0 ? nth : 0);
}

Status FaultHook::hit(const char* call) {
  calls_.fetch_add(1);
  int c = countdown_.load();
  while (c > 0 && !countdown_.compare_exchange_weak(c, c - 1)) {
  }
  if (c != 1) return ok_status();
  Status reason;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reason = Status(reason_.code(), reason_.message() + " at " + call);
  }
  fired_.store(true);
  w_.abort(reason);
  return reason;
}

}  // namespace moed::testing
