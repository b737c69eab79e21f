// LowLatencyBuffer: creation (checked across ranks), the segment layout and the size hint.
#include <array>
#include <atomic>

#include "comm/agreement.h"
#include "comm/wait.h"
#include "core/block_cache.h"
#include "dispatch/low_latency/segment.h"
#include "dispatch/low_latency/state.h"
#include "dispatch/sections.h"

namespace moed {

namespace low_latency {

SegmentLayout SegmentLayout::make(int64_t max_tokens, int hidden, int num_ranks, int num_experts,
                                  bool shrink) {
  SegmentLayout l{.max_tokens = max_tokens,
                  .hidden = hidden,
                  .num_ranks = num_ranks,
                  .num_experts = num_experts,
                  .num_local_experts = num_experts / num_ranks,
                  .num_scales = hidden % kFp8BlockSize == 0 ? hidden / kFp8BlockSize : 0};
  const size_t rows = size_t(num_experts) * size_t(max_tokens);
  // A push needs no dispatch slots.
  l.slot_block = BlockLayout::of(shrink ? int64_t(rows) : 0, hidden, l.num_scales);
  Sections s(64);
  for (int h = 0; h < 2; ++h) {
    l.counts[h] = s.add(size_t(num_experts) * sizeof(uint64_t));
    l.slots[h] = s.add(l.slot_block.bytes);
    l.combine_y[h] = s.add(rows * size_t(hidden) * sizeof(bf16));
    l.ranges[h] = s.add(size_t(l.num_local_experts) * size_t(num_ranks) * sizeof(LowLatencyRange));
  }
  l.words = s.add((kWords + size_t(num_ranks)) * sizeof(uint64_t));
  l.total = s.aligned_end();
  return l;
}

BlockLayout BlockLayout::of(int64_t rows, int hidden, int num_scales) {
  const size_t n = size_t(rows);
  BlockLayout l;
  Sections s(64);
  l.x = s.add(n * size_t(hidden) * sizeof(bf16));
  l.scales = s.add(n * size_t(num_scales) * sizeof(float));
  l.src = s.add(n * sizeof(int32_t));
  l.prob = s.add(n * sizeof(float));
  l.bytes = s.aligned_end();
  return l;
}

namespace {

std::shared_ptr<ReceiveBlock> new_block(const LowLatencyBuffer::State& st, std::byte* base,
                                        std::shared_ptr<void> memory, bool fp8) {
  const SegmentLayout& lay = st.layout;
  auto b = std::make_shared<ReceiveBlock>();
  b->base = base;
  b->lay = st.block_layout;
  b->fp8 = fp8;
  b->recv_count.assign(size_t(lay.num_local_experts), 0);
  b->layout_range.assign(size_t(lay.num_local_experts) * size_t(lay.num_ranks), LowLatencyRange{});
  b->memory = std::move(memory);
  return b;
}

}  // namespace

std::shared_ptr<ReceiveBlock> take_receive_block(LowLatencyBuffer::State& st, int half,
                                                 bool fp8) {
  std::shared_ptr<ReceiveBlock>& b = st.dispatch_half[half].received;
  // NOTE: use_count() == 1 means no output holds the block and none can take it any more (only
  // this half hands it out); a count read high while an output is being dropped elsewhere only
  // costs a fresh block.
  if (b && b.use_count() == 1) {
    // The last other holder's reads (on any thread: torch frees where it likes) happen before
    // this receive's writes: its release decrement pairs with this acquire.
    std::atomic_thread_fence(std::memory_order_acquire);
    b->fp8 = fp8;
    return b;
  }
  const BlockLayout& bl = st.block_layout;
  auto memory = std::make_shared<Tensor>(Tensor::empty(DType::kFP8, 1, int64_t(bl.bytes)));
  // Each expert's rows fill the start of its R * M slots: small pages, or every expert's
  // first rows would each touch (and the kernel clear) a 2 MiB page.
  internal::advise_sparse(memory->data(), bl.bytes);
  auto* base = static_cast<std::byte*>(memory->data());
  b = new_block(st, base, std::move(memory), fp8);
  return b;
}

std::shared_ptr<ReceiveBlock> ring_receive_block(LowLatencyBuffer::State& st, int slot, bool fp8) {
  const flex::Region& region = st.recv_ring.region(slot);
  return new_block(st, reinterpret_cast<std::byte*>(region.local()), st.recv_ring.hold(slot), fp8);
}

void view_receive_block(const LowLatencyBuffer::State& st, std::shared_ptr<ReceiveBlock> block,
                        LowLatencyDispatchOutput& out) {
  const SegmentLayout& lay = st.layout;
  const int64_t rows = int64_t(lay.num_local_experts) * lay.rows_per_expert();
  out.num_local_experts = lay.num_local_experts;
  out.rows_per_expert = lay.rows_per_expert();
  out.recv.x = TensorView(block->x(), block->fp8 ? DType::kFP8 : DType::kBF16, rows, lay.hidden);
  out.recv.scales =
      block->fp8 ? TensorView(block->scales(), DType::kF32, rows, lay.num_scales) : TensorView();
  out.recv_count = std::span<const int32_t>(block->recv_count);
  out.src_info = std::span<const int32_t>(block->src(), size_t(rows));
  out.recv_probs = std::span<const float>(block->prob(), size_t(rows));
  out.layout_range = std::span<const LowLatencyRange>(block->layout_range);
  out.storage = std::move(block);
}

}  // namespace low_latency

size_t get_low_latency_size_hint(int64_t max_tokens_per_rank, int hidden, int num_ranks,
                                 int num_experts) {
  if (max_tokens_per_rank <= 0 || hidden <= 0 || num_ranks <= 0 || num_experts <= 0) return 0;
  // The larger layout, shrink mode's: DeepEP's num_rdma_bytes does not say which mode.
  return low_latency::SegmentLayout::make(max_tokens_per_rank, hidden, num_ranks, num_experts,
                                          /*shrink=*/true)
      .total;
}

LowLatencyBuffer::LowLatencyBuffer(std::shared_ptr<State> state) : state_(std::move(state)) {}

LowLatencyBuffer::~LowLatencyBuffer() = default;

LowLatencyBuffer::State::~State() {
  for (low_latency::DispatchHalf& h : dispatch_half) {
    h.header_requests.clear();
    h.send_requests.clear();
  }
  for (low_latency::CombineHalf& h : combine_half) {
    h.recvs.clear();
    h.row_recvs.clear();
    h.requests.clear();
  }
}

StatusOr<std::unique_ptr<LowLatencyBuffer>> LowLatencyBuffer::create(
    World& world, int64_t max_tokens_per_rank, int hidden, int num_experts,
    const LowLatencyOptions& options) {
  const int R = world.size();
  Status local;
  if (options.enable_shrink && options.shrink_timeout.count() <= 0) {
    local =
        invalid_argument("shrink_timeout = ", options.shrink_timeout.count(), " ms must be > 0");
  }
  if (max_tokens_per_rank <= 0 || max_tokens_per_rank > INT32_MAX / R) {
    local = invalid_argument("max_tokens_per_rank = ", max_tokens_per_rank, " is outside [1, ",
                             INT32_MAX / R, "]");
  } else if (!local.ok()) {
    // the shrink timeout's error stands
  } else if (hidden <= 0) {
    local = invalid_argument("hidden = ", hidden, " must be positive");
  } else if (num_experts <= 0 || num_experts % R != 0) {
    local = invalid_argument("num_experts = ", num_experts,
                             " must be a positive multiple of the world size ", R);
  }
  if (options.segment) {
    // No collective: this rank's checks are its own (the caller passes the same shape).
    MOED_RETURN_IF_ERROR(local);
    const size_t need = low_latency::SegmentLayout::make(max_tokens_per_rank, hidden, R,
                                                         num_experts, options.enable_shrink)
                            .total;
    if (options.segment->bytes() < need) {
      return invalid_argument(
          "the segment has ", options.segment->bytes(),
          " bytes; the low-latency buffer of (max_tokens_per_rank = ", max_tokens_per_rank,
          ", hidden = ", hidden, ", num_experts = ", num_experts, ") needs ", need,
          " (get_low_latency_size_hint)");
    }
    return make_state(world, max_tokens_per_rank, hidden, num_experts, options);
  }
  // The slots are sized by M, H and E, and a sender writes at the receiver's offsets: all three
  // must be the same everywhere. Every rank sees the same table and names the same culprit.
  using F = AgreedField;
  const AgreedField fields[] = {
      {"LowLatencyBuffer: max_tokens_per_rank", max_tokens_per_rank, F::kAgree},
      {"LowLatencyBuffer: hidden", hidden, F::kAgree},
      {"LowLatencyBuffer: num_experts", num_experts, F::kAgree},
      {"LowLatencyBuffer: enable_shrink", options.enable_shrink, F::kAgree}};
  MOED_RETURN_IF_ERROR(agree_in_one(world, local, fields).status());

  MOED_ASSIGN_OR_RETURN(std::unique_ptr<LowLatencyBuffer> buffer,
                        make_state(world, max_tokens_per_rank, hidden, num_experts, options));
  // Every rank has zeroed its own counters before any peer reads them.
  MOED_RETURN_IF_ERROR(world.barrier());
  return buffer;
}

StatusOr<std::unique_ptr<LowLatencyBuffer>> LowLatencyBuffer::make_state(
    World& world, int64_t max_tokens_per_rank, int hidden, int num_experts,
    const LowLatencyOptions& options) {
  const int R = world.size();
  auto state = std::make_shared<State>();
  state->world = &world;
  static std::atomic<uint64_t> next_id{1};
  // Ids only tell handles of different buffers apart on one rank; they need not agree.
  state->id = next_id.fetch_add(1, std::memory_order_relaxed);
  state->layout = low_latency::SegmentLayout::make(max_tokens_per_rank, hidden, R, num_experts,
                                                   options.enable_shrink);
  const low_latency::SegmentLayout& lay = state->layout;
  state->block_layout = low_latency::BlockLayout::of(
      int64_t(lay.num_local_experts) * lay.rows_per_expert(), lay.hidden, lay.num_scales);
  if (options.segment) {
    state->shared = options.segment;
  } else {
    MOED_ASSIGN_OR_RETURN(state->shared, world.alloc_shared(state->layout.total));
    // Its slots take a few rows each at decode: small pages (advise_sparse).
    internal::advise_sparse(state->shared->local(), state->layout.total);
  }
  // Shrink mode reads and writes no caller memory across ranks (segment_peers.h).
  state->in_place = world.shares_address_space() && !options.enable_shrink;
  state->topo = flex::Topology{.num_ranks = R,
                               .ranks_per_node = world.ranks_per_node(),
                               .num_nodes = R / world.ranks_per_node(),
                               .num_experts = num_experts,
                               .num_local_experts = num_experts / R,
                               .rank = world.rank(),
                               .node = world.node(),
                               .local_rank = world.local_rank()};
  // The push's and the in-place combine's signals; shrink mode makes no collective call after
  // create().
  if (!options.enable_shrink) MOED_RETURN_IF_ERROR(state->dispatch_signals.init(world));
  if (state->in_place) MOED_RETURN_IF_ERROR(state->combine_signals.init(world));
  state->shrink = options.enable_shrink;
  state->shrink_timeout = options.shrink_timeout;
  const int L = num_experts / R;
  for (int h = 0; h < 2; ++h) {
    low_latency::DispatchHalf& dh = state->dispatch_half[h];
    // [R][verdict, L counts, tokens] (dispatch_rows.h, header_ints).
    dh.recv_header.assign(size_t(R) * low_latency::header_ints(L), 0);
    dh.send_header.assign(size_t(R) * low_latency::header_ints(L), 0);
    // A segment given by the caller was zeroed by every rank before: a peer may be writing
    // its own part already.
    if (!options.segment) {
      std::atomic<uint64_t>* c = state->counts(world.local_rank(), h);
      for (int e = 0; e < num_experts; ++e) c[e].store(0, std::memory_order_relaxed);
    }
  }
  if (!options.segment) {
    for (size_t i = 0; i < low_latency::kWords + size_t(R); ++i)
      state->segment_word(world.local_rank(), i)->store(0, std::memory_order_relaxed);
  }
  return std::unique_ptr<LowLatencyBuffer>(new LowLatencyBuffer(std::move(state)));
}

Status LowLatencyBuffer::clean() {
  if (state_->shrink) return low_latency::segment_clean(*state_);
  return state_->world->barrier();
}

std::vector<int32_t> LowLatencyBuffer::query_mask() const {
  const State& st = *state_;
  std::vector<int32_t> mask(size_t(st.layout.num_ranks), 0);
  if (!st.shrink) return mask;
  for (int r = 0; r < st.layout.num_ranks; ++r) {
    mask[size_t(r)] =
        int32_t(st.segment_word(st.world->local_rank(), low_latency::kMask + size_t(r))
                    ->load(std::memory_order_acquire));
  }
  return mask;
}

Status LowLatencyBuffer::update_mask(int rank, bool mask) {
  State& st = *state_;
  if (!st.shrink) {
    return failed_precondition("update_mask: the buffer was made without enable_shrink");
  }
  if (rank < 0 || rank >= st.layout.num_ranks) {
    return invalid_argument("update_mask: rank = ", rank, " is outside [0, ", st.layout.num_ranks,
                            ")");
  }
  // NOTE: a rank may mask itself, as in DeepEP: it then skips its traffic with itself (its own
  // tokens to its own experts); its peers' masks are theirs, so none of them waits on this one.
  st.segment_word(st.world->local_rank(), low_latency::kMask + size_t(rank))
      ->store(mask ? 1 : 0, std::memory_order_release);
  return ok_status();
}

Status LowLatencyBuffer::clean_mask() {
  State& st = *state_;
  if (!st.shrink) {
    return failed_precondition("clean_mask: the buffer was made without enable_shrink");
  }
  for (int r = 0; r < st.layout.num_ranks; ++r) MOED_RETURN_IF_ERROR(update_mask(r, false));
  return ok_status();
}

World& LowLatencyBuffer::world() const { return *state_->world; }
int64_t LowLatencyBuffer::max_tokens_per_rank() const { return state_->layout.max_tokens; }
int LowLatencyBuffer::hidden() const { return state_->layout.hidden; }
int LowLatencyBuffer::num_experts() const { return state_->layout.num_experts; }
int LowLatencyBuffer::num_local_experts() const { return state_->layout.num_local_experts; }
size_t LowLatencyBuffer::bytes() const { return state_->layout.total; }

}  // namespace moed
