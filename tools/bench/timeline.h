// The copy/compute timeline of `stoke bench train --timeline N`: for each timed step, when its
// compute ran and when its batch's host-to-device copy ran, on the device's clock (milliseconds
// from one mark). DescribeTimeline reads it: which step's compute each copy ran under (with a ring
// of several slots, batch k+1 is usually copied while step k, or an earlier one, computes), and
// how long the device sat idle between steps.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "train/network.h"

namespace stoke::bench {

using TimelineRow = train::StepTimeline;

struct TimelineSummary {
  int copies = 0;          // rows with a copy
  int during_compute = 0;  // copies that ran entirely within one timed step's compute
  int partly = 0;          // copies that overlapped a step's compute only in part
  int before = 0;          // copies that ran before the first timed step began
  int idle = 0;            // copies that ran while no timed step computed
  std::vector<double> idle_ms;  // device idle before each step after the first
  double median_idle_ms = 0, max_idle_ms = 0, median_step_ms = 0;
  std::vector<std::string> where;  // per row: "step 3", "partly step 3", "before", "idle", "-"
};

TimelineSummary SummarizeTimeline(std::span<const TimelineRow> rows);

// A table of the first `show` rows (compute and copy intervals, where each copy ran, the idle
// gap before the step) and the summary lines; indented for the bench report.
std::string DescribeTimeline(std::span<const TimelineRow> rows, int show = 12);

}  // namespace stoke::bench
