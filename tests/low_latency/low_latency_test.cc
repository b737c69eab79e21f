// Low-latency dispatch and combine on both worlds, against the reference (spec §3, §4, §6):
// rows, counts, layout ranges and source indices of every expert equal the reference's
// canonical layout; FP8 rows and scales equal quantize_fp8_row of the source row; combine
// equals the reference's weighted combine bit for bit; the hook mode equals the one-call mode;
// two operations in flight keep their own halves; bad input fails on every rank.
#include "moed/low_latency.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "moed/reference.h"
#include "moed/routing.h"
#include "support/world_test.h"

namespace moed {
namespace {

using ::moed::testing::Backend;
using ::moed::testing::run_world;

// The global problem: every rank builds all of it from the seed and uses its own part.
struct Problem {
  int ranks = 1, num_experts = 0, hidden = 0, num_topk = 0;
  int64_t max_tokens = 0;
  std::vector<Tensor> x;          // per rank [T_s, H] bf16
  std::vector<TopkRouting> topk;  // per rank
  std::vector<Tensor> y;          // per rank: expert outputs in the canonical layout
  std::vector<ReferenceRankDispatch> ref;
  std::vector<Tensor> ref_out;  // per rank: weighted combine [T_s, H] bf16
};

struct Case {
  int ranks, per_node, num_experts, hidden, num_topk;
  int64_t max_tokens;
  uint32_t seed;
  bool skewed = false;     // every token's first expert is expert 0
  bool all_empty = false;  // every rank has T = 0
};

bf16 random_bf16(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  return float_to_bf16(u(rng) * std::ldexp(1.0f, int(rng() % 9) - 4));
}

StatusOr<Problem> make_problem(const Case& c) {
  Problem p;
  p.ranks = c.ranks;
  p.num_experts = c.num_experts;
  p.hidden = c.hidden;
  p.num_topk = c.num_topk;
  p.max_tokens = c.max_tokens;
  std::mt19937 rng(c.seed);
  ReferenceProblem rp;
  rp.num_experts = c.num_experts;
  rp.ep_size = c.ranks;
  rp.weighted_combine = true;
  rp.num_topk = c.num_topk;
  for (int s = 0; s < c.ranks; ++s) {
    // Token counts from 0 to max_tokens: rank 0 has none, the last rank is full.
    int64_t T = c.all_empty             ? 0
                : s == 0 && c.ranks > 1 ? 0
                : s == c.ranks - 1      ? c.max_tokens
                                        : int64_t(rng() % uint32_t(c.max_tokens + 1));
    Tensor x = Tensor::empty(DType::kBF16, T, c.hidden);
    for (int64_t t = 0; t < T; ++t) {
      for (int h = 0; h < c.hidden; ++h) x.row<bf16>(t)[h] = random_bf16(rng);
    }
    TopkRouting r;
    r.num_tokens = T;
    r.num_topk = c.num_topk;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> experts(size_t(c.num_experts));
      for (int e = 0; e < c.num_experts; ++e) experts[size_t(e)] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      if (c.skewed) std::swap(experts[0], *std::find(experts.begin(), experts.end(), 0));
      for (int k = 0; k < c.num_topk; ++k) {
        // About one entry in six is -1 (no expert), as DeepEP allows.
        const bool drop = !c.skewed && rng() % 6 == 0;
        r.topk_idx.push_back(drop ? -1 : experts[size_t(k)]);
        r.topk_weights.push_back(float(rng() % 1000) / 256.0f);
      }
    }
    rp.routing.push_back(to_map(r, c.num_experts));
    p.x.push_back(std::move(x));
    p.topk.push_back(std::move(r));
  }
  for (int s = 0; s < c.ranks; ++s) rp.hidden.push_back(TokenRows{p.x[size_t(s)].view(), {}});
  MOED_ASSIGN_OR_RETURN(p.ref, reference_dispatch(rp));
  std::vector<TensorView> ys;
  for (int r = 0; r < c.ranks; ++r) {
    const int64_t rows = p.ref[size_t(r)].expert_input.x.rows();
    Tensor y = Tensor::empty(DType::kBF16, rows, c.hidden);
    for (int64_t i = 0; i < rows; ++i) {
      for (int h = 0; h < c.hidden; ++h) y.row<bf16>(i)[h] = random_bf16(rng);
    }
    ys.push_back(y.view());
    p.y.push_back(std::move(y));
  }
  MOED_ASSIGN_OR_RETURN(p.ref_out, reference_combine(rp, ys));
  return p;
}

// Checks one rank's dispatch output against the reference.
Status check_dispatch(const Problem& p, int rank, const LowLatencyDispatchOutput& d, bool fp8,
                      bool round_scale) {
  const ReferenceRankDispatch& ref = p.ref[size_t(rank)];
  const int L = p.num_experts / p.ranks, H = p.hidden, S = H / kFp8BlockSize;
  if (d.num_local_experts != L || d.rows_per_expert != p.ranks * p.max_tokens) {
    return internal_error("rank ", rank, ": output shape L = ", d.num_local_experts);
  }
  if (d.recv.x.dtype != (fp8 ? DType::kFP8 : DType::kBF16)) return internal_error("recv dtype");
  int64_t off = 0;
  std::vector<fp8_e4m3> q(static_cast<size_t>(H));
  std::vector<float> scales(static_cast<size_t>(S));
  for (int j = 0; j < L; ++j) {
    const int64_t n = ref.tokens_per_expert[size_t(j)];
    if (d.recv_count[size_t(j)] != n) {
      return internal_error("rank ", rank, ": recv_count[", j, "] = ", d.recv_count[size_t(j)],
                            ", reference ", n);
    }
    int32_t begin = 0;
    for (int s = 0; s < p.ranks; ++s) {
      int32_t count = 0;
      for (int64_t i = 0; i < n; ++i) count += ref.row_src_rank[size_t(off + i)] == s;
      const LowLatencyRange got = d.layout_range[size_t(j) * p.ranks + s];
      if (got.begin != begin || got.count != count) {
        return internal_error("rank ", rank, ": layout_range[", j, "][", s, "] = (", got.begin,
                              ", ", got.count, "), expected (", begin, ", ", count, ")");
      }
      begin += count;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = j * d.rows_per_expert + i;
      const int32_t s = ref.row_src_rank[size_t(off + i)], t = ref.row_src_token[size_t(off + i)];
      if (d.src_info[size_t(row)] != t) {
        return internal_error("rank ", rank, ": src_info of expert ", j, " row ", i, " = ",
                              d.src_info[size_t(row)], ", reference ", t);
      }
      if (std::memcmp(&d.recv_probs[size_t(row)], &ref.permuted_probs[size_t(off + i)], 4) != 0) {
        return internal_error("rank ", rank, ": recv_probs of expert ", j, " row ", i, " = ",
                              d.recv_probs[size_t(row)], ", reference ",
                              ref.permuted_probs[size_t(off + i)]);
      }
      if (!fp8) {
        if (std::memcmp(d.recv.x.row_ptr(row), ref.expert_input.x.row<bf16>(off + i),
                        size_t(H) * 2) != 0) {
          return internal_error("rank ", rank, ": bf16 row ", i, " of expert ", j, " differs");
        }
        continue;
      }
      quantize_fp8_row(std::span<const bf16>(p.x[size_t(s)].row<bf16>(t), size_t(H)), round_scale,
                       q, scales);
      if (std::memcmp(d.recv.x.row_ptr(row), q.data(), size_t(H)) != 0 ||
          std::memcmp(d.recv.scales.row_ptr(row), scales.data(), size_t(S) * 4) != 0) {
        return internal_error("rank ", rank, ": fp8 row ", i, " of expert ", j,
                              " differs from quantize_fp8_row of (", s, ", ", t, ")");
      }
    }
    off += n;
  }
  return ok_status();
}

// Expert outputs in the low-latency layout: the reference's rows of expert j at its packed
// rows, NaN in every unused slot (combine must never read them).
Tensor expert_output(const Problem& p, int rank, const LowLatencyDispatchOutput& d) {
  const ReferenceRankDispatch& ref = p.ref[size_t(rank)];
  const int L = p.num_experts / p.ranks;
  Tensor y = Tensor::empty(DType::kBF16, L * d.rows_per_expert, p.hidden);
  for (int64_t i = 0; i < y.rows(); ++i) {
    for (int h = 0; h < p.hidden; ++h) y.row<bf16>(i)[h] = bf16{0x7fc0};
  }
  int64_t off = 0;
  for (int j = 0; j < L; ++j) {
    for (int64_t i = 0; i < ref.tokens_per_expert[size_t(j)]; ++i) {
      std::memcpy(y.row<bf16>(j * d.rows_per_expert + i), p.y[size_t(rank)].row<bf16>(off + i),
                  size_t(p.hidden) * 2);
    }
    off += ref.tokens_per_expert[size_t(j)];
  }
  return y;
}

Status check_combine(const Problem& p, int rank, const Tensor& out) {
  if (!bitwise_equal(out.view(), p.ref_out[size_t(rank)].view())) {
    return internal_error("rank ", rank, ": combine differs from the reference's weighted combine");
  }
  return ok_status();
}

// Runs body on every rank of case c with a LowLatencyBuffer sized for c.
Status run_with_buffer(Backend backend, const Case& c,
                       const std::function<Status(World&, LowLatencyBuffer&)>& body) {
  return run_world(backend, c.ranks, c.per_node, [&](World& w) -> Status {
    MOED_ASSIGN_OR_RETURN(auto buffer,
                          LowLatencyBuffer::create(w, c.max_tokens, c.hidden, c.num_experts));
    return body(w, *buffer);
  });
}

// Two problems of c's shape (the second from seed + 1000), for two operations in flight.
StatusOr<std::array<Problem, 2>> two_problems(const Case& c) {
  Case c2 = c;
  c2.seed += 1000;
  MOED_ASSIGN_OR_RETURN(Problem a, make_problem(c));
  MOED_ASSIGN_OR_RETURN(Problem b, make_problem(c2));
  return std::array<Problem, 2>{std::move(a), std::move(b)};
}

class LowLatencyTest : public ::testing::TestWithParam<Backend> {};

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
          MOED_ASSIGN_OR_RETURN(LowLatencyDispatchOutput d,
                                buffer.low_latency_dispatch({.x = p.x[size_t(me)].view(),
                                                             .topk = &p.topk[size_t(me)],
                                                             .use_fp8 = fp8,
                                                             .round_scale = round_scale,
                                                             .return_recv_hook = hook}));
          if (!d.hook) return internal_error("hook is null");
          if (hook == d.hook->ready()) return internal_error("hook ready() = ", d.hook->ready());
          if (hook) MOED_RETURN_IF_ERROR(d.hook->wait());
          Status ds = check_dispatch(p, me, d, fp8, round_scale);
          if (!ds.ok()) return ds.with_context(str_cat("round ", round, " mode ", mode));
          Tensor y = expert_output(p, me, d);
          MOED_ASSIGN_OR_RETURN(LowLatencyCombineOutput out,
                                buffer.low_latency_combine({.x = y.view(),
                                                            .topk = &p.topk[size_t(me)],
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
        MOED_ASSIGN_OR_RETURN(auto da, buffer.low_latency_dispatch({.x = a->x[size_t(me)].view(),
                                                                    .topk = &a->topk[size_t(me)],
                                                                    .use_fp8 = round == 1,
                                                                    .return_recv_hook = true}));
        MOED_ASSIGN_OR_RETURN(auto db, buffer.low_latency_dispatch({.x = b->x[size_t(me)].view(),
                                                                    .topk = &b->topk[size_t(me)],
                                                                    .return_recv_hook = true}));
        // A third dispatch before the first is received is refused on every rank.
        auto third = buffer.low_latency_dispatch(
            {.x = a->x[size_t(me)].view(), .topk = &a->topk[size_t(me)]});
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
        MOED_ASSIGN_OR_RETURN(auto ca, buffer.low_latency_combine({.x = va,
                                                                   .topk = &a->topk[size_t(me)],
                                                                   .handle = da.handle,
                                                                   .return_recv_hook = true}));
        MOED_ASSIGN_OR_RETURN(auto cb, buffer.low_latency_combine({.x = vb,
                                                                   .topk = &b->topk[size_t(me)],
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
    MOED_ASSIGN_OR_RETURN(auto da, buffer.low_latency_dispatch({.x = a->x[size_t(me)].view(),
                                                                .topk = &a->topk[size_t(me)],
                                                                .return_recv_hook = true}));
    MOED_ASSIGN_OR_RETURN(auto db, buffer.low_latency_dispatch({.x = b->x[size_t(me)].view(),
                                                                .topk = &b->topk[size_t(me)],
                                                                .return_recv_hook = true}));
    MOED_RETURN_IF_ERROR(in_order(da.hook, db.hook));
    MOED_RETURN_IF_ERROR(check_dispatch(*a, me, da, false, false));
    MOED_RETURN_IF_ERROR(check_dispatch(*b, me, db, false, false));
    Tensor ya = expert_output(*a, me, da), yb = expert_output(*b, me, db);
    MOED_ASSIGN_OR_RETURN(auto ca, buffer.low_latency_combine({.x = ya.view(),
                                                               .topk = &a->topk[size_t(me)],
                                                               .handle = da.handle,
                                                               .return_recv_hook = true}));
    MOED_ASSIGN_OR_RETURN(auto cb, buffer.low_latency_combine({.x = yb.view(),
                                                               .topk = &b->topk[size_t(me)],
                                                               .handle = db.handle,
                                                               .return_recv_hook = true}));
    MOED_RETURN_IF_ERROR(in_order(ca.hook, cb.hook));
    MOED_RETURN_IF_ERROR(check_combine(*a, me, ca.combined_x));
    return check_combine(*b, me, cb.combined_x);
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
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
// not a multiple of 16 (bf16 only; FP8 needs H % 128 == 0), and strided x and expert outputs.
TEST_P(LowLatencyTest, EdgesMatchTheReference) {
  const Case cases[] = {
      {5, 0, 10, 17, 2, 4, 41},
      {7, 0, 7, 100, 1, 3, 42},
      {5, 1, 5, 128, 5, 3, 43},
      {7, 0, 14, 4099, 2, 2, 44},
      {3, 0, 6, 128, 2, 4, 45, false, true},
      {5, 0, 5, 17, 2, 3, 46, false, true},
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
            buffer.low_latency_dispatch(
                {.x = x, .topk = &p->topk[size_t(me)], .use_fp8 = fp8, .return_recv_hook = hook}));
        if (hook) MOED_RETURN_IF_ERROR(d.hook->wait());
        Status ds = check_dispatch(*p, me, d, fp8, false);
        if (!ds.ok()) return ds.with_context(str_cat("mode ", mode));
        Tensor y_keep;
        const TensorView y = strided_copy(expert_output(*p, me, d), &y_keep);
        MOED_ASSIGN_OR_RETURN(LowLatencyCombineOutput out,
                              buffer.low_latency_combine({.x = y,
                                                          .topk = &p->topk[size_t(me)],
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
        MOED_ASSIGN_OR_RETURN(LowLatencyDispatchOutput d,
                              buffer.low_latency_dispatch({.x = x.view(),
                                                           .topk = &p->topk[size_t(me)],
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
                                                          .topk = &p->topk[size_t(me)],
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
      return buffer->low_latency_dispatch({.x = x.view(), .topk = &r, .use_fp8 = fp8}).status();
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
  expect_error(
      GetParam(),
      [](World& w) -> Status {
        MOED_ASSIGN_OR_RETURN(auto buffer, LowLatencyBuffer::create(w, 4, 128, 8));
        Tensor x = Tensor::zeros(DType::kBF16, 1, 128);
        TopkRouting r{.num_tokens = 1, .num_topk = 1, .topk_idx = {7}, .topk_weights = {1.0f}};
        MOED_ASSIGN_OR_RETURN(auto d, buffer->low_latency_dispatch(
                                          {.x = x.view(), .topk = &r, .return_recv_hook = true}));
        Tensor y = Tensor::zeros(DType::kBF16, 2 * 4 * 4, 128);
        Status early =
            buffer->low_latency_combine({.x = y.view(), .topk = &r, .handle = d.handle}).status();
        MOED_RETURN_IF_ERROR(d.hook->wait());
        if (early.ok()) return internal_error("combine before the dispatch's hook succeeded");
        r.topk_weights[0] = w.rank() == 1 ? -1.0f : 1.0f;
        Status neg =
            buffer->low_latency_combine({.x = y.view(), .topk = &r, .handle = d.handle}).status();
        if (neg.message() != "rank 1: topk_weights[0][0] = -1 must be a number >= 0") {
          return internal_error("negative weight: ", neg.to_string());
        }
        return early;
      },
      StatusCode::kFailedPrecondition, "has not been received yet; call its hook first");

  // Threads world (in-node ranks read each other's rows): return_recv_hook must agree, as a
  // rank that reads in place and one that copies cannot meet.
  if (GetParam() == Backend::kThreads) {
    expect_error(
        GetParam(),
        [](World& w) -> Status {
          MOED_ASSIGN_OR_RETURN(auto buffer, LowLatencyBuffer::create(w, 4, 128, 8));
          Tensor x = Tensor::zeros(DType::kBF16, 1, 128);
          TopkRouting r{.num_tokens = 1, .num_topk = 1, .topk_idx = {7}, .topk_weights = {1.0f}};
          MOED_ASSIGN_OR_RETURN(auto d, buffer->low_latency_dispatch({.x = x.view(), .topk = &r}));
          Tensor y = Tensor::zeros(DType::kBF16, 2 * 4 * 4, 128);
          return buffer
              ->low_latency_combine({.x = y.view(),
                                     .topk = &r,
                                     .handle = d.handle,
                                     .return_recv_hook = w.rank() == 2})
              .status();
        },
        StatusCode::kInvalidArgument,
        "low_latency_combine: return_recv_hook = 0 on rank 0 but 1 on rank 2");
    expect_error(
        GetParam(),
        [](World& w) -> Status {
          MOED_ASSIGN_OR_RETURN(auto buffer, LowLatencyBuffer::create(w, 4, 128, 8));
          Tensor x = Tensor::zeros(DType::kBF16, 1, 128);
          TopkRouting r{.num_tokens = 1, .num_topk = 1, .topk_idx = {7}, .topk_weights = {1.0f}};
          return buffer
              ->low_latency_dispatch({.x = x.view(), .topk = &r, .return_recv_hook = w.rank() != 1})
              .status();
        },
        StatusCode::kInvalidArgument,
        "low_latency_dispatch: return_recv_hook = 1 on rank 0 but 0 on rank 1");
  }
}

TEST(LowLatencySizeHint, CoversTheSlots) {
  // Per half: dispatch [E*M] rows of H bf16 + scales + indices + probs, combine [E*M] rows of
  // H bf16.
  const size_t rows = 256 * 128;
  const size_t hint = get_low_latency_size_hint(128, 7168, 8, 256);
  EXPECT_GE(hint, 2 * (rows * 7168 * 2 * 2 + rows * 56 * 4 + rows * 8));
  EXPECT_LE(hint, 2 * (rows * 7168 * 2 * 2 + rows * 56 * 4 + rows * 8) + 2 * 6 * 64 + 2 * 256 * 8);
  EXPECT_EQ(get_low_latency_size_hint(0, 7168, 8, 256), 0u);
}

INSTANTIATE_TEST_SUITE_P(Worlds, LowLatencyTest, ::testing::ValuesIn(::moed::testing::backends()),
                         ::moed::testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed
