#include "tools/synth/synth.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <numbers>
#include <system_error>

#include <fmt/format.h>
#include <opencv2/imgproc.hpp>

#include "common/file_util.h"
#include "common/image.h"
#include "common/random.h"
#include "decode/jpeg_encoder.h"

namespace stoke::synth {

namespace {

std::vector<cv::Point> Polygon(const std::vector<cv::Point2d>& unit, cv::Point2d center, double radius,
                               double angle) {
  std::vector<cv::Point> out;
  const double c = std::cos(angle), s = std::sin(angle);
  for (const auto& p : unit) {
    // 4 fractional bits: sub-pixel vertices with cv::fillPoly's `shift`.
    out.emplace_back(static_cast<int>(std::lround(16 * (center.x + radius * (c * p.x - s * p.y)))),
                     static_cast<int>(std::lround(16 * (center.y + radius * (s * p.x + c * p.y)))));
  }
  return out;
}

// Draws shape `kind` (0-9) of radius r at `center` in `color` onto `canvas`.
void DrawShape(cv::Mat& canvas, int kind, cv::Point2d center, double r, double angle, const cv::Scalar& color) {
  const int thick = std::max(2, static_cast<int>(r * 0.3));
  auto fill = [&](const std::vector<cv::Point2d>& unit) {
    std::vector<std::vector<cv::Point>> polys = {Polygon(unit, center, r, angle)};
    cv::fillPoly(canvas, polys, color, cv::LINE_AA, 4);
  };
  const cv::Point c(static_cast<int>(center.x), static_cast<int>(center.y));
  switch (kind) {
    case 0:  // disc
      cv::circle(canvas, c, static_cast<int>(r), color, cv::FILLED, cv::LINE_AA);
      break;
    case 1:  // ring
      cv::circle(canvas, c, static_cast<int>(r - thick / 2.0), color, thick, cv::LINE_AA);
      break;
    case 2:  // square
      fill({{-0.8, -0.8}, {0.8, -0.8}, {0.8, 0.8}, {-0.8, 0.8}});
      break;
    case 3: {  // frame: a square outline
      std::vector<std::vector<cv::Point>> polys = {
          Polygon({{-0.8, -0.8}, {0.8, -0.8}, {0.8, 0.8}, {-0.8, 0.8}}, center, r - thick / 2.0, angle)};
      cv::polylines(canvas, polys, true, color, thick, cv::LINE_AA, 4);
      break;
    }
    case 4:  // triangle
      fill({{0, -1}, {0.95, 0.75}, {-0.95, 0.75}});
      break;
    case 5:  // diamond
      fill({{0, -1}, {0.7, 0}, {0, 1}, {-0.7, 0}});
      break;
    case 6:  // plus
      fill({{-0.3, -1}, {0.3, -1}, {0.3, -0.3}, {1, -0.3}, {1, 0.3}, {0.3, 0.3}, {0.3, 1}, {-0.3, 1},
            {-0.3, 0.3}, {-1, 0.3}, {-1, -0.3}, {-0.3, -0.3}});
      break;
    case 7:  // cross (a plus turned by 45 degrees)
      angle += std::numbers::pi / 4;
      fill({{-0.25, -1}, {0.25, -1}, {0.25, -0.25}, {1, -0.25}, {1, 0.25}, {0.25, 0.25}, {0.25, 1}, {-0.25, 1},
            {-0.25, 0.25}, {-1, 0.25}, {-1, -0.25}, {-0.25, -0.25}});
      break;
    case 8:  // two horizontal bars
      fill({{-1, -0.75}, {1, -0.75}, {1, -0.25}, {-1, -0.25}});
      fill({{-1, 0.25}, {1, 0.25}, {1, 0.75}, {-1, 0.75}});
      break;
    default: {  // five-pointed star
      std::vector<cv::Point2d> star;
      for (int k = 0; k < 10; ++k) {
        const double a = -std::numbers::pi / 2 + k * std::numbers::pi / 5;
        const double rad = k % 2 == 0 ? 1.0 : 0.42;
        star.emplace_back(rad * std::cos(a), rad * std::sin(a));
      }
      fill(star);
      break;
    }
  }
}

// Random colours far enough apart in brightness that the shape is always visible.
void Colours(SplitMix64& rng, cv::Scalar* fg, cv::Scalar* bg) {
  while (true) {
    double f[3], b[3];
    for (int i = 0; i < 3; ++i) {
      f[i] = static_cast<double>(rng.Below(256));
      b[i] = static_cast<double>(rng.Below(256));
    }
    const double lf = 0.3 * f[0] + 0.59 * f[1] + 0.11 * f[2], lb = 0.3 * b[0] + 0.59 * b[1] + 0.11 * b[2];
    if (std::abs(lf - lb) >= 70) {
      *fg = cv::Scalar(f[0], f[1], f[2]);
      *bg = cv::Scalar(b[0], b[1], b[2]);
      return;
    }
  }
}

// An earlier synth's unfinished tree: removed when it holds only what synth writes (class_* folders
// of img_* files), refused otherwise (a folder of the user's that happens to have the name).
Status RemoveEarlierPartial(const std::filesystem::path& partial) {
  namespace fs = std::filesystem;
  std::error_code ec;
  auto foreign = [&](const fs::path& p) {
    return InvalidArgumentError(fmt::format(
        "synth: {}: holds {}, which synth does not write; this name is where synth builds its tree before "
        "renaming it into place: move that folder away",
        partial.string(), p.string()));
  };
  if (!fs::is_directory(fs::symlink_status(partial, ec))) return foreign(partial);
  for (const auto& cls : fs::directory_iterator(partial, ec)) {
    if (!cls.is_directory(ec) || cls.is_symlink(ec) || !cls.path().filename().string().starts_with("class_")) {
      return foreign(cls.path());
    }
    for (const auto& file : fs::directory_iterator(cls.path(), ec)) {
      if (!file.is_regular_file(ec) || file.is_symlink(ec) || !file.path().filename().string().starts_with("img_")) {
        return foreign(file.path());
      }
    }
  }
  if (ec) return IoError(fmt::format("synth: {}: {}", partial.string(), ec.message()));
  fs::remove_all(partial, ec);
  if (ec) return IoError(fmt::format("synth: {}: {}", partial.string(), ec.message()));
  return OkStatus();
}

Status WriteTree(const std::filesystem::path& out_dir, const SynthOptions& o) {
  STOKE_ASSIGN_OR_RETURN(decode::JpegEncoder encoder, decode::JpegEncoder::Create());
  SplitMix64 rng(MixSeed(o.seed, 0x73796e));
  Image img;
  for (int c = 0; c < o.classes; ++c) {
    const auto dir = out_dir / fmt::format("class_{:02}", c);
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return IoError(fmt::format("synth: {}: {}", dir.string(), ec.message()));
    // Class identity: a hue and a stripe angle.
    const double hue = 2 * std::numbers::pi * c / o.classes;
    const double angle = std::numbers::pi * c / o.classes;
    const double r0 = 128 + 100 * std::cos(hue), g0 = 128 + 100 * std::cos(hue - 2.1),
                 b0 = 128 + 100 * std::cos(hue + 2.1);
    for (int i = 0; i < o.per_class; ++i) {
      if (o.stop && o.stop->load()) return UnavailableError("synth: interrupted");
      const int span = o.max_side - o.min_side + 1;
      const int w = o.min_side + static_cast<int>(rng.Below(static_cast<uint64_t>(span)));
      const int h = o.min_side + static_cast<int>(rng.Below(static_cast<uint64_t>(span)));
      const double phase = static_cast<double>(rng.Below(1000)) / 1000.0 * 2 * std::numbers::pi;
      img.Reshape(w, h, 3);
      if (o.style == SynthStyle::kShapes) {
        cv::Scalar fg, bg;
        Colours(rng, &fg, &bg);
        cv::Mat canvas(h, w, CV_8UC3, img.pixels.data());
        canvas.setTo(bg);
        const double side = std::min(w, h);
        const double r = side * (0.22 + 0.14 * Uniform01(rng)) * (c >= 10 ? 0.75 : 1.0);
        const cv::Point2d center(r + (w - 2 * r) * Uniform01(rng), r + (h - 2 * r) * Uniform01(rng));
        const double angle = (Uniform01(rng) - 0.5) * 0.35;
        DrawShape(canvas, c % 10, center, r, angle, fg);
        for (auto& px : img.pixels) {
          px = static_cast<uint8_t>(std::clamp(static_cast<int>(px) + static_cast<int>(rng.Below(31)) - 15, 0, 255));
        }
        STOKE_ASSIGN_OR_RETURN(auto jpeg, encoder.Encode(img, {.quality = 90}));
        STOKE_RETURN_IF_ERROR(WriteFileAtomic(dir / fmt::format("img_{:04}.jpg", i), jpeg));
        continue;
      }
      for (int y = 0; y < h; ++y) {
        uint8_t* row = img.row(y);
        for (int x = 0; x < w; ++x) {
          double s = 0.5 + 0.5 * std::sin((x * std::cos(angle) + y * std::sin(angle)) * 0.35 + phase);
          double noise = static_cast<double>(rng.Below(31)) - 15;
          auto px = [&](double base) {
            return static_cast<uint8_t>(std::clamp(base * (0.55 + 0.45 * s) + noise, 0.0, 255.0));
          };
          row[3 * x] = px(r0);
          row[3 * x + 1] = px(g0);
          row[3 * x + 2] = px(b0);
        }
      }
      STOKE_ASSIGN_OR_RETURN(auto jpeg, encoder.Encode(img, {.quality = 90}));
      STOKE_RETURN_IF_ERROR(WriteFileAtomic(dir / fmt::format("img_{:04}.jpg", i), jpeg));
    }
  }
  return OkStatus();
}

}  // namespace

Status WriteSyntheticTree(const std::filesystem::path& out_dir, const SynthOptions& o) {
  namespace fs = std::filesystem;
  if (o.classes <= 0 || o.per_class <= 0 || o.min_side < 8 || o.max_side < o.min_side) {
    return InvalidArgumentError(
        "synth: need classes > 0, per_class > 0 and 8 <= min_side <= max_side");
  }
  if (o.style == SynthStyle::kShapes && o.classes > 20) {
    // Ten shapes, each large or small: a 21st class would draw the first one again.
    return InvalidArgumentError(fmt::format(
        "synth: --classes {}: the shapes style draws at most 20 distinct classes (use --style stripes for more)",
        o.classes));
  }
  // Into a folder holding files, the tree would be mixed with them (an earlier synth's classes
  // and images stayed, and a pack of it counted them): refused.
  std::error_code ec;
  if (fs::exists(fs::symlink_status(out_dir, ec)) && (!fs::is_directory(out_dir, ec) || !fs::is_empty(out_dir, ec))) {
    return InvalidArgumentError(fmt::format(
        "synth: {}: exists and is not an empty folder (the images would be mixed with what is there); "
        "give a new or empty folder",
        out_dir.string()));
  }
  // The tree is built in OUT.partial and renamed to OUT only when complete: a synth interrupted
  // or killed leaves no OUT that a pack would take for the whole set, and the next one starts over.
  fs::path partial = out_dir, lock_path = out_dir;
  partial += ".partial";
  lock_path += ".lock";
  if (out_dir.has_parent_path()) {
    fs::create_directories(out_dir.parent_path(), ec);
    if (ec) return IoError(fmt::format("synth: {}: {}", out_dir.parent_path().string(), ec.message()));
  }
  STOKE_ASSIGN_OR_RETURN(FileLock lock, FileLock::TryAcquire(lock_path, "synth: " + out_dir.string()));
  if (fs::exists(fs::symlink_status(partial, ec))) STOKE_RETURN_IF_ERROR(RemoveEarlierPartial(partial));
  const Status written = WriteTree(partial, o);
  if (!written.ok()) {
    fs::remove_all(partial, ec);  // best effort: what is left is removed by the next synth
    if (o.stop && o.stop->load()) {
      return UnavailableError(fmt::format("synth: interrupted; {} not written (run it again to start over)",
                                          out_dir.string()));
    }
    return written;
  }
  // rename(2) replaces an empty folder; one that gained files meanwhile makes it fail, naming OUT.
  if (::rename(partial.c_str(), out_dir.c_str()) != 0) {
    return IoError(fmt::format("synth: {}: cannot rename {} to it: {}", out_dir.string(), partial.string(),
                               std::strerror(errno)));
  }
  return SyncDirectory(out_dir.has_parent_path() ? out_dir.parent_path() : fs::path("."));
}

}  // namespace stoke::synth
