// `moed dispatch --world mpi` under mpiexec -np 3 against the threads world: every file it
// writes equals, byte for byte, the one a threads-world run of the same inputs writes; bad
// input fails every rank with the message and a non-zero exit, without a hang.
// MOED_MPIEXEC and MOED_MPIEXEC_NP_FLAG come from CMake's FindMPI.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "moed/npy.h"
#include "moed/tensor.h"
#include "tools/cli_support.h"

namespace moed {
namespace {

using namespace cli_test;  // NOLINT: run_cli, TempDir, save, ...

constexpr int kRanks = 3;

// `mpiexec -np 3 moed ARGS`, killed after two minutes so that a hang fails the test.
CliResult run_mpi(const std::string& args) {
  return run_command("timeout -k 10 120 " + std::string(MOED_MPIEXEC) + " --oversubscribe " +
                     MOED_MPIEXEC_NP_FLAG + " " + std::to_string(kRanks) + " " + MOED_CLI_PATH +
                     " " + args);
}

bool timed_out(const CliResult& r) { return r.rc == 124 || r.rc == 137; }

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::string contents(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::set<std::string> files_in(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.insert(e.path().filename().string());
  }
  return names;
}

struct Case {
  DType dtype;
  std::string flags;  // dispatcher and layout, the same for both worlds
  std::string world;  // how the MPI run picks its world and R
};

TEST(CliDispatchMpi, FilesEqualTheThreadsWorld) {
  TempDir dir("dispatch_mpi");
  const int E = 12, K = 3;
  const Case cases[] = {
      {DType::kF32, "--dispatcher allgather", "--world mpi --ranks 3"},
      {DType::kBF16,
       "--dispatcher alltoall --ranks-per-node 1 --etp 3 --capacity-factor 1.0 "
       "--drop-policy position --expert-alignment 4",
       "--world mpi"},
      // No --world: under mpirun the default is mpi.
      {DType::kBF16,
       "--dispatcher flex --ranks-per-node 1 --capacity-factor 0.75 "
       "--router-padding 2",
       ""},
      {DType::kF32, "--dispatcher flex --capacity-factor 1.5 --pad-to-capacity", "--world mpi"},
  };
  uint32_t seed = 5;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags + " / " + c.world);
    write_dispatch_inputs(dir, c.dtype, /*rows=*/kRanks * 7, /*H=*/24, K, E, seed);
    seed += 2;
    const std::string in = "dispatch --x " + dir / "x.npy" + " --topk-idx " + dir / "idx.npy" +
                           " --topk-probs " + dir / "probs.npy" + " --experts " +
                           std::to_string(E) + " " + c.flags;
    std::filesystem::remove_all(dir / "threads");
    std::filesystem::remove_all(dir / "mpi");
    const CliResult threads = run_cli(in + " --world threads --ranks 3 --out " + dir / "threads");
    ASSERT_EQ(threads.rc, 0) << threads.output;
    const CliResult mpi = run_mpi(in + " " + c.world + " --out " + dir / "mpi");
    ASSERT_EQ(mpi.rc, 0) << mpi.output;
    // Rank 0 alone prints the report.
    EXPECT_EQ(count(mpi.output, "3 ranks (mpi world"), 1) << mpi.output;

    std::set<std::string> want;
    for (int r = 0; r < kRanks; ++r) {
      want.insert("expert_input_rank" + std::to_string(r) + ".npy");
      want.insert("permuted_probs_rank" + std::to_string(r) + ".npy");
    }
    want.insert("tokens_per_expert.npy");
    want.insert("combined.npy");
    ASSERT_EQ(files_in(dir / "threads"), want);
    ASSERT_EQ(files_in(dir / "mpi"), want);
    for (const std::string& f : want) {
      const std::string a = contents(dir / "threads/" + f), b = contents(dir / "mpi/" + f);
      EXPECT_FALSE(a.empty()) << f;
      EXPECT_TRUE(a == b) << f << " differs: threads " << a.size() << " bytes, mpi " << b.size();
    }
  }
}

TEST(CliDispatchMpi, BadInputFailsEveryRank) {
  TempDir dir("dispatch_mpi_errors");
  write_dispatch_inputs(dir, DType::kF32, /*rows=*/kRanks * 2, /*H=*/4, /*K=*/2, /*E=*/6, 3);
  const std::vector<int32_t> bad_idx = {0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 6};
  save(dir / "bad_idx.npy", NpyDType::kI32, {6, 2}, bad_idx.data());
  // Only rank 1 fails here, on writing its file: the others must still fail, and name it.
  std::filesystem::create_directories(dir / "blocked/expert_input_rank1.npy");
  const std::string probs = " --topk-probs " + dir / "probs.npy";
  const std::string base = "dispatch --world mpi --x " + dir / "x.npy" + " --experts 6 " +
                           "--dispatcher flex --out " + dir / "o";
  const std::string blocked = "dispatch --world mpi --x " + dir / "x.npy" + " --experts 6 " +
                              "--dispatcher alltoall --out " + dir / "blocked";
  struct Bad {
    std::string args, message;
  };
  const Bad cases[] = {
      {base + " --topk-idx " + dir / "idx.npy" + probs + " --ranks 5",
       "moed dispatch: --ranks = 5 but mpirun started 3 processes"},
      {base + " --topk-idx " + dir / "bad_idx.npy" + probs,
       "moed dispatch: " + dir / "bad_idx.npy" + ": topk_idx[5][1] = 6 is outside [-1, 6)"},
      {base + " --topk-idx " + dir / "missing.npy" + probs, dir / "missing.npy"},
      {base + " --topk-idx " + dir / "idx.npy" + probs + " --ranks-per-node 2",
       "moed dispatch: --ranks-per-node = 2 does not divide --ranks = 3"},
      {blocked + " --topk-idx " + dir / "idx.npy" + probs,
       "moed dispatch: rank 1: " + dir / "blocked/expert_input_rank1.npy"},
  };
  for (const Bad& c : cases) {
    SCOPED_TRACE(c.args);
    const CliResult r = run_mpi(c.args);
    EXPECT_FALSE(timed_out(r)) << r.output;
    EXPECT_NE(r.rc, 0) << r.output;
    EXPECT_EQ(count(r.output, c.message), kRanks) << r.output;
  }
}

// moed run --fail-rank under mpiexec: the lost process stops calling, the others mask it after
// the shrink timeout and go on, each checking its own output against the masked reference.
TEST(CliRunMpi, ALostRankIsMaskedAndTheOthersGoOn) {
  const CliResult r = run_mpi(
      "run --world mpi --dispatcher low-latency --fail-rank 2 --at-step 1 --steps 3 --experts 6 "
      "--shrink-timeout 0.5");
  ASSERT_FALSE(timed_out(r)) << r.output;
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("verify: every live rank's output of every step is bitwise equal"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace moed
