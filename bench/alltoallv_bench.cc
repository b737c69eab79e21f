// `moed bench alltoallv`: the world's all-to-all-v of bf16 token rows (the AlltoAll
// dispatcher's exchange), against its physical limit (bench/limit.h: every byte read once
// where it is sent and written once where it is received, over STREAM bandwidths measured in
// the same run) and, in the MPI world, beside a bare MPI_Alltoallv of the same bytes.
//
// Each rank routes its T tokens to K distinct experts, uniform at random (fixed seed per
// rank), and sends one row of H bf16 per (token, expert) to the expert's rank (E adjusted so
// that R divides it). bytes = sum over ranks of received rows * H * 2 (aggregate, design.md §7.1);
// a multi-rank time is the maximum over ranks, the figure the median over iterations, each
// paired with the STREAM operation just before it.
//
//   moed bench alltoallv --world threads --ranks 8 --shape mixtral --json
//   mpirun --oversubscribe -np 8 moed bench alltoallv --world mpi --shape mixtral --json
#include <algorithm>
#include <cstring>
#include <random>
#include <string>

#include "bench/common.h"
#include "cli/registry.h"
#include "moed/world.h"
#ifdef MOED_WITH_MPI
#include <mpi.h>
#endif

namespace moed::bench::alltoallv_bench {
namespace {

struct Args : WorldArgs, ReportArgs {
  std::string shape = "mixtral";
};

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
  std::vector<std::vector<uint64_t>> by_dst(static_cast<size_t>(R));
  random_experts(shape.num_tokens, E, K, rng, [&](int64_t t, int k, int expert) {
    by_dst[size_t(expert / L)].push_back(tag_of(w.rank(), t, k));
  });
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

Status bench_body(World& w, const Args& args, const Shape& shape, Report* report) {
  Plan plan;
  MOED_RETURN_IF_ERROR(build_plan(w, shape, &plan));
  const int R = w.size();
  std::vector<size_t> sb(static_cast<size_t>(R)), so(static_cast<size_t>(R)),
      rb(static_cast<size_t>(R)), ro(static_cast<size_t>(R));
  for (int d = 0, s_off = 0, r_off = 0; d < R; ++d) {
    sb[size_t(d)] = plan.send_rows[size_t(d)] * plan.row_bytes;
    rb[size_t(d)] = plan.recv_rows[size_t(d)] * plan.row_bytes;
    so[size_t(d)] = size_t(s_off);
    ro[size_t(d)] = size_t(r_off);
    s_off += int(sb[size_t(d)]);
    r_off += int(rb[size_t(d)]);
  }
  auto exchange = [&] {
    return w.all_to_all_v_bytes(plan.send.data(), sb, so, plan.recv.data(), rb, ro);
  };
  // One counted call (the warm-up), then STREAM, exchange, STREAM, exchange, ...
  MOED_ASSIGN_OR_RETURN(const Traffic per_call, traffic_of(w, exchange, "alltoallv"));
  MOED_ASSIGN_OR_RETURN(const bool verified, all_ranks_ok(w, verify(w, plan)));
  MOED_ASSIGN_OR_RETURN(const int64_t recv_bytes, sum_ranks(w, int64_t(plan.recv.size())));
  const uint64_t bytes = uint64_t(recv_bytes);
  Stream stream(w);
  MOED_ASSIGN_OR_RETURN(const Paired times, paired_time_max(w, args.iters, stream, exchange));

  double mpi_seconds = 0;
#ifdef MOED_WITH_MPI
  if (std::string(w.backend_name()) == "mpi") {
    std::vector<int> sc(static_cast<size_t>(R)), sd(static_cast<size_t>(R)),
        rc(static_cast<size_t>(R)), rd(static_cast<size_t>(R));
    for (int d = 0; d < R; ++d) {
      sc[size_t(d)] = int(sb[size_t(d)]);
      sd[size_t(d)] = int(so[size_t(d)]);
      rc[size_t(d)] = int(rb[size_t(d)]);
      rd[size_t(d)] = int(ro[size_t(d)]);
    }
    MOED_ASSIGN_OR_RETURN(mpi_seconds, median_time_max(w, args.iters, [&] {
                            MPI_Alltoallv(plan.send.data(), sc.data(), sd.data(), MPI_BYTE,
                                          plan.recv.data(), rc.data(), rd.data(), MPI_BYTE,
                                          MPI_COMM_WORLD);
                            return ok_status();
                          }));
  }
#endif
  if (w.rank() == 0) {
    nlohmann::json rec = {{"suite", "alltoallv"},
                          {"shape", shape.name},
                          {"dtype", "bf16"},
                          {"threads", R * w.pool().num_threads()},
                          {"world", w.backend_name()},
                          {"ranks", R},
                          {"ranks_per_node", w.ranks_per_node()},
                          {"bytes", bytes},
                          {"shared_bytes", per_call.shared_bytes},
                          {"network_bytes", per_call.network_bytes},
                          {"verified", verified}};
    TrafficModel m;
    m.read_bytes = m.write_bytes = double(bytes);
    add_limit(rec, times, m);
    add_mpi_baseline(rec, mpi_seconds);
    report->add(rec);
  }
  MOED_RETURN_IF_ERROR(w.barrier());
  return verified ? ok_status() : internal_error("received rows differ from what was sent");
}

void run(const Args& args) {
  StatusOr<Shape> shape = find_shape(args.shape);
  if (!shape.ok()) fail("alltoallv", shape.status());
  // Under --world mpi: the job's size.
  int ranks = args.ranks;
  if (args.world == "mpi") {
    StatusOr<int> n = mpi_world_size();
    if (!n.ok()) fail("alltoallv", n.status());
    ranks = *n;
  }
  WorldOptions opts;
  opts.ranks_per_node = args.ranks_per_node;
  Report report(args);
  int my_rank = 0;
  Status s = run_in_world(
      args.world, ranks, opts, args.json,
      [&](World& w) { return bench_body(w, args, *shape, &report); }, &my_rank);
  if (!s.ok()) fail("alltoallv", s);
  if (my_rank != 0) return;
  if (Status st = report.finish(); !st.ok()) fail("alltoallv", st);
}

void setup(CLI::App& bench) {
  auto args = std::make_shared<Args>();
  CLI::App* c = bench.add_subcommand(
      "alltoallv", "the world's all-to-all-v of bf16 token rows vs its limit (and MPI)");
  add_world_options(*c, *args);
  c->add_option("--shape", args->shape, "tiny | mixtral | dsv3 | decode")->capture_default_str();
  add_report_options(*c, *args);
  c->callback([args] { run(*args); });
}

MOED_CLI_COMMAND("bench", setup);

}  // namespace
}  // namespace moed::bench::alltoallv_bench
