// The sweep's chart (moed/plan.h sweep_svg): dispatch and combine panels, one line per
// algorithm against EP size (or tokens) on a log axis, the published points as markers.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "moed/plan.h"
#include "replay/svg.h"

namespace moed {

namespace {

using svg::Canvas;

// Paul Tol's bright scheme (colour-blind safe): one per algorithm; the sources take the
// muted scheme so the two never read as the same thing.
constexpr const char* kLineColours[] = {"#4477aa", "#ee6677", "#228833", "#ccbb44", "#aa3377"};
constexpr const char* kSourceColours[] = {"#332288", "#88ccee", "#44aa99", "#117733", "#999933",
                                          "#ddcc77", "#cc6677", "#882255", "#aa4499", "#555555"};

const char* describe(const std::string& a) {
  if (a == "flat") return "flat: a row per (token, rank)";
  if (a == "alltoall") return "alltoall: Megatron, 3 copies";
  if (a == "flex") return "flex: DeepEP normal, 2 hops";
  if (a == "low-latency") return "low-latency: per (token, expert)";
  return "pplx: rows per expert, 1 write/peer";
}

struct Axis {
  double lo, hi;  // data range (log10 when log)
  bool log;
  double pos(double v) const {
    const double x = log ? std::log10(std::max(v, 1e-9)) : v;
    return hi > lo ? (x - lo) / (hi - lo) : 0.5;
  }
};

// Log-axis ticks 1, 2, 5 x 10^k inside [lo, hi] (values, not logs).
std::vector<double> log_ticks(double lo, double hi) {
  std::vector<double> t;
  for (double p = std::pow(10.0, std::floor(std::log10(lo))); p <= hi * 1.0001; p *= 10) {
    for (double m : {1.0, 2.0, 5.0}) {
      if (m * p >= lo * 0.9999 && m * p <= hi * 1.0001) t.push_back(m * p);
    }
  }
  return t;
}

void panel(Canvas& c, const SweepResult& r, bool gbps, bool dispatch, double x0, double y0,
           double w, double h, const std::map<std::string, std::string>& source_colour) {
  // Values to scale: the lines and the published points of this panel.
  std::vector<double> ys;
  for (const SweepPoint& p : r.points) {
    const auto& v = gbps ? (dispatch ? p.dispatch_gbps : p.combine_gbps)
                         : (dispatch ? p.dispatch_us : p.combine_us);
    ys.insert(ys.end(), v.begin(), v.end());
  }
  std::vector<const ValidationRow*> pts;
  for (const ValidationRow& v : r.published) {
    if ((v.phase == "dispatch") != dispatch) continue;
    const double y = gbps ? v.published_gbps : v.implied_us;
    const double x = r.axis == "ep" ? double(v.ep) : double(v.tokens);
    if (y <= 0 || x < double(r.points.front().value) || x > double(r.points.back().value)) continue;
    pts.push_back(&v);
    ys.push_back(y);
  }
  const double ymax = ys.empty() ? 1.0 : *std::max_element(ys.begin(), ys.end());
  const double ymin = ys.empty() ? 1.0 : *std::min_element(ys.begin(), ys.end());
  const Axis xa{std::log10(double(r.points.front().value)), std::log10(double(r.points.back().value)),
                true};
  std::vector<double> yticks;
  Axis ya{0, 1, false};
  if (gbps) {
    yticks = svg::nice_ticks(ymax, 6);
    ya = {0.0, std::max(yticks.back(), 1e-9), false};
  } else {
    // The axis runs between the 1-2-5 steps just outside the data.
    double lo = std::pow(10.0, std::floor(std::log10(std::max(ymin, 1e-3))));
    for (double m : {2.0, 5.0}) {
      if (lo / 1.0 * m <= ymin) lo = std::pow(10.0, std::floor(std::log10(std::max(ymin, 1e-3)))) * m;
    }
    double hi = std::pow(10.0, std::ceil(std::log10(std::max(ymax, lo * 2))));
    for (double m : {0.2, 0.5}) {
      if (hi * m >= ymax && hi * m > lo) {
        hi *= m;
        break;
      }
    }
    yticks = log_ticks(lo, hi);
    ya = {std::log10(lo), std::log10(hi), true};
  }
  auto X = [&](double v) { return x0 + w * xa.pos(v); };
  auto Y = [&](double v) { return y0 + h - h * ya.pos(v); };

  c.text(x0 + w / 2, y0 - 12, dispatch ? "dispatch" : "combine",
         {.size = 14, .anchor = "middle", .bold = true});
  for (double t : yticks) {
    c.line(x0, Y(t), x0 + w, Y(t), "#e4e4e4");
    c.text(x0 - 6, Y(t) + 4, svg::short_number(t), {.size = 11, .anchor = "end"});
  }
  for (const SweepPoint& p : r.points) {
    c.line(X(double(p.value)), y0, X(double(p.value)), y0 + h, "#f0f0f0");
    c.text(X(double(p.value)), y0 + h + 16, std::to_string(p.value), {.size = 11, .anchor = "middle"});
  }
  c.rect(x0, y0, w, h, "none", "stroke=\"#333333\" stroke-width=\"1\"");
  c.text(x0 + w / 2, y0 + h + 38, r.axis == "ep" ? "EP size (ranks)" : "tokens per rank",
         {.size = 12, .anchor = "middle", .bold = true});
  c.text(x0 - 48, y0 + h / 2, gbps ? "GB/s per rank" : "time per call (us)",
         {.size = 12, .anchor = "middle", .bold = true, .rotate = -90});

  for (size_t a = 0; a < r.algorithms.size(); ++a) {
    std::string path;
    for (const SweepPoint& p : r.points) {
      const double y = gbps ? (dispatch ? p.dispatch_gbps[a] : p.combine_gbps[a])
                            : (dispatch ? p.dispatch_us[a] : p.combine_us[a]);
      path += fmt::format("{}{:.1f},{:.1f}", path.empty() ? "M" : " L", X(double(p.value)), Y(y));
    }
    // pplx moves low-latency's bytes: dashed, so the two stay visible where they coincide.
    c.raw(fmt::format("<path d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2.2\"{}/>\n", path,
                      kLineColours[a % 5],
                      r.algorithms[a] == "pplx" ? " stroke-dasharray=\"7,4\"" : ""));
    for (const SweepPoint& p : r.points) {
      const double y = gbps ? (dispatch ? p.dispatch_gbps[a] : p.combine_gbps[a])
                            : (dispatch ? p.dispatch_us[a] : p.combine_us[a]);
      c.raw(fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.8\" fill=\"{}\"><title>{} at {}: "
                        "{:.1f} {}</title></circle>\n",
                        X(double(p.value)), Y(y), kLineColours[a % 5], r.algorithms[a], p.value, y,
                        gbps ? "GB/s" : "us"));
    }
  }
  // Published points: a hollow diamond in the source's colour, with what it is in its tooltip.
  for (const ValidationRow* v : pts) {
    const double x = X(r.axis == "ep" ? double(v->ep) : double(v->tokens));
    const double y = Y(gbps ? v->published_gbps : v->implied_us);
    const std::string& col = source_colour.at(v->source + " (" + v->design + ")");
    c.raw(fmt::format(
        "<path d=\"M{:.1f},{:.1f} l6,6 l-6,6 l-6,-6 z\" fill=\"#ffffff\" fill-opacity=\"0.6\" "
        "stroke=\"{}\" stroke-width=\"2\"><title>{}: {} ({}), EP {}: {}</title></path>\n",
        x, y - 6, col, svg::escape(v->source), svg::escape(v->table), v->design, v->ep,
        gbps ? fmt::format("{:.0f} GB/s", v->published_gbps)
             : fmt::format("{:.0f} us{}", v->implied_us,
                           v->published_us > 0 ? "" : " (from its GB/s)")));
  }
}

}  // namespace

