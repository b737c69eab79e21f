// run_world and backends() for the world test binaries: the threads world, or under
// `mpiexec ... <test> --world=mpi` the MPI world (world_main.cc chooses before gtest starts).
#include "support/world_test.h"

#include <exception>

#include "moed/threads_world.h"
#ifdef MOED_WITH_MPI
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "moed/mpi_world.h"
#endif

namespace moed::testing {

namespace {
Backend g_backend = Backend::kThreads;
}  // namespace

const char* backend_name(Backend b) { return b == Backend::kThreads ? "threads" : "mpi"; }

void use_backend(Backend b) { g_backend = b; }

std::vector<Backend> backends() { return {g_backend}; }

#ifdef MOED_WITH_MPI
namespace {

// Waits for `req` without spinning. In CI 8 MPI processes share 2 cores, and a blocking MPI
// call spins (sched_yield): the ranks that left a test early (or sit it out) would take the
// cores from the ranks still in it.
// Bounded: a harness wait longer than the longest test is a hang, reported and aborted.
void wait_gently(MPI_Request* req, const char* what) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::seconds(600);
  for (int i = 0;; ++i) {
    int done = 0;
    MPI_Test(req, &done, MPI_STATUS_IGNORE);
    if (done) return;
    if (Clock::now() > deadline) {
      std::fprintf(stderr, "run_world: %s did not complete within 600 s; aborting\n", what);
      MPI_Abort(MPI_COMM_WORLD, 3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(i < 200 ? 20 : 500));
  }
}

// The same rule as run_threads: the lowest rank's error that is not the kAborted echo of
// another rank's failure, else the lowest error; returned identically on every process.
Status combine(const Status& local, MPI_Comm comm) {
  int size = 0, me = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &me);
  int code = int(local.code());
  std::vector<int> codes(size_t(size), 0);
  MPI_Request req;
  MPI_Iallgather(&code, 1, MPI_INT, codes.data(), 1, MPI_INT, comm, &req);
  wait_gently(&req, "the all-gather of the ranks' verdicts");
  int pick = -1;
  for (int r = 0; r < size && pick < 0; ++r) {
    if (codes[size_t(r)] != 0 && codes[size_t(r)] != int(StatusCode::kAborted)) pick = r;
  }
  for (int r = 0; r < size && pick < 0; ++r) {
    if (codes[size_t(r)] != 0) pick = r;
  }
  if (pick < 0) return ok_status();
  std::string msg = me == pick ? local.message() : std::string();
  uint64_t len = msg.size();
  MPI_Ibcast(&len, 1, MPI_UINT64_T, pick, comm, &req);
  wait_gently(&req, "the broadcast of the verdict's length");
  msg.resize(len);
  MPI_Ibcast(msg.data(), int(len), MPI_CHAR, pick, comm, &req);
  wait_gently(&req, "the broadcast of the verdict");
  return Status(StatusCode(codes[size_t(pick)]), msg);
}

Status run_mpi_world(int ranks, int ranks_per_node, const std::function<Status(World&)>& body,
                     WorldOptions opts) {
  int size = 0, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (ranks < 1 || ranks > size) {
    return invalid_argument("run_world: ranks = ", ranks, " needs 1..", size,
                            " processes; mpiexec started ", size);
  }
  opts.ranks_per_node = ranks_per_node;
  // Every process is here before the (blocking) split, so it does not spin for long.
  MPI_Request req;
  MPI_Ibarrier(MPI_COMM_WORLD, &req);
  wait_gently(&req, "the barrier before a test");
  MPI_Comm sub = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, me < ranks ? 0 : MPI_UNDEFINED, me, &sub);
  Status local;
  if (sub != MPI_COMM_NULL) {
    {
      StatusOr<std::unique_ptr<World> > world = make_mpi_world(sub, opts);
      if (!world.ok()) {
        local = world.status();
      } else {
        try {
          local = body(**world);
        } catch (const std::exception& e) {
          local = internal_error("rank ", me, " threw: ", e.what());
        } catch (...) {
          local = internal_error("rank ", me, " threw an exception that is not a std::exception");
        }
        // Tell the other ranks, so their pending calls return kAborted instead of waiting
        // for the timeout.
        if (!local.ok()) (*world)->abort(local);
      }
    }
    MPI_Comm_free(&sub);
  }
  return combine(local, MPI_COMM_WORLD);
}

}  // namespace
#endif

Status run_world(Backend b, int ranks, int ranks_per_node,
                 const std::function<Status(World&)>& body, WorldOptions opts) {
  if (b != g_backend) {
    return unimplemented("run_world: this run of the test binary has the ", backend_name(g_backend),
                         " world, not ", backend_name(b), " (--world=mpi under mpiexec for MPI)");
  }
  if (b == Backend::kThreads) {
    opts.ranks_per_node = ranks_per_node;
    return run_threads(ranks, opts, body);
  }
#ifdef MOED_WITH_MPI
  return run_mpi_world(ranks, ranks_per_node, body, opts);
#else
  return unimplemented("run_world: this build has no MPI (-DMOED_WITH_MPI=OFF)");
#endif
}

}  // namespace moed::testing
