// libjpeg plumbing shared by the decoder and the transcoder (private to decode/): error and
// progress managers that longjmp back to the caller's setjmp, and the header parse.
#pragma once

// clang-format off
#include <cstdio>   // jpeglib.h needs FILE and size_t first
#include <jpeglib.h>
// clang-format on

#include <csetjmp>
#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "decode/jpeg_decoder.h"

namespace stoke::decode::detail {

// libjpeg reports errors through callbacks; these longjmp back to the setjmp of the calling
// function. Everything between setjmp and longjmp is C (libjpeg) or trivially destructible, so
// skipping those frames is well-defined.
struct ErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX + 32];  // room for a prefix before libjpeg's text
  StatusCode code;
  bool strict;   // warnings are errors
  int warnings;  // warnings seen by the current call (lenient mode)
  // Set while decoding a stream stoke assembled itself (DecodeRegion with a restart index): the
  // zero bytes it puts before each marker. Exactly that many skipped before a restart marker (the
  // Huffman decoder counts the whole bytes left in its bit buffer as skipped too), and at most
  // that many before EOI (its read-ahead is not counted there), are expected; any other count is
  // an interval that ends early or runs on, and is damage. 0 outside such streams.
  int allow_extraneous;
};

struct ProgressManager {
  jpeg_progress_mgr pub;
  int max_scans;
};

// error_exit: formats the message and longjmps (kCorrupt).
[[noreturn]] void OnError(j_common_ptr cinfo);
// emit_message: a warning (msg_level -1) is corruption in strict mode, counted in lenient mode.
void OnMessage(j_common_ptr cinfo, int msg_level);
// progress_monitor: more than max_scans progressive scans is kCorrupt (libjpeg-turbo 2.1 has no
// limit of its own).
void OnProgress(j_common_ptr cinfo);

// Starts a decompression of `data`, reads its header into `info`. Must run inside a setjmp scope.
void ReadHeaderInto(jpeg_decompress_struct* cinfo, const std::byte* data, size_t size, JpegInfo* info);

Status PixelLimitError(const JpegInfo& info, int64_t max_pixels);

// The message for sampling factors a full-size decode rejects (Validate and Transcode agree).
inline constexpr const char* kFractionalSampling =
    "libjpeg: Fractional sampling not implemented yet (sampling factors that a full-size decode rejects)";

}  // namespace stoke::decode::detail
