// The plan model (moed/plan.h): per-rank counts from the routing, then bytes per link and time
// for each algorithm. Formulas: docs/planner.md, "The model".
#include <algorithm>
#include <numeric>

#include "moed/plan.h"

namespace moed {

int64_t LinkCost::max_nvl() const { return *std::max_element(nvl_bytes.begin(), nvl_bytes.end()); }
int64_t LinkCost::max_net() const { return *std::max_element(net_bytes.begin(), net_bytes.end()); }

PublishedBytes PlanResult::published_for(const std::string& algorithm) const {
  return algorithm == "low-latency" || algorithm == "pplx" ? published_selections
                                                           : published_tokens;
}

const AlgorithmCost& PlanResult::algorithm(const std::string& name) const {
  for (const AlgorithmCost& a : algorithms) {
    if (a.name == name) return a;
  }
  return algorithms.front();
}

namespace {

bool known_algorithm(const std::string& name) {
  for (const char* a : kPlanAlgorithms) {
    if (name == a) return true;
  }
  return false;
}

Status check(PlanOptions& o) {
  if (o.algorithm.empty()) o.algorithm = o.low_latency ? "low-latency" : "flex";
  if (!known_algorithm(o.algorithm)) {
    return invalid_argument("--algorithm '", o.algorithm,
                            "' is not one of flat, alltoall, flex, low-latency, pplx");
  }
  if (o.routing == PlanRouting::kTrace) {
    if (o.trace == nullptr) return invalid_argument("--routing trace needs --trace");
    if (o.trace->num_tokens % o.ep != 0) {
      return invalid_argument(o.trace->name, ": ", o.trace->num_tokens,
                              " tokens do not split evenly over --ep = ", o.ep);
    }
    o.tokens = o.trace->num_tokens / o.ep;
    o.topk = o.trace->num_topk;
    if (o.experts == 0) o.experts = o.trace->max_index() + 1;
  }
  if (o.ep < 1 || o.ep > 2048) return invalid_argument("--ep = ", o.ep, " is outside [1, 2048]");
  if (o.ranks_per_node < 1 || o.ep % o.ranks_per_node != 0) {
    return invalid_argument("--ranks-per-node = ", o.ranks_per_node,
                            " does not divide --ep = ", o.ep);
  }
  if (o.tokens < 0) return invalid_argument("--tokens = ", o.tokens, " must be >= 0");
  if (o.hidden < 1) return invalid_argument("--hidden = ", o.hidden, " must be >= 1");
  if (o.fp8_dispatch && o.hidden % 128 != 0) {
    return invalid_argument("--hidden = ", o.hidden,
                            " is not a multiple of 128, which fp8 dispatch needs (one scale per "
                            "128 values); use --dispatch-dtype bf16");
  }
  if (o.experts < 1 || o.experts % o.ep != 0) {
    return invalid_argument("--experts = ", o.experts,
                            " is not a positive multiple of --ep = ", o.ep);
  }
  if (o.topk < 1 || o.topk > o.experts) {
    return invalid_argument("--topk = ", o.topk, " is outside [1, --experts = ", o.experts, "]");
  }
  if (o.routing == PlanRouting::kZipf && !(o.zipf_s >= 0.0 && o.zipf_s <= 8.0)) {
    return invalid_argument("--zipf-s = ", o.zipf_s, " is outside [0, 8]");
  }
  if (o.routing == PlanRouting::kGroup) {
    if (o.num_groups == 0) o.num_groups = o.ep / o.ranks_per_node;
    if (o.group_topk == 0) o.group_topk = std::min(o.num_groups, 4);
    if (o.num_groups < 1 || o.experts % o.num_groups != 0) {
      return invalid_argument("--groups = ", o.num_groups,
                              " does not divide --experts = ", o.experts);
    }
    if (o.group_topk < 1 || o.group_topk > o.num_groups) {
      return invalid_argument("--group-topk = ", o.group_topk,
                              " is outside [1, --groups = ", o.num_groups, "]");
    }
    if (int64_t(o.group_topk) * (o.experts / o.num_groups) < o.topk) {
      return invalid_argument("--group-topk = ", o.group_topk, " groups of ",
                              o.experts / o.num_groups,
                              " experts hold fewer than --topk = ", o.topk);
    }
  }
  const Cluster& c = o.cluster;
  if (!(c.nvl_gbps > 0) || !(c.net_gbps > 0) || !(c.hbm_gbps > 0)) {
    return invalid_argument("cluster '", c.name, "': bandwidths must be > 0 (nvl ", c.nvl_gbps,
                            ", net ", c.net_gbps, ", hbm ", c.hbm_gbps, ")");
  }
  if (c.fixed_us < 0 || c.nvl_latency_us < 0 || c.net_latency_us < 0 || c.proxy_message_us < 0) {
    return invalid_argument("cluster '", c.name, "': latencies must be >= 0");
  }
  return ok_status();
}

// Per-rank send / receive counters of one link view, in bytes.
struct Dir {
  std::vector<int64_t> nvl_send, nvl_recv, net_send, net_recv, hbm, msgs;
  explicit Dir(int R)
      : nvl_send(static_cast<size_t>(R)),
        nvl_recv(static_cast<size_t>(R)),
        net_send(static_cast<size_t>(R)),
        net_recv(static_cast<size_t>(R)),
        hbm(static_cast<size_t>(R)),
        msgs(static_cast<size_t>(R)) {}
};

// How one algorithm's bytes turn into time (beyond the cluster's links).
struct Costs {
  double message_us = 0.0;  // one network message, where a CPU proxy posts it (0 otherwise)
  double fixed_us = 0.0;    // per call
  double sm_gbps = 0.0;     // SMs x the per-SM copy rate (0: not SM-limited)
};

LinkCost finish(const Dir& d, const Cluster& c, int hops_nvl, int hops_net, const Costs& k) {
  LinkCost l;
  const size_t R = d.nvl_send.size();
  l.nvl_bytes.resize(R);
  l.net_bytes.resize(R);
  l.hbm_bytes = d.hbm;
  l.net_messages = d.msgs;
  double worst = 0.0;
  for (size_t r = 0; r < R; ++r) {
    l.nvl_bytes[r] = std::max(d.nvl_send[r], d.nvl_recv[r]);
    l.net_bytes[r] = std::max(d.net_send[r], d.net_recv[r]);
    // NVLink and RDMA run at once (DeepEP pipelines them); local passes come on top. A CPU
    // proxy pays each message on top of its bytes (LogGP's per-message gap): the posting thread
    // is busy for it whatever the size.
    // The intra-node copies are SM work: with too few SMs they, not the link, set the pace.
    const double nvl_gbps = k.sm_gbps > 0 ? std::min(c.nvl_gbps, k.sm_gbps) : c.nvl_gbps;
    const double link = std::max(
        double(l.nvl_bytes[r]) / (nvl_gbps * 1e9),
        double(l.net_bytes[r]) / (c.net_gbps * 1e9) + 1e-6 * k.message_us * double(d.msgs[r]));
    worst = std::max(worst, link + double(d.hbm[r]) / (c.hbm_gbps * 1e9));
  }
  l.seconds =
      worst + 1e-6 * (k.fixed_us + hops_nvl * c.nvl_latency_us + hops_net * c.net_latency_us);
  return l;
}

// `messages`: network messages the sender posts for these bytes.
void add(Dir& d, bool same_node, int from, int to, int64_t bytes, int64_t messages = 0) {
  if (bytes == 0) return;
  (same_node ? d.nvl_send : d.net_send)[size_t(from)] += bytes;
  (same_node ? d.nvl_recv : d.net_recv)[size_t(to)] += bytes;
  if (!same_node) d.msgs[size_t(from)] += messages;
}

// Row bytes as moed and DeepEP lay them out, and the units of the published numerators.
struct RowBytes {
  int64_t d = 0, c = 0;    // a dispatched row (fp8: H bytes + one fp32 scale per 128), combined
  int64_t ll_d = 0;        // DeepEP low-latency: + source info per message
  int64_t flex_total = 0;  // moed Flex: + prob, source, slot
  int64_t sel_unit_d = 0;  // published bytes of one selection (dispatch)
  int64_t tok_unit_d = 0;  // published bytes of one token (dispatch)
  int64_t unit_c = 0;      // published bytes of one selection or token (combine)
};

RowBytes row_bytes(const PlanOptions& o) {
  const int64_t H = o.hidden;
  RowBytes b;
  const int64_t scale = o.fp8_dispatch ? H / 128 * 4 : 0;
  b.d = (o.fp8_dispatch ? H : 2 * H) + scale;
  b.c = 2 * H;
  b.ll_d = b.d + 16;
  b.flex_total = b.d + kFlexRowMetaBytes;
  // The published numerator: what is counted, and the bytes of one (moed/plan.h Convention).
  // DeepEP's low-latency test counts fp8 rows with their 16-byte message header.
  b.sel_unit_d = o.fp8_dispatch ? b.ll_d : b.d;
  b.tok_unit_d = b.d;
  b.unit_c = b.c;
  if (o.convention == Convention::kDeepEPv2) {
    b.sel_unit_d = b.tok_unit_d = b.d + 12 * o.topk;  // + int64 index and fp32 weight per slot
    b.unit_c = b.c + 4 * o.topk;                      // + fp32 weight per slot
  } else if (o.convention == Convention::kPayload) {
    b.sel_unit_d = b.tok_unit_d = o.fp8_dispatch ? H : 2 * H;
  }
  return b;
}

// The link views each algorithm is charged on, dispatch and combine.
struct Views {
  Dir flat_d, flat_c, a2a_d, a2a_c, flex_d, flex_c, ll_d, ll_c, pp_d, pp_c;
  explicit Views(int R)
      : flat_d(R),
        flat_c(R),
        a2a_d(R),
        a2a_c(R),
        flex_d(R),
        flex_c(R),
        ll_d(R),
        ll_c(R),
        pp_d(R),
        pp_c(R) {}
};

// One source rank's routing, counted per destination rank and per node.
struct SourceCounts {
  std::vector<int64_t> pairs, toks;         // [R] (token, expert) pairs; tokens
  std::vector<int64_t> tok_node, ent_node;  // [N] tokens; (token, expert) entries
  int64_t selections = 0;
};

// moed Flex's combine across nodes (design.md §5.6), on the network, for one token of source s
// whose experts are on `nodes`: per-expert terms from each remote node's forwarder, or, where
// fewer bytes, the chain over the token's nodes ascending (an fp32 row per hop between them,
// then the rounded row home), each hop sent by the rank of its node on the home's rail.
void charge_flex_combine(std::vector<int>& nodes, const int32_t* topk, int K,
                         const std::vector<int32_t>& node_of, int G, int s, int64_t H,
                         int64_t row_c, std::vector<int64_t>& net) {
  const int ns = s / G, ls = s % G;
  std::sort(nodes.begin(), nodes.end());
  const int64_t remote = std::count_if(nodes.begin(), nodes.end(), [&](int n) { return n != ns; });
  nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  const int64_t inner = int64_t(nodes.size()) - 1, home_hop = nodes.back() != ns ? 1 : 0;
  if (4 * H * inner + row_c * home_hop < row_c * remote) {
    for (size_t i = 0; i + 1 < nodes.size(); ++i) net[size_t(nodes[i] * G + ls)] += 4 * H;
    if (home_hop) net[size_t(nodes.back() * G + ls)] += row_c;
    return;
  }
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i] == ns) continue;
    // the entries of the token on that node: one term each
    for (int k = 0; k < K; ++k) {
      const int32_t e = topk[k];
      if (e >= 0 && node_of[size_t(e)] == nodes[i]) net[size_t(nodes[i] * G + ls)] += row_c;
    }
  }
}

