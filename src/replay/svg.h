// A small SVG writer for replay's pictures: shapes, escaped text, nice axis ticks and a
// perceptually uniform colour ramp. Everything is plain text, so the pictures need no library
// and diff well.
//
//   moed::svg::Canvas c(640, 480);
//   c.text(320, 24, "Load per expert", {.size = 16, .anchor = "middle", .bold = true});
//   c.rect(10, 10, 20, 30, "#4477aa");
//   std::string doc = c.finish();
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "moed/replay.h"

namespace moed::svg {

// Concatenates strings and string literals by appending (so no `"literal" + std::string`
// temporaries, which also trip GCC 12's -Wrestrict false positive).
template <typename... Parts>
std::string cat(const Parts&... parts) {
  std::string s;
  (s.append(parts), ...);
  return s;
}

// printf into a string (at most 511 characters): the labels and report lines of replay.
std::string format(const char* fmt, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof(buf), fmt, args...);
  return buf;
}

// Escapes &, <, >, " and ' for text and attribute values.
std::string escape(const std::string& s);

// About `max_ticks` + 1 round tick values (whole multiples of 1, 2 or 5 times a power of ten)
// from 0 up to the first at or above max; {0, 1} when max <= 0.
std::vector<double> nice_ticks(double max, int max_ticks);
// Tick positions 0, step, 2 step, ... < n for n categories, with step a power of two chosen so
// that at most `max_labels` labels appear (0..255 experts -> every 16th).
std::vector<int> index_ticks(int n, int max_labels);
// "1234", "12.5k", "3.4M": short tick labels.
std::string short_number(double v);

// Viridis, sampled at t in [0, 1] (clamped): "#rrggbb".
std::string viridis(double t);

struct TextStyle {
  double size = 12;
  const char* anchor = "start";  // start | middle | end
  bool bold = false;
  double rotate = 0;  // degrees, about the anchor point
  const char* fill = "#222222";
};

class Canvas {
 public:
  Canvas(double width, double height);
  void rect(double x, double y, double w, double h, const std::string& fill,
            const std::string& extra = "");
  void line(double x1, double y1, double x2, double y2, const std::string& stroke, double width = 1,
            const std::string& extra = "");
  void text(double x, double y, const std::string& s, const TextStyle& style = {});
  // Raw markup (definitions, groups); the caller keeps it well formed.
  void raw(const std::string& markup);
  // The complete document.
  std::string finish() const;

 private:
  double width_, height_;
  std::string body_;
};

// The viridis ramp as a legend: a lw x lh bar at (lx, ly), 0 at the bottom and scale_max at
// the top, with round tick labels to its right.
void ramp_legend(Canvas& c, double lx, double ly, double lw, double lh, double scale_max);

// Writes each (name, document) as DIR/name.svg (DIR created if missing) and a PNG beside each
// when rsvg-convert or ImageMagick's convert is on PATH and converts them all (tried in that
// order; otherwise no PNG, silently).
StatusOr<ReplayPictures> write_pictures(const std::string& dir,
                                        const std::vector<std::pair<std::string, std::string>>& docs);

}  // namespace moed::svg
