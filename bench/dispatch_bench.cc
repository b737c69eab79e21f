// `moed bench dispatch`: the TokenDispatcher implementations (allgather, alltoall, flex) on a
// world of R ranks, dispatch and combine timed separately, each against its physical limit:
// the bytes it must move (counted from the routing) over the machine's STREAM bandwidths,
// measured with the same threads in the same run, one before each kernel iteration
// (bench/limit.h: limit_seconds, fraction_of_limit, its spread, `noisy`).
//
//   moed bench dispatch --dispatcher allgather,alltoall --world threads --ranks 4 --shape mixtral
//
// Each rank holds the shape's T tokens (or --tokens T), bf16, with uniform random top-k routing
// from a fixed seed. A figure's time is the median over iterations of the slowest rank's time;
// bytes = aggregate received rows * H * 2 (dispatch) and the same rows sent back (combine). The
// expert outputs fed to combine are the dispatched rows (for Flex copied, untimed, into
// FlexDispatcher::expert_output_buffer, where experts write them). Every dispatcher's output is
// checked against the reference (moed/reference.h) bit for bit in the same run (`verified`).
// network_bytes and shared_bytes are the world's counters for one iteration, summed over ranks;
// collectives is the collectives one call entered on each rank (TrafficCounters, mean over
// ranks). With several nodes (--ranks-per-node) dispatch records add flat_network_bytes, what a
// flat all-to-all of the same routing would send between nodes, and network_vs_flat =
// network_bytes / that; Flex records add network_rows_counted (cross_node_rows).
// Every record says what holds the memory: peak_rss_bytes and `memory` (inputs_bytes,
// reference_bytes, stream_bytes, all ranks, and dispatcher_rss_bytes, the resident memory
// the dispatcher's creation and first dispatch + combine added: its buffers and outputs).
//
//   mpirun -np 4 moed bench dispatch --world mpi --dispatcher alltoall,flex --shape mixtral
//
// Under MPI (one rank per process) every process rebuilds all ranks' inputs from the seeds and
// the reference, checks its own rank's outputs, and the verdicts are combined over ranks; the
// dispatch records also carry a bare MPI_Alltoallv of the same rows per destination, timed the
// same way in the same run (mpi_seconds, mpi_gbps, ratio_to_mpi = gbps / mpi_gbps).
#include <algorithm>
#include <cstring>
#include <random>
#include <sstream>
#include <string>

#ifdef MOED_WITH_MPI
#include <mpi.h>
#endif

#include "bench/common.h"
#include "cli/registry.h"
#include "moed/dispatcher.h"
#include "moed/flex.h"
#include "moed/reference.h"

