// A low-latency dispatch output owns what it views (LowLatencyDispatchOutput::storage): held
// outputs keep their bits through any number of later dispatches, and outlive their buffer and
// their world. Run under ASan in CI, where a view into freed or reused memory is an error.
#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <vector>

#include "low_latency/low_latency_test_util.h"

namespace moed {
namespace {

using namespace low_latency_test;  // NOLINT: Problem, Case, make_problem, the checks, ...
using ::moed::testing::run_world;

// Everything an output views, copied.
struct Snapshot {
  std::vector<std::byte> x, scales;
  std::vector<int32_t> count, src;
  std::vector<float> prob;
  std::vector<LowLatencyRange> ranges;

  static Snapshot of(const LowLatencyDispatchOutput& d) {
    Snapshot s;
    auto bytes = [](const TensorView& v) {
      std::vector<std::byte> b(size_t(v.rows) * v.row_bytes());
      for (int64_t i = 0; i < v.rows; ++i)
        std::memcpy(b.data() + size_t(i) * v.row_bytes(), v.row_ptr(i), v.row_bytes());
      return b;
    };
    s.x = bytes(d.recv.x);
    s.scales = bytes(d.recv.scales);
    s.count.assign(d.recv_count.begin(), d.recv_count.end());
    s.src.assign(d.src_info.begin(), d.src_info.end());
    s.prob.assign(d.recv_probs.begin(), d.recv_probs.end());
    s.ranges.assign(d.layout_range.begin(), d.layout_range.end());
    return s;
  }
  bool operator==(const Snapshot& o) const {
    auto same_ranges = [&] {
      if (ranges.size() != o.ranges.size()) return false;
      for (size_t i = 0; i < ranges.size(); ++i)
        if (ranges[i].begin != o.ranges[i].begin || ranges[i].count != o.ranges[i].count)
          return false;
      return true;
    };
    return x == o.x && scales == o.scales && count == o.count && src == o.src &&
           std::memcmp(prob.data(), o.prob.data(), prob.size() * sizeof(float)) == 0 &&
           prob.size() == o.prob.size() && same_ranges();
  }
};

// Four dispatches (with and without a hook, bf16 and fp8), each output held: after the last,
// every one still holds its own bits and matches its reference.
TEST_P(LowLatencyTest, HeldOutputsNeverChange) {
  for (const Case& c : {Case{4, 0, 8, 128, 3, 6, 71}, Case{4, 2, 8, 256, 2, 5, 72},
                        Case{3, 0, 6, 128, 6, 4, 73}}) {
    const auto ab = two_problems(c);
    ASSERT_TRUE(ab.ok()) << ab.status().to_string();
    Status s = run_with_buffer(GetParam(), c, [&](World& w, LowLatencyBuffer& buffer) -> Status {
      const int me = w.rank();
      std::vector<LowLatencyDispatchOutput> held;
      std::vector<Snapshot> shots;
      for (int i = 0; i < 4; ++i) {
        const Problem& p = (*ab)[size_t(i % 2)];
        const bool fp8 = i == 2, hook = i % 2 == 1;
        MOED_ASSIGN_OR_RETURN(auto d,
                              buffer.low_latency_dispatch({.x = p.x[size_t(me)].view(),
                                                           .topk = TopkView::of(p.topk[size_t(me)]),
                                                           .use_fp8 = fp8,
                                                           .return_recv_hook = hook}));
        MOED_RETURN_IF_ERROR(d.hook->wait());
        MOED_RETURN_IF_ERROR(check_dispatch(p, me, d, fp8, false));
        shots.push_back(Snapshot::of(d));
        held.push_back(std::move(d));
      }
      for (size_t i = 0; i < held.size(); ++i) {
        if (!(Snapshot::of(held[i]) == shots[i]))
          return internal_error("dispatch output ", i, " changed under its holder");
        MOED_RETURN_IF_ERROR(
            check_dispatch((*ab)[i % 2], me, held[i], i == 2, false));
      }
      return ok_status();
    });
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
}

// An output read after its buffer is gone and a new buffer of the same shape has run, and
// (threads world) after the world itself is gone.
TEST_P(LowLatencyTest, OutputsOutliveTheirBufferAndWorld) {
  const Case c{4, 0, 8, 128, 3, 6, 81};
  const auto p = make_problem(c);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  std::vector<std::optional<LowLatencyDispatchOutput>> kept(size_t(c.ranks));
  std::vector<Snapshot> shots(size_t(c.ranks));
  Status s = run_world(GetParam(), c.ranks, c.per_node, [&](World& w) -> Status {
    const int me = w.rank();
    {
      MOED_ASSIGN_OR_RETURN(auto buffer,
                            LowLatencyBuffer::create(w, c.max_tokens, c.hidden, c.num_experts));
      MOED_ASSIGN_OR_RETURN(
          auto d, buffer->low_latency_dispatch(
                      {.x = p->x[size_t(me)].view(), .topk = TopkView::of(p->topk[size_t(me)])}));
      shots[size_t(me)] = Snapshot::of(d);
      kept[size_t(me)] = std::move(d);
    }
    MOED_ASSIGN_OR_RETURN(auto again,
                          LowLatencyBuffer::create(w, c.max_tokens, c.hidden, c.num_experts));
    for (int i = 0; i < 2; ++i) {
      MOED_ASSIGN_OR_RETURN(
          auto d, again->low_latency_dispatch(
                      {.x = p->x[size_t(me)].view(), .topk = TopkView::of(p->topk[size_t(me)])}));
    }
    if (!(Snapshot::of(*kept[size_t(me)]) == shots[size_t(me)]))
      return internal_error("the output changed once its buffer was gone");
    return check_dispatch(*p, me, *kept[size_t(me)], false, false);
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
  // Under MPI only this process's rank ran here.
  for (size_t r = 0; r < kept.size(); ++r) {
    if (!kept[r]) continue;
    EXPECT_TRUE(Snapshot::of(*kept[r]) == shots[r]) << "rank " << r << " after its world";
  }
}

}  // namespace
}  // namespace moed
