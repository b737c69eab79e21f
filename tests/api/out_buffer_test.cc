// Caller-owned combine outputs (CombineInput::out, NormalCombineInput::out,
// LowLatencyCombineInput::out) and dispatch rows (DispatchInput::out, NormalDispatchInput::out),
// for every dispatcher on both worlds: the result written into a strided caller buffer is bitwise
// the owning variant's, the bytes between its rows stay untouched, and a bad buffer on one rank is
// an InvalidArgument on every rank naming that rank and the value, with no rank's buffer written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "api/api_grid.h"
#include "dispatch/harness.h"
#include "moed/deep_ep.h"
#include "moed/dispatcher.h"
#include "moed/low_latency.h"
#include "support/low_latency_test.h"

namespace moed {
namespace {

using testing::Backend;

constexpr int kPad = 3;  // elements between the rows of a caller's buffer

// [rows, cols] with row_stride cols + kPad, every byte 0xff (a NaN pattern in f32 and bf16).
struct Sentinel {
  Tensor block;
  TensorView view;
  Sentinel(DType dt, int64_t rows, int64_t cols)
      : block(Tensor::empty(dt, rows, cols + kPad)),
        view(block.data(), dt, rows, cols, cols + kPad) {
    if (block.bytes() > 0) std::memset(block.data(), 0xff, block.bytes());
  }
  // The padding of every row (or, when `all`, every byte) is still 0xff.
  bool untouched(bool all = false) const {
    const auto* p = static_cast<const unsigned char*>(block.data());
    const size_t row = size_t(view.row_stride) * view.element_size();
    for (int64_t i = 0; i < view.rows; ++i) {
      for (size_t b = all ? 0 : view.row_bytes(); b < row; ++b)
        if (p[size_t(i) * row + b] != 0xff) return false;
    }
    return true;
  }
};

Status same_result(const TensorView& want, const Sentinel& got, const std::string& what) {
  if (!bitwise_equal(want, got.view))
    return internal_error(what, ": out differs from the owning result");
  if (!got.untouched()) return internal_error(what, ": bytes between out's rows were written");
  return ok_status();
}

// The error every rank must see when `bad_rank` passed `expect`.
Status expect_error(const Status& s, int bad_rank, const std::string& expect, const Sentinel& mine,
                    bool mine_bad, const std::string& what) {
  if (s.code() != StatusCode::kInvalidArgument)
    return internal_error(what, ": expected InvalidArgument, got ", s.to_string());
  const std::string want = str_cat("rank ", bad_rank, ": ", expect);
  if (s.message().find(want) == std::string::npos)
    return internal_error(what, ": '", s.message(), "' lacks '", want, "'");
  if (!mine_bad && !mine.untouched(/*all=*/true))
    return internal_error(what, ": out written by a rejected combine");
  return ok_status();
}

testing::DispatchCase make_case(int ranks, int g, DType dt) {
  testing::DispatchCase c = testing::api_case(ranks, g, 4, /*hidden=*/100, /*seed=*/7);
  c.dtype = dt;
  return c;
}

// R ranks, G per node, ETP P: odd sizes, two nodes, and ETP (which Flex has not).
struct GridWorld {
  int R, G, P;
};
constexpr GridWorld kGridWorlds[] = {{3, 0, 1}, {4, 2, 1}, {5, 0, 1}, {4, 0, 2}};

class CombineOut : public testing::BackendAndKindTest {};

TEST_P(CombineOut, SameBitsAndErrorsOnEveryRank) {
  const auto [backend, kind] = GetParam();
  for (GridWorld wc : kGridWorlds) {
    if (wc.P > 1 && kind == DispatcherKind::kFlex) continue;  // Flex has no ETP
    for (DType dt : {DType::kF32, DType::kBF16}) {
      for (bool weighted : {false, true}) {
        const testing::DispatchCase c = make_case(wc.R, wc.G, dt);
        const testing::CaseInput in = testing::make_case_input(c);
        const std::string name = str_cat(dispatcher_kind_name(kind), " R", wc.R, " G", wc.G, " P",
                                         wc.P, " ", dtype_name(dt), weighted ? " weighted" : "");
        Status s = testing::run_world(backend, wc.R, wc.G, [&](World& w) -> Status {
          const int r = w.rank(), R = w.size();
          DispatchConfig cfg{.kind = kind,
                             .num_experts = c.num_experts,
                             .etp_size = wc.P,
                             .weighted_combine = weighted};
          MOED_ASSIGN_OR_RETURN(auto d, TokenDispatcher::create(w, cfg));
          MOED_ASSIGN_OR_RETURN(DispatchOutput o,
                                d->dispatch({.hidden = in.hidden[size_t(r)].rows(),
                                             .topk = TopkView::of(in.topk[size_t(r)])}));
          MOED_ASSIGN_OR_RETURN(CombineOutput y1,
                                d->combine({.expert_output = o.expert_input, .handle = o.handle}));
          const int64_t T = in.topk[size_t(r)].num_tokens, H = c.hidden;
          Sentinel buf(dt, T, H);
          MOED_ASSIGN_OR_RETURN(
              CombineOutput y2,
              d->combine({.expert_output = o.expert_input, .handle = o.handle, .out = buf.view}));
          if (y2.hidden.rows() != 0 || y2.result().data != buf.view.data)
            return internal_error("rank ", r, ": the result is not the caller's buffer");
          if (y2.combined_probs != y1.combined_probs)
            return internal_error("rank ", r, ": combined_probs differ");
          MOED_RETURN_IF_ERROR(same_result(y1.hidden.view(), buf, str_cat("rank ", r)));
          // Through the three steps, too.
          Sentinel buf3(dt, T, H);
          MOED_RETURN_IF_ERROR(d->combine_preprocess(
              {.expert_output = o.expert_input, .handle = o.handle, .out = buf3.view}));
          MOED_ASSIGN_OR_RETURN(Request q, d->token_combine(/*async=*/true));
          MOED_RETURN_IF_ERROR(q->wait());
          MOED_RETURN_IF_ERROR(d->combine_postprocess().status());
          MOED_RETURN_IF_ERROR(same_result(y1.hidden.view(), buf3, str_cat("rank ", r, " steps")));

          // Bad buffers on the last rank: every rank's error, nobody's buffer written.
          const bool bad = r == R - 1;
          const int64_t T_last = c.tokens[size_t(R - 1)];
          const DType other = dt == DType::kF32 ? DType::kBF16 : DType::kF32;
          struct Bad {
            Sentinel buf;
            std::string expect;
          };
          Bad cases[] = {
              {Sentinel(dt, bad ? T + 1 : T, H),
               str_cat("out is [", T_last + 1, ", ", H, "]; expected [", T_last, ", ", H, "]")},
              {Sentinel(bad ? other : dt, T, H),
               str_cat("out dtype is ", dtype_name(other), "; expected ", dtype_name(dt),
                       " (the dtype of expert_output)")},
          };
          for (Bad& b : cases) {
            TensorView v = b.buf.view;
            Status e = d->combine({.expert_output = o.expert_input, .handle = o.handle, .out = v})
                           .status();
            MOED_RETURN_IF_ERROR(expect_error(e, R - 1, b.expect, b.buf, bad, str_cat("rank ", r)));
          }
          TensorView narrow = buf.view;
          narrow.row_stride = bad ? H - 1 : narrow.row_stride;
          Status e =
              d->combine({.expert_output = o.expert_input, .handle = o.handle, .out = narrow})
                  .status();
          if (e.message().find(str_cat("rank ", R - 1, ": out row_stride = ", H - 1)) ==
              std::string::npos)
            return internal_error("rank ", r, ": stride error: ", e.to_string());
          // The dispatcher still works.
          return d->combine({.expert_output = o.expert_input, .handle = o.handle}).status();
        });
        ASSERT_TRUE(s.ok()) << name << ": " << s.to_string();
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, CombineOut, testing::six_step_grid(), testing::six_step_grid_name);

// DispatchInput::out (the six-step dispatchers' expert_input in a caller's buffer): the same
// bits, probs and counts as the owning dispatch, the same combine after it, and a buffer with
// the wrong rows or dtype on the last rank is every rank's error with nobody's buffer written.
class DispatchOut : public testing::BackendAndKindTest {};

TEST_P(DispatchOut, SameBitsAndErrorsOnEveryRank) {
  const auto [backend, kind] = GetParam();
  for (GridWorld wc : kGridWorlds) {
    if (wc.P > 1 && kind == DispatcherKind::kFlex) continue;  // Flex has no ETP
    for (DType dt : {DType::kF32, DType::kBF16, DType::kFP8}) {
      testing::DispatchCase c = make_case(wc.R, wc.G, dt);
      if (dt == DType::kFP8) c.hidden = 256;  // a multiple of the fp8 block
      const testing::CaseInput in = testing::make_case_input(c);
      const std::string name = str_cat(dispatcher_kind_name(kind), " R", wc.R, " G", wc.G, " P",
                                       wc.P, " ", dtype_name(dt));
      Status s = testing::run_world(backend, wc.R, wc.G, [&](World& w) -> Status {
        const int r = w.rank(), R = w.size();
        const int64_t H = c.hidden;
        DispatchConfig cfg{.kind = kind, .num_experts = c.num_experts, .etp_size = wc.P};
        MOED_ASSIGN_OR_RETURN(auto d, TokenDispatcher::create(w, cfg));
        const DispatchInput base{.hidden = in.hidden[size_t(r)].rows(),
                                 .topk = TopkView::of(in.topk[size_t(r)])};
        MOED_ASSIGN_OR_RETURN(DispatchOutput o1, d->dispatch(base));
        const int64_t rows = o1.num_rows();
        Sentinel buf(dt, rows, H);
        DispatchInput with_out = base;
        with_out.out = buf.view;
        MOED_ASSIGN_OR_RETURN(DispatchOutput o2, d->dispatch(with_out));
        if (o2.expert_input.x.data != buf.view.data)
          return internal_error("rank ", r, ": expert_input is not the caller's buffer");
        MOED_RETURN_IF_ERROR(same_result(o1.expert_input.x, buf, str_cat("rank ", r)));
        if (dt == DType::kFP8 && !bitwise_equal(o1.expert_input.scales, o2.expert_input.scales))
          return internal_error("rank ", r, ": fp8 scales differ");
        if (!std::ranges::equal(o1.permuted_probs, o2.permuted_probs) ||
            !std::ranges::equal(o1.tokens_per_expert, o2.tokens_per_expert))
          return internal_error("rank ", r, ": permuted_probs or tokens_per_expert differ");
        if (dt != DType::kFP8) {
          MOED_ASSIGN_OR_RETURN(CombineOutput y1, d->combine({.expert_output = o1.expert_input.x,
                                                              .handle = o1.handle}));
          MOED_ASSIGN_OR_RETURN(CombineOutput y2, d->combine({.expert_output = o2.expert_input.x,
                                                              .handle = o2.handle}));
          if (!bitwise_equal(y1.hidden.view(), y2.hidden.view()))
            return internal_error("rank ", r, ": combine after dispatch(out) differs");
        }

        const bool bad = r == R - 1;
        const DType other = dt == DType::kF32 ? DType::kBF16 : DType::kF32;
        struct Bad {
          Sentinel buf;
          std::string expect;
        };
        Bad cases[] = {
            {Sentinel(dt, bad ? rows + 1 : rows, H), "out is ["},
            {Sentinel(bad ? other : dt, rows, H),
             str_cat("out dtype is ", dtype_name(other), "; expected ", dtype_name(dt),
                     " (the dtype of hidden)")},
        };
        for (Bad& b : cases) {
          DispatchInput bad_in = base;
          bad_in.out = b.buf.view;
          MOED_RETURN_IF_ERROR(expect_error(d->dispatch(bad_in).status(), R - 1, b.expect, b.buf,
                                            bad, str_cat("rank ", r)));
        }
        return d->dispatch(base).status();  // the dispatcher still works
      });
      ASSERT_TRUE(s.ok()) << name << ": " << s.to_string();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, DispatchOut, testing::six_step_grid(),
                         testing::six_step_grid_name);

// DeepEP's normal mode (rank-major) and low-latency combine, the same checks.
class DeepEpCombineOut : public ::testing::TestWithParam<Backend> {};

TEST_P(DeepEpCombineOut, RankMajorAndLowLatency) {
  for (auto [R, G] : {std::pair{3, 0}, std::pair{4, 2}, std::pair{5, 0}}) {
    const testing::DispatchCase c = make_case(R, G, DType::kBF16);
    const testing::CaseInput in = testing::make_case_input(c);
    Status s = testing::run_world(GetParam(), R, G, [&](World& w) -> Status {
      const int r = w.rank();
      const bool bad = r == R - 1;
      const int64_t T = in.topk[size_t(r)].num_tokens, H = c.hidden,
                    T_last = c.tokens[size_t(R - 1)];
      const TopkView topk = TopkView::of(in.topk[size_t(r)]);
      const TensorView x = in.hidden[size_t(r)].x.view();
      // Rank-major.
      MOED_ASSIGN_OR_RETURN(auto nb, deep_ep::NormalBuffer::create(w));
      MOED_ASSIGN_OR_RETURN(DispatchLayout layout, nb->get_dispatch_layout(topk, c.num_experts));
      MOED_ASSIGN_OR_RETURN(
          deep_ep::NormalDispatchOutput d,
          nb->dispatch({.x = {x, {}}, .topk = topk, .layout = deep_ep::LayoutView::of(layout)}));
      const TensorView bias = x;  // [T, H] bf16 home rows: a bias of the right shape
      MOED_ASSIGN_OR_RETURN(deep_ep::NormalCombineOutput y1,
                            nb->combine({.x = d.recv_x.x, .bias_0 = bias, .handle = d.handle}));
      Sentinel buf(DType::kBF16, T, H);
      MOED_ASSIGN_OR_RETURN(
          deep_ep::NormalCombineOutput y2,
          nb->combine({.x = d.recv_x.x, .bias_0 = bias, .handle = d.handle, .out = buf.view}));
      if (y2.combined_x.rows() != 0 || y2.result().data != buf.view.data)
        return internal_error("rank ", r, ": rank-major result is not the caller's buffer");
      MOED_RETURN_IF_ERROR(same_result(y1.combined_x.view(), buf, str_cat("rank-major rank ", r)));
      Sentinel wrong(DType::kBF16, bad ? T + 1 : T, H);
      MOED_RETURN_IF_ERROR(expect_error(
          nb->combine({.x = d.recv_x.x, .handle = d.handle, .out = wrong.view}).status(), R - 1,
          str_cat("out is [", T_last + 1, ", ", H, "]; expected [", T_last, ", ", H, "]"), wrong,
          bad, str_cat("rank-major rank ", r)));

      // Low-latency, with and without the hook.
      MOED_ASSIGN_OR_RETURN(auto ll, LowLatencyBuffer::create(w, 16, int(H), c.num_experts));
      for (bool hook : {false, true}) {
        MOED_ASSIGN_OR_RETURN(testing::LowLatencyRoundTrip l1,
                              testing::low_latency_round_trip(*ll, x, in.topk[size_t(r)], hook));
        const LowLatencyDispatchOutput& ld = l1.dispatch;
        Sentinel lbuf(DType::kBF16, T, H);
        MOED_ASSIGN_OR_RETURN(LowLatencyCombineOutput l2,
                              ll->low_latency_combine({.x = ld.recv.x,
                                                       .topk = TopkView::of(in.topk[size_t(r)]),
                                                       .handle = ld.handle,
                                                       .return_recv_hook = hook,
                                                       .out = lbuf.view}));
        MOED_RETURN_IF_ERROR(l2.hook->wait());
        if (l2.combined_x.rows() != 0 || l2.result().data != lbuf.view.data)
          return internal_error("rank ", r, ": low-latency result is not the caller's buffer");
        MOED_RETURN_IF_ERROR(same_result(l1.combine.combined_x.view(), lbuf,
                                         str_cat("low-latency rank ", r, " hook ", hook)));
        Sentinel lwrong(bad ? DType::kF32 : DType::kBF16, T, H);
        MOED_RETURN_IF_ERROR(expect_error(
            ll->low_latency_combine({.x = ld.recv.x,
                                     .topk = TopkView::of(in.topk[size_t(r)]),
                                     .handle = ld.handle,
                                     .out = lwrong.view})
                .status(),
            R - 1, "low_latency_combine: out dtype is f32; expected bf16 (the dtype of x)", lwrong,
            bad, str_cat("low-latency rank ", r)));
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << "R " << R << " G " << G << ": " << s.to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, DeepEpCombineOut, ::testing::ValuesIn(testing::backends()),
                         testing::backend_param_name<::testing::TestParamInfo<Backend>>);

// DeepEP's normal dispatch into a caller's recv_x (NormalDispatchInput::out), sized by
// num_worst_tokens or by a cached handle: the same bits as moed's own recv_x, the padding
// between rows untouched, and a bad buffer (or one with no size known up front) an error on
// every rank with no buffer written.
class DeepEpDispatchOut : public ::testing::TestWithParam<Backend> {};

TEST_P(DeepEpDispatchOut, WorstTokensAndCached) {
  for (auto [R, G] : {std::pair{3, 0}, std::pair{4, 2}, std::pair{5, 0}}) {
    for (DType dt : {DType::kBF16, DType::kF32}) {
      const testing::DispatchCase c = make_case(R, G, dt);
      const testing::CaseInput in = testing::make_case_input(c);
      int64_t W = 1;  // every token at most once per receiver
      for (int64_t n : c.tokens) W += n;
      Status s = testing::run_world(GetParam(), R, G, [&](World& w) -> Status {
        const int r = w.rank();
        const bool bad = r == R - 1;
        const int64_t H = c.hidden;
        const std::string name = str_cat("R", R, " G", G, " ", dtype_name(dt), " rank ", r);
        const TopkView topk = TopkView::of(in.topk[size_t(r)]);
        const TokenRows x{in.hidden[size_t(r)].x.view(), {}};
        MOED_ASSIGN_OR_RETURN(auto nb, deep_ep::NormalBuffer::create(w));
        MOED_ASSIGN_OR_RETURN(DispatchLayout layout, nb->get_dispatch_layout(topk, c.num_experts));
        const deep_ep::NormalDispatchInput base{
            .x = x, .topk = topk, .layout = deep_ep::LayoutView::of(layout), .num_worst_tokens = W};
        MOED_ASSIGN_OR_RETURN(deep_ep::NormalDispatchOutput d1, nb->dispatch(base));
        const std::vector<int64_t> idx1(d1.recv_topk_idx.begin(), d1.recv_topk_idx.end());
        MOED_ASSIGN_OR_RETURN(deep_ep::NormalCombineOutput y1,
                              nb->combine({.x = d1.recv_x.x, .handle = d1.handle}));

        Sentinel buf(dt, W, H);
        deep_ep::NormalDispatchInput with_out = base;
        with_out.out = buf.view;
        MOED_ASSIGN_OR_RETURN(deep_ep::NormalDispatchOutput d2, nb->dispatch(with_out));
        if (d2.recv_x.x.data != buf.view.data)
          return internal_error(name, ": recv_x is not the caller's buffer");
        MOED_RETURN_IF_ERROR(same_result(d1.recv_x.x, buf, name));
        if (!std::equal(idx1.begin(), idx1.end(), d2.recv_topk_idx.begin(), d2.recv_topk_idx.end()))
          return internal_error(name, ": recv_topk_idx differs");
        MOED_ASSIGN_OR_RETURN(deep_ep::NormalCombineOutput y2,
                              nb->combine({.x = d2.recv_x.x, .handle = d2.handle}));
        if (!bitwise_equal(y1.combined_x.view(), y2.combined_x.view()))
          return internal_error(name, ": combine of the caller's recv_x differs");

        // Cached: the handle gives the rows.
        const int64_t rows = d1.handle->num_rows;
        MOED_ASSIGN_OR_RETURN(deep_ep::NormalDispatchOutput c1,
                              nb->dispatch({.x = x, .handle = d1.handle}));
        Sentinel cbuf(dt, rows, H);
        MOED_ASSIGN_OR_RETURN(deep_ep::NormalDispatchOutput c2,
                              nb->dispatch({.x = x, .handle = d1.handle, .out = cbuf.view}));
        if (c2.recv_x.x.data != cbuf.view.data)
          return internal_error(name, ": cached recv_x is not the caller's buffer");
        MOED_RETURN_IF_ERROR(same_result(c1.recv_x.x, cbuf, name + " cached"));

        // No size known before the count exchange: every rank's error, on every rank.
        deep_ep::NormalDispatchInput unsized = with_out;
        unsized.num_worst_tokens = 0;
        Sentinel ubuf(dt, W, H);
        unsized.out = ubuf.view;
        Status e = nb->dispatch(unsized).status();
        if (e.code() != StatusCode::kInvalidArgument ||
            e.message().find("out needs num_worst_tokens > 0 or a cached handle") ==
                std::string::npos)
          return internal_error(name, ": unsized out: ", e.to_string());
        if (!ubuf.untouched(/*all=*/true)) return internal_error(name, ": unsized out written");
        // A wrong shape on the last rank.
        Sentinel wrong(dt, bad ? W + 1 : W, H);
        deep_ep::NormalDispatchInput wrong_in = base;
        wrong_in.out = wrong.view;
        MOED_RETURN_IF_ERROR(
            expect_error(nb->dispatch(wrong_in).status(), R - 1,
                         str_cat("out is [", W + 1, ", ", H, "]; expected [", W, ", ", H, "]"),
                         wrong, bad, name));
        // The buffer still works.
        return nb->dispatch(base).status();
      });
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, DeepEpDispatchOut, ::testing::ValuesIn(testing::backends()),
                         testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed
