// The rank-major receive (moed/deep_ep.h, DeepEP's normal mode) on both worlds, against a
// reference built straight from every rank's topk_idx: each receiving rank gets each token
// once, source rank ascending then token ascending; recv_topk_idx holds local ids or -1 and
// the weights (0 where -1); the expert list is the aligned (token, local expert) count; the
// handle's six arrays mean what DeepEP's do; combine = biases + rows of the ranks that got the
// token, ranks ascending, fp32, rounded once. Every comparison is bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "moed/deep_ep.h"
#include "support/world_test.h"

namespace moed {
namespace {

using deep_ep::NormalBuffer;
using ::moed::testing::Backend;
using ::moed::testing::run_world;

struct Case {
  int ranks = 1, per_node = 0, num_experts = 1, num_topk = 1;
  DType dtype = DType::kBF16;
  int hidden = 100;
  int alignment = 1;
  bool with_topk = true;
  std::vector<int64_t> tokens = {};  // per rank; "= {}" lets the grid rows leave it out
  int64_t worst = 0;
  uint32_t seed = 1;
};

struct Problem {
  Case c;
  std::vector<TokenTensor> x;                  // per rank
  std::vector<std::vector<int64_t>> topk_idx;  // per rank [T, K]
  std::vector<std::vector<float>> topk_w;
  std::vector<Tensor> bias0, bias1;  // per rank [T, H] bf16
};

Problem make_problem(const Case& c) {
  Problem p;
  p.c = c;
  std::mt19937 rng(c.seed);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  const int H = c.hidden, K = c.num_topk, E = c.num_experts;
  for (int s = 0; s < c.ranks; ++s) {
    const int64_t T = c.tokens[size_t(s)];
    TokenTensor x;
    x.x = Tensor::empty(c.dtype, T, H);
    if (c.dtype == DType::kFP8) x.scales = Tensor::empty(DType::kF32, T, H / kFp8BlockSize);
    for (int64_t t = 0; t < T; ++t) {
      for (int h = 0; h < H; ++h) {
        const float v = u(rng);
        if (c.dtype == DType::kF32) x.x.row<float>(t)[h] = v;
        if (c.dtype == DType::kBF16) x.x.row<bf16>(t)[h] = float_to_bf16(v);
        if (c.dtype == DType::kFP8) x.x.row<fp8_e4m3>(t)[h] = float_to_fp8_e4m3(v * 50.0f);
      }
      if (c.dtype == DType::kFP8) {
        for (int b = 0; b < H / kFp8BlockSize; ++b)
          x.scales.row<float>(t)[b] = 0.01f * float(b + 1 + t);
      }
    }
    p.x.push_back(std::move(x));
    std::vector<int64_t> idx(size_t(T) * K);
    std::vector<float> w(size_t(T) * K);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int> perm(static_cast<size_t>(E));
      for (int e = 0; e < E; ++e) perm[size_t(e)] = e;
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int k = 0; k < K; ++k) {
        idx[size_t(t) * K + k] = (rng() % 7 == 0) ? -1 : perm[size_t(k)];
        w[size_t(t) * K + k] = std::fabs(u(rng));
      }
    }
    p.topk_idx.push_back(std::move(idx));
    p.topk_w.push_back(std::move(w));
    p.bias0.push_back(Tensor::empty(DType::kBF16, T, H));
    p.bias1.push_back(Tensor::empty(DType::kBF16, T, H));
    for (int64_t t = 0; t < T; ++t) {
      for (int h = 0; h < H; ++h) {
        p.bias0.back().row<bf16>(t)[h] = float_to_bf16(u(rng));
        p.bias1.back().row<bf16>(t)[h] = float_to_bf16(u(rng) * 0.001f);
      }
    }
  }
  return p;
}

