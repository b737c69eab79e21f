// Flex phase 2, notify (design.md §5.2): one all-gather of every rank's counts. From it every
// rank computes the canonical layout of every rank (rank prefix matrix: where each source's
// chunk starts inside each expert segment) and keeps the rows it needs (flex::Notified), its
// own channel prefix matrices (where each of its channels starts inside each chunk and inside
// each node's message), and the size of every message it will send or receive. Nothing else
// is exchanged before the data moves.
#include <algorithm>

#include "dispatch/flex/engines.h"
#include "routing/dispatch_layout.h"

namespace moed::flex {

namespace {

SendPlan make_send_plan(const Topology& topo, const SparseRouting& routes, int num_channels,
                        ThreadPool& pool) {
  const int64_t T = routes.num_tokens();
  const int C = num_channels, E = topo.num_experts, N = topo.num_nodes;
  SendPlan plan;
  plan.num_channels = C;
  plan.channel_begin = channel_bounds(T, C);
  // Per-channel counts first (disjoint rows of the matrices), then exclusive prefixes.
  std::vector<int64_t> expert_count(size_t(C) * E, 0);
  std::vector<int64_t> node_tokens(size_t(C) * N, 0), node_entries(size_t(C) * N, 0);
  std::vector<int64_t> term_entries[kChainClasses];
  for (auto& v : term_entries) v.assign(size_t(C) * N, 0);
  plan.chain.assign(size_t(T), 0);
  pool.parallel_for(C, [&](int64_t cb, int64_t ce, int) {
    std::vector<uint8_t> seen(static_cast<size_t>(N));
    std::vector<int> nodes;
    for (int64_t c = cb; c < ce; ++c) {
      int64_t* ec = &expert_count[size_t(c) * E];
      int64_t* nt = &node_tokens[size_t(c) * N];
      int64_t* ne = &node_entries[size_t(c) * N];
      for (int64_t t = plan.channel_begin[size_t(c)]; t < plan.channel_begin[size_t(c) + 1]; ++t) {
        std::fill(seen.begin(), seen.end(), 0);
        const int64_t b = routes.begin[size_t(t)], k = routes.begin[size_t(t) + 1] - b;
        const uint32_t classes =
            N > 1 ? chain_classes(topo, &routes.expert[size_t(b)], k, topo.node, &nodes) : 0;
        plan.chain[size_t(t)] = uint8_t(classes);
        for (int64_t i = b; i < b + k; ++i) {
          const int e = routes.expert[size_t(i)];
          const int m = topo.node_of_expert(e);
          ++ec[e];
          ++ne[m];
          for (int cls = 0; cls < kChainClasses; ++cls) {
            if (!(classes >> cls & 1)) ++term_entries[cls][size_t(c) * N + m];
          }
          if (!seen[size_t(m)]) {
            seen[size_t(m)] = 1;
            ++nt[m];
          }
        }
      }
    }
  });
  plan.expert_prefix.assign(size_t(C) * E, 0);
  for (int c = 1; c < C; ++c) {
    for (int e = 0; e < E; ++e) {
      plan.expert_prefix[size_t(c) * E + e] =
          plan.expert_prefix[size_t(c - 1) * E + e] + expert_count[size_t(c - 1) * E + e];
    }
  }
  plan.node_tokens = channel_prefix(node_tokens, C, N);
  plan.node_entries = channel_prefix(node_entries, C, N);
  for (int cls = 0; cls < kChainClasses; ++cls)
    plan.term_entries[cls] = channel_prefix(term_entries[cls], C, N);
  return plan;
}

}  // namespace

std::shared_ptr<FlexHandle> notify_local(World& world, const DispatchConfig& config,
                                         PreparedInput input, uint64_t dispatcher_id,
                                         std::vector<int64_t>* row) {
  const Topology topo = Topology::of(world, config);
  const int E = topo.num_experts, N = topo.num_nodes;
  auto h = std::make_shared<FlexHandle>();
  h->dispatcher_id = dispatcher_id;
  h->topo = topo;
  h->routing = std::move(input.effective);
  const int C = config.num_channels > 0 ? config.num_channels : world.pool().num_threads();
  h->send = make_send_plan(topo, h->routing, C, world.pool());

  // This rank's row of the exchange: [T, C_s, counts[E], tokens_per_node[N]], the counts from
  // routing's dispatch layout (DeepEP's get_dispatch_layout) of the effective routing.
  const DispatchLayout layout =
      count_dispatch_layout(h->routing, topo.num_ranks, topo.ranks_per_node, topo.etp_size);
  row->assign(notify_row_width(topo), 0);
  (*row)[0] = input.num_tokens;
  (*row)[1] = input.capacity;
  std::copy(layout.num_tokens_per_expert.begin(), layout.num_tokens_per_expert.end(),
            row->begin() + 2);
  std::copy(layout.num_tokens_per_node.begin(), layout.num_tokens_per_node.end(),
            row->begin() + 2 + E);
  // The send plan's channel prefixes must end where the layout's totals are.
  for (int m = 0; m < N; ++m) {
    MOED_CHECK(h->send.node_tokens[size_t(C) * N + m] == layout.num_tokens_per_node[size_t(m)],
               "node ", m, ": send plan ", h->send.node_tokens[size_t(C) * N + m], " != layout ",
               layout.num_tokens_per_node[size_t(m)]);
  }

  h->kind = DispatcherKind::kFlex;
  h->hidden = input.hidden;
  h->dtype = input.dtype;
  h->num_topk = input.num_topk;
  return h;
}

Status notify_finish(const DispatchConfig& config, FlexHandle& h, std::span<const int64_t> table,
                     size_t stride, size_t offset) {
  const Topology& topo = h.topo;
  const int R = topo.num_ranks, E = topo.num_experts, N = topo.num_nodes;
  const int L = topo.num_local_experts, P = topo.etp_size;
  // Rank s's row is [T, C_s, counts[E], tokens_per_node[N]].
  const auto row = [&](int s) { return &table[size_t(s) * stride + offset]; };
  const CountsView counts{row(0) + 2, stride, row(0) + 1, stride};
  Notified& n = h.notified;
  n.rank_rows.assign(size_t(R), 0);
  n.send_chunk.assign(size_t(E), 0);
  n.node_experts = E / N;  // an expert's ranks sit in one node, so a node's experts are a range
  n.first_node_expert = topo.node * n.node_experts;
  n.forward_chunk.assign(size_t(N) * size_t(n.node_experts), 0);
  n.forward_tokens.assign(size_t(N), 0);
  n.forward_entries.assign(size_t(N), 0);
  for (int m = 0; m < N; ++m) {
    if (m == topo.node) continue;
    const int64_t* src = row(topo.forwarder_on(m));
    n.forward_tokens[size_t(m)] = src[2 + E + topo.node];
    for (int x = 0; x < n.node_experts; ++x) {
      n.forward_entries[size_t(m)] += src[2 + n.first_node_expert + x];
    }
  }
  // Every ep's layout in turn, each kept only as long as it takes to read this rank's rows out.
  for (int ep = 0; ep < R / P; ++ep) {
    ExpertLayout l = compute_expert_layout(config, R, ep * P, counts);
    for (int p = 0; p < P; ++p) n.rank_rows[size_t(ep * P + p)] = l.num_rows;
    for (int j = 0; j < L; ++j) n.send_chunk[size_t(ep * L + j)] = l.offset(j, topo.rank);
    if (topo.node_of_rank(ep * P) == topo.node) {
      for (int m = 0; m < N; ++m) {
        if (m == topo.node) continue;
        for (int j = 0; j < L; ++j) {
          const int x = ep * L + j - n.first_node_expert;
          n.forward_chunk[size_t(m) * size_t(n.node_experts) + size_t(x)] =
              l.offset(j, topo.forwarder_on(m));
        }
      }
    }
    if (ep == topo.rank / P) n.mine = std::move(l);
  }

  // Every rank sees the same table, so this error is the same on every rank.
  if (config.num_worst_tokens > 0) {
    for (int r = 0; r < R; ++r) {
      if (n.rank_rows[size_t(r)] > config.num_worst_tokens) {
        return invalid_argument("num_worst_tokens = ", config.num_worst_tokens,
                                " is smaller than the ", n.rank_rows[size_t(r)], " rows rank ", r,
                                " receives");
      }
    }
  }

  h.exact_rows = n.mine.num_rows;
  h.worst_rows = config.num_worst_tokens > 0 ? config.num_worst_tokens : n.mine.num_rows;
  h.num_rows = h.worst_rows;
  h.tokens_per_expert = n.mine.tokens_per_expert;
  h.tokens_per_expert_unpadded = n.mine.tokens_per_expert_unpadded;
  return ok_status();
}

StatusOr<std::shared_ptr<FlexHandle>> notify(World& world, const DispatchConfig& config,
                                             PreparedInput input, uint64_t dispatcher_id) {
  std::vector<int64_t> mine;
  std::shared_ptr<FlexHandle> h =
      notify_local(world, config, std::move(input), dispatcher_id, &mine);
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> all,
                        all_gather<int64_t>(world, std::span<const int64_t>(mine)));
  MOED_RETURN_IF_ERROR(notify_finish(config, *h, all, mine.size(), 0));
  return h;
}

}  // namespace moed::flex
