// moed run --fail-rank R --at-step S: a decode loop on the low-latency buffer in shrink mode
// (DeepEP's enable_shrink) in which rank R is lost at step S, and the others go on. Each step
// every rank dispatches its tokens, its experts scale their rows (expert e by 1 + e/16, the
// same on every run), and combine brings the results home; every live rank's output is
// compared bit for bit with the reference with the masked ranks' experts dropped (their tokens
// never sent, their terms left out: moed/low_latency.h's masking).
//
//   moed run --fail-rank 1 --at-step 4                     # rank 1 falls silent at step 4
//   moed run --fail-rank 2 --at-step 3 --fail-how raise    # rank 2 raises instead
//   mpirun -np 4 moed run --world mpi --fail-rank 1 --at-step 4
//
// A silent rank (a killed or stopped process) is masked when its peers' shrink timeout runs
// out; one that raises is masked at once, since the world tells its peers.
#include "lost_rank.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cli/registry.h"
#include "cli/world_choice.h"
#include "moed/low_latency.h"
#include "moed/reference.h"
#include "moed/routing.h"

namespace moed::cli {
namespace {

using Clock = std::chrono::steady_clock;

// One step's inputs on every rank (the same on every rank: each makes all of them).
struct StepInput {
  std::vector<Tensor> x;          // per rank [T, H] bf16
  std::vector<TopkRouting> topk;  // per rank
};

StepInput make_step(const LostRankArgs& a, int step) {
  std::mt19937_64 rng(a.seed * 1000003u + uint64_t(step));
  StepInput s;
  for (int r = 0; r < a.ranks; ++r) {
    Tensor x = Tensor::empty(DType::kBF16, a.tokens, a.hidden);
    for (int64_t t = 0; t < a.tokens; ++t) {
      for (int h = 0; h < a.hidden; ++h)
        x.row<bf16>(t)[h] = float_to_bf16(float(int(rng() % 33) - 16) / 8.0f);
    }
    TopkRouting k{a.tokens, a.topk, {}, {}};
    std::vector<int32_t> e(size_t(a.experts));
    for (int64_t t = 0; t < a.tokens; ++t) {
      for (int i = 0; i < a.experts; ++i) e[size_t(i)] = i;
      std::shuffle(e.begin(), e.end(), rng);
      for (int i = 0; i < a.topk; ++i) {
        k.topk_idx.push_back(e[size_t(i)]);
        k.topk_weights.push_back(float(1 + rng() % 63) / 64.0f);
      }
    }
    s.x.push_back(std::move(x));
    s.topk.push_back(std::move(k));
  }
  return s;
}

// Expert e's function on its rows, in place: bf16(x * (1 + e/16)).
void expert(int e, TensorView rows, int64_t n) {
  const float scale = 1.0f + float(e) / 16.0f;
  for (int64_t i = 0; i < n; ++i) {
    bf16* row = rows.row<bf16>(i);
    for (int64_t h = 0; h < rows.cols; ++h) row[h] = float_to_bf16(bf16_to_float(row[h]) * scale);
  }
}

// What every rank's combine must return with the ranks in `masked` gone.
StatusOr<std::vector<Tensor>> masked_reference(const LostRankArgs& a, const StepInput& s,
                                               const std::set<int>& masked) {
  const int L = a.experts / a.ranks;
  ReferenceProblem p;
  p.num_experts = a.experts;
  p.ep_size = a.ranks;
  p.weighted_combine = true;
  p.num_topk = a.topk;
  std::vector<Tensor> none;
  for (int r = 0; r < a.ranks; ++r) {
    TopkRouting k = s.topk[size_t(r)];
    if (masked.count(r)) k = TopkRouting{0, a.topk, {}, {}};
    for (int32_t& e : k.topk_idx) {
      if (masked.count(e / L)) e = -1;
    }
    p.routing.push_back(to_map(k, a.experts));
    if (masked.count(r)) none.push_back(Tensor::empty(DType::kBF16, 0, a.hidden));
    p.hidden.push_back(TokenRows{masked.count(r) ? none.back().view() : s.x[size_t(r)].view(), {}});
  }
  MOED_ASSIGN_OR_RETURN(std::vector<ReferenceRankDispatch> d, reference_dispatch(p));
  std::vector<Tensor> ys;
  std::vector<TensorView> yv;
  for (int r = 0; r < a.ranks; ++r) {
    const ReferenceRankDispatch& rd = d[size_t(r)];
    ys.push_back(Tensor::copy_of(rd.expert_input.x.view()));
    int64_t row = 0;
    for (int j = 0; j < L; ++j) {
      const int64_t n = rd.tokens_per_expert[size_t(j)];
      expert(r * L + j, ys.back().view().slice_rows(row, n), n);
      row += n;
    }
    yv.push_back(ys.back().view());
  }
  return reference_combine(p, yv);
}

// What rank 0 learns of each step, for the report.
struct StepReport {
  double end_s = 0;       // since the start, on rank 0
  double ms = 0;          // rank 0's dispatch + experts + combine
  std::string masked;     // rank 0's mask, "-" when none
  int bitwise_ranks = 0;  // live ranks whose output matched
  int live_ranks = 0;
};

[[noreturn]] void fail(const Status& s) { fail_command("moed run", s.to_string()); }

void check_args(const LostRankArgs& a) {
  if (a.experts % a.ranks != 0)
    fail(
        invalid_argument("--experts ", a.experts, " is not a multiple of the ", a.ranks, " ranks"));
  if (a.fail_rank < 0 || a.fail_rank >= a.ranks)
    fail(invalid_argument("--fail-rank ", a.fail_rank, " is not a rank of ", a.ranks));
  if (a.at_step < 0 || a.at_step >= a.steps)
    fail(invalid_argument("--at-step ", a.at_step, " is not a step of ", a.steps));
  if (a.fail_rank == 0) fail(invalid_argument("--fail-rank 0: rank 0 reports; lose another"));
  if (a.topk > a.experts) fail(invalid_argument("--topk ", a.topk, " > --experts ", a.experts));
}

// Rank 0's table of the steps; false when a live rank's output differed.
bool print_report(const LostRankArgs& a, const std::vector<StepReport>& report,
                  const std::string& lost, double fail_s) {
  // NOTE: under MPI each process counts its own rank only: rank 0 prints its own verdicts, and
  // another rank's differing output is run_lost_rank's error.
  const bool threads = a.world == "threads";
  std::printf(
      "moed run: low-latency decode loop in shrink mode, %d ranks, %d experts, top-%d, "
      "%lld tokens x %d hidden per rank, shrink timeout %.1f s\n",
      a.ranks, a.experts, a.topk, static_cast<long long>(a.tokens), a.hidden, a.shrink_timeout_s);
  std::printf("%s (%s)\n\n", lost.c_str(), a.fail_how.c_str());
  std::printf("%5s  %9s  %9s  %7s  %s\n", "step", "done at s", "step ms", "masked",
              threads ? "bitwise (live ranks)" : "bitwise (rank 0)");
  bool pass = true;
  std::vector<double> before, after;
  double first_after = -1;
  for (int i = 0; i < a.steps; ++i) {
    const StepReport& r = report[size_t(i)];
    const int want = threads ? (i < a.at_step ? a.ranks : a.ranks - 1) : 1;
    const bool ok = r.bitwise_ranks == want && r.live_ranks == want;
    pass = pass && ok;
    std::printf("%5d  %9.3f  %9.2f  %7s  %d / %d%s\n", i, r.end_s, r.ms, r.masked.c_str(),
                r.bitwise_ranks, want, ok ? "" : "  DIFFERS");
    if (i < a.at_step) before.push_back(r.ms);
    if (i > a.at_step) after.push_back(r.ms);
    if (i == a.at_step) first_after = r.end_s;
  }
  // The moment of the loss: the lost rank's own clock (threads); under MPI, rank 0's end of
  // the step before.
  if (!threads || fail_s < 0) fail_s = a.at_step > 0 ? report[size_t(a.at_step - 1)].end_s : 0;
  auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::nth_element(v.begin(), v.begin() + long(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  std::printf(
      "\nfirst step without rank %d done %.3f s after it was lost; median step %.2f ms "
      "before, %.2f ms after\n",
      a.fail_rank, first_after - fail_s, median(before), median(after));
  std::printf("verify: %s\n", pass ? "every live rank's output of every step is bitwise equal "
                                     "to the reference with the lost rank's experts masked"
                                   : "FAILED");
  std::fflush(stdout);
  return pass;
}

}  // namespace

void run_lost_rank(const LostRankArgs& a) {
  check_args(a);
  std::vector<StepInput> steps;
  std::vector<std::vector<Tensor>> full, masked;
  for (int i = 0; i < a.steps; ++i) {
    steps.push_back(make_step(a, i));
    auto f = masked_reference(a, steps.back(), {});
    auto m = masked_reference(a, steps.back(), {a.fail_rank});
    if (!f.ok()) fail(f.status());
    if (!m.ok()) fail(m.status());
    full.push_back(std::move(*f));
    masked.push_back(std::move(*m));
  }

  std::mutex mu;
  std::vector<StepReport> report(size_t(a.steps));
  double fail_s = -1;
  const std::string lost = "rank " + std::to_string(a.fail_rank) + " is lost at step " +
                           std::to_string(a.at_step) + " (--fail-rank)";
  const Clock::time_point start = Clock::now();
  auto since = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };

  auto body = [&](World& w) -> Status {
    const LowLatencyOptions opts{
        .enable_shrink = true,
        .shrink_timeout = std::chrono::milliseconds(int64_t(a.shrink_timeout_s * 1e3))};
    MOED_ASSIGN_OR_RETURN(auto buf,
                          LowLatencyBuffer::create(w, a.tokens, a.hidden, a.experts, opts));
    const int me = w.rank(), L = a.experts / a.ranks;
    int first_differing = -1;  // reported after the loop, so the others' steps still run
    for (int i = 0; i < a.steps; ++i) {
      if (me == a.fail_rank && i == a.at_step) {
        {
          std::lock_guard<std::mutex> lock(mu);
          fail_s = since();
        }
        if (a.fail_how == "silent") return ok_status();  // as a killed process: no more calls
        Status reason = aborted(lost);
        w.abort(reason);
        return reason;
      }
      const StepInput& s = steps[size_t(i)];
      const Clock::time_point t0 = Clock::now();
      MOED_ASSIGN_OR_RETURN(LowLatencyDispatchOutput d,
                            buf->low_latency_dispatch({.x = s.x[size_t(me)].view(),
                                                       .topk = TopkView::of(s.topk[size_t(me)])}));
      Tensor y = Tensor::copy_of(d.recv.x);
      for (int j = 0; j < L; ++j) {
        expert(me * L + j, y.view().slice_rows(j * d.rows_per_expert, d.rows_per_expert),
               d.recv_count[size_t(j)]);
      }
      MOED_ASSIGN_OR_RETURN(
          LowLatencyCombineOutput o,
          buf->low_latency_combine(
              {.x = y.view(), .topk = TopkView::of(s.topk[size_t(me)]), .handle = d.handle}));
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      std::vector<int32_t> mask = buf->query_mask();
      const bool gone = mask[size_t(a.fail_rank)] != 0;
      const bool same =
          bitwise_equal(o.result(), (gone ? masked : full)[size_t(i)][size_t(me)].view());
      if (!same && first_differing < 0) first_differing = i;
      std::lock_guard<std::mutex> lock(mu);
      StepReport& rep = report[size_t(i)];
      rep.live_ranks += 1;
      rep.bitwise_ranks += same ? 1 : 0;
      if (me == 0) {
        rep.end_s = since();
        rep.ms = ms;
        rep.masked.clear();
        for (int r = 0; r < a.ranks; ++r) {
          if (mask[size_t(r)] != 0)
            rep.masked += (rep.masked.empty() ? "" : ",") + std::to_string(r);
        }
        if (rep.masked.empty()) rep.masked = "-";
      }
    }
    if (first_differing >= 0) {
      return internal_error("rank ", me, ", step ", first_differing,
                            ": the combined output differs from the masked reference");
    }
    return ok_status();
  };
  WorldOptions opts;
  opts.ranks_per_node = a.ranks_per_node;
  int my_rank = 0;
  Status s = run_in_world(a.world, a.ranks, opts, body, &my_rank);
  // The lost rank's own error is the expected end of its part; anything else is a failure.
  if (!s.ok() && s.message().find(lost) == std::string::npos) fail(s);
  if (my_rank != 0) return;

  if (!print_report(a, report, lost, fail_s)) throw CLI::RuntimeError(2);
}

}  // namespace moed::cli