// The independent reference for receiving rank r.
struct RefRank {
  std::vector<int> src_rank;
  std::vector<int64_t> src_token;
  std::vector<int64_t> topk_idx;  // [rows, K] local or -1
  std::vector<float> topk_w;
  std::vector<int32_t> expert_list;
};
bool in_rank(const Problem& p, int s, int64_t t, int r) {
  const int L = p.c.num_experts / p.c.ranks, K = p.c.num_topk;
  for (int k = 0; k < K; ++k) {
    const int64_t e = p.topk_idx[size_t(s)][size_t(t) * K + k];
    if (e >= 0 && e / L == r) return true;
  }
  return false;
}
RefRank reference(const Problem& p, int r) {
  const int L = p.c.num_experts / p.c.ranks, K = p.c.num_topk;
  RefRank ref;
  ref.expert_list.assign(size_t(L), 0);
  for (int s = 0; s < p.c.ranks; ++s) {
    for (int64_t t = 0; t < p.c.tokens[size_t(s)]; ++t) {
      if (!in_rank(p, s, t, r)) continue;
      ref.src_rank.push_back(s);
      ref.src_token.push_back(t);
      for (int k = 0; k < K; ++k) {
        const int64_t e = p.topk_idx[size_t(s)][size_t(t) * K + k];
        const bool local = e >= 0 && e / L == r;
        ref.topk_idx.push_back(local ? e - int64_t(r) * L : -1);
        ref.topk_w.push_back(local ? p.topk_w[size_t(s)][size_t(t) * K + k] : 0.0f);
        if (local) ++ref.expert_list[size_t(e - int64_t(r) * L)];
      }
    }
  }
  for (int32_t& n : ref.expert_list) n = (n + p.c.alignment - 1) / p.c.alignment * p.c.alignment;
  return ref;
}

// Expert output of rank r for a received row: y = bf16(float(x) * (r + 1) + 0.5) per channel
// (x read as its stored value; fp8 without its scale).
float x_value(const Problem& p, int s, int64_t t, int h) {
  const TensorView v = p.x[size_t(s)].x.view();
  if (p.c.dtype == DType::kF32) return v.row<float>(t)[h];
  if (p.c.dtype == DType::kBF16) return bf16_to_float(v.row<bf16>(t)[h]);
  return fp8_e4m3_to_float(v.row<fp8_e4m3>(t)[h]);
}
bf16 y_value(const Problem& p, int r, int s, int64_t t, int h) {
  return float_to_bf16(x_value(p, s, t, h) * float(r + 1) + 0.5f);
}

using testing::expect;

// Checks one dispatch output against the reference (rows [0, n) real, the rest padding).
Status check_recv(const Problem& p, int r, const deep_ep::NormalDispatchOutput& d, bool topk) {
  const RefRank ref = reference(p, r);
  const int64_t n = int64_t(ref.src_rank.size());
  const int K = p.c.num_topk, H = p.c.hidden;
  const int64_t rows = p.c.worst > 0 ? p.c.worst : n;
  MOED_RETURN_IF_ERROR(
      expect(d.recv_x.x.rows == rows,
             str_cat("rank ", r, ": recv_x has ", d.recv_x.x.rows, " rows, want ", rows)));
  const size_t rb = d.recv_x.x.row_bytes();
  for (int64_t i = 0; i < n; ++i) {
    const int s = ref.src_rank[size_t(i)];
    const int64_t t = ref.src_token[size_t(i)];
    if (std::memcmp(d.recv_x.x.row_ptr(i), p.x[size_t(s)].x.view().row_ptr(t), rb) != 0)
      return internal_error("rank ", r, ": recv_x row ", i, " is not x of rank ", s, " token ", t);
    if (p.c.dtype == DType::kFP8 &&
        std::memcmp(d.recv_x.scales.row_ptr(i), p.x[size_t(s)].scales.view().row_ptr(t),
                    d.recv_x.scales.row_bytes()) != 0)
      return internal_error("rank ", r, ": scales row ", i);
    if (d.handle->recv_src_idx[size_t(i)] != t)
      return internal_error("rank ", r, ": recv_src_idx[", i,
                            "] = ", d.handle->recv_src_idx[size_t(i)], ", want ", t);
  }
  for (int64_t i = n; i < rows; ++i) {
    const char* row = static_cast<const char*>(d.recv_x.x.row_ptr(i));
    for (size_t b = 0; b < rb; ++b)
      if (row[b] != 0) return internal_error("rank ", r, ": padding row ", i, " is not zero");
    if (d.handle->recv_src_idx[size_t(i)] != -1) return internal_error("padding src idx");
  }
  (void)H;
  if (!topk) return ok_status();
  MOED_RETURN_IF_ERROR(expect(d.recv_topk_idx.size() == size_t(rows) * K, "recv_topk_idx size"));
  for (int64_t i = 0; i < n * K; ++i) {
    if (d.recv_topk_idx[size_t(i)] != ref.topk_idx[size_t(i)] ||
        std::memcmp(&d.recv_topk_weights[size_t(i)], &ref.topk_w[size_t(i)], 4) != 0)
      return internal_error("rank ", r, ": recv_topk entry ", i, " is (",
                            d.recv_topk_idx[size_t(i)], ", ", d.recv_topk_weights[size_t(i)],
                            "), want (", ref.topk_idx[size_t(i)], ", ", ref.topk_w[size_t(i)], ")");
  }
  for (int64_t i = n * K; i < rows * K; ++i) {
    if (d.recv_topk_idx[size_t(i)] != -1 || d.recv_topk_weights[size_t(i)] != 0.0f)
      return internal_error("rank ", r, ": padding top-k entry ", i);
  }
  if (p.c.worst > 0)
    return expect(d.num_recv_tokens_per_expert.empty(), "list not empty with worst");
  return expect(d.num_recv_tokens_per_expert == ref.expert_list,
                str_cat("rank ", r, ": num_recv_tokens_per_expert differs"));
}

