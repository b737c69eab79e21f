#include "comm/mpi/process.h"

#include <mpi.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

namespace moed::mpi {
namespace {

// While alive, this thread's allocations are not leaks (LeakSanitizer only).
struct NotLeaks {
#if defined(__SANITIZE_ADDRESS__)
  __lsan::ScopedDisabler disabler;
#endif
};

}  // namespace

int init_thread(int* argc, char*** argv, int required) {
  NotLeaks not_leaks;
  int provided = 0;
  MPI_Init_thread(argc, argv, required, &provided);
  return provided;
}

void finalize() {
#if defined(__SANITIZE_ADDRESS__)
  __lsan_do_leak_check();  // the process's one leak check: none runs at exit after this
#endif
  NotLeaks not_leaks;
  MPI_Finalize();
}

}  // namespace moed::mpi
