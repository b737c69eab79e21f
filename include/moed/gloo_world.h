// The gloo world: ranks are processes joined by gloo's TCP transport (Debian's libgloo), the
// engine under torch.distributed's CPU backend, with the same contract as the threads and
// MPI worlds (moed/world.h). The Python package makes one from a torch.distributed group
// (moed.from_torch); C++ callers bring any gloo rendezvous store (a FileStore, say).
//
// Nodes: by default the ranks of one host (same hostname, boot id and /dev/shm); set
// options.ranks_per_node (G) to split a host into emulated nodes. Node-shared memory is one
// POSIX shared-memory segment per alloc_shared, unlinked as soon as every local rank has
// mapped it (so a crash leaves nothing in /dev/shm). The network and the world's collectives
// are gloo unbound-buffer sends and receives, polled against failures and the timeout; fp32
// sums are done locally in ascending rank order.
//
// Faults: a failing rank (abort) writes its reason into the host's control segment and sends
// it to every rank over gloo; a rank whose process ends without closing its world is noticed
// by the ranks of its host (its pid is gone) and reported to everyone the same way; a closed
// connection names the peer. Calls are made from the thread that made the world (pool
// workers may wait on shared-memory signals).
//
//   auto store = std::make_shared<gloo::rendezvous::FileStore>("/tmp/rendezvous");
//   MOED_ASSIGN_OR_RETURN(auto w, moed::make_gloo_world(*store, rank, size, {}));
#pragma once

#include <memory>
#include <string>

#include "moed/status.h"
#include "moed/world.h"

namespace gloo::rendezvous {
class Store;
}

namespace moed {

struct GlooWorldOptions {
  WorldOptions world;
  // The address this rank listens on (a name or an IP; "" = this host's name). Between
  // hosts it must be reachable from every other rank.
  std::string address;
  // Overrides this rank's host identity (tests; "" = hostname + boot id + /dev/shm's device).
  std::string host_id;
};

// Collective over the `size` ranks that use `store` (keys are made under the store as
// given: use a fresh prefix per world). The store is used only inside this call. Errors (bad
// G, ranks of one node on different hosts, a bad timeout) are the same on every rank.
StatusOr<std::unique_ptr<World>> make_gloo_world(gloo::rendezvous::Store& store, int rank, int size,
                                                 const GlooWorldOptions& options);

}  // namespace moed
