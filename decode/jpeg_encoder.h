// JPEG encoding with TurboJPEG: used by pack (re-encode, format conversion) and by tests that
// make their own images.
#pragma once

#include <cstddef>
#include <vector>

#include "common/c_handles.h"
#include "common/image.h"
#include "common/status.h"

namespace stoke::decode {

enum class ChromaSubsampling { k444, k422, k420 };

struct EncodeOptions {
  int quality = 90;  // 1..100
  ChromaSubsampling subsampling = ChromaSubsampling::k420;  // ignored for 1-channel images
  bool progressive = false;
};

// Encodes 1-channel (gray) or 3-channel (RGB) images. Not thread-safe: one encoder per thread.
class JpegEncoder {
 public:
  static Result<JpegEncoder> Create();

  // The JPEG bytes of `image`. kInvalidArgument for an empty image, a channel count other than
  // 1 or 3, or a quality outside 1..100.
  Result<std::vector<std::byte>> Encode(const Image& image, const EncodeOptions& options);

 private:
  explicit JpegEncoder(TjHandle h) : handle_(std::move(h)) {}
  TjHandle handle_;
};

}  // namespace stoke::decode
