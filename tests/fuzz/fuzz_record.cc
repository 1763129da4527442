// Fuzz target: arbitrary bytes as an LMDB record value (header + payload) and as a manifest. The
// first byte picks the record index the parser is told about; the rest is the value. A record
// with a restart index also has its index checked against its JPEG and a few regions decoded
// through it: a damaged index is an error, never a crash or a read outside the record.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "dataset/manifest.h"
#include "dataset/record.h"
#include "decode/jpeg_decoder.h"
#include "decode/jpeg_transcode.h"

using namespace stoke;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  const int64_t index = size > 0 ? data[0] : 0;
  auto record = dataset::ParseRecord(std::span<const std::byte>(bytes, size), index);
  if (record.ok()) {
    (void)dataset::CheckCrc(*record);
    // A parsed view stays inside the input.
    const auto* begin = bytes;
    const auto* end = bytes + size;
    auto inside = [&](std::span<const std::byte> s) { return s.empty() || (s.data() >= begin && s.data() + s.size() <= end); };
    if (!inside(record->payload) || !inside(record->image) || !inside(record->jpeg_index.entries)) __builtin_trap();
    const dataset::JpegIndexView& x = record->jpeg_index;
    if (x.entry_bytes != 0) {
      const decode::RestartIndex ri{x.restart_mcus, x.mcus_per_row, x.mcu_rows, x.entry_bytes, x.intervals, x.entries};
      (void)decode::CheckRestartIndex(record->image, ri);
      decode::DecoderOptions options;
      options.max_pixels = 4'000'000;
      options.max_scans = 64;
      decode::JpegDecoder decoder(options);
      Image out;
      const int w = static_cast<int>(record->header.width), h = static_cast<int>(record->header.height);
      for (const decode::Region r : {decode::Region{0, 0, w, h}, decode::Region{w / 3, h / 4, w / 3 + 1, h / 2 + 1}}) {
        for (int d : {1, 8}) (void)decoder.DecodeRegion(record->image, r, 1, 1, &out, d, &ri);
      }
    }
  }
  (void)dataset::Manifest::Parse(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
