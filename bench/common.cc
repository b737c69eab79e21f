#include "bench/common.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <new>
#include <random>
#include <thread>

#include <fmt/format.h>

#include "cli/registry.h"
#include "cli/world_choice.h"
#include "moed/dtype.h"
#include "moed/threads_world.h"

namespace moed::bench {

StatusOr<Shape> find_shape(std::string_view name) {
  static const std::vector<Shape> shapes = {
      {"tiny", 64, 256, 8, 2},
      {"mixtral", 2048, 4096, 8, 2},
      {"dsv3", 4096, 7168, 256, 8},
      {"decode", 128, 7168, 256, 8},
  };
  for (const auto& s : shapes) {
    if (s.name == name) return s;
  }
  return invalid_argument("shape '", name, "' is not one of tiny, mixtral, dsv3, decode");
}

std::vector<std::string> shape_names() { return {"tiny", "mixtral", "dsv3", "decode"}; }

int experts_for_ranks(int num_experts, int ranks) {
  if (ranks <= 0 || num_experts % ranks == 0) return num_experts;
  const int down = num_experts / ranks * ranks;
  const int up = down + ranks;
  if (down > 0 && num_experts - down < up - num_experts) return down;
  return up;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double median_seconds(const std::function<void()>& fn, int iters, int warmup) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < std::max(1, iters); ++i) {
    auto a = std::chrono::steady_clock::now();
    fn();
    auto b = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double>(b - a).count());
  }
  return median(t);
}

void add_comparison(nlohmann::json& record, const std::string& name, std::span<const double> a,
                    std::span<const double> b, double limit) {
  std::vector<double> r;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (b[i] > 0) r.push_back(a[i] / b[i]);
  }
  if (r.empty()) return;
  constexpr int kResamples = 2000;
  std::mt19937 rng(1234);
  std::uniform_int_distribution<size_t> pick(0, r.size() - 1);
  std::vector<double> medians(kResamples), sample(r.size());
  for (double& m : medians) {
    for (double& x : sample) x = r[pick(rng)];
    m = median(sample);
  }
  std::sort(medians.begin(), medians.end());
  const double lo = medians[size_t(kResamples * 0.025)];
  const double hi = medians[size_t(kResamples * 0.975) - 1];
  // Fewer pairs than this make too rough an interval to decide on.
  constexpr size_t kMinPairs = 10;
  const char* verdict = r.size() < kMinPairs ? "too few pairs"
                        : hi <= limit        ? "met"
                        : lo > limit         ? "missed"
                                             : "undecided";
  record["comparisons"].push_back({{"name", name},
                                   {"median", median(r)},
                                   {"lo", lo},
                                   {"hi", hi},
                                   {"limit", limit},
                                   {"pairs", r.size()},
                                   {"verdict", verdict}});
}

namespace {
double seconds_of(const std::function<void()>& fn) {
  const auto a = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
}
}  // namespace

StatusOr<Paired> paired_seconds(const std::function<void()>& fn, Stream& stream, int iters,
                                int warmup) {
  MOED_RETURN_IF_ERROR(stream.calibrate());
  Paired p;
  p.calibration = stream.calibration();
  for (int i = -warmup; i < std::max(1, iters); ++i) {
    MOED_ASSIGN_OR_RETURN(const StreamSample s, stream.next());
    const double k = seconds_of(fn);
    if (i >= 0) p.add(k, s);
  }
  MOED_RETURN_IF_ERROR(close_figures(stream, {&p}));
  return p;
}

StatusOr<Paired> paired_time_max(World& w, int iters, Stream& stream,
                                 const std::function<Status()>& fn, int warmup) {
  MOED_RETURN_IF_ERROR(stream.calibrate());
  Paired p;
  p.calibration = stream.calibration();
  for (int i = -warmup; i < iters; ++i) {
    MOED_ASSIGN_OR_RETURN(const StreamSample s, stream.next());
    MOED_ASSIGN_OR_RETURN(const double k, time_max(w, fn));
    if (i >= 0) p.add(k, s);
  }
  MOED_RETURN_IF_ERROR(close_figures(stream, {&p}));
  return p;
}

namespace {
uint64_t status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(key);
  while (std::getline(f, line)) {
    if (line.compare(0, n, key) == 0) return uint64_t(std::stoull(line.substr(n))) * 1024;
  }
  return 0;
}
}  // namespace

uint64_t peak_rss_bytes() { return status_kb("VmHWM:"); }
uint64_t current_rss_bytes() { return status_kb("VmRSS:"); }

