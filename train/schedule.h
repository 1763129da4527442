// Learning-rate schedules, evaluated per step from the fractional epoch, so that a run resumed
// at any step continues on exactly the same curve.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace stoke::train {

struct ScheduleConfig {
  std::string type = "cosine";     // constant | step | multistep | cosine
  double warmup_epochs = 0;        // linear ramp from warmup_start * lr to lr
  double warmup_start = 0.1;       // [0, 1]
  int step_epochs = 30;            // step: multiply by gamma every step_epochs
  std::vector<int> milestones;     // multistep: multiply by gamma at each of these epochs
  double gamma = 0.1;              // (0, 1]
  double min_lr = 0;               // cosine: the floor, as a fraction of lr
};

// The learning rate at `step` of a run of `total_epochs` with `steps_per_epoch` steps, peak `lr`.
double LearningRate(const ScheduleConfig& schedule, double lr, int64_t step, int64_t steps_per_epoch,
                    int total_epochs);

}  // namespace stoke::train
