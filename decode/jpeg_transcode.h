// Lossless transcoding into the form the loader decodes fastest, and the restart index that goes
// with it. The transcode keeps every DCT coefficient (so every pixel) and rewrites the stream as
// baseline sequential JPEG with optimised Huffman tables and a restart marker every
// `restart_mcus` MCUs, a divisor of the MCU row: each row is cut into intervals that decode
// independently. The index is the byte offset of every interval, so that a crop decodes only the
// intervals of its own rows and columns (JpegDecoder::DecodeRegion with a RestartIndex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "decode/jpeg_decoder.h"

namespace stoke::decode {

struct TranscodeOptions {
  // Restart intervals per MCU row: the largest divisor of the row's MCU count that gives at least
  // this many intervals is used, so that a crop can skip columns as well as rows. More intervals
  // skip finer but each costs a marker, byte padding and an index entry (~6 bytes).
  int intervals_per_row = 8;
  // How the optimal Huffman tables are found: true counts the symbols in one pass over the
  // non-zero coefficients and encodes once; false lets libjpeg run its own gathering pass (a
  // full trial encode) before the real one. The two give byte-identical output; the first is
  // faster (the test keeps them equal).
  bool fast_tables = true;
  // With fast_tables: check that the symbols counted fill the bytes written (else transcode again
  // with libjpeg's pass). Off only in tests that compare the two builders directly.
  bool check_counts = true;
};

// A transcoded JPEG and its restart index.
struct TranscodedJpeg {
  std::vector<std::byte> jpeg;
  int restart_mcus = 0;          // MCUs per restart interval
  int mcus_per_row = 0;
  int mcu_rows = 0;
  std::vector<uint32_t> offsets;  // per interval, in raster order: its first entropy-coded byte
  JpegInfo info;
};

// Reads a JPEG's coefficients strictly and writes them back as above. Not thread-safe: one
// transcoder per worker thread; reuses its libjpeg state and buffers.
class JpegTranscoder {
 public:
  explicit JpegTranscoder(DecoderOptions options = {}, TranscodeOptions transcode = {});
  ~JpegTranscoder();
  JpegTranscoder(const JpegTranscoder&) = delete;
  JpegTranscoder& operator=(const JpegTranscoder&) = delete;

  // Transcodes `jpeg`. Reading every coefficient strictly is the validation: it refuses what
  // JpegDecoder::Validate refuses, with the same codes and messages (corrupt data, a libjpeg
  // warning, fractional sampling a full-size decode rejects, the pixel and scan limits).
  // kUnavailable for images that stay as they are: not 8-bit YCbCr, RGB or grayscale
  // (CMYK/YCCK, other component counts). Fills `out` (reusing its capacity).
  Status Transcode(std::span<const std::byte> jpeg, TranscodedJpeg* out);

 private:
  struct State;
  DecoderOptions options_;
  TranscodeOptions transcode_;
  std::unique_ptr<State> state_;
};

// Checks a restart index against its JPEG: the offsets increase and lie in the entropy-coded
// data, each interval after the first follows an RSTn marker with n counting 0..7 in turn, the
// data ends with EOI, and the count matches the MCU grid. kCorrupt naming the first mismatch.
Status CheckRestartIndex(std::span<const std::byte> jpeg, const RestartIndex& index);

// The restart offsets of a JPEG with restart markers, found by scanning its entropy-coded data
// (what Transcode() reports, recomputed from the bytes). kCorrupt when it has no single scan.
Result<std::vector<uint32_t>> FindRestartOffsets(std::span<const std::byte> jpeg);

}  // namespace stoke::decode