int host_threads() { return int(std::max(1u, std::thread::hardware_concurrency())); }

void fail(std::string_view command, const Status& s) {
  cli::fail_command(command.empty() ? std::string("moed bench") : str_cat("moed bench ", command),
                    s.to_string());
}

void add_world_options(CLI::App& c, WorldArgs& a) {
  c.add_option("--world", a.world, "threads | mpi")->capture_default_str();
  c.add_option("--ranks", a.ranks, "ranks in the world")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  c.add_option("--ranks-per-node", a.ranks_per_node, "ranks per node G (0 = all on one)")
      ->capture_default_str();
}

void add_report_options(CLI::App& c, ReportArgs& a) {
  c.add_option("--iters", a.iters, "timed iterations (median reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  c.add_flag("--json", a.json, "print the records as a JSON array");
  c.add_option("--json-out", a.json_out,
               "also write the records as a JSON array to this file (the program's own output, "
               "apart from a launcher's lines)");
}

Tensor random_tokens(int64_t rows, int hidden, float bound, std::mt19937& rng) {
  Tensor x = Tensor::empty(DType::kBF16, rows, hidden);
  std::uniform_real_distribution<float> u(-bound, bound);
  for (int64_t r = 0; r < rows; ++r) {
    for (int h = 0; h < hidden; ++h) x.row<bf16>(r)[h] = float_to_bf16(u(rng));
  }
  return x;
}

void random_experts(int64_t num_tokens, int num_experts, int num_topk, std::mt19937& rng,
                    const std::function<void(int64_t token, int k, int expert)>& pick) {
  std::vector<int> experts(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int e = 0; e < num_experts; ++e) experts[size_t(e)] = e;
    for (int k = 0; k < num_topk; ++k) {
      std::swap(experts[size_t(k)], experts[size_t(k) + rng() % size_t(num_experts - k)]);
      pick(t, k, experts[size_t(k)]);
    }
  }
}

TopkRouting random_topk(const Shape& s, float min_weight, std::mt19937& rng) {
  TopkRouting r;
  r.num_tokens = s.num_tokens;
  r.num_topk = s.num_topk;
  std::uniform_real_distribution<float> weight(min_weight, 1.0f);
  random_experts(s.num_tokens, s.num_experts, s.num_topk, rng, [&](int64_t, int, int expert) {
    r.topk_idx.push_back(expert);
    r.topk_weights.push_back(weight(rng));
  });
  return r;
}

StatusOr<double> time_max(World& w, const std::function<Status()>& fn) {
  MOED_RETURN_IF_ERROR(w.barrier());
  const auto a = std::chrono::steady_clock::now();
  MOED_RETURN_IF_ERROR(fn());
  const double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
  MOED_ASSIGN_OR_RETURN(std::vector<double> all,
                        all_gather<double>(w, std::span<const double>(&mine, 1)));
  return *std::max_element(all.begin(), all.end());
}

namespace {

// The clock domain of this process: steady_clock readings compare between processes of one
// running kernel, named by its boot id (the host name where there is none).
int64_t clock_domain() {
  static const int64_t key = [] {
    std::string id;
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    if (!(f >> id)) {
      char host[256] = {};
      gethostname(host, sizeof(host) - 1);
      id = host;
    }
    return int64_t(std::hash<std::string>{}(id));
  }();
  return key;
}

int64_t steady_ns() {
  return int64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                     std::chrono::steady_clock::now().time_since_epoch())
                     .count());
}

}  // namespace

StatusOr<double> time_span(World& w, const std::function<Status()>& fn) {
  MOED_RETURN_IF_ERROR(w.barrier());
  const int64_t start = steady_ns();
  MOED_RETURN_IF_ERROR(fn());
  const int64_t mine[3] = {clock_domain(), start, steady_ns()};
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> all, all_gather<int64_t>(w, mine));
  std::map<int64_t, std::pair<int64_t, int64_t>> spans;  // domain -> first start, last end
  for (size_t i = 0; i + 2 < all.size(); i += 3) {
    auto [it, fresh] = spans.try_emplace(all[i], all[i + 1], all[i + 2]);
    it->second.first = std::min(it->second.first, all[i + 1]);
    it->second.second = std::max(it->second.second, all[i + 2]);
  }
  int64_t longest = 0;
  for (const auto& [domain, span] : spans) longest = std::max(longest, span.second - span.first);
  return double(longest) * 1e-9;
}

