// Tests for augment/ (crop plans, resize/flip/jitter, normalisation) and for region decoding
// composed with it, as prefetch/ will compose them: region + scaled decode followed by the plan
// must agree with a full decode followed by the same plan.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <thread>

#include <fmt/format.h>
#include <opencv2/core.hpp>

#include "augment/crop_plan.h"
#include "augment/transform.h"
#include "common/random.h"
#include "decode/jpeg_decoder.h"
#include "tests/testing/test_util.h"

namespace stoke::augment {
namespace {
namespace fs = std::filesystem;

ImageView View(const Image& img) {
  return {img.pixels.data(), img.width, img.height, img.channels, img.row_bytes()};
}

double Psnr(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  double mse = 0;
  for (size_t i = 0; i < a.size(); ++i) mse += std::pow(static_cast<double>(a[i]) - static_cast<double>(b[i]), 2);
  mse /= static_cast<double>(a.size());
  return mse == 0 ? 99.0 : 10 * std::log10(255.0 * 255.0 / mse);
}

double Mse(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  double mse = 0;
  for (size_t i = 0; i < a.size(); ++i) mse += std::pow(static_cast<double>(a[i]) - static_cast<double>(b[i]), 2);
  return mse / static_cast<double>(a.size());
}

double Mad(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += std::abs(int{a[i]} - int{b[i]});
  return sum / static_cast<double>(a.size());
}

TEST(RandomResizedCrop, RegionsAreInsideIntegralAndInRange) {
  RandomResizedCropOptions o;
  ASSERT_OK(ValidateOptions(o));
  for (auto [w, h] : std::vector<std::pair<int, int>>{{500, 375}, {375, 500}, {224, 224}, {2400, 1600}, {68, 56}}) {
    for (int i = 0; i < 500; ++i) {
      SplitMix64 rng = SampleRng(7, 0, i);
      CropPlan p = PlanRandomResizedCrop(w, h, o, rng);
      ASSERT_GE(p.region.x, 0);
      ASSERT_GE(p.region.y, 0);
      ASSERT_LE(p.region.x + p.region.width, w);
      ASSERT_LE(p.region.y + p.region.height, h);
      ASSERT_EQ(p.region.x, std::floor(p.region.x));
      ASSERT_GT(p.region.width, 0);
      EXPECT_EQ(p.out_width, 224);
    }
  }
}

TEST(RandomResizedCrop, DistributionMatchesTorchvisionSemantics) {
  // With areas of 8-25% of a 500x375 image every first attempt fits, so the area fraction is
  // uniform on [0.08, 0.25] (mean 0.165) and log(aspect) uniform on [log 3/4, log 4/3] (mean 0),
  // as torchvision draws them.
  RandomResizedCropOptions o{.scale_min = 0.08, .scale_max = 0.25};
  double area = 0, log_ratio = 0, flips = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    SplitMix64 rng = SampleRng(1, 2, i);
    CropPlan p = PlanRandomResizedCrop(500, 375, o, rng);
    area += p.region.width * p.region.height / (500.0 * 375.0);
    log_ratio += std::log(p.region.width / p.region.height);
    flips += p.flip;
  }
  EXPECT_NEAR(area / n, 0.165, 0.005);
  EXPECT_NEAR(log_ratio / n, 0.0, 0.01);
  EXPECT_NEAR(flips / n, 0.5, 0.02);
}

TEST(RandomResizedCrop, DefaultRangesHold) {
  // With the defaults, large areas often miss and are redrawn (favouring smaller crops, as in
  // torchvision), but every crop stays within the scale and ratio ranges up to rounding.
  RandomResizedCropOptions o;
  for (int i = 0; i < 5000; ++i) {
    SplitMix64 rng = SampleRng(4, 0, i);
    CropPlan p = PlanRandomResizedCrop(500, 375, o, rng);
    const double area = p.region.width * p.region.height / (500.0 * 375.0);
    const double ratio = p.region.width / p.region.height;
    ASSERT_GE(area, 0.08 * 0.97);
    ASSERT_LE(area, 1.0);
    ASSERT_GE(ratio, 0.75 * 0.97);
    ASSERT_LE(ratio, 4.0 / 3 * 1.03);
  }
}

TEST(RandomResizedCrop, FallsBackToACentreCropWithinTheRatio) {
  // A 1000x10 strip: no attempt fits the 3/4..4/3 ratio, so the fallback crops 13x10 centred.
  RandomResizedCropOptions o;
  SplitMix64 rng(3);
  CropPlan p = PlanRandomResizedCrop(1000, 10, o, rng);
  EXPECT_EQ(p.region.height, 10);
  EXPECT_EQ(p.region.width, 13);
  EXPECT_EQ(p.region.x, (1000 - 13) / 2);
}

TEST(RandomResizedCrop, SameKeySamePlan) {
  RandomResizedCropOptions o{.brightness = 0.4, .contrast = 0.4, .saturation = 0.4};
  SplitMix64 a = SampleRng(5, 3, 1234), b = SampleRng(5, 3, 1234), c = SampleRng(5, 3, 1235);
  CropPlan pa = PlanRandomResizedCrop(640, 480, o, a);
  EXPECT_EQ(pa, PlanRandomResizedCrop(640, 480, o, b));
  EXPECT_NE(pa, PlanRandomResizedCrop(640, 480, o, c));
  EXPECT_GE(pa.jitter.brightness, 0.6);
  EXPECT_LE(pa.jitter.brightness, 1.4);
}

TEST(RandomResizedCrop, RejectsBadOptions) {
  EXPECT_EQ(ValidateOptions({.size = 0}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateOptions({.scale_min = 0.5, .scale_max = 0.2}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateOptions({.ratio_min = 0}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateOptions({.flip_p = 2}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateOptions({.brightness = 1.5}).code(), StatusCode::kInvalidArgument);
}

TEST(CenterCrop, MatchesResizeThenCentreCrop) {
  CropPlan p = PlanCenterCrop(500, 375, 256, 224);
  const double s = 256.0 / 375;  // resized to 341x256
  // The same rectangle, rounded to whole source pixels. torchvision's offset rounds half to even:
  // (341 - 224) / 2 = 58.5 -> 58 resized pixels, 84.96 source pixels (59 gave 86.4, a whole output
  // pixel off).
  EXPECT_NEAR(p.region.width, 224 / s, 1.0);
  EXPECT_NEAR(p.region.x, 58 / s, 0.5);
  EXPECT_EQ(p.region.x, 85);
  EXPECT_NEAR(p.region.y, 16 / s, 0.5);
  EXPECT_EQ(p.region.x, std::round(p.region.x));
  EXPECT_FALSE(p.flip);
  EXPECT_FALSE(p.jitter.enabled());
}

TEST(ApplyPlan, IdentityPlanCopiesThePixels) {
  Image src = testing::MakeImage(40, 30, 3, 1);
  CropPlan p{.region = {0, 0, 40, 30}, .out_width = 40, .out_height = 30};
  std::vector<uint8_t> out(40 * 30 * 3);
  ASSERT_OK(ApplyPlan(View(src), p.region, p, out));
  EXPECT_EQ(out, src.pixels);
}

TEST(ApplyPlan, FlipTwiceIsTheIdentity) {
  Image src = testing::MakeImage(37, 23, 3, 4);
  CropPlan p{.region = {0, 0, 37, 23}, .out_width = 37, .out_height = 23, .flip = true};
  std::vector<uint8_t> once(37 * 23 * 3), twice(37 * 23 * 3);
  ASSERT_OK(ApplyPlan(View(src), p.region, p, once));
  EXPECT_NE(once, src.pixels);
  EXPECT_EQ(once[0], src.pixels[36 * 3]);  // first pixel of a row is the last of the source row
  ImageView flipped{once.data(), 37, 23, 3, 37 * 3};
  ASSERT_OK(ApplyPlan(flipped, p.region, p, twice));
  EXPECT_EQ(twice, src.pixels);
}

TEST(ApplyPlan, GraySourcesBecomeRgbAndCropsLandInPlace) {
  Image gray = testing::MakeImage(50, 40, 1, 2);
  CropPlan p{.region = {10, 5, 20, 20}, .out_width = 20, .out_height = 20};
  std::vector<uint8_t> out(20 * 20 * 3);
  ASSERT_OK(ApplyPlan(View(gray), p.region, p, out));
  for (int y = 0; y < 20; ++y) {
    for (int x = 0; x < 20; ++x) {
      const uint8_t want = gray.row(y + 5)[x + 10];
      for (int c = 0; c < 3; ++c) ASSERT_EQ(out[(y * 20 + x) * 3 + c], want);
    }
  }
}

TEST(ApplyPlan, ShrinksAndJitters) {
  Image src = testing::MakeImage(400, 300, 3, 3);
  CropPlan plain{.region = {0, 0, 400, 300}, .out_width = 64, .out_height = 48};
  std::vector<uint8_t> base(64 * 48 * 3), bright(64 * 48 * 3), gray(64 * 48 * 3);
  ASSERT_OK(ApplyPlan(View(src), plain.region, plain, base));  // 6x shrink: area averaging
  CropPlan b = plain;
  b.jitter.brightness = 1.3;
  ASSERT_OK(ApplyPlan(View(src), b.region, b, bright));
  double sum_base = 0, sum_bright = 0;
  for (size_t i = 0; i < base.size(); ++i) sum_base += base[i], sum_bright += bright[i];
  EXPECT_GT(sum_bright, sum_base * 1.15);
  CropPlan s = plain;
  s.jitter.saturation = 0;  // no saturation: every pixel gray
  ASSERT_OK(ApplyPlan(View(src), s.region, s, gray));
  for (size_t i = 0; i < gray.size(); i += 3) {
    ASSERT_NEAR(gray[i], gray[i + 1], 1);
    ASSERT_NEAR(gray[i], gray[i + 2], 1);
  }
}

// A crop 3x wider than the output but half its height (a wide aspect-ratio range): the width is
// averaged, not sampled. Columns of period 3 (one lit, two dark) average to 85 everywhere.
TEST(ApplyPlan, ShrinkingOneAxisWhileGrowingTheOtherAverages) {
  Image src;
  src.Reshape(96, 8, 3);
  for (int y = 0; y < 8; ++y) {
    for (int x = 0; x < 96; ++x) {
      for (int c = 0; c < 3; ++c) src.row(y)[x * 3 + c] = x % 3 == 1 ? 255 : 0;
    }
  }
  CropPlan p{.region = {0, 0, 96, 8}, .out_width = 32, .out_height = 16};
  std::vector<uint8_t> out(32 * 16 * 3);
  ASSERT_OK(ApplyPlan(View(src), p.region, p, out));
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], 85, 1) << "at " << i / 3 % 32 << ", " << i / 96;
}

TEST(ApplyPlan, RejectsBadArguments) {
  Image src = testing::MakeImage(10, 10, 3);
  CropPlan p{.region = {0, 0, 10, 10}, .out_width = 4, .out_height = 4};
  std::vector<uint8_t> wrong(10);
  EXPECT_EQ(ApplyPlan(View(src), p.region, p, wrong).code(), StatusCode::kInvalidArgument);
  std::vector<uint8_t> out(4 * 4 * 3);
  EXPECT_EQ(ApplyPlan(View(src), RectF{0, 0, 0, 5}, p, out).code(), StatusCode::kInvalidArgument);
  ImageView two = View(src);
  two.channels = 2;
  EXPECT_EQ(ApplyPlan(two, p.region, p, out).code(), StatusCode::kInvalidArgument);
}

TEST(Normalize, LayoutsAndTypes) {
  std::vector<uint8_t> px = {0, 128, 255, 10, 20, 30};  // two RGB pixels
  NormalizeOptions o{.mean = {0.5f, 0.5f, 0.5f}, .std = {0.5f, 0.25f, 1.0f}};
  std::vector<float> nchw(6), nhwc(6);
  ASSERT_OK(Normalize(px, 1, 2, 1, o, std::as_writable_bytes(std::span(nchw))));
  o.layout = Layout::kNHWC;
  ASSERT_OK(Normalize(px, 1, 2, 1, o, std::as_writable_bytes(std::span(nhwc))));
  EXPECT_FLOAT_EQ(nhwc[0], (0 / 255.0f - 0.5f) / 0.5f);
  EXPECT_FLOAT_EQ(nhwc[2], (255 / 255.0f - 0.5f) / 1.0f);
  for (int i = 0; i < 2; ++i) {
    for (int c = 0; c < 3; ++c) EXPECT_FLOAT_EQ(nchw[c * 2 + i], nhwc[i * 3 + c]);
  }
  o.dtype = DType::kFloat16;
  std::vector<uint16_t> half(6);
  ASSERT_OK(Normalize(px, 1, 2, 1, o, std::as_writable_bytes(std::span(half))));
  cv::Mat h(1, 6, CV_16F, half.data()), f;
  h.convertTo(f, CV_32F);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(f.at<float>(i), nhwc[i], 2e-3);
  std::vector<float> small(5);
  EXPECT_EQ(Normalize(px, 1, 2, 1, o, std::as_writable_bytes(std::span(small))).code(),
            StatusCode::kInvalidArgument);
  o.std[1] = 0;
  o.dtype = DType::kFloat32;
  EXPECT_EQ(Normalize(px, 1, 2, 1, o, std::as_writable_bytes(std::span(nhwc))).code(),
            StatusCode::kInvalidArgument);
}

TEST(Normalize, ValidatesMeanStdAndTheOutputRange) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const double f32 = std::numeric_limits<float>::max();
  EXPECT_OK(ValidateNormalize({0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f}, kFloat16Largest));
  struct Case {
    std::array<float, 3> mean, std;
    double largest;
    const char* says;
  };
  for (const Case& c : {Case{{nan, 0, 0}, {1, 1, 1}, f32, "mean[0] = nan"},
                        Case{{0, 0, inf}, {1, 1, 1}, f32, "mean[2] = inf"},
                        Case{{0, 0, 0}, {1, 0, 1}, f32, "std[1] = 0"},
                        Case{{0, 0, 0}, {1, -1, 1}, f32, "std[1] = -1"},
                        Case{{0, 0, 0}, {1, 1, inf}, f32, "std[2] = inf"},
                        Case{{0, 0, 0}, {1e-40f, 1, 1}, f32, "channel 0"},
                        Case{{0, 0, 0}, {1, 1e-5f, 1}, kFloat16Largest, "channel 1"},
                        Case{{-1e5f, 0, 0}, {1, 1, 1}, kFloat16Largest, "channel 0"}}) {
    const Status s = ValidateNormalize(c.mean, c.std, c.largest);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.says;
    EXPECT_NE(s.message().find(c.says), std::string::npos) << s.message();
  }
  EXPECT_OK(ValidateNormalize({0, 0, 0}, {1e-5f, 1e-5f, 1e-5f}, f32));  // fits float32, not float16
}

// ---- Region decode composed with plans ----

// The sample via the cheap path (plan -> region decode at a DCT scale -> ApplyPlan) and via the
// reference path (full decode -> ApplyPlan on the plan's region).
struct Pair {
  std::vector<uint8_t> fast, reference;
  int scale = 1;
};

Pair BothWays(decode::JpegDecoder& decoder, const std::vector<std::byte>& jpeg, CropPlan plan) {
  Pair r;
  // As prefetch does it: choose the DCT scale for the plan, then snap the plan to that scale.
  auto info = decoder.ReadHeader(jpeg);
  EXPECT_TRUE(info.ok());
  const int d = decode::ChooseRegionScale(static_cast<int>(plan.region.width),
                                          static_cast<int>(plan.region.height), plan.out_width,
                                          plan.out_height);
  plan = SnapToScale(plan, d, info->width, info->height);
  r.fast.resize(plan.out_width * plan.out_height * 3);
  r.reference.resize(r.fast.size());
  Image full, region;
  EXPECT_OK(decoder.Decode(jpeg, &full));
  EXPECT_OK(ApplyPlan(View(full), plan.region, plan, r.reference));
  const decode::Region want{static_cast<int>(std::floor(plan.region.x)),
                            static_cast<int>(std::floor(plan.region.y)),
                            static_cast<int>(std::ceil(plan.region.x + plan.region.width)) -
                                static_cast<int>(std::floor(plan.region.x)),
                            static_cast<int>(std::ceil(plan.region.y + plan.region.height)) -
                                static_cast<int>(std::floor(plan.region.y))};
  auto where = decoder.DecodeRegion(jpeg, want, plan.out_width, plan.out_height, &region, d);
  EXPECT_TRUE(where.ok()) << where.status().ToString();
  if (!where.ok()) return r;
  r.scale = where->scale_denom;
  // The plan's region inside the decoded block (want may be a little larger than the region).
  const double s = where->scale_denom;
  RectF in_block{where->x + (plan.region.x - want.x) / s, where->y + (plan.region.y - want.y) / s,
                 plan.region.width / s, plan.region.height / s};
  EXPECT_OK(ApplyPlan(View(region), in_block, plan, r.fast));
  return r;
}

TEST(RegionDecode, FullRegionAtFullScaleEqualsAFullDecode) {
  decode::JpegDecoder decoder;
  auto jpeg = testing::EncodeJpeg(testing::MakeImage(97, 61, 3, 1));
  Image full, region;
  ASSERT_OK(decoder.Decode(jpeg, &full));
  ASSERT_OK_AND_ASSIGN(auto where, decoder.DecodeRegion(jpeg, {0, 0, 97, 61}, 97, 61, &region));
  EXPECT_EQ(where.scale_denom, 1);
  EXPECT_EQ(region.pixels, full.pixels);
}

TEST(RegionDecode, AgreesWithFullDecodeOnSyntheticImages) {
  decode::JpegDecoder decoder;
  RandomResizedCropOptions o;
  int scaled = 0;
  for (int i = 0; i < 40; ++i) {
    SCOPED_TRACE(i);
    const int w = 300 + 37 * (i % 9), h = 240 + 53 * (i % 7);
    auto jpeg = testing::EncodeJpeg(testing::MakeImage(w, h, 3, static_cast<uint32_t>(i)), 92,
                                    i % 4 == 0, i % 3 == 0);
    SplitMix64 rng = SampleRng(11, 0, i);
    CropPlan plan = PlanRandomResizedCrop(w, h, o, rng);
    plan.out_width = plan.out_height = i % 2 ? 64 : 112;  // small outputs make scaled decodes
    Pair p = BothWays(decoder, jpeg, plan);
    scaled += p.scale > 1;
    EXPECT_LE(Mad(p.fast, p.reference), 2.0);
    EXPECT_GE(Psnr(p.fast, p.reference), 35.0);
  }
  EXPECT_GT(scaled, 10);  // the comparison covered DCT-scaled decodes
}

TEST(SnapToScale, EdgesMoveToTheGridAndStayInside) {
  CropPlan p{.region = {13, 7, 101, 55}, .out_width = 10, .out_height = 10};
  for (int d : {1, 2, 4, 8}) {
    CropPlan s = SnapToScale(p, d, 200, 150);
    EXPECT_EQ(std::fmod(s.region.x, d), 0);
    EXPECT_EQ(std::fmod(s.region.width, d), 0);
    EXPECT_LT(std::abs(s.region.x - p.region.x), d);
    EXPECT_LT(std::abs(s.region.x + s.region.width - p.region.x - p.region.width), d);
    EXPECT_LE(s.region.x + s.region.width, 200);
  }
  // Near the right edge of a 203-wide image at 1/8, the partial last cell is left out.
  CropPlan edge{.region = {150, 0, 53, 20}, .out_width = 4, .out_height = 2};
  CropPlan s = SnapToScale(edge, 8, 203, 20);
  EXPECT_EQ(s.region.x + s.region.width, 200);
  // A region narrower than a cell snaps to the cell holding it ([1999, 2000) at 1/2 became
  // [2000, 2002), past the column asked for): at every offset, both edges move by less than d.
  for (int d : {2, 4, 8}) {
    for (double x = 0; x < 64; x += 0.5) {
      for (double w : {0.5, 1.0, d - 0.5}) {
        CropPlan narrow{.region = {x, 0, w, 20}, .out_width = 1, .out_height = 1};
        CropPlan n = SnapToScale(narrow, d, 4000, 3000);
        SCOPED_TRACE(fmt::format("d {} x {} width {}", d, x, w));
        EXPECT_LT(std::abs(n.region.x - x), d);
        EXPECT_LT(std::abs(n.region.x + n.region.width - x - w), d);
        EXPECT_LT(n.region.x, x + w);  // it overlaps the region asked for
        EXPECT_GT(n.region.x + n.region.width, x);
      }
    }
  }
}

TEST(RegionDecode, RejectsRegionsOutsideTheImage) {
  decode::JpegDecoder decoder;
  auto jpeg = testing::EncodeJpeg(testing::MakeImage(40, 30, 3));
  Image out;
  EXPECT_EQ(decoder.DecodeRegion(jpeg, {50, 0, 10, 10}, 8, 8, &out).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(decoder.DecodeRegion(jpeg, {0, 0, 10, 10}, 0, 8, &out).status().code(),
            StatusCode::kInvalidArgument);
  std::vector<std::byte> cut(jpeg.begin(), jpeg.begin() + static_cast<ptrdiff_t>(jpeg.size() / 2));
  EXPECT_EQ(decoder.DecodeRegion(cut, {0, 20, 40, 10}, 8, 8, &out).status().code(),
            StatusCode::kCorrupt);
}

TEST(RegionDecode, SamplesAreTheSameOnEveryThread) {
  // Plans and pixels keyed by (seed, epoch, index): 1 thread and 4 threads give the same bytes.
  std::vector<std::vector<std::byte>> jpegs;
  for (int i = 0; i < 16; ++i) {
    jpegs.push_back(testing::EncodeJpeg(testing::MakeImage(200 + i * 10, 150 + i * 5, 3, i)));
  }
  auto sample = [&](int i, std::vector<uint8_t>& out, decode::JpegDecoder& decoder) {
    Image full;
    ASSERT_OK(decoder.Decode(jpegs[i], &full));
    SplitMix64 rng = SampleRng(99, 4, i);
    RandomResizedCropOptions o{.size = 32, .brightness = 0.3, .saturation = 0.3};
    CropPlan plan = PlanRandomResizedCrop(full.width, full.height, o, rng);
    out.resize(32 * 32 * 3);
    ASSERT_OK(ApplyPlan(View(full), plan.region, plan, out));
  };
  std::vector<std::vector<uint8_t>> serial(16), parallel(16);
  decode::JpegDecoder d;
  for (int i = 0; i < 16; ++i) sample(i, serial[i], d);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      decode::JpegDecoder own;
      for (int i = 15 - t; i >= 0; i -= 4) sample(i, parallel[i], own);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(serial, parallel);
}

using testing::FilesUnder;

TEST(RegionDecodeCorpus, AgreesWithFullDecodeOnRealPhotos) {
  STOKE_REQUIRE_SHARED_DATA(data);
  decode::JpegDecoder decoder;
  RandomResizedCropOptions o;
  double worst_mad = 0, worst_psnr = 99, sum_mad = 0, sum_mse = 0;
  int n = 0;
  auto files = FilesUnder(data / "imagenet_like");
  for (size_t i = 0; i < files.size(); i += 5) {  // 200 photos
    auto jpeg = testing::ReadBytes(files[i]);
    ASSERT_OK_AND_ASSIGN(decode::JpegInfo info, decoder.ReadHeader(jpeg));
    SplitMix64 rng = SampleRng(3, 0, static_cast<int64_t>(i));
    CropPlan plan = i % 10 == 0 ? PlanCenterCrop(info.width, info.height)
                                : PlanRandomResizedCrop(info.width, info.height, o, rng);
    Pair p = BothWays(decoder, jpeg, plan);
    const double mad = Mad(p.fast, p.reference), psnr = Psnr(p.fast, p.reference);
    worst_mad = std::max(worst_mad, mad);
    worst_psnr = std::min(worst_psnr, psnr);
    sum_mad += mad;
    sum_mse += Mse(p.fast, p.reference);
    ++n;
    // No single photo may be far off: a misplaced region or a wrong scale shows up as tens of dB.
    EXPECT_LE(mad, 4.0) << files[i] << " scale 1/" << p.scale;
    EXPECT_GE(psnr, 30.0) << files[i] << " scale 1/" << p.scale;
  }
  // The agreement criterion, over the set: mean absolute difference <= 2, PSNR >= 35 dB.
  const double set_mad = sum_mad / n, set_psnr = 10 * std::log10(255.0 * 255.0 / (sum_mse / n));
  std::printf("region vs full decode over %d photos: MAD %.3f (worst photo %.3f), PSNR %.2f dB "
              "(worst photo %.2f)\n", n, set_mad, worst_mad, set_psnr, worst_psnr);
  EXPECT_LE(set_mad, 2.0);
  EXPECT_GE(set_psnr, 35.0);
}

TEST(RegionDecodeCorpus, EveryEdgeFileDecodesLikeAFullDecode) {
  STOKE_REQUIRE_SHARED_DATA(data);
  decode::JpegDecoder decoder;
  Image full, region;
  int checked = 0;
  for (const auto& f : FilesUnder(data / "edge")) {
    auto jpeg = testing::ReadBytes(f);
    Status s = decoder.Decode(jpeg, &full);
    auto r = decoder.DecodeRegion(jpeg, {0, 0, 1 << 30, 1 << 30}, 1 << 20, 1 << 20, &region);
    if (f.parent_path().filename() == "unsupported_by_ljt2") {
      EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << f;
      EXPECT_NE(r.status().message().find("Unsupported"), std::string::npos) << r.status().ToString();
      continue;
    }
    ASSERT_OK(s);
    ASSERT_TRUE(r.ok()) << f << ": " << r.status().ToString();
    ASSERT_EQ(region.width, full.width) << f;
    ASSERT_EQ(region.height, full.height) << f;
    ASSERT_EQ(region.channels, 3);
    if (full.channels == 3) {
      EXPECT_EQ(region.pixels, full.pixels) << f;
    } else {
      for (size_t i = 0; i < full.pixels.size(); ++i) ASSERT_EQ(region.pixels[3 * i], full.pixels[i]) << f;
    }
    ++checked;
  }
  EXPECT_EQ(checked, 98);
}

TEST(RegionDecodeCorpus, EveryBadFileIsRejected) {
  STOKE_REQUIRE_SHARED_DATA(data);
  decode::JpegDecoder decoder;
  Image region;
  for (const auto& f : FilesUnder(data / "bad")) {
    auto jpeg = testing::ReadBytes(f);
    auto r = decoder.DecodeRegion(jpeg, {0, 0, 1 << 30, 1 << 30}, 1, 1, &region);
    EXPECT_FALSE(r.ok()) << f;
    if (!r.ok()) {
      EXPECT_FALSE(r.status().message().empty());
    }
  }
}

}  // namespace
}  // namespace stoke::augment
