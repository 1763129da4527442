// Bounds on options that ask for threads (decoding, packing, verifying, compute): beyond them a
// request is a mistake, not a machine. And bounds on what stored data may claim.
#pragma once

#include <cstdint>

namespace stoke {

inline constexpr int kMaxThreads = 4096;

// The most pixels an image may have: the decoder's default cap (a larger JPEG is a decompression
// bomb), the packer's for other formats, and so the largest raw record a pack writes.
inline constexpr int64_t kMaxImagePixels = 250'000'000;

}  // namespace stoke
