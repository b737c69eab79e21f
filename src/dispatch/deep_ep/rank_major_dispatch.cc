// The rank-major dispatch (DeepEP's normal mode, moed/deep_ep.h). One all-gather of the
// layout counts (skipped in cached mode) gives every rank the rank prefix matrix, so each
// sender knows where its rows start on every receiver; each channel (a worker owning a token
// range) knows its offset inside that block from its own channel prefix matrix, so every row
// is written once, straight into its final place, with no sort. Tokens for another node go
// over the network once per node, to the rank with the sender's local index, which writes
// them into each receiving rank of its node (rows of one source arrive in token order through
// one forwarder, so a running count per receiver is the row). This file: the checks, the count
// exchange and the handle; the data movement is rank_major_push.cc.

#include "comm/agreement.h"
#include "core/row_checks.h"
#include "dispatch/deep_ep/rank_major.h"

namespace moed::deep_ep {

namespace {

Status check_uncached(const NormalBuffer::State& s, const NormalDispatchInput& in) {
  MOED_RETURN_IF_ERROR(moed::internal::check_token_rows("x", in.x));
  const int R = s.topo.num_ranks, E = s.num_experts;
  const int64_t T = in.x.x.rows;
  if (in.expert_alignment < 1)
    return invalid_argument("expert_alignment = ", in.expert_alignment, " must be >= 1");
  if (in.num_worst_tokens < 0)
    return invalid_argument("num_worst_tokens = ", in.num_worst_tokens, " must be >= 0");
  const LayoutView& l = in.layout;
  if (l.num_tokens_per_rank.size() != size_t(R))
    return invalid_argument("num_tokens_per_rank has ", l.num_tokens_per_rank.size(),
                            " entries; expected num_ranks = ", R);
  if (l.num_tokens_per_expert.size() != size_t(E))
    return invalid_argument("num_tokens_per_expert has ", l.num_tokens_per_expert.size(),
                            " entries; expected num_experts = ", E);
  if (l.is_token_in_rank.size() != size_t(T) * size_t(R))
    return invalid_argument("is_token_in_rank has ", l.is_token_in_rank.size(),
                            " entries; expected [", T, ", ", R, "]");
  std::vector<int64_t> per_rank(size_t(R), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int r = 0; r < R; ++r) per_rank[size_t(r)] += l.is_token_in_rank[size_t(t) * R + r] != 0;
  }
  for (int r = 0; r < R; ++r) {
    if (per_rank[size_t(r)] != l.num_tokens_per_rank[size_t(r)]) {
      return invalid_argument("num_tokens_per_rank[", r, "] = ", l.num_tokens_per_rank[size_t(r)],
                              " but is_token_in_rank has ", per_rank[size_t(r)],
                              " tokens for rank ", r);
    }
  }
  for (int e = 0; e < E; ++e) {
    if (l.num_tokens_per_expert[size_t(e)] < 0)
      return invalid_argument("num_tokens_per_expert[", e,
                              "] = ", l.num_tokens_per_expert[size_t(e)], " is negative");
  }
  const TopkView& k = in.topk;
  if (k.num_topk < 0) return invalid_argument("num_topk = ", k.num_topk, " is negative");
  if (k.num_topk == 0) return ok_status();
  if (k.num_tokens != T)
    return invalid_argument("topk_idx has ", k.num_tokens, " rows but x has ", T);
  // The weights travel as they are, as in DeepEP (its tests send randn weights): only the
  // indices are checked.
  MOED_RETURN_IF_ERROR(
      check_topk_in_layout(k, l.is_token_in_rank, E, R, false, "topk_idx", "is_token_in_rank"));
  std::vector<int64_t> per_expert(size_t(E), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int j = 0; j < k.num_topk; ++j) {
      if (const int64_t e = k.at(t, j); e >= 0) ++per_expert[size_t(e)];
    }
  }
  for (int e = 0; e < E; ++e) {
    if (per_expert[size_t(e)] != l.num_tokens_per_expert[size_t(e)]) {
      return invalid_argument("num_tokens_per_expert[", e,
                              "] = ", l.num_tokens_per_expert[size_t(e)], " but topk_idx routes ",
                              per_expert[size_t(e)], " tokens to it");
    }
  }
  return ok_status();
}

