// `moed plan --sweep`: the model for every algorithm over EP sizes or tokens per rank
// (moed/plan.h plan_sweep), as a table; the chart is sweep_svg.cc.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>

#include "moed/plan.h"

namespace moed {

namespace {

StatusOr<std::vector<int64_t>> parse_values(const std::string& spec, const std::string& list) {
  std::vector<int64_t> out;
  size_t begin = 0;
  while (begin <= list.size()) {
    const size_t end = std::min(list.find(',', begin), list.size());
    const std::string item = list.substr(begin, end - begin);
    int64_t v = 0;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || ptr != item.data() + item.size() || v < 1) {
      return invalid_argument("--sweep '", spec, "': '", item, "' is not a whole number >= 1");
    }
    if (!out.empty() && v <= out.back()) {
      return invalid_argument("--sweep '", spec, "': values must ascend (", v, " after ",
                              out.back(), ")");
    }
    out.push_back(v);
    begin = end + 1;
  }
  return out;
}

}  // namespace

StatusOr<SweepResult> plan_sweep(const PlanOptions& base, const std::string& spec) {
  const size_t eq = spec.find('=');
  const std::string axis = spec.substr(0, eq);
  if (eq == std::string::npos || (axis != "ep" && axis != "tokens")) {
    return invalid_argument("--sweep '", spec, "' is not ep=V1,V2,... or tokens=V1,V2,...");
  }
  MOED_ASSIGN_OR_RETURN(const std::vector<int64_t> values, parse_values(spec, spec.substr(eq + 1)));
  if (axis == "ep" && values.back() > 2048) {
    return invalid_argument("--sweep '", spec, "': EP ", values.back(), " is above 2048");
  }
  if (base.routing == PlanRouting::kTrace) {
    return invalid_argument("--sweep generates its routing; it does not take --trace");
  }
  SweepResult out;
  out.base = base;
  out.axis = axis;
  out.algorithms.assign(std::begin(kPlanAlgorithms), std::end(kPlanAlgorithms));
  for (int64_t v : values) {
    PlanOptions o = base;
    if (axis == "ep") {
      o.ep = int(v);
      o.ranks_per_node = std::min(base.ranks_per_node, o.ep);
      if (o.ep % o.ranks_per_node != 0) {
        return invalid_argument("--sweep '", spec, "': --ranks-per-node = ", base.ranks_per_node,
                                " does not divide EP ", v);
      }
      // NOTE: E must be a multiple of EP; past E (or off its multiples) the sweep takes the
      // next multiple of EP, one expert per rank and more, as design.md §7.4 does for odd EP.
      if (o.experts % o.ep != 0) o.experts = (o.experts / o.ep + 1) * o.ep;
    } else {
      o.tokens = v;
    }
    MOED_ASSIGN_OR_RETURN(const PlanResult r, plan(o));
    SweepPoint p;
    p.value = v;
    p.experts = o.experts;
    for (const std::string& a : out.algorithms) {
      const AlgorithmCost& c = r.algorithm(a);
      const PublishedBytes b = r.published_for(a);
      p.dispatch_us.push_back(c.dispatch.seconds * 1e6);
      p.combine_us.push_back(c.combine.seconds * 1e6);
      p.dispatch_gbps.push_back(double(b.dispatch) / c.dispatch.seconds / 1e9);
      p.combine_gbps.push_back(double(b.combine) / c.combine.seconds / 1e9);
    }
    out.points.push_back(std::move(p));
  }
  MOED_ASSIGN_OR_RETURN(out.published, validate_plan(base.cluster.name,
                                                     axis == "ep" ? base.tokens : -1,
                                                     axis == "ep" ? -1 : base.ep));
  return out;
}

std::string sweep_table(const SweepResult& r, bool gbps) {
  const PlanOptions& o = r.base;
  std::string s = fmt::format(
      "moed plan --sweep {}: cluster {}, {} tokens per rank, H={}, K={}, E={}, {} dispatch, {}\n"
      "  {} per algorithm, dispatch / combine ({})\n\n",
      r.axis, o.cluster.name, r.axis == "tokens" ? std::string("varying") : std::to_string(o.tokens),
      o.hidden, o.topk, o.experts, o.fp8_dispatch ? "fp8" : "bf16",
      r.axis == "ep" ? fmt::format("G={} ranks per node", o.ranks_per_node)
                     : fmt::format("EP={}", o.ep),
      gbps ? "GB/s" : "us",
      gbps ? "GB/s per rank as DeepEP counts: received tokens on one node, (token, node) pairs "
             "across nodes, selections for low-latency and pplx"
           : "modelled time per call");
  s += fmt::format("  {:>7} {:>5}", r.axis == "ep" ? "EP" : "tokens", "E");
  for (const std::string& a : r.algorithms) s += fmt::format(" {:>21}", a);
  s += "\n";
  for (const SweepPoint& p : r.points) {
    s += fmt::format("  {:>7} {:>5}", p.value, p.experts);
    for (size_t i = 0; i < r.algorithms.size(); ++i) {
      const double d = gbps ? p.dispatch_gbps[i] : p.dispatch_us[i];
      const double c = gbps ? p.combine_gbps[i] : p.combine_us[i];
      s += fmt::format(" {:>21}", fmt::format("{:.1f} / {:.1f}", d, c));
    }
    s += "\n";
  }
  if (!r.published.empty()) {
    s += fmt::format("\n  published on {} at the same {} ({} rows):\n", o.cluster.name,
                     r.axis == "ep" ? "tokens" : "EP", r.published.size());
    for (const ValidationRow& v : r.published) {
      std::string fig;
      if (v.published_gbps > 0) fig = fmt::format("{:.0f} GB/s", v.published_gbps);
      if (v.published_us > 0) fig += fmt::format("{}{:.0f} us", fig.empty() ? "" : ", ", v.published_us);
      if (v.published_us <= 0) fig += fmt::format(" (= {:.0f} us for its bytes)", v.implied_us);
      s += fmt::format("    {:<18} {:<26} EP {:>4} {:<8} {}\n", v.source, v.table, v.ep, v.phase,
                       fig);
    }
  }
  return s;
}

}  // namespace moed
