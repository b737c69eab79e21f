// `moed bench dispatch`: the TokenDispatcher implementations (allgather, alltoall, flex) on a
// world of R ranks, dispatch and combine timed separately, beside a plain copy of the same
// bytes with the same total threads in the same run (spec §7).
//
//   moed bench dispatch --dispatcher allgather,alltoall --world threads --ranks 4 --shape mixtral
//
// Each rank holds the shape's T tokens (bf16) with uniform random top-k routing from a fixed
// seed. A figure's time is the median over iterations of the slowest rank's time; bytes =
// aggregate received rows * H * 2 (dispatch) and the same rows sent back (combine). The expert
// outputs fed to combine are the dispatched rows. Every dispatcher's output is checked against
// the reference (moed/reference.h) bit for bit in the same run (`verified`). network_bytes and
// shared_bytes are the world's counters for one iteration, summed over ranks.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include "bench/common.h"
#include "moed/dispatcher.h"
#include "moed/reference.h"
#include "moed/threads_world.h"
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
};

// What the ranks of the threads world share for the in-run check against the reference: each
// rank fills its own slot; rank 0 compares everybody's after a barrier.
struct Shared {
  std::vector<Tensor> x;
  std::vector<TopkRouting> topk;
  std::vector<DispatchOutput> dispatched;
  std::vector<Tensor> combined;
  std::vector<Figure> figures;
  bool verified = false;
};

bool check_against_reference(const Shape& s, int R, Shared& sh) {
  ReferenceProblem p;
  p.num_experts = s.num_experts;
  p.ep_size = R;
  p.num_topk = s.num_topk;
  for (int r = 0; r < R; ++r) {
    p.routing.push_back(to_map(sh.topk[size_t(r)], s.num_experts));
    p.hidden.push_back(TokenRows{sh.x[size_t(r)].view(), {}});
  }
  bool ok = true;
  {
    StatusOr<std::vector<ReferenceRankDispatch>> ref = reference_dispatch(p);
    if (!ref.ok()) return false;
    for (int r = 0; r < R; ++r) {
      const DispatchOutput& d = sh.dispatched[size_t(r)];
      const ReferenceRankDispatch& want = (*ref)[size_t(r)];
      ok = ok && bitwise_equal(d.expert_input.x, want.expert_input.x.view()) &&
           std::equal(d.permuted_probs.begin(), d.permuted_probs.end(), want.permuted_probs.begin(),
                      want.permuted_probs.end()) &&
           std::equal(d.tokens_per_expert.begin(), d.tokens_per_expert.end(),
                      want.tokens_per_expert.begin(), want.tokens_per_expert.end()) &&
           d.handle->row_src_token == want.row_src_token;
    }
  }
  std::vector<TensorView> y;
  for (int r = 0; r < R; ++r) y.push_back(sh.dispatched[size_t(r)].expert_input.x);
  StatusOr<std::vector<Tensor>> out = reference_combine(p, y);
  if (!out.ok()) return false;
  for (int r = 0; r < R; ++r) {
    ok = ok && bitwise_equal(sh.combined[size_t(r)].view(), (*out)[size_t(r)].view());
  }
  return ok;
}

Status run_rank(World& w, const Shape& s, const std::vector<DispatcherKind>& kinds, int iters,
                Shared& sh) {
  const int me = w.rank(), R = w.size();
  sh.x[size_t(me)] = make_tokens(s.num_tokens, s.hidden, 1u + uint32_t(me));
  sh.topk[size_t(me)] = make_topk(s, me);
  const Tensor& x = sh.x[size_t(me)];
  const TopkRouting& topk = sh.topk[size_t(me)];
  for (DispatcherKind kind : kinds) {
    DispatchConfig config;
    config.kind = kind;
    config.num_experts = s.num_experts;
    MOED_ASSIGN_OR_RETURN(std::unique_ptr<TokenDispatcher> d, TokenDispatcher::create(w, config));
    DispatchInput in;
    in.hidden = TokenRows{x.view(), {}};
    in.topk = &topk;
    DispatchOutput out;
    CombineOutput comb;
    auto dispatch = [&]() -> Status {
      MOED_ASSIGN_OR_RETURN(out, d->dispatch(in));
      return ok_status();
    };
    auto combine = [&]() -> Status {
      MOED_ASSIGN_OR_RETURN(comb, d->combine(CombineInput{out.expert_input, out.handle}));
      return ok_status();
    };
    // One iteration's traffic, from the world's counters.
    w.reset_counters();
    MOED_RETURN_IF_ERROR(dispatch());
    const TrafficCounters dc = w.counters();
    w.reset_counters();
    MOED_RETURN_IF_ERROR(combine());
    const TrafficCounters cc = w.counters();

    sh.dispatched[size_t(me)] = out;
    sh.combined[size_t(me)] = std::move(comb.hidden);
    MOED_RETURN_IF_ERROR(w.barrier());
    if (me == 0) sh.verified = check_against_reference(s, R, sh);
    MOED_RETURN_IF_ERROR(w.barrier());
    sh.dispatched[size_t(me)] = DispatchOutput{};
    sh.combined[size_t(me)] = Tensor();

    std::vector<double> dt, ct;
    for (int i = 0; i < iters; ++i) {
      MOED_ASSIGN_OR_RETURN(double a, time_max(w, dispatch));
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
      sh.figures.push_back({name, "dispatch", rows, median(dt), dnet, dshm, sh.verified});
      sh.figures.push_back({name, "combine", rows, median(ct), cnet, cshm, sh.verified});
    }
    out = DispatchOutput{};
    comb = CombineOutput{};
  }
  return ok_status();
}

void run(const Args& a) {
  StatusOr<Shape> found = find_shape(a.shape);
  if (!found.ok()) fail(found.status());
  Shape s = *found;
  s.num_experts = experts_for_ranks(s.num_experts, a.ranks);
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
  if (a.world != "threads") {
    // NOTE: the MPI world's public entry point (moed/mpi_world.h) is not in the tree yet, and
    // the in-run reference check reads the other ranks' outputs through the process.
    fail(unimplemented("--world ", a.world, ": only the threads world can run this bench so far"));
  }
  WorldOptions opts;
  opts.ranks_per_node = a.ranks_per_node;
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  const int threads_per_rank = std::max(1, cores / a.ranks);
  opts.threads_per_rank = threads_per_rank;
  Shared sh;
  sh.x.resize(size_t(a.ranks));
  sh.topk.resize(size_t(a.ranks));
  sh.dispatched.resize(size_t(a.ranks));
  sh.combined.resize(size_t(a.ranks));
  Status st =
      run_threads(a.ranks, opts, [&](World& w) { return run_rank(w, s, kinds, a.iters, sh); });
  if (!st.ok()) fail(st);
  sh.x.clear();
  sh.topk.clear();

  // The same total threads as the ranks' pools together.
  const int threads = threads_per_rank * a.ranks;
  Report report(a.json);
  for (const Figure& f : sh.figures) {
    const size_t bytes = size_t(f.rows) * size_t(s.hidden) * 2;
    report.add({{"suite", "dispatch"},
                {"shape", s.name},
                {"dispatcher", f.dispatcher},
                {"phase", f.phase},
                {"world", a.world},
                {"ranks", a.ranks},
                {"ranks_per_node", a.ranks_per_node == 0 ? a.ranks : a.ranks_per_node},
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
                {"verified", f.verified}});
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
