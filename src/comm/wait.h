// The one way moed's backends wait: poll a condition with back-off, checking the world's
// failure state and its timeout, so that no wait outlives a failed peer or the deadline.
#pragma once

#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "moed/status.h"
#include "moed/world.h"

namespace moed::internal {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Polls done() until it returns true. Returns world.failure() as soon as a rank has failed,
// or kDeadlineExceeded "<what()>: waited N ms" once world.timeout() has passed.
// NOTE: ranks often outnumber cores (8 ranks on 2 cores in CI), so the loop spins only
// briefly, then yields, then sleeps: a spinning waiter must not starve the rank it waits for.
template <typename Done, typename What>
Status poll_until(const World& world, Done&& done, What&& what) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto deadline = start + world.timeout();
  for (int i = 0;; ++i) {
    if (done()) return ok_status();
    if (i < 64) {
      cpu_relax();
      continue;
    }
    Status failure = world.failure();
    if (!failure.ok()) return failure;
    const auto now = Clock::now();
    if (now >= deadline) {
      if (done()) return ok_status();
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - start);
      return deadline_exceeded(what(), ": waited ", waited.count(), " ms (timeout ",
                               world.timeout().count(), " ms)");
    }
    if (i < 2048) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(i < 8192 ? 20 : 200));
    }
  }
}

// poll_until for a wait on a peer's signal outside the world's own collectives and messages
// (moed's shared-memory signals, the low-latency acks): on a timeout the world adds what it
// knows of the silent ranks (World::after_timeout; MPI's census), so a stalled rank is named
// whichever wait saw it first.
template <typename Done, typename What>
Status poll_peer(World& world, Done&& done, What&& what) {
  Status s = poll_until(world, std::forward<Done>(done), std::forward<What>(what));
  if (s.code() == StatusCode::kDeadlineExceeded) s = world.after_timeout(std::move(s));
  return s;
}

}  // namespace moed::internal