Status check_cached(const NormalBuffer::State& s, const NormalDispatchInput& in) {
  MOED_RETURN_IF_ERROR(s.check_handle(in.handle.get()));
  MOED_RETURN_IF_ERROR(moed::internal::check_token_rows("x", in.x));
  const NormalHandle& h = *in.handle;
  // The handle is the layout only (as DeepEP's): x's dtype and hidden may differ from the
  // dispatch that made it (they are agreed across ranks in the call), its tokens may not.
  if (in.x.x.rows != h.num_tokens) {
    return invalid_argument("cached dispatch: x has ", in.x.x.rows,
                            " rows but the handle's dispatch had ", h.num_tokens, " tokens");
  }
  const TopkView& k = in.topk;
  if (k.num_topk > 0 && k.num_tokens != h.num_tokens)
    return invalid_argument("topk_idx has ", k.num_tokens, " rows but x has ", h.num_tokens);
  if (k.num_topk == 0) return ok_status();
  return check_topk_in_layout(k, h.is_token_in_rank, h.num_experts, h.num_ranks, false,
                              "cached dispatch: topk_idx", "the handle's is_token_in_rank");
}

// Builds the handle from the gathered counts (the same tables on every rank).
StatusOr<std::shared_ptr<NormalHandle>> make_handle(NormalBuffer::State& s,
                                                    const NormalDispatchInput& in,
                                                    const std::vector<int64_t>& all, size_t width,
                                                    std::vector<int32_t>* expert_list) {
  const flex::Topology& topo = s.topo;
  const int R = topo.num_ranks, E = s.num_experts, L = E / R, N = topo.num_nodes;
  const int C = s.num_channels, me = topo.rank;
  auto h = std::make_shared<NormalHandle>();
  h->world = s.world;
  h->num_ranks = R;
  h->num_channels = C;
  h->num_experts = E;
  h->num_tokens = in.x.x.rows;
  h->hidden = int(in.x.x.cols);
  h->dtype = in.x.x.dtype;
  h->rank_prefix_matrix.resize(size_t(R) * R);
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < R; ++j) {
      h->rank_prefix_matrix[size_t(i) * R + j] =
          int32_t((i > 0 ? h->rank_prefix_matrix[size_t(i - 1) * R + j] : 0) +
                  all[size_t(i) * width + size_t(j)]);
    }
  }
  const int64_t worst = in.num_worst_tokens;
  if (worst > 0) {
    for (int r = 0; r < R; ++r) {
      const int64_t got = h->rank_prefix_matrix[size_t(R - 1) * R + r];
      if (got > worst) {
        return invalid_argument("num_worst_tokens = ", worst, " is smaller than the ", got,
                                " tokens rank ", r, " receives");
      }
    }
  }
  h->num_recv_tokens = h->rank_prefix_matrix[size_t(R - 1) * R + me];
  h->num_rows = worst > 0 ? worst : h->num_recv_tokens;
  h->num_worst_tokens = worst;
  if (worst == 0) {
    const int64_t a = in.expert_alignment;
    expert_list->assign(size_t(L), 0);
    for (int j = 0; j < L; ++j) {
      int64_t n = 0;
      for (int src = 0; src < R; ++src) n += all[size_t(src) * width + R + size_t(me) * L + j];
      (*expert_list)[size_t(j)] = int32_t((n + a - 1) / a * a);
    }
  }
  const int64_t T = h->num_tokens;
  h->is_token_in_rank.assign(in.layout.is_token_in_rank.begin(), in.layout.is_token_in_rank.end());
  for (uint8_t& b : h->is_token_in_rank) b = b != 0;
  h->send_head.assign(size_t(T) * R, -1);
  std::vector<int32_t> per_channel(size_t(R) * C, 0);
  s.world->pool().parallel_for(C, [&](int64_t cb, int64_t ce, int) {
    for (int64_t c = cb; c < ce; ++c) {
      int64_t b, e;
      ThreadPool::split(T, C, int(c), &b, &e);
      std::vector<int32_t> n(size_t(R), 0);
      for (int64_t t = b; t < e; ++t) {
        for (int r = 0; r < R; ++r) {
          if (h->is_token_in_rank[size_t(t) * R + r])
            h->send_head[size_t(t) * R + r] = n[size_t(r)]++;
        }
      }
      for (int r = 0; r < R; ++r) per_channel[size_t(r) * C + size_t(c)] = n[size_t(r)];
    }
  });
  h->channel_prefix_matrix.resize(size_t(R) * C);
  for (int r = 0; r < R; ++r) {
    int32_t acc = 0;
    for (int c = 0; c < C; ++c) {
      acc += per_channel[size_t(r) * C + c];
      h->channel_prefix_matrix[size_t(r) * C + c] = acc;
    }
  }
  h->forward_tokens.assign(size_t(N), 0);
  for (int m = 0; m < N; ++m) {
    if (m == topo.node) continue;
    const int src = topo.forwarder_on(m);
    h->forward_tokens[size_t(m)] = all[size_t(src) * width + R + E + size_t(topo.node)];
  }
  h->forward_src_token.resize(size_t(N));
  h->forward_mask.resize(size_t(N));
  return h;
}