// Counts source s's routing (and charges Flex's cross-node combine, which depends on each
// token's nodes).
Status count_source(const PlanOptions& o, int s, const RowBytes& rb, SourceCounts& n,
                    MoedCounters& m) {
  const int R = o.ep, G = o.ranks_per_node, N = R / G, E = o.experts, K = o.topk, L = E / R;
  const int64_t T = o.tokens;
  MOED_ASSIGN_OR_RETURN(std::vector<int32_t> idx, plan_routing(o, s));
  MOED_RETURN_IF_ERROR(validate(TopkView{idx.data(), false, nullptr, T, K}, E)
                           .with_context("source " + std::to_string(s) + " (--experts = " +
                                         std::to_string(E) + ")"));
  n.pairs.assign(size_t(R), 0);
  n.toks.assign(size_t(R), 0);
  n.tok_node.assign(size_t(N), 0);
  n.ent_node.assign(size_t(N), 0);
  n.selections = 0;
  std::vector<int64_t> rank_stamp(size_t(R), -1), node_stamp(size_t(N), -1);
  std::vector<int> nodes;
  // An expert's rank and node looked up: a division per entry was most of this loop's time.
  std::vector<int32_t> rank_of(static_cast<size_t>(E)), node_of(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) rank_of[size_t(e)] = e / L, node_of[size_t(e)] = e / L / G;
  for (int64_t t = 0; t < T; ++t) {
    nodes.clear();
    for (int k = 0; k < K; ++k) {
      const int32_t e = idx[size_t(t * K + k)];
      if (e < 0) continue;
      const int d = rank_of[size_t(e)], nd = node_of[size_t(e)];
      ++n.selections;
      ++n.pairs[size_t(d)];
      ++n.ent_node[size_t(nd)];
      if (rank_stamp[size_t(d)] != t) rank_stamp[size_t(d)] = t, ++n.toks[size_t(d)];
      if (node_stamp[size_t(nd)] != t) node_stamp[size_t(nd)] = t, ++n.tok_node[size_t(nd)];
      nodes.push_back(nd);
    }
    if (N == 1 || nodes.empty()) continue;
    charge_flex_combine(nodes, &idx[size_t(t * K)], K, node_of, G, s, o.hidden, rb.c,
                        m.flex_combine.network);
  }
  return ok_status();
}

