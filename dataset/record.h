// The on-disk record: a fixed 32-byte little-endian header followed by the payload bytes.
// docs/FORMAT.md is the specification; this header is its implementation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace stoke::dataset {

// Format version written by this build. It reads this one and every older one back to
// kOldestFormatVersion (v1 lacks restart-indexed JPEG records; v2's CRC does not cover the
// record's index; nothing else changed).
inline constexpr uint16_t kFormatVersion = 3;
inline constexpr uint16_t kOldestFormatVersion = 1;
inline bool ReadableFormatVersion(uint32_t v) { return v >= kOldestFormatVersion && v <= kFormatVersion; }
// The most records a dataset may hold (docs/RELIABILITY.md): a larger count in a manifest or given
// to a sampler is damage or a mistake, and bounding it keeps the arithmetic on counts (sums,
// shares of a world size) within 64 bits.
inline constexpr int64_t kMaxRecords = int64_t{1} << 40;
// "STKR" as little-endian bytes 'S' 'T' 'K' 'R'.
inline constexpr uint32_t kRecordMagic = 0x524B5453u;
inline constexpr size_t kRecordHeaderSize = 32;

enum class PayloadEncoding : uint8_t {
  kJpeg = 1,         // a baseline or progressive 8-bit JPEG, 1 or 3 components, upright pixels
  kRaw = 2,          // width*height*channels uint8 pixels, HWC, no padding
  kJpegIndexed = 3,  // v2: a sequential JPEG with restart markers, then its restart index
};
std::string_view EncodingName(PayloadEncoding e);

// Decoded header fields. width/height/channels describe the upright image.
struct RecordHeader {
  uint16_t format_version = kFormatVersion;
  PayloadEncoding encoding = PayloadEncoding::kJpeg;
  uint8_t channels = 3;
  int32_t label = 0;
  uint32_t width = 0;
  uint32_t height = 0;
  // CRC-32C over the header's other fields (bytes [0,20) and [24,32)) and the payload, so a
  // damaged label or size is caught as surely as a damaged image.
  uint32_t crc32c = 0;
  uint64_t payload_size = 0;
};

// The restart index of a kJpegIndexed record, as stored: where each restart interval of the JPEG
// starts (docs/FORMAT.md). `entries` is a view into the record; decode::RestartIndex takes the
// same fields.
struct JpegIndexView {
  uint32_t intervals = 0;
  uint16_t restart_mcus = 0;   // MCUs per restart interval
  uint16_t mcus_per_row = 0;
  uint16_t mcu_rows = 0;
  uint8_t entry_bytes = 0;     // 4: uint32 offsets; 2: a uint32, then uint16 distances; 0: no index
  std::span<const std::byte> entries;
};

// A record read in place. The spans point into the LMDB map (or whatever buffer was parsed) and
// are valid as long as that memory is: for a dataset reader, until its read transaction ends.
struct RecordView {
  int64_t index = -1;
  RecordHeader header;
  std::span<const std::byte> header_bytes;  // the 32 stored header bytes
  std::span<const std::byte> payload;       // everything after the header (what the CRC covers)
  std::span<const std::byte> image;         // the JPEG or the raw pixels (payload less any index)
  JpegIndexView jpeg_index;                 // kJpegIndexed only
};

// The stored index block that follows the JPEG in a kJpegIndexed payload: entries, then a 20-byte
// trailer (jpeg size, interval count, the MCU grid, the entry size, "STRX").
inline constexpr size_t kJpegIndexTrailerSize = 20;
inline constexpr uint32_t kJpegIndexMagic = 0x58525453u;  // "STRX"

// The payload of a kJpegIndexed record: `jpeg` followed by the index of `offsets` (each interval's
// first entropy-coded byte in `jpeg`, increasing), as 16-bit distances when they all fit, else as
// 32-bit offsets.
std::vector<std::byte> EncodeJpegIndexedPayload(std::span<const std::byte> jpeg, std::span<const uint32_t> offsets,
                                                int restart_mcus, int mcus_per_row, int mcu_rows);

// Checks a kRaw record's pixel dimensions against its payload size: 1 or 3 channels, width and
// height > 0, at most kMaxImagePixels pixels, and width * height * channels equal to
// `payload_bytes` (a product that cannot wrap: each factor is bounded first). kCorrupt saying
// which fails, without the record's index (callers add it).
Status CheckRawDimensions(const RecordHeader& header, uint64_t payload_bytes);

// Serialises `header` into out[0..32) as it is (see SealRecordHeader for size and CRC).
void EncodeRecordHeader(const RecordHeader& header, std::span<std::byte, kRecordHeaderSize> out);

// Sets format_version, payload_size and crc32c of `header` for `payload` stored as record `index`
// (from v3 the CRC covers the index too: a value that a damaged B-tree serves under another key
// fails its check instead of passing for that record).
void SealRecordHeader(RecordHeader& header, std::span<const std::byte> payload, int64_t index);

// Parses a stored value (header + payload) without copying. kCorrupt when the value is shorter
// than the header, has the wrong magic, an unknown encoding, a payload length that does not match
// the value, a raw payload whose size disagrees with width*height*channels, or an index block
// whose trailer or sizes do not add up; kInvalidArgument (with "re-pack" advice) for a format
// version this build cannot read. Does not check the CRC: see CheckCrc.
Result<RecordView> ParseRecord(std::span<const std::byte> value, int64_t index);

// kCorrupt naming the record index when the CRC-32C of header fields, payload and (v3 records)
// the index differs from the stored one.
Status CheckCrc(const RecordView& record);

// 8-byte big-endian key for a record index: byte order = index order in LMDB.
void EncodeKey(uint64_t index, std::span<std::byte, 8> out);
uint64_t DecodeKey(std::span<const std::byte, 8> key);

}  // namespace stoke::dataset
