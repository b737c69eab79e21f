// Bad input: every rank gets the same clear error (code and message naming the value), and
// nothing hangs, for the three dispatchers alike (one message each) on both worlds.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "dispatch/allgather/allgather.h"
#include "dispatch/alltoall/alltoall.h"
#include "dispatch/flex/flex_dispatcher.h"
#include "support/world_test.h"

namespace moed {
namespace {

using testing::Backend;

struct Kind {
  DispatcherKind kind;
  StatusOr<std::unique_ptr<TokenDispatcher>> (*make)(World&, const DispatchConfig&);
};

class DispatchErrors : public ::testing::TestWithParam<std::tuple<Backend, int>> {
 protected:
  Kind kind() const {
    static const Kind kinds[] = {{DispatcherKind::kAllGather, make_allgather_dispatcher},
                                 {DispatcherKind::kAlltoAll, make_alltoall_dispatcher},
                                 {DispatcherKind::kFlex, make_flex_dispatcher}};
    return kinds[std::get<1>(GetParam())];
  }
  Backend backend() const { return std::get<0>(GetParam()); }
  DispatchConfig config(int num_experts) const {
    DispatchConfig c;
    c.kind = kind().kind;
    c.num_experts = num_experts;
    return c;
  }
  // Runs body on `ranks` ranks (one node), each with a dispatcher of this test's kind for
  // `num_experts` experts; the test fails with body's error.
  void on_dispatchers(int ranks, int num_experts,
                      const std::function<Status(World&, TokenDispatcher&)>& body) const {
    Status s = testing::run_world(backend(), ranks, 0, [&](World& w) -> Status {
      MOED_ASSIGN_OR_RETURN(auto d, kind().make(w, config(num_experts)));
      return body(w, *d);
    });
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
};

// OK when `got` is `code` with `message` (exactly), else an error saying what came instead.
Status expect_error(const Status& got, StatusCode code, const std::string& message) {
  if (got.code() == code && got.message() == message) return ok_status();
  return internal_error("expected ", status_code_name(code), ": ", message, "\n got ",
                        got.to_string());
}

DispatchInput input_of(const Tensor& x, const TopkRouting* topk, const RoutingMap* map = nullptr) {
  DispatchInput in;
  in.hidden = TokenRows{x.view(), TensorView()};
  if (topk) in.topk = TopkView::of(*topk);
  if (map) in.map = MapView::of(*map);
  return in;
}

// OK when dispatching x with `topk` (or `map`) fails with InvalidArgument and `message`.
Status expect_dispatch_error(TokenDispatcher& d, const Tensor& x, const TopkRouting* topk,
                             const std::string& message, const RoutingMap* map = nullptr) {
  return expect_error(d.dispatch(input_of(x, topk, map)).status(), StatusCode::kInvalidArgument,
                      message);
}

TopkRouting simple_topk(int64_t T, int K, int E, int shift) {
  TopkRouting r;
  r.num_tokens = T;
  r.num_topk = K;
  for (int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      r.topk_idx.push_back(int32_t((t + k + shift) % E));
      r.topk_weights.push_back(0.5f);
    }
  }
  return r;
}

TEST_P(DispatchErrors, RoutingOutsideNumExpertsOnOneRank) {
  on_dispatchers(4, 8, [&](World& w, TokenDispatcher& d) -> Status {
    Tensor x = Tensor::zeros(DType::kF32, 3, 128);
    TopkRouting r = simple_topk(3, 2, 8, w.rank());
    if (w.rank() == 2) r.topk_idx[2] = 8;  // token 1, k = 0
    return expect_dispatch_error(d, x, &r, "rank 2: topk_idx[1][0] = 8 is outside [-1, 8)");
  });
}

// A TopkRouting whose arrays are not [T, K] gives TopkView::of a view without data: an error
// naming the sizes, never a read past the arrays.
TEST_P(DispatchErrors, TopkArraysShorterThanTheirShapeOnOneRank) {
  on_dispatchers(3, 6, [&](World& w, TokenDispatcher& d) -> Status {
    Tensor x = Tensor::zeros(DType::kF32, 3, 128);
    TopkRouting r = simple_topk(3, 2, 6, w.rank());
    if (w.rank() == 1) r.topk_weights.pop_back();
    return expect_dispatch_error(d, x, &r,
                                 "rank 1: topk_idx has no data for its 3 x 2 entries (a "
                                 "TopkRouting's arrays must hold num_tokens * num_topk each)");
  });
}

// The same for a RoutingMap's arrays (MapView::of).
TEST_P(DispatchErrors, MapArraysShorterThanTheirShapeOnOneRank) {
  on_dispatchers(2, 4, [&](World& w, TokenDispatcher& d) -> Status {
    Tensor x = Tensor::zeros(DType::kF32, 3, 128);
    RoutingMap m = to_map(simple_topk(3, 1, 4, w.rank()), 4);
    if (w.rank() == 0) m.probs.pop_back();
    return expect_dispatch_error(d, x, nullptr,
                                 "rank 0: routing_map has no data for its 3 x 4 cells (a "
                                 "RoutingMap's arrays must hold num_tokens * num_experts each)",
                                 &m);
  });
}

TEST_P(DispatchErrors, RoutingMapWithOtherNumExperts) {
  on_dispatchers(2, 8, [&](World&, TokenDispatcher& d) -> Status {
    Tensor x = Tensor::zeros(DType::kBF16, 2, 128);
    RoutingMap m = to_map(simple_topk(2, 1, 4, 0), 4);
    return expect_dispatch_error(d, x, nullptr,
                                 "rank 0: routing map has num_experts = 4, expected 8", &m);
  });
}

TEST_P(DispatchErrors, EpTimesEtpIsNotTheWorldSize) {
  Status s = testing::run_world(backend(), 4, 0, [&](World& w) -> Status {
    DispatchConfig c = config(8);
    c.ep_size = 3;
    auto d = kind().make(w, c);
    MOED_RETURN_IF_ERROR(expect_error(d.status(), StatusCode::kInvalidArgument,
                                      "rank 0: ep_size * etp_size = 3 * 1 = 3 is not the world "
                                      "size 4"));
    c.ep_size = 0;
    c.etp_size = 3;
    return expect_error(kind().make(w, c).status(), StatusCode::kInvalidArgument,
                        "rank 0: etp_size = 3 does not divide world size 4");
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

TEST_P(DispatchErrors, HiddenSizeDiffersAcrossRanks) {
  on_dispatchers(3, 6, [&](World& w, TokenDispatcher& d) -> Status {
    const int H = w.rank() == 1 ? 256 : 128;
    const int64_t T = w.rank() == 2 ? 0 : 2;
    Tensor x = Tensor::zeros(DType::kF32, T, H);
    TopkRouting r = simple_topk(T, 2, 6, 0);
    return expect_dispatch_error(d, x, &r, "hidden = 128 on rank 0 but 256 on rank 1");
  });
}

TEST_P(DispatchErrors, NanProbOnOneRank) {
  on_dispatchers(4, 4, [&](World& w, TokenDispatcher& d) -> Status {
    Tensor x = Tensor::zeros(DType::kF32, 2, 128);
    TopkRouting r = simple_topk(2, 1, 4, w.rank());
    if (w.rank() == 3) r.topk_weights[1] = std::numeric_limits<float>::quiet_NaN();
    return expect_dispatch_error(d, x, &r, "rank 3: topk_weights[1][0] = nan is not a valid prob");
  });
}

TEST_P(DispatchErrors, CombineRowsDisagreeWithTheDispatchOnOneRank) {
  on_dispatchers(2, 2, [&](World& w, TokenDispatcher& d) -> Status {
    Tensor x = Tensor::zeros(DType::kF32, 3, 128);
    TopkRouting r = simple_topk(3, 1, 2, 0);  // tokens 0, 2 -> expert 0; token 1 -> expert 1
    MOED_ASSIGN_OR_RETURN(DispatchOutput out, d.dispatch(input_of(x, &r)));
    const int64_t rows = out.num_rows() + (w.rank() == 1 ? 1 : 0);
    Tensor y = Tensor::zeros(DType::kF32, rows, 128);
    auto c = d.combine(CombineInput{TokenRows{y.view(), TensorView()}, out.handle});
    MOED_RETURN_IF_ERROR(expect_error(c.status(), StatusCode::kInvalidArgument,
                                      "rank 1: expert_output is [3, 128]; expected [2, 128]"));
    // fp8 expert outputs are refused on every rank too.
    Tensor y8 = Tensor::zeros(DType::kFP8, out.num_rows(), 128);
    auto c8 = d.combine(CombineInput{TokenRows{y8.view(), TensorView()}, out.handle});
    return expect_error(c8.status(), StatusCode::kInvalidArgument,
                        "rank 0: expert_output dtype is fp8; expected f32 or bf16");
  });
}

std::string param_name(const ::testing::TestParamInfo<std::tuple<Backend, int>>& info) {
  static const char* const names[] = {"_allgather", "_alltoall", "_flex"};
  return std::string(testing::backend_name(std::get<0>(info.param))) +
         names[std::get<1>(info.param)];
}

INSTANTIATE_TEST_SUITE_P(Worlds, DispatchErrors,
                         ::testing::Combine(::testing::ValuesIn(testing::backends()),
                                            ::testing::Values(0, 1, 2)),
                         param_name);

}  // namespace
}  // namespace moed
