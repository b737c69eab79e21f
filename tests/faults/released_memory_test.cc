// A rank that leaves in the middle of a loop of calls, dropping its inputs and its buffer at
// once, never leaves another rank reading or writing its released memory: in the threads world
// the peers read each other's rows where they are (low-latency mode's in-place combine, Flex's
// pull, the rank-major combine) and write each other's receive blocks (the rank-major and
// low-latency pushes). Every
// other rank returns an error naming the rank that left; under AddressSanitizer a read of its
// memory would be reported. The loop runs many times, since the hazard is a race.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "moed/deep_ep.h"
#include "moed/dispatcher.h"
#include "moed/low_latency.h"
#include "moed/routing.h"
#include "support/sanitizers.h"
#include "support/world_test.h"

namespace moed {
namespace {

using ::moed::testing::Backend;

constexpr int kRanks = 4;
constexpr int kLeaver = 1;
constexpr int kLeaveAt = 5;  // iteration
constexpr int kIterations = 12;
constexpr int kExperts = 8;
constexpr int kTopk = 2;

struct Input {
  Tensor x;
  TopkRouting topk;
};

Input make_input(int rank, int it, int64_t tokens, int hidden) {
  std::mt19937 rng(uint32_t(1000 * rank + it));
  Input in;
  in.x = Tensor::empty(DType::kBF16, tokens, hidden);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h = 0; h < hidden; ++h)
      in.x.row<bf16>(t)[h] = float_to_bf16(float(int(rng() % 17) - 8) / 8.0f);
  }
  in.topk.num_tokens = tokens;
  in.topk.num_topk = kTopk;
  for (int64_t t = 0; t < tokens; ++t) {
    const int a = int(rng() % kExperts), b = (a + 1 + int(rng() % (kExperts - 1))) % kExperts;
    in.topk.topk_idx.insert(in.topk.topk_idx.end(), {a, b});
    in.topk.topk_weights.insert(in.topk.topk_weights.end(), {0.75f, 0.25f});
  }
  return in;
}

// The leaving rank fails the world, then drops everything it holds at once (the caller of each
// *_loop below) and returns.
Status leave(World& w) {
  Status reason = internal_error("rank ", w.rank(), " leaves");
  w.abort(reason);
  return reason;
}

// Low-latency dispatch (bf16 and FP8 alternating) and combine, no receive hook: in the threads
// world the receivers read the senders' rows, and the homes the experts' outputs, in place.
// tokens * hidden * 2 above 64 KiB: the peers read the caller's x, else the buffer's copy.
Status low_latency_loop(World& w, int64_t tokens, int hidden, bool leave_after_combine) {
  MOED_ASSIGN_OR_RETURN(std::unique_ptr<LowLatencyBuffer> buffer,
                        LowLatencyBuffer::create(w, tokens, hidden, kExperts));
  for (int it = 0; it < kIterations; ++it) {
    auto in = std::make_unique<Input>(make_input(w.rank(), it, tokens, hidden));
    MOED_ASSIGN_OR_RETURN(
        LowLatencyDispatchOutput d,
        buffer->low_latency_dispatch(
            {.x = in->x.view(), .topk = TopkView::of(in->topk), .use_fp8 = it % 2 == 1}));
    if (w.rank() == kLeaver && it == kLeaveAt && !leave_after_combine) {
      Status left = leave(w);
      in.reset();
      buffer.reset();
      return left;
    }
    // The experts: zeros of the combine's shape (the rows' values do not matter here).
    auto y = std::make_unique<Tensor>(
        Tensor::zeros(DType::kBF16, int64_t(d.num_local_experts) * d.rows_per_expert, hidden));
    MOED_ASSIGN_OR_RETURN(
        LowLatencyCombineOutput c,
        buffer->low_latency_combine(
            {.x = y->view(), .topk = TopkView::of(in->topk), .handle = d.handle}));
    if (w.rank() == kLeaver && it == kLeaveAt) {
      y.reset();
      Status left = leave(w);
      in.reset();
      buffer.reset();
      return left;
    }
  }
  return ok_status();
}

// The rank-major engine (DeepEP's normal kernels): in the threads world the senders write the
// receivers' blocks, and the combine reads the experts' rows where they are.
Status rank_major_loop(World& w, bool leave_after_combine) {
  constexpr int64_t kTokens = 24;
  constexpr int kHidden = 256;
  MOED_ASSIGN_OR_RETURN(std::unique_ptr<deep_ep::NormalBuffer> buffer,
                        deep_ep::NormalBuffer::create(w));
  for (int it = 0; it < kIterations; ++it) {
    auto in = std::make_unique<Input>(make_input(w.rank(), it, kTokens, kHidden));
    const deep_ep::TopkView topk{in->topk.topk_idx.data(), false, in->topk.topk_weights.data(),
                                 kTokens, kTopk};
    MOED_ASSIGN_OR_RETURN(DispatchLayout layout, buffer->get_dispatch_layout(topk, kExperts));
    deep_ep::NormalDispatchInput din;
    din.x = TokenRows{in->x.view(), {}};
    din.topk = topk;
    din.layout = deep_ep::LayoutView::of(layout);
    MOED_ASSIGN_OR_RETURN(deep_ep::NormalDispatchOutput d, buffer->dispatch(din));
    if (w.rank() == kLeaver && it == kLeaveAt && !leave_after_combine) {
      d = {};
      Status left = leave(w);
      in.reset();
      buffer.reset();
      return left;
    }
    auto y = std::make_unique<Tensor>(Tensor::zeros(DType::kBF16, d.recv_x.x.rows, kHidden));
    std::vector<float> weights(d.recv_topk_weights.begin(), d.recv_topk_weights.end());
    MOED_ASSIGN_OR_RETURN(deep_ep::NormalCombineOutput c,
                          buffer->combine({.x = y->view(),
                                           .topk_weights = weights.data(),
                                           .num_topk = kTopk,
                                           .handle = d.handle}));
    if (w.rank() == kLeaver && it == kLeaveAt) {
      y.reset();
      d = {};
      Status left = leave(w);
      in.reset();
      buffer.reset();
      return left;
    }
  }
  return ok_status();
}