namespace moed::bench::dispatch_bench {
namespace {

struct Args : WorldArgs, ReportArgs {
  Args() : WorldArgs(4), ReportArgs(5) {}
  std::string dispatchers = "allgather,alltoall";
  std::string shape = "mixtral";
  int64_t tokens = 0;  // T per rank, overriding the shape's (0: the shape's)
};

struct Figure {
  std::string dispatcher;
  std::string phase;
  int64_t rows = 0;
  Paired times;  // the kernel's, each with the STREAM sample taken before it
  Traffic traffic;
  bool verified = false;
  double mpi_seconds = 0;  // the bare MPI_Alltoallv of the same rows (dispatch, MPI world)
  // Resident memory that creating the dispatcher and its first dispatch + experts + combine
  // added (its buffers, its outputs, the experts' outputs), all ranks; may be less than what
  // it allocated where it reused memory a previous dispatcher freed.
  int64_t dispatcher_rss_bytes = 0;
};

// What holds this run's memory besides the dispatchers (all ranks, bytes).
struct Memory {
  uint64_t inputs = 0;     // every rank's tokens and routing
  uint64_t reference = 0;  // the reference's dispatched rows and combined tokens
  uint64_t stream = 0;     // the STREAM arrays
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
    std::mt19937 token_rng(1u + uint32_t(r)), topk_rng(1234u + uint32_t(r));
    pr.x.push_back(random_tokens(s.num_tokens, s.hidden, 2.0f, token_rng));
    pr.topk.push_back(random_topk(s, 0.01f, topk_rng));
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
// rows per destination as the dispatchers' output (docs/design.md §3, one row per routed (token,
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
  StatusOr<double> t = median_time_max(w, iters, [&] {
    const int rc =
        MPI_Alltoallv(send.data(), send_counts.data(), send_offsets.data(), row, recv.data(),
                      recv_counts.data(), recv_offsets.data(), row, MPI_COMM_WORLD);
    return rc == MPI_SUCCESS ? ok_status() : internal_error("MPI_Alltoallv returned ", rc);
  });
  MPI_Type_free(&row);
  MOED_ASSIGN_OR_RETURN(seconds, std::move(t));
#endif
  return seconds;
}

// RSS growth since `before`, summed over the processes of the world (one per rank under MPI;
// the threads world is one process, counted once).
StatusOr<int64_t> rss_growth(World& w, uint64_t before) {
  MOED_RETURN_IF_ERROR(w.barrier());
  const int64_t mine = int64_t(current_rss_bytes()) - int64_t(before);
  return sum_ranks(w, w.shares_address_space() && w.rank() != 0 ? 0 : mine);
}

Status run_rank(World& w, const Shape& s, const std::vector<DispatcherKind>& kinds, int iters,
                const Problem& pr, std::vector<Figure>* figures, Memory* memory) {
  const int me = w.rank();
  const Tensor& x = pr.x[size_t(me)];
  const TopkRouting& topk = pr.topk[size_t(me)];
  MOED_ASSIGN_OR_RETURN(const double mpi_seconds, time_bare_alltoallv(w, s, topk, iters));
  Stream stream(w);  // this rank's share of the STREAM arrays
  MOED_RETURN_IF_ERROR(stream.calibrate());
  for (DispatcherKind kind : kinds) {
    MOED_RETURN_IF_ERROR(w.barrier());
    const uint64_t rss_before = current_rss_bytes();
    DispatchConfig config;
    config.kind = kind;
    config.num_experts = s.num_experts;
    std::unique_ptr<TokenDispatcher> d;
    FlexDispatcher* flex = nullptr;  // d when it is Flex, for its expert output buffer (below)
    if (kind == DispatcherKind::kFlex) {
      MOED_ASSIGN_OR_RETURN(std::unique_ptr<FlexDispatcher> f, FlexDispatcher::make(w, config));
      flex = f.get();
      d = std::move(f);
    } else {
      MOED_ASSIGN_OR_RETURN(d, TokenDispatcher::create(w, config));
    }
    DispatchInput in;
    in.hidden = TokenRows{x.view(), {}};
    in.topk = TopkView::of(topk);
    DispatchOutput out;
    TokenRows expert_output;
    CombineOutput comb;
    // NOTE: the previous output is dropped first (dispatch and combine), so its memory is
    // reused (moed/dispatcher.h's lifetime rule: a held output would make the dispatcher write
    // elsewhere, into fresh pages the first timed call would fault in).
    auto dispatch = [&]() -> Status {
      out = DispatchOutput{};
      MOED_ASSIGN_OR_RETURN(out, d->dispatch(in));
      return ok_status();
    };
    // The "experts" (untimed): their outputs are the dispatched rows. Flex's experts write
    // into its node-shared buffer, as the MoE layer's do, so combine reads them in place.
    auto run_experts = [&]() -> Status {
      expert_output = out.expert_input;
      if (flex == nullptr) return ok_status();
      MOED_ASSIGN_OR_RETURN(TensorView y, flex->expert_output_buffer(*out.handle, DType::kBF16));
      for (int64_t r = 0; r < y.rows; ++r) {
        std::memcpy(y.row_ptr(r), out.expert_input.x.row_ptr(r), y.row_bytes());
      }
      expert_output = TokenRows{y, {}};
      return ok_status();
    };
    auto combine = [&]() -> Status {
      comb = CombineOutput{};
      MOED_ASSIGN_OR_RETURN(comb, d->combine(CombineInput{expert_output, out.handle}));
      return ok_status();
    };
    MOED_RETURN_IF_ERROR(dispatch());  // warm-up: the counted call allocates nothing
    const std::string name = dispatcher_kind_name(kind);
    MOED_ASSIGN_OR_RETURN(const Traffic dispatch_traffic,
                          traffic_of(w, dispatch, name + " dispatch"));
    MOED_RETURN_IF_ERROR(run_experts());
    MOED_ASSIGN_OR_RETURN(const Traffic combine_traffic, traffic_of(w, combine, name + " combine"));
    MOED_ASSIGN_OR_RETURN(const int64_t dispatcher_rss, rss_growth(w, rss_before));
    MOED_ASSIGN_OR_RETURN(
        const bool verified,
        all_ranks_ok(w, dispatch_ok(out, pr.dispatched[size_t(me)]) &&
                            bitwise_equal(comb.hidden.view(), pr.combined[size_t(me)].view())));

    // STREAM, dispatch, STREAM, combine, ...: each phase paired with the STREAM operation just
    // before it (read, write, copy in turn), which also evicts the previous call's rows.
    MOED_ASSIGN_OR_RETURN(const int64_t rows, sum_ranks(w, out.num_rows()));
    Paired dt, ct;
    dt.calibration = ct.calibration = stream.calibration();
    for (int i = 0; i < iters; ++i) {
      MOED_ASSIGN_OR_RETURN(const StreamSample s1, stream.next());
      MOED_ASSIGN_OR_RETURN(const double a, time_max(w, dispatch));
      MOED_RETURN_IF_ERROR(run_experts());
      MOED_ASSIGN_OR_RETURN(const StreamSample s2, stream.next());
      MOED_ASSIGN_OR_RETURN(const double b, time_max(w, combine));
      dt.add(a, s1);
      ct.add(b, s2);
    }
    MOED_RETURN_IF_ERROR(close_figures(stream, {&dt, &ct}));
    if (me == 0) {
      figures->push_back({name, "dispatch", rows, dt, dispatch_traffic, verified, mpi_seconds,
                          dispatcher_rss});
      figures->push_back({name, "combine", rows, ct, combine_traffic, verified, 0, dispatcher_rss});
    }
    out = DispatchOutput{};
    comb = CombineOutput{};
  }
  MOED_ASSIGN_OR_RETURN(const int64_t stream_bytes,
                        sum_ranks(w, int64_t(stream.allocated_bytes())));
  if (me == 0) memory->stream = uint64_t(stream_bytes);
  return ok_status();
}

// Rows the routing sends between nodes, counted from it (docs/design.md §5.5). `flat`: what a flat
// all-to-all sends, one bf16 row per (token, destination rank on another node). Flex's two
// hops cut dispatch to one row per (token, remote node) (`dispatch`); combine (per-expert
// terms) sends one per (token, expert on a remote node) (`combine`).
struct CrossNodeRows {
  int64_t flat = 0, dispatch = 0, combine = 0;
};
CrossNodeRows cross_node_rows(const Shape& s, const std::vector<TopkRouting>& topk, int ranks,
                              int ranks_per_node) {
  const int L = s.num_experts / ranks;
  CrossNodeRows n;
  std::vector<int> dests, nodes;
  for (int src = 0; src < ranks; ++src) {
    const TopkRouting& r = topk[size_t(src)];
    for (int64_t t = 0; t < r.num_tokens; ++t) {
      dests.clear();
      nodes.clear();
      for (int k = 0; k < r.num_topk; ++k) {
        const int e = r.topk_idx[size_t(t * r.num_topk + k)];
        if (e < 0 || (e / L) / ranks_per_node == src / ranks_per_node) continue;
        dests.push_back(e / L);
        nodes.push_back((e / L) / ranks_per_node);
        ++n.combine;
      }
      std::sort(dests.begin(), dests.end());
      n.flat += std::unique(dests.begin(), dests.end()) - dests.begin();
      std::sort(nodes.begin(), nodes.end());
      n.dispatch += std::unique(nodes.begin(), nodes.end()) - nodes.begin();
    }
  }
  return n;
}

void run(const Args& a) {
  StatusOr<WorldShape> ws = world_shape(a.shape, a.world, a.ranks);
  if (!ws.ok()) fail("dispatch", ws.status());
  const int ranks = ws->ranks;
  if (a.tokens > 0) ws->shape.num_tokens = a.tokens;
  const Shape& s = ws->shape;
  std::vector<DispatcherKind> kinds;
  std::stringstream list(a.dispatchers);
  for (std::string name; std::getline(list, name, ',');) {
    StatusOr<DispatcherKind> k = parse_dispatcher_kind(name);
    if (!k.ok()) fail("dispatch", k.status());
    kinds.push_back(*k);
  }
  WorldOptions opts;
  opts.ranks_per_node = a.ranks_per_node;
  const int threads_per_rank = std::max(1, host_threads() / ranks);
  opts.threads_per_rank = threads_per_rank;
  std::vector<Figure> figures;
  int my_rank = 0;
  // The world's G: the argument, or under MPI the ranks of one host (real hosts are nodes).
  int g = a.ranks_per_node == 0 ? ranks : a.ranks_per_node;
  int64_t flat_bytes = 0;
  Memory memory;
  CrossNodeRows net_rows;
  TrafficModel dispatch_traffic, combine_traffic;  // the limit's models
  {
    StatusOr<Problem> pr = make_problem(s, ranks);
    if (!pr.ok()) fail("dispatch", pr.status());
    for (int r = 0; r < ranks; ++r) {
      memory.inputs += pr->x[size_t(r)].bytes() +
                       pr->topk[size_t(r)].topk_idx.size() * (sizeof(int32_t) + sizeof(float));
      memory.reference +=
          pr->dispatched[size_t(r)].expert_input.x.bytes() + pr->combined[size_t(r)].bytes();
    }
    Status st = run_in_world(
        a.world, ranks, opts, a.json,
        [&](World& w) {
          if (w.rank() == 0) g = w.ranks_per_node();
          return run_rank(w, s, kinds, a.iters, *pr, &figures, &memory);
        },
        &my_rank);
    if (!st.ok()) fail("dispatch", st);
    const double row_bytes = double(s.hidden) * 2;
    dispatch_traffic = dispatch_model(pr->topk, s.num_experts, ranks, g, row_bytes, row_bytes);
    combine_traffic = combine_model(pr->topk, s.num_experts, ranks, g, row_bytes, false);
    if (g < ranks) {
      net_rows = cross_node_rows(s, pr->topk, ranks, g);
      flat_bytes = net_rows.flat * int64_t(s.hidden) * 2;
    }
  }
  if (my_rank != 0) return;

  // The same total threads as the ranks' pools together.
  const int threads = threads_per_rank * ranks;
  const uint64_t peak = peak_rss_bytes();
  Report report(a);
  for (size_t i = 0; i < figures.size(); ++i) {
    const Figure& f = figures[i];
    nlohmann::json fields =
        bf16_phase_fields(f.dispatcher, f.phase, f.rows, s.hidden, f.traffic, f.verified);
    fields["peak_rss_bytes"] = peak;
    fields["memory"] = {{"inputs_bytes", memory.inputs},
                        {"reference_bytes", memory.reference},
                        {"stream_bytes", memory.stream},
                        {"dispatcher_rss_bytes", f.dispatcher_rss_bytes}};
    nlohmann::json rec =
        world_record("dispatch", s, a.world, ranks, g, threads, a.iters, std::move(fields));
    add_limit(rec, f.times, f.phase == "dispatch" ? dispatch_traffic : combine_traffic);
    if (f.phase == "combine") {
      // Issue 14's target: combine (K rows read, one written per token) no slower than the
      // dispatch of the same rows, each iteration's pair (figures come as dispatch, combine).
      add_comparison(rec, "combine / dispatch", f.times.kernel, figures[i - 1].times.kernel, 1.0);
    }
    if (flat_bytes > 0 && f.phase == "dispatch") {
      rec["flat_network_bytes"] = flat_bytes;
      rec["network_vs_flat"] = double(f.traffic.network_bytes) / double(flat_bytes);
    }
    if (flat_bytes > 0 && f.dispatcher == "flex" && f.rows > 0) {
      const int64_t over = f.phase == "dispatch" ? net_rows.dispatch : net_rows.combine;
      rec["network_rows_counted"] = over;
    }
    add_mpi_baseline(rec, f.mpi_seconds);
    report.add(std::move(rec));
  }
  if (!a.json) {
    std::printf("memory: peak RSS %.1f MB = inputs %.1f + reference %.1f + STREAM arrays %.1f MB",
                double(peak) / 1e6, double(memory.inputs) / 1e6, double(memory.reference) / 1e6,
                double(memory.stream) / 1e6);
    for (size_t i = 0; i < figures.size(); i += 2) {
      std::printf(" + %s %.1f MB", figures[i].dispatcher.c_str(),
                  double(figures[i].dispatcher_rss_bytes) / 1e6);
    }
    std::printf(" (dispatchers: RSS growth over creation and one dispatch + combine) + the rest\n");
  }
  if (Status st = report.finish(); !st.ok()) fail("dispatch", st);
}

void setup(CLI::App& bench) {
  auto args = std::make_shared<Args>();
  CLI::App* c = bench.add_subcommand(
      "dispatch",
      "TokenDispatcher dispatch and combine (allgather, alltoall, flex) vs their limit");
  c->add_option("--dispatcher", args->dispatchers, "comma-separated: allgather,alltoall,flex")
      ->capture_default_str();
  add_world_options(*c, *args);
  c->add_option("--shape", args->shape, "tiny | mixtral | dsv3 | decode")->capture_default_str();
  c->add_option("--tokens", args->tokens, "T per rank, overriding the shape's")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  add_report_options(*c, *args);
  c->callback([args] { run(*args); });
}

}  // namespace

MOED_CLI_COMMAND("bench", setup);

}  // namespace moed::bench::dispatch_bench
