// The step sequencer of every TokenDispatcher (design.md §1.1). A step's first call stages it:
// local, it keeps this rank's verdict on its input instead of returning it. Its communicating
// call runs the step's body, which agrees on the verdict first (one rank's bad input is every
// rank's error), now or on its own thread. Its last call collects the body's status and the
// step's state, leaving the member reset for the next step. Low-latency mode's receive phase
// runs on the same body runner (run_body), inside its hook's wait().
//
//   struct CombineStep : Step { TensorView rows; };
//   combine_ = CombineStep{}; combine_.local = check(input); combine_.staged = true;
//   return run_step(*world_, async, combine_, kCombineCalls, [this] { return combine_body(); });
//   MOED_ASSIGN_OR_RETURN(CombineStep c, finish_step(combine_, kCombineCalls));
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <utility>

#include "moed/status.h"
#include "moed/world.h"

namespace moed {

// The outcome of one communicating call, read by the step's last call.
struct StepOp {
  std::atomic<bool> finished{false};  // the body returned (ready() of the async request)
  bool done = false;                  // the status was collected (wait() or a sync run)
  Status status;
};

// A step's first and communicating calls, as TokenDispatcher names them (moed/dispatcher.h).
struct StepCalls {
  const char* first;  // stages the step
  const char* token;  // communicates
};
inline constexpr StepCalls kDispatchCalls{"dispatch_preprocess", "token_dispatch"};
inline constexpr StepCalls kCombineCalls{"combine_preprocess", "token_combine"};
inline constexpr StepCalls kDispatchBackwardCalls{"dispatch_postprocess_backward",
                                                  "token_dispatch_backward"};
inline constexpr StepCalls kCombineBackwardCalls{"combine_postprocess_backward",
                                                 "token_combine_backward"};

// What every step's state has; each dispatcher's per-step structs derive from it.
struct Step {
  bool staged = false;  // the first call ran, the communicating call not yet
  Status local;         // this rank's verdict on the step's input, agreed by the body
  std::shared_ptr<StepOp> op;
};

// How a communicating body runs: now (the request is complete; its wait() returns the body's
// status); on its own thread of `world` (wait() joins it), in its turn: after the async steps
// started before it, and every later call on the world after it (World::AsyncSteps); or inside
// the request's first wait() (a receive hook, design.md §6.4: a request dropped unwaited runs
// it in its destructor, so what the body frees is freed). `op`, when given, also gets the
// outcome. Never null.
enum class BodyRun { kNow, kBackground, kOnWait };
Request run_body(BodyRun how, std::function<Status()> body, std::shared_ptr<StepOp> op = nullptr,
                 World* world = nullptr);

// The communicating call: an error naming the order unless the first call staged `step`
// (cleared here); then `body`, on its own thread when async and the world allows calls from any
// thread (World::calls_from_any_thread), else now, its error then returned.
StatusOr<Request> run_step(World& world, bool async, Step& step, const StepCalls& calls,
                           std::function<Status()> body);

// The body's status, or an error naming `call` when it has not run or was not waited on.
Status step_status(const std::shared_ptr<StepOp>& op, const char* call);

// The last call: the body's status, then the step's state (the member reset).
template <class S>
StatusOr<S> finish_step(S& step, const StepCalls& calls) {
  MOED_RETURN_IF_ERROR(step_status(step.op, calls.token));
  return std::exchange(step, S{});
}

// The last call of a step whose body makes what that call returns (S::result).
template <class S>
StatusOr<decltype(S::result)> finish_result(S& step, const StepCalls& calls) {
  MOED_ASSIGN_OR_RETURN(S done, finish_step(step, calls));
  return std::move(done.result);
}

}  // namespace moed
