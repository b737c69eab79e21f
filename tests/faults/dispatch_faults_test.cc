// A rank that fails in the middle of a dispatch or a combine, on both worlds, for every
// dispatcher (allgather, alltoall, flex; low-latency through its buffer): at every world call
// the rank makes during dispatch + combine (FaultHook: after the count exchange, between the
// pushes, before the combine reads) and at every boundary between the six steps. Every other
// rank must return an error naming the failed rank (kAborted "rank 2 failed: ..."), within the
// world's timeout (a hang shows as kDeadlineExceeded, which fails the test), or, where it no
// longer needed the failed rank (the victim failed after its last send to it), succeed with
// exactly the clean run's output: no rank returns a half-written output as a success.
#include <gtest/gtest.h>

#include <algorithm>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "faults/fault_hook.h"
#include "moed/dispatcher.h"
#include "moed/low_latency.h"
#include "moed/routing.h"
#include "support/world_test.h"

namespace moed {
namespace {

using ::moed::testing::Backend;
using ::moed::testing::FaultHook;

constexpr int kRanks = 4;
constexpr int kVictim = 2;
constexpr int kHidden = 128;
constexpr int kExperts = 8;
const char* const kReason = "injected fault";

// Where the victim fails: at its nth world call from the start of the dispatch (call > 0), or
// by returning an error right after step `boundary` of the six (call == 0).
struct Fault {
  int call = 0;
  int boundary = -1;
  std::string name() const {
    return call > 0 ? "world call " + std::to_string(call)
                    : "after step " + std::to_string(boundary);
  }
};

// Per-rank inputs, rebuilt identically on every rank from the seed.
struct Input {
  Tensor x;
  TopkRouting topk;
};
Input make_input(int rank) {
  std::mt19937 rng(100 + rank);
  Input in;
  const int64_t T = 3 + rank * 2;
  in.x = Tensor::empty(DType::kBF16, T, kHidden);
  for (int64_t t = 0; t < T; ++t) {
    for (int h = 0; h < kHidden; ++h)
      in.x.row<bf16>(t)[h] = float_to_bf16(float(int(rng() % 9) - 4));
  }
  in.topk.num_tokens = T;
  in.topk.num_topk = 2;
  for (int64_t t = 0; t < T; ++t) {
    const int a = int(rng() % kExperts), b = (a + 1 + int(rng() % (kExperts - 1))) % kExperts;
    in.topk.topk_idx.insert(in.topk.topk_idx.end(), {a, b});
    in.topk.topk_weights.insert(in.topk.topk_weights.end(), {0.5f, 0.25f});
  }
  return in;
}

// What one rank saw; checked after run_world (the threads world fills every rank's, an MPI
// process its own).
struct Outcome {
  bool ran = false;
  Status status;
  bool fired = false;
  int calls = 0;
  Tensor output;  // the combine's output, on success
};

// The victim's failure: the boundary kind, or the fault armed in FaultHook.
Status boundary_failure(World& w, const Fault& f, int step) {
  if (w.rank() != kVictim || f.boundary != step) return ok_status();
  Status reason = internal_error(kReason, " after step ", step);
  w.abort(reason);
  return reason;
}

// Dispatch + combine through the six steps with TokenDispatcher::create(kind).
Status run_token_dispatcher(World& w, FaultHook& faults, DispatcherKind kind, const Fault& f,
                            Tensor* output) {
  DispatchConfig cfg;
  cfg.kind = kind;
  cfg.num_experts = kExperts;
  MOED_ASSIGN_OR_RETURN(std::unique_ptr<TokenDispatcher> d, TokenDispatcher::create(w, cfg));
  const Input in = make_input(w.rank());
  if (w.rank() == kVictim) faults.arm(f.call, internal_error(kReason));
  DispatchInput din;
  din.hidden = TokenRows{in.x.view(), {}};
  din.topk = TopkView::of(in.topk);
  MOED_RETURN_IF_ERROR(d->dispatch_preprocess(din));
  MOED_RETURN_IF_ERROR(boundary_failure(w, f, 0));
  MOED_ASSIGN_OR_RETURN(Request r, d->token_dispatch(false));
  if (r) MOED_RETURN_IF_ERROR(r->wait());
  MOED_RETURN_IF_ERROR(boundary_failure(w, f, 1));
  MOED_ASSIGN_OR_RETURN(DispatchOutput out, d->dispatch_postprocess());
  MOED_RETURN_IF_ERROR(boundary_failure(w, f, 2));
  // The experts: y = x (bf16 in, bf16 out).
  MOED_RETURN_IF_ERROR(
      d->combine_preprocess(CombineInput{TokenRows{out.expert_input.x, {}}, out.handle}));
  MOED_RETURN_IF_ERROR(boundary_failure(w, f, 3));
  MOED_ASSIGN_OR_RETURN(Request c, d->token_combine(false));
  if (c) MOED_RETURN_IF_ERROR(c->wait());
  MOED_RETURN_IF_ERROR(boundary_failure(w, f, 4));
  MOED_ASSIGN_OR_RETURN(CombineOutput co, d->combine_postprocess());
  if (co.hidden.rows() != in.x.rows())
    return internal_error("combine returned ", co.hidden.rows(), " rows");
  return ok_status();
}

// Low-latency dispatch + combine, both with the receive hook: boundaries are after the send
// phase (0), after the receive (1), after the combine's send phase (3).
Status run_low_latency(World& w, FaultHook& faults, const Fault& f, Tensor* output) {
  MOED_ASSIGN_OR_RETURN(std::unique_ptr<LowLatencyBuffer> buffer,
                        LowLatencyBuffer::create(w, 16, kHidden, kExperts));
  const Input in = make_input(w.rank());
  if (w.rank() == kVictim) faults.arm(f.call, internal_error(kReason));
  MOED_ASSIGN_OR_RETURN(
      LowLatencyDispatchOutput d,
      buffer->low_latency_dispatch(
          {.x = in.x.view(), .topk = TopkView::of(in.topk), .return_recv_hook = true}));
  MOED_RETURN_IF_ERROR(boundary_failure(w, f, 0));
  MOED_RETURN_IF_ERROR(d.hook->wait());
  MOED_RETURN_IF_ERROR(boundary_failure(w, f, 1));
  MOED_RETURN_IF_ERROR(boundary_failure(w, f, 2));
  MOED_ASSIGN_OR_RETURN(LowLatencyCombineOutput c,
                        buffer->low_latency_combine({.x = d.recv.x,
                                                     .topk = TopkView::of(in.topk),
                                                     .handle = d.handle,
                                                     .return_recv_hook = true}));
  MOED_RETURN_IF_ERROR(boundary_failure(w, f, 3));
  MOED_RETURN_IF_ERROR(c.hook->wait());
  MOED_RETURN_IF_ERROR(boundary_failure(w, f, 4));
  *output = std::move(c.combined_x);
  return ok_status();
}

// The name as a std::string: gtest prints it into the ctest name (a const char* would print as
// an address, which changes from build to build).
class DispatchFaults : public ::testing::TestWithParam<std::tuple<Backend, std::string, int>> {};

// Runs dispatcher `name` on kRanks ranks (nodes of G) with fault f; returns what each rank saw.
std::vector<Outcome> run_with_fault(Backend b, const std::string& name, int g, const Fault& f) {
  std::vector<Outcome> outcomes(kRanks);
  std::mutex mu;
  WorldOptions opts;
  // A bound, not a timed assertion: a rank that would wait forever returns kDeadlineExceeded,
  // which the checks below report as the hang it is.
  opts.timeout = std::chrono::seconds(20);
  Status all = testing::run_world(
      b, kRanks, g,
      [&](World& w) -> Status {
        FaultHook faults(w);
        Status s;
        Tensor output;
        if (name == "low-latency") {
          s = run_low_latency(w, faults, f, &output);
        } else {
          StatusOr<DispatcherKind> kind = parse_dispatcher_kind(name);
          s = kind.ok() ? run_token_dispatcher(w, faults, *kind, f, &output) : kind.status();
        }
        int calls = faults.calls();
        if (f.call == 0 && f.boundary < 0 && s.ok()) {
          // The clean run: every rank learns how many calls the victim made.
          s = broadcast<int>(w, std::span<int>(&calls, 1), kVictim);
        }
        std::lock_guard<std::mutex> lock(mu);
        outcomes[size_t(w.rank())] = Outcome{true, s, faults.fired(), calls, std::move(output)};
        return s;
      },
      opts);
  (void)all;  // the per-rank outcomes say more than the root cause
  return outcomes;
}

TEST_P(DispatchFaults, EveryOtherRankNamesTheFailedRank) {
  const auto [backend, name, g] = GetParam();
  // A clean run first: how many world calls the victim makes (the fault points to try).
  std::vector<Outcome> clean = run_with_fault(backend, name, g, Fault{});
  for (const Outcome& o : clean) {
    if (o.ran) {
      ASSERT_TRUE(o.status.ok()) << o.status.to_string();
    }
  }
  int calls = 0;
  for (const Outcome& o : clean) {
    if (o.ran) calls = o.calls;
  }
  ASSERT_GT(calls, 0);
  std::vector<Fault> faults;
  for (int step = 0; step < 5; ++step) faults.push_back(Fault{0, step});
  // Every world call of the victim's dispatch and combine (at most about 40 of them).
  const int stride = (calls + 39) / 40;
  for (int call = 1; call <= calls; call += stride) faults.push_back(Fault{call, -1});
  const std::string want = "rank " + std::to_string(kVictim) + " failed: " + kReason;
  int errors = 0, finished = 0;
  for (const Fault& f : faults) {
    SCOPED_TRACE(f.name());
    std::vector<Outcome> out = run_with_fault(backend, name, g, f);
    for (int r = 0; r < kRanks; ++r) {
      const Outcome& o = out[size_t(r)];
      if (!o.ran) continue;
      if (r == kVictim) {
        EXPECT_TRUE(f.call == 0 || o.fired) << "the fault did not fire";
        EXPECT_FALSE(o.status.ok()) << "the failed rank returned success";
        continue;
      }
      // A rank that no longer needed the victim when it failed may finish, but only with
      // its whole output: the bits of the clean run.
      ++(o.status.ok() ? finished : errors);
      if (o.status.ok()) {
        EXPECT_TRUE(clean[size_t(r)].ran &&
                    bitwise_equal(o.output.view(), clean[size_t(r)].output.view()))
            << "rank " << r << " returned success with an output that differs from the clean run";
        continue;
      }
      EXPECT_EQ(o.status.code(), StatusCode::kAborted)
          << "rank " << r << ": " << o.status.to_string();
      EXPECT_NE(o.status.message().find(want), std::string::npos)
          << "rank " << r << ": " << o.status.to_string();
    }
  }
  // What the other ranks this process runs (threads: all; MPI: its own) did.
  if (errors + finished > 0) {
    std::printf(
        "%zu faults of rank %d (%d world calls): the other ranks here returned %d errors "
        "naming it and finished %d times with the clean output\n",
        faults.size(), kVictim, calls, errors, finished);
    EXPECT_GT(errors, 0);
  }
}

std::string param_name(const ::testing::TestParamInfo<DispatchFaults::ParamType>& info) {
  std::string n = std::get<1>(info.param);
  std::replace(n.begin(), n.end(), '-', '_');
  return std::string(testing::backend_name(std::get<0>(info.param))) + "_" + n + "_G" +
         std::to_string(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Worlds, DispatchFaults,
                         ::testing::Combine(::testing::ValuesIn(testing::backends()),
                                            ::testing::Values("allgather", "alltoall", "flex",
                                                              "low-latency"),
                                            ::testing::Values(0, 2)),
                         param_name);

}  // namespace
}  // namespace moed
