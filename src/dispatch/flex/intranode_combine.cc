// Flex combine (design.md §5.4) and the backward of dispatch: each home rank reads its tokens'
// contributions from the expert ranks' rows (node-shared memory inside the node, the
// forwarders' per-expert terms from other nodes) and folds them in the fixed order of
// design.md §4.1: one read per contribution, one write per token, fp32 accumulation from 0.
#include <algorithm>
#include <cstring>

#include "comm/tags.h"
#include "dispatch/flex/engines.h"
#include "dispatch/ordered_fold.h"

namespace moed::flex {

namespace {

// The per-token loop reads the routing's small arrays a few bytes a token while each token's K
// rows sweep the caches: the next line of each array is evicted before the loop comes to it,
// and too far from the last to look like a stream to the prefetchers (perf showed the loop
// stalled on them). So token t asks for the lines of token t + kRoutingAhead (begin twice as
// far ahead, as the other lines are found through it).
constexpr int64_t kRoutingAhead = 8;
void prefetch_routing(const SparseRouting& r, const std::vector<uint8_t>& chain, int64_t t,
                      int64_t end) {
  if (t + 2 * kRoutingAhead < end) __builtin_prefetch(&r.begin[size_t(t + 2 * kRoutingAhead)]);
  if (t + kRoutingAhead < end) {
    const size_t k = size_t(r.begin[size_t(t + kRoutingAhead)]);
    __builtin_prefetch(r.expert.data() + k);
    __builtin_prefetch(r.prob.data() + k);
    __builtin_prefetch(chain.data() + t + kRoutingAhead);
  }
}

// One pull's fold over its home tokens, channel by channel (pull runs it on the pool).
struct PullPass {
  const PullSpec& spec;
  const FlexHandle& h;
  const Topology& topo;
  const SendPlan& plan;
  const PullRemote& remote;
  const std::vector<int64_t>& terms;  // per (channel, node): first entry of the node's pieces
  const uint32_t chain_bit;           // tokens with this bit arrive summed (chain_combine.cc)
  // P = 1 folds (every term a raw row) are one fold_rows call per token (FoldAhead: one token
  // behind, the next token's rows asked for first): the fp32 sum stays in registers while the
  // K rows stream past, and a large output is written with non-temporal stores (no read of
  // the destination). Each element still sees acc = 0, + term, ... in expert order: the same
  // bits.
  const bool fused, stream;
  const int E, L, P, N, C;
  const int64_t H;

  // One worker's scratch and cursors.
  struct Worker {
    std::vector<int64_t> run, cursor;  // [E] next row of each expert, [N] next piece per node
    std::vector<float> acc, term;
    internal::FoldAhead fold;
    std::vector<OrderedTerm> ordered;  // DeepEP V2's order (spec.recipe)
    OrderedFold ordered_fold;
    uint64_t read = 0;  // rows read from the node's sources
  };

  // The term of expert e for a token: raw rows (P = 1, or P partials to sum into w.term) or an
  // fp32 term, from this node's sources or node m's message; and its row scalar.
  struct Term {
    const void* raw = nullptr;
    const float* f32 = nullptr;
    float scalar = 0.0f;
  };
  [[gnu::always_inline]] Term term_of(Worker& w, int e, int m, int64_t row) const {
    Term t;
    if (m == topo.node) {
      const int first = topo.first_rank_of_expert(e);
      if (P == 1) {
        const PullSource& src = spec.sources[size_t(first % topo.ranks_per_node)];
        t.raw = src.rows + size_t(row) * src.row_stride_bytes;
        if (spec.with_scalars) t.scalar = t.scalar + src.scalars[row];
      } else {
        std::fill(w.term.begin(), w.term.end(), 0.0f);
        for (int p = 0; p < P; ++p) {
          const PullSource& src = spec.sources[size_t((first + p) % topo.ranks_per_node)];
          internal::row_kernels().accumulate(
              w.term.data(), src.rows + size_t(row) * src.row_stride_bytes, spec.dtype, size_t(H));
          if (spec.with_scalars) t.scalar = t.scalar + src.scalars[row];
        }
        t.f32 = w.term.data();
      }
      w.read += uint64_t(P);
      return t;
    }
    const Bytes& msg = remote.recv_buffers[size_t(m)];
    const int64_t i = w.cursor[size_t(m)]++;
    const char* piece = msg.data() + size_t(i) * remote.piece_bytes;
    if (P == 1) {
      t.raw = piece;
    } else {
      t.f32 = reinterpret_cast<const float*>(piece);
    }
    if (spec.with_scalars) {
      const int64_t q = terms[size_t(C) * N + m];
      std::memcpy(&t.scalar, msg.data() + size_t(q) * remote.piece_bytes + size_t(i) * 4, 4);
    }
    return t;
  }

