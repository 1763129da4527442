#include "tools/bench/timeline.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "tools/bench/bench_stats.h"

namespace stoke::bench {

TimelineSummary SummarizeTimeline(std::span<const TimelineRow> rows) {
  TimelineSummary s;
  std::vector<double> steps;
  for (size_t j = 0; j < rows.size(); ++j) {
    const TimelineRow& r = rows[j];
    steps.push_back(r.compute_end_ms - r.compute_begin_ms);
    if (j > 0) s.idle_ms.push_back(std::max(0.0, r.compute_begin_ms - rows[j - 1].compute_end_ms));
    if (std::isnan(r.copy_begin_ms) || std::isnan(r.copy_end_ms)) {
      s.where.emplace_back("-");
      continue;
    }
    ++s.copies;
    // The step whose compute holds the copy, else the one it overlaps most.
    int inside = -1, most = -1;
    double most_ms = 0;
    for (size_t m = 0; m < rows.size(); ++m) {
      const double lo = std::max(r.copy_begin_ms, rows[m].compute_begin_ms);
      const double hi = std::min(r.copy_end_ms, rows[m].compute_end_ms);
      if (r.copy_begin_ms >= rows[m].compute_begin_ms && r.copy_end_ms <= rows[m].compute_end_ms) {
        inside = static_cast<int>(m);
        break;
      }
      if (hi - lo > most_ms) {
        most_ms = hi - lo;
        most = static_cast<int>(m);
      }
    }
    if (inside >= 0) {
      ++s.during_compute;
      s.where.push_back(fmt::format("step {}", inside));
    } else if (most >= 0) {
      ++s.partly;
      s.where.push_back(fmt::format("partly step {}", most));
    } else if (!rows.empty() && r.copy_end_ms <= rows.front().compute_begin_ms) {
      ++s.before;
      s.where.emplace_back("before");
    } else {
      ++s.idle;
      s.where.emplace_back("idle");
    }
  }
  s.median_step_ms = Median(steps);
  s.median_idle_ms = Median(s.idle_ms);
  s.max_idle_ms = s.idle_ms.empty() ? 0 : *std::max_element(s.idle_ms.begin(), s.idle_ms.end());
  return s;
}

std::string DescribeTimeline(std::span<const TimelineRow> rows, int show) {
  const TimelineSummary s = SummarizeTimeline(rows);
  std::string out = fmt::format(
      "  timeline, {} end-to-end steps on the device's clock (ms from the timeline's mark; a batch "
      "copied before it is negative):\n"
      "    {:>4}  {:^21}  {:^21}  {:17}  {}\n",
      rows.size(), "step", "compute", "its batch's copy", "copy ran during", "idle before (ms)");
  for (size_t j = 0; j < rows.size() && static_cast<int>(j) < show; ++j) {
    const TimelineRow& r = rows[j];
    const std::string copy = std::isnan(r.copy_begin_ms)
                                 ? std::string("(not the ring's)")
                                 : fmt::format("{:9.3f} - {:9.3f}", r.copy_begin_ms, r.copy_end_ms);
    out += fmt::format("    {:4}  {:9.3f} - {:9.3f}  {:21}  {:17}  {}\n", j, r.compute_begin_ms, r.compute_end_ms,
                       copy, s.where[j], j == 0 ? std::string("-") : fmt::format("{:.3f}", s.idle_ms[j - 1]));
  }
  if (static_cast<int>(rows.size()) > show) out += fmt::format("    ... {} more steps\n", rows.size() - show);
  // The batches already in the ring when the timed steps began were copied under earlier, untimed
  // steps: they are counted apart, not as copies that missed the compute.
  out += fmt::format(
      "  copies within a timed step's compute: {} of the {} made during the timed steps (partly: {}, while the "
      "device idled: {}); {} already in the ring\n",
      s.during_compute, s.copies - s.before, s.partly, s.idle, s.before);
  if (s.idle_ms.empty()) {
    out += fmt::format("  device idle between steps: n/a (one step); step {:.3f} ms\n", s.median_step_ms);
  } else {
    out += fmt::format(
        "  device idle between steps: median {:.3f} ms, max {:.3f} ms; step {:.3f} ms (median): {:.2f}% idle\n",
        s.median_idle_ms, s.max_idle_ms, s.median_step_ms,
        s.median_step_ms + s.median_idle_ms > 0 ? 100 * s.median_idle_ms / (s.median_step_ms + s.median_idle_ms)
                                                : 0.0);
  }
  return out;
}

}  // namespace stoke::bench
