// A low-latency call through the node-shared segments (segment_dispatch.cc, segment_combine.cc;
// the protocol in segment_peers.h): a dispatch in shrink mode, and every combine (in place,
// state.h, or not). In shrink mode (DeepEP's enable_shrink) with no collective, masking a peer that
// misses a deadline; else after the call's agreement, a lost peer being every rank's error.
#pragma once

#include <memory>
#include <vector>

#include "dispatch/low_latency/state.h"

namespace moed::low_latency {

// `local`: this rank's input check (check_dispatch / check_combine); an error other than a
// failed precondition is published as the call's verdict, so the peers fail the call too
// (outside shrink mode the agreement has already failed it everywhere).
StatusOr<LowLatencyDispatchOutput> segment_dispatch(
    const std::shared_ptr<LowLatencyBuffer::State>& st, const LowLatencyDispatchInput& in,
    const Status& local);
// `in_place` ([R], from the call's agreement; empty: none): the in-node homes read this rank's
// rows where they are (state.h, in-place combine) instead of from its segment.
StatusOr<LowLatencyCombineOutput> segment_combine(
    const std::shared_ptr<LowLatencyBuffer::State>& st, const LowLatencyCombineInput& in,
    const Status& local, std::vector<InPlaceRows> in_place = {});
// Shrink mode: a barrier over the unmasked ranks.
Status segment_clean(LowLatencyBuffer::State& st);

}  // namespace moed::low_latency