  // Adds term `t` of expert e (prob `prob`) to token t's sum, or (kProbGrad) writes its prob
  // gradient.
  [[gnu::always_inline]] void add_term(Worker& w, int64_t tok, int e, float prob, Term t) const {
    switch (spec.mode) {
      case PullMode::kCombine:
      case PullMode::kDispatchBackward:
        if (t.raw) {
          add_term_raw(w.acc.data(), t.raw, spec.dtype, spec.weighted, prob, H);
        } else {
          add_term_f32(w.acc.data(), t.f32, spec.weighted, prob, H);
        }
        break;
      case PullMode::kProbGrad:
        if (t.raw) {
          std::fill(w.term.begin(), w.term.end(), 0.0f);
          internal::row_kernels().accumulate(w.term.data(), t.raw, spec.dtype, size_t(H));
          t.f32 = w.term.data();
        }
        // d = 0; d += float(g[h]) * term[h] for h ascending
        const void* g = spec.grad_out.row_ptr(tok);
        const void* term = t.f32;
        internal::row_kernels().dot(&g, spec.grad_out.dtype, &term, DType::kF32, 1, size_t(H),
                                    &spec.out_probs[size_t(tok) * E + e]);
        break;
    }
  }

  // Token t: its terms in ascending expert order, folded and written (design.md §4.1), or in
  // DeepEP V2's order by spec.recipe.
  [[gnu::always_inline]] void fold_token(Worker& w, int64_t tok) const {
    const SparseRouting& r = h.routing;
    if (!fused) std::fill(w.acc.begin(), w.acc.end(), 0.0f);
    if (spec.recipe) {
      w.ordered.clear();
      if (spec.bias_0.data) {
        accumulate_row_f32(w.acc.data(), spec.bias_0.row_ptr(tok), spec.bias_0.dtype, size_t(H));
      }
      if (spec.bias_1.data) {
        accumulate_row_f32(w.acc.data(), spec.bias_1.row_ptr(tok), spec.bias_1.dtype, size_t(H));
      }
    }
    for (int64_t k = r.begin[size_t(tok)]; k < r.begin[size_t(tok) + 1]; ++k) {
      const int e = r.expert[size_t(k)];
      const float prob = r.prob[size_t(k)];
      const int64_t row = h.notified.send_chunk[size_t(e)] + w.run[size_t(e)]++;
      const int m = topo.node_of_expert(e);
      const Term t = term_of(w, e, m, row);
      if (spec.mode == PullMode::kDispatchBackward) spec.out_probs[size_t(tok) * E + e] = t.scalar;
      if (spec.recipe) {
        const int slot = r.slot.empty() ? -1 : r.slot[size_t(k)];
        w.ordered.push_back({t.raw, slot, topo.first_rank_of_expert(e), m});
        if (spec.out_slot_weights && slot >= 0 && slot < spec.num_topk)
          spec.out_slot_weights[size_t(tok) * size_t(spec.num_topk) + size_t(slot)] = t.scalar;
        continue;
      }
      if (fused) {
        w.fold.add(t.raw, prob);
        continue;
      }
      add_term(w, tok, e, prob, t);
    }
    if (spec.recipe) w.ordered_fold.fold(w.acc.data(), w.ordered, *spec.recipe);
    if (fused) {
      w.fold.push(spec.out.row_ptr(tok));
    } else if (spec.mode != PullMode::kProbGrad) {
      store_row(w.acc.data(), spec.out.row_ptr(tok), spec.out.dtype, size_t(H));
    }
  }

  // Channels [cb, ce); returns the rows read from the node's sources.
  uint64_t run_channels(int64_t cb, int64_t ce) const {
    Worker w{std::vector<int64_t>(size_t(E)),
             std::vector<int64_t>(size_t(N)),
             std::vector<float>(size_t(H)),
             std::vector<float>(size_t(H)),
             internal::FoldAhead(spec.dtype, spec.out.dtype, size_t(H), spec.weighted, stream),
             {},
             OrderedFold(spec.dtype, H)};
    for (int64_t c = cb; c < ce; ++c) {
      std::copy(plan.expert_prefix.begin() + c * E, plan.expert_prefix.begin() + (c + 1) * E,
                w.run.begin());
      for (int m = 0; m < N; ++m) w.cursor[size_t(m)] = terms[size_t(c) * N + m];
      const int64_t end = plan.channel_begin[size_t(c) + 1];
      for (int64_t t = plan.channel_begin[size_t(c)]; t < end; ++t) {
        prefetch_routing(h.routing, plan.chain, t, end);
        if (plan.chain[size_t(t)] & chain_bit) {
          // Chained: summed along its nodes; only its experts' rows are skipped here.
          for (int64_t k = h.routing.begin[size_t(t)]; k < h.routing.begin[size_t(t) + 1]; ++k)
            ++w.run[size_t(h.routing.expert[size_t(k)])];
          continue;
        }
        fold_token(w, t);
      }
    }
    w.fold.flush();
    if (stream) internal::stream_fence();  // the rows are read by other threads next
    return w.read;
  }
};

}  // namespace

Status pull(const DispatchContext& ctx, const PullSpec& spec, int tag) {
  const FlexHandle& h = *ctx.handle;
  const Topology& topo = h.topo;
  const SendPlan& plan = h.send;
  const int P = topo.etp_size;
  // Chained tokens (chain_combine.cc) are summed along their nodes and arrive finished; the
  // fold skips them and reads per-expert terms only for the others.
  const bool chain_on = chain_enabled(topo, spec);
  MOED_ASSIGN_OR_RETURN(PullRemote remote, pull_remote_start(ctx, spec, tag));
  ChainOps chain;
  if (chain_on) {
    MOED_ASSIGN_OR_RETURN(chain, chain_start(ctx, spec, tags::flex_chain(tag)));
  }
  MOED_RETURN_IF_ERROR(wait_all(remote.recvs));
  const bool fused = P == 1 && spec.mode != PullMode::kProbGrad && spec.recipe == nullptr;
  const PullPass pass{
      spec,
      h,
      topo,
      plan,
      remote,
      chain_on ? plan.term_entries[chain_class(spec.dtype, P)] : plan.node_entries,
      chain_on ? 1u << chain_class(spec.dtype, P) : 0,
      fused,
      fused && size_t(spec.out.rows) * spec.out.row_bytes() >= internal::kStreamThresholdBytes,
      topo.num_experts,
      topo.num_local_experts,
      P,
      topo.num_nodes,
      plan.num_channels,
      h.hidden};
  std::vector<uint64_t> rows_read(size_t(pass.C), 0);
  ctx.world->pool().parallel_for(pass.C, [&](int64_t cb, int64_t ce, int) {
    rows_read[size_t(cb)] = pass.run_channels(cb, ce);
  });
  uint64_t rows = 0;
  for (uint64_t r : rows_read) rows += r;
  ctx.world->add_shared_bytes(rows * dtype_row_bytes(spec.dtype, pass.H), rows);
  Status s = chain_on ? chain_finish(ctx, spec, chain) : ok_status();
  Status sent = wait_all(remote.sends);
  MOED_RETURN_IF_ERROR(s);
  return sent;
}

}  // namespace moed::flex
