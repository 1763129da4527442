#include "decode/jpeg_encoder.h"

#include <cstring>

#include <fmt/format.h>

namespace stoke::decode {

Result<JpegEncoder> JpegEncoder::Create() {
  tjhandle h = tjInitCompress();
  if (h == nullptr) return InternalError(fmt::format("turbojpeg: {}", tjGetErrorStr2(nullptr)));
  return JpegEncoder(TjHandle(h));
}

Result<std::vector<std::byte>> JpegEncoder::Encode(const Image& image,
                                                   const EncodeOptions& options) {
  if (image.width <= 0 || image.height <= 0) return InvalidArgumentError("encode: empty image");
  if (image.channels != 1 && image.channels != 3) {
    return InvalidArgumentError(fmt::format("encode: {} channels (expected 1 or 3)", image.channels));
  }
  if (options.quality < 1 || options.quality > 100) {
    return InvalidArgumentError(fmt::format("encode: quality {} not in 1..100", options.quality));
  }
  int subsamp = TJSAMP_GRAY;
  if (image.channels == 3) {
    switch (options.subsampling) {
      case ChromaSubsampling::k444: subsamp = TJSAMP_444; break;
      case ChromaSubsampling::k422: subsamp = TJSAMP_422; break;
      case ChromaSubsampling::k420: subsamp = TJSAMP_420; break;
    }
  }
  const int pixel_format = image.channels == 1 ? TJPF_GRAY : TJPF_RGB;
  int flags = TJFLAG_ACCURATEDCT;
  if (options.progressive) flags |= TJFLAG_PROGRESSIVE;
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  int rc = tjCompress2(handle_.get(), image.pixels.data(), image.width, 0, image.height,
                       pixel_format, &buf, &size, subsamp, options.quality, flags);
  if (rc != 0) {
    std::string err = tjGetErrorStr2(handle_.get());
    tjFree(buf);
    return InternalError("turbojpeg: compress: " + err);
  }
  std::vector<std::byte> out(size);
  std::memcpy(out.data(), buf, size);
  tjFree(buf);
  return out;
}

}  // namespace stoke::decode
