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
#include "dispatch/flex/engines.h"
#include "dispatch/steps.h"
#include "moed/flex.h"

namespace moed::flex {

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
  StatusOr<Request> token_dispatch(bool async) override {
    return run_step(*world_, async, dispatch_, kDispatchCalls, [this] { return dispatch_body(); });
  }
  StatusOr<DispatchOutput> dispatch_postprocess() override;
  Status combine_preprocess(const CombineInput& input,
                            const Status& caller_error = Status()) override;
  StatusOr<Request> token_combine(bool async) override {
    return run_step(*world_, async, combine_, kCombineCalls, [this] { return combine_body(); });
  }
  StatusOr<CombineOutput> combine_postprocess() override;
  Status dispatch_postprocess_backward(const DispatchGradInput& grad) override;
  StatusOr<Request> token_dispatch_backward(bool async) override {
    return run_step(*world_, async, dispatch_grad_, kDispatchBackwardCalls,
                    [this] { return dispatch_backward_body(); });
  }
  StatusOr<DispatchGrad> dispatch_preprocess_backward() override;
  Status combine_postprocess_backward(const CombineGradInput& grad) override;
  StatusOr<Request> token_combine_backward(bool async) override {
    return run_step(*world_, async, combine_grad_, kCombineBackwardCalls,
                    [this] { return combine_backward_body(); });
  }
  StatusOr<CombineGrad> combine_preprocess_backward() override;

  StatusOr<TensorView> expert_output_buffer(const DispatchHandle& handle, DType dtype) override;
  // flex_ordered_combine (flex_dispatcher.h): DeepEP V2's combine order, one synchronous call.
  StatusOr<OrderedCombineOutput> ordered_combine(std::shared_ptr<const DispatchHandle> handle,
                                                 const OrderedCombineInput& input);

 private:
  // ---- per-step state (reset by the step's first call; the sequencer in dispatch/steps.h) ----
  struct DispatchStep : Step {
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
  struct CombineStep : Step {
    std::shared_ptr<const FlexHandle> handle;
    TensorView rows;  // expert outputs
    Tensor out;
    std::optional<TensorView> user_out;  // CombineInput::out: the result goes there instead
  };
  struct DispatchBackwardStep : Step {
    std::shared_ptr<const FlexHandle> handle;
    TensorView rows;  // grad of expert_input
    std::span<const float> grad_permuted_probs;
    Tensor out;
    std::vector<float> probs;
  };
  struct CombineBackwardStep : Step {
    std::shared_ptr<const FlexHandle> handle;
    TensorView grad;  // grad of hidden
    TensorView rows;  // expert outputs (weighted combine)
    Tensor out;
    std::vector<float> probs;
  };

  // The handle if it is this dispatcher's, and in *local why not.
  std::shared_ptr<const FlexHandle> own_handle(const std::shared_ptr<const DispatchHandle>& handle,
                                               Status* local) const;
  // The first call of a step after the dispatch: resets and stages `step`, takes its handle and
  // checks `rows` against it ([num_rows, hidden] on the expert side, else [num_tokens, hidden]),
  // the verdict in step.local.
  template <class S>
  void start_step(S& step, const std::shared_ptr<const DispatchHandle>& handle, const char* name,
                  const TensorView& rows, bool expert_side);
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
