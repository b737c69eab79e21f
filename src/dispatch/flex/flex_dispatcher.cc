// The Flex dispatcher (design.md §5): the six steps and their backward on top of the phases
// (layout.cc, notify.cc, intranode_* / internode_*). The class and its per-step state are in
// steps.h; this file has the dispatch steps, combine_steps.cc the combine and the backward.
//
// NOTE (one collective per step): every communicating step starts with exactly one collective,
// agree_in_one (comm/agreement.h), and makes none before its data moves. Its row carries this
// rank's verdict on its input (the status code), the values every rank must share and the
// step's payload:
//   - dispatch: [code, cached mode, hidden, dtype, num_topk, held outputs] + notify's counts
//     ([T, C_s, counts[E], tokens_per_node[N]]; zeros in cached mode). dispatch_preprocess is
//     local only (checks and the effective routing, prepare_dispatch_input); the cached
//     mode, the verdicts, the shapes, the ring slot (below) and every rank's layout all come
//     out of this one all-gather in token_dispatch. A cached dispatch sends the same row
//     (counts unused), so a rank in the other mode is found in the same collective.
//   - combine: [code, expert_output dtype]; dispatch backward: [code, dtype, grad of the probs
//     given]; combine backward: [code, grad dtype, expert_output dtype].
// A bad input on any rank is then every rank's error before anything is written (the error's
// message is fetched in further collectives, on the error path only), and every rank has left
// the previous step before its memory is written again; inside the step only per-pair signals
// order the shared-memory traffic. A collective that allocates node-shared memory
// (alloc_shared, counted in TrafficCounters::collectives too) happens only when a region grows,
// the ring gains a slot or every slot is held, never in the steady state of equal shapes.
//
// NOTE (buffers, lifetime rule of moed/dispatcher.h): the dispatch output lives in node-shared
// memory (DeepEP's NVL buffer), so that peers write their rows straight into it. The regions
// form a ring (OutputRing): each output's storage holds its slot, and the next dispatch writes
// into the lowest slot that no local rank's caller still holds (each rank's held mask travels
// in the agreement; allocating node-shared memory is collective over the node, so every
// local rank must pick the same slot). A caller that drops each output before the next
// dispatch uses one slot; one that keeps k outputs uses k + 1, up to OutputRing::kMaxSlots,
// beyond which each output gets a region of its own. The storage also keeps the memory
// itself (node-shared memory is freed locally with its last owner: heap in the threads world,
// a munmap of unlinked POSIX segments in the MPI and gloo worlds), so an output may outlive
// the dispatcher in every world.
// token_*(async = true) runs the step on its own thread where the world allows calls from any
// thread (threads; MPI initialised with MPI_THREAD_MULTIPLE); elsewhere the step runs eagerly
// and returns a completed request.
// Combine reads the expert outputs where they are when the world shares one address space
// (threads); otherwise (MPI) they are copied into a shared region first (counted), unless the
// experts wrote them into expert_output_buffer().
#include "dispatch/flex/flex_dispatcher.h"

#include <algorithm>
#include <cstring>

#include "core/row_checks.h"
#include "core/row_kernels.h"
#include "dispatch/flex/steps.h"

