// Flex beyond the sweep: get_dispatch_layout against a brute force, cached mode, async use,
// num_worst_tokens, what notify keeps, network bytes against the analytic count, and error
// paths.
#include <gtest/gtest.h>

#include <random>

#include "dispatch/flex/flex_dispatcher.h"
#include "dispatch/flex/steps.h"
#include "dispatch/harness.h"
#include "moed/flex.h"
#include "moed/reference.h"

namespace moed {
namespace {

using testing::Backend;

TEST(FlexLayout, MatchesBruteForce) {
  std::mt19937 rng(7);
  for (int etp : {1, 2}) {
    const int R = 8, G = 4, E = 16, K = 3, T = 50;
    TopkRouting topk;
    topk.num_tokens = T;
    topk.num_topk = K;
    for (int t = 0; t < T; ++t) {
      std::vector<int> experts(E);
      for (int e = 0; e < E; ++e) experts[size_t(e)] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int k = 0; k < K; ++k) {
        topk.topk_idx.push_back(k == 2 && t % 5 == 0 ? -1 : experts[size_t(k)]);
        topk.topk_weights.push_back(0.25f);
      }
    }
    auto l = get_dispatch_layout(topk, E, R, G, etp);
    ASSERT_TRUE(l.ok()) << l.status().to_string();
    const int L = E / (R / etp);
    std::vector<int64_t> per_rank(R), per_node(R / G), per_expert(E);
    for (int t = 0; t < T; ++t) {
      std::vector<bool> rank(R), node(R / G);
      for (int k = 0; k < K; ++k) {
        const int e = topk.idx(t, k);
        if (e < 0) continue;
        ++per_expert[size_t(e)];
        for (int p = 0; p < etp; ++p) rank[size_t((e / L) * etp + p)] = true;
      }
      for (int r = 0; r < R; ++r) {
        EXPECT_EQ(l->in_rank(t, r), bool(rank[size_t(r)])) << "t " << t << " r " << r;
        if (rank[size_t(r)]) {
          ++per_rank[size_t(r)];
          node[size_t(r / G)] = true;
        }
      }
      for (int m = 0; m < R / G; ++m) per_node[size_t(m)] += node[size_t(m)];
    }
    EXPECT_EQ(l->num_tokens_per_rank, per_rank);
    EXPECT_EQ(l->num_tokens_per_node, per_node);
    EXPECT_EQ(l->num_tokens_per_expert, per_expert);
  }
  TopkRouting bad;
  bad.num_tokens = 1;
  bad.num_topk = 1;
  bad.topk_idx = {300};
  bad.topk_weights = {1.0f};
  auto l = get_dispatch_layout(bad, 16, 8, 4);
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("300"), std::string::npos) << l.status().to_string();
  EXPECT_EQ(get_dispatch_layout(bad, 16, 8, 3).status().code(), StatusCode::kInvalidArgument);
}

// A two-node problem (R = 4, G = 2) from the harness's generator, with the reference.
struct Problem {
  testing::DispatchCase c;
  testing::CaseInput in;
  ReferenceProblem ref;
};

Problem make_problem(DType dtype, int ranks, int ranks_per_node, int num_experts, int num_topk) {
  Problem p;
  p.c.ranks = ranks;
  p.c.ranks_per_node = ranks_per_node;
  p.c.num_experts = num_experts;
  p.c.num_topk = num_topk;
  p.c.dtype = dtype;
  p.c.hidden = 256;
  p.c.tokens.resize(size_t(ranks));
  for (int r = 0; r < ranks; ++r) p.c.tokens[size_t(r)] = (r * 7 + 3) % 13;
  p.c.tokens[1] = 0;
  p.c.seed = 99;
  p.in = testing::make_case_input(p.c);
  p.ref.num_experts = num_experts;
  p.ref.ep_size = ranks;
  p.ref.num_topk = num_topk;
  p.ref.routing = p.in.map;
  for (const TokenTensor& t : p.in.hidden) p.ref.hidden.push_back(t.rows());
  return p;
}

using testing::expect;

class FlexFeatures : public ::testing::TestWithParam<Backend> {};

