// Two low-latency operations in flight on both worlds: each keeps its own half of the buffer,
// a third is refused, and hooks may run in any order across ranks.
#include <gtest/gtest.h>

#include <cstring>
#include <utility>

#include "low_latency/low_latency_test_util.h"

namespace moed {
namespace {

using namespace low_latency_test;  // NOLINT: Problem, Case, make_problem, the checks, ...
using ::moed::testing::run_world;

// Two dispatches and two combines in flight at once, received in order, each equal to its own
// reference; the expert outputs of both are strided views (the combine stages them).
TEST_P(LowLatencyTest, TwoInFlightKeepTheirHalves) {
  for (const Case& c : {Case{4, 2, 8, 128, 3, 6, 31}, Case{3, 0, 6, 256, 2, 5, 32}}) {
    const auto ab = two_problems(c);
    ASSERT_TRUE(ab.ok()) << ab.status().to_string();
    const Problem *a = &(*ab)[0], *b = &(*ab)[1];
    Status s = run_with_buffer(GetParam(), c, [&](World& w, LowLatencyBuffer& buffer) -> Status {
      const int me = w.rank();
      for (int round = 0; round < 2; ++round) {
        MOED_ASSIGN_OR_RETURN(
            auto da, buffer.low_latency_dispatch({.x = a->x[size_t(me)].view(),
                                                  .topk = TopkView::of(a->topk[size_t(me)]),
                                                  .use_fp8 = round == 1,
                                                  .return_recv_hook = true}));
        MOED_ASSIGN_OR_RETURN(
            auto db, buffer.low_latency_dispatch({.x = b->x[size_t(me)].view(),
                                                  .topk = TopkView::of(b->topk[size_t(me)]),
                                                  .return_recv_hook = true}));
        // A third dispatch before the first is received is refused on every rank.
        auto third = buffer.low_latency_dispatch(
            {.x = a->x[size_t(me)].view(), .topk = TopkView::of(a->topk[size_t(me)])});
        if (third.ok() || third.status().code() != StatusCode::kFailedPrecondition ||
            third.status().message().find("two dispatches are already in flight") ==
                std::string::npos) {
          return internal_error("third dispatch in flight: ", third.status().to_string());
        }
        MOED_RETURN_IF_ERROR(da.hook->wait());
        MOED_RETURN_IF_ERROR(db.hook->wait());
        MOED_RETURN_IF_ERROR(check_dispatch(*a, me, da, round == 1, false));
        MOED_RETURN_IF_ERROR(check_dispatch(*b, me, db, false, false));
        // Strided expert outputs: each row sits in a wider row.
        auto widen = [&](const Tensor& t) {
          Tensor wide = Tensor::empty(DType::kBF16, t.rows(), t.cols() * 2);
          for (int64_t i = 0; i < t.rows(); ++i) {
            std::memcpy(wide.row<bf16>(i), t.row<bf16>(i), size_t(t.cols()) * 2);
          }
          return wide;
        };
        Tensor ya = widen(expert_output(*a, me, da)), yb = widen(expert_output(*b, me, db));
        TensorView va(ya.data(), DType::kBF16, ya.rows(), c.hidden, c.hidden * 2);
        TensorView vb(yb.data(), DType::kBF16, yb.rows(), c.hidden, c.hidden * 2);
        MOED_ASSIGN_OR_RETURN(auto ca,
                              buffer.low_latency_combine({.x = va,
                                                          .topk = TopkView::of(a->topk[size_t(me)]),
                                                          .handle = da.handle,
                                                          .return_recv_hook = true}));
        MOED_ASSIGN_OR_RETURN(auto cb,
                              buffer.low_latency_combine({.x = vb,
                                                          .topk = TopkView::of(b->topk[size_t(me)]),
                                                          .handle = db.handle,
                                                          .return_recv_hook = true}));
        MOED_RETURN_IF_ERROR(cb.hook->wait());  // out of order on purpose
        MOED_RETURN_IF_ERROR(ca.hook->wait());
        MOED_RETURN_IF_ERROR(check_combine(*a, me, ca.combined_x));
        MOED_RETURN_IF_ERROR(check_combine(*b, me, cb.combined_x));
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
}

// Hooks need not run in the same order on every rank: even ranks receive the first of two
// operations in flight first, odd ranks the second.
TEST_P(LowLatencyTest, HooksRunInAnyOrderAcrossRanks) {
  const Case c{4, 0, 8, 128, 3, 5, 61};
  const auto ab = two_problems(c);
  ASSERT_TRUE(ab.ok()) << ab.status().to_string();
  const Problem *a = &(*ab)[0], *b = &(*ab)[1];
  Status s = run_with_buffer(GetParam(), c, [&](World& w, LowLatencyBuffer& buffer) -> Status {
    const int me = w.rank();
    auto in_order = [&](Request& first, Request& second) -> Status {
      if (me % 2 == 1) std::swap(first, second);
      MOED_RETURN_IF_ERROR(first->wait());
      return second->wait();
    };
    MOED_ASSIGN_OR_RETURN(auto da,
                          buffer.low_latency_dispatch({.x = a->x[size_t(me)].view(),
                                                       .topk = TopkView::of(a->topk[size_t(me)]),
                                                       .return_recv_hook = true}));
    MOED_ASSIGN_OR_RETURN(auto db,
                          buffer.low_latency_dispatch({.x = b->x[size_t(me)].view(),
                                                       .topk = TopkView::of(b->topk[size_t(me)]),
                                                       .return_recv_hook = true}));
    MOED_RETURN_IF_ERROR(in_order(da.hook, db.hook));
    MOED_RETURN_IF_ERROR(check_dispatch(*a, me, da, false, false));
    MOED_RETURN_IF_ERROR(check_dispatch(*b, me, db, false, false));
    Tensor ya = expert_output(*a, me, da), yb = expert_output(*b, me, db);
    MOED_ASSIGN_OR_RETURN(auto ca,
                          buffer.low_latency_combine({.x = ya.view(),
                                                      .topk = TopkView::of(a->topk[size_t(me)]),
                                                      .handle = da.handle,
                                                      .return_recv_hook = true}));
    MOED_ASSIGN_OR_RETURN(auto cb,
                          buffer.low_latency_combine({.x = yb.view(),
                                                      .topk = TopkView::of(b->topk[size_t(me)]),
                                                      .handle = db.handle,
                                                      .return_recv_hook = true}));
    MOED_RETURN_IF_ERROR(in_order(ca.hook, cb.hook));
    MOED_RETURN_IF_ERROR(check_combine(*a, me, ca.combined_x));
    return check_combine(*b, me, cb.combined_x);
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

// A dispatch pushes every row during its send phase, so ranks may differ in return_recv_hook:
// one rank's receive never waits on another's hook.
TEST_P(LowLatencyTest, ADispatchsHookMayDifferAcrossRanks) {
  for (const Case& c : {Case{4, 2, 8, 128, 3, 6, 71}, Case{5, 0, 10, 96, 2, 4, 72}}) {
    const auto p = make_problem(c);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    Status s = run_with_buffer(GetParam(), c, [&](World& w, LowLatencyBuffer& buffer) -> Status {
      const int me = w.rank();
      MOED_ASSIGN_OR_RETURN(auto d,
                            buffer.low_latency_dispatch({.x = p->x[size_t(me)].view(),
                                                         .topk = TopkView::of(p->topk[size_t(me)]),
                                                         .return_recv_hook = me % 2 == 0}));
      MOED_RETURN_IF_ERROR(d.hook->wait());
      MOED_RETURN_IF_ERROR(check_dispatch(*p, me, d, false, false));
      Tensor y = expert_output(*p, me, d);
      MOED_ASSIGN_OR_RETURN(
          auto out,
          buffer.low_latency_combine(
              {.x = y.view(), .topk = TopkView::of(p->topk[size_t(me)]), .handle = d.handle}));
      return check_combine(*p, me, out.combined_x);
    });
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
}

}  // namespace
}  // namespace moed
