// The physical limit of a kernel, measured in the same run (docs/benchmarks.md, "The limit"):
// a traffic model (the bytes a kernel must at least read and write in memory, counted from the
// routing) over the machine's STREAM-style read, write and copy bandwidth, which are measured
// beside the kernel, one of the three before each of its iterations.
//
//   limit_seconds     = 2 min(R, W) / copy + (R - min(R, W)) / read + (W - min(R, W)) / write
//   fraction_of_limit = limit_seconds / seconds
//
// R and W are the model's read and write bytes (each network byte counted once read, when it
// is sent, and once written, when it is received). Bytes that pair a read with a write move at
// STREAM copy's rate (its bytes read plus written per second), the rest at the rate of STREAM
// read or write alone: each STREAM kernel is at exactly 1 of its own limit.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moed/routing.h"
#include "moed/status.h"
#include "moed/thread_pool.h"
#include "moed/world.h"

namespace moed::bench {

// The last-level cache of this host, bytes (sysfs, else sysconf, else 32 MiB).
uint64_t last_level_cache_bytes();

// ---- the machine: STREAM-style bandwidths over all ranks' threads ----
enum class StreamOp { kRead, kWrite, kCopy };
const char* stream_op_name(StreamOp op);

// Bandwidths, GB/s, aggregate over the ranks of a world: read = bytes read / s, write = bytes
// written / s, copy = bytes read + bytes written / s (STREAM's count).
struct StreamRates {
  double read_gbps = 0, write_gbps = 0, copy_gbps = 0;
  bool nt_write = false, nt_copy = false;  // non-temporal stores won the calibration
  uint64_t array_bytes = 0;                // each array, over all ranks
  double gbps(StreamOp op) const;
  double& gbps(StreamOp op);
};

// One STREAM measurement taken beside a kernel iteration.
struct StreamSample {
  StreamOp op = StreamOp::kRead;
  double gbps = 0;
};

// One rank's share (1/R) of the STREAM arrays, each past the last-level cache (4x it, at least
// 64 MiB over all ranks, as STREAM's rule asks), and the run's measurements. Every call is
// collective: every rank streams its share with its own pool after a barrier, timed from the
// first rank's start to the last rank's end (time_span), as bench/common.h's kernels are.
class Stream {
 public:
  explicit Stream(World& w);
  // One process without a world (the single-rank suites): the pool's threads, no barrier.
  explicit Stream(ThreadPool& pool);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  // Times read, write and copy, the writes and copies with plain and with non-temporal
  // stores (twice each), and keeps the faster kind of store from then on.
  Status calibrate();
  // The next operation of the rotation read, write, copy, ...: one per kernel iteration.
  StatusOr<StreamSample> next();
  // The calibration's figures (the best of two passes of each).
  const StreamRates& calibration() const { return calibration_; }
  size_t allocated_bytes() const { return 2 * share_; }  // this rank's src + dst

 private:
  void allocate(size_t ranks);
  StatusOr<double> run(StreamOp op, bool nt);
  World* w_ = nullptr;
  ThreadPool& pool_;
  size_t share_ = 0;
  uint64_t total_ = 0;
  char* src_ = nullptr;
  char* dst_ = nullptr;
  StreamRates calibration_;
  bool calibrated_ = false;
  int next_op_ = 0;
};

// ---- the model: what a kernel must at least read and write ----
// Bytes summed over ranks. read and write exclude the network's bytes; limit_seconds adds them
// to both.
struct TrafficModel {
  double read_bytes = 0, write_bytes = 0, network_bytes = 0;
  double total() const { return read_bytes + write_bytes + 2 * network_bytes; }
};
double limit_seconds(const TrafficModel& m, const StreamRates& r);

// What a dispatch (rank src's routing topk[src], E experts over `ranks` ranks, nodes of
// `ranks_per_node`) must move: each routed token's row read once (in_row_bytes) and its
// top-k (8 bytes per pick), each received row written once (out_row_bytes, plus its source
// index and prob: 8 bytes); across nodes, one row per (token, remote node) with its top-k
// (out_row_bytes + 8 K) over the network.
TrafficModel dispatch_model(const std::vector<TopkRouting>& topk, int num_experts, int ranks,
                            int ranks_per_node, double in_row_bytes, double out_row_bytes);
// What a combine must move: each received row read once (row_bytes, plus its source index,
// plus its weight when weighted), each routed token's row written once; across nodes, per
// token the cheaper of one bf16 row per remote expert and the chain the fixed order allows
// (the fp32 partial, 2 row_bytes, from each node of the token's experts to the next in
// ascending order, and the rounded row home from the last when that is not home).
TrafficModel combine_model(const std::vector<TopkRouting>& topk, int num_experts, int ranks,
                           int ranks_per_node, double row_bytes, bool weighted);

// ---- a figure: kernel times paired with STREAM samples ----
struct Paired {
  std::vector<double> kernel;
  std::vector<StreamSample> stream;   // stream[i] measured just before kernel[i]
  std::vector<StreamSample> closing;  // one of each operation after the last iteration
  StreamRates calibration;            // the run's calibration, counted with the samples
  void add(double kernel_seconds, const StreamSample& s) {
    kernel.push_back(kernel_seconds);
    stream.push_back(s);
  }
};
// One sample of each STREAM operation after the figures' last iterations (Paired::closing).
// NOTE: the machine's bandwidth moves between seconds on a shared VM; a kernel whose
// iterations fell in a fast moment that none of the samples before them saw read above 1.
Status close_figures(Stream& stream, std::initializer_list<Paired*> figures);
// The figure's bandwidths: of each operation, the best of its samples (closing ones too) and
// the calibration's.
// NOTE: the best, not the median: the limit is what the machine showed it can do in this run;
// a median of a few samples taken while another job held the cores would put the limit above
// what the kernel, timed in a quieter moment, did.
StreamRates rates_of(const Paired& p);
// Spread of the per-iteration fractions wider than this (of the median) makes a record noisy.
constexpr double kNoisySpread = 0.2;
// Fills seconds and the limit's fields of `record` from the pairs and the model:
// model_read_bytes, model_write_bytes, model_network_bytes, stream_{read,write,copy}_gbps,
// stream_nt_write, stream_nt_copy, stream_array_bytes, limit_seconds, fraction_of_limit,
// fraction_min and fraction_max (each iteration's limit from its own sample, the other two
// rates the figure's, over its kernel time), noisy, and cache_resident (the model's bytes fit in
// the last-level cache: a fraction above 1 is then cache reuse, not a faster machine).
void add_limit(nlohmann::json& record, const Paired& p, const TrafficModel& m);

// ---- instructions per byte: callgrind ----
// Brackets one call of a kernel for scripts/callgrind_bench.py: outside valgrind nothing;
// under callgrind, the counters are zeroed when every rank has arrived and dumped, named
// `name`, when every rank is done. Collective.
Status callgrind_call(World& w, const std::string& name, const std::function<Status()>& fn);

}  // namespace moed::bench
