// `moed bench dispatch`: the TokenDispatcher implementations (allgather, alltoall, flex) on a
// world of R ranks, dispatch and combine timed separately, beside a plain copy of the same
// bytes with the same total threads in the same run (spec §7).
//
//   moed bench dispatch --dispatcher allgather,alltoall --world threads --ranks 4 --shape mixtral
//
// Each rank holds the shape's T tokens (bf16) with uniform random top-k routing from a fixed
// seed. A figure's time is the median over iterations of the slowest rank's time; bytes =
// aggregate received rows * H * 2 (dispatch) and the same rows sent back (combine). The expert
// outputs fed to combine are the dispatched rows (for Flex copied, untimed, into
// flex_expert_output_buffer, where experts write them). Every dispatcher's output is checked against
// the reference (moed/reference.h) bit for bit in the same run (`verified`). network_bytes and
// shared_bytes are the world's counters for one iteration, summed over ranks.
//
//   mpirun -np 4 moed bench dispatch --world mpi --dispatcher alltoall,flex --shape mixtral
//
// Under MPI (one rank per process) every process rebuilds all ranks' inputs from the seeds and
// the reference, checks its own rank's outputs, and the verdicts are combined over ranks; the
// dispatch records also carry a bare MPI_Alltoallv of the same rows per destination, timed the
// same way in the same run (mpi_seconds, mpi_gbps, ratio_to_mpi = gbps / mpi_gbps).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#ifdef MOED_WITH_MPI
#include <mpi.h>
#endif

#include "bench/common.h"
#include "moed/dispatcher.h"
#include "moed/flex.h"
#include "moed/reference.h"
#include "tools/moed/registry.h"

namespace moed::bench {
namespace {

struct Args {
  std::string dispatchers = "allgather,alltoall";
  std::string world = "threads";
  std::string shape = "mixtral";
  int ranks = 4;
  int ranks_per_node = 0;
  int iters = 5;
  bool json = false;
};

[[noreturn]] void fail(const Status& s) {
  std::fprintf(stderr, "moed bench dispatch: %s\n", s.to_string().c_str());
  throw CLI::RuntimeError(1);
}

TopkRouting make_topk(const Shape& s, int rank) {
  TopkRouting r;
  r.num_tokens = s.num_tokens;
  r.num_topk = s.num_topk;
  std::mt19937 rng(1234u + uint32_t(rank));
  std::uniform_real_distribution<float> prob(0.01f, 1.0f);
  std::vector<int> experts(static_cast<size_t>(s.num_experts));
  for (int64_t t = 0; t < s.num_tokens; ++t) {
    for (int e = 0; e < s.num_experts; ++e) experts[size_t(e)] = e;
    for (int k = 0; k < s.num_topk; ++k) {
      std::swap(experts[size_t(k)], experts[size_t(k) + rng() % size_t(s.num_experts - k)]);
      r.topk_idx.push_back(experts[size_t(k)]);
      r.topk_weights.push_back(prob(rng));
    }
  }
  return r;
}

Tensor make_tokens(int64_t rows, int hidden, uint32_t seed) {
  Tensor x = Tensor::empty(DType::kBF16, rows, hidden);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int h = 0; h < hidden; ++h) x.row<bf16>(r)[h] = float_to_bf16(u(rng));
  }
  return x;
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

StatusOr<int64_t> sum_ranks(World& w, int64_t v) {
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> all,
                        all_gather<int64_t>(w, std::span<const int64_t>(&v, 1)));
  int64_t s = 0;
  for (int64_t x : all) s += x;
  return s;
}

struct Figure {
  std::string dispatcher;
  std::string phase;
  int64_t rows = 0;
  double seconds = 0;
  int64_t network_bytes = 0;
  int64_t shared_bytes = 0;
  bool verified = false;
  double mpi_seconds = 0;  // the bare MPI_Alltoallv of the same rows (dispatch, MPI world)
};

// Every rank's input, rebuilt from the seeds by every process, and what the reference says each
// rank must hold after dispatch and after combine. The expert outputs fed to combine are the
// dispatched rows, so the reference combines its own dispatched rows: a dispatcher whose
// dispatch differs fails its check anyway.
struct Problem {
  std::vector<Tensor> x;
  std::vector<TopkRouting> topk;
  std::vector<ReferenceRankDispatch> dispatched;
  std::vector<Tensor> combined;
};

StatusOr<Problem> make_problem(const Shape& s, int R) {
  Problem pr;
  ReferenceProblem p;
  p.num_experts = s.num_experts;
  p.ep_size = R;
  p.num_topk = s.num_topk;
  for (int r = 0; r < R; ++r) {
    pr.x.push_back(make_tokens(s.num_tokens, s.hidden, 1u + uint32_t(r)));
    pr.topk.push_back(make_topk(s, r));
    p.routing.push_back(to_map(pr.topk.back(), s.num_experts));
    p.hidden.push_back(TokenRows{pr.x.back().view(), {}});
  }
  MOED_ASSIGN_OR_RETURN(pr.dispatched, reference_dispatch(p));
  std::vector<TensorView> y;
  for (const ReferenceRankDispatch& d : pr.dispatched) y.push_back(d.expert_input.x.view());
  MOED_ASSIGN_OR_RETURN(pr.combined, reference_combine(p, y));
  return pr;
}

bool dispatch_ok(const DispatchOutput& d, const ReferenceRankDispatch& want) {
  return bitwise_equal(d.expert_input.x, want.expert_input.x.view()) &&
         std::equal(d.permuted_probs.begin(), d.permuted_probs.end(), want.permuted_probs.begin(),
                    want.permuted_probs.end()) &&
         std::equal(d.tokens_per_expert.begin(), d.tokens_per_expert.end(),
                    want.tokens_per_expert.begin(), want.tokens_per_expert.end()) &&
         d.handle->row_src_token == want.row_src_token;
}

// Median over iterations of the slowest rank's time of a bare MPI_Alltoallv (MPI_COMM_WORLD)
// sending each destination the rows this rank's tokens contribute to its experts: the same
// rows per destination as the dispatchers' output (spec §3, one row per routed (token,
// expert)). 0 outside the MPI world. One warm-up call first, as the dispatchers have had.
StatusOr<double> time_bare_alltoallv(World& w, const Shape& s, const TopkRouting& topk, int iters) {
  double seconds = 0;
#ifdef MOED_WITH_MPI
  if (std::string(w.backend_name()) != "mpi") return seconds;
  const int R = w.size(), L = s.num_experts / R;
  std::vector<int> send_counts(size_t(R), 0), recv_counts(size_t(R), 0);
  for (int32_t e : topk.topk_idx) {
    if (e >= 0) ++send_counts[size_t(e / L)];
  }
  MOED_ASSIGN_OR_RETURN(std::vector<int> all, all_gather<int>(w, send_counts));
  for (int src = 0; src < R; ++src) {
    recv_counts[size_t(src)] = all[size_t(src) * size_t(R) + size_t(w.rank())];
  }
  std::vector<int> send_offsets(size_t(R), 0), recv_offsets(size_t(R), 0);
  for (int r = 1; r < R; ++r) {
    send_offsets[size_t(r)] = send_offsets[size_t(r) - 1] + send_counts[size_t(r) - 1];
    recv_offsets[size_t(r)] = recv_offsets[size_t(r) - 1] + recv_counts[size_t(r) - 1];
  }
  // NOTE: counts in rows of a contiguous row type, so that no count is a byte count past INT_MAX.
  const size_t row_bytes = size_t(s.hidden) * 2;
  std::vector<uint8_t> send(size_t(send_offsets.back() + send_counts.back()) * row_bytes, 1);
  std::vector<uint8_t> recv(size_t(recv_offsets.back() + recv_counts.back()) * row_bytes, 0);
  MPI_Datatype row;
  MPI_Type_contiguous(int(row_bytes), MPI_BYTE, &row);
  MPI_Type_commit(&row);
  std::vector<double> times;
  Status st;
  for (int i = -1; i < iters && st.ok(); ++i) {  // i = -1: warm-up
    StatusOr<double> t = time_max(w, [&] {
      const int rc =
          MPI_Alltoallv(send.data(), send_counts.data(), send_offsets.data(), row, recv.data(),
                        recv_counts.data(), recv_offsets.data(), row, MPI_COMM_WORLD);
      return rc == MPI_SUCCESS ? ok_status() : internal_error("MPI_Alltoallv returned ", rc);
    });
    if (!t.ok()) st = t.status();
    if (t.ok() && i >= 0) times.push_back(*t);
  }
  MPI_Type_free(&row);
  MOED_RETURN_IF_ERROR(st);
  seconds = median(std::move(times));
#endif
  return seconds;
}

