// Shrink mode on both worlds (moed/low_latency.h; DeepEP's enable_shrink): a rank that stops
// taking part is masked by every other rank within the shrink timeout, and each step of the
// others equals the reference with that rank's experts masked (its tokens gone, its experts'
// terms dropped), bit for bit; before it stopped, the full reference. Also: a rank that comes
// back after being masked is told it was removed, bad input is an error on every rank, the
// mask API, and the clean barrier. One node and two (the network path), odd world sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "moed/low_latency.h"
#include "moed/reference.h"
#include "moed/routing.h"
#include "support/low_latency_test.h"
#include "support/world_test.h"

namespace moed {
namespace {

using ::moed::testing::Backend;
using ::moed::testing::low_latency_round_trip;
using ::moed::testing::LowLatencyRoundTrip;
using ::moed::testing::run_world;

constexpr int kHidden = 256;
constexpr int kTopk = 3;
constexpr int64_t kMaxTokens = 6;
// A live rank slower than the shrink timeout is masked, as it should be; under ThreadSanitizer
// (5-15x slower) 400 ms is not enough for a live rank's step, so it gets more.
#ifdef __SANITIZE_THREAD__
constexpr auto kShrinkTimeout = std::chrono::milliseconds(3000);
#else
constexpr auto kShrinkTimeout = std::chrono::milliseconds(400);
#endif

// One step's inputs on every rank, from the seed.
struct Step {
  std::vector<Tensor> x;
  std::vector<TopkRouting> topk;
};

Step make_step(int ranks, int experts, uint32_t seed) {
  std::mt19937 rng(seed);
  Step s;
  for (int r = 0; r < ranks; ++r) {
    const int64_t T = r == 0 ? 0 : int64_t(rng() % (kMaxTokens + 1));  // rank 0 has none
    Tensor x = Tensor::empty(DType::kBF16, T, kHidden);
    for (int64_t t = 0; t < T; ++t) {
      for (int h = 0; h < kHidden; ++h)
        x.row<bf16>(t)[h] = float_to_bf16(float(int(rng() % 33) - 16) / 8.0f);
    }
    TopkRouting k;
    k.num_tokens = T;
    k.num_topk = kTopk;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> e(static_cast<size_t>(experts));
      for (int i = 0; i < experts; ++i) e[size_t(i)] = i;
      std::shuffle(e.begin(), e.end(), rng);
      for (int i = 0; i < kTopk; ++i) {
        k.topk_idx.push_back(rng() % 7 == 0 ? -1 : e[size_t(i)]);
        k.topk_weights.push_back(float(rng() % 64) / 32.0f);
      }
    }
    s.x.push_back(std::move(x));
    s.topk.push_back(std::move(k));
  }
  return s;
}

// The combine every rank must return when the experts are the identity (y = the dispatched
// rows) and the ranks in `masked` are gone: their tokens never sent, their experts' terms
// dropped.
StatusOr<std::vector<Tensor>> masked_reference(const Step& s, int experts,
                                               const std::set<int>& masked) {
  const int R = int(s.x.size()), L = experts / R;
  ReferenceProblem p;
  p.num_experts = experts;
  p.ep_size = R;
  p.weighted_combine = true;
  p.num_topk = kTopk;
  std::vector<Tensor> empty(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    TopkRouting k = s.topk[size_t(r)];
    if (masked.count(r)) {
      k = TopkRouting{0, kTopk, {}, {}};
      empty[size_t(r)] = Tensor::empty(DType::kBF16, 0, kHidden);
    }
    for (int32_t& e : k.topk_idx) {
      if (e >= 0 && masked.count(e / L)) e = -1;
    }
    p.routing.push_back(to_map(k, experts));
    p.hidden.push_back(
        TokenRows{masked.count(r) ? empty[size_t(r)].view() : s.x[size_t(r)].view(), {}});
  }
  MOED_ASSIGN_OR_RETURN(std::vector<ReferenceRankDispatch> d, reference_dispatch(p));
  std::vector<TensorView> ys;
  for (const ReferenceRankDispatch& rd : d) ys.push_back(rd.expert_input.x.view());
  return reference_combine(p, ys);
}

struct ShrinkCase {
  int ranks, per_node, victim, stop_at;
};

class ShrinkTest : public ::testing::TestWithParam<Backend> {};

// Steps of dispatch (bf16; hook on odd steps) and combine with identity experts; the victim
// stops calling at step `stop_at`. Every other rank: each step equals the full reference
// before, the masked one from then on, and its mask names the victim.
Status run_silent_rank(Backend b, const ShrinkCase& c) {
  const int experts = 2 * c.ranks;
  constexpr int kSteps = 4;
  std::vector<Step> steps;
  std::vector<std::vector<Tensor>> full, masked;
  for (int i = 0; i < kSteps; ++i) {
    steps.push_back(make_step(c.ranks, experts, 7 + uint32_t(i)));
    MOED_ASSIGN_OR_RETURN(std::vector<Tensor> f, masked_reference(steps.back(), experts, {}));
    MOED_ASSIGN_OR_RETURN(std::vector<Tensor> m,
                          masked_reference(steps.back(), experts, {c.victim}));
    full.push_back(std::move(f));
    masked.push_back(std::move(m));
  }
  return run_world(b, c.ranks, c.per_node, [&](World& w) -> Status {
    const LowLatencyOptions opts{.enable_shrink = true, .shrink_timeout = kShrinkTimeout};
    MOED_ASSIGN_OR_RETURN(auto buf,
                          LowLatencyBuffer::create(w, kMaxTokens, kHidden, experts, opts));
    const int me = w.rank();
    for (int i = 0; i < kSteps; ++i) {
      if (me == c.victim && i == c.stop_at) return ok_status();  // silent from here on
      const Step& s = steps[size_t(i)];
      const bool hook = i % 2 == 1;
      MOED_ASSIGN_OR_RETURN(
          LowLatencyRoundTrip o,
          low_latency_round_trip(*buf, s.x[size_t(me)].view(), s.topk[size_t(me)], hook));
      const bool gone = i >= c.stop_at;
      const Tensor& want = (gone ? masked : full)[size_t(i)][size_t(me)];
      if (!bitwise_equal(o.combine.result(), want.view())) {
        return internal_error("rank ", me, ", step ", i, ": combine differs from the ",
                              gone ? "masked" : "full", " reference");
      }
      std::vector<int32_t> mask = buf->query_mask();
      for (int r = 0; r < c.ranks; ++r) {
        if (mask[size_t(r)] != int32_t(gone && r == c.victim)) {
          return internal_error("rank ", me, ", step ", i, ": mask[", r, "] = ", mask[size_t(r)]);
        }
      }
    }
    return buf->clean();
  });
}

TEST_P(ShrinkTest, ASilentRankIsMaskedAndTheOthersMatchTheMaskedReference) {
  for (const ShrinkCase& c : {ShrinkCase{4, 0, 1, 2}, ShrinkCase{5, 0, 3, 1},
                              ShrinkCase{4, 2, 2, 2}, ShrinkCase{7, 0, 6, 0}}) {
    SCOPED_TRACE(::testing::Message() << c.ranks << " ranks, G = " << c.per_node << ", victim "
                                      << c.victim << " stops at step " << c.stop_at);
    const auto start = std::chrono::steady_clock::now();
    Status s = run_silent_rank(GetParam(), c);
    ASSERT_TRUE(s.ok()) << s.to_string();
    // The victim costs one shrink timeout (each rank masks it once), not the world's.
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
  }
}

TEST_P(ShrinkTest, ARankThatComesBackIsToldItWasRemoved) {
  const int R = 4, E = 8, victim = 2;
  const Step s = make_step(R, E, 3);
  Status st = run_world(GetParam(), R, 0, [&](World& w) -> Status {
    const LowLatencyOptions opts{.enable_shrink = true, .shrink_timeout = kShrinkTimeout};
    MOED_ASSIGN_OR_RETURN(auto buf, LowLatencyBuffer::create(w, kMaxTokens, kHidden, E, opts));
    const int me = w.rank();
    if (me == victim) std::this_thread::sleep_for(kShrinkTimeout * 4);
    StatusOr<LowLatencyDispatchOutput> d = buf->low_latency_dispatch(
        {.x = s.x[size_t(me)].view(), .topk = TopkView::of(s.topk[size_t(me)])});
    if (me != victim) {
      MOED_RETURN_IF_ERROR(d.status());
      return buf->query_mask()[size_t(victim)] == 1
                 ? ok_status()
                 : internal_error("rank ", me, " did not mask rank ", victim);
    }
    if (d.ok()) return internal_error("the removed rank's dispatch succeeded");
    if (d.status().message().find("was removed by rank") == std::string::npos)
      return internal_error("the removed rank got: ", d.status().to_string());
    // Every later call says so too, and the others see nothing of it.
    Status again = buf->clean();
    return again.message().find("was removed") != std::string::npos
               ? ok_status()
               : internal_error("clean after removal: ", again.to_string());
  });
  EXPECT_TRUE(st.ok()) << st.to_string();
}

// Two nodes of 2; node 1 goes silent. Rank 1 has masked its ranks by hand, rank 0 has not: in
// the first dispatch rank 0 waits out each of them in turn (2 timeouts) while rank 1 goes on
// to the combine and waits for rank 0 there. Rank 0 is alive, held up by its own waits: rank 1
// must not mask it (as when a cut link let one node-mate receive what the other did not).
TEST_P(ShrinkTest, ARankHeldUpByAnotherNodesLostRanksIsNotLostToItsNodeMate) {
  const int R = 4, E = 8;
  std::vector<Step> steps;
  std::vector<std::vector<Tensor>> want;
  for (int i = 0; i < 2; ++i) {
    steps.push_back(make_step(R, E, 11 + uint32_t(i)));
    StatusOr<std::vector<Tensor>> m = masked_reference(steps.back(), E, {2, 3});
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    want.push_back(std::move(m).value());
  }
  Status st = run_world(GetParam(), R, 2, [&](World& w) -> Status {
    const LowLatencyOptions opts{.enable_shrink = true, .shrink_timeout = kShrinkTimeout};
    MOED_ASSIGN_OR_RETURN(auto buf, LowLatencyBuffer::create(w, kMaxTokens, kHidden, E, opts));
    const int me = w.rank();
    if (me >= 2) return ok_status();  // silent from here on
    if (me == 1) {
      MOED_RETURN_IF_ERROR(buf->update_mask(2, true));
      MOED_RETURN_IF_ERROR(buf->update_mask(3, true));
    }
    for (int i = 0; i < 2; ++i) {
      const Step& s = steps[size_t(i)];
      MOED_ASSIGN_OR_RETURN(
          LowLatencyRoundTrip o,
          low_latency_round_trip(*buf, s.x[size_t(me)].view(), s.topk[size_t(me)], i == 1));
      if (!bitwise_equal(o.combine.result(), want[size_t(i)][size_t(me)].view()))
        return internal_error("rank ", me, ", step ", i, ": combine differs from the reference");
      if (buf->query_mask() != std::vector<int32_t>{0, 0, 1, 1})
        return internal_error("rank ", me, ", step ", i, ": mask ", buf->query_mask()[0], " ",
                              buf->query_mask()[1]);
    }
    return ok_status();
  });
  EXPECT_TRUE(st.ok()) << st.to_string();
}

TEST_P(ShrinkTest, BadInputIsAnErrorOnEveryRankThatReceivesFromIt) {
  const int R = 4, E = 8, bad = 1;
  const Step s = make_step(R, E, 5);
  std::mutex mu;
  std::vector<std::string> seen(static_cast<size_t>(R));
  Status st = run_world(GetParam(), R, 2, [&](World& w) -> Status {
    const LowLatencyOptions opts{.enable_shrink = true, .shrink_timeout = std::chrono::seconds(20)};
    MOED_ASSIGN_OR_RETURN(auto buf, LowLatencyBuffer::create(w, kMaxTokens, kHidden, E, opts));
    const int me = w.rank();
    TopkRouting topk = s.topk[size_t(me)];
    if (me == bad && !topk.topk_idx.empty()) topk.topk_idx[0] = E + 3;
    if (me == bad && topk.topk_idx.empty()) {
      topk = TopkRouting{1, kTopk, {E + 3, -1, -1}, {1, 0, 0}};
    }
    Tensor x = Tensor::zeros(DType::kBF16, topk.num_tokens, kHidden);
    StatusOr<LowLatencyDispatchOutput> d = buf->low_latency_dispatch(
        {.x = me == bad ? x.view() : s.x[size_t(me)].view(), .topk = TopkView::of(topk)});
    std::lock_guard<std::mutex> lock(mu);
    seen[size_t(me)] = d.ok() ? "ok" : d.status().message();
    // No one masked the bad rank: it answered, with its verdict.
    if (buf->query_mask()[size_t(bad)] != 0) return internal_error("rank ", me, " masked it");
    return ok_status();
  });
  ASSERT_TRUE(st.ok()) << st.to_string();
  for (int r = 0; r < R; ++r) {
    if (GetParam() != Backend::kThreads && seen[size_t(r)].empty()) continue;  // another process
    if (r == bad) {
      EXPECT_NE(seen[size_t(r)].find("is outside [-1, 8)"), std::string::npos) << seen[size_t(r)];
    } else {
      EXPECT_NE(seen[size_t(r)].find("rank 1: its input of low_latency_dispatch #1 was rejected"),
                std::string::npos)
          << "rank " << r << ": " << seen[size_t(r)];
    }
  }
}

TEST_P(ShrinkTest, TheMaskByHandAndItsErrors) {
  Status st = run_world(GetParam(), 3, 0, [&](World& w) -> Status {
    MOED_ASSIGN_OR_RETURN(auto plain, LowLatencyBuffer::create(w, 2, 128, 3));
    if (plain->update_mask(1, true).code() != StatusCode::kFailedPrecondition)
      return internal_error("update_mask without enable_shrink");
    if (plain->query_mask() != std::vector<int32_t>{0, 0, 0}) return internal_error("plain mask");
    MOED_RETURN_IF_ERROR(plain->clean());
    const LowLatencyOptions opts{.enable_shrink = true, .shrink_timeout = std::chrono::seconds(20)};
    MOED_ASSIGN_OR_RETURN(auto buf, LowLatencyBuffer::create(w, 2, 128, 3, opts));
    if (buf->update_mask(3, true).message().find("rank = 3 is outside [0, 3)") == std::string::npos)
      return internal_error("update_mask(3)");
    // A rank may mask itself, as in DeepEP: the entry is set, and unset again.
    MOED_RETURN_IF_ERROR(buf->update_mask(w.rank(), true));
    if (buf->query_mask()[size_t(w.rank())] != 1) return internal_error("masking oneself");
    MOED_RETURN_IF_ERROR(buf->update_mask(w.rank(), false));
    // Every rank masks rank 2 by hand; rank 2 masks no one: the clean barrier then involves
    // only ranks 0 and 1 (rank 2 reads it was removed).
    if (w.rank() != 2) MOED_RETURN_IF_ERROR(buf->update_mask(2, true));
    MOED_RETURN_IF_ERROR(w.barrier());
    Status cleaned = buf->clean();
    MOED_RETURN_IF_ERROR(w.barrier());  // rank 2 has looked before anyone unmasks it
    if (w.rank() == 2) {
      if (cleaned.message().find("was removed by rank 0") == std::string::npos)
        return internal_error("rank 2's clean: ", cleaned.to_string());
    } else {
      MOED_RETURN_IF_ERROR(cleaned);
      if (buf->query_mask() != std::vector<int32_t>{0, 0, 1}) return internal_error("mask");
      MOED_RETURN_IF_ERROR(buf->clean_mask());
      if (buf->query_mask() != std::vector<int32_t>{0, 0, 0}) return internal_error("clean_mask");
    }
    return w.barrier();
  });
  EXPECT_TRUE(st.ok()) << st.to_string();
}

INSTANTIATE_TEST_SUITE_P(Worlds, ShrinkTest, ::testing::ValuesIn(::moed::testing::backends()),
                         ::moed::testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed
