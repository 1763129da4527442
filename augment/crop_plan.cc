#include "augment/crop_plan.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>

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
  // CenterCrop(crop) on the resized image, mapped back to source pixels. Its offset is rounded
  // half to even, as torchvision's (Python's round): (341 - 224) / 2 = 58.5 is 58, not 59.
  const double top = std::nearbyint((rh - crop) / 2.0), left = std::nearbyint((rw - crop) / 2.0);
  // In source pixels, rounded to whole pixels and kept inside the image.
  const double x0 = std::clamp(std::round(left / scale), 0.0, width - 1.0);
  const double y0 = std::clamp(std::round(top / scale), 0.0, height - 1.0);
  const double x1 = std::clamp(std::round((left + crop) / scale), x0 + 1, static_cast<double>(width));
  const double y1 = std::clamp(std::round((top + crop) / scale), y0 + 1, static_cast<double>(height));
  plan.region = {x0, y0, x1 - x0, y1 - y0};
  return plan;
}

CropPlan SnapToScale(const CropPlan& plan, int d, int width, int height) {
  if (d <= 1) return plan;
  CropPlan out = plan;
  // Whole decoded pixels of the image at 1/d: [0, floor(size / d)) (the last partial one, if
  // any, is left out so that a full decode covers the same source pixels).
  auto snap = [d](double lo, double len, int size) {
    const int cells = std::max(1, size / d);
    int a = static_cast<int>(std::lround(lo / d));
    int b = static_cast<int>(std::lround((lo + len) / d));
    // Narrower than a cell, both edges can round to one grid line: the cell holding the region's
    // start, not the next one (which moved the far edge by d and missed the region itself).
    if (b <= a) a = static_cast<int>(std::floor(lo / d));
    a = std::clamp(a, 0, cells - 1);
    b = std::clamp(b, a + 1, cells);
    return std::pair<double, double>(a * d, (b - a) * d);
  };
  std::tie(out.region.x, out.region.width) = snap(plan.region.x, plan.region.width, width);
  std::tie(out.region.y, out.region.height) = snap(plan.region.y, plan.region.height, height);
  // A tiny image (under d pixels) keeps its own size.
  out.region.width = std::min(out.region.width, static_cast<double>(width) - out.region.x);
  out.region.height = std::min(out.region.height, static_cast<double>(height) - out.region.y);
  return out;
}

}  // namespace stoke::augment