// Flex through the six steps: in the threads world the combine pulls the experts' rows in place.
Status flex_loop(World& w) {
  constexpr int64_t kTokens = 24;
  constexpr int kHidden = 256;
  DispatchConfig cfg;
  cfg.kind = DispatcherKind::kFlex;
  cfg.num_experts = kExperts;
  MOED_ASSIGN_OR_RETURN(std::unique_ptr<TokenDispatcher> d, TokenDispatcher::create(w, cfg));
  for (int it = 0; it < kIterations; ++it) {
    auto in = std::make_unique<Input>(make_input(w.rank(), it, kTokens, kHidden));
    DispatchInput din;
    din.hidden = TokenRows{in->x.view(), {}};
    din.topk = TopkView::of(in->topk);
    MOED_RETURN_IF_ERROR(d->dispatch_preprocess(din));
    MOED_ASSIGN_OR_RETURN(Request r, d->token_dispatch(false));
    MOED_RETURN_IF_ERROR(r->wait());
    MOED_ASSIGN_OR_RETURN(DispatchOutput out, d->dispatch_postprocess());
    auto y =
        std::make_unique<Tensor>(Tensor::zeros(DType::kBF16, out.expert_input.x.rows, kHidden));
    MOED_RETURN_IF_ERROR(d->combine_preprocess(CombineInput{TokenRows{y->view(), {}}, out.handle}));
    MOED_ASSIGN_OR_RETURN(Request c, d->token_combine(false));
    MOED_RETURN_IF_ERROR(c->wait());
    if (w.rank() == kLeaver && it == kLeaveAt) {
      Status left = leave(w);
      y.reset();
      out = {};
      in.reset();
      d.reset();
      return left;
    }
    MOED_ASSIGN_OR_RETURN(CombineOutput co, d->combine_postprocess());
  }
  return ok_status();
}

class ReleasedMemory : public ::testing::TestWithParam<std::tuple<Backend, std::string>> {};

TEST_P(ReleasedMemory, NoRankTouchesTheMemoryOfARankThatLeft) {
  const auto& [backend, name] = GetParam();
  // The race needs many tries in the threads world; the process worlds share no caller memory.
  // ThreadSanitizer sees the missing order in any run, so fewer do there (sanitizers.h).
  const int runs = backend != Backend::kThreads ? 4 : testing::kUnderTsan ? 10 : 50;
  const std::string want =
      "rank " + std::to_string(kLeaver) + " failed: rank " + std::to_string(kLeaver) + " leaves";
  for (int run = 0; run < runs; ++run) {
    std::vector<Status> seen(kRanks);
    WorldOptions opts;
    opts.timeout = std::chrono::seconds(20);  // a bound: a hang shows as kDeadlineExceeded
    Status all = testing::run_world(
        backend, kRanks, /*ranks_per_node=*/0,
        [&](World& w) -> Status {
          Status s;
          if (name == "ll_dispatch") s = low_latency_loop(w, 64, 1024, false);
          if (name == "ll_combine") s = low_latency_loop(w, 64, 1024, true);
          if (name == "rank_major_dispatch") s = rank_major_loop(w, false);
          if (name == "rank_major_combine") s = rank_major_loop(w, true);
          if (name == "flex_combine") s = flex_loop(w);
          seen[size_t(w.rank())] = s;
          return s;
        },
        opts);
    ASSERT_FALSE(all.ok()) << "run " << run;
    for (int r = 0; r < kRanks; ++r) {
      const Status& s = seen[size_t(r)];
      if (r == kLeaver) continue;
      if (backend != Backend::kThreads && s.ok()) continue;  // an MPI process sees its own only
      ASSERT_EQ(s.code(), StatusCode::kAborted)
          << "run " << run << ", rank " << r << ": " << s.to_string();
      ASSERT_NE(s.message().find(want), std::string::npos)
          << "run " << run << ", rank " << r << ": " << s.to_string();
    }
  }
}

std::string param_name(const ::testing::TestParamInfo<ReleasedMemory::ParamType>& info) {
  return std::string(testing::backend_name(std::get<0>(info.param))) + "_" +
         std::get<1>(info.param);
}

INSTANTIATE_TEST_SUITE_P(
    Worlds, ReleasedMemory,
    ::testing::Combine(::testing::ValuesIn(testing::backends()),
                       ::testing::Values("ll_dispatch", "ll_combine", "rank_major_dispatch",
                                         "rank_major_combine", "flex_combine")),
    param_name);

}  // namespace
}  // namespace moed
