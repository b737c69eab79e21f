// The plan model's reports: the text table and JSON of `moed plan`, and the validation table
// against published figures (`moed plan --validate`).
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "moed/plan.h"

namespace moed {

namespace {

// PlanRouting's names, as --routing spells them, in the enum's order.
constexpr const char* kRoutingNames[] = {"uniform", "zipf", "group", "trace"};

}  // namespace

std::string plan_table(const PlanResult& r) {
  const PlanOptions& o = r.options;
  const Cluster& c = o.cluster;
  std::string s = fmt::format(
      "moed plan: cluster {} ({})\n  nvl {:.0f} GB/s  net {:.0f} GB/s  hbm {:.0f} GB/s  latency "
      "nvl {:.1f} us, net {:.1f} us  fixed {:.0f} us per call\n",
      c.name, c.description, c.nvl_gbps, c.net_gbps, c.hbm_gbps, c.nvl_latency_us, c.net_latency_us,
      c.fixed_us);
  s += fmt::format(
      "  EP={} ({} node{} of {})  T={} per rank  H={}  K={}  E={}  routing {}  dispatch {}, "
      "combine bf16\n\n",
      o.ep, r.num_nodes, r.num_nodes == 1 ? "" : "s", o.ranks_per_node, o.tokens, o.hidden, o.topk,
      o.experts, kRoutingNames[int(o.routing)], o.fp8_dispatch ? "fp8" : "bf16");
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
      r.reported == "low-latency" ? "low-latency"
      : r.reported == "flex"      ? "normal (flex)"
                                  : r.reported,
      r.dispatch_seconds * 1e6, r.dispatch_gbps, r.published.link, r.combine_seconds * 1e6,
      r.combine_gbps, r.published.link,
      r.published.link == "RDMA" && (r.reported == "low-latency" || r.reported == "pplx")
          ? "(token, expert) selections x row"
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
                  {"fixed_us", o.cluster.fixed_us},
                  {"proxy_message_us", o.cluster.proxy_message_us},
                  {"ranks_per_node", o.cluster.ranks_per_node}};
  j["ep"] = o.ep;
  j["ranks_per_node"] = o.ranks_per_node;
  j["num_nodes"] = r.num_nodes;
  j["tokens"] = o.tokens;
  j["hidden"] = o.hidden;
  j["topk"] = o.topk;
  j["experts"] = o.experts;
  j["mode"] = o.low_latency ? "low-latency" : "normal";
  j["algorithm"] = r.reported;
  j["cpu_proxy"] = o.cpu_proxy;
  j["routing"] = kRoutingNames[int(o.routing)];
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

std::string validation_summary(const std::vector<ValidationRow>& rows) {
  std::vector<std::pair<std::string, std::pair<int, int>>> per;  // source -> (within, rows)
  int within = 0;
  for (const ValidationRow& v : rows) {
    auto it = std::find_if(per.begin(), per.end(), [&](const auto& p) { return p.first == v.source; });
    if (it == per.end()) it = per.insert(per.end(), {v.source, {0, 0}});
    it->second.first += v.within();
    it->second.second += 1;
    within += v.within();
  }
  std::string s = fmt::format("{} of {} rows within +-25% ({:.0f}%)", within, rows.size(),
                              rows.empty() ? 0.0 : 100.0 * within / double(rows.size()));
  for (size_t i = 0; i < per.size(); ++i) {
    s += fmt::format("{} {} {}/{}", i == 0 ? ":" : ",", per[i].first, per[i].second.first,
                     per[i].second.second);
  }
  return s + "\n";
}

std::string validation_table(const std::vector<ValidationRow>& rows, bool markdown) {
  std::string s;
  if (markdown) {
    s += "| source | table | design | cluster | EP | tokens | phase | published | model | ratio | "
         "miss: why |\n";
    s += "| --- | --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | --- |\n";
  } else {
    s += fmt::format("{:<18} {:<26} {:<14} {:<12} {:>4} {:>5} {:<9} {:>18} {:>18} {:>6}  {}\n",
                     "source", "table", "design", "cluster", "EP", "tok", "phase", "published",
                     "model", "ratio", "note");
  }
  for (const ValidationRow& v : rows) {
    std::string pub;
    if (v.published_gbps > 0) pub = fmt::format("{:.0f} GB/s", v.published_gbps);
    if (v.published_us > 0) pub += fmt::format("{}{:.0f} us", pub.empty() ? "" : ", ", v.published_us);
    const std::string mod = v.published_gbps > 0
                                ? fmt::format("{:.1f} GB/s, {:.0f} us", v.predicted_gbps, v.predicted_us)
                                : fmt::format("{:.0f} us", v.predicted_us);
    const std::string note = v.within() ? v.note : "MISS: " + v.note;
    const std::string phase = v.phase + (v.phase == "dispatch" && v.dtype == "bf16" ? " bf16" : "");
    if (markdown) {
      s += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2f} | {} |\n", v.source,
                       v.table, v.design, v.cluster, v.ep, v.tokens, phase, pub, mod, v.ratio,
                       v.within() ? "" : v.note);
    } else {
      s += fmt::format("{:<18} {:<26} {:<14} {:<12} {:>4} {:>5} {:<9} {:>18} {:>18} {:>6.2f}  {}\n",
                       v.source, v.table, v.design, v.cluster, v.ep, v.tokens, phase, pub, mod,
                       v.ratio, note);
    }
  }
  s += fmt::format("{}{}", markdown ? "\n" : "", validation_summary(rows));
  s += "(ratio = model GB/s / published GB/s, or published us / model us where only a time is "
       "published)\n";
  return s;
}

}  // namespace moed
