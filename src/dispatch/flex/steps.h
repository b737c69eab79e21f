// The Flex dispatcher's class: one state struct per step (dispatch, combine and the backward of
// each), the ring of dispatch-output regions and the one agreement each step starts with.
// flex_dispatcher.cc has the dispatch steps and the design notes; combine_steps.cc the rest.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "comm/agreement.h"
#include "comm/tags.h"
#include "dispatch/flex/flex_dispatcher.h"
#include "dispatch/flex/flex_internal.h"
#include "moed/flex.h"

namespace moed::flex {


// The outcome of one communicating step, read by the step after it.
struct OpState {
  std::atomic<bool> finished{false};  // the body returned (ready() of the async request)
  bool done = false;                  // the status was collected (wait() or a sync run)
  Status status;
};

// Width in int64 of a dispatch's agreement row (flex_dispatcher.cc): the code, six fields and
// notify's counts. Tests use it to tell the agreement's bytes from the payload's.
inline size_t dispatch_agreement_width(const Topology& topo) {
  return 1 + 6 + notify_row_width(topo);
}

class Dispatcher final : public moed::FlexDispatcher {
 public:
  Dispatcher(World& world, const DispatchConfig& config);
  Status init() { return signals_.init(*world_); }

  Status dispatch_preprocess(const DispatchInput& input,
                             const Status& caller_error = Status()) override;
  StatusOr<Request> token_dispatch(bool async) override;
  StatusOr<DispatchOutput> dispatch_postprocess() override;
  Status combine_preprocess(const CombineInput& input,
                            const Status& caller_error = Status()) override;
  StatusOr<Request> token_combine(bool async) override;
  StatusOr<CombineOutput> combine_postprocess() override;
  Status dispatch_postprocess_backward(const DispatchGradInput& grad) override;
  StatusOr<Request> token_dispatch_backward(bool async) override;
  StatusOr<DispatchGrad> dispatch_preprocess_backward() override;
  Status combine_postprocess_backward(const CombineGradInput& grad) override;
  StatusOr<Request> token_combine_backward(bool async) override;
  StatusOr<CombineGrad> combine_preprocess_backward() override;

  StatusOr<TensorView> expert_output_buffer(const DispatchHandle& handle, DType dtype) override;
  // flex_ordered_combine (flex_dispatcher.h): DeepEP V2's combine order, one synchronous call.
  StatusOr<OrderedCombineOutput> ordered_combine(std::shared_ptr<const DispatchHandle> handle,
                                                 const OrderedCombineInput& input);

 private:
  // ---- per-step state (reset by the step's first call) ----
  // What every step has: the flag run() checks the call order by, this rank's verdict on
  // its input (agreed in the step's one collective) and the communicating call's progress.
  struct StepState {
    bool staged = false;  // preprocess ran, the communicating call not yet
    Status local;
    std::shared_ptr<OpState> op;
  };
  struct DispatchStep : StepState {
    TokenRows rows;                         // the caller's tokens, until token_dispatch returns
    DType dtype = DType::kF32;              // theirs: a cached dispatch may move another dtype
    int64_t hidden = 0;                     // and rows of another width
    bool cached_mode = false;               // cached_handle given (agreed in the exchange)
    std::optional<PreparedInput> prepared;  // uncached
    std::shared_ptr<const FlexHandle> cached;
    std::shared_ptr<FlexHandle> fresh;  // made by notify (uncached)
    int slot = -1;                      // ring slot written
    std::optional<TensorView> out;      // DispatchInput::out: the rows are copied there
    PushLayout layout;
    const FlexHandle& handle() const { return cached ? *cached : *fresh; }
  };
  struct CombineStep : StepState {
    std::shared_ptr<const FlexHandle> handle;
    TensorView rows;  // expert outputs
    Tensor out;
    std::optional<TensorView> user_out;  // CombineInput::out: the result goes there instead
  };
  struct DispatchBackwardStep : StepState {
    std::shared_ptr<const FlexHandle> handle;
    TensorView rows;  // grad of expert_input
    std::span<const float> grad_permuted_probs;
    Tensor out;
    std::vector<float> probs;
  };
  struct CombineBackwardStep : StepState {
    std::shared_ptr<const FlexHandle> handle;
    TensorView grad;  // grad of hidden
    TensorView rows;  // expert outputs (weighted combine)
    Tensor out;
    std::vector<float> probs;
  };

  // A step's communicating call: an error naming the order (`not_staged`) unless its
  // preprocess call staged it (step.staged, cleared here); then body, now or in the
  // background, its progress in step.op.
  StatusOr<Request> run(bool async, StepState& step, const char* not_staged,
                        std::function<Status()> body);
  static Status finished(const std::shared_ptr<OpState>& state, const char* step);
  // The handle if it is this dispatcher's, and in *local why not.
  std::shared_ptr<const FlexHandle> own_handle(const std::shared_ptr<const DispatchHandle>& handle,
                                               Status* local) const;
  // The first call of a step after the dispatch: resets and stages `step`, takes its handle and
  // checks `rows` against it ([num_rows, hidden] on the expert side, else [num_tokens, hidden]),
  // the verdict in step.local.
  template <class Step>
  void start_step(Step& step, const std::shared_ptr<const DispatchHandle>& handle, const char* name,
                  const TensorView& rows, bool expert_side);
  // The last call of a step: the communicating call's status (finished), then the step's state,
  // the member reset for the next step.
  template <class Step>
  static StatusOr<Step> finish_step(Step& step, const char* name);
  Status check_cached(const DispatchInput& input);

  int64_t node_cap_rows(const FlexHandle& h) const;
  size_t pull_scalars_off(const FlexHandle& h, DType dt) const;
  size_t pull_bytes(const FlexHandle& h, DType dt) const;

  Status dispatch_body();
  Status combine_body();
  Status dispatch_backward_body();
  Status combine_backward_body();
  Status push_step(const DispatchContext& ctx, const PushSpec& spec, int tag);
  Status pull_step(const FlexHandle& h, const TensorView& rows, std::span<const float> scalars,
                   PullSpec spec, int tag);

  uint64_t id_;
  Topology topo_;
  bool in_place_;  // world shares one address space: pull sources are read where they are
  Signals signals_;
  OutputRing outputs_;
  Region pull_region_, grad_region_;
  NetScratch net_[tags::kFlexStepKinds];  // one per step kind, by tag - tags::kFlexDispatch
  NetScratch* net(int tag) { return &net_[tag - tags::kFlexDispatch]; }
  uint64_t epoch_ = 0;

  DispatchStep dispatch_;
  CombineStep combine_;
  DispatchBackwardStep dispatch_grad_;
  CombineBackwardStep combine_grad_;
};

}  // namespace moed::flex
