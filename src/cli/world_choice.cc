// Choosing a world for a command: threads in this process or the MPI job (world_choice.h).
#include "cli/world_choice.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "cli/registry.h"
#include "moed/threads_world.h"
#ifdef MOED_WITH_MPI
#include "comm/mpi/process.h"
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

namespace {

double g_timeout_seconds = 0;  // 0 = WorldOptions' default

// --timeout for every command that communicates (they all run through run_in_world).
void setup_world_timeout(CLI::App& app) {
  app.add_option("--timeout", g_timeout_seconds,
                 "seconds a rank waits for a peer before every rank fails with an error naming "
                 "it (any command that communicates; default 300)")
      ->check(CLI::PositiveNumber);
}
MOED_CLI_COMMAND("", setup_world_timeout);

}  // namespace

Status run_in_world(const std::string& world, int ranks, const WorldOptions& world_options,
                    const std::function<Status(World&)>& body, int* my_rank) {
  *my_rank = 0;
  WorldOptions options = world_options;
  if (g_timeout_seconds > 0) {
    options.timeout = std::chrono::milliseconds(int64_t(g_timeout_seconds * 1000.0 + 0.5));
  }
  if (world == "threads") return run_threads(ranks, options, body);
  if (world == "mpi") {
    MOED_RETURN_IF_ERROR(mpi_world_size().status());
#ifdef MOED_WITH_MPI
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      // MPI_THREAD_MULTIPLE lets an async dispatch run on its own thread (World::
      // calls_from_any_thread); with less, moed runs async steps eagerly.
      mpi::init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE);
      // NOTE: every World is dropped before exit, so finalising at exit is safe, unless a
      // world failed: then a peer may never reach MPI_Finalize, so exit without it.
      std::atexit([] {
        if (mpi_peer_may_be_gone()) {
          std::fflush(nullptr);
          std::_Exit(1);
        }
        mpi::finalize();
      });
    }
    MOED_ASSIGN_OR_RETURN(std::unique_ptr<World> w, make_mpi_world(MPI_COMM_WORLD, options));
    *my_rank = w->rank();
    if (w->size() != ranks) {
      return invalid_argument("mpirun started ", w->size(), " processes but ", ranks,
                              " ranks were asked for");
    }
    Status st = body(*w);
    // A failing rank tells the others (whose calls then return kAborted) instead of ending the job.
    if (!st.ok()) w->abort(st);
    return st;
#else
    return unimplemented("--world mpi: this moed was built without MPI (-DMOED_WITH_MPI=OFF)");
#endif
  }
  return invalid_argument("world '", world, "' is not one of threads, mpi");
}

}  // namespace moed::cli
