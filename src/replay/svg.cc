// The SVG writer behind replay's pictures (svg.h).
#include "replay/svg.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>

namespace moed::svg {

namespace {

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f", v);
  // Trim "12.50" -> "12.5", "12.00" -> "12": smaller files, same picture.
  std::string s = buf;
  while (!s.empty() && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s == "-0" ? "0" : s;
}

}  // namespace

std::string escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // NOTE: control characters other than tab / newline are not allowed in XML 1.0 at
        // all, so a file name carrying one is shown with '?' instead.
        out += (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n') ? '?' : c;
    }
  }
  return out;
}

std::vector<double> nice_ticks(double max, int max_ticks) {
  if (!(max > 0)) return {0.0, 1.0};
  const double raw = max / std::max(1, max_ticks);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * mag;
    if (step >= raw) break;
  }
  // Whole counts never need fractional ticks.
  step = std::max(step, 1.0);
  // The last tick is the first at or above max, so an axis ending there holds every value.
  std::vector<double> ticks = {0.0};
  while (ticks.back() < max) ticks.push_back(double(ticks.size()) * step);
  return ticks;
}

std::vector<int> index_ticks(int n, int max_labels) {
  int step = 1;
  while ((n + step - 1) / step > std::max(1, max_labels)) step *= 2;
  std::vector<int> ticks;
  for (int i = 0; i < n; i += step) ticks.push_back(i);
  return ticks;
}

std::string short_number(double v) {
  char buf[32];
  const double a = std::fabs(v);
  if (a >= 1e9) {
    std::snprintf(buf, sizeof(buf), "%.3gG", v / 1e9);
  } else if (a >= 1e6) {
    std::snprintf(buf, sizeof(buf), "%.3gM", v / 1e6);
  } else if (a >= 1e4) {
    std::snprintf(buf, sizeof(buf), "%.3gk", v / 1e3);
  } else {
    std::snprintf(buf, sizeof(buf), "%.4g", v);
  }
  return buf;
}

std::string viridis(double t) {
  // Nine samples of matplotlib's viridis, linearly interpolated.
  static constexpr std::array<std::array<int, 3>, 9> kStops = {{{68, 1, 84},
                                                                {71, 44, 122},
                                                                {59, 81, 139},
                                                                {44, 113, 142},
                                                                {33, 144, 141},
                                                                {39, 173, 129},
                                                                {92, 200, 99},
                                                                {170, 220, 50},
                                                                {253, 231, 37}}};
  t = std::clamp(std::isfinite(t) ? t : 0.0, 0.0, 1.0);
  const double x = t * double(kStops.size() - 1);
  const size_t i = std::min(size_t(x), kStops.size() - 2);
  const double f = x - double(i);
  char buf[8];
  int c[3];
  for (int k = 0; k < 3; ++k) {
    c[k] = int(std::lround(kStops[i][size_t(k)] * (1 - f) + kStops[i + 1][size_t(k)] * f));
  }
  std::snprintf(buf, sizeof(buf), "#%02x%02x%02x", c[0], c[1], c[2]);
  return buf;
}

Canvas::Canvas(double width, double height) : width_(width), height_(height) {
  rect(0, 0, width, height, "#ffffff");
}

void Canvas::rect(double x, double y, double w, double h, const std::string& fill,
                  const std::string& extra) {
  body_ += cat("<rect x=\"", num(x), "\" y=\"", num(y), "\" width=\"", num(w), "\" height=\"",
               num(h), "\" fill=\"", fill, "\"", extra.empty() ? "" : " ", extra, "/>\n");
}

void Canvas::line(double x1, double y1, double x2, double y2, const std::string& stroke,
                  double width, const std::string& extra) {
  body_ += cat("<line x1=\"", num(x1), "\" y1=\"", num(y1), "\" x2=\"", num(x2), "\" y2=\"",
               num(y2), "\" stroke=\"", stroke, "\" stroke-width=\"", num(width), "\"",
               extra.empty() ? "" : " ", extra, "/>\n");
}

void Canvas::text(double x, double y, const std::string& s, const TextStyle& st) {
  body_ += cat("<text x=\"", num(x), "\" y=\"", num(y), "\" font-size=\"", num(st.size),
               "\" text-anchor=\"", st.anchor, "\" fill=\"", st.fill, "\"");
  if (st.bold) body_ += " font-weight=\"bold\"";
  if (st.rotate != 0) {
    body_ += cat(" transform=\"rotate(", num(st.rotate), " ", num(x), " ", num(y), ")\"");
  }
  body_ += cat(">", escape(s), "</text>\n");
}

void Canvas::raw(const std::string& markup) { body_ += markup; }

std::string Canvas::finish() const {
  return cat("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n",
             "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"", num(width_),
             "\" height=\"", num(height_), "\" viewBox=\"0 0 ", num(width_), " ", num(height_),
             "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n", body_, "</svg>\n");
}

void ramp_legend(Canvas& c, double lx, double ly, double lw, double lh, double scale_max) {
  std::string grad = "<defs><linearGradient id=\"ramp\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">";
  char stop[96];
  for (int i = 0; i <= 8; ++i) {
    std::snprintf(stop, sizeof(stop), "<stop offset=\"%.3f\" stop-color=\"%s\"/>", i / 8.0,
                  viridis(i / 8.0).c_str());
    grad += stop;
  }
  c.raw(grad + "</linearGradient></defs>\n");
  c.rect(lx, ly, lw, lh, "url(#ramp)", "stroke=\"#333333\" stroke-width=\"0.5\"");
  for (double t : nice_ticks(scale_max, 5)) {
    if (t > scale_max * (1 + 1e-9)) break;
    const double y = ly + lh - lh * t / scale_max;
    c.line(lx + lw, y, lx + lw + 4, y, "#333333");
    c.text(lx + lw + 7, y + 4, short_number(t), {.size = 11});
  }
}

}  // namespace moed::svg
