// `moed bench alltoallv`: the world's all-to-all-v of bf16 token rows (the AlltoAll
// dispatcher's exchange), beside the memory-copy bound and, in the MPI world, beside a bare
// MPI_Alltoallv of the same bytes in the same run.
//
// Each rank routes its T tokens to K distinct experts, uniform at random (fixed seed per
// rank), and sends one row of H bf16 per (token, expert) to the expert's rank (E adjusted so
// that R divides it). bytes = sum over ranks of received rows * H * 2 (aggregate, spec §7);
// a multi-rank time is the maximum over ranks, the figure the median over iterations.
//
//   moed bench alltoallv --world threads --ranks 8 --shape mixtral --json
//   mpirun --oversubscribe -np 8 moed bench alltoallv --world mpi --shape mixtral --json
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

#include "bench/common.h"
#include "moed/threads_world.h"
#include "moed/world.h"
#include "tools/moed/registry.h"
#ifdef MOED_WITH_MPI
#include <mpi.h>

#include "moed/mpi_world.h"
#endif

namespace moed::bench {
namespace {

struct Args {
  std::string world = "threads";
  int ranks = 0;
  int ranks_per_node = 0;
  std::string shape = "mixtral";
  int iters = 10;
  bool json = false;
};

[[noreturn]] void fail(const Status& s) {
  std::fprintf(stderr, "moed bench alltoallv: %s\n", s.to_string().c_str());
  throw CLI::RuntimeError(1);
}

// What one rank sends: rows grouped by destination rank, each row tagged with its origin
// (source rank, token, k) in its first 8 bytes so the receiver can check it.
struct Plan {
  std::vector<size_t> send_rows, recv_rows;  // per peer
  std::vector<uint8_t> send, recv;
  size_t row_bytes = 0;
};

uint64_t tag_of(int src, int64_t token, int k) {
  return (uint64_t(src) << 40) | (uint64_t(token) << 8) | uint64_t(k);
}

Status build_plan(World& w, const Shape& shape, Plan* plan) {
  const int R = w.size();
  const int E = experts_for_ranks(shape.num_experts, R);
  const int L = E / R;
  const int K = std::min(shape.num_topk, E);
  plan->row_bytes = size_t(shape.hidden) * 2;
  std::mt19937 rng(1000u + uint32_t(w.rank()));
  std::vector<int> experts(size_t(E), 0);
  std::vector<std::vector<uint64_t>> by_dst(static_cast<size_t>(R));
  for (int64_t t = 0; t < shape.num_tokens; ++t) {
    for (int e = 0; e < E; ++e) experts[size_t(e)] = e;
    for (int k = 0; k < K; ++k) {
      std::swap(experts[size_t(k)], experts[size_t(k) + rng() % size_t(E - k)]);
      by_dst[size_t(experts[size_t(k)] / L)].push_back(tag_of(w.rank(), t, k));
    }
  }
  plan->send_rows.assign(size_t(R), 0);
  size_t rows = 0;
  for (int d = 0; d < R; ++d) rows += (plan->send_rows[size_t(d)] = by_dst[size_t(d)].size());
  plan->send.assign(rows * plan->row_bytes, 0);
  size_t r = 0;
  for (int d = 0; d < R; ++d) {
    for (uint64_t tag : by_dst[size_t(d)]) {
      uint8_t* row = plan->send.data() + r++ * plan->row_bytes;
      std::memcpy(row, &tag, sizeof(tag));
      for (size_t b = sizeof(tag); b < plan->row_bytes; ++b) row[b] = uint8_t(tag + b);
    }
  }
  std::vector<uint64_t> mine(plan->send_rows.begin(), plan->send_rows.end());
  MOED_ASSIGN_OR_RETURN(std::vector<uint64_t> theirs,
                        all_to_all<uint64_t>(w, std::span<const uint64_t>(mine)));
  plan->recv_rows.assign(theirs.begin(), theirs.end());
  size_t recv_rows = 0;
  for (size_t n : plan->recv_rows) recv_rows += n;
  plan->recv.assign(recv_rows * plan->row_bytes, 0);
  return ok_status();
}

// Every received row came from the rank its tag names, with the bytes the sender wrote.
bool verify(const World& w, const Plan& plan) {
  size_t r = 0;
  for (int s = 0; s < w.size(); ++s) {
    for (size_t i = 0; i < plan.recv_rows[size_t(s)]; ++i, ++r) {
      const uint8_t* row = plan.recv.data() + r * plan.row_bytes;
      uint64_t tag;
      std::memcpy(&tag, row, sizeof(tag));
      if (int(tag >> 40) != s) return false;
      for (size_t b = sizeof(tag); b < plan.row_bytes; ++b) {
        if (row[b] != uint8_t(tag + b)) return false;
      }
    }
  }
  return true;
}

// Median over iterations of the slowest rank's time for fn.
StatusOr<double> time_max_over_ranks(World& w, int iters, const std::function<Status()>& fn) {
  std::vector<double> per_iter;
  for (int i = -1; i < iters; ++i) {  // i = -1: warm-up
    MOED_RETURN_IF_ERROR(w.barrier());
    const auto a = std::chrono::steady_clock::now();
    MOED_RETURN_IF_ERROR(fn());
    const double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
    MOED_ASSIGN_OR_RETURN(std::vector<double> all,
                          all_gather<double>(w, std::span<const double>(&mine, 1)));
    if (i >= 0) per_iter.push_back(*std::max_element(all.begin(), all.end()));
  }
  return median(per_iter);
}

Status bench_body(World& w, const Args& args, const Shape& shape, Report* report) {
  Plan plan;
  MOED_RETURN_IF_ERROR(build_plan(w, shape, &plan));
  const int R = w.size();
  std::vector<size_t> sb(static_cast<size_t>(R)), so(static_cast<size_t>(R)), rb(static_cast<size_t>(R)), ro(static_cast<size_t>(R));
  for (int d = 0, s_off = 0, r_off = 0; d < R; ++d) {
    sb[size_t(d)] = plan.send_rows[size_t(d)] * plan.row_bytes;
    rb[size_t(d)] = plan.recv_rows[size_t(d)] * plan.row_bytes;
    so[size_t(d)] = size_t(s_off);
    ro[size_t(d)] = size_t(r_off);
    s_off += int(sb[size_t(d)]);
    r_off += int(rb[size_t(d)]);
  }
  w.reset_counters();
  auto exchange = [&] {
    return w.all_to_all_v_bytes(plan.send.data(), sb, so, plan.recv.data(), rb, ro);
  };
  MOED_ASSIGN_OR_RETURN(double seconds, time_max_over_ranks(w, args.iters, exchange));
  const TrafficCounters per_call = w.counters();  // warm-up + iters calls
  const bool ok = verify(w, plan);
  const uint8_t ok_byte = ok ? 1 : 0;
  MOED_ASSIGN_OR_RETURN(std::vector<uint8_t> oks,
                        all_gather<uint8_t>(w, std::span<const uint8_t>(&ok_byte, 1)));
  const bool verified = std::all_of(oks.begin(), oks.end(), [](uint8_t v) { return v == 1; });
  const uint64_t mine[3] = {plan.recv.size(), per_call.shared_bytes, per_call.network_bytes};
  MOED_ASSIGN_OR_RETURN(std::vector<uint64_t> sums,
                        all_gather<uint64_t>(w, std::span<const uint64_t>(mine, 3)));
  uint64_t bytes = 0, shared = 0, network = 0;
  for (int r = 0; r < R; ++r) {
    bytes += sums[3 * size_t(r)];
    shared += sums[3 * size_t(r) + 1];
    network += sums[3 * size_t(r) + 2];
  }
  const uint64_t calls = uint64_t(args.iters) + 1;

  double mpi_seconds = 0;
#ifdef MOED_WITH_MPI
  if (std::string(w.backend_name()) == "mpi") {
    std::vector<int> sc(static_cast<size_t>(R)), sd(static_cast<size_t>(R)), rc(static_cast<size_t>(R)), rd(static_cast<size_t>(R));
    for (int d = 0; d < R; ++d) {
      sc[size_t(d)] = int(sb[size_t(d)]);
      sd[size_t(d)] = int(so[size_t(d)]);
      rc[size_t(d)] = int(rb[size_t(d)]);
      rd[size_t(d)] = int(ro[size_t(d)]);
    }
    MOED_ASSIGN_OR_RETURN(mpi_seconds, time_max_over_ranks(w, args.iters, [&] {
                            MPI_Alltoallv(plan.send.data(), sc.data(), sd.data(), MPI_BYTE,
                                          plan.recv.data(), rc.data(), rd.data(), MPI_BYTE,
                                          MPI_COMM_WORLD);
                            return ok_status();
                          }));
  }
#endif
  // The copy bound: the same aggregate bytes copied by as many threads as there are ranks
  // (each rank copies its share in both worlds), measured on rank 0 while the rest wait.
  double copy_gbps = 0;
  if (w.rank() == 0) {
    copy_gbps = measure_copy_gbps(size_t(bytes), std::min<int>(R, 64), args.iters);
    nlohmann::json rec = {{"suite", "alltoallv"},
                          {"shape", shape.name},
                          {"dtype", "bf16"},
                          {"threads", R * w.pool().num_threads()},
                          {"world", w.backend_name()},
                          {"ranks", R},
                          {"ranks_per_node", w.ranks_per_node()},
                          {"bytes", bytes},
                          {"seconds", seconds},
                          {"copy_gbps", copy_gbps},
                          {"shared_bytes", shared / calls},
                          {"network_bytes", network / calls},
                          {"verified", verified}};
    if (mpi_seconds > 0) {
      rec["mpi_seconds"] = mpi_seconds;
      rec["mpi_gbps"] = double(bytes) / mpi_seconds / 1e9;
      rec["ratio_to_mpi"] = mpi_seconds / seconds;
    }
    report->add(rec);
  }
  MOED_RETURN_IF_ERROR(w.barrier());
  return verified ? ok_status() : internal_error("received rows differ from what was sent");
}

void run(const Args& args) {
  StatusOr<Shape> shape = find_shape(args.shape);
  if (!shape.ok()) fail(shape.status());
  if (args.iters < 1) fail(invalid_argument("--iters = ", args.iters, " must be >= 1"));
  WorldOptions opts;
  opts.ranks_per_node = args.ranks_per_node;
  Report report(args.json);
  bool print = true;
  if (args.world == "threads") {
    const int ranks = args.ranks == 0 ? 2 : args.ranks;
    Status s =
        run_threads(ranks, opts, [&](World& w) { return bench_body(w, args, *shape, &report); });
    if (!s.ok()) fail(s);
  } else if (args.world == "mpi") {
#ifdef MOED_WITH_MPI
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    }
    int size = 0, rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    print = rank == 0;
    Status s;
    if (args.ranks != 0 && args.ranks != size) {
      s = invalid_argument("--ranks ", args.ranks, " differs from the ", size,
                           " processes mpirun started");
    } else {
      StatusOr<std::unique_ptr<World>> w = make_mpi_world(MPI_COMM_WORLD, opts);
      s = w.ok() ? bench_body(**w, args, *shape, &report) : w.status();
    }
    if (!initialized) MPI_Finalize();
    if (!s.ok()) fail(s);
#else
    fail(unimplemented("--world mpi: this moed was built without MPI (MOED_WITH_MPI=OFF)"));
#endif
  } else {
    fail(invalid_argument("--world '", args.world, "' is not one of threads, mpi"));
  }
  if (print) report.finish();
}

void setup(CLI::App& bench) {
  auto args = std::make_shared<Args>();
  CLI::App* c = bench.add_subcommand(
      "alltoallv", "the world's all-to-all-v of bf16 token rows vs the copy bound (and MPI)");
  c->add_option("--world", args->world, "threads or mpi (mpi: start the program with mpirun)");
  c->add_option("--ranks", args->ranks, "ranks (threads; default 2; mpi: the job size)");
  c->add_option("--ranks-per-node", args->ranks_per_node, "G, ranks per node (0 = default)");
  c->add_option("--shape", args->shape, "tiny, mixtral, dsv3, decode");
  c->add_option("--iters", args->iters, "timed iterations (median reported)");
  c->add_flag("--json", args->json, "print the records as JSON");
  c->callback([args] { run(*args); });
}

MOED_CLI_COMMAND("bench", setup);

}  // namespace
}  // namespace moed::bench
