// Flex phase 3 across nodes (design.md §5.5): a token needed on a remote node crosses the network
// once, to the rank of that node with the sender's local index (the forwarder), with a header
// (source token, mask of the node's ranks that need it, its experts there and their probs).
// The forwarder places it over shared memory into each needed rank's canonical row.
//
// The header also carries the destination node's place in the token's combine chain
// (ChainLink, flex/topology.h), kept in the forward plan so cached dispatches and every
// combine of the handle reuse it.
//
// NOTE: the forwarder learns a token's rows from a running count per expert over the
// source's headers, which arrive in token order: every token of source s for an expert of
// node m goes through the same forwarder, so the count is the token's index in its chunk.
#include <cstring>

#include "dispatch/flex/engines.h"

namespace moed::flex {

namespace {

uint64_t rank_mask_of(const Topology& topo, int expert, uint64_t mask) {
  for (int p = 0; p < topo.etp_size; ++p) {
    mask |= uint64_t(1) << ((topo.first_rank_of_expert(expert) + p) % topo.ranks_per_node);
  }
  return mask;
}

// Scans the headers of node m's source into a forward plan (uncached mode).
ForwardPlan scan_headers(const FlexHandle& h, int m, const char* msg, int64_t n, int64_t q) {
  const Topology& topo = h.topo;
  const int src = topo.forwarder_on(m);
  ForwardPlan f;
  f.src = src;
  f.num_tokens = n;
  f.num_entries = q;
  f.src_token.resize(size_t(n));
  f.entry_begin.resize(size_t(n) + 1);
  f.entry_expert.resize(size_t(q));
  f.entry_prob.resize(size_t(q));
  f.entry_slot.resize(size_t(q));
  f.entry_row.resize(size_t(q));
  f.chain.resize(size_t(n));
  const Message<const char> message(msg, MessageLayout::of(n, q, 0, 0));
  std::vector<int64_t> run(size_t(topo.num_experts), 0);
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) {
    const MessageHeader hd = message.header(size_t(i));
    f.src_token[size_t(i)] = hd.src_token;
    f.chain[size_t(i)] = hd.chain;
    MOED_CHECK(hd.chain.classes == 0 ||
                   (hd.chain.prev >= -1 && hd.chain.prev < topo.node && hd.chain.next >= 0 &&
                    hd.chain.next < topo.num_nodes && hd.chain.next != topo.node),
               "forwarded token ", hd.src_token, " from rank ", src, ": chain link ", hd.chain.prev,
               " -> ", hd.chain.next, " on node ", topo.node);
    f.entry_begin[size_t(i)] = k;
    uint64_t mask = 0;
    for (int32_t x = 0; x < hd.num_entries; ++x, ++k) {
      const MessageEntry en = message.entry(size_t(k));
      MOED_CHECK(topo.node_of_expert(en.expert) == topo.node, "forwarded token ", hd.src_token,
                 " from rank ", src, ": expert ", en.expert, " is not on node ", topo.node);
      f.entry_expert[size_t(k)] = en.expert;
      f.entry_prob[size_t(k)] = en.prob;
      f.entry_slot[size_t(k)] = en.slot;
      f.entry_row[size_t(k)] = h.notified.forward_chunk_of(m, en.expert) + run[size_t(en.expert)]++;
      mask = rank_mask_of(topo, en.expert, mask);
    }
    MOED_CHECK(mask == hd.rank_mask, "forwarded token ", hd.src_token, " from rank ", src,
               ": header mask ", hd.rank_mask, " != ", mask);
  }
  MOED_CHECK(k == q, "forwarder saw ", k, " entries from rank ", src, ", expected ", q);
  f.entry_begin[size_t(n)] = k;
  return f;
}

}  // namespace

