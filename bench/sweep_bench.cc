// moed bench (no subcommand): the one sweep, nccl-tests style. Every dispatcher x world x
// rank count x shape, dispatch and combine timed separately (low-latency too), each verified
// bit for bit against moed's reference and printed against its physical limit (bench/limit.h:
// the bytes it must move over STREAM bandwidths measured in the same run), then a one-screen
// summary.
//
//   moed bench                                  # threads world, ranks 2 and 4, tiny and mixtral
//   moed bench --shapes tiny,dsv3 --ranks 2,4,8 --dispatchers flex,low-latency --json
//   mpirun -np 4 moed bench                     # the MPI world, 4 ranks
//
// A multi-rank time is the slowest rank's, per iteration (every rank starts after a barrier);
// figures are medians over iterations. Bandwidth is aggregate: rows received over all ranks
// times the bf16 row bytes, divided by the time (DeepEP's count; combine sends the same rows
// back). Combine's expert outputs are the dispatched rows themselves. A STREAM operation runs
// before each kernel iteration (bench/limit.h: fraction_of_limit, its spread, `noisy`).
#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>

#include "bench/common.h"
#include "cli/registry.h"
#include "moed/dispatcher.h"
#include "moed/low_latency.h"
#include "moed/reference.h"

namespace moed::bench::sweep_bench {
namespace {

struct SweepArgs : ReportArgs {
  SweepArgs() : ReportArgs(5) {}
  std::vector<std::string> shapes = {"tiny", "mixtral"};
  std::vector<int> ranks = {2, 4};
  std::vector<std::string> dispatchers = {"allgather", "alltoall", "flex", "low-latency"};
  std::string world;  // "" = mpi under mpirun, else threads
  int ranks_per_node = 0;
};

constexpr double kLowLatencyBudgetBytes = 2e9;

// One rank's input: bf16 rows, K distinct experts per token, random probs (seeded by rank).
struct RankInput {
  Tensor x;
  TopkRouting topk;
  RoutingMap map;
};

RankInput make_input(const Shape& s, int rank) {
  RankInput in;
  std::mt19937 rng(977u + uint32_t(rank));  // the tokens, then the routing
  in.x = random_tokens(s.num_tokens, s.hidden, 1.0f, rng);
  in.topk = random_topk(s, 0.05f, rng);
  in.map = to_map(in.topk, s.num_experts);
  return in;
}

struct Figure {
  std::string dispatcher, phase;
  Paired times;  // the kernel's, each with the STREAM sample taken before it
  int64_t rows = 0;
  Traffic traffic;
  bool verified = false;
};

struct Ref {
  std::vector<ReferenceRankDispatch> dispatch;
  std::vector<Tensor> combine;           // unweighted (normal dispatchers)
  std::vector<Tensor> weighted_combine;  // low-latency's combine weighs by the probs
};

StatusOr<Ref> make_reference(const Shape& s, int R, const std::vector<RankInput>& in) {
  ReferenceProblem p;
  p.num_experts = s.num_experts;
  p.ep_size = R;
  p.num_topk = s.num_topk;
  for (const RankInput& r : in) {
    p.routing.push_back(r.map);
    p.hidden.push_back(TokenRows{r.x.view(), {}});
  }
  Ref ref;
  MOED_ASSIGN_OR_RETURN(ref.dispatch, reference_dispatch(p));
  std::vector<TensorView> y;
  for (const auto& d : ref.dispatch) y.push_back(d.expert_input.x.view());
  MOED_ASSIGN_OR_RETURN(ref.combine, reference_combine(p, y));
  p.weighted_combine = true;
  MOED_ASSIGN_OR_RETURN(ref.weighted_combine, reference_combine(p, y));
  return ref;
}

// One call counting its traffic (which is also the warm-up), then iters pairs of a STREAM
// operation and the call, each timed over the ranks; rows: my_rows() after the first call,
// summed over ranks.
struct Timed {
  Paired times;
  Traffic traffic;
  int64_t rows = 0;
};
StatusOr<Timed> measure(World& w, int iters, Stream& stream, const std::function<Status()>& fn,
                        const std::function<int64_t()>& my_rows) {
  Timed r;
  MOED_ASSIGN_OR_RETURN(r.traffic, traffic_of(w, fn));
  MOED_ASSIGN_OR_RETURN(r.rows, sum_ranks(w, my_rows()));
  MOED_ASSIGN_OR_RETURN(r.times, paired_time_max(w, iters, stream, fn, /*warmup=*/0));
  return r;
}

Status run_normal(World& w, DispatcherKind kind, const Shape& s, const RankInput& in,
                  const Ref& ref, int iters, Stream& stream, std::vector<Figure>* out) {
  DispatchConfig config;
  config.kind = kind;
  config.num_experts = s.num_experts;
  MOED_ASSIGN_OR_RETURN(std::unique_ptr<TokenDispatcher> d, TokenDispatcher::create(w, config));
  DispatchOutput dd;
  auto dispatch = [&]() -> Status {
    MOED_ASSIGN_OR_RETURN(dd, d->dispatch({.hidden = TokenRows{in.x.view(), {}},
                                           .topk = TopkView::of(in.topk),
                                           .cached_handle = nullptr}));
    return ok_status();
  };
  MOED_ASSIGN_OR_RETURN(Timed td,
                        measure(w, iters, stream, dispatch, [&] { return dd.num_rows(); }));
  const ReferenceRankDispatch& rd = ref.dispatch[size_t(w.rank())];
  bool ok = bitwise_equal(dd.expert_input.x, rd.expert_input.x.view()) &&
            std::equal(dd.tokens_per_expert.begin(), dd.tokens_per_expert.end(),
                       rd.tokens_per_expert.begin(), rd.tokens_per_expert.end()) &&
            std::equal(dd.permuted_probs.begin(), dd.permuted_probs.end(),
                       rd.permuted_probs.begin(), rd.permuted_probs.end());
  MOED_ASSIGN_OR_RETURN(const bool dispatch_ok, all_ranks_ok(w, ok));
  CombineOutput cc;
  auto combine = [&]() -> Status {
    MOED_ASSIGN_OR_RETURN(cc, d->combine({.expert_output = dd.expert_input, .handle = dd.handle}));
    return ok_status();
  };
  // Combine sends the dispatched rows back: the same bytes.
  MOED_ASSIGN_OR_RETURN(Timed tc,
                        measure(w, iters, stream, combine, [&] { return dd.num_rows(); }));
  MOED_ASSIGN_OR_RETURN(const bool combine_ok,
                        all_ranks_ok(w, bitwise_equal(cc.hidden, ref.combine[size_t(w.rank())])));
  if (w.rank() == 0) {
    const char* name = dispatcher_kind_name(kind);
    out->push_back({name, "dispatch", td.times, td.rows, td.traffic, dispatch_ok});
    out->push_back({name, "combine", tc.times, tc.rows, tc.traffic, combine_ok});
  }
  return ok_status();
}

Status run_low_latency(World& w, const Shape& s, const RankInput& in, const Ref& ref, int iters,
                       Stream& stream, std::vector<Figure>* out) {
  MOED_ASSIGN_OR_RETURN(auto buffer,
                        LowLatencyBuffer::create(w, s.num_tokens, s.hidden, s.num_experts));
  LowLatencyDispatchOutput d;
  auto dispatch = [&]() -> Status {
    MOED_ASSIGN_OR_RETURN(
        d, buffer->low_latency_dispatch({.x = in.x.view(), .topk = TopkView::of(in.topk)}));
    return ok_status();
  };
  auto received = [&] {
    int64_t n = 0;
    for (int32_t c : d.recv_count) n += c;
    return n;
  };
  MOED_ASSIGN_OR_RETURN(Timed td, measure(w, iters, stream, dispatch, received));
  // Expert j's received rows against the reference segment j.
  const ReferenceRankDispatch& rd = ref.dispatch[size_t(w.rank())];
  bool ok = true;
  int64_t row = 0;
  for (int j = 0; j < d.num_local_experts; ++j) {
    const int64_t n = d.recv_count[size_t(j)];
    ok = ok && n == rd.tokens_per_expert[size_t(j)] &&
         bitwise_equal(d.recv.x.slice_rows(j * d.rows_per_expert, n),
                       rd.expert_input.x.view().slice_rows(row, n));
    row += n;
  }
  MOED_ASSIGN_OR_RETURN(const bool dispatch_ok, all_ranks_ok(w, ok));
  Tensor y = Tensor::copy_of(d.recv.x);
  std::shared_ptr<const LowLatencyHandle> handle = d.handle;
  LowLatencyCombineOutput c;
  auto combine = [&]() -> Status {
    MOED_ASSIGN_OR_RETURN(c, buffer->low_latency_combine(
                                 {.x = y.view(), .topk = TopkView::of(in.topk), .handle = handle}));
    return ok_status();
  };
  MOED_ASSIGN_OR_RETURN(Timed tc, measure(w, iters, stream, combine, received));
  MOED_ASSIGN_OR_RETURN(
      const bool combine_ok,
      all_ranks_ok(w, bitwise_equal(c.combined_x, ref.weighted_combine[size_t(w.rank())])));
  if (w.rank() == 0) {
    out->push_back({"low_latency", "dispatch", td.times, td.rows, td.traffic, dispatch_ok});
    out->push_back({"low_latency", "combine", tc.times, tc.rows, tc.traffic, combine_ok});
  }
  return ok_status();
}

struct SummaryRow {
  std::string world, shape, dispatcher;
  int ranks = 0;
  double dispatch_gbps = 0, combine_gbps = 0, stream_copy_gbps = 0;  // STREAM: dispatch's
  double dispatch_fraction = 0, combine_fraction = 0;  // of the limit
  double dispatch_us = 0, combine_us = 0;
  bool noisy = false;  // either phase's per-iteration fractions spread wider than kNoisySpread
  bool verified = true;
};

// Adds one (shape, R) point's figures to the report; its summary rows, one per dispatcher.
std::map<std::string, SummaryRow> report_point(Report& report, const std::vector<Figure>& figures,
                                               const Shape& s, const std::string& world, int R,
                                               const SweepArgs& a, int pool_threads,
                                               const std::vector<RankInput>& inputs) {
  std::vector<TopkRouting> topk;
  for (const RankInput& in : inputs) topk.push_back(in.topk);
  const int G = a.ranks_per_node > 0 ? a.ranks_per_node : R;
  const double row = double(s.hidden) * 2;
  std::map<std::string, SummaryRow> rows;
  for (const Figure& f : figures) {
    nlohmann::json rec = world_record(
        "sweep", s, world, R, a.ranks_per_node, pool_threads, a.iters,
        bf16_phase_fields(f.dispatcher, f.phase, f.rows, s.hidden, f.traffic, f.verified));
    // Low-latency's combine always weighs by the probs.
    add_limit(rec, f.times,
              f.phase == "dispatch"
                  ? dispatch_model(topk, s.num_experts, R, G, row, row)
                  : combine_model(topk, s.num_experts, R, G, row, f.dispatcher == "low_latency"));
    const double seconds = rec["seconds"].get<double>();
    const double copy = rec["stream_copy_gbps"].get<double>();
    const double fraction = rec["fraction_of_limit"].get<double>();
    rec["microseconds"] = seconds * 1e6;
    const bool noisy = rec["noisy"].get<bool>();
    const double rec_bytes = rec["bytes"].get<double>();
    report.add(std::move(rec));
    SummaryRow& row = rows[f.dispatcher];
    row.world = world;
    row.shape = s.name;
    row.dispatcher = f.dispatcher;
    row.ranks = R;
    const double gbps = seconds > 0 ? rec_bytes / seconds / 1e9 : 0;
    (f.phase == "dispatch" ? row.dispatch_gbps : row.combine_gbps) = gbps;
    (f.phase == "dispatch" ? row.dispatch_us : row.combine_us) = seconds * 1e6;
    (f.phase == "dispatch" ? row.dispatch_fraction : row.combine_fraction) = fraction;
    if (f.phase == "dispatch") row.stream_copy_gbps = copy;
    row.noisy = row.noisy || noisy;
    row.verified = row.verified && f.verified;
  }
  return rows;
}

void print_summary(const std::vector<SummaryRow>& summary) {
  std::printf("\n%-8s %-8s %5s %-12s %11s %9s %6s %11s %9s %6s %9s  %s\n", "world", "shape",
              "ranks", "dispatcher", "dispatch us", "GB/s", "limit", "combine us", "GB/s", "limit",
              "copy GB/s", "check");
  for (const SummaryRow& r : summary) {
    std::printf("%-8s %-8s %5d %-12s %11.1f %9.2f %6.2f %11.1f %9.2f %6.2f %9.2f  %s%s\n",
                r.world.c_str(), r.shape.c_str(), r.ranks, r.dispatcher.c_str(), r.dispatch_us,
                r.dispatch_gbps, r.dispatch_fraction, r.combine_us, r.combine_gbps,
                r.combine_fraction, r.stream_copy_gbps, r.verified ? "verified" : "MISMATCH",
                r.noisy ? " NOISY" : "");
  }
  std::printf(
      "(aggregate GB/s = rows received over all ranks x H x 2 bytes / slowest rank's "
      "median time; limit = fraction of the physical limit: the bytes the call must move over "
      "the STREAM bandwidths measured beside it (copy GB/s: STREAM copy, bytes read + written); "
      "NOISY = the per-iteration fractions spread over %.0f%% of their median)\n",
      kNoisySpread * 100);
}

void sweep(const SweepArgs& a) {
  const std::string world = a.world.empty() ? (launched_by_mpirun() ? "mpi" : "threads") : a.world;
  std::vector<int> ranks_list = a.ranks;
  if (world == "mpi") {
    StatusOr<int> n = mpi_world_size();
    if (!n.ok()) fail("", n.status());
    ranks_list = {*n};
  }
  // A TokenDispatcher's kind, or none: the low-latency buffer (moed/low_latency.h).
  std::vector<std::optional<DispatcherKind>> kinds;
  for (const std::string& name : a.dispatchers) {
    if (name == "low-latency" || name == "low_latency") {
      kinds.push_back(std::nullopt);
      continue;
    }
    StatusOr<DispatcherKind> k = parse_dispatcher_kind(name);
    if (!k.ok()) fail("", k.status());
    kinds.push_back(*k);
  }
  std::vector<Shape> shapes;
  for (const std::string& name : a.shapes) {
    StatusOr<Shape> sh = find_shape(name);
    if (!sh.ok()) fail("", sh.status());
    shapes.push_back(*sh);
  }
  Report report(a);
  std::vector<SummaryRow> summary;
  int my_rank = 0;
  for (const Shape& base : shapes) {
    for (int R : ranks_list) {
      Shape s = base;
      s.num_experts = experts_for_ranks(base.num_experts, R);
      if (a.ranks_per_node > 0 && R % a.ranks_per_node != 0) {
        fail("",
             invalid_argument("--ranks-per-node ", a.ranks_per_node, " does not divide ranks ", R));
      }
      std::vector<RankInput> inputs;
      for (int r = 0; r < R; ++r) inputs.push_back(make_input(s, r));
      StatusOr<Ref> ref = make_reference(s, R, inputs);
      if (!ref.ok()) fail("", ref.status());
      // NOTE: low-latency slots are sized for every expert's worst case ([E][T] rows, twice),
      // which is meant for decode batches; at prefill shapes they would not fit in memory.
      const double ll_bytes =
          double(get_low_latency_size_hint(s.num_tokens, s.hidden, R, s.num_experts)) * R;
      const bool ll_fits = ll_bytes <= kLowLatencyBudgetBytes;
      std::vector<Figure> figures;
      int pool_threads = 0;  // the ranks' pools together (STREAM runs on them too)
      WorldOptions opts;
      opts.ranks_per_node = a.ranks_per_node;
      Status st = run_in_world(
          world, R, opts, a.json,
          [&](World& w) -> Status {
            if (w.rank() == 0) pool_threads = w.pool().num_threads() * w.size();
            Stream stream(w);  // this rank's share of the STREAM arrays
            for (const std::optional<DispatcherKind>& k : kinds) {
              if (!k) {
                if (!ll_fits) continue;
                MOED_RETURN_IF_ERROR(run_low_latency(w, s, inputs[size_t(w.rank())], *ref,
                                                     a.iters, stream, &figures));
              } else {
                MOED_RETURN_IF_ERROR(run_normal(w, *k, s, inputs[size_t(w.rank())], *ref, a.iters,
                                                stream, &figures));
              }
            }
            return ok_status();
          },
          &my_rank);
      if (!st.ok()) fail("", st);
      if (my_rank != 0) continue;
      std::map<std::string, SummaryRow> rows =
          report_point(report, figures, s, world, R, a, pool_threads, inputs);
      for (const std::optional<DispatcherKind>& k : kinds) {
        if (!k && !ll_fits) {
          std::fprintf(stderr,
                       "moed bench: low-latency skipped at %s R=%d (buffers %.1f GB > %.1f GB)\n",
                       s.name.c_str(), R, ll_bytes / 1e9, kLowLatencyBudgetBytes / 1e9);
          continue;
        }
        summary.push_back(rows[k ? dispatcher_kind_name(*k) : "low_latency"]);
      }
    }
  }
  if (my_rank != 0) return;
  if (Status st = report.finish(); !st.ok()) fail("", st);
  bool all_ok = true;
  for (const SummaryRow& r : summary) all_ok = all_ok && r.verified;
  if (!a.json) print_summary(summary);
  if (!all_ok) {
    std::fprintf(stderr, "moed bench: some results differ from the reference (see MISMATCH)\n");
    throw CLI::RuntimeError(2);
  }
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

void setup(CLI::App& bench) {
  auto a = std::make_shared<SweepArgs>();
  auto shapes = std::make_shared<std::string>("tiny,mixtral");
  auto dispatchers = std::make_shared<std::string>("allgather,alltoall,flex,low-latency");
  // NOTE: `moed bench` alone runs the sweep; `moed bench <command>` runs that command only.
  bench.require_subcommand(0, 1);
  bench.add_option("--shapes", *shapes, "comma-separated shapes: tiny, mixtral, dsv3, decode")
      ->capture_default_str();
  bench.add_option("--ranks", a->ranks, "rank counts (threads world), e.g. --ranks 2,4,8")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  bench
      .add_option("--dispatchers", *dispatchers,
                  "comma-separated: allgather, alltoall, flex, low-latency")
      ->capture_default_str();
  bench.add_option("--world", a->world, "threads | mpi (default: mpi under mpirun, else threads)")
      ->check(CLI::IsMember({"threads", "mpi"}));
  bench.add_option("--ranks-per-node", a->ranks_per_node, "ranks per node G (0 = all on one)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  add_report_options(bench, *a);
  CLI::App* app = &bench;
  bench.callback([a, shapes, dispatchers, app] {
    if (!app->get_subcommands().empty()) return;  // a subcommand ran instead
    a->shapes = split(*shapes);
    a->dispatchers = split(*dispatchers);
    sweep(*a);
  });
}

}  // namespace
}  // namespace moed::bench::sweep_bench

MOED_CLI_COMMAND("bench", moed::bench::sweep_bench::setup);
