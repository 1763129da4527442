#include "bench_data.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>

#include "common/file_util.h"
#include "common/image.h"
#include "decode/jpeg_decoder.h"
#include "decode/jpeg_encoder.h"

namespace stoke::bench {
namespace fs = std::filesystem;

const BenchImages& LoadBenchImages() {
  static const BenchImages images = [] {
    BenchImages b;
    fs::path dir = fs::path(STOKE_SOURCE_DIR) / ".." / "shared" / "data" / "imagenet_like";
    if (const char* env = std::getenv("STOKE_BENCH_DATA")) dir = env;
    std::error_code ec;
    if (fs::is_directory(dir, ec)) {
      std::vector<fs::path> files;
      for (const auto& e : fs::recursive_directory_iterator(dir)) {
        if (e.is_regular_file()) files.push_back(e.path());
      }
      std::sort(files.begin(), files.end());
      // Only JPEGs that decode: each benchmark counts every image of the set per iteration, so a
      // damaged file it skipped quickly would have raised its rate.
      decode::JpegDecoder decoder;
      Image scratch;
      size_t left_out = 0;
      for (const auto& f : files) {
        auto bytes = ReadFileBytes(f);
        if (!bytes.ok() || !decode::LooksLikeJpeg(*bytes)) continue;
        if (!decoder.Decode(*bytes, &scratch).ok()) {
          ++left_out;
          continue;
        }
        b.jpegs.push_back(std::move(bytes).value());
      }
      b.source = dir.lexically_normal().string();
      if (left_out > 0) b.source += fmt::format(" ({} JPEGs that do not decode left out)", left_out);
    }
    if (b.jpegs.empty()) {
      auto enc = decode::JpegEncoder::Create();
      for (int i = 0; i < 64 && enc.ok(); ++i) {
        Image img;
        img.Reshape(500, 375, 3);
        for (size_t k = 0; k < img.pixels.size(); ++k) {
          img.pixels[k] = static_cast<uint8_t>((k * 7 + static_cast<size_t>(i) * 13) % 251);
        }
        auto jpeg = enc->Encode(img, {.quality = 90});
        if (jpeg.ok()) b.jpegs.push_back(std::move(jpeg).value());
      }
      b.source = "synthetic 500x375";
    }
    for (const auto& j : b.jpegs) b.total_bytes += j.size();
    return b;
  }();
  return images;
}

}  // namespace stoke::bench
