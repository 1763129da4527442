#include "augment/crop_plan.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace stoke::augment {

Status ValidateOptions(const RandomResizedCropOptions& o) {
  if (o.size <= 0) return InvalidArgumentError(fmt::format("crop: size {} must be > 0", o.size));
  if (!(o.scale_min > 0 && o.scale_min <= o.scale_max && o.scale_max <= 1)) {
    return InvalidArgumentError(fmt::format("crop: scale range [{}, {}] must satisfy 0 < min <= max <= 1",
                                            o.scale_min, o.scale_max));
  }
  if (!(o.ratio_min > 0 && o.ratio_min <= o.ratio_max)) {
    return InvalidArgumentError(fmt::format("crop: ratio range [{}, {}] must satisfy 0 < min <= max",
                                            o.ratio_min, o.ratio_max));
  }
  if (!(o.flip_p >= 0 && o.flip_p <= 1)) {
    return InvalidArgumentError(fmt::format("crop: flip probability {} not in [0, 1]", o.flip_p));
  }
  for (double j : {o.brightness, o.contrast, o.saturation}) {
    if (!(j >= 0 && j < 1)) {
      return InvalidArgumentError(fmt::format("crop: jitter strength {} not in [0, 1)", j));
    }
  }
  return OkStatus();
}

CropPlan PlanRandomResizedCrop(int width, int height, const RandomResizedCropOptions& o,
                               SplitMix64& rng) {
  CropPlan plan;
  plan.out_width = plan.out_height = o.size;
  const double area = static_cast<double>(width) * height;
  const double log_lo = std::log(o.ratio_min), log_hi = std::log(o.ratio_max);
  bool found = false;
  for (int attempt = 0; attempt < 10 && !found; ++attempt) {
    const double target_area = area * Uniform(rng, o.scale_min, o.scale_max);
    const double aspect = std::exp(Uniform(rng, log_lo, log_hi));
    const int w = static_cast<int>(std::lround(std::sqrt(target_area * aspect)));
    const int h = static_cast<int>(std::lround(std::sqrt(target_area / aspect)));
    if (w > 0 && w <= width && h > 0 && h <= height) {
      const auto top = static_cast<int>(rng.Below(static_cast<uint64_t>(height - h + 1)));
      const auto left = static_cast<int>(rng.Below(static_cast<uint64_t>(width - w + 1)));
      plan.region = {static_cast<double>(left), static_cast<double>(top), static_cast<double>(w),
                     static_cast<double>(h)};
      found = true;
    }
  }
  if (!found) {
    // torchvision's fallback: the largest centred crop within the ratio range.
    const double in_ratio = static_cast<double>(width) / height;
    int w = width, h = height;
    if (in_ratio < o.ratio_min) {
      h = std::max(1, static_cast<int>(std::lround(w / o.ratio_min)));
    } else if (in_ratio > o.ratio_max) {
      w = std::max(1, static_cast<int>(std::lround(h * o.ratio_max)));
    }
    h = std::min(h, height);
    w = std::min(w, width);
    plan.region = {static_cast<double>((width - w) / 2), static_cast<double>((height - h) / 2),
                   static_cast<double>(w), static_cast<double>(h)};
  }
  // Always draw the same number of values, so a change of options does not shift later draws.
  const double flip_draw = Uniform01(rng);
  const double b = Uniform(rng, -1, 1), c = Uniform(rng, -1, 1), s = Uniform(rng, -1, 1);
  plan.flip = flip_draw < o.flip_p;
  plan.jitter = {1 + o.brightness * b, 1 + o.contrast * c, 1 + o.saturation * s};
  return plan;
}

CropPlan PlanCenterCrop(int width, int height, int resize, int crop) {
  CropPlan plan;
  plan.out_width = plan.out_height = crop;
  // Resize(resize): the shorter side becomes `resize`; the longer is truncated as torchvision does.
  const double scale = static_cast<double>(resize) / std::min(width, height);
  const int rw = width <= height ? resize : static_cast<int>(resize * static_cast<double>(width) / height);
  const int rh = width <= height ? static_cast<int>(resize * static_cast<double>(height) / width) : resize;
  // CenterCrop(crop) on the resized image, mapped back to source pixels.
  const double top = std::round((rh - crop) / 2.0), left = std::round((rw - crop) / 2.0);
  plan.region = {left / scale, top / scale, crop / scale, crop / scale};
  // Clamp to the image (a crop larger than the resized image would need padding: keep it inside).
  plan.region.x = std::max(0.0, plan.region.x);
  plan.region.y = std::max(0.0, plan.region.y);
  plan.region.width = std::min(plan.region.width, width - plan.region.x);
  plan.region.height = std::min(plan.region.height, height - plan.region.y);
  return plan;
}

}  // namespace stoke::augment