// Charges source s's rows to every algorithm's links and to moed's counters.
void charge_source(const PlanOptions& o, int s, const RowBytes& rb, const SourceCounts& n, Views& v,
                   MoedCounters& m, std::vector<int64_t>& recv_pairs) {
  const int R = o.ep, G = o.ranks_per_node, N = R / G;
  const int ns = s / G, ls = s % G;
  const std::vector<int64_t>&pairs = n.pairs, &toks = n.toks;
  for (int d = 0; d < R; ++d) {
    const bool same = d / G == ns;
    // flat: one row per (token, rank), straight to the rank (own rows included), a message
    // each across nodes.
    add(v.flat_d, same, s, d, toks[size_t(d)] * rb.d, toks[size_t(d)]);
    add(v.flat_c, same, d, s, toks[size_t(d)] * rb.c, toks[size_t(d)]);
    // alltoall: one row per (token, expert), NCCL copies the rank's own rows locally; one
    // message per peer.
    if (d != s) {
      add(v.a2a_d, same, s, d, pairs[size_t(d)] * rb.d, 1);
      add(v.a2a_c, same, d, s, pairs[size_t(d)] * rb.c, 1);
    }
    // low-latency: one message per (token, expert) into the expert's slots.
    add(v.ll_d, same, s, d, pairs[size_t(d)] * rb.ll_d, pairs[size_t(d)]);
    add(v.ll_c, same, d, s, pairs[size_t(d)] * rb.c, pairs[size_t(d)]);
    // pplx: the same rows (no per-message header), one write per peer.
    add(v.pp_d, same, s, d, pairs[size_t(d)] * rb.d, 1);
    add(v.pp_c, same, d, s, pairs[size_t(d)] * rb.c, 1);
    // flex (DeepEP's two hops): rows for another node go via the rank there with s's local
    // index, which writes one row per destination rank of its node.
    const int via = same ? s : (d / G) * G + ls;
    add(v.flex_d, true, via, d, toks[size_t(d)] * rb.d);
    add(v.flex_c, true, d, via, toks[size_t(d)] * rb.c);
    recv_pairs[size_t(d)] += pairs[size_t(d)];
    // moed's counters: AlltoAll's exchanges (rows, probs, source indices; count_send skips
    // the rank itself), counted by the sender.
    if (d != s) {
      CounterBytes& ad = m.alltoall_dispatch;
      (same ? ad.shared : ad.network)[size_t(s)] += pairs[size_t(d)] * (rb.d + 8);
      CounterBytes& ac = m.alltoall_combine;
      (same ? ac.shared : ac.network)[size_t(d)] += pairs[size_t(d)] * rb.c;
    }
    // moed's low-latency buffer: a copy into the slots of every rank of the node (its own
    // included) per pair; across nodes one message per rank in the wire layout, a header and
    // a row per token, an entry per pair. Combine returns one bf16 row per pair, counted on the
    // expert side.
    CounterBytes& ld = m.low_latency_dispatch;
    if (same) {
      ld.shared[size_t(s)] += pairs[size_t(d)] * rb.d;
    } else {
      ld.network[size_t(s)] +=
          toks[size_t(d)] * (rb.d + kFlexTokenHeaderBytes) + pairs[size_t(d)] * kFlexEntryBytes;
    }
    CounterBytes& lc = m.low_latency_combine;
    (same ? lc.shared : lc.network)[size_t(d)] += pairs[size_t(d)] * rb.c;
  }
  for (int nd = 0; nd < N; ++nd) {
    if (nd == ns) continue;
    const int f = nd * G + ls;
    // moed wire format: kFlexTokenHeaderBytes per token, kFlexEntryBytes per expert entry.
    const int64_t msg = n.tok_node[size_t(nd)] * (rb.d + kFlexTokenHeaderBytes) +
                        n.ent_node[size_t(nd)] * kFlexEntryBytes;
    add(v.flex_d, false, s, f, msg);
    add(v.flex_c, false, f, s, n.tok_node[size_t(nd)] * rb.c);
    // moed Flex: the message to the forwarder, which writes one row per expert entry;
    // combine reads one term per entry there (its network bytes are charged per token above).
    m.flex_dispatch.network[size_t(s)] += msg;
    m.flex_dispatch.shared[size_t(f)] += n.ent_node[size_t(nd)] * rb.flex_total;
    m.flex_combine.shared[size_t(f)] += n.ent_node[size_t(nd)] * rb.c;
  }
  m.flex_dispatch.shared[size_t(s)] += n.ent_node[size_t(ns)] * rb.flex_total;
  m.flex_combine.shared[size_t(s)] += n.ent_node[size_t(ns)] * rb.c;
  // AlltoAll's copy passes: permute and sort (dispatch), unsort and unpermute (combine),
  // each reading and writing every (token, expert) row once.
  const int64_t mine = std::accumulate(pairs.begin(), pairs.end(), int64_t(0));
  v.a2a_d.hbm[size_t(s)] += 2 * mine * rb.d;
  v.a2a_c.hbm[size_t(s)] += 2 * mine * rb.c;
}