// The handle's arrays against their DeepEP meanings, from the reference.
Status check_handle(const Problem& p, int me, const deep_ep::NormalHandle& h) {
  const int R = p.c.ranks, C = h.num_channels;
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < R; ++j) {
      int64_t want = 0;
      for (int s = 0; s <= i; ++s) {
        for (int64_t t = 0; t < p.c.tokens[size_t(s)]; ++t) want += in_rank(p, s, t, j);
      }
      if (h.rank_prefix_matrix[size_t(i) * R + j] != want)
        return internal_error("rank_prefix_matrix[", i, "][", j,
                              "] = ", h.rank_prefix_matrix[size_t(i) * R + j], ", want ", want);
    }
  }
  const int64_t T = p.c.tokens[size_t(me)];
  for (int r = 0; r < R; ++r) {
    // send_head counts per channel; the channel prefix matrix is its inclusive prefix.
    for (int c = 0; c < C; ++c) {
      int64_t b, e;
      ThreadPool::split(T, C, c, &b, &e);
      int32_t n = 0;
      for (int64_t t = b; t < e; ++t) {
        const bool in = in_rank(p, me, t, r);
        if (h.is_token_in_rank[size_t(t) * R + r] != in) return internal_error("is_token_in_rank");
        if (h.send_head[size_t(t) * R + r] != (in ? n : -1))
          return internal_error("send_head[", t, "][", r, "] = ", h.send_head[size_t(t) * R + r]);
        n += in;
      }
      const int32_t prev = c == 0 ? 0 : h.channel_prefix_matrix[size_t(r) * C + c - 1];
      if (h.channel_prefix_matrix[size_t(r) * C + c] != prev + n)
        return internal_error("channel_prefix_matrix");
    }
  }
  // recv_channel_prefix_matrix[s][c]: where channel c of s starts among s's rows here.
  for (int s = 0; s < R; ++s) {
    const int64_t Ts = p.c.tokens[size_t(s)];
    int32_t before = 0;
    for (int c = 0; c < C; ++c) {
      int64_t b, e;
      ThreadPool::split(Ts, C, c, &b, &e);
      if (h.recv_channel_prefix_matrix[size_t(s) * C + c] != before)
        return internal_error("rank ", me, ": recv_channel_prefix_matrix[", s, "][", c,
                              "] = ", h.recv_channel_prefix_matrix[size_t(s) * C + c], ", want ",
                              before);
      for (int64_t t = b; t < e; ++t) before += in_rank(p, s, t, me);
    }
  }
  return ok_status();
}

