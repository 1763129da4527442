// curves.svg: two panels (loss; accuracy) against the step, from metrics.jsonl. Plain SVG, so it
// opens in any browser and needs no plotting library.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/file_util.h"
#include "train/trainer.h"

namespace stoke::train {
namespace {

struct Series {
  std::string label;
  std::string color;
  bool dashed = false;
  std::vector<std::pair<double, double>> points;  // (step, value)
};

// A "nice" tick step for a span: 1, 2 or 5 times a power of ten.
double TickStep(double span, int target) {
  const double raw = span / target;
  const double p = std::pow(10, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * p >= raw) return m * p;
  }
  return 10 * p;
}

// `percent`: values are fractions, drawn 0-100% with the legend at the bottom (accuracy rises
// to the top); otherwise the legend sits at the top (losses fall).
std::string Panel(const std::vector<Series>& series, const std::string& title, double x0, double y0, double w,
                  double h, double max_step, bool percent) {
  double lo = std::numeric_limits<double>::max(), hi = std::numeric_limits<double>::lowest();
  for (const auto& s : series) {
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(y)) continue;  // not drawn
      lo = std::min(lo, y);
      hi = std::max(hi, y);
    }
  }
  if (lo > hi) lo = 0, hi = 1;
  if (percent) lo = 0, hi = std::max(hi, 1e-9);
  // A flat or nearly flat series gets a span relative to its size: a fixed +1 vanished next to
  // values of 1e16 (a diverged loss), and the ticks below never advanced.
  const double size = std::max({1.0, std::abs(lo), std::abs(hi)});
  if (hi - lo < 1e-6 * size) {
    const double pad = 0.01 * size;
    lo -= pad;
    hi += pad;
  }
  const double ml = 60, mr = 15, mt = 30, mb = 40;  // margins
  const double pw = w - ml - mr, ph = h - mt - mb;
  auto X = [&](double s) { return x0 + ml + pw * (max_step > 0 ? s / max_step : 0); };
  auto Y = [&](double v) { return y0 + mt + ph * (1 - (v - lo) / (hi - lo)); };
  std::string out = fmt::format(R"(<text x="{:.1f}" y="{:.1f}" font-size="15" font-weight="bold">{}</text>)" "\n",
                                x0 + ml, y0 + 20, title);
  out += fmt::format(R"(<rect x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{:.1f}" fill="none" stroke="#888"/>)" "\n",
                     x0 + ml, y0 + mt, pw, ph);
  // Ticks counted, not accumulated: at most a dozen whatever the values.
  const double ys = TickStep(hi - lo, 5), first_tick = std::ceil(lo / ys);
  for (int k = 0; k < 12; ++k) {
    const double v = (first_tick + k) * ys;
    if (v > hi + 1e-9 * ys) break;
    out += fmt::format(R"(<line x1="{:.1f}" x2="{:.1f}" y1="{:.1f}" y2="{:.1f}" stroke="#eee"/>)"
                       R"(<text x="{:.1f}" y="{:.1f}" font-size="11" text-anchor="end">{}</text>)" "\n",
                       x0 + ml, x0 + ml + pw, Y(v), Y(v), x0 + ml - 5, Y(v) + 4,
                       percent ? fmt::format("{:g}%", std::round(v * 1000) / 10) : fmt::format("{:g}", v));
  }
  const double xs = TickStep(std::max(max_step, 1.0), 6);
  for (int k = 0; k < 12; ++k) {
    const double s = k * xs;
    if (s > max_step + 1e-9 * xs) break;
    out += fmt::format(R"(<text x="{:.1f}" y="{:.1f}" font-size="11" text-anchor="middle">{:g}</text>)" "\n", X(s),
                       y0 + mt + ph + 16, s);
  }
  out += fmt::format(R"(<text x="{:.1f}" y="{:.1f}" font-size="12" text-anchor="middle">step</text>)" "\n",
                     x0 + ml + pw / 2, y0 + h - 6);
  int shown = 0;
  for (const auto& s : series) shown += s.points.empty() ? 0 : 1;
  double ly = percent ? y0 + mt + ph - 16 * shown + 4 : y0 + mt + 14;
  for (const auto& s : series) {
    if (s.points.empty()) continue;
    std::string path;
    for (const auto& [x, y] : s.points) {
      if (std::isfinite(y)) path += fmt::format("{}{:.1f},{:.1f}", path.empty() ? "M" : " L", X(x), Y(y));
    }
    out += fmt::format(R"(<path d="{}" fill="none" stroke="{}" stroke-width="1.6"{}/>)" "\n", path, s.color,
                       s.dashed ? R"( stroke-dasharray="5,3")" : "");
    if (s.points.size() <= 60) {
      for (const auto& [x, y] : s.points) {
        if (!std::isfinite(y)) continue;
        out += fmt::format(R"(<circle cx="{:.1f}" cy="{:.1f}" r="2.2" fill="{}"/>)", X(x), Y(y), s.color);
      }
      out += "\n";
    }
    out += fmt::format(R"(<line x1="{:.1f}" x2="{:.1f}" y1="{:.1f}" y2="{:.1f}" stroke="{}" stroke-width="2"/>)"
                       R"(<text x="{:.1f}" y="{:.1f}" font-size="11">{}</text>)" "\n",
                       x0 + ml + pw - 130, x0 + ml + pw - 110, ly, ly, s.color, x0 + ml + pw - 105, ly + 4, s.label);
    ly += 16;
  }
  return out;
}

}  // namespace

Result<bool> WritePlot(const std::string& metrics_path, const std::string& svg_path) {
  std::ifstream in(metrics_path);
  if (!in) return IoError(fmt::format("cannot read {}", metrics_path));
  Series train_loss{"train loss", "#1f77b4"}, val_loss{"val loss", "#d62728"};
  Series train_top1{"train top-1", "#1f77b4"}, val_top1{"val top-1", "#d62728"}, val_top5{"val top-5", "#2ca02c", true};
  double max_step = 0;
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object() || !j.contains("type") || !j["type"].is_string() || !j.contains("step") ||
        !j["step"].is_number()) {
      continue;
    }
    const auto step = j["step"].get<double>();
    max_step = std::max(max_step, step);
    // A value that is missing (an interval of skipped steps has no loss) or not finite (written as
    // null) is no point: drawn at 0 it would read as a perfect loss.
    auto add = [&](Series& series, const char* key) {
      if (j.contains(key) && j[key].is_number() && std::isfinite(j[key].get<double>())) {
        series.points.emplace_back(step, j[key].get<double>());
      }
    };
    const std::string type = j["type"].get<std::string>();
    if (type == "train") {
      add(train_loss, "loss");
      add(train_top1, "top1");
    } else if (type == "val") {
      add(val_loss, "loss");
      add(val_top1, "top1");
      add(val_top5, "top5");
    }
  }
  if (train_loss.points.empty() && val_loss.points.empty()) return false;
  const double w = 520, h = 340;
  std::string svg = fmt::format(
      R"(<svg xmlns="http://www.w3.org/2000/svg" width="{:.0f}" height="{:.0f}" font-family="sans-serif">)" "\n"
      R"(<rect width="100%" height="100%" fill="white"/>)" "\n",
      2 * w, h);
  svg += Panel({train_loss, val_loss}, "loss", 0, 0, w, h, max_step, false);
  svg += Panel({train_top1, val_top1, val_top5}, "accuracy", w, 0, w, h, max_step, true);
  svg += "</svg>\n";
  STOKE_RETURN_IF_ERROR(WriteFileAtomic(svg_path, svg));
  return true;
}

}  // namespace stoke::train
