// gtest main for the world test binaries (moed_world_gtest): the threads world, or with
// --world=mpi (under mpiexec) the MPI world, MPI_Init / MPI_Finalize around RUN_ALL_TESTS.
// Under MPI every process runs every test (run_world needs all of them); only rank 0 prints
// gtest's usual output, the other ranks print just their failures, prefixed with their rank.
#include <gtest/gtest.h>

#include <cstdio>
#include <string_view>

#include "support/world_test.h"
#ifdef MOED_WITH_MPI
#include <mpi.h>

#include "comm/mpi/process.h"
#endif

namespace {

#ifdef MOED_WITH_MPI
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[mpi rank %d] %s:%d: failure\n%s\n", rank_,
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[mpi rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(),
                   info.name());
    }
  }

 private:
  int rank_;
};

int run_on_mpi(int argc, char** argv) {
  // MULTIPLE, as moed's tools ask for: async steps then really run on their own thread.
  moed::mpi::init_thread(&argc, &argv, MPI_THREAD_MULTIPLE);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  const int result = RUN_ALL_TESTS();
  moed::mpi::finalize();
  return result;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  // --world=threads|mpi is ours: taken out before gtest reads the rest.
  bool mpi = false;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--world=mpi" || arg == "--world=threads") {
      mpi = arg == "--world=mpi";
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  argv[argc] = nullptr;
  if (!mpi) {
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
  }
  // Before InitGoogleTest: that is when the worlds' test instances are named and registered.
  moed::testing::use_backend(moed::testing::Backend::kMpi);
#ifdef MOED_WITH_MPI
  return run_on_mpi(argc, argv);
#else
  std::fprintf(stderr, "--world=mpi: this build has no MPI (-DMOED_WITH_MPI=OFF)\n");
  return 2;
#endif
}