// NormalDispatchInput::out: the rows must be known before the count exchange.
Status check_out_rows(const NormalDispatchInput& in) {
  const int64_t rows = in.handle ? in.handle->num_rows : in.num_worst_tokens;
  if (rows <= 0 && !in.handle) {
    return invalid_argument(
        "out needs num_worst_tokens > 0 or a cached handle (num_worst_tokens = ",
        in.num_worst_tokens,
        "): without them recv_x's rows are known only after the count exchange");
  }
  return moed::internal::check_out_buffer("out", *in.out, rows, in.x.x.cols, in.x.x.dtype, "x");
}

}  // namespace

StatusOr<NormalDispatchOutput> rm_dispatch(NormalBuffer::State& s, const NormalDispatchInput& in,
                                           const Status& caller_error) {
  World& w = *s.world;
  const int R = s.topo.num_ranks, N = s.topo.num_nodes;
  const bool cached = in.handle != nullptr;
  // E of this call: the layout's (or the handle's); checked against the other ranks below.
  s.num_experts = cached ? (in.handle ? in.handle->num_experts : 0)
                         : int(in.layout.num_tokens_per_expert.size());
  const int E = s.num_experts;
  // First exchange, the agreement (fixed size, so it works whatever a bad input looks like);
  // cached mode stops there (no count exchange).
  Status local = caller_error;
  if (local.ok() && !cached && (E <= 0 || E % R != 0))
    local =
        invalid_argument("num_tokens_per_expert has ", E,
                         " entries; num_experts must be a positive multiple of the ", R, " ranks");
  if (local.ok()) local = cached ? check_cached(s, in) : check_uncached(s, in);
  if (local.ok() && in.out) local = check_out_rows(in);
  const bool ok = local.ok(), fresh = ok && !cached;
  using F = AgreedField;
  // Cached mode agrees on the first four only (the others are 0 on every rank then).
  const AgreedField fields[] = {{"cached mode (handle given)", cached, F::kAgree},
                                {"hidden", ok ? in.x.x.cols : 0, F::kAgree},
                                {"x dtype", ok ? int64_t(in.x.x.dtype) : 0, F::kAgreeDType},
                                {"num_topk", ok ? in.topk.num_topk : 0, F::kAgree},
                                {"expert_alignment", fresh ? in.expert_alignment : 0, F::kAgree},
                                {"num_worst_tokens", fresh ? in.num_worst_tokens : 0, F::kAgree},
                                {"num_experts", fresh ? E : 0, F::kAgree},
                                {"held receive slots", int64_t(s.recv_ring.held_mask()), F::kFree}};
  MOED_ASSIGN_OR_RETURN(AgreedTable head, agree_in_one(w, local, fields));
  const auto held_of = [&](int r) { return uint64_t(head.field(r, std::size(fields) - 1)); };
  s.recv_slot = s.recv_ring.pick(s.topo, held_of);
  if (cached) {
    // NOTE: the handle is shared with earlier outputs; the cached push writes no plan into
    // it (plan = false), it only reads it.
    auto& h = const_cast<NormalHandle&>(*in.handle);
    return rm_push(s, h, in.x, in.topk, /*plan=*/false, in.out);
  }
  // Second exchange, the counts: [per rank, per expert, per node] (DeepEP's notify).
  const size_t width = size_t(R) + size_t(E) + size_t(N);
  std::vector<int64_t> counts(width, 0);
  for (int r = 0; r < R; ++r) counts[size_t(r)] = in.layout.num_tokens_per_rank[size_t(r)];
  for (int e = 0; e < E; ++e) counts[R + size_t(e)] = in.layout.num_tokens_per_expert[size_t(e)];
  const int G = s.topo.ranks_per_node;
  for (int64_t t = 0; t < in.x.x.rows; ++t) {
    for (int m = 0; m < N; ++m) {
      bool any = false;
      for (int lr = 0; lr < G; ++lr)
        any |= in.layout.is_token_in_rank[size_t(t) * R + m * G + lr] != 0;
      counts[R + E + size_t(m)] += any;
    }
  }
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> all,
                        all_gather<int64_t>(w, std::span<const int64_t>(counts)));
  std::vector<int32_t> expert_list;
  MOED_ASSIGN_OR_RETURN(std::shared_ptr<NormalHandle> h,
                        make_handle(s, in, all, width, &expert_list));
  MOED_ASSIGN_OR_RETURN(NormalDispatchOutput out,
                        rm_push(s, *h, in.x, in.topk, /*plan=*/true, in.out));
  out.num_recv_tokens_per_expert = std::move(expert_list);
  out.handle = std::move(h);
  return out;
}

}  // namespace moed::deep_ep