Status run_rank(World& w, const Shape& s, const std::vector<DispatcherKind>& kinds, int iters,
                const Problem& pr, std::vector<Figure>* figures) {
  const int me = w.rank();
  const Tensor& x = pr.x[size_t(me)];
  const TopkRouting& topk = pr.topk[size_t(me)];
  MOED_ASSIGN_OR_RETURN(const double mpi_seconds, time_bare_alltoallv(w, s, topk, iters));
  for (DispatcherKind kind : kinds) {
    DispatchConfig config;
    config.kind = kind;
    config.num_experts = s.num_experts;
    MOED_ASSIGN_OR_RETURN(std::unique_ptr<TokenDispatcher> d, TokenDispatcher::create(w, config));
    DispatchInput in;
    in.hidden = TokenRows{x.view(), {}};
    in.topk = &topk;
    DispatchOutput out;
    TokenRows expert_output;
    CombineOutput comb;
    auto dispatch = [&]() -> Status {
      MOED_ASSIGN_OR_RETURN(out, d->dispatch(in));
      return ok_status();
    };
    // The "experts" (untimed): their outputs are the dispatched rows. Flex's experts write
    // into its node-shared buffer, as the MoE layer's do, so combine reads them in place.
    auto run_experts = [&]() -> Status {
      expert_output = out.expert_input;
      if (kind != DispatcherKind::kFlex) return ok_status();
      MOED_ASSIGN_OR_RETURN(TensorView y, flex_expert_output_buffer(*d, *out.handle, DType::kBF16));
      for (int64_t r = 0; r < y.rows; ++r) {
        std::memcpy(y.row_ptr(r), out.expert_input.x.row_ptr(r), y.row_bytes());
      }
      expert_output = TokenRows{y, {}};
      return ok_status();
    };
    auto combine = [&]() -> Status {
      MOED_ASSIGN_OR_RETURN(comb, d->combine(CombineInput{expert_output, out.handle}));
      return ok_status();
    };
    // One iteration's traffic, from the world's counters.
    w.reset_counters();
    MOED_RETURN_IF_ERROR(dispatch());
    const TrafficCounters dc = w.counters();
    MOED_RETURN_IF_ERROR(run_experts());
    w.reset_counters();
    MOED_RETURN_IF_ERROR(combine());
    const TrafficCounters cc = w.counters();

    const bool ok = dispatch_ok(out, pr.dispatched[size_t(me)]) &&
                    bitwise_equal(comb.hidden.view(), pr.combined[size_t(me)].view());
    MOED_ASSIGN_OR_RETURN(const int64_t bad, sum_ranks(w, ok ? 0 : 1));
    const bool verified = bad == 0;

    std::vector<double> dt, ct;
    for (int i = 0; i < iters; ++i) {
      MOED_ASSIGN_OR_RETURN(double a, time_max(w, dispatch));
      MOED_RETURN_IF_ERROR(run_experts());
      MOED_ASSIGN_OR_RETURN(double b, time_max(w, combine));
      dt.push_back(a);
      ct.push_back(b);
    }
    MOED_ASSIGN_OR_RETURN(const int64_t rows, sum_ranks(w, out.num_rows()));
    MOED_ASSIGN_OR_RETURN(const int64_t dnet, sum_ranks(w, int64_t(dc.network_bytes)));
    MOED_ASSIGN_OR_RETURN(const int64_t dshm, sum_ranks(w, int64_t(dc.shared_bytes)));
    MOED_ASSIGN_OR_RETURN(const int64_t cnet, sum_ranks(w, int64_t(cc.network_bytes)));
    MOED_ASSIGN_OR_RETURN(const int64_t cshm, sum_ranks(w, int64_t(cc.shared_bytes)));
    if (me == 0) {
      const std::string name = dispatcher_kind_name(kind);
      figures->push_back({name, "dispatch", rows, median(dt), dnet, dshm, verified, mpi_seconds});
      figures->push_back({name, "combine", rows, median(ct), cnet, cshm, verified});
    }
    out = DispatchOutput{};
    comb = CombineOutput{};
  }
  return ok_status();
}

void run(const Args& a) {
  StatusOr<Shape> found = find_shape(a.shape);
  if (!found.ok()) fail(found.status());
  int ranks = a.ranks;
  if (a.world == "mpi") {
    StatusOr<int> n = mpi_world_size();
    if (!n.ok()) fail(n.status());
    ranks = *n;
  }
  Shape s = *found;
  s.num_experts = experts_for_ranks(s.num_experts, ranks);
  std::vector<DispatcherKind> kinds;
  std::stringstream list(a.dispatchers);
  for (std::string name; std::getline(list, name, ',');) {
    StatusOr<DispatcherKind> k = parse_dispatcher_kind(name);
    if (!k.ok()) fail(k.status());
    if (*k == DispatcherKind::kLowLatency) {
      fail(invalid_argument("--dispatcher low-latency has its own bench: moed bench low-latency"));
    }
    kinds.push_back(*k);
  }
  WorldOptions opts;
  opts.ranks_per_node = a.ranks_per_node;
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  const int threads_per_rank = std::max(1, cores / ranks);
  opts.threads_per_rank = threads_per_rank;
  std::vector<Figure> figures;
  int my_rank = 0;
  {
    StatusOr<Problem> pr = make_problem(s, ranks);
    if (!pr.ok()) fail(pr.status());
    Status st = run_in_world(
        a.world, ranks, opts,
        [&](World& w) { return run_rank(w, s, kinds, a.iters, *pr, &figures); }, &my_rank);
    if (!st.ok()) fail(st);
  }
  if (my_rank != 0) return;

  // The same total threads as the ranks' pools together.
  const int threads = threads_per_rank * ranks;
  Report report(a.json);
  for (const Figure& f : figures) {
    const size_t bytes = size_t(f.rows) * size_t(s.hidden) * 2;
    nlohmann::json rec = {{"suite", "dispatch"},
                          {"shape", s.name},
                          {"dispatcher", f.dispatcher},
                          {"phase", f.phase},
                          {"world", a.world},
                          {"ranks", ranks},
                          {"ranks_per_node", a.ranks_per_node == 0 ? ranks : a.ranks_per_node},
                          {"num_tokens", s.num_tokens},
                          {"hidden", s.hidden},
                          {"num_experts", s.num_experts},
                          {"num_topk", s.num_topk},
                          {"dtype", "bf16"},
                          {"threads", threads},
                          {"iters", a.iters},
                          {"rows", f.rows},
                          {"bytes", bytes},
                          {"seconds", f.seconds},
                          {"network_bytes", f.network_bytes},
                          {"shared_bytes", f.shared_bytes},
                          {"copy_gbps", measure_copy_gbps(bytes, threads)},
                          {"peak_rss_bytes", peak_rss_bytes()},
                          {"verified", f.verified}};
    if (f.mpi_seconds > 0) {
      // The same bytes, so the GB/s ratio is the inverse ratio of the times.
      rec["mpi_seconds"] = f.mpi_seconds;
      rec["mpi_gbps"] = double(bytes) / f.mpi_seconds / 1e9;
      rec["ratio_to_mpi"] = f.mpi_seconds / f.seconds;
    }
    report.add(std::move(rec));
  }
  report.finish();
}

void setup(CLI::App& bench) {
  auto args = std::make_shared<Args>();
  CLI::App* c = bench.add_subcommand(
      "dispatch", "TokenDispatcher dispatch and combine (allgather, alltoall, flex) vs copy");
  c->add_option("--dispatcher", args->dispatchers, "comma-separated: allgather,alltoall,flex")
      ->capture_default_str();
  c->add_option("--world", args->world, "threads | mpi")->capture_default_str();
  c->add_option("--ranks", args->ranks, "ranks in the world")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  c->add_option("--ranks-per-node", args->ranks_per_node, "ranks per node G (0 = all on one)")
      ->capture_default_str();
  c->add_option("--shape", args->shape, "tiny | mixtral | dsv3 | decode")->capture_default_str();
  c->add_option("--iters", args->iters, "timed iterations (median reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  c->add_flag("--json", args->json, "print the records as a JSON array");
  c->callback([args] { run(*args); });
}

}  // namespace

MOED_CLI_COMMAND("bench", setup);

}  // namespace moed::bench