Status run_case(World& w, const Problem& p, bool check_meta = true) {
  const int r = w.rank(), K = p.c.num_topk, H = p.c.hidden;
  MOED_ASSIGN_OR_RETURN(auto buf, NormalBuffer::create(w));
  const deep_ep::TopkView topk{p.topk_idx[size_t(r)].data(), true, p.topk_w[size_t(r)].data(),
                               p.c.tokens[size_t(r)], K};
  MOED_ASSIGN_OR_RETURN(DispatchLayout layout, buf->get_dispatch_layout(topk, p.c.num_experts));
  deep_ep::NormalDispatchInput in;
  in.x = p.x[size_t(r)].rows();
  if (p.c.with_topk) in.topk = topk;
  in.layout = deep_ep::LayoutView::of(layout);
  in.expert_alignment = p.c.alignment;
  in.num_worst_tokens = p.c.worst;
  w.reset_counters();
  MOED_ASSIGN_OR_RETURN(deep_ep::NormalDispatchOutput d, buf->dispatch(in));
  MOED_RETURN_IF_ERROR(check_recv(p, r, d, p.c.with_topk));
  // Two hops: a token crosses the network once per remote node that needs it.
  uint64_t want_network_rows = 0;
  const int G = w.ranks_per_node();
  for (int64_t t = 0; t < p.c.tokens[size_t(r)]; ++t) {
    for (int m = 0; m < w.num_nodes(); ++m) {
      bool any = false;
      for (int lr = 0; lr < G; ++lr) any |= m != w.node() && in_rank(p, r, t, m * G + lr);
      want_network_rows += any;
    }
  }
  MOED_RETURN_IF_ERROR(expect(w.counters().network_rows == want_network_rows,
                              str_cat("rank ", r, ": ", w.counters().network_rows,
                                      " network rows, want ", want_network_rows)));
  if (check_meta) MOED_RETURN_IF_ERROR(check_handle(p, r, *d.handle));

  // Cached == uncached, bit for bit.
  deep_ep::NormalDispatchInput cin;
  cin.x = in.x;
  cin.handle = d.handle;
  MOED_ASSIGN_OR_RETURN(deep_ep::NormalDispatchOutput again, buf->dispatch(cin));
  MOED_RETURN_IF_ERROR(
      expect(bitwise_equal(again.recv_x.x, d.recv_x.x), str_cat("rank ", r, ": cached recv_x")));
  if (p.c.dtype == DType::kFP8)
    MOED_RETURN_IF_ERROR(
        expect(bitwise_equal(again.recv_x.scales, d.recv_x.scales), "cached scales"));

  // Combine: y from the reference rows, with topk weights and both biases.
  const RefRank ref = reference(p, r);
  const int64_t rows = d.recv_x.x.rows;
  Tensor y = Tensor::zeros(DType::kBF16, rows, H);
  for (size_t i = 0; i < ref.src_rank.size(); ++i) {
    for (int h = 0; h < H; ++h)
      y.row<bf16>(int64_t(i))[h] = y_value(p, r, ref.src_rank[i], ref.src_token[i], h);
  }
  std::vector<float> yw(size_t(rows) * K, 0.0f);
  std::copy(ref.topk_w.begin(), ref.topk_w.end(), yw.begin());
  deep_ep::NormalCombineInput cb{.x = y.view(),
                                 .topk_weights = yw.data(),
                                 .num_topk = K,
                                 .bias_0 = p.bias0[size_t(r)].view(),
                                 .bias_1 = p.bias1[size_t(r)].view(),
                                 .handle = d.handle};
  MOED_ASSIGN_OR_RETURN(deep_ep::NormalCombineOutput out, buf->combine(cb));
  const int64_t T = p.c.tokens[size_t(r)];
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> acc(static_cast<size_t>(H));
    for (int h = 0; h < H; ++h)
      acc[size_t(h)] = bf16_to_float(p.bias0[size_t(r)].row<bf16>(t)[h]) +
                       bf16_to_float(p.bias1[size_t(r)].row<bf16>(t)[h]);
    std::vector<float> wsum(size_t(K), 0.0f);
    for (int q = 0; q < p.c.ranks; ++q) {
      if (!in_rank(p, r, t, q)) continue;
      for (int h = 0; h < H; ++h)
        acc[size_t(h)] = acc[size_t(h)] + bf16_to_float(y_value(p, q, r, t, h));
      const int L = p.c.num_experts / p.c.ranks;
      for (int k = 0; k < K; ++k) {
        const int64_t e = p.topk_idx[size_t(r)][size_t(t) * K + k];
        wsum[size_t(k)] = wsum[size_t(k)] +
                          ((e >= 0 && e / L == q) ? p.topk_w[size_t(r)][size_t(t) * K + k] : 0.0f);
      }
    }
    for (int h = 0; h < H; ++h) {
      const bf16 want = float_to_bf16(acc[size_t(h)]);
      if (out.combined_x.row<bf16>(t)[h].bits != want.bits)
        return internal_error("rank ", r, ": combined_x[", t, "][", h,
                              "] = ", bf16_to_float(out.combined_x.row<bf16>(t)[h]), ", want ",
                              bf16_to_float(want));
    }
    if (std::memcmp(&out.combined_topk_weights[size_t(t) * K], wsum.data(), size_t(K) * 4) != 0)
      return internal_error("rank ", r, ": combined_topk_weights row ", t);
  }
  return ok_status();
}

