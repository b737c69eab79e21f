// Low-latency dispatch and combine on both worlds, against the reference (design.md §3, §6):
// rows, counts, layout ranges and source indices of every expert equal the reference's
// canonical layout; FP8 rows and scales equal quantize_fp8_row of the source row; combine
// equals the reference's weighted combine bit for bit; the hook mode equals the one-call mode.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "low_latency/low_latency_test_util.h"
#include "moed/dispatch_layout.h"

namespace moed {
namespace {

using namespace low_latency_test;  // NOLINT: Problem, Case, make_problem, the checks, ...
using ::moed::testing::run_world;

std::vector<Case> sweep() {
  return {
      {1, 0, 4, 256, 2, 8, 11},       {2, 0, 4, 256, 4, 6, 12},   // K = E
      {2, 1, 6, 128, 1, 5, 13},       {3, 0, 6, 256, 3, 7, 14},   // K = 1 over the network
      {3, 1, 9, 128, 2, 4, 15},       {4, 2, 8, 256, 3, 9, 16},   // 2 nodes x 2
      {4, 0, 8, 128, 2, 6, 17, true}, {8, 4, 16, 128, 4, 5, 18},  // skewed; 2 nodes x 4
      {8, 2, 8, 256, 2, 4, 19},       {8, 0, 24, 128, 5, 3, 20},
      {4, 2, 8, 4096, 3, 48, 21},  // rows enough to be read in place, not copied first
  };
}

TEST_P(LowLatencyTest, DispatchAndCombineMatchTheReference) {
  for (const Case& c : sweep()) {
    SCOPED_TRACE(::testing::Message() << "R=" << c.ranks << " G=" << c.per_node
                                      << " E=" << c.num_experts << " seed=" << c.seed);
    // Three problems through one buffer: halves flip, counts and slots are reused.
    std::vector<Problem> problems;
    for (uint32_t round = 0; round < 3; ++round) {
      Case r = c;
      r.seed = c.seed * 100 + round;
      auto p = make_problem(r);
      ASSERT_TRUE(p.ok()) << p.status().to_string();
      problems.push_back(std::move(p).value());
    }
    Status s = run_with_buffer(GetParam(), c, [&](World& w, LowLatencyBuffer& buffer) -> Status {
      for (size_t round = 0; round < problems.size(); ++round) {
        const Problem& p = problems[round];
        const int me = w.rank();
        for (int mode = 0; mode < 4; ++mode) {
          const bool fp8 = mode >= 2, round_scale = mode == 3, hook = mode % 2 == 1;
          MOED_ASSIGN_OR_RETURN(
              LowLatencyDispatchOutput d,
              buffer.low_latency_dispatch({.x = p.x[size_t(me)].view(),
                                           .topk = TopkView::of(p.topk[size_t(me)]),
                                           .use_fp8 = fp8,
                                           .round_scale = round_scale,
                                           .return_recv_hook = hook}));
          if (!d.hook) return internal_error("hook is null");
          if (hook == d.hook->ready()) return internal_error("hook ready() = ", d.hook->ready());
          if (hook) MOED_RETURN_IF_ERROR(d.hook->wait());
          Status ds = check_dispatch(p, me, d, fp8, round_scale);
          if (!ds.ok()) return ds.with_context(str_cat("round ", round, " mode ", mode));
          Tensor y = expert_output(p, me, d);
          MOED_ASSIGN_OR_RETURN(
              LowLatencyCombineOutput out,
              buffer.low_latency_combine({.x = y.view(),
                                          .topk = TopkView::of(p.topk[size_t(me)]),
                                          .handle = d.handle,
                                          .return_recv_hook = hook}));
          if (hook) MOED_RETURN_IF_ERROR(out.hook->wait());
          Status cs = check_combine(p, me, out.combined_x);
          if (!cs.ok()) return cs.with_context(str_cat("round ", round, " mode ", mode));
        }
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
}

// A copy of t's rows with row_stride = cols + 3 (the pad NaN bits), kept in *keep.
TensorView strided_copy(const Tensor& t, Tensor* keep) {
  *keep = Tensor::empty(t.dtype(), t.rows(), t.cols() + 3);
  TensorView v(keep->data(), t.dtype(), t.rows(), t.cols(), t.cols() + 3);
  for (int64_t i = 0; i < t.rows(); ++i) {
    for (int64_t h = 0; h < t.cols() + 3; ++h) keep->row<bf16>(i)[h] = bf16{0x7fc0};
    std::memcpy(v.row_ptr(i), t.row<bf16>(i), size_t(t.cols()) * 2);
  }
  return v;
}

// The corners the sweep leaves out: R = 5 and 7, every rank with T = 0, hidden sizes that are
// not a multiple of 16 (bf16 only; FP8 needs H % 128 == 0), strided x and expert outputs, and
// rows enough that the receive streams them, several side by side.
TEST_P(LowLatencyTest, EdgesMatchTheReference) {
  const Case cases[] = {
      {5, 0, 10, 17, 2, 4, 41},
      {7, 0, 7, 100, 1, 3, 42},
      {5, 1, 5, 128, 5, 3, 43},
      {7, 0, 14, 4099, 2, 2, 44},
      {3, 0, 6, 128, 2, 4, 45, false, true},
      {5, 0, 5, 17, 2, 3, 46, false, true},
      {2, 0, 4, 4104, 2, 1024, 47},  // a receive past the size at which rows stream
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "R=" << c.ranks << " G=" << c.per_node << " E="
                                      << c.num_experts << " H=" << c.hidden << " seed=" << c.seed);
    auto p = make_problem(c);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    Status s = run_with_buffer(GetParam(), c, [&](World& w, LowLatencyBuffer& buffer) -> Status {
      const int me = w.rank();
      Tensor x_keep;
      const TensorView x = strided_copy(p->x[size_t(me)], &x_keep);
      for (int mode = 0; mode < 4; ++mode) {
        const bool fp8 = mode >= 2, hook = mode % 2 == 1;
        if (fp8 && c.hidden % kFp8BlockSize != 0) continue;
        MOED_ASSIGN_OR_RETURN(
            LowLatencyDispatchOutput d,
            buffer.low_latency_dispatch({.x = x,
                                         .topk = TopkView::of(p->topk[size_t(me)]),
                                         .use_fp8 = fp8,
                                         .return_recv_hook = hook}));
        if (hook) MOED_RETURN_IF_ERROR(d.hook->wait());
        Status ds = check_dispatch(*p, me, d, fp8, false);
        if (!ds.ok()) return ds.with_context(str_cat("mode ", mode));
        Tensor y_keep;
        const TensorView y = strided_copy(expert_output(*p, me, d), &y_keep);
        MOED_ASSIGN_OR_RETURN(LowLatencyCombineOutput out,
                              buffer.low_latency_combine({.x = y,
                                                          .topk = TopkView::of(p->topk[size_t(me)]),
                                                          .handle = d.handle,
                                                          .return_recv_hook = hook}));
        if (hook) MOED_RETURN_IF_ERROR(out.hook->wait());
        Status cs = check_combine(*p, me, out.combined_x);
        if (!cs.ok()) return cs.with_context(str_cat("mode ", mode));
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
}

// Once a call has returned (dispatch: its send phase; combine: the call or its hook), no peer
// reads its input rows any more: each rank overwrites its tokens and expert outputs right after,
// and every rank's result is still the reference's. T = 1 on the last rank and 0 on rank 0
// (max_tokens 1), one node and two (in-node peers read each other's memory in the threads world;
// other nodes get messages). The last case has rows enough (over 64 KiB a rank) that in-node peers
// read the caller's own rows and acks are waited for; a dispatch of fewer copies them first.
TEST_P(LowLatencyTest, RowsMayBeReusedOnceTheCallReturns) {
  for (const Case& c : {Case{3, 0, 6, 128, 2, 1, 51}, Case{4, 2, 8, 256, 3, 1, 52},
                        Case{5, 0, 10, 100, 4, 3, 53}, Case{3, 0, 6, 4096, 3, 48, 54}}) {
    SCOPED_TRACE(::testing::Message() << "R=" << c.ranks << " G=" << c.per_node);
    auto p = make_problem(c);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    Status s = run_with_buffer(GetParam(), c, [&](World& w, LowLatencyBuffer& buffer) -> Status {
      const int me = w.rank();
      auto scribble = [](Tensor& t) {
        for (int64_t i = 0; i < t.rows(); ++i) {
          for (int64_t h = 0; h < t.cols(); ++h) t.row<bf16>(i)[h] = bf16{0x7fc0};
        }
      };
      for (int mode = 0; mode < 4; ++mode) {
        const bool fp8 = mode >= 2, hook = mode % 2 == 1;
        if (fp8 && c.hidden % kFp8BlockSize != 0) continue;
        Tensor x = Tensor::copy_of(p->x[size_t(me)].view());
        MOED_ASSIGN_OR_RETURN(
            LowLatencyDispatchOutput d,
            buffer.low_latency_dispatch({.x = x.view(),
                                         .topk = TopkView::of(p->topk[size_t(me)]),
                                         .use_fp8 = fp8,
                                         .return_recv_hook = hook}));
        // DeepEP's contract: dispatch's x is free once the send phase has returned.
        scribble(x);
        if (hook) MOED_RETURN_IF_ERROR(d.hook->wait());
        MOED_RETURN_IF_ERROR(w.barrier());  // every rank has scribbled before anyone checks
        Status ds = check_dispatch(*p, me, d, fp8, false);
        if (!ds.ok()) return ds.with_context(str_cat("mode ", mode));
        Tensor y = expert_output(*p, me, d);
        MOED_ASSIGN_OR_RETURN(LowLatencyCombineOutput out,
                              buffer.low_latency_combine({.x = y.view(),
                                                          .topk = TopkView::of(p->topk[size_t(me)]),
                                                          .handle = d.handle,
                                                          .return_recv_hook = hook}));
        if (hook) MOED_RETURN_IF_ERROR(out.hook->wait());
        scribble(y);
        MOED_RETURN_IF_ERROR(w.barrier());
        Status cs = check_combine(*p, me, out.combined_x);
        if (!cs.ok()) return cs.with_context(str_cat("mode ", mode));
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
}

// Across nodes a token goes to a rank once, however many of its experts take it
// (design.md §6.5): rank 0's one token, bound for experts 2, 3 and 0, reaches rank 1 (experts 2
// and 3, on the other node) as one message of a token header, two entries and the row; rank 1
// receives it as both experts' row 0.
TEST_P(LowLatencyTest, ATokenCrossesToARankOnceForAllItsExperts) {
  constexpr int kHidden = 256, kExperts = 4;
  Status s = run_world(GetParam(), 2, 1, [&](World& w) -> Status {
    MOED_ASSIGN_OR_RETURN(auto buffer, LowLatencyBuffer::create(w, 1, kHidden, kExperts));
    const int64_t T = w.rank() == 0 ? 1 : 0;
    Tensor x = Tensor::zeros(DType::kBF16, T, kHidden);
    auto* xs = static_cast<bf16*>(x.data());
    for (int64_t h = 0; h < T * kHidden; ++h) xs[h] = float_to_bf16(float(h % 13) - 6.0f);
    // Bytes on the network beside the rows (headers, the call's collective): a call whose
    // token stays home, then the one measured.
    auto sent_by = [&](std::vector<int32_t> experts) -> StatusOr<uint64_t> {
      TopkRouting topk{T, 3, {}, {}};
      if (T == 1) topk = {1, 3, std::move(experts), {0.5f, 0.25f, 0.25f}};
      w.reset_counters();
      MOED_ASSIGN_OR_RETURN(
          LowLatencyDispatchOutput out,
          buffer->low_latency_dispatch({.x = x.view(), .topk = TopkView::of(topk)}));
      return w.counters().network_bytes;
    };
    MOED_ASSIGN_OR_RETURN(const uint64_t home, sent_by({0, 1, -1}));
    TopkRouting topk{T, 3, {}, {}};
    if (T == 1) topk = {1, 3, {2, 3, 0}, {0.5f, 0.25f, 0.25f}};
    w.reset_counters();
    MOED_ASSIGN_OR_RETURN(
        LowLatencyDispatchOutput d,
        buffer->low_latency_dispatch({.x = x.view(), .topk = TopkView::of(topk)}));
    const uint64_t sent = w.counters().network_bytes - home;
    const uint64_t message = kFlexTokenHeaderBytes + 2 * kFlexEntryBytes + kHidden * sizeof(bf16);
    if (sent != (w.rank() == 0 ? message : 0)) {
      return internal_error("rank ", w.rank(), " sent ", sent, " network bytes for its rows");
    }
    if (w.rank() == 1) {
      for (int j = 0; j < 2; ++j) {
        const int64_t row = j * d.rows_per_expert;
        if (d.recv_count[size_t(j)] != 1 || d.src_info[size_t(row)] != 0) {
          return internal_error("expert ", 2 + j, " received ", d.recv_count[size_t(j)], " rows");
        }
        for (int h = 0; h < kHidden; ++h) {
          const float got = bf16_to_float(static_cast<const bf16*>(d.recv.x.row_ptr(row))[h]);
          if (got != float(h % 13) - 6.0f) return internal_error("expert ", 2 + j, " element ", h);
        }
      }
    }
    return ok_status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

TEST(LowLatencySizeHint, CoversTheSlots) {
  // Per half: dispatch [E*M] rows of H bf16 + scales + indices + probs, combine [E*M] rows of
  // H bf16; and shrink mode's: the layout [L][R] per half and 13 + R words.
  const size_t rows = 256 * 128;
  const size_t hint = get_low_latency_size_hint(128, 7168, 8, 256);
  EXPECT_GE(hint, 2 * (rows * 7168 * 2 * 2 + rows * 56 * 4 + rows * 8));
  EXPECT_LE(hint, 2 * (rows * 7168 * 2 * 2 + rows * 56 * 4 + rows * 8) + 2 * 7 * 64 + 2 * 256 * 8 +
                      2 * 32 * 8 * 8 + (13 + 8) * 8 + 64);
  EXPECT_EQ(get_low_latency_size_hint(0, 7168, 8, 256), 0u);
}

}  // namespace
}  // namespace moed
