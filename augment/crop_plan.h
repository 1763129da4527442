// Crop plans: which region of an image a sample uses and at what output size, decided from the
// image size alone, before any decoding (so the decoder can decode just that region).
#pragma once

#include <cstdint>

#include "common/random.h"
#include "common/status.h"

namespace stoke::augment {

// A rectangle in source-image pixels (edges, not centres): x in [0, width of the image].
struct RectF {
  double x = 0, y = 0, width = 0, height = 0;
  bool operator==(const RectF&) const = default;
};

struct ColorJitter {
  double brightness = 1;  // multiply every channel
  double contrast = 1;    // blend with the image's mean gray
  double saturation = 1;  // blend each pixel with its own gray
  bool enabled() const { return brightness != 1 || contrast != 1 || saturation != 1; }
  bool operator==(const ColorJitter&) const = default;
};

// Everything needed to turn a decoded image into one sample. A value type.
struct CropPlan {
  RectF region;        // in source-image pixels; the planners below make it integral
  int out_width = 0;
  int out_height = 0;
  bool flip = false;   // horizontal
  ColorJitter jitter;
  bool operator==(const CropPlan&) const = default;
};

// torchvision's RandomResizedCrop (with its 10 attempts and centre-crop fallback), a horizontal
// flip with probability flip_p, and colour jitter factors drawn from [1-x, 1+x].
struct RandomResizedCropOptions {
  int size = 224;             // square output side; > 0
  double scale_min = 0.08;    // area fraction range; 0 < min <= max <= 1
  double scale_max = 1.0;
  double ratio_min = 3.0 / 4; // aspect (w/h) range; 0 < min <= max
  double ratio_max = 4.0 / 3;
  double flip_p = 0.5;        // [0, 1]
  double brightness = 0;      // jitter strengths; [0, 1)
  double contrast = 0;
  double saturation = 0;
};
Status ValidateOptions(const RandomResizedCropOptions& o);

// Plans a training sample for a width x height image from `rng` (use SampleRng(seed, epoch,
// index) for determinism). The region is integral and inside the image. Options must be valid.
CropPlan PlanRandomResizedCrop(int width, int height, const RandomResizedCropOptions& options,
                               SplitMix64& rng);

// Evaluation: resize the shorter side to `resize` then take the centre crop x crop, as
// torchvision's Resize(resize) + CenterCrop(crop). Expressed as one region of the source image
// (rounded to whole source pixels), so a single resize produces it. No flip, no jitter.
CropPlan PlanCenterCrop(int width, int height, int resize = 256, int crop = 224);

// Moves the region's edges to multiples of `scale_denom` (1, 2, 4, 8) within a width x height
// image, so that at that DCT scale it covers whole decoded pixels: a region decode then resizes
// exactly as a full decode of the same plan would. Edges move by less than scale_denom pixels
// (but in the image's partial last cell, which no whole decoded pixel covers); the region keeps
// at least one decoded pixel per side.
CropPlan SnapToScale(const CropPlan& plan, int scale_denom, int width, int height);

}  // namespace stoke::augment
