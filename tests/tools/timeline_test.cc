// The reading of `stoke bench train --timeline`: which step's compute each batch's copy ran under,
// and the device's idle time between steps, from intervals on the device's clock.
#include "tools/bench/timeline.h"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>

namespace stoke::bench {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

TEST(Timeline, EachCopyIsPlacedUnderTheStepWhoseComputeHoldsIt) {
  // Steps of 10 ms with 0.5 ms gaps; batch j copied during step j - 2 (a ring of 3), batch 1 half
  // in step 0 and half in the gap after it, batch 0 before the first timed step, one batch uploaded
  // from the host.
  const std::vector<TimelineRow> rows = {
      {0, 10, -3, -2},      {10.5, 20.5, 9, 11},  {21, 31, 2, 3},
      {31.5, 41.5, 12, 13}, {42, 52, 20.6, 20.9}, {52.5, 62.5, kNaN, kNaN},
  };
  const TimelineSummary s = SummarizeTimeline(rows);
  EXPECT_EQ(s.copies, 5);
  EXPECT_EQ(s.during_compute, 2);
  EXPECT_EQ(s.partly, 1);
  EXPECT_EQ(s.before, 1);
  EXPECT_EQ(s.idle, 1);  // 20.6-20.9 ms: between steps 1 and 2
  EXPECT_EQ(s.where, (std::vector<std::string>{"before", "partly step 0", "step 0", "step 1", "idle", "-"}));
  EXPECT_DOUBLE_EQ(s.median_idle_ms, 0.5);
  EXPECT_DOUBLE_EQ(s.max_idle_ms, 0.5);
  EXPECT_DOUBLE_EQ(s.median_step_ms, 10);

  const std::string text = DescribeTimeline(rows, 4);
  EXPECT_NE(text.find("copies within a timed step's compute: 2 of the 4 made during the timed steps (partly: 1, "
                      "while the device idled: 1); 1 already in the ring"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("... 2 more steps"), std::string::npos) << text;
  EXPECT_NE(text.find("median 0.500 ms"), std::string::npos) << text;
}

TEST(Timeline, NoRowsGiveAnEmptySummary) {
  const TimelineSummary s = SummarizeTimeline({});
  EXPECT_EQ(s.copies, 0);
  EXPECT_EQ(s.median_idle_ms, 0);
  EXPECT_NE(DescribeTimeline({}).find("0 of the 0"), std::string::npos);
}

TEST(Timeline, OneStepHasNoIdleFigure) {
  const std::vector<TimelineRow> rows = {{0, 10, 2, 3}};
  const std::string text = DescribeTimeline(rows);
  EXPECT_NE(text.find("device idle between steps: n/a (one step); step 10.000 ms"), std::string::npos) << text;
  EXPECT_EQ(text.find("% idle"), std::string::npos) << text;
}

}  // namespace
}  // namespace stoke::bench
