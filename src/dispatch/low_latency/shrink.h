// Shrink mode of LowLatencyBuffer (moed/low_latency.h; DeepEP's enable_shrink): the calls
// without collectives, masking a peer that misses a call's deadline (shrink_dispatch.cc,
// shrink_combine.cc; the protocol in shrink_peers.h).
#pragma once

#include <memory>

#include "dispatch/low_latency/state.h"

namespace moed::low_latency {

// `local`: this rank's input check (check_dispatch / check_combine); an error other than a
// failed precondition is published as the call's verdict, so the peers fail the call too.
StatusOr<LowLatencyDispatchOutput> shrink_dispatch(
    const std::shared_ptr<LowLatencyBuffer::State>& st, const LowLatencyDispatchInput& in,
    const Status& local);
StatusOr<LowLatencyCombineOutput> shrink_combine(const std::shared_ptr<LowLatencyBuffer::State>& st,
                                                 const LowLatencyCombineInput& in,
                                                 const Status& local);
// A barrier over the unmasked ranks.
Status shrink_clean(LowLatencyBuffer::State& st);

}  // namespace moed::low_latency
