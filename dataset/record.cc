#include "dataset/record.h"

#include <array>
#include <cstring>

#include <fmt/format.h>

#include "common/crc32c.h"

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
  if (h.format_version != kFormatVersion) {
    return InvalidArgumentError(
        fmt::format("record {}: format v{}, this build reads v{} (re-pack with this stoke)", index,
                    h.format_version, kFormatVersion));
  }
  auto enc = Load<uint8_t>(p + kOffEncoding);
  if (enc != static_cast<uint8_t>(PayloadEncoding::kJpeg) &&
      enc != static_cast<uint8_t>(PayloadEncoding::kRaw)) {
    return err(fmt::format("unknown payload encoding {}", enc));
  }
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
  if (h.encoding == PayloadEncoding::kRaw &&
      h.payload_size != uint64_t{h.width} * h.height * h.channels) {
    return err(fmt::format("raw payload of {} bytes for {}x{}x{}", h.payload_size, h.width,
                           h.height, h.channels));
  }
  r.header_bytes = value.first(kRecordHeaderSize);
  r.payload = value.subspan(kRecordHeaderSize);
  return r;
}

namespace {

// The record CRC: header bytes before and after the CRC field, then the payload.
uint32_t RecordCrc(std::span<const std::byte> header_bytes, std::span<const std::byte> payload) {
  uint32_t crc = Crc32c(header_bytes.first(kOffCrc));
  crc = Crc32c(header_bytes.subspan(kOffSize, kRecordHeaderSize - kOffSize), crc);
  return Crc32c(payload, crc);
}

}  // namespace

void SealRecordHeader(RecordHeader& header, std::span<const std::byte> payload) {
  header.format_version = kFormatVersion;
  header.payload_size = payload.size();
  header.crc32c = 0;
  std::array<std::byte, kRecordHeaderSize> bytes;
  EncodeRecordHeader(header, bytes);
  header.crc32c = RecordCrc(bytes, payload);
}

Status CheckCrc(const RecordView& record) {
  uint32_t crc = RecordCrc(record.header_bytes, record.payload);
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
