// Choosing a world for a command: threads in this process or the MPI job (world_choice.h).
#include "tools/moed/world_choice.h"

#include <cstdlib>
#include <memory>

#include "moed/threads_world.h"
#ifdef MOED_WITH_MPI
#include "moed/mpi_world.h"
#endif

namespace moed::cli {

bool launched_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
}

StatusOr<int> mpi_world_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    if (const char* v = std::getenv(name)) return std::atoi(v);
  }
  return failed_precondition(
      "--world mpi needs the program started by mpirun (mpirun -np 4 moed ...)");
}

Status run_in_world(const std::string& world, int ranks, const WorldOptions& options,
                    const std::function<Status(World&)>& body, int* my_rank) {
  *my_rank = 0;
  if (world == "threads") return run_threads(ranks, options, body);
  if (world == "mpi") {
    MOED_RETURN_IF_ERROR(mpi_world_size().status());
#ifdef MOED_WITH_MPI
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      MPI_Init(nullptr, nullptr);
      // NOTE: every World is dropped before exit, so finalising at exit is safe.
      std::atexit([] { MPI_Finalize(); });
    }
    MOED_ASSIGN_OR_RETURN(std::unique_ptr<World> w, make_mpi_world(MPI_COMM_WORLD, options));
    *my_rank = w->rank();
    if (w->size() != ranks) {
      return invalid_argument("mpirun started ", w->size(), " processes but ", ranks,
                              " ranks were asked for");
    }
    Status st = body(*w);
    // A failing rank tells the others (whose calls then return kAborted) instead of ending the job.
    if (!st.ok()) mpi_world_fail(*w, st);
    return st;
#else
    return unimplemented("--world mpi: this moed was built without MPI (-DMOED_WITH_MPI=OFF)");
#endif
  }
  return invalid_argument("world '", world, "' is not one of threads, mpi");
}

void fail_world(World& w, const Status& reason) {
#ifdef MOED_WITH_MPI
  mpi_world_fail(w, reason);  // a no-op for a world that is not an MPI world
#endif
}

}  // namespace moed::cli
