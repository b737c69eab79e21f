// The gloo world: ranks are processes joined by gloo's TCP transport (Debian's libgloo), the
// engine under torch.distributed's CPU backend, with the same contract as the threads and MPI
// worlds (moed/world.h; docs/gloo.md says how it works). The Python package makes one from a
// torch.distributed group (moed.from_torch); C++ callers bring any gloo rendezvous store.
//
// Nodes are the ranks of one host unless options.ranks_per_node (G) splits it. Calls are made
// from the thread that made the world (pool workers may wait on shared-memory signals).
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
