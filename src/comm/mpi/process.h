// MPI_Init_thread and MPI_Finalize as moed's programs and tests call them.
//
// OpenMPI 4 allocates in both and never frees it (~120 KB in ~3300 blocks per process, none
// of it moed's), in this thread and in its progress thread. Under LeakSanitizer, this
// thread's allocations inside MPI_Init_thread are not counted as leaks, and finalize() checks
// for leaks before MPI_Finalize instead of at exit: what OpenMPI holds is still reachable
// then, and whatever MPI_Finalize drops is not moed's. Exact, where suppressions by frame
// name need full stacks on every malloc, which slows every MPI test under ASan.
#pragma once

namespace moed::mpi {

// MPI_Init_thread(argc, argv, required); returns the level MPI provides.
int init_thread(int* argc, char*** argv, int required);
void finalize();

}  // namespace moed::mpi
