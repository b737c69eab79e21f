#include "dispatch/steps.h"

#include <thread>

#include "comm/backend.h"

namespace moed {

namespace {

// BodyRun::kBackground: the body runs on its own thread, in its turn among the world's async
// steps (comm/backend.h, wait_turn); wait() joins it.
class BackgroundBody final : public PendingOp {
 public:
  BackgroundBody(World& world, std::function<Status()> body, std::shared_ptr<StepOp> op)
      : op_(std::move(op)),
        ticket_(world.async_steps().taken.fetch_add(1, std::memory_order_acq_rel) + 1),
        thread_([this, &world, body = std::move(body)] {
          internal::t_async_step = {&world, ticket_};
          result_ = internal::wait_turn(world);
          if (result_.ok()) result_ = body();
          world.async_steps().finished.fetch_add(1, std::memory_order_acq_rel);
          op_->finished.store(true, std::memory_order_release);
        }) {}
  ~BackgroundBody() override {
    if (thread_.joinable()) wait().ignore();
  }
  Status wait() override {
    if (thread_.joinable()) {
      thread_.join();
      op_->status = result_;
      op_->done = true;
    }
    return op_->status;
  }
  bool ready() override { return op_->finished.load(std::memory_order_acquire); }

 private:
  std::shared_ptr<StepOp> op_;
  const uint64_t ticket_;
  Status result_;
  std::thread thread_;
};

// BodyRun::kOnWait: the body runs inside the first wait(), or when the request is dropped.
class BodyOnWait final : public PendingOp {
 public:
  BodyOnWait(std::function<Status()> body, std::shared_ptr<StepOp> op)
      : body_(std::move(body)), op_(std::move(op)) {}
  ~BodyOnWait() override {
    if (body_) wait().ignore();
  }
  Status wait() override {
    if (body_) {
      op_->status = std::exchange(body_, nullptr)();
      op_->done = true;
      op_->finished.store(true, std::memory_order_release);
    }
    return op_->status;
  }
  bool ready() override { return op_->done; }  // the body runs inside wait()

 private:
  std::function<Status()> body_;
  std::shared_ptr<StepOp> op_;
};

}  // namespace

Request run_body(BodyRun how, std::function<Status()> body, std::shared_ptr<StepOp> op,
                 World* world) {
  if (!op) op = std::make_shared<StepOp>();
  switch (how) {
    case BodyRun::kBackground:
      MOED_CHECK(world != nullptr, "a background body needs its world");
      return std::make_unique<BackgroundBody>(*world, std::move(body), std::move(op));
    case BodyRun::kOnWait:
      return std::make_unique<BodyOnWait>(std::move(body), std::move(op));
    case BodyRun::kNow:
      break;
  }
  op->status = body();
  op->done = true;
  op->finished.store(true, std::memory_order_release);
  return completed_request(op->status);
}

StatusOr<Request> run_step(World& world, bool async, Step& step, const StepCalls& calls,
                           std::function<Status()> body) {
  if (!step.staged) return failed_precondition(calls.token, " before ", calls.first);
  step.staged = false;
  step.op = std::make_shared<StepOp>();
  const bool background = async && world.calls_from_any_thread();
  Request r = run_body(background ? BodyRun::kBackground : BodyRun::kNow, std::move(body), step.op,
                       &world);
  if (!background && !step.op->status.ok()) return step.op->status;
  return r;
}

Status step_status(const std::shared_ptr<StepOp>& op, const char* call) {
  if (!op) return failed_precondition(call, " has not run");
  if (!op->done) return failed_precondition(call, "(async = true) was not waited on");
  return op->status;
}

}  // namespace moed
