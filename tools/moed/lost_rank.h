// moed run --fail-rank R --at-step S (lost_rank.cc): the decode loop that goes on without a
// lost rank.
#pragma once

#include <cstdint>
#include <string>

namespace moed::cli {

struct LostRankArgs {
  std::string world;  // "threads" or "mpi"
  int ranks = 4;
  int ranks_per_node = 0;
  int experts = 8, topk = 2, hidden = 512;
  int64_t tokens = 32;  // per rank and step
  int steps = 8;
  int fail_rank = 1, at_step = 4;
  std::string fail_how = "silent";  // silent (a killed or stopped process) | raise
  double shrink_timeout_s = 1.0;
  uint64_t seed = 1;
};

// Runs it and prints one line per step; throws CLI::RuntimeError(2) when an output differs.
void run_lost_rank(const LostRankArgs& a);

}  // namespace moed::cli