std::string sweep_svg(const SweepResult& r, bool gbps) {
  const double left = 80, top = 116, pw = 420, ph = 360, gap = 96, legend = 310, bottom = 70;
  const double width = left + 2 * pw + gap + legend;
  Canvas c(width, top + ph + bottom + 40);
  const PlanOptions& o = r.base;
  c.text(width / 2, 28,
         gbps ? "Where each design stops scaling: modelled GB/s per rank"
              : "Where each design stops scaling: modelled time per call",
         {.size = 18, .anchor = "middle", .bold = true});
  c.text(width / 2, 50,
         fmt::format("moed plan --sweep {}: cluster {} ({}), {} tokens per rank, H {}, top-{}, "
                     "E {}+, {} dispatch, {} routing",
                     r.axis, o.cluster.name, o.cluster.description,
                     r.axis == "ep" ? std::to_string(o.tokens) : std::string("varying"), o.hidden,
                     o.topk, o.experts, o.fp8_dispatch ? "fp8" : "bf16",
                     std::string(o.routing == PlanRouting::kGroup  ? "group-limited"
                                 : o.routing == PlanRouting::kZipf ? "Zipf"
                                                                   : "uniform")),
         {.size = 11, .anchor = "middle", .fill = "#444444"});
  c.text(width / 2, 68,
         gbps ? "GB/s as DeepEP counts it: received tokens on one node, (token, node) pairs across "
                "nodes (own node included), selections for low-latency and pplx"
              : "time of one dispatch / combine call, log scale; a row published in GB/s is shown "
                "as the time its bytes (as its source counts them) take at that rate",
         {.size = 11, .anchor = "middle", .fill = "#444444"});
  std::map<std::string, std::string> source_colour;
  // One colour per (source, design): a source's tables of different designs stay apart.
  for (const ValidationRow& v : r.published) {
    const std::string key = v.source + " (" + v.design + ")";
    if (!source_colour.count(key)) source_colour[key] = kSourceColours[source_colour.size() % 10];
  }
  panel(c, r, gbps, true, left, top, pw, ph, source_colour);
  panel(c, r, gbps, false, left + pw + gap, top, pw, ph, source_colour);

  const double lx = left + 2 * pw + gap + 28;
  double row = top + 4;
  c.text(lx, row, "model (one line per design)", {.size = 12, .bold = true});
  for (size_t a = 0; a < r.algorithms.size(); ++a) {
    row += 20;
    c.line(lx, row - 4, lx + 22, row - 4, kLineColours[a % 5], 2.2,
           r.algorithms[a] == "pplx" ? "stroke-dasharray=\"7,4\"" : "");
    c.text(lx + 30, row, describe(r.algorithms[a]), {.size = 11});
  }
  if (!source_colour.empty()) {
    row += 34;
    c.text(lx, row, gbps ? "published (each as its source counts)" : "published (its time)",
           {.size = 12, .bold = true});
    for (const auto& [name, col] : source_colour) {
      row += 20;
      c.raw(fmt::format("<path d=\"M{:.1f},{:.1f} l6,6 l-6,6 l-6,-6 z\" fill=\"#ffffff\" "
                        "stroke=\"{}\" stroke-width=\"2\"/>\n",
                        lx + 8, row - 11, col));
      c.text(lx + 30, row, name, {.size = 11});
    }
  } else {
    row += 34;
    c.text(lx, row, "no published row on this cluster", {.size = 11, .fill = "#666666"});
    c.text(lx, row + 16, "at these settings", {.size = 11, .fill = "#666666"});
  }
  c.text(left, top + ph + bottom + 24,
         fmt::format("cluster {}: NVLink {:.0f} GB/s, network {:.0f} GB/s per GPU, {:.0f} us per call; "
                     "{}",
                     o.cluster.name, o.cluster.nvl_gbps, o.cluster.net_gbps, o.cluster.fixed_us,
                     o.cpu_proxy ? "messages posted by CPU proxies" : "GPU-initiated"),
         {.size = 10, .fill = "#666666"});
  return c.finish();
}

}  // namespace moed
