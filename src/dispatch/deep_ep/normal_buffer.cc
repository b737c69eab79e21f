// NormalBuffer (moed/deep_ep.h): creation, DeepEP's layout from a top-k view, the receive
// block and message layouts, and the home side's channel plan of the rank-major receive.
#include <algorithm>

#include "comm/agreement.h"
#include "dispatch/deep_ep/rank_major.h"
#include "dispatch/sections.h"

namespace moed::deep_ep {

LayoutView LayoutView::of(const DispatchLayout& l) {
  LayoutView v;
  v.owned_rank.assign(l.num_tokens_per_rank.begin(), l.num_tokens_per_rank.end());
  v.owned_expert.assign(l.num_tokens_per_expert.begin(), l.num_tokens_per_expert.end());
  v.num_tokens_per_rank = v.owned_rank;
  v.num_tokens_per_expert = v.owned_expert;
  v.is_token_in_rank = l.is_token_in_rank;
  return v;
}

RecvLayout RecvLayout::of(int64_t cap_rows, size_t row_bytes, size_t scale_bytes, int num_topk,
                          int num_ranks, int num_channels) {
  RecvLayout l{.cap_rows = cap_rows,
               .row_bytes = row_bytes,
               .scale_bytes = scale_bytes,
               .num_topk = num_topk,
               .num_ranks = num_ranks,
               .num_channels = num_channels};
  const size_t rows = size_t(cap_rows);
  Sections s(64);
  s.add(rows * row_bytes);
  l.scales_off = s.add(rows * scale_bytes);
  l.src_idx_off = s.add(rows * 4);
  l.topk_idx_off = s.add(rows * size_t(num_topk) * 8);
  l.weights_off = s.add(rows * size_t(num_topk) * 4);
  l.rcpm_off = s.add(size_t(num_ranks) * size_t(num_channels) * 4);
  l.bytes = s.aligned_end();
  return l;
}

flex::MessageLayout rm_message(int64_t n, size_t row_bytes, size_t scale_bytes, int num_topk,
                               int ranks_per_node, int num_channels) {
  return flex::MessageLayout::of(n, n * num_topk, row_bytes, scale_bytes,
                                 size_t(ranks_per_node) * size_t(num_channels) * sizeof(int32_t));
}

Status check_topk_in_layout(const TopkView& topk, std::span<const uint8_t> is_token_in_rank,
                            int num_experts, int num_ranks, bool exact, const char* what,
                            const char* layout) {
  MOED_RETURN_IF_ERROR(validate(topk.indices(), num_experts));
  const int L = num_experts / num_ranks;
  std::vector<uint8_t> hit(static_cast<size_t>(num_ranks));
  for (int64_t t = 0; t < topk.num_tokens; ++t) {
    const uint8_t* in = &is_token_in_rank[size_t(t) * num_ranks];
    std::fill(hit.begin(), hit.end(), 0);
    for (int k = 0; k < topk.num_topk; ++k) {
      const int64_t e = topk.at(t, k);
      if (e < 0) continue;
      hit[size_t(e / L)] = 1;
      if (!in[e / L])
        return invalid_argument(what, "[", t, "][", k, "] = ", e, " lives on rank ", e / L, " but ",
                                layout, "[", t, "][", e / L, "] is false");
    }
    for (int r = 0; exact && r < num_ranks; ++r) {
      if (in[r] && !hit[size_t(r)])
        return invalid_argument(layout, "[", t, "][", r, "] is true but no expert of ", what, "[",
                                t, "] lives on rank ", r);
    }
  }
  return ok_status();
}

RmSendPlan make_rm_send_plan(const flex::Topology& topo, const NormalHandle& h, ThreadPool& pool) {
  const int C = h.num_channels, N = topo.num_nodes, G = topo.ranks_per_node, R = topo.num_ranks;
  const int64_t T = h.num_tokens;
  RmSendPlan p;
  p.num_channels = C;
  p.channel_begin = flex::channel_bounds(T, C);
  std::vector<int64_t> tok(size_t(C) * N, 0), pairs(size_t(C) * N, 0);
  pool.parallel_for(C, [&](int64_t cb, int64_t ce, int) {
    for (int64_t c = cb; c < ce; ++c) {
      for (int64_t t = p.channel_begin[size_t(c)]; t < p.channel_begin[size_t(c) + 1]; ++t) {
        const uint8_t* in = &h.is_token_in_rank[size_t(t) * R];
        for (int m = 0; m < N; ++m) {
          int q = 0;
          for (int lr = 0; lr < G; ++lr) q += in[m * G + lr] != 0;
          tok[size_t(c) * N + m] += q > 0;
          pairs[size_t(c) * N + m] += q;
        }
      }
    }
  });
  p.node_tokens = flex::channel_prefix(tok, C, N);
  p.node_pairs = flex::channel_prefix(pairs, C, N);
  return p;
}

int64_t NormalBuffer::State::node_cap_rows(const NormalHandle& h, int64_t worst) const {
  if (worst > 0) return worst;
  int64_t cap = 0;
  const int R = topo.num_ranks;
  for (int lr = 0; lr < topo.ranks_per_node; ++lr) {
    const int r = topo.node * topo.ranks_per_node + lr;
    cap = std::max<int64_t>(cap, h.rank_prefix_matrix[size_t(R - 1) * R + r]);
  }
  return cap;
}

Status NormalBuffer::State::check_handle(const NormalHandle* h) const {
  if (h == nullptr) return invalid_argument("handle is null");
  if (h->world != world)
    return invalid_argument("handle was made by a dispatch over another group than this buffer's");
  if (h->num_channels != num_channels || h->num_ranks != topo.num_ranks)
    return invalid_argument("handle was made with ", h->num_channels,
                            " channels; this buffer uses ", num_channels);
  return ok_status();
}

StatusOr<std::unique_ptr<NormalBuffer>> NormalBuffer::create(World& world, int num_channels) {
  // The world's shape: the same verdict on every rank, with no collective.
  if (world.num_nodes() > 1 && world.ranks_per_node() > 64) {
    return unimplemented(
        "the rank-major receive across nodes supports up to 64 ranks per node; "
        "ranks_per_node = ",
        world.ranks_per_node());
  }
  // Rank 0's channel count is everyone's (a rank's default follows its own thread pool).
  const AgreedField channels{
      "num_channels", num_channels > 0 ? num_channels : world.pool().num_threads(),
      AgreedField::kFree};
  MOED_ASSIGN_OR_RETURN(AgreedTable all, agree_in_one(world, Status(), {&channels, 1}));
  auto s = std::make_unique<State>();
  s->world = &world;
  s->num_channels = int(std::max<int64_t>(1, all.field(0, 0)));
  DispatchConfig cfg;
  cfg.kind = DispatcherKind::kFlex;
  cfg.num_experts = world.size();  // the rank arithmetic used here does not depend on E
  s->topo = flex::Topology::of(world, cfg);
  s->in_place = world.shares_address_space();
  MOED_RETURN_IF_ERROR(s->signals.init(world));
  return std::unique_ptr<NormalBuffer>(new NormalBuffer(std::move(s)));
}

NormalBuffer::NormalBuffer(std::unique_ptr<State> state) : state_(std::move(state)) {}
NormalBuffer::~NormalBuffer() = default;
World& NormalBuffer::world() const { return *state_->world; }

StatusOr<DispatchLayout> NormalBuffer::get_dispatch_layout(const TopkView& topk,
                                                           int num_experts) const {
  TopkView idx_only = topk;  // the layout reads indices only; weights are not checked here
  idx_only.weights = nullptr;
  return moed::get_dispatch_layout(idx_only, num_experts, state_->world->size(),
                                   state_->world->ranks_per_node());
}

Status pack_ue8m0(const TensorView& scales, std::span<int32_t> out) {
  if (scales.dtype != DType::kF32 || scales.cols % 4 != 0)
    return invalid_argument("use_ue8m0: scales are ", dtype_name(scales.dtype), " [", scales.rows,
                            ", ", scales.cols,
                            "]; they must be f32 with hidden / 128 a multiple of 4");
  if (out.size() != size_t(scales.rows) * size_t(scales.cols / 4))
    return invalid_argument("use_ue8m0: output has ", out.size(), " entries; expected ",
                            scales.rows * (scales.cols / 4));
  for (int64_t i = 0; i < scales.rows; ++i) {
    const float* row = scales.row<float>(i);
    for (int64_t b = 0; b < scales.cols; b += 4) {
      uint32_t packed = 0;
      for (int q = 0; q < 4; ++q) {
        const uint32_t bits = float_to_bits(row[b + q]);
        if ((bits & 0x807fffffu) != 0 || (bits >> 23) == 0xff)
          return invalid_argument("use_ue8m0: scale [", i, "][", b + q, "] = ", row[b + q],
                                  " is not a power of two (use_ue8m0 needs round_scale = True)");
        packed |= (bits >> 23) << (8 * q);
      }
      out[size_t(i) * size_t(scales.cols / 4) + size_t(b / 4)] = int32_t(packed);
    }
  }
  return ok_status();
}

StatusOr<NormalDispatchOutput> NormalBuffer::dispatch(const NormalDispatchInput& input,
                                                      const Status& caller_error) {
  return rm_dispatch(*state_, input, caller_error);
}

StatusOr<NormalCombineOutput> NormalBuffer::combine(const NormalCombineInput& input,
                                                    const Status& caller_error) {
  return rm_combine(*state_, input, caller_error);
}

}  // namespace moed::deep_ep
