// Shared by every `moed bench` command: the standard shapes (spec §7), the memory-copy bound
// measured in the same run, timing, and the record format (one JSON object per figure, also
// printed as a table row).
//
// Every record carries at least: suite, shape, dtype, threads, bytes, seconds, gbps,
// copy_gbps, ratio_to_copy, verified. Commands add their own fields (world, ranks,
// dispatcher, phase, network_bytes, ...).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "moed/status.h"
#include "moed/thread_pool.h"
#include "moed/world.h"

namespace moed::bench {

// Per-rank problem size (spec §7).
struct Shape {
  std::string name;
  int64_t num_tokens;  // T per rank
  int hidden;          // H
  int num_experts;     // E
  int num_topk;        // K
};
// tiny, mixtral, dsv3, decode. An unknown name is an error listing the known ones.
StatusOr<Shape> find_shape(std::string_view name);
std::vector<std::string> shape_names();
// E adjusted so that `ranks` divides it (spec §7: the nearest E that R divides; ties go up).
int experts_for_ranks(int num_experts, int ranks);

// GB/s of a plain parallel memcpy of `bytes` with `threads` threads, median of `iters` runs
// after a warm-up. This is the bound a one-copy algorithm can reach on this machine now.
double measure_copy_gbps(size_t bytes, int threads, int iters = 10);

// Median wall time (seconds) of fn over `iters` runs after `warmup` runs.
double median_seconds(const std::function<void()>& fn, int iters, int warmup = 1);
double median(std::vector<double> v);

// Peak resident memory of this process so far, bytes (VmHWM).
uint64_t peak_rss_bytes();

// Collects records; prints each as a table row as it arrives (unless json) and, with json,
// the whole list as a JSON array at the end.
class Report {
 public:
  explicit Report(bool json) : json_(json) {}
  // Fills gbps and ratio_to_copy from bytes, seconds and copy_gbps when absent.
  void add(nlohmann::json record);
  void finish() const;  // prints the JSON array when json
  const std::vector<nlohmann::json>& records() const { return records_; }

 private:
  bool json_;
  std::vector<nlohmann::json> records_;
};

// ---- choosing a world (shared by `moed run` and `moed bench`) ----
// True when this process was started by mpirun / mpiexec (OpenMPI or a PMI launcher).
bool launched_by_mpirun();
// The number of processes mpirun started (an error when not under mpirun).
StatusOr<int> mpi_world_size();
// Runs body on `ranks` ranks of the world named "threads" or "mpi" (under mpirun `ranks` is
// the job's size) and returns the root-cause error, the same on every rank. *my_rank is 0 for
// the threads world (the process speaks for all ranks) and the process's rank under MPI.
Status run_in_world(const std::string& world, int ranks, const WorldOptions& options,
                    const std::function<Status(World&)>& body, int* my_rank);

}  // namespace moed::bench
