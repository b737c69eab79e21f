// The MPI world: ranks are MPI processes (OpenMPI), with the same contract as the threads
// world (moed/world.h).
//
// Nodes: by default the ranks of one host (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)); set
// options.ranks_per_node (G) to split a host into several emulated nodes. Node-shared
// memory is POSIX shared-memory segments, one per local rank, mapped by every local rank
// (src/comm/mpi/shared_memory.cc says why not MPI shared windows); the network is MPI
// point-to-point; collectives are MPI non-blocking collectives polled against the timeout,
// with fp32 sums done locally in ascending rank order (never MPI_SUM, whose order MPI does
// not fix).
//
//   MPI_Init(&argc, &argv);
//   {
//     MOED_ASSIGN_OR_RETURN(std::unique_ptr<moed::World> w,
//                           moed::make_mpi_world(MPI_COMM_WORLD, moed::WorldOptions{}));
//     ... w->all_reduce_f32(...) ...
//   }  // drop the world (and its shared buffers) before MPI_Finalize
//   MPI_Finalize();
//
// Limits: one message, or one rank's part of a collective, is at most INT_MAX bytes (an
// error otherwise). MPI calls come only from the thread that made the world; other threads
// (pool workers) may wait on shared-memory signals, which need no MPI. After a failure or a
// timeout the world is unusable: pending MPI operations are abandoned.
// A timeout names the ranks that did not answer a census (every other rank is asked "are you
// there?" and given a grace of timeout / 4, clamped to [0.5 s, 5 s]), so a stopped, dead or
// cut-off rank is named in the error of every rank that waited for it.
#pragma once

#include <mpi.h>

#include <memory>

#include "moed/status.h"
#include "moed/world.h"

namespace moed {

// Collective over comm (which it duplicates; comm may be freed afterwards). Errors (bad G,
// ranks of one node not on one host, a bad timeout) are the same on every rank.
StatusOr<std::unique_ptr<World>> make_mpi_world(MPI_Comm comm, const WorldOptions& options);

// True once a rank of an MPI world of this process gave no sign of life after a timeout (the
// census found it silent here, or on a rank whose failure message said so). Then a peer may be stopped, dead or unreachable, and
// MPI_Finalize (which waits for every process) could wait forever: exit without it (mpirun
// then ends the job). Such a world's destructor and its shared buffers skip their collective
// frees likewise. After other failures (a bad input, a rank that raised) every peer is alive,
// and teardown stays collective.
bool mpi_peer_may_be_gone();

}  // namespace moed
