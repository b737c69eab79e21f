// The rules of moed/dispatcher.h and moed/world.h that the Python package builds on, for every
// dispatcher on both worlds: a held output stays bitwise unchanged through later calls,
// requests are never null, the first step of each group is local, the steps run in order, a
// Flex step makes one collective, the pools are settable.
#include <gtest/gtest.h>

#include "api/api_grid.h"
#include "dispatch/harness.h"
#include "moed/dispatcher.h"
#include "moed/thread_pool.h"

namespace moed {
namespace {

using testing::Backend;

struct Held {
  Tensor x;
  std::vector<float> probs;
  std::vector<int64_t> tokens_per_expert;
};
Held copy_of(const DispatchOutput& out) {
  return {Tensor::copy_of(out.expert_input.x),
          std::vector<float>(out.permuted_probs.begin(), out.permuted_probs.end()),
          std::vector<int64_t>(out.tokens_per_expert.begin(), out.tokens_per_expert.end())};
}
Status same(const DispatchOutput& out, const Held& h, const std::string& what) {
  if (!bitwise_equal(out.expert_input.x, h.x.view()))
    return internal_error(what, ": expert_input changed");
  if (std::vector<float>(out.permuted_probs.begin(), out.permuted_probs.end()) != h.probs)
    return internal_error(what, ": permuted_probs changed");
  if (std::vector<int64_t>(out.tokens_per_expert.begin(), out.tokens_per_expert.end()) !=
      h.tokens_per_expert)
    return internal_error(what, ": tokens_per_expert changed");
  return ok_status();
}

testing::DispatchCase make_case(int ranks, int g, uint64_t seed) {
  return testing::api_case(ranks, g, 5 + int(seed), /*hidden=*/72, seed);
}

using CaseBody = std::function<Status(World&, const testing::DispatchCase&, const DispatchInput&)>;

// Runs body on every rank of make_case(ranks, g, seed) with the case and this rank's input
// (its hidden rows and top-k routing).
Status run_case(Backend backend, int ranks, int g, uint64_t seed, const CaseBody& body) {
  const testing::DispatchCase c = make_case(ranks, g, seed);
  const testing::CaseInput in = testing::make_case_input(c);
  return testing::run_world(backend, ranks, g, [&](World& w) -> Status {
    const int r = w.rank();
    return body(w, c,
                {.hidden = in.hidden[size_t(r)].rows(), .topk = TopkView::of(in.topk[size_t(r)])});
  });
}

class OutputLifetime : public testing::BackendAndKindTest {};

// Hold output 1 (and its combine), dispatch and combine again with other routing and data:
// output 1 is bitwise unchanged. Then with the outputs dropped, the steps run again.
TEST_P(OutputLifetime, HeldOutputsStayUnchanged) {
  const auto [backend, kind] = GetParam();
  for (auto [R, G] : {std::pair{4, 2}, std::pair{3, 0}}) {
    const testing::DispatchCase c1 = make_case(R, G, 1), c2 = make_case(R, G, 2);
    const testing::CaseInput in1 = testing::make_case_input(c1), in2 = testing::make_case_input(c2);
    Status s = testing::run_world(backend, R, G, [&](World& w) -> Status {
      const int r = w.rank();
      DispatchConfig cfg{.kind = kind, .num_experts = c1.num_experts};
      MOED_ASSIGN_OR_RETURN(auto d, TokenDispatcher::create(w, cfg));
      MOED_ASSIGN_OR_RETURN(DispatchOutput o1,
                            d->dispatch({.hidden = in1.hidden[size_t(r)].rows(),
                                         .topk = TopkView::of(in1.topk[size_t(r)])}));
      const Held h1 = copy_of(o1);
      MOED_ASSIGN_OR_RETURN(CombineOutput y1,
                            d->combine({.expert_output = o1.expert_input, .handle = o1.handle}));
      const Tensor y1_copy = Tensor::copy_of(y1.hidden.view());
      for (int round = 0; round < 3; ++round) {
        const testing::CaseInput& in = round % 2 == 0 ? in2 : in1;
        MOED_ASSIGN_OR_RETURN(DispatchOutput o2,
                              d->dispatch({.hidden = in.hidden[size_t(r)].rows(),
                                           .topk = TopkView::of(in.topk[size_t(r)])}));
        MOED_ASSIGN_OR_RETURN(CombineOutput y2,
                              d->combine({.expert_output = o2.expert_input, .handle = o2.handle}));
        MOED_RETURN_IF_ERROR(same(o1, h1, str_cat("rank ", r, " round ", round)));
        if (!bitwise_equal(y1.hidden.view(), y1_copy.view()))
          return internal_error("rank ", r, ": combine output 1 changed");
      }
      // Cached mode writes a new output too; the held one stays.
      if (kind == DispatcherKind::kFlex) {
        MOED_ASSIGN_OR_RETURN(
            DispatchOutput o3,
            d->dispatch({.hidden = in1.hidden[size_t(r)].rows(), .cached_handle = o1.handle}));
        MOED_RETURN_IF_ERROR(same(o3, h1, str_cat("rank ", r, ": cached dispatch")));
        MOED_RETURN_IF_ERROR(same(o1, h1, str_cat("rank ", r, " after cached")));
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << "R " << R << " G " << G << ": " << s.to_string();
  }
}

// The storage keeps the memory too: an output read after its dispatcher is gone (and, in the
// MPI and gloo worlds, after every local rank unmapped its view of Flex's region) is unchanged.
TEST_P(OutputLifetime, OutputOutlivesItsDispatcher) {
  const auto [backend, kind] = GetParam();
  Status s = run_case(
      backend, 4, 2, 3,
      [&](World& w, const testing::DispatchCase& c, const DispatchInput& input) -> Status {
        DispatchOutput held;
        Held copy;
        {
          MOED_ASSIGN_OR_RETURN(
              auto d, TokenDispatcher::create(w, {.kind = kind, .num_experts = c.num_experts}));
          MOED_ASSIGN_OR_RETURN(held, d->dispatch(input));
          copy = copy_of(held);
        }
        MOED_RETURN_IF_ERROR(w.barrier());  // every rank's dispatcher is gone
        return same(held, copy, str_cat("rank ", w.rank(), " after the dispatcher"));
      });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

// More outputs held at once than Flex's ring has slots (64; a model's layers kept for the
// backward): every one stays unchanged, those past the ring in regions of their own, and a
// dispatch after they are dropped goes back into the ring.
TEST_P(OutputLifetime, MoreHeldOutputsThanRingSlots) {
  const auto [backend, kind] = GetParam();
  constexpr int kHeldOutputs = 64 + 3;
  const testing::DispatchCase c1 = make_case(4, 2, 1), c2 = make_case(4, 2, 2);
  const testing::CaseInput in1 = testing::make_case_input(c1), in2 = testing::make_case_input(c2);
  Status s = testing::run_world(backend, 4, 2, [&](World& w) -> Status {
    const int r = w.rank();
    MOED_ASSIGN_OR_RETURN(
        auto d, TokenDispatcher::create(w, {.kind = kind, .num_experts = c1.num_experts}));
    auto dispatch = [&](int i) {
      const testing::CaseInput& in = i % 2 == 0 ? in1 : in2;
      return d->dispatch(
          {.hidden = in.hidden[size_t(r)].rows(), .topk = TopkView::of(in.topk[size_t(r)])});
    };
    std::vector<DispatchOutput> held;
    std::vector<Held> copies;
    for (int i = 0; i < kHeldOutputs; ++i) {
      MOED_ASSIGN_OR_RETURN(DispatchOutput o, dispatch(i));
      copies.push_back(copy_of(o));
      held.push_back(std::move(o));
    }
    for (int i = 0; i < kHeldOutputs; ++i)
      MOED_RETURN_IF_ERROR(same(held[size_t(i)], copies[size_t(i)], str_cat("rank ", r, " #", i)));
    held.clear();
    MOED_ASSIGN_OR_RETURN(DispatchOutput again, dispatch(0));
    return same(again, copies[0], str_cat("rank ", r, " after the outputs were dropped"));
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

// Every token_* returns a non-null request, done after wait() (async or not).
TEST_P(OutputLifetime, RequestsAreNeverNull) {
  const auto [backend, kind] = GetParam();
  Status s = run_case(
      backend, 3, 0, 1,
      [&](World& w, const testing::DispatchCase& c, const DispatchInput& input) -> Status {
        MOED_ASSIGN_OR_RETURN(
            auto d, TokenDispatcher::create(w, {.kind = kind, .num_experts = c.num_experts}));
        for (bool async : {false, true}) {
          MOED_RETURN_IF_ERROR(d->dispatch_preprocess(input));
          MOED_ASSIGN_OR_RETURN(Request q, d->token_dispatch(async));
          if (!q) return internal_error("token_dispatch(", async, ") returned null");
          MOED_RETURN_IF_ERROR(q->wait());
          if (!q->ready()) return internal_error("ready() false after wait()");
          MOED_ASSIGN_OR_RETURN(DispatchOutput o, d->dispatch_postprocess());
          MOED_RETURN_IF_ERROR(
              d->combine_preprocess({.expert_output = o.expert_input, .handle = o.handle}));
          MOED_ASSIGN_OR_RETURN(Request cq, d->token_combine(async));
          if (!cq) return internal_error("token_combine(", async, ") returned null");
          MOED_RETURN_IF_ERROR(cq->wait());
          MOED_RETURN_IF_ERROR(d->combine_postprocess().status());
          const Tensor g = Tensor::zeros(DType::kF32, o.num_rows(), c.hidden);
          MOED_RETURN_IF_ERROR(d->dispatch_postprocess_backward(
              {.grad_expert_input = g.view(), .handle = o.handle}));
          MOED_ASSIGN_OR_RETURN(Request bq, d->token_dispatch_backward(async));
          if (!bq) return internal_error("token_dispatch_backward returned null");
          MOED_RETURN_IF_ERROR(bq->wait());
          MOED_RETURN_IF_ERROR(d->dispatch_preprocess_backward().status());
          const Tensor gh = Tensor::zeros(DType::kF32, input.topk.num_tokens, c.hidden);
          MOED_RETURN_IF_ERROR(d->combine_postprocess_backward(
              {.grad_hidden = gh.view(), .expert_output = o.expert_input, .handle = o.handle}));
          MOED_ASSIGN_OR_RETURN(Request cbq, d->token_combine_backward(async));
          if (!cbq) return internal_error("token_combine_backward returned null");
          MOED_RETURN_IF_ERROR(cbq->wait());
          MOED_RETURN_IF_ERROR(d->combine_preprocess_backward().status());
        }
        return ok_status();
      });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

INSTANTIATE_TEST_SUITE_P(Worlds, OutputLifetime, testing::six_step_grid(),
                         testing::six_step_grid_name);

// The first step of each group (dispatch_preprocess, combine_preprocess and the backward's
// dispatch_postprocess_backward, combine_postprocess_backward) is local in every dispatcher
// (moed/dispatcher.h): it makes no collective, and a bad input on one rank is every rank's
// error in the step after, where the verdict is agreed. Then the same dispatcher goes on with
// good inputs.
class PreprocessIsLocal : public testing::BackendAndKindTest {};

TEST_P(PreprocessIsLocal, NoCollectiveAndTheErrorInTheNextStep) {
  const auto [backend, kind] = GetParam();
  const int R = 4;
  Status s = run_case(
      backend, R, 0, 7,
      [&](World& w, const testing::DispatchCase& c, const DispatchInput& input) -> Status {
        MOED_ASSIGN_OR_RETURN(auto d, TokenDispatcher::create(
                                          w, {.kind = kind, .num_experts = c.num_experts}));
        TopkRouting bad = to_topk(input.topk);
        if (w.rank() == R - 1) bad.topk_idx[0] = c.num_experts;  // the last rank has tokens
        DispatchInput in = input;
        in.topk = TopkView::of(bad);
        const uint64_t before = w.counters().collectives;
        MOED_RETURN_IF_ERROR(d->dispatch_preprocess(in));
        if (const uint64_t n = w.counters().collectives - before; n != 0)
          return internal_error("dispatch_preprocess made ", n, " collectives");
        StatusOr<Request> q = d->token_dispatch(false);
        const std::string want = "rank " + std::to_string(R - 1) + ": topk_idx[0][0] = " +
                                 std::to_string(c.num_experts) + " is outside";
        if (q.ok() || q.status().message().find(want) == std::string::npos)
          return internal_error("token_dispatch: expected \"", want, "...\", got ",
                                q.status().to_string());
        if (d->dispatch_postprocess().ok())
          return internal_error("dispatch_postprocess after a failed token_dispatch succeeded");
        MOED_ASSIGN_OR_RETURN(DispatchOutput out, d->dispatch(input));
        // The same for combine: expert_output with one column too many on the last rank.
        const Tensor y = Tensor::zeros(DType::kF32, out.num_rows(),
                                       out.expert_input.x.cols + (w.rank() == R - 1 ? 1 : 0));
        const uint64_t at_combine = w.counters().collectives;
        MOED_RETURN_IF_ERROR(d->combine_preprocess({.expert_output = {y.view(), {}},
                                                    .handle = out.handle}));
        if (const uint64_t n = w.counters().collectives - at_combine; n != 0)
          return internal_error("combine_preprocess made ", n, " collectives");
        StatusOr<Request> cq = d->token_combine(false);
        const std::string want_c = "rank " + std::to_string(R - 1) + ": expert_output";
        if (cq.ok() || cq.status().message().find(want_c) == std::string::npos)
          return internal_error("token_combine: expected \"", want_c, "...\", got ",
                                cq.status().to_string());
        if (d->combine_postprocess().ok())
          return internal_error("combine_postprocess after a failed token_combine succeeded");
        const Tensor good = Tensor::copy_of(out.expert_input.x);
        MOED_RETURN_IF_ERROR(
            d->combine({.expert_output = {good.view(), {}}, .handle = out.handle}).status());
        // The backward's first steps too, in their communicating step: grad_expert_input, then
        // grad_hidden, with one column too many on the last rank.
        auto local_then_every_rank = [&](const char* first, const std::function<Status()>& stage,
                                         const std::function<StatusOr<Request>()>& token,
                                         const std::string& name) -> Status {
          const uint64_t at = w.counters().collectives;
          MOED_RETURN_IF_ERROR(stage());
          if (const uint64_t n = w.counters().collectives - at; n != 0)
            return internal_error(first, " made ", n, " collectives");
          StatusOr<Request> q = token();
          const std::string want = "rank " + std::to_string(R - 1) + ": " + name;
          if (q.ok() || q.status().message().find(want) == std::string::npos)
            return internal_error("after ", first, ": expected \"", want, "...\", got ",
                                  q.status().to_string());
          return ok_status();
        };
        MOED_RETURN_IF_ERROR(local_then_every_rank(
            "dispatch_postprocess_backward",
            [&] { return d->dispatch_postprocess_backward({y.view(), {}, out.handle}); },
            [&] { return d->token_dispatch_backward(false); }, "grad_expert_input"));
        const Tensor gh = Tensor::zeros(DType::kF32, input.hidden.x.rows,
                                        c.hidden + (w.rank() == R - 1 ? 1 : 0));
        MOED_RETURN_IF_ERROR(local_then_every_rank(
            "combine_postprocess_backward",
            [&] {
              return d->combine_postprocess_backward({.grad_hidden = gh.view(),
                                                      .expert_output = {good.view(), {}},
                                                      .handle = out.handle});
            },
            [&] { return d->token_combine_backward(false); }, "grad_hidden"));
        return d->dispatch_backward({.grad_expert_input = good.view(), .handle = out.handle})
            .status();
      });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

INSTANTIATE_TEST_SUITE_P(Worlds, PreprocessIsLocal, testing::six_step_grid(),
                         testing::six_step_grid_name);

// The step sequencer (src/dispatch/steps.h) of every dispatcher: a communicating call before
// its first step, or a last step before it, fails naming the order, with no collective; an
// async dispatch and combine (on their own thread in Flex where the world allows it) give the
// bits of synchronous ones.
class StepOrder : public testing::BackendAndKindTest {};

TEST_P(StepOrder, OrderNamedAndAsyncBitsAsSync) {
  const auto [backend, kind] = GetParam();
  Status s = run_case(
      backend, 5, 0, 2,
      [&](World& w, const testing::DispatchCase& c, const DispatchInput& input) -> Status {
        MOED_ASSIGN_OR_RETURN(auto d, TokenDispatcher::create(
                                          w, {.kind = kind, .num_experts = c.num_experts}));
        auto order = [&](const Status& got, const std::string& want) -> Status {
          if (got.code() == StatusCode::kFailedPrecondition && got.message() == want)
            return ok_status();
          return internal_error("expected \"", want, "\", got ", got.to_string());
        };
        const uint64_t before = w.counters().collectives;
        MOED_RETURN_IF_ERROR(order(d->token_dispatch(false).status(),
                                   "token_dispatch before dispatch_preprocess"));
        MOED_RETURN_IF_ERROR(
            order(d->dispatch_postprocess().status(), "token_dispatch has not run"));
        MOED_RETURN_IF_ERROR(order(d->token_combine(true).status(),
                                   "token_combine before combine_preprocess"));
        MOED_RETURN_IF_ERROR(order(d->token_dispatch_backward(false).status(),
                                   "token_dispatch_backward before dispatch_postprocess_backward"));
        MOED_RETURN_IF_ERROR(order(d->token_combine_backward(false).status(),
                                   "token_combine_backward before combine_postprocess_backward"));
        MOED_RETURN_IF_ERROR(order(d->combine_preprocess_backward().status(),
                                   "token_combine_backward has not run"));
        if (const uint64_t n = w.counters().collectives - before; n != 0)
          return internal_error("out-of-order calls made ", n, " collectives");

        MOED_ASSIGN_OR_RETURN(DispatchOutput sync, d->dispatch(input));
        const Held want = copy_of(sync);
        const Tensor y = Tensor::copy_of(sync.expert_input.x);
        MOED_ASSIGN_OR_RETURN(CombineOutput sync_c,
                              d->combine({.expert_output = {y.view(), {}}, .handle = sync.handle}));
        MOED_RETURN_IF_ERROR(d->dispatch_preprocess(input));
        MOED_ASSIGN_OR_RETURN(Request q, d->token_dispatch(/*async=*/true));
        MOED_RETURN_IF_ERROR(q->wait());
        MOED_ASSIGN_OR_RETURN(DispatchOutput async, d->dispatch_postprocess());
        MOED_RETURN_IF_ERROR(same(async, want, str_cat("rank ", w.rank(), ": async dispatch")));
        MOED_RETURN_IF_ERROR(
            d->combine_preprocess({.expert_output = {y.view(), {}}, .handle = async.handle}));
        MOED_ASSIGN_OR_RETURN(Request cq, d->token_combine(/*async=*/true));
        MOED_RETURN_IF_ERROR(cq->wait());
        MOED_ASSIGN_OR_RETURN(CombineOutput async_c, d->combine_postprocess());
        if (!bitwise_equal(async_c.hidden.view(), sync_c.hidden.view()))
          return internal_error("rank ", w.rank(), ": async combine differs from sync");
        return ok_status();
      });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

INSTANTIATE_TEST_SUITE_P(Worlds, StepOrder, testing::six_step_grid(), testing::six_step_grid_name);

// Async steps keep each rank's order (World::AsyncSteps): a Flex dispatch left running on its
// own thread while the caller makes other calls on the world (a barrier, an all-gather, a
// second dispatcher's async dispatch) gives the bits of synchronous calls, and so do the calls.
class AsyncTurns : public ::testing::TestWithParam<Backend> {};

TEST_P(AsyncTurns, OtherCallsWaitForTheStepsBeforeThem) {
  Status s = run_case(
      GetParam(), 4, 0, 4,
      [&](World& w, const testing::DispatchCase& c, const DispatchInput& input) -> Status {
        const DispatchConfig config{.kind = DispatcherKind::kFlex, .num_experts = c.num_experts};
        MOED_ASSIGN_OR_RETURN(auto d1, TokenDispatcher::create(w, config));
        MOED_ASSIGN_OR_RETURN(auto d2, TokenDispatcher::create(w, config));
        MOED_ASSIGN_OR_RETURN(DispatchOutput sync, d1->dispatch(input));
        const Held want = copy_of(sync);
        sync = DispatchOutput{};
        for (int round = 0; round < 3; ++round) {
          MOED_RETURN_IF_ERROR(d1->dispatch_preprocess(input));
          MOED_ASSIGN_OR_RETURN(Request q1, d1->token_dispatch(/*async=*/true));
          MOED_RETURN_IF_ERROR(w.barrier());
          const int64_t mine = w.rank() * 10 + round;
          MOED_ASSIGN_OR_RETURN(std::vector<int64_t> all,
                                all_gather<int64_t>(w, std::span<const int64_t>(&mine, 1)));
          for (int r = 0; r < w.size(); ++r) {
            if (all[size_t(r)] != r * 10 + round)
              return internal_error("rank ", w.rank(), ": the all-gather beside the step read ",
                                    all[size_t(r)], " from rank ", r);
          }
          MOED_RETURN_IF_ERROR(d2->dispatch_preprocess(input));
          MOED_ASSIGN_OR_RETURN(Request q2, d2->token_dispatch(/*async=*/true));
          MOED_RETURN_IF_ERROR(q2->wait());
          MOED_RETURN_IF_ERROR(q1->wait());
          MOED_ASSIGN_OR_RETURN(DispatchOutput o1, d1->dispatch_postprocess());
          MOED_ASSIGN_OR_RETURN(DispatchOutput o2, d2->dispatch_postprocess());
          MOED_RETURN_IF_ERROR(same(o1, want, str_cat("rank ", w.rank(), ": async dispatch 1")));
          MOED_RETURN_IF_ERROR(same(o2, want, str_cat("rank ", w.rank(), ": async dispatch 2")));
        }
        return ok_status();
      });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

INSTANTIATE_TEST_SUITE_P(Worlds, AsyncTurns, ::testing::ValuesIn(testing::backends()),
                         testing::backend_param_name<::testing::TestParamInfo<Backend>>);

// One collective before data moves in each Flex step, in the steady state (same shapes, the
// previous outputs dropped, so no region grows): dispatch 1, cached dispatch, combine and the
// backward steps at most 1; on one node and on two.
class FlexCollectives : public ::testing::TestWithParam<Backend> {};

TEST_P(FlexCollectives, OnePerStep) {
  for (auto [R, G] : {std::pair{4, 0}, std::pair{4, 2}, std::pair{5, 0}}) {
    Status s = run_case(
        GetParam(), R, G, 3,
        [&](World& w, const testing::DispatchCase& c, const DispatchInput& input) -> Status {
          const int r = w.rank();
          MOED_ASSIGN_OR_RETURN(auto d, TokenDispatcher::create(w, {.kind = DispatcherKind::kFlex,
                                                                    .num_experts = c.num_experts}));
          auto count = [&](const char* what, uint64_t limit, bool exact,
                           const std::function<Status()>& step) -> Status {
            const uint64_t before = w.counters().collectives;
            MOED_RETURN_IF_ERROR(step());
            const uint64_t n = w.counters().collectives - before;
            if (n > limit || (exact && n != limit))
              return internal_error("rank ", r, ": ", what, " made ", n, " collectives");
            return ok_status();
          };
          std::shared_ptr<const DispatchHandle> handle;
          for (int round = 0; round < 3; ++round) {
            const bool steady = round > 0;  // round 0 allocates the regions
            const uint64_t any = ~uint64_t(0);
            DispatchOutput out;
            MOED_RETURN_IF_ERROR(count("dispatch", steady ? 1 : any, steady, [&]() -> Status {
              MOED_ASSIGN_OR_RETURN(out, d->dispatch(input));
              return ok_status();
            }));
            handle = out.handle;
            const Tensor y = Tensor::copy_of(out.expert_input.x);
            out = DispatchOutput{};
            MOED_RETURN_IF_ERROR(count("cached dispatch", steady ? 1 : any, false, [&]() -> Status {
              MOED_ASSIGN_OR_RETURN(DispatchOutput o,
                                    d->dispatch({.hidden = input.hidden, .cached_handle = handle}));
              return ok_status();
            }));
            MOED_RETURN_IF_ERROR(count("combine", steady ? 1 : any, false, [&]() -> Status {
              return d->combine({.expert_output = {y.view(), {}}, .handle = handle}).status();
            }));
            MOED_RETURN_IF_ERROR(
                count("dispatch backward", steady ? 1 : any, false, [&]() -> Status {
                  return d->dispatch_backward({.grad_expert_input = y.view(), .handle = handle})
                      .status();
                }));
            const Tensor gh = Tensor::zeros(DType::kF32, input.hidden.x.rows, c.hidden);
            MOED_RETURN_IF_ERROR(
                count("combine backward", steady ? 1 : any, false, [&]() -> Status {
                  return d->combine_backward({.grad_hidden = gh.view(), .handle = handle}).status();
                }));
          }
          return ok_status();
        });
    ASSERT_TRUE(s.ok()) << "R " << R << " G " << G << ": " << s.to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, FlexCollectives, ::testing::ValuesIn(testing::backends()),
                         testing::backend_param_name<::testing::TestParamInfo<Backend>>);

// The per-process pool settings (threads world: its worlds are made inside the test).
TEST(ProcessSettings, DefaultThreadsPerRankAndGlobalPool) {
  ASSERT_FALSE(set_default_threads_per_rank(-1).ok());
  ASSERT_TRUE(set_default_threads_per_rank(3).ok());
  EXPECT_EQ(default_threads_per_rank(), 3);
  EXPECT_EQ(resolve_threads_per_rank(0, 2), 3);
  EXPECT_EQ(resolve_threads_per_rank(5, 2), 5);
  if (testing::backends()[0] == Backend::kThreads) {
    Status s = testing::run_world(Backend::kThreads, 2, 0, [](World& w) -> Status {
      if (w.pool().num_threads() != 3)
        return internal_error("pool has ", w.pool().num_threads(), " threads");
      return ok_status();
    });
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  ASSERT_TRUE(set_default_threads_per_rank(0).ok());

  ThreadPool& before = ThreadPool::global();
  ASSERT_TRUE(ThreadPool::set_global_threads(2));
  EXPECT_EQ(ThreadPool::global_threads(), 2);
  EXPECT_EQ(ThreadPool::global().num_threads(), 2);
  EXPECT_FALSE(ThreadPool::set_global_threads(-1));
  // A reference taken before stays usable.
  int64_t sum = 0;
  std::mutex mu;
  before.parallel_for(10, [&](int64_t b, int64_t e, int) {
    std::lock_guard<std::mutex> lock(mu);
    sum += e - b;
  });
  EXPECT_EQ(sum, 10);
  ASSERT_TRUE(ThreadPool::set_global_threads(0));
}

}  // namespace
}  // namespace moed
