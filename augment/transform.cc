#include "augment/transform.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <opencv2/core.hpp>
#include <opencv2/imgproc.hpp>

namespace stoke::augment {
namespace {

// Shrinking by more than this uses area averaging: bilinear sampling would alias.
constexpr double kAreaAbove = 2.0;

// Colour jitter on RGB8 in place, in the fixed order brightness, contrast, saturation.
void Jitter(cv::Mat& rgb, const ColorJitter& j) {
  if (j.brightness != 1) rgb.convertTo(rgb, CV_8U, j.brightness, 0);
  if (j.contrast != 1) {
    thread_local cv::Mat gray;  // reused: no allocation per sample once a thread has seen the size
    cv::cvtColor(rgb, gray, cv::COLOR_RGB2GRAY);
    const double mean = cv::mean(gray)[0];
    rgb.convertTo(rgb, CV_8U, j.contrast, (1 - j.contrast) * mean);
  }
  if (j.saturation != 1) {
    const float s = static_cast<float>(j.saturation);
    for (int y = 0; y < rgb.rows; ++y) {
      auto* p = rgb.ptr<uint8_t>(y);
      for (int x = 0; x < rgb.cols; ++x, p += 3) {
        const float gray = 0.299f * p[0] + 0.587f * p[1] + 0.114f * p[2];
        for (int c = 0; c < 3; ++c) p[c] = cv::saturate_cast<uint8_t>(s * p[c] + (1 - s) * gray);
      }
    }
  }
}

}  // namespace

void UseCallerThreadsOnly() { cv::setNumThreads(0); }

Status ApplyPlan(const ImageView& src, const RectF& region, const CropPlan& plan,
                 std::span<uint8_t> dst) {
  const size_t need = static_cast<size_t>(plan.out_width) * plan.out_height * 3;
  if (plan.out_width <= 0 || plan.out_height <= 0 || dst.size() != need) {
    return InvalidArgumentError(fmt::format("augment: destination of {} bytes for a {}x{}x3 sample",
                                            dst.size(), plan.out_width, plan.out_height));
  }
  if (src.channels != 1 && src.channels != 3) {
    return InvalidArgumentError(fmt::format("augment: {} channels (expected 1 or 3)", src.channels));
  }
  if (!(region.width > 0 && region.height > 0) || src.width <= 0 || src.height <= 0) {
    return InvalidArgumentError("augment: empty source region");
  }
  try {
    cv::Mat in(src.height, src.width, CV_8UC(src.channels), const_cast<uint8_t*>(src.data),
               src.stride);
    thread_local cv::Mat rgb_scratch;  // gray sources only
    if (src.channels == 1) {
      cv::cvtColor(in, rgb_scratch, cv::COLOR_GRAY2RGB);
      in = rgb_scratch;
    }
    cv::Mat out(plan.out_height, plan.out_width, CV_8UC3, dst.data());
    const double sx = region.width / plan.out_width, sy = region.height / plan.out_height;
    auto whole = [](double v) { return std::abs(v - std::round(v)) < 1e-6; };
    const bool integral = whole(region.x) && whole(region.y) && whole(region.width) && whole(region.height);
    if (integral && sx <= kAreaAbove && sy <= kAreaAbove) {
      // Whole pixels: cv::resize samples (u + 0.5) * sx - 0.5 exactly as the warp below would,
      // at about 2.5x its speed.
      const cv::Rect roi(static_cast<int>(std::lround(region.x)), static_cast<int>(std::lround(region.y)),
                         static_cast<int>(std::lround(region.width)), static_cast<int>(std::lround(region.height)));
      if ((roi & cv::Rect(0, 0, in.cols, in.rows)) != roi) {
        return InvalidArgumentError("augment: region outside the source image");
      }
      cv::resize(in(roi), out, out.size(), 0, 0, cv::INTER_LINEAR);
      if (plan.flip) cv::flip(out, out, 1);
    } else if (sx > kAreaAbove || sy > kAreaAbove) {
      // Area averaging over the whole pixels of the region (misplacement < 0.5 source pixel,
      // under a quarter of an output pixel at this shrink).
      const int x0 = std::clamp(static_cast<int>(std::lround(region.x)), 0, in.cols - 1);
      const int y0 = std::clamp(static_cast<int>(std::lround(region.y)), 0, in.rows - 1);
      const int x1 = std::clamp(static_cast<int>(std::lround(region.x + region.width)), x0 + 1, in.cols);
      const int y1 = std::clamp(static_cast<int>(std::lround(region.y + region.height)), y0 + 1, in.rows);
      const cv::Mat roi = in(cv::Rect(x0, y0, x1 - x0, y1 - y0));
      if (sx >= 1 && sy >= 1) {
        cv::resize(roi, out, out.size(), 0, 0, cv::INTER_AREA);
      } else {
        // One axis shrinks, the other grows: OpenCV's INTER_AREA averages only when both shrink
        // (otherwise it samples, and the shrinking axis aliases). Average along that axis first,
        // then interpolate along the other.
        thread_local cv::Mat shrunk;
        const cv::Size between(sx >= 1 ? out.cols : roi.cols, sy >= 1 ? out.rows : roi.rows);
        cv::resize(roi, shrunk, between, 0, 0, cv::INTER_AREA);
        cv::resize(shrunk, out, out.size(), 0, 0, cv::INTER_LINEAR);
      }
      if (plan.flip) cv::flip(out, out, 1);
    } else {
      // Output pixel centre (u + 0.5) maps to source edge coordinate region.x + (u + 0.5) * sx,
      // i.e. source pixel coordinate that minus 0.5. A flip mirrors u within the output.
      cv::Matx23d m(sx, 0, region.x + 0.5 * sx - 0.5, 0, sy, region.y + 0.5 * sy - 0.5);
      if (plan.flip) {
        m(0, 0) = -sx;
        m(0, 2) = region.x + region.width - 0.5 * sx - 0.5;
      }
      cv::warpAffine(in, out, m, out.size(), cv::INTER_LINEAR | cv::WARP_INVERSE_MAP,
                     cv::BORDER_REPLICATE);
    }
    if (plan.jitter.enabled()) Jitter(out, plan.jitter);
    if (out.data != dst.data()) return InternalError("augment: OpenCV reallocated the destination");
  } catch (const cv::Exception& e) {
    return InternalError(fmt::format("augment: OpenCV: {}", e.what()));
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("augment: out of memory");
  }
  return OkStatus();
}

Status ValidateNormalize(const std::array<float, 3>& mean, const std::array<float, 3>& std, double largest) {
  for (size_t c = 0; c < 3; ++c) {
    if (!std::isfinite(mean[c])) {
      return InvalidArgumentError(fmt::format("normalize: mean[{}] = {} (expected a finite number)", c, mean[c]));
    }
    if (!std::isfinite(std[c]) || !(std[c] > 0)) {
      return InvalidArgumentError(fmt::format("normalize: std[{}] = {} (expected a finite number > 0)", c, std[c]));
    }
    const double reach = std::max(std::abs(0.0 - mean[c]), std::abs(1.0 - mean[c])) / std[c];
    if (!(reach <= largest)) {
      return InvalidArgumentError(fmt::format(
          "normalize: channel {}: (x - mean {}) / std {} reaches {:.3g}, beyond the output type's largest value "
          "{:.6g} (a larger std, or a wider output type)",
          c, mean[c], std[c], reach, largest));
    }
  }
  return OkStatus();
}

size_t NormalizedBytes(int count, int width, int height, DType dtype) {
  return static_cast<size_t>(count) * width * height * 3 * (dtype == DType::kFloat32 ? 4 : 2);
}

Status Normalize(std::span<const uint8_t> src, int count, int width, int height,
                 const NormalizeOptions& o, std::span<std::byte> dst) {
  const size_t pixels = static_cast<size_t>(width) * height;
  if (count <= 0 || width <= 0 || height <= 0 || src.size() != static_cast<size_t>(count) * pixels * 3 ||
      dst.size() != NormalizedBytes(count, width, height, o.dtype)) {
    return InvalidArgumentError(fmt::format(
        "normalize: {} source and {} destination bytes for {} images of {}x{}x3", src.size(),
        dst.size(), count, width, height));
  }
  STOKE_RETURN_IF_ERROR(ValidateNormalize(o.mean, o.std, NormalizeLimit(o.dtype == DType::kFloat16)));
  // y = x * scale[c] + shift[c], with scale = 1 / (255 std) and shift = -mean / std.
  float scale[3], shift[3];
  for (int c = 0; c < 3; ++c) {
    scale[c] = 1.0f / (255.0f * o.std[c]);
    shift[c] = -o.mean[c] / o.std[c];
  }
  thread_local std::vector<float> f32;  // float16 output is converted from this
  const bool half = o.dtype == DType::kFloat16;
  if (half) {
    try {
      f32.resize(pixels * 3);
    } catch (const std::bad_alloc&) {
      return ResourceExhaustedError(fmt::format("augment: normalise: out of memory for {} pixels", pixels));
    }
  }
  for (int n = 0; n < count; ++n) {
    const uint8_t* in = src.data() + n * pixels * 3;
    float* out = half ? f32.data() : reinterpret_cast<float*>(dst.data()) + n * pixels * 3;
    if (o.layout == Layout::kNHWC) {
      for (size_t i = 0; i < pixels; ++i) {
        for (int c = 0; c < 3; ++c) out[3 * i + c] = in[3 * i + c] * scale[c] + shift[c];
      }
    } else {
      for (int c = 0; c < 3; ++c) {
        float* plane = out + c * pixels;
        for (size_t i = 0; i < pixels; ++i) plane[i] = in[3 * i + c] * scale[c] + shift[c];
      }
    }
    if (half) {
      try {
        cv::Mat from(1, static_cast<int>(pixels * 3), CV_32F, f32.data());
        cv::Mat to(1, static_cast<int>(pixels * 3), CV_16F, dst.data() + n * pixels * 3 * 2);
        from.convertTo(to, CV_16F);
      } catch (const cv::Exception& e) {
        return InternalError(fmt::format("augment: normalise: OpenCV: {}", e.what()));
      }
    }
  }
  return OkStatus();
}

}  // namespace stoke::augment