// Every algorithm's time from its link views.
std::vector<AlgorithmCost> algorithm_costs(const PlanOptions& o, const Views& v) {
  const Cluster& c = o.cluster;
  const int multi = o.ep / o.ranks_per_node > 1 ? 1 : 0;
  const double msg = o.cpu_proxy ? c.proxy_message_us : 0.0;
  // NOTE: low-latency kernels signal once per call (the counts travel after the rows, no count
  // exchange first), so their floor is half of Cluster::fixed_us, which comes from pplx's
  // two-round (counts, then rows) 1-token call.
  const double sm_d = o.sms * o.sm_dispatch_gbps, sm_c = o.sms * o.sm_combine_gbps;
  const Costs two{msg, c.fixed_us, sm_d}, two_c{msg, c.fixed_us, sm_c};
  const Costs one{msg, c.fixed_us / 2, sm_d}, one_c{msg, c.fixed_us / 2, sm_c};
  // NOTE: flex sends a remote node's tokens in chunks (DeepEP's num_max_rdma_chunked_send_tokens
  // per RDMA write, 100 KB and more), so its messages are not counted: at 0.4 us each they are
  // under 1% of the bytes' time.
  const Costs two_hops{0.0, c.fixed_us, sm_d}, two_hops_c{0.0, c.fixed_us, sm_c};
  return {
      // flat writes each row straight into its receiver's slots (claimed there, counts after
      // the rows), one round like low-latency.
      {"flat", finish(v.flat_d, c, 1 - multi, multi, one),
       finish(v.flat_c, c, 1 - multi, multi, one_c)},
      {"alltoall", finish(v.a2a_d, c, 1 - multi, multi, two),
       finish(v.a2a_c, c, 1 - multi, multi, two_c)},
      {"flex", finish(v.flex_d, c, 1, multi, two_hops), finish(v.flex_c, c, 1, multi, two_hops_c)},
      {"low-latency", finish(v.ll_d, c, 1 - multi, multi, one),
       finish(v.ll_c, c, 1 - multi, multi, one_c)},
      // pplx exchanges the per-expert counts before the rows: two network round trips.
      {"pplx", finish(v.pp_d, c, 1 - multi, 2 * multi, two),
       finish(v.pp_c, c, 1 - multi, multi, two_c)},
  };
}

}  // namespace

