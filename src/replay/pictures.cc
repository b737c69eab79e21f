// Replay's pictures (moed/replay.h): the traffic heatmap and the load per expert, as SVG, and
// their PNG copies where a converter is installed.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>

#include "moed/replay.h"
#include "replay/svg.h"

namespace moed {

namespace {

using svg::Canvas;
using svg::format;
using svg::TextStyle;

std::string steps_phrase(const ReplayResult& r) {
  return r.num_steps == 1 ? std::string("1 step")
                          : format("%lld steps summed", (long long)r.num_steps);
}

// One legend row: a swatch (filled box or line) and its text, at (x, y) = the row's baseline.
void legend_box(Canvas& c, double x, double y, const std::string& fill, const std::string& label) {
  c.rect(x, y - 10, 14, 12, fill, "stroke=\"#555555\" stroke-width=\"0.5\"");
  c.text(x + 20, y, label, {.size = 11});
}
void legend_line(Canvas& c, double x, double y, const std::string& stroke, double width,
                 const std::string& dash, const std::string& label) {
  c.line(x, y - 4, x + 14, y - 4, stroke, width,
         dash.empty() ? "" : svg::cat("stroke-dasharray=\"", dash, "\""));
  c.text(x + 20, y, label, {.size = 11});
}

}  // namespace

std::string traffic_heatmap_svg(const ReplayResult& r) {
  const int R = r.num_ranks, G = r.ranks_per_node;
  const double left = 90, top = 84, plot = 512, legend_w = 200, bottom = 70;
  const double cell = plot / std::max(R, 1);
  Canvas c(left + plot + legend_w, top + plot + bottom);
  const int64_t max = r.traffic.empty() ? 0 : *std::max_element(r.traffic.begin(), r.traffic.end());

  c.text((left + plot + legend_w) / 2, 28, "Dispatch traffic: tokens sent from rank to rank",
         {.size = 17, .anchor = "middle", .bold = true});
  c.text((left + plot + legend_w) / 2, 50,
         format("%s: %d ranks = %d node(s) x %d, %s; a token counts once per destination rank",
                r.trace_name.c_str(), R, r.num_nodes, G, steps_phrase(r).c_str()),
         {.size = 11, .anchor = "middle", .fill = "#444444"});

  // Cells, each with a tooltip naming the pair and its count.
  for (int s = 0; s < R; ++s) {
    for (int d = 0; d < R; ++d) {
      const int64_t v = r.traffic_at(s, d);
      const std::string fill = v == 0 ? "#e8e8e8" : svg::viridis(double(v) / double(max));
      c.raw(
          format("<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\">"
                 "<title>rank %d -&gt; rank %d: %lld tokens</title></rect>\n",
                 left + d * cell, top + s * cell, cell, cell, fill.c_str(), s, d, (long long)v));
    }
  }
  // Node boundaries: inter-node traffic sits off the diagonal blocks.
  const bool nodes = G < R;
  if (nodes) {
    for (int k = G; k < R; k += G) {
      c.line(left + k * cell, top, left + k * cell, top + plot, "#ff2020", 1.5);
      c.line(left, top + k * cell, left + plot, top + k * cell, "#ff2020", 1.5);
    }
  }
  c.rect(left, top, plot, plot, "none", "stroke=\"#333333\" stroke-width=\"1\"");

  for (int i : svg::index_ticks(R, 16)) {
    const double at = (i + 0.5) * cell;
    c.line(left + at, top + plot, left + at, top + plot + 4, "#333333");
    c.text(left + at, top + plot + 17, std::to_string(i), {.size = 11, .anchor = "middle"});
    c.line(left - 4, top + at, left, top + at, "#333333");
    c.text(left - 7, top + at + 4, std::to_string(i), {.size = 11, .anchor = "end"});
  }
  c.text(left + plot / 2, top + plot + 44, "destination rank",
         {.size = 13, .anchor = "middle", .bold = true});
  c.text(left - 48, top + plot / 2, "source rank",
         {.size = 13, .anchor = "middle", .bold = true, .rotate = -90});

  // Colour legend: the ramp with its scale, then the swatches.
  const double lx = left + plot + 36, ly = top + 18, lh = plot * 0.55, lw = 18;
  const double scale_max = max > 0 ? double(max) : 1.0;
  c.text(lx - 4, top + 2, "tokens sent", {.size = 12, .bold = true});
  svg::ramp_legend(c, lx, ly, lw, lh, scale_max);
  double row = ly + lh + 30;
  legend_box(c, lx, row, "#e8e8e8", "0 (no tokens)");
  row += 20;
  c.text(lx, row, format("max %lld tokens", (long long)max), {.size = 11});
  if (nodes) {
    row += 20;
    legend_line(c, lx, row, "#ff2020", 1.5, "", format("node boundary (%d ranks)", G));
  }
  return c.finish();
}

std::string expert_load_svg(const ReplayResult& r) {
  const int E = r.num_experts, R = r.num_ranks, L = r.num_local_experts;
  const double left = 86, top = 84, pw = 760, ph = 360, right = 250, bottom = 70;
  Canvas c(left + pw + right, top + ph + bottom);
  const int64_t routed =
      std::accumulate(r.routed_per_expert.begin(), r.routed_per_expert.end(), int64_t(0));
  const double mean = E > 0 ? double(routed) / E : 0.0;
  const int64_t capacity_total = r.capacity_factor ? r.capacity * R * r.num_steps : 0;
  double ymax = std::max(mean, double(capacity_total));
  for (int64_t v : r.routed_per_expert) ymax = std::max(ymax, double(v));
  const std::vector<double> ticks = svg::nice_ticks(ymax, 6);
  const double ytop = std::max(ticks.back(), 1.0);
  auto y_of = [&](double v) { return top + ph - ph * v / ytop; };

  c.text((left + pw + right) / 2, 28, "Load per expert",
         {.size = 17, .anchor = "middle", .bold = true});
  c.text((left + pw + right) / 2, 50,
         format("%s: %lld tokens x top-%d, %d experts on %d ranks, %s; max/mean = %.2f",
                r.trace_name.c_str(), (long long)r.num_tokens, r.num_topk, E, R,
                steps_phrase(r).c_str(), r.expert_imbalance),
         {.size = 11, .anchor = "middle", .fill = "#444444"});

  for (double t : ticks) {
    c.line(left, y_of(t), left + pw, y_of(t), "#e0e0e0");
    c.line(left - 4, y_of(t), left, y_of(t), "#333333");
    c.text(left - 7, y_of(t) + 4, svg::short_number(t), {.size = 11, .anchor = "end"});
  }
  // Rank boundaries: which experts share a rank, so a hot rank is visible as a hot group.
  const bool rank_lines = R > 1 && R <= 64;
  if (rank_lines) {
    for (int k = 1; k < R; ++k) {
      const double x = left + pw * double(k * L) / E;
      c.line(x, top, x, top + ph, "#b0b0b0", 0.8, "stroke-dasharray=\"2,2\"");
    }
  }
  const double bw = pw / std::max(E, 1);
  const double gap = bw >= 5 ? bw * 0.15 : 0.0;
  for (int e = 0; e < E; ++e) {
    const int64_t kept = r.tokens_per_expert[size_t(e)], dropped = r.dropped_per_expert[size_t(e)];
    const double x = left + e * bw + gap / 2;
    c.raw(
        format("<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"#4477aa\">"
               "<title>expert %d: %lld tokens kept</title></rect>\n",
               x, y_of(double(kept)), bw - gap, y_of(0) - y_of(double(kept)), e, (long long)kept));
    if (dropped > 0) {
      c.raw(
          format("<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"#ee7733\">"
                 "<title>expert %d: %lld tokens dropped</title></rect>\n",
                 x, y_of(double(kept + dropped)), bw - gap,
                 y_of(double(kept)) - y_of(double(kept + dropped)), e, (long long)dropped));
    }
  }
  c.line(left, y_of(mean), left + pw, y_of(mean), "#cc3311", 2, "stroke-dasharray=\"6,4\"");
  if (r.capacity_factor) {
    c.line(left, y_of(double(capacity_total)), left + pw, y_of(double(capacity_total)), "#222222",
           1.5, "stroke-dasharray=\"2,3\"");
  }
  c.rect(left, top, pw, ph, "none", "stroke=\"#333333\" stroke-width=\"1\"");
  for (int e : svg::index_ticks(E, 16)) {
    const double x = left + (e + 0.5) * bw;
    c.line(x, top + ph, x, top + ph + 4, "#333333");
    c.text(x, top + ph + 17, std::to_string(e), {.size = 11, .anchor = "middle"});
  }
  c.text(left + pw / 2, top + ph + 44, "expert", {.size = 13, .anchor = "middle", .bold = true});
  c.text(left - 56, top + ph / 2, "tokens routed (token-expert pairs)",
         {.size = 13, .anchor = "middle", .bold = true, .rotate = -90});

  const double lx = left + pw + 24;
  double row = top + 8;
  c.text(lx, row, "legend", {.size = 12, .bold = true});
  row += 22;
  legend_box(c, lx, row, "#4477aa", "tokens kept");
  if (r.dropped > 0) {
    row += 20;
    legend_box(c, lx, row, "#ee7733", format("dropped (%lld in all)", (long long)r.dropped));
  }
  row += 20;
  legend_line(c, lx, row, "#cc3311", 2, "6,4", format("mean routed = %.1f tokens", mean));
  if (r.capacity_factor) {
    row += 20;
    legend_line(c, lx, row, "#222222", 1.5, "2,3",
                format("capacity = %lld (cf %g)", (long long)capacity_total, *r.capacity_factor));
  }
  if (rank_lines) {
    row += 20;
    legend_line(c, lx, row, "#b0b0b0", 0.8, "2,2", format("rank boundary (%d experts)", L));
  }
  return c.finish();
}

namespace {

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return false;
  std::string p = path;
  size_t begin = 0;
  while (begin <= p.size()) {
    const size_t end = std::min(p.find(':', begin), p.size());
    const std::string dir = end > begin ? p.substr(begin, end - begin) : ".";
    if (::access(svg::cat(dir, "/", program).c_str(), X_OK) == 0) return true;
    begin = end + 1;
  }
  return false;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

// Converts one SVG with `converter`; true when a non-empty PNG came out.
bool to_png(const std::string& converter, const std::string& svg_path,
            const std::string& png_path) {
  const std::string cmd =
      converter == "rsvg-convert"
          ? svg::cat("rsvg-convert -b white -o ", shell_quote(png_path), " ", shell_quote(svg_path))
          : svg::cat("convert ", shell_quote(svg_path), " ", shell_quote(png_path));
  const int rc = std::system(svg::cat(cmd, " >/dev/null 2>&1").c_str());
  std::error_code ec;
  if (rc == 0 && std::filesystem::file_size(png_path, ec) > 0 && !ec) return true;
  std::filesystem::remove(png_path, ec);
  return false;
}

}  // namespace

StatusOr<ReplayPictures> svg::write_pictures(
    const std::string& dir, const std::vector<std::pair<std::string, std::string>>& docs) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return invalid_argument(dir, ": cannot create the directory: ", ec.message());
  ReplayPictures out;
  std::vector<std::string> svgs;
  for (const auto& [name, text] : docs) {
    const std::string path = (std::filesystem::path(dir) / (name + ".svg")).string();
    std::ofstream f(path, std::ios::binary);
    f << text;
    f.close();
    if (!f) return invalid_argument(path, ": cannot write");
    svgs.push_back(path);
  }
  out.files = svgs;
  for (const char* converter : {"rsvg-convert", "convert"}) {
    if (!on_path(converter)) continue;
    std::vector<std::string> pngs;
    for (const std::string& s : svgs) {
      const std::string png = s.substr(0, s.size() - 4) + ".png";
      if (!to_png(converter, s, png)) break;
      pngs.push_back(png);
    }
    if (pngs.size() == svgs.size()) {
      out.converter = converter;
      out.files.insert(out.files.end(), pngs.begin(), pngs.end());
      break;
    }
    for (const std::string& p : pngs) std::filesystem::remove(p, ec);
  }
  return out;
}

StatusOr<ReplayPictures> write_replay_pictures(const ReplayResult& r, const std::string& dir) {
  return svg::write_pictures(dir, {{"traffic", traffic_heatmap_svg(r)},
                                   {"expert_load", expert_load_svg(r)}});
}

}  // namespace moed