namespace moed {
namespace flex {
namespace {

std::atomic<uint64_t> g_next_dispatcher_id{1};

// The verdict of the dispatch's first field when the ranks disagree on cached mode.
constexpr const char* kCachedModeName =
    "cached mode (cached_handle given; cached mode must be used by every rank)";

}  // namespace

Dispatcher::Dispatcher(World& world, const DispatchConfig& config)
    : moed::FlexDispatcher(world, config),
      id_(g_next_dispatcher_id.fetch_add(1)),
      topo_(Topology::of(world, config)),
      in_place_(world.shares_address_space()) {}

// ---- dispatch ----

Status Dispatcher::dispatch_preprocess(const DispatchInput& input, const Status& caller_error) {
  dispatch_ = DispatchStep{};
  DispatchStep& d = dispatch_;
  d.rows = input.hidden;
  d.dtype = input.hidden.x.dtype;
  d.hidden = input.hidden.x.cols;
  d.out = input.out;
  d.cached_mode = input.cached_handle != nullptr;
  if (!caller_error.ok()) {
    d.local = caller_error;
  } else if (d.cached_mode) {
    d.local = check_cached(input);
    if (d.local.ok()) d.local = check_dispatch_out_columns(input);  // (uncached: in prepare's)
  } else {
    StatusOr<PreparedInput> p = prepare_dispatch_input(config_, input, world_->pool());
    if (p.ok()) {
      d.prepared = std::move(*p);
    } else {
      d.local = p.status();
    }
  }
  d.staged = true;
  return ok_status();  // the verdict is agreed in token_dispatch's one collective
}

StatusOr<DispatchOutput> Dispatcher::dispatch_postprocess() {
  DispatchStep& d = dispatch_;
  MOED_RETURN_IF_ERROR(step_status(d.op, kDispatchCalls.token));
  std::shared_ptr<const FlexHandle> h = d.cached ? d.cached : d.fresh;
  DispatchOutput out;
  char* seg = outputs_.region(d.slot).local();
  out.expert_input.x = TensorView(seg, d.dtype, h->num_rows, d.hidden);
  const bool fp8 = d.dtype == DType::kFP8;
  if (fp8) {
    out.expert_input.scales =
        TensorView(seg + d.layout.scales_off, DType::kF32, h->num_rows, d.hidden / kFp8BlockSize);
  }
  out.permuted_probs = std::span<const float>(h->permuted_probs);
  out.tokens_per_expert = std::span<const int64_t>(h->tokens_per_expert);
  if (d.out) {
    // The peers wrote the region; one copy of each row into the caller's buffer, after which
    // the slot is free again unless the fp8 scales (which stay ours) still live in it.
    internal::copy_rows(*d.out, 0, out.expert_input.x, 0, h->num_rows, &world_->pool());
    out.expert_input.x = *d.out;
    if (fp8) out.storage = outputs_.hold(d.slot);
  } else {
    out.storage = outputs_.hold(d.slot);
  }
  out.handle = std::move(h);
  dispatch_ = DispatchStep{};
  return out;
}

Status Dispatcher::dispatch_body() {
  DispatchStep& d = dispatch_;
  std::vector<int64_t> counts(notify_row_width(topo_), 0);
  if (d.local.ok() && !d.cached_mode) {
    d.fresh = notify_local(*world_, config_, std::move(*d.prepared), id_, &counts);
    d.prepared.reset();
  }
  const TensorView& x = d.rows.x;
  const int64_t num_topk = d.cached ? d.cached->num_topk : d.fresh ? d.fresh->num_topk : 0;
  const AgreedField fields[] = {
      {kCachedModeName, d.cached_mode ? 1 : 0, AgreedField::kFirst},
      {"hidden", x.cols, AgreedField::kAgree},
      {"dtype", int64_t(x.dtype), AgreedField::kAgreeDType},
      {"num_topk", num_topk, AgreedField::kAgree},
      {"held outputs", int64_t(outputs_.held_mask()), AgreedField::kFree},
      {"out rows", d.out ? d.out->rows : -1, AgreedField::kFree},
  };
  constexpr size_t kHeld = 4, kOutRows = 5, kCounts = 1 + std::size(fields);
  MOED_ASSIGN_OR_RETURN(AgreedTable t, agree_in_one(*world_, d.local, fields, counts));
  MOED_CHECK(t.width == dispatch_agreement_width(topo_));

  d.slot = outputs_.pick(topo_, [&](int r) { return uint64_t(t.field(r, kHeld)); });
  if (d.fresh) MOED_RETURN_IF_ERROR(notify_finish(config_, *d.fresh, t.table, t.width, kCounts));

  const FlexHandle& h = d.handle();
  // Every rank's `out` against the rows it receives: the same table, so the same verdict.
  for (int r = 0; r < world_->size(); ++r) {
    const int64_t got = t.field(r, kOutRows);
    const int64_t want =
        config_.num_worst_tokens > 0 ? config_.num_worst_tokens : h.notified.rank_rows[size_t(r)];
    if (got >= 0 && got != want) {
      return invalid_argument("rank ", r, ": out is [", got, ", ", x.cols, "]; expected [", want,
                              ", ", x.cols, "]");
    }
  }
  d.layout = PushLayout::of(node_cap_rows(h), dtype_row_bytes(x.dtype, x.cols),
                            scale_row_bytes(x.dtype, x.cols), /*meta=*/true);
  Region& target = outputs_.region(d.slot);
  MOED_RETURN_IF_ERROR(target.ensure(*world_, d.layout.bytes));
  // No local rank holds an output of this slot (that is why it was picked), so nothing can
  // read the buffer it had before growing: free it now (on every local rank, same point).
  target.release_retired();
  PushSpec spec{d.rows, false, &target, d.layout};
  DispatchContext ctx{world_, &config_, &h, d.cached ? nullptr : &d.fresh->forward,
                      net(tags::kFlexDispatch)};
  MOED_RETURN_IF_ERROR(push_step(ctx, spec, tags::kFlexDispatch));
  d.rows = TokenRows{};
  if (d.fresh) {
    // The owner's metadata rows, for the handle (combine and the backward passes use them).
    const char* seg = target.local();
    const size_t n = size_t(d.fresh->num_rows);
    const auto* probs = reinterpret_cast<const float*>(seg + d.layout.prob_off);
    const auto* src_rank = reinterpret_cast<const int32_t*>(seg + d.layout.src_rank_off);
    const auto* src_token = reinterpret_cast<const int32_t*>(seg + d.layout.src_token_off);
    const auto* src_slot = reinterpret_cast<const int32_t*>(seg + d.layout.src_slot_off);
    d.fresh->permuted_probs.assign(probs, probs + n);
    d.fresh->row_src_rank.assign(src_rank, src_rank + n);
    d.fresh->row_src_token.assign(src_token, src_token + n);
    d.fresh->row_src_slot.assign(src_slot, src_slot + n);
  }
  return ok_status();
}

// ---- shared by the steps ----

std::shared_ptr<const FlexHandle> Dispatcher::own_handle(
    const std::shared_ptr<const DispatchHandle>& handle, Status* local) const {
  auto h = std::dynamic_pointer_cast<const FlexHandle>(handle);
  *local = ok_status();
  if (h == nullptr || h->dispatcher_id != id_) {
    *local = invalid_argument("the handle is ", handle ? "from another dispatcher" : "null",
                              "; pass the handle of this Flex dispatcher's dispatch");
  }
  return h;
}

Status Dispatcher::check_cached(const DispatchInput& input) {
  auto h = std::dynamic_pointer_cast<const FlexHandle>(input.cached_handle);
  if (h == nullptr || h->dispatcher_id != id_) {
    return invalid_argument("cached_handle was not made by this Flex dispatcher");
  }
  const TokenRows& x = input.hidden;
  // The handle fixes the layout, not the payload (DeepEP's: fp8 rows forward, bf16
  // gradients back through the same handle); dtype and width are agreed across ranks in the
  // call. The tokens must be the handle's.
  if (x.x.rows != h->routing.num_tokens()) {
    return invalid_argument("cached mode: hidden has ", x.x.rows,
                            " rows but the handle's dispatch had ", h->routing.num_tokens(),
                            " tokens");
  }
  MOED_RETURN_IF_ERROR(moed::internal::check_token_rows("hidden", x));
  dispatch_.cached = std::move(h);
  return ok_status();
}

// Rows of the largest output among this node's ranks: every local segment has this many.
int64_t Dispatcher::node_cap_rows(const FlexHandle& h) const {
  int64_t cap = 0;
  for (int lr = 0; lr < topo_.ranks_per_node; ++lr) {
    const int r = topo_.node * topo_.ranks_per_node + lr;
    cap = std::max(cap, config_.num_worst_tokens > 0 ? config_.num_worst_tokens
                                                     : h.notified.rank_rows[size_t(r)]);
  }
  return cap;
}
size_t Dispatcher::pull_scalars_off(const FlexHandle& h, DType dt) const {
  return (size_t(node_cap_rows(h)) * dtype_row_bytes(dt, h.hidden) + 63) / 64 * 64;
}
size_t Dispatcher::pull_bytes(const FlexHandle& h, DType dt) const {
  return std::max<size_t>(64, pull_scalars_off(h, dt) + size_t(node_cap_rows(h)) * sizeof(float));
}

// Push: remote messages out first, local copies while they travel, forwarded rows last;
// then one signal per (writer, owner) pair.
Status Dispatcher::push_step(const DispatchContext& ctx, const PushSpec& spec, int tag) {
  RemoteOps remote;
  if (topo_.num_nodes > 1) {
    MOED_ASSIGN_OR_RETURN(remote, push_remote_start(ctx, spec, tag));
  }
  push_local(ctx, spec);
  zero_padding_rows(ctx, spec);
  if (topo_.num_nodes > 1) MOED_RETURN_IF_ERROR(push_remote_finish(ctx, spec, remote));
  signals_.signal_all(++epoch_);
  return signals_.wait_all(epoch_);
}

// FlexDispatcher::expert_output_buffer (moed/flex.h).
StatusOr<TensorView> Dispatcher::expert_output_buffer(const DispatchHandle& handle, DType dtype) {
  const auto* h = dynamic_cast<const FlexHandle*>(&handle);
  if (h == nullptr || h->dispatcher_id != id_) {
    return invalid_argument(
        "expert_output_buffer: the handle was not made by this dispatcher");
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return invalid_argument("expert_output_buffer: dtype ", dtype_name(dtype),
                            " is not f32 or bf16");
  }
  MOED_RETURN_IF_ERROR(pull_region_.ensure(*world_, pull_bytes(*h, dtype)));
  pull_region_.release_retired();  // this call ends the earlier buffer's validity (moed/flex.h)
  return TensorView(pull_region_.local(), dtype, h->num_rows, h->hidden);
}

}  // namespace flex

namespace {

// What Flex's wire format bounds (flex/message.h): ETP groups inside a node, the header's rank
// mask and chain links.
Status check_flex_world(const World& world, int etp_size) {
  const int G = world.ranks_per_node();
  if (world.num_nodes() > 1 && G % etp_size != 0) {
    return unimplemented("Flex across nodes needs each expert's ", etp_size,
                         " ETP ranks inside one node; ranks_per_node = ", G,
                         " is not a multiple of etp_size = ", etp_size);
  }
  if (world.num_nodes() > 1 && G > 64) {
    return unimplemented(
        "Flex across nodes supports up to 64 ranks per node (the header's rank mask); "
        "ranks_per_node = ",
        G);
  }
  if (world.num_nodes() > 32767) {
    return unimplemented(
        "Flex across nodes supports up to 32767 nodes (the header's chain links); num_nodes = ",
        world.num_nodes());
  }
  return ok_status();
}

}  // namespace

StatusOr<std::unique_ptr<FlexDispatcher>> make_flex(World& world, const DispatchConfig& config) {
  // As every dispatcher's factory: a bad config on any rank is an error on every rank.
  Status local = config.validate(world.size());
  if (local.ok()) local = check_flex_world(world, config.etp_size);
  MOED_RETURN_IF_ERROR(world.agree(local));
  auto d = std::make_unique<flex::Dispatcher>(world, config);
  MOED_RETURN_IF_ERROR(d->init());
  return std::unique_ptr<FlexDispatcher>(std::move(d));
}

StatusOr<std::unique_ptr<FlexDispatcher>> FlexDispatcher::make(World& world,
                                                               const DispatchConfig& config) {
  Status local;
  if (config.kind != DispatcherKind::kFlex) {
    local = invalid_argument("FlexDispatcher::make: config.kind = '",
                             dispatcher_kind_name(config.kind), "'; expected 'flex'");
  }
  MOED_RETURN_IF_ERROR(world.agree(local));
  return make_flex(world, config);
}

StatusOr<std::unique_ptr<TokenDispatcher>> make_flex_dispatcher(World& world,
                                                                const DispatchConfig& config) {
  MOED_ASSIGN_OR_RETURN(std::unique_ptr<FlexDispatcher> flex, make_flex(world, config));
  return std::unique_ptr<TokenDispatcher>(std::move(flex));
}

StatusOr<OrderedCombineOutput> flex_ordered_combine(FlexDispatcher& dispatcher,
                                                    std::shared_ptr<const DispatchHandle> handle,
                                                    const OrderedCombineInput& input) {
  // flex::Dispatcher is FlexDispatcher's one implementation (final).
  return static_cast<flex::Dispatcher&>(dispatcher).ordered_combine(std::move(handle), input);
}

}  // namespace moed
