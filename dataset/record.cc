#include "dataset/record.h"

#include <array>
#include <cstring>

#include <fmt/format.h>

#include "common/crc32c.h"
#include "common/limits.h"

namespace stoke::dataset {
namespace {

// Little-endian loads/stores through memcpy: values in the LMDB map are not aligned.
template <typename T>
void Store(std::byte* p, T v) {
  static_assert(std::endian::native == std::endian::little, "stoke assumes a little-endian host");
  std::memcpy(p, &v, sizeof v);
}
template <typename T>
T Load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Field offsets; docs/FORMAT.md has the table.
constexpr size_t kOffMagic = 0, kOffVersion = 4, kOffEncoding = 6, kOffChannels = 7, kOffLabel = 8,
                 kOffWidth = 12, kOffHeight = 16, kOffCrc = 20, kOffSize = 24;

}  // namespace

std::string_view EncodingName(PayloadEncoding e) {
  switch (e) {
    case PayloadEncoding::kJpeg: return "jpeg";
    case PayloadEncoding::kRaw: return "raw";
    case PayloadEncoding::kJpegIndexed: return "jpeg+index";
  }
  return "unknown";
}

void EncodeRecordHeader(const RecordHeader& h, std::span<std::byte, kRecordHeaderSize> out) {
  std::byte* p = out.data();
  Store<uint32_t>(p + kOffMagic, kRecordMagic);
  Store<uint16_t>(p + kOffVersion, h.format_version);
  Store<uint8_t>(p + kOffEncoding, static_cast<uint8_t>(h.encoding));
  Store<uint8_t>(p + kOffChannels, h.channels);
  Store<int32_t>(p + kOffLabel, h.label);
  Store<uint32_t>(p + kOffWidth, h.width);
  Store<uint32_t>(p + kOffHeight, h.height);
  Store<uint32_t>(p + kOffCrc, h.crc32c);
  Store<uint64_t>(p + kOffSize, h.payload_size);
}

Result<RecordView> ParseRecord(std::span<const std::byte> value, int64_t index) {
  auto err = [index](std::string what) {
    return CorruptError(fmt::format("record {}: {}", index, what));
  };
  if (value.size() < kRecordHeaderSize) {
    return err(fmt::format("value is {} bytes, shorter than the {}-byte header", value.size(),
                           kRecordHeaderSize));
  }
  const std::byte* p = value.data();
  uint32_t magic = Load<uint32_t>(p + kOffMagic);
  if (magic != kRecordMagic) return err(fmt::format("bad magic 0x{:08x}", magic));
  RecordView r;
  r.index = index;
  RecordHeader& h = r.header;
  h.format_version = Load<uint16_t>(p + kOffVersion);
  if (!ReadableFormatVersion(h.format_version)) {
    return InvalidArgumentError(
        fmt::format("record {}: format v{}, this build reads v{} to v{} (re-pack with this stoke)", index,
                    h.format_version, kOldestFormatVersion, kFormatVersion));
  }
  auto enc = Load<uint8_t>(p + kOffEncoding);
  const bool known = enc == static_cast<uint8_t>(PayloadEncoding::kJpeg) ||
                     enc == static_cast<uint8_t>(PayloadEncoding::kRaw) ||
                     (enc == static_cast<uint8_t>(PayloadEncoding::kJpegIndexed) && h.format_version >= 2);
  if (!known) return err(fmt::format("unknown payload encoding {} in a v{} record", enc, h.format_version));
  h.encoding = static_cast<PayloadEncoding>(enc);
  h.channels = Load<uint8_t>(p + kOffChannels);
  h.label = Load<int32_t>(p + kOffLabel);
  h.width = Load<uint32_t>(p + kOffWidth);
  h.height = Load<uint32_t>(p + kOffHeight);
  h.crc32c = Load<uint32_t>(p + kOffCrc);
  h.payload_size = Load<uint64_t>(p + kOffSize);
  if (h.payload_size != value.size() - kRecordHeaderSize) {
    return err(fmt::format("header says {} payload bytes, value holds {}", h.payload_size,
                           value.size() - kRecordHeaderSize));
  }
  if (h.channels != 1 && h.channels != 3) return err(fmt::format("{} channels", h.channels));
  if (h.encoding == PayloadEncoding::kRaw) {
    if (Status s = CheckRawDimensions(h, h.payload_size); !s.ok()) return err(s.message());
  }
  r.header_bytes = value.first(kRecordHeaderSize);
  r.payload = value.subspan(kRecordHeaderSize);
  r.image = r.payload;
  if (h.encoding == PayloadEncoding::kJpegIndexed) {
    const size_t n = r.payload.size();
    if (n < kJpegIndexTrailerSize) return err(fmt::format("indexed JPEG payload of {} bytes has no index", n));
    const std::byte* t = r.payload.data() + n - kJpegIndexTrailerSize;
    JpegIndexView& x = r.jpeg_index;
    const auto jpeg_size = Load<uint32_t>(t);
    x.intervals = Load<uint32_t>(t + 4);
    x.restart_mcus = Load<uint16_t>(t + 8);
    x.mcus_per_row = Load<uint16_t>(t + 10);
    x.mcu_rows = Load<uint16_t>(t + 12);
    x.entry_bytes = Load<uint8_t>(t + 14);
    const auto magic = Load<uint32_t>(t + 16);
    const uint64_t entries = x.entry_bytes == 4   ? 4ull * x.intervals
                             : x.entry_bytes == 2 ? (x.intervals == 0 ? 0 : 4 + 2ull * (x.intervals - 1))
                                                  : UINT64_MAX;
    if (magic != kJpegIndexMagic || entries == UINT64_MAX || x.intervals == 0 || x.restart_mcus == 0 ||
        x.mcus_per_row % x.restart_mcus != 0 ||
        uint64_t{x.intervals} != uint64_t{x.mcus_per_row} / x.restart_mcus * x.mcu_rows ||
        uint64_t{jpeg_size} + entries + kJpegIndexTrailerSize != n) {
      return err("its restart index does not add up (trailer, interval count or sizes)");
    }
    r.image = r.payload.first(jpeg_size);
    x.entries = r.payload.subspan(jpeg_size, entries);
  }
  return r;
}

Status CheckRawDimensions(const RecordHeader& h, uint64_t payload_bytes) {
  auto bad = [&](std::string_view why) {
    return CorruptError(fmt::format("raw payload of {} bytes for {}x{}x{}: {}", payload_bytes,
                                    h.width, h.height, h.channels, why));
  };
  if (h.channels != 1 && h.channels != 3) return bad("expected 1 or 3 channels");
  if (h.width == 0 || h.height == 0) return bad("an empty image");
  // Checked, not wrapped: 1432163965 x 4293443238 x 3 is 4394 modulo 2^64.
  uint64_t pixels = 0, bytes = 0;
  if (__builtin_mul_overflow(uint64_t{h.width}, uint64_t{h.height}, &pixels) ||
      pixels > static_cast<uint64_t>(kMaxImagePixels)) {
    return bad(fmt::format("more than {} pixels", kMaxImagePixels));
  }
  if (__builtin_mul_overflow(pixels, uint64_t{h.channels}, &bytes) || bytes != payload_bytes) {
    return bad(fmt::format("expected {} bytes", bytes));
  }
  return OkStatus();
}

std::vector<std::byte> EncodeJpegIndexedPayload(std::span<const std::byte> jpeg, std::span<const uint32_t> offsets,
                                                int restart_mcus, int mcus_per_row, int mcu_rows) {
  bool narrow = true;
  for (size_t i = 1; i < offsets.size(); ++i) narrow = narrow && offsets[i] - offsets[i - 1] <= 0xFFFF;
  const size_t entries = offsets.empty() ? 0 : narrow ? 4 + 2 * (offsets.size() - 1) : 4 * offsets.size();
  std::vector<std::byte> out(jpeg.size() + entries + kJpegIndexTrailerSize);
  std::memcpy(out.data(), jpeg.data(), jpeg.size());
  std::byte* p = out.data() + jpeg.size();
  for (size_t i = 0; i < offsets.size(); ++i) {
    if (i == 0 || !narrow) {
      Store<uint32_t>(p, offsets[i]);
      p += 4;
    } else {
      Store<uint16_t>(p, static_cast<uint16_t>(offsets[i] - offsets[i - 1]));
      p += 2;
    }
  }
  Store<uint32_t>(p, static_cast<uint32_t>(jpeg.size()));
  Store<uint32_t>(p + 4, static_cast<uint32_t>(offsets.size()));
  Store<uint16_t>(p + 8, static_cast<uint16_t>(restart_mcus));
  Store<uint16_t>(p + 10, static_cast<uint16_t>(mcus_per_row));
  Store<uint16_t>(p + 12, static_cast<uint16_t>(mcu_rows));
  Store<uint8_t>(p + 14, static_cast<uint8_t>(narrow ? 2 : 4));
  Store<uint8_t>(p + 15, 0);
  Store<uint32_t>(p + 16, kJpegIndexMagic);
  return out;
}

namespace {

// The record CRC: header bytes before and after the CRC field, the payload, then (from v3) the
// record's 8-byte key.
uint32_t RecordCrc(std::span<const std::byte> header_bytes, std::span<const std::byte> payload, uint16_t version,
                   int64_t index) {
  uint32_t crc = Crc32c(header_bytes.first(kOffCrc));
  crc = Crc32c(header_bytes.subspan(kOffSize, kRecordHeaderSize - kOffSize), crc);
  crc = Crc32c(payload, crc);
  if (version < 3) return crc;
  std::array<std::byte, 8> key;
  EncodeKey(static_cast<uint64_t>(index), key);
  return Crc32c(key, crc);
}

}  // namespace

void SealRecordHeader(RecordHeader& header, std::span<const std::byte> payload, int64_t index) {
  header.format_version = kFormatVersion;
  header.payload_size = payload.size();
  header.crc32c = 0;
  std::array<std::byte, kRecordHeaderSize> bytes;
  EncodeRecordHeader(header, bytes);
  header.crc32c = RecordCrc(bytes, payload, header.format_version, index);
}

Status CheckCrc(const RecordView& record) {
  uint32_t crc = RecordCrc(record.header_bytes, record.payload, record.header.format_version, record.index);
  if (crc != record.header.crc32c) {
    return CorruptError(fmt::format("record {}: CRC-32C 0x{:08x}, stored 0x{:08x}", record.index,
                                    crc, record.header.crc32c));
  }
  return OkStatus();
}

void EncodeKey(uint64_t index, std::span<std::byte, 8> out) {
  for (int i = 7; i >= 0; --i) {
    out[i] = static_cast<std::byte>(index & 0xFF);
    index >>= 8;
  }
}

uint64_t DecodeKey(std::span<const std::byte, 8> key) {
  uint64_t v = 0;
  for (std::byte b : key) v = (v << 8) | static_cast<uint8_t>(b);
  return v;
}

}  // namespace stoke::dataset