StatusOr<int> ranks_per_host(World& w) {
  const int64_t mine = clock_domain();
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> all,
                        all_gather<int64_t>(w, std::span<const int64_t>(&mine, 1)));
  std::map<int64_t, int> count;
  int most = 0;
  for (int64_t d : all) most = std::max(most, ++count[d]);
  return most;
}

StatusOr<double> median_time_max(World& w, int iters, const std::function<Status()>& fn,
                                 int warmup) {
  std::vector<double> times;
  for (int i = -warmup; i < iters; ++i) {
    MOED_ASSIGN_OR_RETURN(const double t, time_max(w, fn));
    if (i >= 0) times.push_back(t);
  }
  return median(std::move(times));
}

StatusOr<int64_t> sum_ranks(World& w, int64_t v) {
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> sums, sum_ranks(w, std::span<const int64_t>(&v, 1)));
  return sums[0];
}

StatusOr<std::vector<int64_t>> sum_ranks(World& w, std::span<const int64_t> v) {
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> all, all_gather<int64_t>(w, v));
  std::vector<int64_t> sums(v.size(), 0);
  for (size_t i = 0; i < all.size(); ++i) sums[i % v.size()] += all[i];
  return sums;
}

StatusOr<bool> all_ranks_ok(World& w, bool ok) {
  MOED_ASSIGN_OR_RETURN(const int64_t bad, sum_ranks(w, ok ? 0 : 1));
  return bad == 0;
}

StatusOr<Traffic> traffic_of(World& w, const std::function<Status()>& fn,
                             const std::string& name) {
  const TrafficCounters before = w.counters();
  MOED_RETURN_IF_ERROR(callgrind_call(w, name.empty() ? std::string("call") : name, fn));
  const TrafficCounters& after = w.counters();
  const int64_t mine[3] = {int64_t(after.network_bytes - before.network_bytes),
                           int64_t(after.shared_bytes - before.shared_bytes),
                           int64_t(after.collectives - before.collectives)};
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> sums, sum_ranks(w, mine));
  return Traffic{uint64_t(sums[0]), uint64_t(sums[1]), double(sums[2]) / double(w.size())};
}

nlohmann::json shape_record(std::string_view suite, const Shape& s, int threads, int iters,
                            nlohmann::json fields) {
  fields["suite"] = std::string(suite);
  fields["shape"] = s.name;
  fields["num_tokens"] = s.num_tokens;
  fields["hidden"] = s.hidden;
  fields["num_experts"] = s.num_experts;
  fields["num_topk"] = s.num_topk;
  fields["threads"] = threads;
  fields["iters"] = iters;
  return fields;
}

nlohmann::json world_record(std::string_view suite, const Shape& s, const std::string& world,
                            int ranks, int ranks_per_node, int threads, int iters,
                            nlohmann::json fields) {
  fields["world"] = world;
  fields["ranks"] = ranks;
  fields["ranks_per_node"] = ranks_per_node == 0 ? ranks : ranks_per_node;
  return shape_record(suite, s, threads, iters, std::move(fields));
}

nlohmann::json bf16_phase_fields(const std::string& dispatcher, const std::string& phase,
                                 int64_t rows, int64_t hidden, const Traffic& traffic,
                                 bool verified) {
  return {{"dispatcher", dispatcher},
          {"phase", phase},
          {"dtype", "bf16"},
          {"rows", rows},
          {"bytes", size_t(rows) * size_t(hidden) * 2},
          {"network_bytes", traffic.network_bytes},
          {"shared_bytes", traffic.shared_bytes},
          {"collectives", traffic.collectives},
          {"verified", verified}};
}

void add_mpi_baseline(nlohmann::json& record, double mpi_seconds) {
  if (mpi_seconds <= 0) return;
  const double bytes = record["bytes"].get<double>();
  record["mpi_seconds"] = mpi_seconds;
  record["mpi_gbps"] = bytes / mpi_seconds / 1e9;
  // The same bytes, so the GB/s ratio is the inverse ratio of the times.
  record["ratio_to_mpi"] = mpi_seconds / record["seconds"].get<double>();
}

void Report::add(nlohmann::json r) {
  const double bytes = r.value("bytes", 0.0);
  const double seconds = r.value("seconds", 0.0);
  if (!r.contains("isa")) r["isa"] = active_isa_name();  // the row kernels that ran
  if (!r.contains("gbps")) r["gbps"] = seconds > 0 ? bytes / seconds / 1e9 : 0.0;
  if (!json_) {
    std::string extra;
    for (const char* k : {"world", "ranks", "dispatcher", "phase", "isa"}) {
      if (std::string_view(k) == "dispatcher" && r.value("suite", "") == "low_latency") {
        extra += " T=" + r["num_tokens"].dump();  // --tokens runs several T under one shape
      }
      if (r.contains(k))
        extra +=
            std::string(" ") + k + "=" + (r[k].is_string() ? r[k].get<std::string>() : r[k].dump());
    }
    // A record without a model of its own (a half of a call) prints no fraction.
    std::string limit = "  limit      -";
    if (r.contains("fraction_of_limit")) {
      limit = fmt::format("  limit {:8.3f} ms  of limit {:5.2f} [{:4.2f}-{:4.2f}]{}{}",
                          r.value("limit_seconds", 0.0) * 1e3, r.value("fraction_of_limit", 0.0),
                          r.value("fraction_min", 0.0), r.value("fraction_max", 0.0),
                          r.value("noisy", false) ? " NOISY" : "",
                          r.value("cache_resident", false) ? " CACHE" : "");
    }
    std::printf("%-12s %-8s %-5s thr=%-2d%s  %10.3f ms  %8.2f GB/s%s  %s\n",
                r.value("suite", "").c_str(), r.value("shape", "").c_str(),
                r.value("dtype", "").c_str(), r.value("threads", 0), extra.c_str(),
                seconds * 1e3, r["gbps"].get<double>(), limit.c_str(),
                r.value("verified", false) ? "verified" : "NOT VERIFIED");
    if (r.contains("fraction_of_limit")) {
      std::printf(
          "    model: read %.2f MB, write %.2f MB, network %.2f MB; STREAM read %.2f, write "
          "%.2f%s, copy %.2f%s GB/s\n",
          r.value("model_read_bytes", 0.0) / 1e6, r.value("model_write_bytes", 0.0) / 1e6,
          r.value("model_network_bytes", 0.0) / 1e6, r.value("stream_read_gbps", 0.0),
          r.value("stream_write_gbps", 0.0), r.value("stream_nt_write", false) ? " (nt)" : "",
          r.value("stream_copy_gbps", 0.0), r.value("stream_nt_copy", false) ? " (nt)" : "");
    }
    if (r.contains("warm_seconds")) {
      std::printf("    warm (back to back): %.1f us, %.2f x the floor of %.1f us\n",
                  r.value("warm_seconds", 0.0) * 1e6, r.value("warm_floor_ratio", 0.0),
                  r.value("floor_seconds", 0.0) * 1e6);
    }
    for (const nlohmann::json& c : r.value("comparisons", nlohmann::json::array())) {
      std::printf("    %s: %.3f [%.3f, %.3f] over %d paired iterations, target <= %.2f: %s\n",
                  c["name"].get<std::string>().c_str(), c["median"].get<double>(),
                  c["lo"].get<double>(), c["hi"].get<double>(), c["pairs"].get<int>(),
                  c["limit"].get<double>(), c["verdict"].get<std::string>().c_str());
    }
    std::fflush(stdout);
  }
  records_.push_back(std::move(r));
}

Status Report::finish() const {
  const std::string text = nlohmann::json(records_).dump(2);
  if (json_) std::printf("%s\n", text.c_str());
  if (json_out_.empty()) return ok_status();
  std::ofstream f(json_out_);
  f << text << "\n";
  f.close();
  if (!f) return invalid_argument("--json-out ", json_out_, ": cannot write the file");
  return ok_status();
}

Status run_in_world(const std::string& world, int ranks, const WorldOptions& options, bool json,
                    const std::function<Status(World&)>& body, int* my_rank) {
  return cli::run_in_world(
      world, ranks, options,
      [&](World& w) -> Status {
        MOED_ASSIGN_OR_RETURN(const int here, ranks_per_host(w));
        if (w.rank() == 0 && here > host_threads()) {
          std::fprintf(json ? stderr : stdout,
                       "note: %d ranks on %d cores: the ranks take turns on the cores, so STREAM "
                       "is timed over all ranks (first start to last end), as the kernel is\n",
                       here, host_threads());
          std::fflush(json ? stderr : stdout);
        }
        return body(w);
      },
      my_rank);
}

StatusOr<WorldShape> world_shape(std::string_view shape, const std::string& world, int ranks) {
  WorldShape ws;
  MOED_ASSIGN_OR_RETURN(ws.shape, find_shape(shape));
  ws.ranks = ranks;
  if (world == "mpi") {
    MOED_ASSIGN_OR_RETURN(ws.ranks, cli::mpi_world_size());
  }
  ws.shape.num_experts = experts_for_ranks(ws.shape.num_experts, ws.ranks);
  return ws;
}

}  // namespace moed::bench
