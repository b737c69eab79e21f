// ElasticBuffer (moed/elastic_buffer.h): DeepEP V2's dispatch and combine as calls of the two
// engines. Each call first agrees, in one small all-gather, on what it is (cached or not,
// which layout, the sizes), so a rank whose call differs is every rank's error before an
// engine starts; the engine then checks the rows and routing as it always does.
#include <algorithm>

#include "comm/agreement.h"
#include "dispatch/deep_ep/elastic.h"

namespace moed::deep_ep {

namespace {

Status check_call(const ElasticBuffer::State& s, const ElasticDispatchInput& in, ElasticCall* c) {
  const int R = s.world->size();
  const ElasticHandle* h = in.handle.get();
  c->cached = h != nullptr;
  c->weights = c->cached ? !in.cached_weights.empty() : in.topk.weights != nullptr;
  if (c->cached) {
    if (h->world != s.world)
      return invalid_argument("handle was made by a dispatch over another group than this buffer's");
    if (in.topk.num_topk != 0)
      return invalid_argument("a cached dispatch (handle given) takes no topk_idx: the handle's");
    if (in.do_cpu_sync.value_or(false))
      return invalid_argument("do_cpu_sync = True with a cached handle (its sizes are fixed)");
    auto same = [](const char* name, int64_t given, int64_t had) {
      return given == 0 || given == had
                 ? ok_status()
                 : invalid_argument(name, " = ", given, " but the handle's dispatch had ", had);
    };
    MOED_RETURN_IF_ERROR(same("num_experts", in.num_experts, h->num_experts));
    MOED_RETURN_IF_ERROR(
        same("num_max_tokens_per_rank", in.num_max_tokens_per_rank, h->num_max_tokens_per_rank));
    MOED_RETURN_IF_ERROR(same("expert_alignment", in.expert_alignment, h->expert_alignment));
    if (in.x.x.rows != h->num_tokens)
      return invalid_argument("x has ", in.x.x.rows, " rows but the handle's dispatch had ",
                              h->num_tokens, " tokens");
    c->expand = h->do_expand;
    c->num_experts = h->num_experts;
    c->max_tokens = h->num_max_tokens_per_rank;
    c->alignment = h->expert_alignment;
    c->num_topk = h->num_topk;
    c->cpu_sync = false;  // the handle's sizes (DeepEP's cached mode never syncs)
    if (c->weights && in.cached_weights.size() != size_t(h->num_tokens) * size_t(h->num_topk))
      return invalid_argument("topk_weights has ", in.cached_weights.size(), " values; expected [",
                              h->num_tokens, ", ", h->num_topk, "]");
    return ok_status();
  }
  if (in.topk.num_topk == 0) return invalid_argument("topk_idx is required without a handle");
  c->expand = in.do_expand;
  c->cpu_sync = in.do_cpu_sync.value_or(true);
  c->num_experts = in.num_experts;
  c->max_tokens =
      in.num_max_tokens_per_rank > 0 ? in.num_max_tokens_per_rank : s.config.num_max_tokens_per_rank;
  c->alignment = in.expert_alignment > 0 ? in.expert_alignment : 1;
  c->num_topk = in.topk.num_topk;
  if (c->num_experts <= 0 || c->num_experts % R != 0)
    return invalid_argument("num_experts = ", c->num_experts, " must be a positive multiple of the ",
                            R, " ranks");
  if (c->max_tokens <= 0)
    return invalid_argument("num_max_tokens_per_rank = ", c->max_tokens,
                            " (give it to the buffer or to dispatch)");
  if (in.x.x.rows > c->max_tokens)
    return invalid_argument("x has ", in.x.x.rows, " tokens, more than num_max_tokens_per_rank = ",
                            c->max_tokens);
  if (in.topk.num_tokens != in.x.x.rows)
    return invalid_argument("topk_idx has ", in.topk.num_tokens, " rows but x has ", in.x.x.rows);
  if (c->num_topk <= 0) return invalid_argument("num_topk = ", c->num_topk, " must be positive");
  if (in.expert_alignment < 0)
    return invalid_argument("expert_alignment = ", in.expert_alignment, " must be >= 1");
  return ok_status();
}

int64_t worst_expanded_rows(const ElasticCall& c, int R) {
  // DeepEP's worst case: every rank's tokens to min(K, L) of this rank's experts, each
  // segment padded.
  const int L = c.num_experts / R, A = c.alignment;
  const int64_t rows = int64_t(R) * c.max_tokens * std::min(c.num_topk, L) + int64_t(A - 1) * L;
  return (rows + A - 1) / A * A;
}

// A fresh dispatch's handle, holding its routing as int64 (topk then reads it there).
std::shared_ptr<ElasticHandle> new_handle(const ElasticBuffer::State& s, const ElasticCall& call,
                                          TopkView& topk) {
  auto h = std::make_shared<ElasticHandle>();
  h->world = s.world;
  h->do_expand = call.expand;
  h->num_experts = call.num_experts;
  h->expert_alignment = call.alignment;
  h->num_max_tokens_per_rank = call.max_tokens;
  h->num_topk = call.num_topk;
  h->num_tokens = topk.num_tokens;
  h->topk_idx.resize(size_t(topk.num_tokens) * size_t(topk.num_topk));
  for (int64_t t = 0; t < topk.num_tokens; ++t) {
    for (int k = 0; k < topk.num_topk; ++k) {
      h->topk_idx[size_t(t) * topk.num_topk + k] = topk.at(t, k);
    }
  }
  topk.idx = h->topk_idx.data();
  topk.idx_int64 = true;
  return h;
}

// do_expand = False: the rank-major receive (NormalBuffer). `fresh`: the handle a fresh
// dispatch fills (null in cached mode).
StatusOr<ElasticDispatchOutput> dispatch_rank_major(ElasticBuffer::State& s,
                                                    const ElasticDispatchInput& in,
                                                    const ElasticCall& call,
                                                    const DispatchLayout& layout,
                                                    const TopkView& topk, ElasticHandle* fresh) {
  NormalDispatchInput nin;
  nin.x = in.x;
  nin.topk = topk;
  nin.expert_alignment = call.alignment;
  if (!fresh) {
    nin.handle = in.handle->normal;
  } else {
    nin.layout = LayoutView::of(layout);
    nin.num_worst_tokens = call.cpu_sync ? 0 : int64_t(s.world->size()) * call.max_tokens;
  }
  MOED_ASSIGN_OR_RETURN(NormalDispatchOutput d, s.normal->dispatch(nin));
  if (fresh) {
    fresh->normal = d.handle;
    fill_rank_major_metadata(call, s.scaleup, *d.handle, d.recv_topk_idx, topk, *fresh);
  }
  ElasticDispatchOutput out;
  out.recv_x = d.recv_x;
  out.recv_topk_idx = d.recv_topk_idx;
  if (call.weights) out.recv_topk_weights = d.recv_topk_weights;
  out.storage = d.storage;
  return out;
}

// do_expand = True: Flex's expert-major layout, each expert padded to expert_alignment.
StatusOr<ElasticDispatchOutput> dispatch_expanded(ElasticBuffer::State& s,
                                                  const ElasticDispatchInput& in,
                                                  const ElasticCall& call, const TopkView& topk,
                                                  ElasticHandle* fresh) {
  const ElasticHandle* cached = fresh ? nullptr : in.handle.get();
  const int64_t worst = call.cpu_sync ? 0 : worst_expanded_rows(call, s.world->size());
  MOED_ASSIGN_OR_RETURN(FlexDispatcher * flex,
                        s.flex_for({call.num_experts, call.alignment,
                                    cached ? cached->expand_worst_rows : worst}));
  DispatchInput din;
  din.hidden = in.x;
  if (cached) {
    din.cached_handle = cached->expand;
  } else {
    din.topk = topk;
  }
  MOED_ASSIGN_OR_RETURN(DispatchOutput d, flex->dispatch(din));
  if (fresh) {
    fresh->expand = d.handle;
    fresh->expand_worst_rows = worst;
    fill_expanded_metadata(call, s.scaleup, static_cast<const flex::FlexHandle&>(*d.handle),
                           *fresh);
  }
  ElasticDispatchOutput out;
  out.recv_x = d.expert_input;
  // The storage holds the rows and what the weights live in: the Flex handle's probs, or
  // (cached mode, whose handle keeps the weights of the dispatch that made it) the given
  // weights, moved as [T, K] rows of their own through the same layout, each row then taking
  // its slot's.
  struct Held {
    std::shared_ptr<void> rows;
    std::shared_ptr<const DispatchHandle> handle;
    std::vector<float> weights;
  };
  auto held = std::make_shared<Held>(Held{d.storage, d.handle, {}});
  if (call.weights && !cached) out.recv_topk_weights = d.permuted_probs;
  if (call.weights && cached) {
    const std::span<const float> w = in.cached_weights;
    std::vector<float> zeros;
    if (w.empty()) zeros.assign(size_t(cached->num_tokens) * size_t(call.num_topk), 0.0f);
    TensorView wrows(const_cast<float*>(w.empty() ? zeros.data() : w.data()), DType::kF32,
                     cached->num_tokens, call.num_topk);
    MOED_ASSIGN_OR_RETURN(DispatchOutput dw, flex->dispatch({.hidden = TokenRows{wrows, {}},
                                                             .cached_handle = cached->expand}));
    const DispatchHandle& fh = *cached->expand;
    held->weights.assign(size_t(fh.num_rows), 0.0f);
    for (int64_t r = 0; r < fh.num_rows; ++r) {
      const int32_t slot = fh.row_src_slot[size_t(r)];
      if (slot >= 0) held->weights[size_t(r)] = dw.expert_input.x.row<float>(r)[slot];
    }
    out.recv_topk_weights = held->weights;
  }
  out.storage = held;
  return out;
}

}  // namespace

StatusOr<FlexDispatcher*> ElasticBuffer::State::flex_for(const FlexKey& key) {
  auto it = flex.find(key);
  if (it != flex.end()) return it->second.get();
  DispatchConfig cfg;
  cfg.kind = DispatcherKind::kFlex;
  cfg.num_experts = std::get<0>(key);
  cfg.layout.expert_alignment = std::get<1>(key);
  cfg.num_worst_tokens = std::get<2>(key);
  MOED_ASSIGN_OR_RETURN(std::unique_ptr<FlexDispatcher> d, make_flex(*world, cfg));
  return (flex[key] = std::move(d)).get();
}

StatusOr<std::unique_ptr<ElasticBuffer>> ElasticBuffer::create(World& world,
                                                               const ElasticConfig& config) {
  auto s = std::make_unique<State>();
  s->world = &world;
  s->config = config;
  MOED_ASSIGN_OR_RETURN(s->normal, NormalBuffer::create(world));
  const bool hybrid = config.allow_hybrid_mode && world.num_nodes() > 1;
  s->scaleout = hybrid ? world.num_nodes() : 1;
  s->scaleup = hybrid ? world.ranks_per_node() : world.size();
  return std::unique_ptr<ElasticBuffer>(new ElasticBuffer(std::move(s)));
}

ElasticBuffer::ElasticBuffer(std::unique_ptr<State> state) : state_(std::move(state)) {}
ElasticBuffer::~ElasticBuffer() = default;
const ElasticConfig& ElasticBuffer::config() const { return state_->config; }
World& ElasticBuffer::world() const { return *state_->world; }

std::pair<int, int> ElasticBuffer::logical_domain() const {
  return {state_->scaleout, state_->scaleup};
}
std::pair<int, int> ElasticBuffer::physical_domain() const {
  return {state_->world->num_nodes(), state_->world->ranks_per_node()};
}

CombineRecipe ElasticBuffer::recipe(bool do_expand) const {
  // DeepEP's kernels: with multiple reductions each rank's terms (and with hybrid mode each
  // node's) are reduced first; without, the expanded layout adds every term at home, and the
  // rank-major rows are each one rank's sum already.
  const bool hybrid = state_->scaleout > 1;
  if (state_->config.allow_multiple_reduction) return {true, hybrid};
  return {!do_expand, false};
}

StatusOr<ElasticDispatchOutput> ElasticBuffer::dispatch(const ElasticDispatchInput& in,
                                                       const Status& caller_error) {
  State& s = *state_;
  World& w = *s.world;
  ElasticCall call;
  Status local = caller_error;
  if (local.ok()) local = check_call(s, in, &call);
  // The non-expanded layout is this rank's part of the count exchange: computed (and the
  // routing checked) before the agreement, so a bad index is every rank's error.
  DispatchLayout layout;
  if (local.ok() && !call.cached && !call.expand) {
    StatusOr<DispatchLayout> l = s.normal->get_dispatch_layout(in.topk, call.num_experts);
    if (l.ok()) {
      layout = std::move(*l);
    } else {
      local = l.status();
    }
  }
  if (local.ok() && !in.cumulative_local_expert_recv_stats.empty() &&
      int64_t(in.cumulative_local_expert_recv_stats.size()) != call.num_experts / w.size()) {
    local = invalid_argument("cumulative_local_expert_recv_stats has ",
                             in.cumulative_local_expert_recv_stats.size(),
                             " entries; expected num_local_experts = ", call.num_experts / w.size());
  }
  using F = AgreedField;
  // Whether this rank has weights is free: a rank with no tokens may have none, and all send
  // them when any has.
  const AgreedField fields[] = {{"cached mode (handle given)", call.cached, F::kAgree},
                                {"do_expand", call.expand, F::kAgree},
                                {"num_experts", call.num_experts, F::kAgree},
                                {"num_max_tokens_per_rank", call.max_tokens, F::kAgree},
                                {"expert_alignment", call.alignment, F::kAgree},
                                {"num_topk", call.num_topk, F::kAgree},
                                {"do_cpu_sync", call.cpu_sync, F::kAgree},
                                {"weights", call.weights, F::kFree}};
  MOED_ASSIGN_OR_RETURN(AgreedTable t, agree_in_one(w, local, fields));
  for (int r = 0; r < w.size(); ++r) {
    call.weights = call.weights || t.field(r, std::size(fields) - 1) != 0;
  }

  const ElasticHandle* cached = in.handle.get();
  // The routing: the caller's, or the handle's in cached mode (with the caller's weights).
  TopkView topk = in.topk;
  std::shared_ptr<ElasticHandle> fresh;
  if (cached) {
    topk = TopkView{cached->topk_idx.data(), true,
                    in.cached_weights.empty() ? nullptr : in.cached_weights.data(),
                    cached->num_tokens, cached->num_topk};
  } else {
    fresh = new_handle(s, call, topk);
  }
  ElasticDispatchOutput out;
  if (!call.expand) {
    MOED_ASSIGN_OR_RETURN(out, dispatch_rank_major(s, in, call, layout, topk, fresh.get()));
  } else {
    MOED_ASSIGN_OR_RETURN(out, dispatch_expanded(s, in, call, topk, fresh.get()));
  }
  const ElasticHandle& h = cached ? *cached : *fresh;
  const std::span<int32_t> stats = in.cumulative_local_expert_recv_stats;
  for (size_t j = 0; j < stats.size(); ++j)
    stats[j] += h.num_unaligned_recv_tokens_per_expert[j];
  out.handle = cached ? in.handle : fresh;
  return out;
}

StatusOr<ElasticCombineOutput> ElasticBuffer::combine(const ElasticCombineInput& in,
                                                     const Status& caller_error) {
  State& s = *state_;
  const ElasticHandle* h = in.handle.get();
  Status local = caller_error;
  if (local.ok() && (h == nullptr || h->world != s.world))
    local = invalid_argument("handle was not made by a dispatch over this buffer's group");
  // The layout is agreed on first, so every rank goes into the same engine.
  const AgreedField layout{"the handle's do_expand", local.ok() && h->do_expand,
                           AgreedField::kAgree};
  MOED_RETURN_IF_ERROR(agree_in_one(*s.world, local, {&layout, 1}).status());
  ElasticCombineOutput out;
  if (!h->do_expand) {
    const TopkView order{h->topk_idx.data(), true, nullptr, h->num_tokens, h->num_topk};
    NormalCombineInput nin;
    nin.x = in.x;
    nin.topk_weights = in.topk_weights;
    nin.num_topk = in.topk_weights ? h->num_topk : 0;
    nin.bias_0 = in.bias_0;
    nin.bias_1 = in.bias_1;
    nin.handle = h->normal;
    nin.order_topk = &order;
    nin.recipe = recipe(false);
    nin.out = in.out;
    MOED_ASSIGN_OR_RETURN(NormalCombineOutput c, s.normal->combine(nin));
    out.combined_x = std::move(c.combined_x);
    out.combined_topk_weights = std::move(c.combined_topk_weights);
    out.out = c.out;
    return out;
  }
  MOED_ASSIGN_OR_RETURN(FlexDispatcher * flex,
                        s.flex_for({h->num_experts, h->expert_alignment, h->expand_worst_rows}));
  OrderedCombineInput fin;
  fin.rows = in.x;
  if (in.topk_weights) fin.row_weights = {in.topk_weights, size_t(in.x.rows)};
  fin.bias_0 = in.bias_0;
  fin.bias_1 = in.bias_1;
  fin.recipe = recipe(true);
  fin.num_topk = h->num_topk;
  fin.out = in.out;
  MOED_ASSIGN_OR_RETURN(OrderedCombineOutput c,
                        flex_ordered_combine(*flex, h->expand, fin));
  out.combined_x = std::move(c.combined);
  out.combined_topk_weights = std::move(c.slot_weights);
  out.out = in.out;
  return out;
}

}  // namespace moed::deep_ep