// num_worst_tokens: the exact result, then zero rows; cached mode (also async) equals the
// uncached dispatch; combine from the shared expert-output buffer equals the reference.
TEST_P(FlexFeatures, CachedWorstAsyncAndSharedExpertOutput) {
  const Problem p = make_problem(DType::kBF16, 4, 2, 8, 3);
  constexpr int64_t kWorst = 64;
  Status s = testing::run_world(GetParam(), 4, 2, [&](World& w) -> Status {
    const int r = w.rank();
    DispatchConfig cfg{.kind = DispatcherKind::kFlex, .num_experts = 8};
    cfg.num_worst_tokens = kWorst;
    MOED_ASSIGN_OR_RETURN(auto d, make_flex(w, cfg));
    MOED_ASSIGN_OR_RETURN(auto want, reference_dispatch(p.ref));
    const ReferenceRankDispatch& ref = want[size_t(r)];
    const int64_t exact = ref.expert_input.x.rows();

    DispatchInput input{.hidden = p.in.hidden[size_t(r)].rows(),
                        .topk = TopkView::of(p.in.topk[size_t(r)])};
    MOED_RETURN_IF_ERROR(d->dispatch_preprocess(input));
    MOED_ASSIGN_OR_RETURN(Request req, d->token_dispatch(/*async=*/true));
    MOED_RETURN_IF_ERROR(req->wait());  // never null; already complete in the MPI world
    MOED_ASSIGN_OR_RETURN(DispatchOutput out, d->dispatch_postprocess());
    MOED_RETURN_IF_ERROR(expect(out.num_rows() == kWorst, "rows != num_worst_tokens"));
    MOED_RETURN_IF_ERROR(
        expect(bitwise_equal(out.expert_input.x.slice_rows(0, exact), ref.expert_input.x.view()),
               str_cat("rank ", r, ": exact rows differ")));
    const Tensor zeros = Tensor::zeros(DType::kBF16, kWorst - exact, 256);
    MOED_RETURN_IF_ERROR(
        expect(bitwise_equal(out.expert_input.x.slice_rows(exact, kWorst - exact), zeros.view()),
               str_cat("rank ", r, ": padding rows are not zero")));
    MOED_RETURN_IF_ERROR(expect(out.handle->tokens_per_expert == ref.tokens_per_expert,
                                "tokens_per_expert changed by num_worst_tokens"));
    for (int64_t i = exact; i < kWorst; ++i) {
      MOED_RETURN_IF_ERROR(
          expect(out.handle->row_src_rank[size_t(i)] == -1 && out.permuted_probs[size_t(i)] == 0.0f,
                 "padding row metadata"));
    }
    const Tensor first = Tensor::copy_of(out.expert_input.x);

    // Cached mode: same rows, same handle, no notify.
    DispatchInput cached{.hidden = input.hidden, .cached_handle = out.handle};
    MOED_ASSIGN_OR_RETURN(DispatchOutput again, d->dispatch(cached));
    MOED_RETURN_IF_ERROR(expect(bitwise_equal(again.expert_input.x, first.view()),
                                str_cat("rank ", r, ": cached dispatch differs")));

    // Experts write y = 2 * x straight into the shared combine buffer.
    MOED_ASSIGN_OR_RETURN(TensorView y, d->expert_output_buffer(*out.handle, DType::kF32));
    for (int64_t i = 0; i < kWorst; ++i) {
      for (int64_t h = 0; h < 256; ++h) {
        y.row<float>(i)[h] = 2.0f * bf16_to_float(first.row<bf16>(i)[h]);
      }
    }
    MOED_RETURN_IF_ERROR(d->combine_preprocess({.expert_output = {y, {}}, .handle = out.handle}));
    MOED_ASSIGN_OR_RETURN(Request creq, d->token_combine(/*async=*/true));
    MOED_RETURN_IF_ERROR(creq->wait());
    MOED_ASSIGN_OR_RETURN(CombineOutput got, d->combine_postprocess());
    std::vector<Tensor> ys;
    std::vector<TensorView> views;
    for (int q = 0; q < 4; ++q) {
      const TensorView x = want[size_t(q)].expert_input.x.view();
      ys.push_back(Tensor::empty(DType::kF32, x.rows, 256));
      for (int64_t i = 0; i < x.rows; ++i) {
        for (int64_t h = 0; h < 256; ++h)
          ys.back().row<float>(i)[h] = 2.0f * bf16_to_float(x.row<bf16>(i)[h]);
      }
      views.push_back(ys.back().view());
    }
    MOED_ASSIGN_OR_RETURN(std::vector<Tensor> combined, reference_combine(p.ref, views));
    return expect(bitwise_equal(got.hidden.view(), combined[size_t(r)].view()),
                  str_cat("rank ", r, ": combine differs"));
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

// Each row knows the top-k column its token chose its expert in (DeepEP's slot, which
// ElasticBuffer's metadata needs), and a cached dispatch may move rows of another dtype and
// width through the same layout (DeepEP's handles are the layout only).
TEST_P(FlexFeatures, RowSlotsAndCachedRowsOfAnotherShape) {
  const Problem p = make_problem(DType::kBF16, 4, 2, 8, 3);
  Status s = testing::run_world(GetParam(), 4, 2, [&](World& w) -> Status {
    const int r = w.rank(), L = 2;
    DispatchConfig cfg{.kind = DispatcherKind::kFlex, .num_experts = 8};
    MOED_ASSIGN_OR_RETURN(auto d, make_flex_dispatcher(w, cfg));
    DispatchInput input{.hidden = p.in.hidden[size_t(r)].rows(),
                        .topk = TopkView::of(p.in.topk[size_t(r)])};
    MOED_ASSIGN_OR_RETURN(DispatchOutput out, d->dispatch(input));
    const DispatchHandle& h = *out.handle;
    int64_t row = 0;
    for (int j = 0; j < L; ++j) {
      for (int64_t n = 0; n < h.tokens_per_expert[size_t(j)]; ++n, ++row) {
        const int src = h.row_src_rank[size_t(row)], slot = h.row_src_slot[size_t(row)];
        const int64_t t = h.row_src_token[size_t(row)];
        const TopkRouting& k = p.in.topk[size_t(src)];
        MOED_RETURN_IF_ERROR(
            expect(slot >= 0 && slot < k.num_topk && k.idx(t, slot) == r * L + j,
                   str_cat("rank ", r, " row ", row, ": slot ", slot, " of token ", t, " of rank ",
                           src, " is not expert ", r * L + j)));
      }
    }
    // Three f32 columns per token (its source rank, token and 0.5), through the same handle.
    const int64_t T = p.c.tokens[size_t(r)];
    Tensor tags = Tensor::empty(DType::kF32, T, 3);
    for (int64_t t = 0; t < T; ++t) {
      tags.row<float>(t)[0] = float(r);
      tags.row<float>(t)[1] = float(t);
      tags.row<float>(t)[2] = 0.5f;
    }
    MOED_ASSIGN_OR_RETURN(DispatchOutput again,
                          d->dispatch({.hidden = {tags.view(), {}}, .cached_handle = out.handle}));
    MOED_RETURN_IF_ERROR(expect(again.expert_input.x.dtype == DType::kF32 &&
                                    again.expert_input.x.cols == 3 &&
                                    again.expert_input.x.rows == h.num_rows,
                                "cached rows of another shape: wrong view"));
    for (int64_t i = 0; i < h.num_rows; ++i) {
      const float* v = again.expert_input.x.row<float>(i);
      MOED_RETURN_IF_ERROR(expect(v[0] == float(h.row_src_rank[size_t(i)]) &&
                                      v[1] == float(h.row_src_token[size_t(i)]) && v[2] == 0.5f,
                                  str_cat("rank ", r, " row ", i, ": cached f32 row misplaced")));
    }
    return ok_status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

TEST_P(FlexFeatures, NumWorstTokensTooSmallIsEveryonesError) {
  const Problem p = make_problem(DType::kF32, 4, 2, 8, 3);
  Status s = testing::run_world(GetParam(), 4, 2, [&](World& w) -> Status {
    DispatchConfig cfg{.kind = DispatcherKind::kFlex, .num_experts = 8};
    cfg.num_worst_tokens = 2;
    MOED_ASSIGN_OR_RETURN(auto d, make_flex_dispatcher(w, cfg));
    auto out = d->dispatch({.hidden = p.in.hidden[size_t(w.rank())].rows(),
                            .topk = TopkView::of(p.in.topk[size_t(w.rank())])});
    if (out.ok()) return internal_error("dispatch accepted num_worst_tokens = 2");
    return expect(out.status().code() == StatusCode::kInvalidArgument &&
                      out.status().message().find("num_worst_tokens = 2") != std::string::npos,
                  out.status().to_string());
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

// Notify keeps of every rank's canonical layout only the rows this rank uses (design.md §5.2),
// each against the layouts computed from everybody's counts, and no table of R x E integers.
TEST_P(FlexFeatures, NotifyKeepsOnlyTheRowsItUses) {
  const int R = 8, G = 2, N = R / G, E = 16;
  const Problem p = make_problem(DType::kF32, R, G, E, 3);
  std::vector<int64_t> counts(size_t(R) * E, 0), capacity(size_t(R), 0), node_tokens(size_t(R) * N);
  for (int s = 0; s < R; ++s) {
    const TopkRouting& t = p.in.topk[size_t(s)];
    for (int64_t i = 0; i < t.num_tokens; ++i) {
      std::vector<bool> nodes(static_cast<size_t>(N));
      for (int k = 0; k < t.num_topk; ++k) {
        if (t.idx(i, k) < 0) continue;
        ++counts[size_t(s) * E + size_t(t.idx(i, k))];
        nodes[size_t(t.idx(i, k) / (E / N))] = true;
      }
      for (int m = 0; m < N; ++m) node_tokens[size_t(s) * N + m] += nodes[size_t(m)];
    }
  }
  const CountsView view{counts.data(), size_t(E), capacity.data()};
  for (int P : {1, 2}) {
    Status s = testing::run_world(GetParam(), R, G, [&](World& w) -> Status {
      DispatchConfig cfg{.kind = DispatcherKind::kFlex, .num_experts = E};
      cfg.etp_size = P;
      MOED_ASSIGN_OR_RETURN(auto d, make_flex_dispatcher(w, cfg));
      MOED_ASSIGN_OR_RETURN(DispatchOutput out,
                            d->dispatch({.hidden = p.in.hidden[size_t(w.rank())].rows(),
                                         .topk = TopkView::of(p.in.topk[size_t(w.rank())])}));
      const auto* h = dynamic_cast<const flex::FlexHandle*>(out.handle.get());
      MOED_RETURN_IF_ERROR(expect(h != nullptr, "the handle is not Flex's"));
      const flex::Notified& n = h->notified;
      const int L = E / (R / P), me = w.rank(), node = me / G;
      MOED_RETURN_IF_ERROR(
          expect(n.send_chunk.size() == size_t(E) && n.forward_chunk.size() == size_t(E) &&
                     n.rank_rows.size() == size_t(R) && n.mine.chunk_offset.size() == size_t(L) * R,
                 "kept sizes"));
      for (int ep = 0; ep < R / P; ++ep) {
        const ExpertLayout l = compute_expert_layout(cfg, R, ep * P, view);
        for (int q = 0; q < P; ++q) {
          MOED_RETURN_IF_ERROR(expect(n.rank_rows[size_t(ep * P + q)] == l.num_rows, "rows"));
        }
        for (int j = 0; j < L; ++j) {
          const int e = ep * L + j;
          MOED_RETURN_IF_ERROR(
              expect(n.send_chunk[size_t(e)] == l.offset(j, me), str_cat("chunk ", e)));
          for (int m = 0; m < N && ep * P / G == node; ++m) {
            if (m == node) continue;
            MOED_RETURN_IF_ERROR(expect(n.forward_chunk_of(m, e) == l.offset(j, m * G + me % G),
                                        str_cat("forwarded chunk ", e, " of node ", m)));
          }
        }
      }
      for (int m = 0; m < N; ++m) {
        if (m == node) continue;
        const int src = m * G + me % G;
        int64_t entries = 0;
        for (int e = node * E / N; e < (node + 1) * E / N; ++e)
          entries += counts[size_t(src) * E + e];
        MOED_RETURN_IF_ERROR(
            expect(n.forward_tokens[size_t(m)] == node_tokens[size_t(src) * N + node] &&
                       n.forward_entries[size_t(m)] == entries,
                   str_cat("forwarded from node ", m)));
      }
      return expect(n.mine.chunk_offset == compute_expert_layout(cfg, R, me, view).chunk_offset,
                    "this rank's layout");
    });
    ASSERT_TRUE(s.ok()) << "P = " << P << ": " << s.to_string();
  }
}

// Network bytes of a dispatch = sum over tokens of (remote nodes it routes to) x
// (payload + scales + the token header + an entry per expert on that node).
TEST_P(FlexFeatures, NetworkBytesMatchAnalyticCount) {
  const Problem p = make_problem(DType::kFP8, 8, 2, 16, 4);
  Status s = testing::run_world(GetParam(), 8, 2, [&](World& w) -> Status {
    const int r = w.rank(), G = 2, L = 2;
    DispatchConfig cfg{.kind = DispatcherKind::kFlex, .num_experts = 16};
    MOED_ASSIGN_OR_RETURN(auto d, make_flex_dispatcher(w, cfg));
    DispatchInput input{.hidden = p.in.hidden[size_t(r)].rows(),
                        .topk = TopkView::of(p.in.topk[size_t(r)])};
    MOED_ASSIGN_OR_RETURN(DispatchOutput out, d->dispatch(input));
    // What cached mode's agreement costs on its own (one all-gather of its row).
    w.reset_counters();
    const std::vector<int64_t> row(flex::dispatch_agreement_width(flex::Topology::of(w, cfg)));
    MOED_RETURN_IF_ERROR(all_gather<int64_t>(w, std::span<const int64_t>(row)).status());
    const uint64_t overhead = w.counters().network_bytes;
    w.reset_counters();
    MOED_ASSIGN_OR_RETURN(DispatchOutput again,
                          d->dispatch({.hidden = input.hidden, .cached_handle = out.handle}));
    const uint64_t got = w.counters().network_bytes - overhead;
    const RoutingMap& map = p.in.map[size_t(r)];
    uint64_t want = 0, rows = 0;
    for (int64_t t = 0; t < map.num_tokens; ++t) {
      std::vector<int> entries(4, 0);
      for (int e = 0; e < 16; ++e) {
        if (map.routed(t, e)) ++entries[size_t(e / L / G)];
      }
      for (int m = 0; m < 4; ++m) {
        if (m == w.node() || entries[size_t(m)] == 0) continue;
        want += 256 + 2 * 4 + kFlexTokenHeaderBytes + kFlexEntryBytes * uint64_t(entries[size_t(m)]);
        ++rows;
      }
    }
    MOED_RETURN_IF_ERROR(expect(want > 0 || map.num_tokens == 0, "no cross-node traffic"));
    MOED_RETURN_IF_ERROR(
        expect(got == want, str_cat("rank ", r, ": network bytes ", got, " != analytic ", want)));
    return expect(w.counters().network_rows == rows,
                  str_cat("rank ", r, ": network rows ", w.counters().network_rows, " != ", rows));
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

TEST_P(FlexFeatures, BadInputIsEveryonesError) {
  const Problem p = make_problem(DType::kF32, 4, 2, 8, 3);
  Status s = testing::run_world(GetParam(), 4, 2, [&](World& w) -> Status {
    const int r = w.rank();
    DispatchConfig cfg{.kind = DispatcherKind::kFlex, .num_experts = 8};
    MOED_ASSIGN_OR_RETURN(auto d, make_flex_dispatcher(w, cfg));
    TopkRouting topk = p.in.topk[size_t(r)];
    if (r == 2) topk.topk_idx[0] = 300;
    auto bad = d->dispatch({.hidden = p.in.hidden[size_t(r)].rows(), .topk = TopkView::of(topk)});
    MOED_RETURN_IF_ERROR(expect(!bad.ok() &&
                                    bad.status().message().find("rank 2") != std::string::npos &&
                                    bad.status().message().find("300") != std::string::npos,
                                str_cat("bad topk: ", bad.status().to_string())));
    // The dispatcher still works afterwards.
    MOED_ASSIGN_OR_RETURN(DispatchOutput out,
                          d->dispatch({.hidden = p.in.hidden[size_t(r)].rows(),
                                       .topk = TopkView::of(p.in.topk[size_t(r)])}));
    // A combine with the wrong row count on rank 1 fails on every rank.
    Tensor y = Tensor::zeros(DType::kF32, out.num_rows() + (r == 1 ? 1 : 0), 256);
    auto c = d->combine({.expert_output = {y.view(), {}}, .handle = out.handle});
    MOED_RETURN_IF_ERROR(expect(!c.ok() && c.status().message().find("rank 1") != std::string::npos,
                                str_cat("bad combine: ", c.status().to_string())));
    // Cached mode on one rank only.
    DispatchInput in{.hidden = p.in.hidden[size_t(r)].rows(),
                     .topk = TopkView::of(p.in.topk[size_t(r)])};
    if (r == 3) in.cached_handle = out.handle;
    auto mixed = d->dispatch(in);
    return expect(!mixed.ok() && mixed.status().message().find("cached") != std::string::npos,
                  str_cat("mixed cached mode: ", mixed.status().to_string()));
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

INSTANTIATE_TEST_SUITE_P(Worlds, FlexFeatures, ::testing::ValuesIn(testing::backends()),
                         testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed
