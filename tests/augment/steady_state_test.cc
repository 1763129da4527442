// Once warm, producing a sample (header, plan, region decode, resize/flip into a slot) allocates
// nothing in stoke's code: the decoder's output image and the slot are reused. What remains is
// inside the libraries: cv::resize builds its two interpolation tables (a few KB) per call, and
// libjpeg's per-image pool is C malloc released at the end of every image. Both are small and
// recycled by the allocator's free lists; this test pins the count so that nothing else creeps in.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "augment/crop_plan.h"
#include "augment/transform.h"
#include "common/random.h"
#include "decode/jpeg_decoder.h"
#include "tests/testing/test_util.h"

namespace {
thread_local bool t_counting = false;
std::atomic<int64_t> g_news{0};
}  // namespace

// Replacements for the whole test binary; they count only on a thread that asked to. (GCC cannot
// see that the replaced new and delete pair up through malloc/free.)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t n) {
  if (t_counting) g_news.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace stoke::augment {
namespace {

TEST(SteadyState, NoHeapAllocationPerSampleOnceWarm) {
  std::vector<std::vector<std::byte>> jpegs;
  // Largest first, so warming up sizes every buffer for what follows.
  for (int i = 0; i < 12; ++i) {
    jpegs.push_back(testing::EncodeJpeg(testing::MakeImage(640 - 20 * i, 480 - 10 * i, 3, i)));
  }
  jpegs.push_back(testing::EncodeJpeg(testing::MakeImage(300, 200, 1, 5)));  // grayscale
  UseCallerThreadsOnly();
  decode::JpegDecoder decoder;
  Image decoded;
  std::vector<uint8_t> slot(64 * 64 * 3);
  RandomResizedCropOptions options{.size = 64};
  auto sample = [&](size_t i, int64_t epoch, bool augment) {
    auto info = decoder.ReadHeader(jpegs[i]);
    ASSERT_TRUE(info.ok());
    SplitMix64 rng = SampleRng(3, epoch, static_cast<int64_t>(i));
    CropPlan plan = PlanRandomResizedCrop(info->width, info->height, options, rng);
    const int d = decode::ChooseRegionScale(static_cast<int>(plan.region.width),
                                            static_cast<int>(plan.region.height), 64, 64);
    plan = SnapToScale(plan, d, info->width, info->height);
    auto where = decoder.DecodeRegion(jpegs[i],
                                      {static_cast<int>(plan.region.x), static_cast<int>(plan.region.y),
                                       static_cast<int>(plan.region.width),
                                       static_cast<int>(plan.region.height)},
                                      64, 64, &decoded, d);
    ASSERT_TRUE(where.ok()) << where.status().ToString();
    if (!augment) return;
    ImageView view{decoded.pixels.data(), decoded.width, decoded.height, decoded.channels,
                   decoded.row_bytes()};
    ASSERT_OK(ApplyPlan(view, {where->x, where->y, where->width, where->height}, plan, slot));
  };
  // Warm up: a full-image region of the largest picture, then every picture once.
  ASSERT_OK(decoder.Decode(jpegs[0], &decoded));
  for (size_t i = 0; i < jpegs.size(); ++i) sample(i, 0, true);

  auto count = [&](bool augment) {
    g_news = 0;
    t_counting = true;
    for (int64_t epoch = 1; epoch <= 5; ++epoch) {
      for (size_t i = 0; i < jpegs.size(); ++i) sample(i, epoch, augment);
    }
    t_counting = false;
    return g_news.load();
  };
  const int64_t samples = 5 * static_cast<int64_t>(jpegs.size());
  // Header, plan and region decode: none at all.
  EXPECT_EQ(count(false), 0) << "operator new calls over " << samples << " decodes";
  // Plus resize/flip: only cv::resize's two tables.
  const int64_t plain = count(true);
  EXPECT_LE(plain, 2 * samples) << "over " << samples << " samples";
  // Colour jitter adds none: the plans are the same (the jitter draws are made either way), and
  // the contrast step's gray image is a reused scratch (it allocated one for 5 samples in 6).
  options.brightness = options.contrast = options.saturation = 0.4;
  for (size_t i = 0; i < jpegs.size(); ++i) sample(i, 0, true);
  EXPECT_LE(count(true), plain + samples / 8) << "over " << samples << " samples with colour jitter";
}

}  // namespace
}  // namespace stoke::augment
