// Dispatcher-independent parts of TokenDispatcher: names, the config's validation, and the
// one-call dispatch / combine / backward built from the six steps.
#include "moed/dispatcher.h"

#include "core/enum_names.h"

namespace moed {

namespace {
constexpr EnumName<DispatcherKind> kDispatcherKindNames[] = {
    {DispatcherKind::kAllGather, "allgather"},
    {DispatcherKind::kAlltoAll, "alltoall"},
    {DispatcherKind::kFlex, "flex"},
};
}  // namespace

const char* dispatcher_kind_name(DispatcherKind k) {
  return enum_name(kDispatcherKindNames, k, "?");
}

StatusOr<DispatcherKind> parse_dispatcher_kind(std::string_view name) {
  return parse_enum(kDispatcherKindNames, name, "dispatcher", "is not one of");
}

Status DispatchConfig::validate(int world_size) const {
  if (world_size <= 0) return invalid_argument("world size = ", world_size, " must be positive");
  if (num_experts <= 0) return invalid_argument("num_experts = ", num_experts, " must be positive");
  if (etp_size <= 0) return invalid_argument("etp_size = ", etp_size, " must be positive");
  if (ep_size < 0)
    return invalid_argument("ep_size = ", ep_size, " must be positive (or 0 = auto)");
  if (world_size % etp_size != 0 && ep_size == 0) {
    return invalid_argument("etp_size = ", etp_size, " does not divide world size ", world_size);
  }
  const int ep = effective_ep_size(world_size);
  if (ep * etp_size != world_size) {
    return invalid_argument("ep_size * etp_size = ", ep, " * ", etp_size, " = ", ep * etp_size,
                            " is not the world size ", world_size);
  }
  if (num_experts % ep != 0) {
    return invalid_argument("num_experts = ", num_experts, " is not divisible by ep_size = ", ep);
  }
  MOED_RETURN_IF_ERROR(layout.validate());
  if (num_worst_tokens < 0) {
    return invalid_argument("num_worst_tokens = ", num_worst_tokens, " must be >= 0");
  }
  if (num_channels < 0) return invalid_argument("num_channels = ", num_channels, " must be >= 0");
  if (kind != DispatcherKind::kFlex && (num_worst_tokens != 0 || num_channels != 0)) {
    return invalid_argument("num_worst_tokens and num_channels are Flex options; dispatcher '",
                            dispatcher_kind_name(kind), "' does not take them");
  }
  return ok_status();
}

namespace {
// One call of a step group: its three steps in order, the communicating one synchronous.
template <class Output, class First>
StatusOr<Output> run_steps(TokenDispatcher& d, const First& first,
                           StatusOr<Request> (TokenDispatcher::*token)(bool),
                           StatusOr<Output> (TokenDispatcher::*last)()) {
  MOED_RETURN_IF_ERROR(first());
  StatusOr<Request> r = (d.*token)(/*async=*/false);
  if (!r.ok()) return r.status();
  MOED_CHECK(*r != nullptr, "a dispatcher step returned a null request");
  MOED_RETURN_IF_ERROR((*r)->wait());
  return (d.*last)();
}
}  // namespace

StatusOr<DispatchOutput> TokenDispatcher::dispatch(const DispatchInput& input,
                                                   const Status& caller_error) {
  return run_steps<DispatchOutput>(
      *this, [&] { return dispatch_preprocess(input, caller_error); },
      &TokenDispatcher::token_dispatch, &TokenDispatcher::dispatch_postprocess);
}

StatusOr<CombineOutput> TokenDispatcher::combine(const CombineInput& input,
                                                 const Status& caller_error) {
  return run_steps<CombineOutput>(
      *this, [&] { return combine_preprocess(input, caller_error); },
      &TokenDispatcher::token_combine, &TokenDispatcher::combine_postprocess);
}

StatusOr<DispatchGrad> TokenDispatcher::dispatch_backward(const DispatchGradInput& grad) {
  return run_steps<DispatchGrad>(
      *this, [&] { return dispatch_postprocess_backward(grad); },
      &TokenDispatcher::token_dispatch_backward, &TokenDispatcher::dispatch_preprocess_backward);
}

StatusOr<CombineGrad> TokenDispatcher::combine_backward(const CombineGradInput& grad) {
  return run_steps<CombineGrad>(
      *this, [&] { return combine_postprocess_backward(grad); },
      &TokenDispatcher::token_combine_backward, &TokenDispatcher::combine_preprocess_backward);
}

}  // namespace moed
