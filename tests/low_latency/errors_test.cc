// Bad input to the low-latency buffer fails on every rank with the same message.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "low_latency/low_latency_test_util.h"

namespace moed {
namespace {

using namespace low_latency_test;  // NOLINT: Problem, Case, make_problem, the checks, ...
using ::moed::testing::run_world;

// Runs `body` on 4 ranks (2 nodes) and expects the same error on every rank.
void expect_error(Backend backend, const std::function<Status(World&)>& body, StatusCode code,
                  const std::string& text) {
  Status s = run_world(backend, 4, 2, [&](World& w) -> Status {
    Status got = body(w);
    if (got.code() != code || got.message().find(text) == std::string::npos) {
      return internal_error("rank ", w.rank(), " got '", got.to_string(), "', expected '", text,
                            "'");
    }
    return ok_status();
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
}

// One token on every rank, to expert 7 (on rank 3), and the expert outputs its combine takes:
// 2 local experts of M = 4 rows from each of 4 ranks, H = 128.
struct OneToken {
  Tensor x = Tensor::zeros(DType::kBF16, 1, 128);
  TopkRouting r{.num_tokens = 1, .num_topk = 1, .topk_idx = {7}, .topk_weights = {1.0f}};
  Tensor y = Tensor::zeros(DType::kBF16, 2 * 4 * 4, 128);
};

// expect_error for a body that sends a OneToken through a buffer of M = 4, H = 128, E = 8.
void expect_one_token_error(Backend backend,
                            const std::function<Status(World&, LowLatencyBuffer&, OneToken&)>& body,
                            StatusCode code, const std::string& text) {
  expect_error(
      backend,
      [&](World& w) -> Status {
        MOED_ASSIGN_OR_RETURN(auto buffer, LowLatencyBuffer::create(w, 4, 128, 8));
        OneToken t;
        return body(w, *buffer, t);
      },
      code, text);
}

TEST_P(LowLatencyTest, BadInputIsAnErrorOnEveryRank) {
  // max_tokens_per_rank differs across ranks.
  expect_error(
      GetParam(),
      [](World& w) { return LowLatencyBuffer::create(w, w.rank() == 2 ? 16 : 8, 128, 8).status(); },
      StatusCode::kInvalidArgument, "max_tokens_per_rank = 8 on rank 0 but 16 on rank 2");
  expect_error(
      GetParam(), [](World& w) { return LowLatencyBuffer::create(w, 8, 128, 6).status(); },
      StatusCode::kInvalidArgument, "num_experts = 6 must be a positive multiple of");

  auto dispatch_with = [](int64_t tokens, int hidden, int bad_rank, int32_t bad_expert, bool fp8) {
    return [=](World& w) -> Status {
      MOED_ASSIGN_OR_RETURN(auto buffer, LowLatencyBuffer::create(w, 8, hidden, 8));
      const int64_t T = w.rank() == bad_rank ? tokens : 2;
      Tensor x = Tensor::zeros(DType::kBF16, T, hidden);
      TopkRouting r;
      r.num_tokens = T;
      r.num_topk = 2;
      r.topk_idx.assign(size_t(T) * 2, 1);
      for (int64_t t = 0; t < T; ++t) r.topk_idx[size_t(t) * 2 + 1] = 5;
      if (w.rank() == bad_rank && bad_expert != 0) r.topk_idx[3] = bad_expert;
      return buffer->low_latency_dispatch({.x = x.view(), .topk = TopkView::of(r), .use_fp8 = fp8})
          .status();
    };
  };
  expect_error(GetParam(), dispatch_with(9, 128, 1, 0, false), StatusCode::kInvalidArgument,
               "rank 1: low_latency_dispatch: x has 9 rows > max_tokens_per_rank = 8");
  expect_error(GetParam(), dispatch_with(2, 192, 3, 0, true), StatusCode::kInvalidArgument,
               "use_fp8 needs hidden to be a multiple of 128; hidden = 192");
  expect_error(GetParam(), dispatch_with(2, 128, 3, 8, false), StatusCode::kInvalidArgument,
               "rank 3: topk_idx[1][1] = 8 is outside [-1, 8)");
  expect_error(GetParam(), dispatch_with(2, 128, 2, -2, false), StatusCode::kInvalidArgument,
               "rank 2: topk_idx[1][1] = -2 is outside [-1, 8)");
  expect_error(GetParam(), dispatch_with(2, 128, 0, 1, false), StatusCode::kInvalidArgument,
               "rank 0: topk_idx[1] repeats expert 1");

  // Combine: a handle whose dispatch has not been received, and negative weights.
  expect_one_token_error(
      GetParam(),
      [](World& w, LowLatencyBuffer& buffer, OneToken& t) -> Status {
        MOED_ASSIGN_OR_RETURN(
            auto d, buffer.low_latency_dispatch(
                        {.x = t.x.view(), .topk = TopkView::of(t.r), .return_recv_hook = true}));
        Status early = buffer
                           .low_latency_combine(
                               {.x = t.y.view(), .topk = TopkView::of(t.r), .handle = d.handle})
                           .status();
        MOED_RETURN_IF_ERROR(d.hook->wait());
        if (early.ok()) return internal_error("combine before the dispatch's hook succeeded");
        t.r.topk_weights[0] = w.rank() == 1 ? -1.0f : 1.0f;
        Status neg = buffer
                         .low_latency_combine(
                             {.x = t.y.view(), .topk = TopkView::of(t.r), .handle = d.handle})
                         .status();
        if (neg.message() != "rank 1: topk_weights[0][0] = -1 is not a valid prob") {
          return internal_error("negative weight: ", neg.to_string());
        }
        return early;
      },
      StatusCode::kFailedPrecondition, "has not been received yet; call its hook first");

  // Threads world (an in-place combine reads the in-node expert outputs where they lie): the
  // combine's return_recv_hook must agree, as a rank that reads in place and one that copies
  // cannot meet. A dispatch pushes in every world, so there its ranks may differ.
  if (GetParam() == Backend::kThreads) {
    expect_one_token_error(
        GetParam(),
        [](World& w, LowLatencyBuffer& buffer, OneToken& t) -> Status {
          MOED_ASSIGN_OR_RETURN(
              auto d, buffer.low_latency_dispatch({.x = t.x.view(), .topk = TopkView::of(t.r)}));
          return buffer
              .low_latency_combine({.x = t.y.view(),
                                    .topk = TopkView::of(t.r),
                                    .handle = d.handle,
                                    .return_recv_hook = w.rank() == 2})
              .status();
        },
        StatusCode::kInvalidArgument,
        "low_latency_combine: return_recv_hook = 0 on rank 0 but 1 on rank 2");
  }
}

}  // namespace
}  // namespace moed
