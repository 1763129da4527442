#include "train/schedule.h"

#include <cmath>
#include <numbers>

namespace stoke::train {

double LearningRate(const ScheduleConfig& s, double lr, int64_t step, int64_t steps_per_epoch, int total_epochs) {
  const double epoch = static_cast<double>(step) / static_cast<double>(steps_per_epoch > 0 ? steps_per_epoch : 1);
  if (s.warmup_epochs > 0 && epoch < s.warmup_epochs) {
    const double t = epoch / s.warmup_epochs;
    return lr * (s.warmup_start + (1 - s.warmup_start) * t);
  }
  if (s.type == "step") {
    return lr * std::pow(s.gamma, std::floor(epoch / s.step_epochs));
  }
  if (s.type == "multistep") {
    int passed = 0;
    for (int m : s.milestones) passed += epoch >= m ? 1 : 0;
    return lr * std::pow(s.gamma, passed);
  }
  if (s.type == "cosine") {
    // Cosine from the end of the warm-up to the end of the run.
    const double span = total_epochs - s.warmup_epochs;
    const double t = span > 0 ? std::min(1.0, (epoch - s.warmup_epochs) / span) : 1.0;
    const double floor = lr * s.min_lr;
    return floor + (lr - floor) * 0.5 * (1 + std::cos(std::numbers::pi * t));
  }
  return lr;  // constant
}

}  // namespace stoke::train