StatusOr<RemoteOps> push_remote_start(const DispatchContext& ctx, const PushSpec& spec, int tag) {
  const FlexHandle& h = *ctx.handle;
  const Topology& topo = h.topo;
  const SendPlan& plan = h.send;
  const int N = topo.num_nodes, C = plan.num_channels;
  const PushLayout& l = spec.layout;
  RemoteOps ops;
  // Receives of the forwarder role first, so no sender waits on an unposted receive.
  MOED_RETURN_IF_ERROR(post_node_recvs(
      *ctx.world, topo, *ctx.net, tag,
      [&](int m) {
        const int64_t n = h.notified.forward_tokens[size_t(m)];
        return n == 0 ? 0
                      : MessageLayout::of(n, h.notified.forward_entries[size_t(m)], l.row_bytes,
                                          l.scale_bytes)
                            .bytes;
      },
      ops.recv_buffers, ops.recvs));
  NodeMessages out(topo, *ctx.net, {&plan.node_tokens[size_t(C) * N], size_t(N)}, [&](int m) {
    return MessageLayout::of(plan.node_tokens[size_t(C) * N + m],
                             plan.node_entries[size_t(C) * N + m], l.row_bytes, l.scale_bytes);
  });
  // Headers and entries: channel c's tokens for node m go at the channel's prefix in m's message.
  ctx.world->pool().parallel_for(C, [&](int64_t cb, int64_t ce, int) {
    std::vector<int64_t> tok(static_cast<size_t>(N)), ent(static_cast<size_t>(N));
    std::vector<int32_t> count(static_cast<size_t>(N));
    std::vector<uint64_t> mask(static_cast<size_t>(N));
    std::vector<int> nodes;
    for (int64_t c = cb; c < ce; ++c) {
      for (int m = 0; m < N; ++m) {
        tok[size_t(m)] = plan.node_tokens[size_t(c) * N + m];
        ent[size_t(m)] = plan.node_entries[size_t(c) * N + m];
      }
      for (int64_t t = plan.channel_begin[size_t(c)]; t < plan.channel_begin[size_t(c) + 1]; ++t) {
        std::fill(count.begin(), count.end(), 0);
        std::fill(mask.begin(), mask.end(), 0);
        for (int64_t k = h.routing.begin[size_t(t)]; k < h.routing.begin[size_t(t) + 1]; ++k) {
          const int e = h.routing.expert[size_t(k)];
          const int m = topo.node_of_expert(e);
          if (m == topo.node) continue;
          const MessageEntry en{e, h.routing.prob[size_t(k)],
                                h.routing.slot.empty() ? -1 : h.routing.slot[size_t(k)]};
          out.at(m).put_entry(size_t(ent[size_t(m)] + count[size_t(m)]), en);
          ++count[size_t(m)];
          mask[size_t(m)] = rank_mask_of(topo, e, mask[size_t(m)]);
        }
        const int64_t b = h.routing.begin[size_t(t)];
        const uint32_t classes =
            chain_classes(topo, &h.routing.expert[size_t(b)], h.routing.begin[size_t(t) + 1] - b,
                          topo.node, &nodes);
        for (int m = 0; m < N; ++m) {
          if (count[size_t(m)] == 0) continue;
          const size_t i = size_t(tok[size_t(m)]++);
          out.at(m).put_header(i, {int32_t(t), count[size_t(m)], mask[size_t(m)],
                                   chain_link(nodes, classes, m, topo.node)});
          out.set_row(m, i, spec.rows, t);
          ent[size_t(m)] += count[size_t(m)];
        }
      }
    }
  });
  MOED_RETURN_IF_ERROR(out.send(*ctx.world, tag, ops.sends));
  return ops;
}

Status push_remote_finish(const DispatchContext& ctx, const PushSpec& spec, RemoteOps& ops) {
  const FlexHandle& h = *ctx.handle;
  const Topology& topo = h.topo;
  const PushLayout& l = spec.layout;
  const int N = topo.num_nodes, P = topo.etp_size;
  MOED_RETURN_IF_ERROR(wait_all(ops.recvs));
  if (ctx.forward_out) ctx.forward_out->clear();
  uint64_t rows = 0;
  for (int m = 0; m < N; ++m) {
    if (m == topo.node) continue;
    const int src = topo.forwarder_on(m);
    const int64_t n = h.notified.forward_tokens[size_t(m)];
    const int64_t q = h.notified.forward_entries[size_t(m)];
    const char* msg = ops.recv_buffers[size_t(m)].data();
    const ForwardPlan* f = nullptr;
    if (ctx.forward_out) {
      ctx.forward_out->push_back(scan_headers(h, m, msg, n, q));
      f = &ctx.forward_out->back();
    } else {
      for (const ForwardPlan& p : h.forward) {
        if (p.src == src) f = &p;
      }
      MOED_CHECK(f != nullptr && f->num_tokens == n, "no forward plan for rank ", src);
    }
    if (n == 0) continue;
    const Message<const char> message(msg, MessageLayout::of(n, q, l.row_bytes, l.scale_bytes));
    ctx.world->pool().parallel_for(
        n,
        [&](int64_t b, int64_t e, int) {
          RowWriter writer(spec);
          for (int64_t i = b; i < e; ++i) {
            const char* payload = message.payload(size_t(i));
            const char* scales = message.scales(size_t(i));
            for (int64_t k = f->entry_begin[size_t(i)]; k < f->entry_begin[size_t(i) + 1]; ++k) {
              const int ex = f->entry_expert[size_t(k)];
              for (int p = 0; p < P; ++p) {
                const int lr = (topo.first_rank_of_expert(ex) + p) % topo.ranks_per_node;
                writer.write(spec.target->peer(lr), f->entry_row[size_t(k)], payload, scales,
                             f->entry_prob[size_t(k)], src, f->src_token[size_t(i)],
                             f->entry_slot[size_t(k)]);
              }
            }
          }
          writer.finish();  // before the owners are signalled
        },
        16);
    rows += uint64_t(q) * uint64_t(P);
  }
  ctx.world->add_shared_bytes(
      rows * (l.row_bytes + l.scale_bytes + (l.meta ? PushLayout::kMetaBytes : 0)), rows);
  return wait_all(ops.sends);
}

}  // namespace moed::flex
