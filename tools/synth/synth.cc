#include "tools/synth/synth.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <system_error>

#include <fmt/format.h>

#include "common/file_util.h"
#include "common/image.h"
#include "common/random.h"
#include "decode/jpeg_encoder.h"

namespace stoke::synth {

Status WriteSyntheticTree(const std::filesystem::path& out_dir, const SynthOptions& o) {
  if (o.classes <= 0 || o.per_class <= 0 || o.min_side < 8 || o.max_side < o.min_side) {
    return InvalidArgumentError(
        "synth: need classes > 0, per_class > 0 and 8 <= min_side <= max_side");
  }
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
      const int span = o.max_side - o.min_side + 1;
      const int w = o.min_side + static_cast<int>(rng.Below(static_cast<uint64_t>(span)));
      const int h = o.min_side + static_cast<int>(rng.Below(static_cast<uint64_t>(span)));
      const double phase = static_cast<double>(rng.Below(1000)) / 1000.0 * 2 * std::numbers::pi;
      img.Reshape(w, h, 3);
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

}  // namespace stoke::synth