TEST(DeepEpUe8m0, PacksExponentBytesLittleEndian) {
  Tensor s = Tensor::empty(DType::kF32, 2, 8);
  for (int i = 0; i < 8; ++i) {
    s.row<float>(0)[i] = std::ldexp(1.0f, i - 4);  // exponents 123..130
    s.row<float>(1)[i] = i == 3 ? 0.0f : std::ldexp(1.0f, -20 - i);
  }
  std::vector<int32_t> out(4);
  ASSERT_TRUE(deep_ep::pack_ue8m0(s.view(), out).ok());
  EXPECT_EQ(uint32_t(out[0]), 123u | 124u << 8 | 125u << 16 | 126u << 24);
  EXPECT_EQ(uint32_t(out[1]), 127u | 128u << 8 | 129u << 16 | 130u << 24);
  EXPECT_EQ(uint32_t(out[2]), 107u | 106u << 8 | 105u << 16 | 0u << 24);  // 0 packs as 0
  s.row<float>(1)[5] = 0.3f;
  const Status bad = deep_ep::pack_ue8m0(s.view(), out);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("scale [1][5] = 0.3 is not a power of two"), std::string::npos)
      << bad.to_string();
}

class RankMajor : public ::testing::TestWithParam<Backend> {};

std::vector<int64_t> tokens_for(int R, int seed) {
  std::vector<int64_t> t(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) t[size_t(r)] = (r * 5 + seed * 3 + 2) % 11;
  if (R > 1) t[1] = 0;
  return t;
}

TEST_P(RankMajor, SweepRanksNodesTopkDtypes) {
  // R, G, E, K, dtype, H, alignment, with_topk; tokens and seed follow from R and G. The last
  // case crosses nodes at an odd hidden size: bf16 rows of 74 bytes beside f32 weights.
  const std::vector<Case> grid = {
      {1, 0, 4, 2, DType::kBF16, 100, 1, true},  {2, 0, 4, 1, DType::kF32, 36, 3, true},
      {3, 0, 6, 6, DType::kBF16, 100, 1, true},  {4, 0, 8, 3, DType::kFP8, 256, 4, true},
      {5, 0, 10, 2, DType::kBF16, 100, 1, true}, {7, 0, 7, 7, DType::kBF16, 20, 2, true},
      {8, 0, 16, 4, DType::kF32, 100, 1, false}, {4, 2, 8, 3, DType::kBF16, 100, 1, true},
      {8, 4, 16, 16, DType::kBF16, 52, 1, true}, {8, 2, 8, 2, DType::kFP8, 128, 2, true},
      {6, 3, 12, 1, DType::kF32, 100, 1, true},  {4, 1, 4, 4, DType::kBF16, 100, 1, true},
      {4, 2, 8, 3, DType::kBF16, 37, 1, true},
  };
  for (Case c : grid) {
    c.tokens = tokens_for(c.ranks, c.ranks + c.per_node);
    c.seed = uint32_t(c.ranks * 100 + c.per_node);
    const Problem p = make_problem(c);
    Status s = run_world(GetParam(), c.ranks, c.per_node, [&](World& w) { return run_case(w, p); });
    ASSERT_TRUE(s.ok()) << "R" << c.ranks << " G" << c.per_node << " K" << c.num_topk << ": "
                        << s.to_string();
  }
}

TEST_P(RankMajor, NumWorstTokensPadsWithZerosAndCachedAgrees) {
  for (int G : {0, 2}) {
    const Case c{.ranks = 4,
                 .per_node = G,
                 .num_experts = 8,
                 .num_topk = 2,
                 .tokens = {9, 0, 12, 5},
                 .worst = 40};
    const Problem p = make_problem(c);
    Status s = run_world(GetParam(), 4, G, [&](World& w) { return run_case(w, p); });
    ASSERT_TRUE(s.ok()) << "G" << G << ": " << s.to_string();
  }
}

