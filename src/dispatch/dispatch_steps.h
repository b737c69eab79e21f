// Internal: TokenDispatcher's step methods (moed/dispatcher.h documents them), declared once
// for every dispatcher, in the interface's four groups of three.
#pragma once

#include "moed/dispatcher.h"

// NOTE: the interface's methods listed once, so the dispatchers cannot drift: each declares
// the same signatures, and `override` makes any that leaves TokenDispatcher's an error.
// Every group has one shape: a local step taking the input, the communicating step, a local
// step returning the output.
#define MOED_STEP_GROUP(first, Input, token, last, Output) \
  Status first(const Input&) override;                     \
  StatusOr<Request> token(bool async) override;            \
  StatusOr<Output> last() override
#define MOED_DISPATCH_STEPS                                                                 \
  MOED_STEP_GROUP(dispatch_preprocess, DispatchInput, token_dispatch, dispatch_postprocess, \
                  DispatchOutput)
#define MOED_COMBINE_STEPS                                                              \
  MOED_STEP_GROUP(combine_preprocess, CombineInput, token_combine, combine_postprocess, \
                  CombineOutput)
#define MOED_DISPATCH_BACKWARD_STEPS                                                         \
  MOED_STEP_GROUP(dispatch_postprocess_backward, DispatchGradInput, token_dispatch_backward, \
                  dispatch_preprocess_backward, DispatchGrad)
#define MOED_COMBINE_BACKWARD_STEPS                                                       \
  MOED_STEP_GROUP(combine_postprocess_backward, CombineGradInput, token_combine_backward, \
                  combine_preprocess_backward, CombineGrad)
