// Image: an owned, interleaved 8-bit image (HWC), the currency between decode/ and augment/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace stoke {

// Interleaved uint8 pixels, row-major, no row padding: pixels.size() == width*height*channels.
// channels is 1 (gray) or 3 (RGB). A value type; thread-compatible.
struct Image {
  int width = 0;
  int height = 0;
  int channels = 0;
  std::vector<uint8_t> pixels;

  size_t row_bytes() const { return static_cast<size_t>(width) * channels; }
  size_t size_bytes() const { return row_bytes() * height; }
  uint8_t* row(int y) { return pixels.data() + row_bytes() * y; }
  const uint8_t* row(int y) const { return pixels.data() + row_bytes() * y; }
  // Resizes the pixel buffer for the given shape; keeps capacity to avoid reallocations.
  void Reshape(int w, int h, int c) {
    width = w;
    height = h;
    channels = c;
    pixels.resize(size_bytes());
  }
};

// Reinterprets bytes as a read-only byte span.
inline std::span<const std::byte> AsBytes(std::span<const uint8_t> s) {
  return std::as_bytes(s);
}

}  // namespace stoke
