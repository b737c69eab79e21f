// Test support for the low-latency buffer (moed/low_latency.h), header-only: tests that link
// moed_low_latency include it.
#pragma once

#include "moed/low_latency.h"
#include "moed/status.h"

namespace moed::testing {

// One low-latency dispatch of `x` and the combine of what it received (identity experts: y is
// the dispatched rows), each waited for through its hook. The dispatch is kept: its handle
// serves further combines.
struct LowLatencyRoundTrip {
  LowLatencyDispatchOutput dispatch;
  LowLatencyCombineOutput combine;
};

inline StatusOr<LowLatencyRoundTrip> low_latency_round_trip(LowLatencyBuffer& buf, TensorView x,
                                                            const TopkRouting& topk, bool hook) {
  MOED_ASSIGN_OR_RETURN(
      LowLatencyDispatchOutput d,
      buf.low_latency_dispatch({.x = x, .topk = TopkView::of(topk), .return_recv_hook = hook}));
  MOED_RETURN_IF_ERROR(d.hook->wait());
  MOED_ASSIGN_OR_RETURN(LowLatencyCombineOutput c,
                        buf.low_latency_combine({.x = d.recv.x,
                                                 .topk = TopkView::of(topk),
                                                 .handle = d.handle,
                                                 .return_recv_hook = hook}));
  MOED_RETURN_IF_ERROR(c.hook->wait());
  return LowLatencyRoundTrip{std::move(d), std::move(c)};
}

}  // namespace moed::testing
