// Token rows (x, with its fp8 scales) are checked by one rule with one message for every entry
// point that takes them (check_token_rows, src/core/row_checks.h): the three six-step
// dispatchers, fresh and cached, DeepEP's normal-mode Buffer, fresh and cached, and low-latency
// mode (bf16 only). A bad x on the last rank is an InvalidArgument on every rank naming that rank
// and the value, after which the same objects run a good call.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "api/api_grid.h"
#include "dispatch/harness.h"
#include "moed/deep_ep.h"
#include "moed/dispatcher.h"
#include "moed/low_latency.h"

namespace moed {
namespace {

using testing::Backend;

constexpr int kRanks = 3;
constexpr int64_t kHidden = 256;  // two fp8 blocks
constexpr int64_t kScales = kHidden / kFp8BlockSize;

// One bad x: what the last rank passes (built from its good rows and scales) and the message
// after the argument's name.
struct BadRows {
  const char* name;
  std::function<TokenRows(const TokenRows&)> make;
  std::function<std::string(int64_t tokens)> expect;
};

std::vector<BadRows> bad_rows(bool fp8) {
  std::vector<BadRows> cases = {
      {"row_stride below hidden",
       [](const TokenRows& g) {
         TokenRows b = g;
         b.x.row_stride = kHidden - 1;
         return b;
       },
       [](int64_t) { return str_cat(" row_stride = ", kHidden - 1, " < cols = ", kHidden); }},
      {"no hidden size",
       [](const TokenRows& g) {
         TokenRows b = g;
         b.x.cols = 0;
         return b;
       },
       [](int64_t t) {
         return str_cat(" is [", t,
                        ", 0]; the hidden size must be positive (also on ranks with "
                        "0 tokens)");
       }},
  };
  if (!fp8) return cases;
  auto scales = [](const char* got, int64_t stride) {
    return [got, stride](int64_t t) {
      return str_cat(" scales must be f32 [", t, ", ", kScales, "] with row_stride >= ", kScales,
                     "; got ", got, " [", t, ", ", kScales, "] with row_stride ", stride);
    };
  };
  cases.push_back({"strided scales",
                   [](const TokenRows& g) {
                     TokenRows b = g;
                     b.scales.row_stride = 1;  // rows overlap
                     return b;
                   },
                   scales("f32", 1)});
  cases.push_back({"bf16 scales",
                   [](const TokenRows& g) {
                     TokenRows b = g;
                     b.scales.dtype = DType::kBF16;
                     return b;
                   },
                   scales("bf16", kScales)});
  return cases;
}

// Every rank's error when the last rank passed `bad`.
Status expect_error(const Status& s, const std::string& what, const BadRows& bad,
                    int64_t last_tokens, const std::string& where) {
  const std::string want = str_cat("rank ", kRanks - 1, ": ", what, bad.expect(last_tokens));
  if (s.code() != StatusCode::kInvalidArgument || s.message().find(want) == std::string::npos)
    return internal_error(where, " (", bad.name, "): expected '", want, "', got ", s.to_string());
  return ok_status();
}

// Rank r's x in `dt`: its bf16 rows, or fp8 rows (zeros) with f32 scales.
TokenTensor rows_of(const testing::CaseInput& in, int r, DType dt) {
  const TensorView h = in.hidden[size_t(r)].x.view();
  if (dt != DType::kFP8) return {Tensor::copy_of(h), Tensor()};
  return {Tensor::zeros(DType::kFP8, h.rows, h.cols), Tensor::zeros(DType::kF32, h.rows, kScales)};
}

testing::DispatchCase make_case() {
  testing::DispatchCase c = testing::api_case(kRanks, 0, 4, kHidden, /*seed=*/11);
  c.dtype = DType::kBF16;
  return c;
}

class TokenRowsChecks : public testing::BackendAndKindTest {};

TEST_P(TokenRowsChecks, OneRuleOnEveryRankFreshAndCached) {
  const auto [backend, kind] = GetParam();
  const testing::DispatchCase c = make_case();
  const testing::CaseInput in = testing::make_case_input(c);
  const int64_t last = c.tokens[size_t(kRanks - 1)];
  for (DType dt : {DType::kBF16, DType::kFP8}) {
    Status s = testing::run_world(backend, kRanks, 0, [&](World& w) -> Status {
      const int r = w.rank();
      const bool bad_rank = r == kRanks - 1;
      const std::string where = str_cat(dispatcher_kind_name(kind), " ", dtype_name(dt));
      MOED_ASSIGN_OR_RETURN(
          auto d, TokenDispatcher::create(w, {.kind = kind, .num_experts = c.num_experts}));
      const TokenTensor rows = rows_of(in, r, dt);
      const TopkView topk = TopkView::of(in.topk[size_t(r)]);
      MOED_ASSIGN_OR_RETURN(DispatchOutput good,
                            d->dispatch({.hidden = rows.rows(), .topk = topk}));
      for (const BadRows& b : bad_rows(dt == DType::kFP8)) {
        const TokenRows x = bad_rank ? b.make(rows.rows()) : rows.rows();
        MOED_RETURN_IF_ERROR(expect_error(d->dispatch({.hidden = x, .topk = topk}).status(),
                                          "hidden", b, last, where));
        if (kind != DispatcherKind::kFlex) continue;  // cached mode is Flex's
        MOED_RETURN_IF_ERROR(
            expect_error(d->dispatch({.hidden = x, .cached_handle = good.handle}).status(),
                         "hidden", b, last, where + " cached"));
      }
      return d->dispatch({.hidden = rows.rows(), .topk = topk}).status();
    });
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, TokenRowsChecks, testing::six_step_grid(),
                         testing::six_step_grid_name);

class DeepEpTokenRows : public ::testing::TestWithParam<Backend> {};

TEST_P(DeepEpTokenRows, NormalAndLowLatency) {
  const testing::DispatchCase c = make_case();
  const testing::CaseInput in = testing::make_case_input(c);
  const int64_t last = c.tokens[size_t(kRanks - 1)];
  Status s = testing::run_world(GetParam(), kRanks, 0, [&](World& w) -> Status {
    const int r = w.rank();
    const bool bad_rank = r == kRanks - 1;
    const TopkView topk = TopkView::of(in.topk[size_t(r)]);
    MOED_ASSIGN_OR_RETURN(auto nb, deep_ep::NormalBuffer::create(w));
    MOED_ASSIGN_OR_RETURN(DispatchLayout layout, nb->get_dispatch_layout(topk, c.num_experts));
    for (DType dt : {DType::kBF16, DType::kFP8}) {
      const TokenTensor rows = rows_of(in, r, dt);
      const deep_ep::NormalDispatchInput good{
          .x = rows.rows(), .topk = topk, .layout = deep_ep::LayoutView::of(layout)};
      MOED_ASSIGN_OR_RETURN(deep_ep::NormalDispatchOutput d, nb->dispatch(good));
      for (const BadRows& b : bad_rows(dt == DType::kFP8)) {
        deep_ep::NormalDispatchInput bad = good;
        if (bad_rank) bad.x = b.make(rows.rows());
        MOED_RETURN_IF_ERROR(expect_error(nb->dispatch(bad).status(), "x", b, last,
                                          str_cat("normal ", dtype_name(dt))));
        MOED_RETURN_IF_ERROR(expect_error(nb->dispatch({.x = bad.x, .handle = d.handle}).status(),
                                          "x", b, last, str_cat("normal cached ", dtype_name(dt))));
      }
      MOED_RETURN_IF_ERROR(nb->dispatch(good).status());
    }
    // Low-latency mode takes bf16 rows only.
    MOED_ASSIGN_OR_RETURN(auto ll, LowLatencyBuffer::create(w, 16, int(kHidden), c.num_experts));
    const TokenTensor rows = rows_of(in, r, DType::kBF16);
    const BadRows b = bad_rows(false)[0];  // the stride (its hidden is the buffer's)
    const TensorView x = bad_rank ? b.make(rows.rows()).x : rows.x.view();
    MOED_RETURN_IF_ERROR(expect_error(ll->low_latency_dispatch({.x = x, .topk = topk}).status(),
                                      "low_latency_dispatch: x", b, last, "low-latency"));
    return ll->low_latency_dispatch({.x = rows.x.view(), .topk = topk}).status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

INSTANTIATE_TEST_SUITE_P(Worlds, DeepEpTokenRows, ::testing::ValuesIn(testing::backends()),
                         testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed
