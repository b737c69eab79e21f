// Flex's node-reduced combine across nodes (design.md §5.6): a token's fp32 running sum travels
// along the nodes that hold its experts, ascending, and reaches its home finished.
//
// NOTE (why this is bitwise): design.md §4.1 folds acc = 0; acc = acc + w_e * term_e over the
// experts ascending and rounds once. Experts ascending are nodes ascending (expert e on rank e / L,
// rank r on node r / G), so the node holding the lowest experts starts acc from 0 and adds its
// terms, the next node continues the same acc with its own (the row crosses the network as fp32,
// unrounded), and so on: every element sees the same additions in the same order as the home's fold
// would, with the same row kernels (fold_rows onto the received sum, or the fp32 term of P
// partials). The last node rounds once (store_row, as the home would) and sends the rounded row
// home, so the last hop is an output row, not an fp32 one. Adding per-node partials at home instead
// would re-associate the sum.
//
// NOTE (who does what): all of a token's chain traffic runs on one rail, the ranks with its
// home's local index (the forwarders of its dispatch, Topology::forwarder_on), so a rank's
// chain work is its forwarded tokens (the forward plan knows their experts and rows, and the
// dispatch header their ChainLink) and its own tokens where its node holds experts (the home
// node takes its turn at its place in the node order). One message per (rank, next node): the
// partials of every token whose chain goes that way, listed home rank ascending then token
// ascending, which both ends enumerate alike, so the messages need no headers. Every chain hop
// goes to a higher node except the last one home, so a rank that has received from every lower
// node has all its inputs: waiting for those, then sending, cannot deadlock (induction on the
// node), and the rounded rows from higher nodes are waited for last.
#include <algorithm>
#include <cstring>

#include "dispatch/flex/engines.h"

namespace moed::flex {

bool chain_enabled(const Topology& topo, const PullSpec& spec) {
  return topo.num_nodes > 1 && spec.recipe == nullptr &&
         (spec.mode == PullMode::kCombine ||
          (spec.mode == PullMode::kDispatchBackward && !spec.with_scalars));
}

namespace {

// This rank's items for class bit `bit`: the homes on its rail by rank ascending (its own
// tokens at its own node's place), each home's tokens ascending.
std::vector<ChainItem> list_items(const FlexHandle& h, uint32_t bit) {
  const Topology& topo = h.topo;
  std::vector<ChainItem> items;
  std::vector<int> nodes;
  for (int n = 0; n < topo.num_nodes; ++n) {
    const int home = topo.forwarder_on(n);
    if (n != topo.node) {
      for (const ForwardPlan& f : h.forward) {
        if (f.src != home) continue;
        for (int64_t i = 0; i < f.num_tokens; ++i) {
          const ChainLink& l = f.chain[size_t(i)];
          if (!(l.classes & bit)) continue;
          ChainItem it;
          it.home = home;
          it.token = f.src_token[size_t(i)];
          it.prev = l.prev;
          it.next = l.next;
          it.last = l.last != 0;
          it.plan = &f;
          it.index = i;
          items.push_back(it);
        }
      }
      continue;
    }
    const SparseRouting& r = h.routing;
    for (int64_t t = 0; t < r.num_tokens(); ++t) {
      if (!(h.send.chain[size_t(t)] & bit)) continue;
      const int64_t b = r.begin[size_t(t)];
      chain_classes(topo, &r.expert[size_t(b)], r.begin[size_t(t) + 1] - b, topo.node, &nodes);
      ChainItem it;
      it.home = home;
      it.token = int32_t(t);
      it.index = t;
      const auto pos = std::find(nodes.begin(), nodes.end(), topo.node);
      if (pos != nodes.end()) {  // the home node's turn
        it.prev = int16_t(pos == nodes.begin() ? -1 : *(pos - 1));
        it.next = int16_t(pos + 1 == nodes.end() ? -1 : *(pos + 1));
        it.last = it.next == -1;
        items.push_back(it);
        if (it.last) continue;  // the home node is last: its turn finishes the sum
      }
      it.turn = false;  // the rounded row comes back from the last node
      it.last = false;
      it.prev = int16_t(nodes.back());
      it.next = -1;
      items.push_back(it);
    }
  }
  return items;
}

// Positions of every item in the messages from and to each node, the receives (posted) and
// the send buffers; out_f32 / out_rows: fp32 partials and rounded rows sent to each node.
// Returns whether this rank takes turns on its own tokens.
StatusOr<bool> open_messages(const DispatchContext& ctx, const PullSpec& spec, int tag,
                             ChainOps& ops, std::vector<int64_t>& out_f32,
                             std::vector<int64_t>& out_rows) {
  const Topology& topo = ctx.handle->topo;
  const int N = topo.num_nodes;
  const size_t f32_bytes = size_t(ctx.handle->hidden) * sizeof(float);
  const size_t row_bytes = spec.out.row_bytes();
  std::vector<int64_t> in_f32(size_t(N), 0), in_rows(size_t(N), 0);
  out_f32.assign(size_t(N), 0);
  out_rows.assign(size_t(N), 0);
  bool own_turns = false;
  for (ChainItem& it : ops.items) {
    if (!it.turn) {
      it.in_pos = in_rows[size_t(it.prev)]++;
      continue;
    }
    if (it.prev >= 0) it.in_pos = in_f32[size_t(it.prev)]++;
    if (it.next >= 0) it.out_pos = (it.last ? out_rows : out_f32)[size_t(it.next)]++;
    own_turns = own_turns || it.plan == nullptr;
  }
  ops.recv_buffers.resize(size_t(N));
  ops.send_buffers.resize(size_t(N));
  ops.recv_rows_off.assign(size_t(N), 0);
  ops.send_rows_off.assign(size_t(N), 0);
  for (int n = 0; n < N; ++n) {
    ops.recv_rows_off[size_t(n)] = size_t(in_f32[size_t(n)]) * f32_bytes;
    const size_t bytes = ops.recv_rows_off[size_t(n)] + size_t(in_rows[size_t(n)]) * row_bytes;
    if (bytes == 0) continue;
    Bytes& buf = ops.recv_buffers[size_t(n)];
    buf = ctx.net->chain_recv(n, bytes);
    MOED_ASSIGN_OR_RETURN(Request r,
                          ctx.world->irecv(topo.forwarder_on(n), tag, buf.data(), buf.size()));
    (n < topo.node ? ops.recvs_low : ops.recvs_high).push_back(std::move(r));
  }
  for (int n = 0; n < N; ++n) {
    ops.send_rows_off[size_t(n)] = size_t(out_f32[size_t(n)]) * f32_bytes;
    const size_t bytes = ops.send_rows_off[size_t(n)] + size_t(out_rows[size_t(n)]) * row_bytes;
    if (bytes > 0) ops.send_buffers[size_t(n)] = ctx.net->chain_send(n, bytes);
  }
  return own_turns;
}

// This rank's turns: each adds its node's terms of a token to the running sum.
struct ChainTurns {
  const PullSpec& spec;
  const FlexHandle& h;
  const Topology& topo;
  ChainOps& ops;
  const int P, G;
  const int64_t H;
  const size_t f32_bytes, row_bytes;
  std::vector<int64_t> own_row;  // rows of this rank's own entries (the home's count, as pull's)

  ChainTurns(const DispatchContext& ctx, const PullSpec& s, ChainOps& o, bool own_turns)
      : spec(s),
        h(*ctx.handle),
        topo(h.topo),
        ops(o),
        P(topo.etp_size),
        G(topo.ranks_per_node),
        H(h.hidden),
        f32_bytes(size_t(h.hidden) * sizeof(float)),
        row_bytes(s.out.row_bytes()) {
    if (!own_turns) return;
    const SparseRouting& r = h.routing;
    own_row.resize(size_t(r.num_entries()));
    std::vector<int64_t> run(size_t(topo.num_experts), 0);
    for (int64_t k = 0; k < r.num_entries(); ++k) {
      const int e = r.expert[size_t(k)];
      own_row[size_t(k)] = h.notified.send_chunk[size_t(e)] + run[size_t(e)]++;
    }
  }

  // Calls fn(expert, row, prob) for each of the item's terms on this node.
  template <typename Fn>
  void for_each_term(const ChainItem& it, Fn&& fn) const {
    if (it.plan) {
      const ForwardPlan& f = *it.plan;
      for (int64_t k = f.entry_begin[size_t(it.index)]; k < f.entry_begin[size_t(it.index) + 1];
           ++k)
        fn(f.entry_expert[size_t(k)], f.entry_row[size_t(k)], f.entry_prob[size_t(k)]);
      return;
    }
    const SparseRouting& r = h.routing;
    for (int64_t k = r.begin[size_t(it.index)]; k < r.begin[size_t(it.index) + 1]; ++k) {
      const int ex = r.expert[size_t(k)];
      if (topo.node_of_expert(ex) == topo.node) fn(ex, own_row[size_t(k)], r.prob[size_t(k)]);
    }
  }

  // Where the item's rounded row goes: the output (this rank is the home) or the message home.
  void* rounded_dst(const ChainItem& it) const {
    if (it.next < 0) return spec.out.row_ptr(it.token);
    return ops.send_buffers[size_t(it.next)].data() + ops.send_rows_off[size_t(it.next)] +
           size_t(it.out_pos) * row_bytes;
  }

  // The fp32 sum received from the previous node, or null where the chain starts here.
  const float* received(const ChainItem& it) const {
    if (it.prev < 0) return nullptr;
    return reinterpret_cast<const float*>(ops.recv_buffers[size_t(it.prev)].data() +
                                          size_t(it.in_pos) * f32_bytes);
  }

  // A turn with P = 1 folds its rows in one pass (fold_rows, as pull's home fold does), onto
  // the received sum where it has one: into the fp32 partial it sends on (an f32 store is
  // exact), or rounded into the row it sends home or into the output. Returns the rows read.
  uint64_t fold(const ChainItem& it, std::vector<const void*>& rows,
                std::vector<float>& probs) const {
    rows.clear();
    probs.clear();
    for_each_term(it, [&](int ex, int64_t row, float prob) {
      const PullSource& src = spec.sources[size_t(topo.first_rank_of_expert(ex) % G)];
      rows.push_back(src.rows + size_t(row) * src.row_stride_bytes);
      probs.push_back(prob);
    });
    void* dst;
    DType dt = spec.out.dtype;
    if (it.next >= 0 && !it.last) {
      dst = ops.send_buffers[size_t(it.next)].data() + size_t(it.out_pos) * f32_bytes;
      dt = DType::kF32;
    } else {
      dst = rounded_dst(it);
    }
    internal::row_kernels().fold_rows(rows.data(), spec.dtype,
                                      spec.weighted ? probs.data() : nullptr, int(rows.size()), dst,
                                      dt, size_t(H), /*stream=*/false, received(it));
    return uint64_t(rows.size());
  }

  // A turn with P > 1: continues the received fp32 sum (or starts it from 0) with this node's
  // terms, each the fp32 term of P partials. Returns the rows read.
  uint64_t run(const ChainItem& it, std::vector<float>& local, std::vector<float>& term) const {
    // A partial that goes on is summed in place in its outgoing message.
    float* acc = it.next >= 0 && !it.last
                     ? reinterpret_cast<float*>(ops.send_buffers[size_t(it.next)].data() +
                                                size_t(it.out_pos) * f32_bytes)
                     : local.data();
    if (const float* sum = received(it)) {
      std::memcpy(acc, sum, f32_bytes);
    } else {
      std::fill(acc, acc + H, 0.0f);
    }
    uint64_t read = 0;
    for_each_term(it, [&](int ex, int64_t row, float prob) {
      const int first = topo.first_rank_of_expert(ex);
      ++read;
      std::fill(term.begin(), term.end(), 0.0f);
      for (int p = 0; p < P; ++p) {
        const PullSource& src = spec.sources[size_t((first + p) % G)];
        internal::row_kernels().accumulate(
            term.data(), src.rows + size_t(row) * src.row_stride_bytes, spec.dtype, size_t(H));
      }
      add_term_f32(acc, term.data(), spec.weighted, prob, H);
    });
    // The one rounding: here when this rank is the home, else into the row sent home.
    if (it.next < 0 || it.last) store_row(acc, rounded_dst(it), spec.out.dtype, size_t(H));
    return read * uint64_t(P);
  }
};

}  // namespace

StatusOr<ChainOps> chain_start(const DispatchContext& ctx, const PullSpec& spec, int tag) {
  const FlexHandle& h = *ctx.handle;
  const Topology& topo = h.topo;
  ChainOps ops;
  ops.items = list_items(h, 1u << chain_class(spec.dtype, topo.etp_size));
  std::vector<int64_t> out_f32, out_rows;
  MOED_ASSIGN_OR_RETURN(const bool own_turns,
                        open_messages(ctx, spec, tag, ops, out_f32, out_rows));
  const ChainTurns turns(ctx, spec, ops, own_turns);
  MOED_RETURN_IF_ERROR(wait_all(ops.recvs_low));

  std::vector<uint64_t> terms_read(ops.items.size(), 0);
  ctx.world->pool().parallel_for(
      int64_t(ops.items.size()),
      [&](int64_t b, int64_t e, int) {
        std::vector<float> local(size_t(h.hidden)), term(size_t(h.hidden));
        std::vector<const void*> fold_rows;
        std::vector<float> fold_probs;
        for (int64_t i = b; i < e; ++i) {
          const ChainItem& it = ops.items[size_t(i)];
          if (!it.turn) continue;
          // P = 1: the one-pass fold (same bits).
          terms_read[size_t(i)] = topo.etp_size == 1 ? turns.fold(it, fold_rows, fold_probs)
                                                     : turns.run(it, local, term);
        }
      },
      4);
  uint64_t rows = 0;
  for (uint64_t r : terms_read) rows += r;
  ctx.world->add_shared_bytes(rows * dtype_row_bytes(spec.dtype, h.hidden), rows);
  for (int n = 0; n < topo.num_nodes; ++n) {
    const Bytes& buf = ops.send_buffers[size_t(n)];
    if (buf.empty()) continue;
    MOED_ASSIGN_OR_RETURN(Request r,
                          ctx.world->isend(topo.forwarder_on(n), tag, buf.data(), buf.size()));
    ctx.world->add_network_bytes(0, uint64_t(out_f32[size_t(n)] + out_rows[size_t(n)]));
    ops.sends.push_back(std::move(r));
  }
  return ops;
}

Status chain_finish(const DispatchContext& ctx, const PullSpec& spec, ChainOps& ops) {
  const size_t row_bytes = spec.out.row_bytes();
  MOED_RETURN_IF_ERROR(wait_all(ops.recvs_high));
  ctx.world->pool().parallel_for(
      int64_t(ops.items.size()),
      [&](int64_t b, int64_t e, int) {
        for (int64_t i = b; i < e; ++i) {
          const ChainItem& it = ops.items[size_t(i)];
          if (it.turn) continue;
          std::memcpy(spec.out.row_ptr(it.token),
                      ops.recv_buffers[size_t(it.prev)].data() +
                          ops.recv_rows_off[size_t(it.prev)] + size_t(it.in_pos) * row_bytes,
                      row_bytes);
        }
      },
      16);
  return wait_all(ops.sends);
}

}  // namespace moed::flex