// More receive blocks held at once than the ring has slots (64), from two problems in turn:
// each stays what its dispatch received, those past the ring in regions of their own.
TEST_P(RankMajor, MoreHeldOutputsThanRingSlots) {
  constexpr int kHeldOutputs = 64 + 3;
  Case c{.ranks = 4, .per_node = 2, .num_experts = 8, .num_topk = 2, .tokens = {6, 0, 5, 7}};
  const Problem p1 = make_problem(c);
  c.seed = 2;
  const Problem p2 = make_problem(c);
  Status s = run_world(GetParam(), 4, 2, [&](World& w) -> Status {
    const int r = w.rank();
    MOED_ASSIGN_OR_RETURN(auto buf, NormalBuffer::create(w));
    auto dispatch = [&](const Problem& p) -> StatusOr<deep_ep::NormalDispatchOutput> {
      const deep_ep::TopkView topk{p.topk_idx[size_t(r)].data(), true, p.topk_w[size_t(r)].data(),
                                   p.c.tokens[size_t(r)], c.num_topk};
      MOED_ASSIGN_OR_RETURN(DispatchLayout layout, buf->get_dispatch_layout(topk, c.num_experts));
      deep_ep::NormalDispatchInput in;
      in.x = p.x[size_t(r)].rows();
      in.topk = topk;
      in.layout = deep_ep::LayoutView::of(layout);
      return buf->dispatch(in);
    };
    std::vector<deep_ep::NormalDispatchOutput> held;
    for (int i = 0; i < kHeldOutputs; ++i) {
      MOED_ASSIGN_OR_RETURN(deep_ep::NormalDispatchOutput d, dispatch(i % 2 == 0 ? p1 : p2));
      held.push_back(std::move(d));
    }
    for (int i = 0; i < kHeldOutputs; ++i) {
      MOED_RETURN_IF_ERROR(check_recv(i % 2 == 0 ? p1 : p2, r, held[size_t(i)], true));
    }
    return ok_status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

// Receive blocks of kStreamThresholdBytes and up take their rows with non-temporal stores, in
// the push inside a node and at the forwarder (rank_major_push.cc): blocks of 12-18 MB here,
// bf16 inside a node, FP8 with its scales across nodes.
TEST_P(RankMajor, LargeBlocksAreWrittenWhole) {
  const std::vector<Case> cases = {
      {.ranks = 2, .num_experts = 4, .num_topk = 2, .hidden = 2048, .tokens = {2100, 1500}},
      {.ranks = 4,
       .per_node = 2,
       .num_experts = 8,
       .num_topk = 3,
       .dtype = DType::kFP8,
       .hidden = 4096,
       .tokens = {2400, 0, 2000, 2600}},
  };
  for (const Case& c : cases) {
    const Problem p = make_problem(c);
    Status s = run_world(GetParam(), c.ranks, c.per_node, [&](World& w) { return run_case(w, p); });
    ASSERT_TRUE(s.ok()) << "R" << c.ranks << " G" << c.per_node << ": " << s.to_string();
  }
}

TEST_P(RankMajor, BadInputIsEveryRanksError) {
  const Case c{.ranks = 4, .num_experts = 8, .num_topk = 2, .tokens = {6, 6, 6, 6}};
  const Problem p = make_problem(c);
  Status s = run_world(GetParam(), 4, 2, [&](World& w) -> Status {
    const int r = w.rank();
    MOED_ASSIGN_OR_RETURN(auto buf, NormalBuffer::create(w));
    std::vector<int64_t> idx = p.topk_idx[size_t(r)];
    const deep_ep::TopkView topk{idx.data(), true, p.topk_w[size_t(r)].data(), 6, 2};
    MOED_ASSIGN_OR_RETURN(DispatchLayout layout, buf->get_dispatch_layout(topk, p.c.num_experts));
    deep_ep::NormalDispatchInput in;
    in.x = p.x[size_t(r)].rows();
    in.topk = topk;
    in.layout = deep_ep::LayoutView::of(layout);
    if (r == 2) in.layout.owned_rank[1] += 1;  // a count that disagrees with is_token_in_rank
    auto d = buf->dispatch(in);
    MOED_RETURN_IF_ERROR(
        expect(!d.ok() && d.status().code() == StatusCode::kInvalidArgument &&
                   d.status().message().find("rank 2: num_tokens_per_rank[1]") != std::string::npos,
               d.ok() ? "accepted" : d.status().to_string()));
    // num_worst_tokens too small: the same error everywhere, naming the value.
    in.layout = deep_ep::LayoutView::of(layout);
    in.num_worst_tokens = 1;
    d = buf->dispatch(in);
    MOED_RETURN_IF_ERROR(
        expect(!d.ok() && d.status().message().find("num_worst_tokens = 1") != std::string::npos,
               d.ok() ? "accepted worst" : d.status().to_string()));
    // Different hidden sizes across ranks.
    in.num_worst_tokens = 0;
    TensorView x = p.x[size_t(r)].x.view();
    if (r == 3) x.cols = 50;
    in.x.x = x;
    d = buf->dispatch(in);
    MOED_RETURN_IF_ERROR(
        expect(!d.ok() && d.status().message().find("hidden = 100 on rank 0 but 50 on rank 3") !=
                              std::string::npos,
               d.ok() ? "accepted hidden" : d.status().to_string()));
    // A good dispatch still works afterwards; combine with a wrong row count fails everywhere.
    in.x = p.x[size_t(r)].rows();
    MOED_ASSIGN_OR_RETURN(deep_ep::NormalDispatchOutput ok, buf->dispatch(in));
    Tensor y = Tensor::zeros(DType::kBF16, ok.recv_x.x.rows + (r == 0 ? 1 : 0), 100);
    deep_ep::NormalCombineInput bad_rows;
    bad_rows.x = y.view();
    bad_rows.handle = ok.handle;
    auto cbo = buf->combine(bad_rows);
    MOED_RETURN_IF_ERROR(
        expect(!cbo.ok() && cbo.status().message().find("rank 0: x is [") != std::string::npos,
               cbo.ok() ? "combine accepted" : cbo.status().to_string()));
    // A top-k that routes to a rank the layout leaves out (the layout's counts kept consistent):
    // rank 3's token 0 loses the rank of its first expert.
    // The expected messages name rank 3's and rank 0's values, so every rank reads those.
    const int L = p.c.num_experts / p.c.ranks;
    const std::vector<int64_t>& idx3 = p.topk_idx[3];
    const int k3 = idx3[0] >= 0 ? 0 : 1;
    const int64_t e3 = idx3[size_t(k3)];
    DispatchLayout cut = layout;
    if (r == 3) {
      cut.is_token_in_rank[size_t(e3 / L)] = 0;
      cut.num_tokens_per_rank[size_t(e3 / L)] -= 1;
    }
    in.layout = deep_ep::LayoutView::of(cut);
    d = buf->dispatch(in);
    const std::string lost = str_cat("rank 3: topk_idx[0][", k3, "] = ", e3, " lives on rank ",
                                     e3 / L, " but is_token_in_rank[0][", e3 / L, "] is false");
    MOED_RETURN_IF_ERROR(
        expect(!d.ok() && d.status().message().find(lost) != std::string::npos,
               d.ok() ? "accepted a top-k outside the layout" : d.status().to_string()));
    // A cached dispatch whose top-k routes outside the handle's layout: rank 0's token 0 to the
    // first expert of a rank it did not go to.
    in.layout = deep_ep::LayoutView::of(layout);
    const int k0 = p.topk_idx[0][0] >= 0 ? 0 : 1;
    int away = 0;
    while (in_rank(p, 0, 0, away)) ++away;
    std::vector<int64_t> moved = idx;
    if (r == 0) moved[size_t(k0)] = int64_t(away) * L;
    deep_ep::NormalDispatchInput cached;
    cached.x = in.x;
    cached.handle = ok.handle;
    cached.topk = deep_ep::TopkView{moved.data(), true, p.topk_w[size_t(r)].data(), 6, 2};
    d = buf->dispatch(cached);
    const std::string outside =
        str_cat("rank 0: cached dispatch: topk_idx[0][", k0, "] = ", away * L, " lives on rank ",
                away, " but the handle's is_token_in_rank[0][", away, "] is false");
    MOED_RETURN_IF_ERROR(
        expect(!d.ok() && d.status().message().find(outside) != std::string::npos,
               d.ok() ? "cached accepted a top-k outside the handle" : d.status().to_string()));
    // An expert id outside [-1, E).
    if (r == 1) idx[3] = 8;
    const deep_ep::TopkView bad{idx.data(), true, p.topk_w[size_t(r)].data(), 6, 2};
    in.topk = bad;
    d = buf->dispatch(in);
    return expect(
        !d.ok() && d.status().message().find("rank 1: topk_idx[1][1] = 8 is outside [-1, 8)") !=
                       std::string::npos,
        d.ok() ? "accepted bad idx" : d.status().to_string());
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

INSTANTIATE_TEST_SUITE_P(Worlds, RankMajor, ::testing::ValuesIn(::moed::testing::backends()),
                         ::moed::testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed
