// Choosing the world a command runs on (shared by `moed run`, `moed dispatch` and the
// `moed bench` commands): threads in this process, or the MPI job mpirun started.
//
//   int my_rank = 0;
//   Status s = moed::cli::run_in_world("mpi", 4, WorldOptions{}, body, &my_rank);
//   if (my_rank == 0) ... print the report ...
//
// NOTE: src/cli is the floor of the command line: the program (tools/moed) and the benchmark
// commands (bench/, a library the program links) both build on it, and it on neither.
#pragma once

#include <functional>
#include <string>

#include "moed/status.h"
#include "moed/world.h"

namespace moed::cli {

// True when this process was started by mpirun / mpiexec (OpenMPI or a PMI launcher).
bool launched_by_mpirun();
// The number of processes mpirun started (an error when not under mpirun).
StatusOr<int> mpi_world_size();
// Runs body on `ranks` ranks of the world named "threads" or "mpi" (under mpirun `ranks` is
// the job's size) and returns the root-cause error, the same on every rank. *my_rank is 0 for
// the threads world (the process speaks for all ranks) and the process's rank under MPI.
Status run_in_world(const std::string& world, int ranks, const WorldOptions& options,
                    const std::function<Status(World&)>& body, int* my_rank);

}  // namespace moed::cli
