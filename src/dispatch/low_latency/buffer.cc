// LowLatencyBuffer: creation (checked across ranks), the segment layout, the size hint and the
// receive hook.
#include <array>
#include <atomic>

#include "dispatch/low_latency/state.h"

namespace moed {

namespace low_latency {

namespace {

class ReceiveHook final : public PendingOp {
 public:
  explicit ReceiveHook(std::function<Status()> receive) : receive_(std::move(receive)) {}
  // NOTE: a hook dropped without wait() still receives, so that the half it holds is freed
  // and the next operation's signals are not confused with this one's.
  ~ReceiveHook() override {
    if (!done_) wait().ignore();
  }
  Status wait() override {
    if (!done_) {
      done_ = true;
      result_ = receive_();
      receive_ = nullptr;
    }
    return result_;
  }
  bool ready() override { return done_; }  // the receive runs inside wait()

 private:
  std::function<Status()> receive_;
  bool done_ = false;
  Status result_;
};

}  // namespace

SegmentLayout SegmentLayout::make(int64_t max_tokens, int hidden, int num_ranks, int num_experts) {
  SegmentLayout l;
  l.max_tokens = max_tokens;
  l.hidden = hidden;
  l.num_ranks = num_ranks;
  l.num_experts = num_experts;
  l.num_local_experts = num_experts / num_ranks;
  l.num_scales = hidden % kFp8BlockSize == 0 ? hidden / kFp8BlockSize : 0;
  const size_t rows = size_t(num_experts) * size_t(max_tokens);
  size_t off = 0;
  for (int h = 0; h < 2; ++h) {
    l.counts[h] = off;
    off += align64(size_t(num_experts) * sizeof(uint64_t));
    l.dispatch_x[h] = off;
    off += align64(rows * size_t(hidden) * sizeof(bf16));
    l.dispatch_scales[h] = off;
    off += align64(rows * size_t(l.num_scales) * sizeof(float));
    l.dispatch_src[h] = off;
    off += align64(rows * sizeof(int32_t));
    l.dispatch_prob[h] = off;
    off += align64(rows * sizeof(float));
    l.combine_y[h] = off;
    off += align64(rows * size_t(hidden) * sizeof(bf16));
    l.acks[h] = off;
    off += align64(2 * size_t(num_ranks) * sizeof(uint64_t));  // G <= R
  }
  l.total = off;
  return l;
}

Request make_hook(std::function<Status()> receive) {
  return std::make_unique<ReceiveHook>(std::move(receive));
}

}  // namespace low_latency

size_t get_low_latency_size_hint(int64_t max_tokens_per_rank, int hidden, int num_ranks,
                                 int num_experts) {
  if (max_tokens_per_rank <= 0 || hidden <= 0 || num_ranks <= 0 || num_experts <= 0) return 0;
  return low_latency::SegmentLayout::make(max_tokens_per_rank, hidden, num_ranks, num_experts)
      .total;
}

LowLatencyBuffer::LowLatencyBuffer(std::shared_ptr<State> state) : state_(std::move(state)) {}

LowLatencyBuffer::~LowLatencyBuffer() = default;

StatusOr<std::unique_ptr<LowLatencyBuffer>> LowLatencyBuffer::create(World& world,
                                                                     int64_t max_tokens_per_rank,
                                                                     int hidden, int num_experts) {
  const int R = world.size();
  Status local;
  if (max_tokens_per_rank <= 0 || max_tokens_per_rank > INT32_MAX / R) {
    local = invalid_argument("max_tokens_per_rank = ", max_tokens_per_rank, " is outside [1, ",
                             INT32_MAX / R, "]");
  } else if (hidden <= 0) {
    local = invalid_argument("hidden = ", hidden, " must be positive");
  } else if (num_experts <= 0 || num_experts % R != 0) {
    local = invalid_argument("num_experts = ", num_experts,
                             " must be a positive multiple of the world size ", R);
  }
  MOED_RETURN_IF_ERROR(world.agree(local));

  // The slots are sized by M, H and E, and a sender writes at the receiver's offsets: all three
  // must be the same everywhere. Every rank sees the same table and names the same culprit.
  const std::array<int64_t, 3> mine = {max_tokens_per_rank, hidden, num_experts};
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> all,
                        all_gather<int64_t>(world, std::span<const int64_t>(mine)));
  static const char* const kNames[3] = {"max_tokens_per_rank", "hidden", "num_experts"};
  for (int r = 1; r < R; ++r) {
    for (int i = 0; i < 3; ++i) {
      const int64_t a = all[size_t(i)], b = all[size_t(r) * 3 + size_t(i)];
      if (a != b) {
        return invalid_argument("LowLatencyBuffer: ", kNames[i], " = ", a, " on rank 0 but ", b,
                                " on rank ", r, "; it must be the same on every rank");
      }
    }
  }

  auto state = std::make_shared<State>();
  state->world = &world;
  static std::atomic<uint64_t> next_id{1};
  // Ids only tell handles of different buffers apart on one rank; they need not agree.
  state->id = next_id.fetch_add(1, std::memory_order_relaxed);
  state->layout = low_latency::SegmentLayout::make(max_tokens_per_rank, hidden, R, num_experts);
  MOED_ASSIGN_OR_RETURN(state->shared, world.alloc_shared(state->layout.total));
  state->pull = world.shares_address_space();
  // Counts start at sequence 0, which no operation uses. The output vectors get their final
  // size once, so the spans handed out never move.
  const int L = num_experts / R;
  for (int h = 0; h < 2; ++h) {
    low_latency::DispatchHalf& dh = state->dispatch_half[h];
    dh.recv_count.assign(size_t(L), 0);
    dh.layout_range.assign(size_t(L) * R, LowLatencyRange{});
    dh.recv_header.assign(size_t(R) * L, 0);
    dh.send_header.assign(size_t(R) * L, 0);
    std::atomic<uint64_t>* c = state->counts(world.local_rank(), h);
    for (int e = 0; e < num_experts; ++e) c[e].store(0, std::memory_order_relaxed);
    for (auto k : {low_latency::PullKind::kDispatch, low_latency::PullKind::kCombine}) {
      std::atomic<uint64_t>* a = state->acks(world.local_rank(), h, k);
      for (int p = 0; p < world.ranks_per_node(); ++p) a[p].store(0, std::memory_order_relaxed);
    }
    if (state->pull) {
      dh.pull_tokens.assign(size_t(num_experts) * size_t(max_tokens_per_rank), 0);
      dh.pull_probs.assign(size_t(num_experts) * size_t(max_tokens_per_rank), 0.0f);
    }
  }
  MOED_RETURN_IF_ERROR(world.barrier());
  return std::unique_ptr<LowLatencyBuffer>(new LowLatencyBuffer(std::move(state)));
}

World& LowLatencyBuffer::world() const { return *state_->world; }
int64_t LowLatencyBuffer::max_tokens_per_rank() const { return state_->layout.max_tokens; }
int LowLatencyBuffer::hidden() const { return state_->layout.hidden; }
int LowLatencyBuffer::num_experts() const { return state_->layout.num_experts; }
int LowLatencyBuffer::num_local_experts() const { return state_->layout.num_local_experts; }
size_t LowLatencyBuffer::bytes() const { return state_->layout.total; }

}  // namespace moed
