#include "bench/common.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>

#include "moed/threads_world.h"
#ifdef MOED_WITH_MPI
#include "moed/mpi_world.h"
#endif

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

double measure_copy_gbps(size_t bytes, int threads, int iters) {
  if (bytes == 0) return 0;
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  const size_t rounded = (bytes + 63) / 64 * 64;
  std::unique_ptr<char, Free> src(static_cast<char*>(std::aligned_alloc(64, rounded)));
  std::unique_ptr<char, Free> dst(static_cast<char*>(std::aligned_alloc(64, rounded)));
  std::memset(src.get(), 1, bytes);
  std::memset(dst.get(), 0, bytes);
  ThreadPool pool(threads);
  const double s = median_seconds(
      [&] {
        pool.parallel_for(int64_t(bytes), [&](int64_t b, int64_t e, int) {
          std::memcpy(dst.get() + b, src.get() + b, size_t(e - b));
        }, 1 << 16);
      },
      iters, 2);
  return double(bytes) / s / 1e9;
}

uint64_t peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return uint64_t(std::stoull(line.substr(6))) * 1024;
  }
  return 0;
}

void Report::add(nlohmann::json r) {
  const double bytes = r.value("bytes", 0.0);
  const double seconds = r.value("seconds", 0.0);
  if (!r.contains("gbps")) r["gbps"] = seconds > 0 ? bytes / seconds / 1e9 : 0.0;
  if (!r.contains("ratio_to_copy")) {
    const double copy = r.value("copy_gbps", 0.0);
    r["ratio_to_copy"] = copy > 0 ? r["gbps"].get<double>() / copy : 0.0;
  }
  if (!json_) {
    std::string extra;
    for (const char* k : {"world", "ranks", "dispatcher", "phase"}) {
      if (r.contains(k)) extra += std::string(" ") + k + "=" + (r[k].is_string() ? r[k].get<std::string>() : r[k].dump());
    }
    std::printf("%-12s %-8s %-5s thr=%-2d%s  %10.3f ms  %8.2f GB/s  copy %8.2f GB/s  ratio %5.2f  %s\n",
                r.value("suite", "").c_str(), r.value("shape", "").c_str(),
                r.value("dtype", "").c_str(), r.value("threads", 0), extra.c_str(), seconds * 1e3,
                r["gbps"].get<double>(), r.value("copy_gbps", 0.0),
                r["ratio_to_copy"].get<double>(),
                r.value("verified", false) ? "verified" : "NOT VERIFIED");
    std::fflush(stdout);
  }
  records_.push_back(std::move(r));
}

void Report::finish() const {
  if (json_) std::printf("%s\n", nlohmann::json(records_).dump(2).c_str());
}

bool launched_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
}

StatusOr<int> mpi_world_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    if (const char* v = std::getenv(name)) return std::atoi(v);
  }
  return failed_precondition("--world mpi needs the program started by mpirun (mpirun -np 4 moed ...)");
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

}  // namespace moed::bench
