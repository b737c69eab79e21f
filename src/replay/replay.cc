// Replay counting (moed/replay.h): the trace file, its checks, and the per-step counts. The
// per-source-rank counts come from moed::get_dispatch_layout (Flex's layout phase), so the
// traffic matrix is exactly what the Flex dispatcher would compute; everything else here is
// arithmetic on those counts.
#include "moed/replay.h"

#include <algorithm>
#include <numeric>

#include "moed/dispatch_layout.h"
#include "moed/npy.h"

namespace moed {

int32_t RoutingTrace::max_index() const {
  int32_t m = -1;
  for (int32_t v : topk_idx) m = std::max(m, v);
  return m;
}

StatusOr<RoutingTrace> read_routing_trace(const std::string& path) {
  MOED_ASSIGN_OR_RETURN(NpyArray a, read_npy(path));
  if (a.dtype != NpyDType::kI32 && a.dtype != NpyDType::kI64) {
    return invalid_argument(path, ": dtype '", npy_descr(a.dtype),
                            "'; a trace holds int32 or int64 expert indices");
  }
  if (a.shape.size() != 2 && a.shape.size() != 3) {
    return invalid_argument(path, ": shape ", a.shape_string(),
                            "; a trace is [tokens, topk] or [steps, tokens, topk]");
  }
  RoutingTrace trace;
  trace.name = path;
  const size_t n = a.shape.size();
  trace.num_steps = n == 3 ? a.shape[0] : 1;
  trace.num_tokens = a.shape[n - 2];
  if (a.shape[n - 1] < 1 || a.shape[n - 1] > (int64_t(1) << 20)) {
    return invalid_argument(path, ": shape ", a.shape_string(), " has top-k = ", a.shape[n - 1],
                            "; it must be at least 1");
  }
  trace.num_topk = int(a.shape[n - 1]);
  MOED_ASSIGN_OR_RETURN(trace.topk_idx, npy_to_i32(a));
  for (size_t i = 0; i < trace.topk_idx.size(); ++i) {
    if (trace.topk_idx[i] < -1) {
      const size_t K = size_t(trace.num_topk), T = size_t(trace.num_tokens);
      return invalid_argument(path, ": topk_idx[", i / (K * T), "][", i / K % T, "][", i % K,
                              "] = ", trace.topk_idx[i], " is below -1");
    }
  }
  return trace;
}

int64_t SchemeCost::total_shared_bytes() const {
  return std::accumulate(shared_bytes.begin(), shared_bytes.end(), int64_t(0));
}
int64_t SchemeCost::total_network_bytes() const {
  return std::accumulate(network_bytes.begin(), network_bytes.end(), int64_t(0));
}

namespace {

Status check_options(const RoutingTrace& trace, const ReplayOptions& o, int num_experts) {
  const std::string& f = trace.name;
  if (o.num_ranks < 1) return invalid_argument("--ranks = ", o.num_ranks, " must be >= 1");
  const int R = o.num_ranks, G = o.ranks_per_node == 0 ? R : o.ranks_per_node;
  if (G < 1 || R % G != 0) {
    return invalid_argument("--ranks-per-node = ", G, " does not divide --ranks = ", R);
  }
  if (num_experts < 1) {
    return invalid_argument(f, ": the trace routes no token (every index is -1); give --experts");
  }
  if (num_experts % R != 0) {
    return invalid_argument("experts = ", num_experts,
                            o.num_experts == 0 ? " (the trace's max index + 1)" : "",
                            " is not a multiple of --ranks = ", R);
  }
  if (trace.num_tokens % R != 0) {
    return invalid_argument(f, ": ", trace.num_tokens, " tokens per step do not split evenly over ",
                            "--ranks = ", R);
  }
  if (o.drop_policy == DropPolicy::kProbs && o.capacity_factor.has_value()) {
    return invalid_argument("--drop-policy probs: a trace has no probs; use position");
  }
  if (o.capacity_factor.has_value()) {
    LayoutOptions layout;
    layout.capacity_factor = o.capacity_factor;
    MOED_RETURN_IF_ERROR(layout.validate());
  }
  if (o.hidden < 1) return invalid_argument("--hidden = ", o.hidden, " must be >= 1");
  if (o.dtype_bytes < 1)
    return invalid_argument("--dtype-bytes = ", o.dtype_bytes, " must be >= 1");
  if (!(o.shared_gbps > 0.0))
    return invalid_argument("--shared-gbps = ", o.shared_gbps, " must be > 0");
  if (!(o.network_gbps > 0.0)) {
    return invalid_argument("--network-gbps = ", o.network_gbps, " must be > 0");
  }
  // Each step's routing checked as every dispatch checks it, once for the whole trace.
  for (int64_t st = 0; st < trace.num_steps; ++st) {
    const TopkView step{trace.topk_idx.data() + size_t(st) * size_t(trace.num_tokens) *
                                                    size_t(trace.num_topk),
                        false, nullptr, trace.num_tokens, trace.num_topk};
    const Status s = validate(step, num_experts);
    if (!s.ok()) return s.with_context(f + ": step " + std::to_string(st));
  }
  return ok_status();
}

// Per-step bytes of each rank for both schemes (the model in moed/replay.h).
struct StepBytes {
  std::vector<int64_t> flat_shared, flat_network, flex_shared, flex_network;
  explicit StepBytes(int R)
      : flat_shared(size_t(R)),
        flat_network(size_t(R)),
        flex_shared(size_t(R)),
        flex_network(size_t(R)) {}
};

double step_seconds(const std::vector<int64_t>& shared, const std::vector<int64_t>& network,
                    double shared_gbps, double network_gbps) {
  double worst = 0.0;
  for (size_t r = 0; r < shared.size(); ++r) {
    worst = std::max(
        worst, double(shared[r]) / (shared_gbps * 1e9) + double(network[r]) / (network_gbps * 1e9));
  }
  return worst;
}

void add_into(std::vector<int64_t>& acc, const std::vector<int64_t>& v) {
  for (size_t i = 0; i < v.size(); ++i) acc[i] += v[i];
}

}  // namespace

double imbalance(const std::vector<int64_t>& v) {
  const int64_t sum = std::accumulate(v.begin(), v.end(), int64_t(0));
  if (sum == 0 || v.empty()) return 0.0;
  const double mean = double(sum) / double(v.size());
  return double(*std::max_element(v.begin(), v.end())) / mean;
}

StatusOr<ReplayResult> replay_trace(const RoutingTrace& trace, const ReplayOptions& o) {
  const int E = o.num_experts > 0 ? o.num_experts : trace.max_index() + 1;
  MOED_RETURN_IF_ERROR(check_options(trace, o, E));
  const int R = o.num_ranks, G = o.ranks_per_node == 0 ? R : o.ranks_per_node, N = R / G;
  const int K = trace.num_topk, L = E / R;
  const int64_t Ts = trace.num_tokens / R;

  ReplayResult r;
  r.trace_name = trace.name;
  r.num_steps = trace.num_steps;
  r.num_tokens = trace.num_tokens;
  r.num_topk = K;
  r.num_experts = E;
  r.num_ranks = R;
  r.ranks_per_node = G;
  r.num_nodes = N;
  r.num_local_experts = L;
  r.hidden = o.hidden;
  r.dtype_bytes = o.dtype_bytes;
  r.capacity_factor = o.capacity_factor;
  r.capacity = o.capacity_factor ? expert_capacity(Ts, K, E, *o.capacity_factor) : 0;
  r.shared_gbps = o.shared_gbps;
  r.network_gbps = o.network_gbps;
  r.routed_per_expert.assign(size_t(E), 0);
  r.tokens_per_expert.assign(size_t(E), 0);
  r.dropped_per_expert.assign(size_t(E), 0);
  r.rows_per_rank.assign(size_t(R), 0);
  r.tokens_per_rank.assign(size_t(R), 0);
  r.traffic.assign(size_t(R) * R, 0);
  for (SchemeCost* c : {&r.flat, &r.flex}) {
    c->shared_bytes.assign(size_t(R), 0);
    c->network_bytes.assign(size_t(R), 0);
  }

  LayoutOptions layout;
  layout.capacity_factor = o.capacity_factor;
  layout.drop_policy = DropPolicy::kPosition;
  const int64_t rb = r.row_bytes();
  TopkRouting topk;
  topk.num_tokens = Ts;
  topk.num_topk = K;
  topk.topk_weights.assign(size_t(Ts) * K, 0.0f);

  for (int64_t st = 0; st < trace.num_steps; ++st) {
    StepBytes b(R);
    for (int s = 0; s < R; ++s) {
      const auto first = trace.topk_idx.begin() + (st * trace.num_tokens + s * Ts) * K;
      topk.topk_idx.assign(first, first + Ts * K);
      RoutingMap map = to_map(topk, E);
      std::vector<int64_t> routed(size_t(E), 0);
      for (int64_t t = 0; t < Ts; ++t) {
        for (int e = 0; e < E; ++e) routed[size_t(e)] += map.routed(t, e);
      }
      if (o.capacity_factor) {
        MOED_ASSIGN_OR_RETURN(map, apply_layout_options(map, K, layout));
      }
      MOED_ASSIGN_OR_RETURN(DispatchLayout l, get_dispatch_layout(map, R, G));

      const int node_s = s / G, local_s = s % G;
      std::vector<int64_t> entries_on_node(size_t(N), 0);
      for (int e = 0; e < E; ++e) {
        const int64_t kept = l.num_tokens_per_expert[size_t(e)];
        r.routed_per_expert[size_t(e)] += routed[size_t(e)];
        r.tokens_per_expert[size_t(e)] += kept;
        r.dropped_per_expert[size_t(e)] += routed[size_t(e)] - kept;
        r.rows_per_rank[size_t(e / L)] += kept;
        entries_on_node[size_t(e / L / G)] += kept;
      }
      for (int d = 0; d < R; ++d) {
        const int64_t rows = l.num_tokens_per_rank[size_t(d)];
        r.traffic[size_t(s) * R + d] += rows;
        r.tokens_per_rank[size_t(d)] += rows;
        if (d / G == node_s) {
          b.flat_shared[size_t(s)] += rows * rb;
          b.flex_shared[size_t(s)] += rows * rb;
        } else {
          b.flat_network[size_t(s)] += rows * rb;
          // NOTE: the forwarder of node(d) for s is the rank there with s's local index; it
          // writes the row into d's output over that node's shared memory.
          b.flex_shared[size_t((d / G) * G + local_s)] += rows * rb;
        }
      }
      for (int m = 0; m < N; ++m) {
        if (m == node_s) continue;
        b.flex_network[size_t(s)] +=
            l.num_tokens_per_node[size_t(m)] * (rb + kFlexTokenHeaderBytes) +
            entries_on_node[size_t(m)] * kFlexEntryBytes;
      }
    }
    const double flat_s =
        step_seconds(b.flat_shared, b.flat_network, o.shared_gbps, o.network_gbps);
    const double flex_s =
        step_seconds(b.flex_shared, b.flex_network, o.shared_gbps, o.network_gbps);
    r.flat.step_seconds.push_back(flat_s);
    r.flex.step_seconds.push_back(flex_s);
    r.flat.seconds += flat_s;
    r.flex.seconds += flex_s;
    add_into(r.flat.shared_bytes, b.flat_shared);
    add_into(r.flat.network_bytes, b.flat_network);
    add_into(r.flex.shared_bytes, b.flex_shared);
    add_into(r.flex.network_bytes, b.flex_network);
  }
  r.dropped = std::accumulate(r.dropped_per_expert.begin(), r.dropped_per_expert.end(), int64_t(0));
  r.expert_imbalance = imbalance(r.tokens_per_expert);
  r.rank_imbalance = imbalance(r.rows_per_rank);
  return r;
}

}  // namespace moed
