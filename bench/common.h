// Shared by every `moed bench` command: the standard shapes (docs/benchmarks.md), seeded random
// inputs, timing (over the ranks of a world too), and the record format (one JSON object per
// figure, also printed as a table row).
//
// Every record carries at least: suite, shape, dtype, threads, bytes, seconds, gbps, the limit's
// fields (bench/limit.h: limit_seconds, fraction_of_limit, the STREAM figures it used, noisy,
// cache_resident), verified, isa (the row kernels' instruction set). Commands add their own
// fields (world, ranks, dispatcher, phase, network_bytes, ...).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "bench/limit.h"
#include "cli/world_choice.h"
#include "moed/routing.h"
#include "moed/status.h"
#include "moed/tensor.h"
#include "moed/thread_pool.h"
#include "moed/world.h"

namespace CLI {
class App;
}

namespace moed::bench {

// Per-rank problem size (docs/design.md §7.4).
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
// E adjusted so that `ranks` divides it: the nearest E that R divides, ties go up
// (docs/design.md §7.4).
int experts_for_ranks(int num_experts, int ranks);

// ---- the kernel's time, paired with the machine's bandwidth (bench/limit.h) ----
// `iters` pairs (the stream's next operation, then time_max of fn) after `warmup` of each.
StatusOr<Paired> paired_time_max(World& w, int iters, Stream& stream,
                                 const std::function<Status()>& fn, int warmup = 1);
// One process, one pool: `iters` pairs (the stream's next operation, then fn) after `warmup`.
StatusOr<Paired> paired_seconds(const std::function<void()>& fn, Stream& stream, int iters,
                                int warmup = 1);

// ---- "A no slower than B, in the same run": a paired comparison ----
// A and B timed in every iteration of one loop, so each ratio a_i / b_i is taken under one
// load, which separate medians of a shared, noisy machine are not. Appends {name, median, lo,
// hi, limit, pairs, verdict} to record["comparisons"]: the median ratio, its 95% interval
// (bootstrap, 2000 resamples, fixed seed: the same samples give the same interval) and the
// verdict against "at most limit": met (the whole interval within it), missed (all of it
// beyond), undecided (more --iters, or a quieter machine, would tell); "too few pairs" under
// 10. The table prints it under the record's row.
void add_comparison(nlohmann::json& record, const std::string& name, std::span<const double> a,
                    std::span<const double> b, double limit);

// Median wall time (seconds) of fn over `iters` runs after `warmup` runs.
double median_seconds(const std::function<void()>& fn, int iters, int warmup = 1);
double median(std::vector<double> v);

// Peak resident memory of this process so far, bytes (VmHWM).
uint64_t peak_rss_bytes();
// Resident memory of this process now, bytes (VmRSS).
uint64_t current_rss_bytes();

// Every hardware thread of this host (at least 1).
int host_threads();

// Prints "moed bench <command>: <status>" ("moed bench: ..." for the sweep, command "") and
// ends the command with exit code 1, as cli/registry.h asks of a failing command.
[[noreturn]] void fail(std::string_view command, const Status& s);

// Options with the same meaning and help in every command that takes them: --world, --ranks
// and --ranks-per-node (the multi-rank commands), --iters and --json (the figures' report).
// A command's Args derives from the structs they fill, constructed with its own defaults.
struct WorldArgs {
  explicit WorldArgs(int default_ranks = 2) : ranks(default_ranks) {}
  std::string world = "threads";
  int ranks;
  int ranks_per_node = 0;
};
struct ReportArgs {
  explicit ReportArgs(int default_iters = 10) : iters(default_iters) {}
  int iters;
  bool json = false;
  std::string json_out;  // also write the records, as a JSON array, to this file
};
void add_world_options(CLI::App& c, WorldArgs& a);
void add_report_options(CLI::App& c, ReportArgs& a);

// ---- random inputs ----
// Each draws from the caller's rng in a fixed order, so that a command's seeds keep giving it
// the same inputs (and any process can rebuild any rank's input from its seed).
//
// rows x hidden bf16 values uniform in [-bound, bound), row by row.
Tensor random_tokens(int64_t rows, int hidden, float bound, std::mt19937& rng);
// For each of num_tokens tokens, num_topk distinct experts of num_experts, uniform (a partial
// Fisher-Yates shuffle); pick(token, k, expert) is called after each draw, so it may draw
// from rng too.
void random_experts(int64_t num_tokens, int num_experts, int num_topk, std::mt19937& rng,
                    const std::function<void(int64_t token, int k, int expert)>& pick);
// The shape's top-k routing from random_experts, each pick's weight uniform in
// [min_weight, 1) drawn right after it.
TopkRouting random_topk(const Shape& s, float min_weight, std::mt19937& rng);

// ---- figures over the ranks of a world ----
// Every rank runs fn after a barrier; the slowest rank's seconds (the time of a collective
// operation is when its last rank is done).
StatusOr<double> time_max(World& w, const std::function<Status()>& fn);
// Every rank runs fn after a barrier; seconds from the first rank's start to the last rank's
// end. Clocks are compared only between ranks on one host (one running kernel); over several
// hosts, the longest of their spans.
StatusOr<double> time_span(World& w, const std::function<Status()>& fn);
// How many ranks share this rank's host (the most on any host, the same on every rank).
StatusOr<int> ranks_per_host(World& w);
// The median over `iters` runs of time_max, after `warmup` untimed runs.
StatusOr<double> median_time_max(World& w, int iters, const std::function<Status()>& fn,
                                 int warmup = 1);
// Sum over ranks of a per-rank count (a figure's rows and bytes are aggregate,
// docs/design.md §7.3).
StatusOr<int64_t> sum_ranks(World& w, int64_t v);
// Element-wise sums over ranks of several counts, in one collective.
StatusOr<std::vector<int64_t>> sum_ranks(World& w, std::span<const int64_t> v);
// True when `ok` holds on every rank: each rank checks its own outputs, the verdict is the
// job's (so the MPI world, one rank per process, checks as much as the threads world).
StatusOr<bool> all_ranks_ok(World& w, bool ok);
// A figure's network_bytes and shared_bytes: one call's, summed over ranks like its bytes.
struct Traffic {
  uint64_t network_bytes = 0;
  uint64_t shared_bytes = 0;
  double collectives = 0;  // TrafficCounters::collectives of one call, mean over ranks
};
// Runs fn once, untimed, and returns the traffic the world's counters saw it move. Under
// callgrind the call is the one counted, named `name` (callgrind_call).
StatusOr<Traffic> traffic_of(World& w, const std::function<Status()>& fn,
                             const std::string& name = "");

// ---- records ----
// What ran, in every record of a command over a shape: suite, shape, num_tokens, hidden,
// num_experts, num_topk, threads and iters, added to `fields` (the command's own).
nlohmann::json shape_record(std::string_view suite, const Shape& s, int threads, int iters,
                            nlohmann::json fields);
// shape_record plus the world: world, ranks and ranks_per_node (0 = all ranks on one node).
nlohmann::json world_record(std::string_view suite, const Shape& s, const std::string& world,
                            int ranks, int ranks_per_node, int threads, int iters,
                            nlohmann::json fields);
// A dispatcher phase's own fields over `rows` bf16 rows of `hidden` values: dispatcher, phase,
// dtype, rows, bytes, the traffic of one call (network_bytes, shared_bytes, collectives) and
// verified (checked against the reference).
nlohmann::json bf16_phase_fields(const std::string& dispatcher, const std::string& phase,
                                 int64_t rows, int64_t hidden, const Traffic& traffic,
                                 bool verified);
// A bare MPI_Alltoallv of the record's bytes, timed the same way in the same run, beside its
// figure: mpi_seconds, mpi_gbps and ratio_to_mpi (= gbps / mpi_gbps). Nothing when
// mpi_seconds is 0 (not the MPI world).
void add_mpi_baseline(nlohmann::json& record, double mpi_seconds);

// Collects records; prints each as a table row as it arrives (unless json) and, with json,
// the whole list as a JSON array at the end; with json_out, writes that array to the file
// too. NOTE: a launcher (mpirun) mixes its own lines into the program's stdout and stderr;
// json_out is the program's own output alone, for a script to read.
class Report {
 public:
  explicit Report(const ReportArgs& a) : json_(a.json), json_out_(a.json_out) {}
  // Fills gbps from bytes and seconds when absent.
  void add(nlohmann::json record);
  // Prints the JSON array when json, writes it to json_out; an error if that fails.
  Status finish() const;
  const std::vector<nlohmann::json>& records() const { return records_; }

 private:
  bool json_;
  std::string json_out_;
  std::vector<nlohmann::json> records_;
};

// ---- choosing a world (cli/world_choice.h, shared with `moed run`) ----
using cli::launched_by_mpirun;
using cli::mpi_world_size;
// cli::run_in_world, and where a host has more ranks than cores, a line that says so (on
// stdout, or stderr under --json so the JSON stays whole) before the figures.
Status run_in_world(const std::string& world, int ranks, const WorldOptions& options, bool json,
                    const std::function<Status(World&)>& body, int* my_rank);
// What a multi-rank command runs on: its ranks (under --world mpi the job's size, which mpirun
// decides, else `ranks`) and the named shape with E adjusted so that they divide it.
struct WorldShape {
  int ranks = 0;
  Shape shape;
};
StatusOr<WorldShape> world_shape(std::string_view shape, const std::string& world, int ranks);

}  // namespace moed::bench
