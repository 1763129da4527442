// Strict JPEG decoding with libjpeg-turbo's libjpeg API: every warning is corruption, pixel and
// scan counts are capped, EXIF orientation is reported.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "common/image.h"
#include "common/limits.h"
#include "common/status.h"

namespace stoke::decode {

enum class JpegColorSpace { kGray, kYCbCr, kRgb, kCmyk, kYcck, kUnknown };
std::string_view ColorSpaceName(JpegColorSpace cs);

// Chroma subsampling, named by the luma sampling factors relative to chroma (h x v).
enum class Subsampling { k444, k422, k420, k440, k411, k410, kGray, kOther };
std::string_view SubsamplingName(Subsampling s);  // "4:2:0", "gray", "other", ...

// What the header says. width/height are the stored (not EXIF-rotated) size. Trivially
// destructible on purpose: it lives in frames that libjpeg's error handling longjmps across.
struct JpegInfo {
  int width = 0;
  int height = 0;
  int components = 0;
  JpegColorSpace color_space = JpegColorSpace::kUnknown;
  Subsampling subsampling = Subsampling::kOther;
  bool progressive = false;
  // EXIF orientation 1..8 (TIFF convention); 1 when absent or out of range.
  int orientation = 1;
  // Every component's sampling factors divide the largest ones: what libjpeg's full-size
  // upsampler requires ("fractional sampling" is rejected there, but not at reduced scales).
  bool integral_sampling = true;
};

struct DecoderOptions {
  int64_t max_pixels = kMaxImagePixels;  // larger are kResourceExhausted (decompression bombs)
  int max_scans = 500;               // progressive scans beyond this are kCorrupt (CPU bombs)
  // Strict (default): any libjpeg warning (premature end of data, corrupt Huffman code,
  // extraneous bytes, ...) fails the call with kCorrupt. Lenient: libjpeg's recovery is accepted
  // (a truncated image is padded, a bad code skipped), the warnings are counted and the first is
  // kept (last_warnings(), last_warning()). Fatal errors fail in both modes.
  bool strict = true;
};

// A rectangle of the stored image in full-resolution pixels.
struct Region {
  int x = 0;
  int y = 0;
  int width = 0;
  int height = 0;
};

// A restart index (decode/jpeg_transcode.h makes them): the JPEG is sequential with one scan and a
// restart marker every `restart_mcus` MCUs, a divisor of `mcus_per_row`, so each MCU row is cut
// into mcus_per_row / restart_mcus intervals that decode independently. `entries` locates, for
// every interval in raster order, its first entropy-coded byte in the JPEG (a view into a record:
// little-endian, no alignment needed), in one of two encodings:
//   entry_bytes 4: each offset as a uint32;
//   entry_bytes 2: the first offset as a uint32, then each next one as the uint16 distance from
//                  the previous one (intervals are short: this halves the index).
struct RestartIndex {
  int restart_mcus = 0;
  int mcus_per_row = 0;
  int mcu_rows = 0;
  int entry_bytes = 4;
  size_t intervals = 0;
  std::span<const std::byte> entries;
};

// The absolute offset of every interval of `index`, into `offsets` (reusing its capacity).
// kCorrupt when the entries' size does not match the interval count or the encoding is unknown.
Status ExpandRestartOffsets(const RestartIndex& index, std::vector<uint32_t>* offsets);

// Where a requested region lies in what DecodeRegion() produced.
struct DecodedRegion {
  int scale_denom = 1;  // decoded at 1/scale_denom of full size
  // The requested region in the output image's pixel coordinates (fractional when scaled).
  double x = 0, y = 0, width = 0, height = 0;
};

// The DCT scale 1/d (d = 8, 4, 2 or 1; the scales libjpeg-turbo has SIMD IDCTs for) that
// DecodeRegion() uses for a region_width x region_height region that must come out at least
// min_width x min_height: the largest d that keeps both sides at or above the minimum.
int ChooseRegionScale(int region_width, int region_height, int min_width, int min_height);

// True when `data` starts with a JPEG SOI marker followed by a marker (FF D8 FF).
bool LooksLikeJpeg(std::span<const std::byte> data);

// Decodes JPEGs. Baseline, progressive, arithmetic, any chroma subsampling libjpeg supports,
// grayscale, RGB, and CMYK/YCCK (converted to RGB). 12-bit and lossless JPEGs are kCorrupt with
// the library's reason (libjpeg-turbo 2.1 is 8-bit only).
// Not thread-safe: one decoder per worker thread. Reuses its libjpeg state between images.
class JpegDecoder {
 public:
  explicit JpegDecoder(DecoderOptions options = {});
  ~JpegDecoder();
  JpegDecoder(const JpegDecoder&) = delete;
  JpegDecoder& operator=(const JpegDecoder&) = delete;

