#include "dispatch/steps.h"

#include <thread>

namespace moed {

namespace {

// A communicating call with async = true: the body runs on its own thread; wait() joins it.
class AsyncStep final : public PendingOp {
 public:
  AsyncStep(std::function<Status()> body, std::shared_ptr<StepOp> op)
      : op_(std::move(op)), thread_([this, body = std::move(body)] {
          result_ = body();
          op_->finished.store(true, std::memory_order_release);
        }) {}
  ~AsyncStep() override {
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
  Status result_;
  std::thread thread_;
};

}  // namespace

StatusOr<Request> run_step(World& world, bool async, Step& step, const char* not_staged,
                           std::function<Status()> body) {
  if (!step.staged) return failed_precondition(not_staged);
  step.staged = false;
  const std::shared_ptr<StepOp> op = step.op = std::make_shared<StepOp>();
  if (async && world.calls_from_any_thread()) {
    return Request(std::make_unique<AsyncStep>(std::move(body), op));
  }
  op->status = body();
  op->done = true;
  op->finished.store(true);
  if (!op->status.ok()) return op->status;
  return completed_request();
}

Status step_status(const std::shared_ptr<StepOp>& op, const char* call) {
  if (!op) return failed_precondition(call, " has not run");
  if (!op->done) return failed_precondition(call, "(async = true) was not waited on");
  return op->status;
}

}  // namespace moed
