// Fuzz target: arbitrary bytes through everything stoke does with a JPEG: header parse, the
// loader's per-sample path (plan from the header, region decode at the chosen DCT scale, resize
// and flip into a slot), strict full and scaled decodes, validation, and a lenient decode.
// Any outcome but a crash, a sanitizer report, a hang or an allocation past the caps is fine.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "augment/crop_plan.h"
#include "augment/transform.h"
#include "common/image.h"
#include "common/random.h"
#include "decode/jpeg_decoder.h"

using namespace stoke;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Caps well below the defaults so one input cannot take seconds: 4 Mpixel, 64 scans.
  static decode::JpegDecoder strict({.max_pixels = 4'000'000, .max_scans = 64});
  static decode::JpegDecoder lenient({.max_pixels = 4'000'000, .max_scans = 64, .strict = false});
  static Image image;
  static std::vector<uint8_t> slot;
  const std::span<const std::byte> jpeg(reinterpret_cast<const std::byte*>(data), size);
  (void)decode::LooksLikeJpeg(jpeg);
  auto info = strict.ReadHeader(jpeg);
  if (!info.ok()) return 0;

  // The loader's sample path, with a crop keyed by the input.
  SplitMix64 rng(size * 0x9E3779B97F4A7C15ull + (size ? data[size / 2] : 0));
  augment::RandomResizedCropOptions crop;
  crop.size = 24;
  crop.brightness = crop.contrast = crop.saturation = 0.3;
  augment::CropPlan plan = augment::PlanRandomResizedCrop(info->width, info->height, crop, rng);
  const int d = decode::ChooseRegionScale(static_cast<int>(plan.region.width), static_cast<int>(plan.region.height),
                                          plan.out_width, plan.out_height);
  plan = augment::SnapToScale(plan, d, info->width, info->height);
  const decode::Region region{static_cast<int>(plan.region.x), static_cast<int>(plan.region.y),
                              static_cast<int>(plan.region.width), static_cast<int>(plan.region.height)};
  auto decoded = strict.DecodeRegion(jpeg, region, plan.out_width, plan.out_height, &image, d);
  if (decoded.ok()) {
    slot.resize(static_cast<size_t>(plan.out_width) * plan.out_height * 3);
    const augment::ImageView view{image.pixels.data(), image.width, image.height, image.channels, image.row_bytes()};
    (void)augment::ApplyPlan(view, {decoded->x, decoded->y, decoded->width, decoded->height}, plan, slot);
  }
  (void)strict.Decode(jpeg, &image, 8);
  (void)strict.Validate(jpeg);
  if (static_cast<int64_t>(info->width) * info->height <= 1'000'000) {
    (void)strict.Decode(jpeg, &image, 1);
    (void)lenient.Decode(jpeg, &image, 2);
  }
  return 0;
}
