// The MPI world: ranks are MPI processes (OpenMPI), with the same contract as the threads world
// (moed/world.h; docs/multihost.md says how it is built and what its limits are). MPI calls come
// from the thread that made the world, or from any one thread at a time under
// MPI_THREAD_MULTIPLE; after a failure or a timeout the world is unusable.
//
//   MPI_Init(&argc, &argv);
//   {
//     MOED_ASSIGN_OR_RETURN(std::unique_ptr<moed::World> w,
//                           moed::make_mpi_world(MPI_COMM_WORLD, moed::WorldOptions{}));
//     ... w->all_reduce_f32(...) ...
//   }  // drop the world (and its shared buffers) before MPI_Finalize
//   MPI_Finalize();
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
