// Turning decoded pixels into a sample: crop + resize + flip + colour jitter into a caller's
// buffer (a batch slot), and normalisation to float for the CPU backend.
#pragma once

#include <array>
#include <limits>
#include <cstddef>
#include <cstdint>
#include <span>

#include "augment/crop_plan.h"
#include "common/status.h"

namespace stoke::augment {

// Read-only interleaved uint8 pixels (1 or 3 channels) with a row stride in bytes.
struct ImageView {
  const uint8_t* data = nullptr;
  int width = 0;
  int height = 0;
  int channels = 3;
  size_t stride = 0;  // bytes per row; >= width * channels
};

// Writes the sample for `plan` into dst: plan.out_height rows of plan.out_width RGB pixels (HWC,
// no padding; dst.size() must be exactly that). `region` is where plan.region lies in `src`: the
// DecodedRegion a region decode returned, or plan.region itself after a full decode. Bilinear
// sampling with exact fractional coordinates (the flip folded into the same pass); area
// averaging when shrinking by more than 2x. 1-channel sources come out as RGB.
// kInvalidArgument for a wrong dst size, an empty region or an unsupported channel count.
// Thread-safe (per-thread scratch); allocation-free once warm for 3-channel sources.
Status ApplyPlan(const ImageView& src, const RectF& region, const CropPlan& plan,
                 std::span<uint8_t> dst);

// Makes OpenCV run its functions on the calling thread only. stoke parallelises across samples;
// OpenCV's own thread pool would split each small image across cores and cost more in hand-offs
// than it saves. Process-wide; call once before the worker threads start.
void UseCallerThreadsOnly();

enum class Layout { kNCHW, kNHWC };
enum class DType { kFloat32, kFloat16 };

struct NormalizeOptions {
  // In [0, 1] units (pixels are divided by 255 first), ImageNet's by default.
  std::array<float, 3> mean = {0.485f, 0.456f, 0.406f};
  std::array<float, 3> std = {0.229f, 0.224f, 0.225f};  // each > 0
  Layout layout = Layout::kNCHW;
  DType dtype = DType::kFloat32;
};

// Whether (x - mean) / std, x in [0, 1], is a usable normalisation: every mean and std finite,
// every std > 0, and every output within `largest` (the output type's largest finite value:
// 65504 for float16, FLT_MAX for float32 and bfloat16). kInvalidArgument naming the channel.
Status ValidateNormalize(const std::array<float, 3>& mean, const std::array<float, 3>& std, double largest);
inline constexpr double kFloat16Largest = 65504.0;
// The `largest` ValidateNormalize takes for float16 output, or for float32 / bfloat16.
inline double NormalizeLimit(bool float16) {
  return float16 ? kFloat16Largest : std::numeric_limits<float>::max();
}

// Bytes Normalize() writes for `count` images of width x height.
size_t NormalizedBytes(int count, int width, int height, DType dtype);

// Converts `count` consecutive HWC uint8 RGB images of width x height into dst as
// (x / 255 - mean) / std per channel, in the given layout and dtype. kInvalidArgument for
// mismatched sizes or what ValidateNormalize refuses.
Status Normalize(std::span<const uint8_t> src, int count, int width, int height,
                 const NormalizeOptions& options, std::span<std::byte> dst);

}  // namespace stoke::augment
