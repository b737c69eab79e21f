// Flex combine (design.md §5.4) and the backward of dispatch: each home rank reads its tokens'
// contributions from the expert ranks' rows (node-shared memory inside the node, the
// forwarders' per-expert terms from other nodes) and folds them in the fixed order of
// design.md §4.1: one read per contribution, one write per token, fp32 accumulation from 0.
#include <algorithm>
#include <cstring>

#include "comm/tags.h"
#include "dispatch/flex/flex_internal.h"
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

}  // namespace

Status pull(const DispatchContext& ctx, const PullSpec& spec, int tag) {
  const FlexHandle& h = *ctx.handle;
  const Topology& topo = h.topo;
  const SendPlan& plan = h.send;
  const int E = topo.num_experts, L = topo.num_local_experts, P = topo.etp_size;
  const int N = topo.num_nodes, C = plan.num_channels;
  const int64_t H = h.hidden;
  // Chained tokens (chain_combine.cc) are summed along their nodes and arrive finished; the
  // fold below skips them and reads per-expert terms only for the others.
  const bool chain_on = chain_enabled(topo, spec);
  const uint32_t chain_bit = chain_on ? 1u << chain_class(spec.dtype, P) : 0;
  const std::vector<int64_t>& terms =
      chain_on ? plan.term_entries[chain_class(spec.dtype, P)] : plan.node_entries;
  MOED_ASSIGN_OR_RETURN(PullRemote remote, pull_remote_start(ctx, spec, tag));
  ChainOps chain;
  if (chain_on) {
    MOED_ASSIGN_OR_RETURN(chain, chain_start(ctx, spec, tags::flex_chain(tag)));
  }
  MOED_RETURN_IF_ERROR(wait_all(remote.recvs));
  const size_t scalar_off_unit = remote.piece_bytes;
  // P = 1 folds (every term a raw row) are one fold_rows call per token (FoldAhead: one token
  // behind, the next token's rows asked for first): the fp32 sum stays in registers while the
  // K rows stream past, and a large output is written with non-temporal stores (no read of
  // the destination). Each element still sees acc = 0, + term, ... in expert order: the same
  // bits.
  const bool fused = P == 1 && spec.mode != PullMode::kProbGrad && spec.recipe == nullptr;
  const bool stream =
      fused && size_t(spec.out.rows) * spec.out.row_bytes() >= internal::kStreamThresholdBytes;
  std::vector<uint64_t> rows_read(size_t(C), 0);
  ctx.world->pool().parallel_for(C, [&](int64_t cb, int64_t ce, int) {
    std::vector<int64_t> run(static_cast<size_t>(E)), cursor(static_cast<size_t>(N));
    std::vector<float> acc(static_cast<size_t>(H)), term(static_cast<size_t>(H));
    internal::FoldAhead fold(spec.dtype, spec.out.dtype, size_t(H), spec.weighted, stream);
    // DeepEP V2's order (spec.recipe): the token's terms, folded once all are known.
    std::vector<OrderedTerm> ordered;
    OrderedFold ordered_fold(spec.dtype, H);
    const bool slots = !h.routing.slot.empty();
    for (int64_t c = cb; c < ce; ++c) {
      std::copy(plan.expert_prefix.begin() + c * E, plan.expert_prefix.begin() + (c + 1) * E,
                run.begin());
      for (int m = 0; m < N; ++m) cursor[size_t(m)] = terms[size_t(c) * N + m];
      uint64_t read = 0;
      const int64_t end = plan.channel_begin[size_t(c) + 1];
      for (int64_t t = plan.channel_begin[size_t(c)]; t < end; ++t) {
        prefetch_routing(h.routing, plan.chain, t, end);
        if (plan.chain[size_t(t)] & chain_bit) {
          for (int64_t k = h.routing.begin[size_t(t)]; k < h.routing.begin[size_t(t) + 1]; ++k)
            ++run[size_t(h.routing.expert[size_t(k)])];
          continue;
        }
        if (!fused) std::fill(acc.begin(), acc.end(), 0.0f);
        if (spec.recipe) {
          ordered.clear();
          if (spec.bias_0.data) {
            accumulate_row_f32(acc.data(), spec.bias_0.row_ptr(t), spec.bias_0.dtype, size_t(H));
          }
          if (spec.bias_1.data) {
            accumulate_row_f32(acc.data(), spec.bias_1.row_ptr(t), spec.bias_1.dtype, size_t(H));
          }
        }
        for (int64_t k = h.routing.begin[size_t(t)]; k < h.routing.begin[size_t(t) + 1]; ++k) {
          const int e = h.routing.expert[size_t(k)];
          const float prob = h.routing.prob[size_t(k)];
          const int64_t row = h.layout_of_expert(e).offset(e % L, topo.rank) + run[size_t(e)]++;
          const int m = topo.node_of_expert(e);
          // The term of expert e: raw rows (P = 1, or P partials to sum) or an fp32 term.
          const void* raw = nullptr;
          const float* f32_term = nullptr;
          float scalar = 0.0f;
          if (m == topo.node) {
            const int first = topo.first_rank_of_expert(e);
            if (P == 1) {
              const PullSource& src = spec.sources[size_t(first % topo.ranks_per_node)];
              raw = src.rows + size_t(row) * src.row_stride_bytes;
              if (spec.with_scalars) scalar = scalar + src.scalars[row];
            } else {
              std::fill(term.begin(), term.end(), 0.0f);
              for (int p = 0; p < P; ++p) {
                const PullSource& src = spec.sources[size_t((first + p) % topo.ranks_per_node)];
                accumulate_raw(term.data(), src.rows + size_t(row) * src.row_stride_bytes,
                               spec.dtype, H);
                if (spec.with_scalars) scalar = scalar + src.scalars[row];
              }
              f32_term = term.data();
            }
            read += uint64_t(P);
          } else {
            const Bytes& msg = remote.recv_buffers[size_t(m)];
            const int64_t i = cursor[size_t(m)]++;
            const char* piece = msg.data() + size_t(i) * remote.piece_bytes;
            if (P == 1) {
              raw = piece;
            } else {
              f32_term = reinterpret_cast<const float*>(piece);
            }
            if (spec.with_scalars) {
              const int64_t q = terms[size_t(C) * N + m];
              std::memcpy(&scalar, msg.data() + size_t(q) * scalar_off_unit + size_t(i) * 4, 4);
            }
          }
          if (spec.mode == PullMode::kDispatchBackward) spec.out_probs[size_t(t) * E + e] = scalar;
          if (spec.recipe) {
            const int slot = slots ? h.routing.slot[size_t(k)] : -1;
            ordered.push_back({raw, slot, topo.first_rank_of_expert(e), m});
            if (spec.out_slot_weights && slot >= 0 && slot < spec.num_topk)
              spec.out_slot_weights[size_t(t) * size_t(spec.num_topk) + size_t(slot)] = scalar;
            continue;
          }
          if (fused) {
            fold.add(raw, prob);
            continue;
          }
          switch (spec.mode) {
            case PullMode::kCombine:
            case PullMode::kDispatchBackward:
              if (raw) {
                add_term_raw(acc.data(), raw, spec.dtype, spec.weighted, prob, H);
              } else {
                add_term_f32(acc.data(), f32_term, spec.weighted, prob, H);
              }
              break;
            case PullMode::kProbGrad:
              if (raw) {
                std::fill(term.begin(), term.end(), 0.0f);
                accumulate_raw(term.data(), raw, spec.dtype, H);
                f32_term = term.data();
              }
              spec.out_probs[size_t(t) * E + e] =
                  dot_row(spec.grad_out.row_ptr(t), spec.grad_out.dtype, f32_term, H);
              break;
          }
        }
        if (spec.recipe) ordered_fold.fold(acc.data(), ordered, *spec.recipe);
        if (fused) {
          fold.push(spec.out.row_ptr(t));
        } else if (spec.mode != PullMode::kProbGrad) {
          store_row(spec.out.row_ptr(t), acc.data(), spec.out.dtype, H);
        }
      }
      rows_read[size_t(c)] = read;
    }
    fold.flush();
    if (stream) internal::stream_fence();  // the rows are read by other threads next
  });
  uint64_t rows = 0;
  for (uint64_t r : rows_read) rows += r;
  ctx.world->add_shared_bytes(rows * dtype_row_bytes(spec.dtype, H), rows);
  Status s = chain_on ? chain_finish(ctx, spec, chain) : ok_status();
  Status sent = wait_all(remote.sends);
  MOED_RETURN_IF_ERROR(s);
  return sent;
}

}  // namespace moed::flex