StatusOr<PlanResult> plan(const PlanOptions& options) {
  PlanOptions o = options;
  MOED_RETURN_IF_ERROR(check(o));
  const int R = o.ep, G = o.ranks_per_node, N = R / G;
  const RowBytes rb = row_bytes(o);

  PlanResult r;
  r.num_nodes = N;
  r.dispatch_row_bytes = rb.d;
  r.combine_row_bytes = rb.c;
  const bool per_selection = o.algorithm == "low-latency" || o.algorithm == "pplx";
  Views views(R);
  MoedCounters& m = r.moed;
  for (CounterBytes* cb : {&m.alltoall_dispatch, &m.alltoall_combine, &m.flex_dispatch,
                           &m.flex_combine, &m.low_latency_dispatch, &m.low_latency_combine}) {
    cb->shared.assign(size_t(R), 0);
    cb->network.assign(size_t(R), 0);
  }
  std::vector<int64_t> recv_pairs(size_t(R), 0);
  int64_t sel_d = 0, sel_c = 0, tok_d = 0, tok_c = 0;
  SourceCounts n;
  for (int s = 0; s < R; ++s) {
    MOED_RETURN_IF_ERROR(count_source(o, s, rb, n, m));
    // The source's bandwidth numerators (moed/plan.h PublishedBytes): per selection for
    // low-latency and pplx, else tokens received on one node and (token, node) pairs across.
    sel_d += n.selections * rb.sel_unit_d;
    sel_c += n.selections * rb.unit_c;
    const int64_t counted = N == 1
                                ? std::accumulate(n.toks.begin(), n.toks.end(), int64_t(0))
                                : std::accumulate(n.tok_node.begin(), n.tok_node.end(), int64_t(0));
    tok_d += counted * rb.tok_unit_d;
    tok_c += counted * rb.unit_c;
    charge_source(o, s, rb, n, views, m, recv_pairs);
  }
  for (int d = 0; d < R; ++d) {
    views.a2a_d.hbm[size_t(d)] += 2 * recv_pairs[size_t(d)] * rb.d;
    views.a2a_c.hbm[size_t(d)] += 2 * recv_pairs[size_t(d)] * rb.c;
  }

  r.algorithms = algorithm_costs(o, views);
  r.reported = o.algorithm;
  const AlgorithmCost& chosen = r.algorithm(o.algorithm);
  r.dispatch_seconds = chosen.dispatch.seconds;
  r.combine_seconds = chosen.combine.seconds;
  r.published_selections = {sel_d / R, sel_c / R, "RDMA"};
  r.published_tokens = {tok_d / R, tok_c / R, N > 1 ? "RDMA" : "NVL"};
  r.published = per_selection ? r.published_selections : r.published_tokens;
  auto gbps = [](int64_t b, double sec) { return sec > 0 ? double(b) / sec / 1e9 : 0.0; };
  r.dispatch_gbps = gbps(r.published.dispatch, r.dispatch_seconds);
  r.combine_gbps = gbps(r.published.combine, r.combine_seconds);
  r.options = o;
  return r;
}

}  // namespace moed