  // Parses markers up to the first scan. kCorrupt (with libjpeg's message) for a bad header;
  // kResourceExhausted past max_pixels.
  Result<JpegInfo> ReadHeader(std::span<const std::byte> jpeg);

  // Decodes the whole image into `out`: 1 channel for grayscale JPEGs, 3 (RGB) for the rest.
  // `scale_denom` (1, 2, 4 or 8) decodes at 1/scale_denom size in the DCT domain; every
  // coefficient is still entropy-decoded, so corruption is still caught. Any libjpeg warning
  // (premature end of data, corrupt Huffman code, extraneous bytes, ...) fails with kCorrupt.
  // `out` keeps its capacity across calls. Fills `info` when not null.
  Status Decode(std::span<const std::byte> jpeg, Image* out, int scale_denom = 1,
                JpegInfo* info = nullptr);

  // Checks that a strict full-size Decode() would succeed, at about 1.5x its speed: every marker
  // is parsed and every coefficient entropy-decoded with warnings as errors (corruption shows up
  // there), the output path runs at 1/8 scale (the IDCT emits one pixel per block), and the
  // sampling factors must be ones the full-size upsampler accepts. Same error codes as Decode().
  Status Validate(std::span<const std::byte> jpeg, JpegInfo* info = nullptr);

  // Decodes `region` (clamped to the image) as RGB8 at the cheapest DCT scale (1/1, 1/2, 1/4 or
  // 1/8: the scales libjpeg-turbo has SIMD IDCTs for) that keeps the region at least
  // min_width x min_height. Rows above the region are skipped (entropy-decoded only), decoding
  // stops after its last row, and columns are cropped to the iMCU grid, one iMCU wider than the
  // region on each side, when the region is narrow enough for that to pay (never for sampling
  // ratios other than 1 and 2). The pixels are bit-identical to the same region of a full decode
  // at the same scale. Strictness covers what is decoded: a region that reaches the
  // last row is checked like a full decode; data below a region is not read at all. `out` receives the decoded block (a little larger than the
  // region: whole iMCU columns); the result says where the region lies in it. Grayscale and
  // CMYK/YCCK come out as RGB. Errors as Decode(). Reuses `out`'s capacity.
  // `scale_denom` 0 chooses the scale with ChooseRegionScale(); 1, 2, 4 or 8 imposes one (when
  // the caller has already aligned its plan to that scale).
  // With a restart index, only the restart intervals the region needs are decoded: its MCU rows
  // and the intervals across its columns, with one MCU of context on every side (what chroma
  // upsampling reads), assembled into a small JPEG of their own. The pixels are bit-identical to
  // the same region of a full decode at the same scale. kCorrupt when the index does not match
  // the data: the first interval must start where the scan header ends, and every interval used
  // must start right after the restart marker before it and end at the one after it, numbers
  // included. An index whose intervals are all whole but listed a multiple of 8 intervals away
  // passes these checks; decode::CheckRestartIndex (`stoke inspect --verify`) finds it, and a
  // record's CRC finds damage in storage.
  Result<DecodedRegion> DecodeRegion(std::span<const std::byte> jpeg, Region region,
                                     int min_width, int min_height, Image* out,
                                     int scale_denom = 0, const RestartIndex* index = nullptr);

  // Lenient mode: how many warnings libjpeg recovered from in the last call, and the first one's
  // text (empty when none). Always 0 / empty in strict mode.
  int last_warnings() const;
  std::string_view last_warning() const;

 private:
  struct State;
  DecoderOptions options_;
  std::unique_ptr<State> state_;
};

// Parses an EXIF APP1 payload ("Exif\0\0" + TIFF) for the orientation tag (0x0112).
// Returns 1..8, or 1 when the tag is absent, out of range or the block is malformed.
int ParseExifOrientation(std::span<const std::byte> app1);

}  // namespace stoke::decode
