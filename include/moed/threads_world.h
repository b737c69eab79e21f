// The threads world: R ranks as R threads of this process (moed's embedded default;
// docs/design.md §9).
//
// run_threads starts one thread per rank, hands each its own World, and returns the first
// error. Ranks form nodes of options.ranks_per_node (G): a node's ranks share memory
// (World::alloc_shared); messages between nodes copy once, sender to receiver, like RDMA.
//
//   moed::WorldOptions opts;
//   opts.ranks_per_node = 2;  // 4 ranks = 2 nodes of 2
//   moed::Status s = moed::run_threads(4, opts, [](moed::World& w) -> moed::Status {
//     float x = float(w.rank()), sum = 0;
//     MOED_RETURN_IF_ERROR(w.all_reduce_f32(&x, &sum, 1));  // 0 + 0 + 1 + 2 + 3 = 6
//     return moed::ok_status();
//   });
#pragma once

#include <functional>

#include "moed/status.h"
#include "moed/world.h"

namespace moed {

// Runs body(world) on world_size threads, one rank each, and waits for all of them.
// Returns OK when every rank returned OK. Otherwise the root cause: the error of the lowest
// rank whose error is not the kAborted echo of another rank's failure (so an error every rank
// agreed on comes back once, unchanged); an exception becomes kInternal "rank r threw: ...".
// Errors in the arguments (world_size < 1, G not dividing world_size, timeout <= 0) are
// kInvalidArgument and run nothing.
// threads_per_rank = 0 gives each rank max(1, cores / world_size) pool threads.
Status run_threads(int world_size, const WorldOptions& options,
                   const std::function<Status(World&)>& body);

}  // namespace moed
