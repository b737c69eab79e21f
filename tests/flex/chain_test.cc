// Flex's node-reduced combine (design.md §5.6): tokens whose experts span several nodes combine
// along a chain of fp32 partials, nodes ascending, and must still equal the reference bit for
// bit (the harness checks combine, both backward passes and the round trip). Here: 2, 3, 4 and
// 5 nodes, tokens spanning 1..4 nodes, skewed routing, empty ranks, k = 1 and k = E, H not a
// multiple of 16, f32 and bf16, ETP 2; cached dispatch and combine; and the combine's network
// bytes against an independent count of the chain rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "dispatch/flex/flex_dispatcher.h"
#include "dispatch/harness.h"
#include "moed/reference.h"

namespace moed {
namespace {

using testing::Backend;
using testing::expect;

// Experts of every token on several nodes: E = 4 per rank, K from 1 to E.
std::vector<testing::DispatchCase> chain_cases() {
  struct Shape {
    int ranks, per_node, etp;
  };
  const Shape shapes[] = {{4, 2, 1}, {6, 3, 1}, {6, 2, 1}, {4, 1, 1},
                          {8, 2, 1}, {8, 2, 2}, {5, 1, 1}};
  std::vector<testing::DispatchCase> out;
  uint64_t seed = 9100;
  for (const Shape& s : shapes) {
    const int ep = s.ranks / s.etp;
    for (int i = 0; i < 6; ++i) {
      testing::DispatchCase c;
      c.ranks = s.ranks;
      c.ranks_per_node = s.per_node;
      c.etp = s.etp;
      c.num_experts = ep * (i == 5 ? 1 : 4);
      const int E = c.num_experts;
      const int ks[] = {1, 2, E / 2, E, 3, E};
      c.num_topk = std::min(E, std::max(1, ks[i]));
      c.tokens.assign(size_t(s.ranks), 0);
      for (int r = 0; r < s.ranks; ++r) c.tokens[size_t(r)] = (r * 5 + i * 3 + 4) % 11;
      c.tokens[size_t((i + 1) % s.ranks)] = 0;  // a rank with no tokens
      c.skewed = i % 3 == 1;
      c.weighted = i % 2 == 0;
      c.dtype = i % 3 == 2 ? DType::kBF16 : DType::kF32;
      c.out_dtype = i % 2 ? DType::kBF16 : DType::kF32;
      c.hidden = i % 2 ? 100 : 37;
      c.strided = i == 4;
      c.seed = seed++;
      out.push_back(c);
    }
  }
  return out;
}

class FlexChain : public ::testing::TestWithParam<Backend> {};

TEST_P(FlexChain, EqualsTheReference) {
  Status s =
      testing::run_cases(GetParam(), chain_cases(), DispatcherKind::kFlex, make_flex_dispatcher);
  ASSERT_TRUE(s.ok()) << s.to_string();
}

// The rule the dispatcher follows (P = 1), counted independently: for each token of each home
// on this rank's rail, this rank's network bytes in combine. Per-expert terms (a row each,
// sent by the rank of the expert's node on the rail) unless the chain is fewer bytes: then an
// fp32 row (4H) per hop between the token's nodes and the rounded row from the last one home,
// each sent by the rail rank of the hop's node.
uint64_t expected_combine_network_bytes(const testing::CaseInput& in, int rank, int G, int L,
                                        int64_t H, size_t row_bytes) {
  const int R = int(in.topk.size()), node = rank / G, lane = rank % G;
  uint64_t bytes = 0;
  for (int home = lane; home < R; home += G) {
    const int hn = home / G;
    const TopkRouting& r = in.topk[size_t(home)];
    for (int64_t t = 0; t < r.num_tokens; ++t) {
      std::vector<int> nodes;
      for (int k = 0; k < r.num_topk; ++k) {
        const int e = r.topk_idx[size_t(t) * r.num_topk + k];
        if (e >= 0) nodes.push_back(e / L / G);
      }
      std::sort(nodes.begin(), nodes.end());
      const int64_t remote =
          std::count_if(nodes.begin(), nodes.end(), [&](int n) { return n != hn; });
      const int64_t mine = std::count(nodes.begin(), nodes.end(), node);
      nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
      if (nodes.empty()) continue;
      const uint64_t inner = nodes.size() - 1, home_hop = nodes.back() != hn ? 1 : 0;
      if (uint64_t(4 * H) * inner + row_bytes * home_hop < row_bytes * uint64_t(remote)) {
        for (size_t i = 0; i + 1 < nodes.size(); ++i) {
          if (nodes[i] == node) bytes += uint64_t(4 * H);
        }
        if (home_hop && nodes.back() == node) bytes += row_bytes;
      } else if (node != hn) {
        bytes += uint64_t(mine) * row_bytes;
      }
    }
  }
  return bytes;
}

// Cached dispatch, then combine through the cached handle: the reference's bits; and the
// combine's network bytes on every rank equal the count above, at most twice the dispatch's
// (plus headers) where tokens span many nodes.
TEST_P(FlexChain, CachedModeAndNetworkBytes) {
  for (const DType out_dtype : {DType::kBF16, DType::kF32}) {
    testing::DispatchCase c;
    c.ranks = 8;
    c.ranks_per_node = 2;
    c.num_experts = 32;
    c.num_topk = 8;
    c.hidden = 100;
    c.dtype = DType::kBF16;
    c.out_dtype = out_dtype;
    c.tokens = {9, 0, 7, 12, 3, 10, 6, 8};
    c.weighted = true;
    c.seed = 9300;
    const testing::CaseInput in = testing::make_case_input(c);
    ReferenceProblem ref;
    ref.num_experts = c.num_experts;
    ref.ep_size = c.ranks;
    ref.num_topk = c.num_topk;
    ref.weighted_combine = true;
    ref.routing = in.map;
    for (const TokenTensor& t : in.hidden) ref.hidden.push_back(t.rows());
    Status s = testing::run_world(GetParam(), c.ranks, c.ranks_per_node, [&](World& w) -> Status {
      const int r = w.rank(), G = c.ranks_per_node, L = c.num_experts / c.ranks;
      DispatchConfig cfg;
      cfg.kind = DispatcherKind::kFlex;
      cfg.num_experts = c.num_experts;
      cfg.weighted_combine = true;
      MOED_ASSIGN_OR_RETURN(auto d, make_flex_dispatcher(w, cfg));
      DispatchInput input;
      input.hidden = in.hidden[size_t(r)].rows();
      input.topk = TopkView::of(in.topk[size_t(r)]);
      MOED_ASSIGN_OR_RETURN(DispatchOutput first, d->dispatch(input));
      w.reset_counters();
      MOED_ASSIGN_OR_RETURN(DispatchOutput out,
                            d->dispatch({.hidden = input.hidden, .cached_handle = first.handle}));
      const uint64_t dispatch_bytes = w.counters().network_bytes;
      // What the combine's agreement (code and dtype, one all-gather) costs on its own.
      w.reset_counters();
      const std::vector<int64_t> row(2);
      MOED_RETURN_IF_ERROR(all_gather<int64_t>(w, std::span<const int64_t>(row)).status());
      const uint64_t agreement = w.counters().network_bytes;
      std::vector<Tensor> y;
      std::vector<TensorView> views;
      MOED_ASSIGN_OR_RETURN(std::vector<ReferenceRankDispatch> all, reference_dispatch(ref));
      for (int g = 0; g < c.ranks; ++g) {
        Tensor t = Tensor::empty(out_dtype, all[size_t(g)].expert_input.x.rows(), c.hidden);
        for (int64_t i = 0; i < t.rows(); ++i) {
          for (int64_t h = 0; h < c.hidden; ++h) {
            const float v = float((i * 131 + h * 17 + g * 7) % 97) / 37.0f - 1.3f;
            if (out_dtype == DType::kBF16) {
              t.view().row<bf16>(i)[h] = float_to_bf16(v);
            } else {
              t.view().row<float>(i)[h] = v * 1.0009765625f;
            }
          }
        }
        y.push_back(std::move(t));
        views.push_back(y.back().view());
      }
      MOED_ASSIGN_OR_RETURN(std::vector<Tensor> ref_out, reference_combine(ref, views));
      for (int pass = 0; pass < 2; ++pass) {
        w.reset_counters();
        MOED_ASSIGN_OR_RETURN(CombineOutput co,
                              d->combine(CombineInput{TokenRows{y[size_t(r)].view(), {}},
                                                      pass == 0 ? out.handle : first.handle}));
        const uint64_t got = w.counters().network_bytes;
        const TensorView a = co.hidden.view(), b = ref_out[size_t(r)].view();
        for (int64_t t = 0; t < a.rows; ++t) {
          MOED_RETURN_IF_ERROR(expect(std::memcmp(a.row_ptr(t), b.row_ptr(t), a.row_bytes()) == 0,
                                      str_cat("rank ", r, ": combine row ", t, " differs")));
        }
        const uint64_t want_bytes =
            expected_combine_network_bytes(in, r, G, L, c.hidden, dtype_size(out_dtype) * c.hidden);
        MOED_RETURN_IF_ERROR(expect(got == want_bytes + agreement,
                                    str_cat("rank ", r, ": combine network bytes ", got,
                                            " != ", want_bytes, " (+", agreement, " agreement)")));
        // In all (a rank's share depends on the routing): combine sends at most twice the
        // dispatch's bytes.
        const std::vector<int64_t> mine = {int64_t(got - agreement), int64_t(dispatch_bytes)};
        MOED_ASSIGN_OR_RETURN(std::vector<int64_t> every,
                              all_gather<int64_t>(w, std::span<const int64_t>(mine)));
        int64_t combine_total = 0, dispatch_total = 0;
        for (int g = 0; g < c.ranks; ++g) {
          combine_total += every[size_t(2 * g)];
          dispatch_total += every[size_t(2 * g + 1)];
        }
        MOED_RETURN_IF_ERROR(expect(combine_total <= 2 * dispatch_total,
                                    str_cat("combine network bytes ", combine_total,
                                            " > 2x the dispatch's ", dispatch_total)));
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << dtype_name(out_dtype) << ": " << s.to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, FlexChain, ::testing::ValuesIn(testing::backends()),
                         testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed
