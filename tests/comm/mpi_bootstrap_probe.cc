// A world whose last rank is late: that rank sleeps before make_mpi_world, the others call it
// at once with a short timeout. Every rank must come back with kDeadlineExceeded naming the
// step (none may wait for the late rank without a bound), then leave without MPI_Finalize,
// which would wait for every process. mpi_bootstrap_test.sh checks each rank's line.
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "comm/mpi/process.h"
#include "moed/mpi_world.h"

int main(int argc, char** argv) {
  moed::mpi::init_thread(&argc, &argv, MPI_THREAD_FUNNELED);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  moed::WorldOptions opts;
  opts.timeout = std::chrono::milliseconds(500);
  if (rank == size - 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  auto world = moed::make_mpi_world(MPI_COMM_WORLD, opts);
  std::printf("bootstrap rank %d: %s\n", rank,
              world.ok() ? "OK" : world.status().to_string().c_str());
  std::fflush(stdout);
  // Give every rank (the late one too) time to print before mpirun sees the first exit
  // without MPI_Finalize and ends the job.
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  if (moed::mpi_peer_may_be_gone()) _exit(0);
  moed::mpi::finalize();
  return 0;
}
