// Per-layer pictures of one step (moed/replay.h LayerReplay): layers x experts load and layers x
// ranks received rows, as heatmaps with a colour ramp and one summary figure per layer.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>

#include "moed/replay.h"
#include "replay/svg.h"

namespace moed {

namespace {

using svg::Canvas;
using svg::format;

struct Heatmap {
  std::string title, subtitle, column_axis, legend_title, note_title;
  int columns = 0;
  std::vector<std::string> row_labels;
  std::vector<std::vector<int64_t>> values;  // [rows][columns]
  std::vector<std::string> notes;            // one per row, at the right
  int group = 0;  // > 0: a boundary line every `group` columns (the experts of a rank)
};


std::string draw(const Heatmap& h) {
  const int rows = int(h.values.size()), cols = std::max(h.columns, 1);
  const double left = 150, top = 84, pw = 720, note_w = 150, legend_w = 130, bottom = 64;
  const double cw = pw / cols, rh = std::clamp(480.0 / std::max(rows, 1), 6.0, 40.0);
  const double ph = rh * rows;
  Canvas c(left + pw + note_w + legend_w, top + std::max(ph, 260.0) + bottom);
  int64_t max = 0;
  for (const auto& row : h.values) {
    for (int64_t v : row) max = std::max(max, v);
  }
  const double width = left + pw + note_w + legend_w;
  c.text(width / 2, 28, h.title, {.size = 17, .anchor = "middle", .bold = true});
  c.text(width / 2, 50, h.subtitle, {.size = 11, .anchor = "middle", .fill = "#444444"});
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) {
      const int64_t v = h.values[size_t(i)][size_t(j)];
      const std::string fill = v == 0 ? "#e8e8e8" : svg::viridis(double(v) / double(max));
      c.raw(format("<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\">"
                   "<title>%s, %s %d: %lld</title></rect>\n",
                   left + j * cw, top + i * rh, cw, rh, fill.c_str(),
                   svg::escape(h.row_labels[size_t(i)]).c_str(), h.column_axis.c_str(), j,
                   (long long)v));
    }
    // Row labels: every row while they fit, else every k-th.
    const int every = std::max(1, int(12.0 / rh + 0.999));
    if (i % every == 0) {
      c.text(left - 6, top + (i + 0.5) * rh + 4, h.row_labels[size_t(i)],
             {.size = std::min(11.0, rh * 0.9 + 2), .anchor = "end"});
    }
    if (i % every == 0) {
      c.text(left + pw + 8, top + (i + 0.5) * rh + 4, h.notes[size_t(i)],
             {.size = std::min(11.0, rh * 0.9 + 2)});
    }
  }
  if (h.group > 0 && h.group < cols && cols / h.group <= 64) {
    for (int k = h.group; k < cols; k += h.group) {
      c.line(left + k * cw, top, left + k * cw, top + ph, "#ffffff", cols <= 64 ? 1.5 : 0.8);
    }
  }
  c.rect(left, top, pw, ph, "none", "stroke=\"#333333\" stroke-width=\"1\"");
  for (int j : svg::index_ticks(cols, 16)) {
    const double x = left + (j + 0.5) * cw;
    c.line(x, top + ph, x, top + ph + 4, "#333333");
    c.text(x, top + ph + 17, std::to_string(j), {.size = 11, .anchor = "middle"});
  }
  c.text(left + pw / 2, top + ph + 42, h.column_axis, {.size = 13, .anchor = "middle", .bold = true});
  c.text(left + pw + 8, top - 8, h.note_title, {.size = 11, .bold = true});

  // Colour ramp with its scale.
  const double lx = left + pw + note_w + 24, ly = top + 18, lh = 200, lw = 18;
  const double scale_max = max > 0 ? double(max) : 1.0;
  c.text(lx - 4, top + 2, h.legend_title, {.size = 12, .bold = true});
  svg::ramp_legend(c, lx, ly, lw, lh, scale_max);
  c.rect(lx, ly + lh + 18, 14, 12, "#e8e8e8", "stroke=\"#555555\" stroke-width=\"0.5\"");
  c.text(lx + 20, ly + lh + 28, "0", {.size = 11});
  return c.finish();
}

std::string subtitle(const std::vector<LayerReplay>& layers) {
  if (layers.empty()) return "no layers";
  const ReplayResult& r = layers.front().result;
  return format("%s: %zu layer calls, %lld tokens x top-%d, %d experts on %d ranks (%d node(s) x %d)",
                r.trace_name.c_str(), layers.size(), (long long)r.num_tokens, r.num_topk,
                r.num_experts, r.num_ranks, r.num_nodes, r.ranks_per_node);
}

// A heatmap with one row per layer call; the caller fills its columns, values and notes.
Heatmap layer_heatmap(const std::vector<LayerReplay>& layers, const char* title,
                      const char* column_axis, const char* legend_title, const char* note_title) {
  Heatmap h;
  h.title = title;
  h.subtitle = subtitle(layers);
  h.column_axis = column_axis;
  h.legend_title = legend_title;
  h.note_title = note_title;
  for (const LayerReplay& l : layers) h.row_labels.push_back(l.label);
  return h;
}

}  // namespace

std::string layer_load_svg(const std::vector<LayerReplay>& layers) {
  Heatmap h = layer_heatmap(layers, "Load per expert, layer by layer", "expert", "tokens",
                            "max / mean");
  h.columns = layers.empty() ? 0 : layers.front().result.num_experts;
  h.group = layers.empty() ? 0 : layers.front().result.num_local_experts;
  for (const LayerReplay& l : layers) {
    h.values.push_back(l.result.tokens_per_expert);
    h.notes.push_back(format("%.2f", imbalance(l.result.tokens_per_expert)));
  }
  return draw(h);
}

std::string layer_traffic_svg(const std::vector<LayerReplay>& layers) {
  Heatmap h = layer_heatmap(layers, "Rows each rank receives, layer by layer", "destination rank",
                            "rows", "max/mean, Flex net MB");
  h.columns = layers.empty() ? 0 : layers.front().result.num_ranks;
  // Node boundaries: the ranks of one node share NVLink.
  h.group = layers.empty() ? 0 : layers.front().result.ranks_per_node;
  for (const LayerReplay& l : layers) {
    h.values.push_back(l.result.rows_per_rank);
    const std::vector<int64_t>& net = l.result.flex.network_bytes;
    const double busiest = net.empty() ? 0.0 : double(*std::max_element(net.begin(), net.end()));
    h.notes.push_back(format("%.2f, %.2f", imbalance(l.result.rows_per_rank), busiest / 1e6));
  }
  return draw(h);
}

StatusOr<ReplayPictures> write_layer_pictures(const std::vector<LayerReplay>& layers,
                                              const std::string& dir) {
  return svg::write_pictures(dir, {{"layer_load", layer_load_svg(layers)},
                                   {"layer_traffic", layer_traffic_svg(layers)}});
}

}  // namespace moed
