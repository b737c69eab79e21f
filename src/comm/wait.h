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

// The back-off of a polling loop at its i-th round past the first 64 spins.
// NOTE: ranks often outnumber cores (8 ranks on 2 cores in CI), so a loop spins only briefly,
// then yields, then sleeps: a spinning waiter must not starve the rank it waits for.
inline void backoff(int i) {
  if (i < 2048) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(i < 8192 ? 20 : 200));
  }
}

// Polls done() until it returns true. Returns the first error stop() reports (asked between
// rounds of the back-off), or kDeadlineExceeded "<what()>: waited N ms (timeout T ms)" once
// `timeout` has passed.
template <typename Done, typename Stop, typename What>
Status poll(std::chrono::milliseconds timeout, Done&& done, Stop&& stop, What&& what) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  for (int i = 0;; ++i) {
    if (done()) return ok_status();
    if (i < 64) {
      cpu_relax();
      continue;
    }
    Status stopped = stop();
    if (!stopped.ok()) return stopped;
    const auto now = Clock::now();
    if (now >= deadline) {
      if (done()) return ok_status();
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - start);
      return deadline_exceeded(what(), ": waited ", waited.count(), " ms (timeout ",
                               timeout.count(), " ms)");
    }
    backoff(i);
  }
}

// poll() against the world: returns world.failure() as soon as a rank has failed, and times
// out after world.timeout().
template <typename Done, typename What>
Status poll_until(const World& world, Done&& done, What&& what) {
  return poll(
      world.timeout(), std::forward<Done>(done), [&] { return world.failure(); },
      std::forward<What>(what));
}

// poll_until for a wait on a peer's signal outside the world's own collectives and messages
// (moed's shared-memory signals): on a timeout the world adds what it
// knows of the silent ranks (World::after_timeout; MPI's census), so a stalled rank is named
// whichever wait saw it first.
template <typename Done, typename What>
Status poll_peer(World& world, Done&& done, What&& what) {
  Status s = poll_until(world, std::forward<Done>(done), std::forward<What>(what));
  if (s.code() == StatusCode::kDeadlineExceeded) s = world.after_timeout(std::move(s));
  return s;
}

// A wait of an owner for its readers to be done with its memory (the threads world, where
// peers read and write each other's buffers in place): it runs on through a failed world,
// since a reader that took part in the call releases on every way out, error or not, and the
// owner may free the memory only then. Bounded by the timeout like every other wait.
template <typename Done, typename What>
Status poll_released(World& world, Done&& done, What&& what) {
  Status s = poll(
      world.timeout(), std::forward<Done>(done), [] { return ok_status(); },
      std::forward<What>(what));
  if (s.code() == StatusCode::kDeadlineExceeded) s = world.after_timeout(std::move(s));
  return s;
}

}  // namespace moed::internal
