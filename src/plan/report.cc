// The plan model's reports: the text table and JSON of `moed plan`, and the validation table
// against published figures (`moed plan --validate`).
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "moed/plan.h"

namespace moed {

std::string plan_table(const PlanResult& r) {
  const PlanOptions& o = r.options;
  const Cluster& c = o.cluster;
  std::string s = fmt::format(
      "moed plan: cluster {} ({})\n  nvl {:.0f} GB/s  net {:.0f} GB/s  hbm {:.0f} GB/s  latency "
      "nvl {:.1f} us, net {:.1f} us  fixed {:.0f} us per call\n",
      c.name, c.description, c.nvl_gbps, c.net_gbps, c.hbm_gbps, c.nvl_latency_us, c.net_latency_us,
      c.fixed_us);
  const char* routing[] = {"uniform", "zipf", "group", "trace"};
  s += fmt::format(
      "  EP={} ({} node{} of {})  T={} per rank  H={}  K={}  E={}  routing {}  dispatch {}, "
      "combine bf16\n\n",
      o.ep, r.num_nodes, r.num_nodes == 1 ? "" : "s", o.ranks_per_node, o.tokens, o.hidden, o.topk,
      o.experts, routing[int(o.routing)], o.fp8_dispatch ? "fp8" : "bf16");
  s += fmt::format("  {:<12} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n", "algorithm", "disp us",
                   "NVL MB", "RDMA MB", "comb us", "NVL MB", "RDMA MB");
  for (const AlgorithmCost& a : r.algorithms) {
    s += fmt::format("  {:<12} {:>11.1f} {:>11.2f} {:>11.2f} {:>11.1f} {:>11.2f} {:>11.2f}\n",
                     a.name, a.dispatch.seconds * 1e6, a.dispatch.max_nvl() / 1e6,
                     a.dispatch.max_net() / 1e6, a.combine.seconds * 1e6, a.combine.max_nvl() / 1e6,
                     a.combine.max_net() / 1e6);
  }
  s += fmt::format(
      "  (MB: the busiest rank's bytes over each link, max of sent and received)\n\n"
      "{} mode: dispatch {:.1f} us, {:.1f} GB/s ({})   combine {:.1f} us, {:.1f} GB/s ({})\n"
      "  (GB/s as DeepEP defines it: {} bytes of one rank / time)\n",
      o.low_latency ? "low-latency" : "normal (flex)", r.dispatch_seconds * 1e6, r.dispatch_gbps,
      r.published.link, r.combine_seconds * 1e6, r.combine_gbps, r.published.link,
      o.low_latency     ? "(token, expert) selections x row"
      : r.num_nodes > 1 ? "(token, node) pairs, own node included, x row"
                        : "tokens received x row");
  return s;
}

std::string plan_json(const PlanResult& r) {
  const PlanOptions& o = r.options;
  nlohmann::json j;
  j["cluster"] = {{"name", o.cluster.name},
                  {"nvl_gbps", o.cluster.nvl_gbps},
                  {"net_gbps", o.cluster.net_gbps},
                  {"hbm_gbps", o.cluster.hbm_gbps},
                  {"nvl_latency_us", o.cluster.nvl_latency_us},
                  {"net_latency_us", o.cluster.net_latency_us},
                  {"fixed_us", o.cluster.fixed_us}};
  j["ep"] = o.ep;
  j["ranks_per_node"] = o.ranks_per_node;
  j["num_nodes"] = r.num_nodes;
  j["tokens"] = o.tokens;
  j["hidden"] = o.hidden;
  j["topk"] = o.topk;
  j["experts"] = o.experts;
  j["mode"] = o.low_latency ? "low-latency" : "normal";
  const char* routing[] = {"uniform", "zipf", "group", "trace"};
  j["routing"] = routing[int(o.routing)];
  j["dispatch_dtype"] = o.fp8_dispatch ? "fp8" : "bf16";
  j["dispatch_seconds"] = r.dispatch_seconds;
  j["combine_seconds"] = r.combine_seconds;
  j["dispatch_gbps"] = r.dispatch_gbps;
  j["combine_gbps"] = r.combine_gbps;
  j["gbps_link"] = r.published.link;
  j["dispatch_bandwidth_bytes"] = r.published.dispatch;
  j["combine_bandwidth_bytes"] = r.published.combine;
  for (const AlgorithmCost& a : r.algorithms) {
    auto one = [](const LinkCost& l) {
      return nlohmann::json{
          {"seconds", l.seconds}, {"max_nvl_bytes", l.max_nvl()}, {"max_net_bytes", l.max_net()}};
    };
    j["algorithms"][a.name] = {{"dispatch", one(a.dispatch)}, {"combine", one(a.combine)}};
  }
  return j.dump(2);
}

std::string validation_table(const std::vector<ValidationRow>& rows, bool markdown) {
  std::string s;
  if (markdown) {
    s += "| source | cluster | mode | EP | phase | published | model | ratio | note |\n";
    s += "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | --- |\n";
  } else {
    s += fmt::format("{:<22} {:<9} {:<12} {:>4} {:<9} {:>18} {:>18} {:>6}  {}\n", "source",
                     "cluster", "mode", "EP", "phase", "published", "model", "ratio", "note");
  }
  int within = 0;
  for (const ValidationRow& v : rows) {
    const std::string pub =
        v.published_us > 0 ? fmt::format("{:.0f} GB/s, {:.0f} us", v.published_gbps, v.published_us)
                           : fmt::format("{:.0f} GB/s", v.published_gbps);
    const std::string mod = fmt::format("{:.1f} GB/s, {:.0f} us", v.predicted_gbps, v.predicted_us);
    const bool ok = v.ratio >= 0.75 && v.ratio <= 1.25;
    within += ok;
    const std::string note = ok ? v.note : "MISS: " + v.note;
    if (markdown) {
      s += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {:.2f} | {} |\n", v.source, v.cluster,
                       v.mode, v.ep, v.phase, pub, mod, v.ratio, note);
    } else {
      s += fmt::format("{:<22} {:<9} {:<12} {:>4} {:<9} {:>18} {:>18} {:>6.2f}  {}\n", v.source,
                       v.cluster, v.mode, v.ep, v.phase, pub, mod, v.ratio, note);
    }
  }
  s += fmt::format("{}{} of {} rows within +-25% (ratio = model GB/s / published GB/s)\n",
                   markdown ? "\n" : "", within, rows.size());
  return s;
}

}  // namespace moed
