// FNV-1a, 64 bits: a fast digest for telling things apart (configs, options, states, datasets
// across ranks); not for integrity (records carry CRC-32C) and not for security.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace stoke {

inline constexpr uint64_t kFnvBasis = 0xcbf29ce484222325ull;

// Continues digest `h` over `bytes` bytes at `data` (kFnvBasis for a fresh digest).
inline uint64_t Fnv1a(const void* data, size_t bytes, uint64_t h = kFnvBasis) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}
inline uint64_t Fnv1a(std::string_view s, uint64_t h = kFnvBasis) { return Fnv1a(s.data(), s.size(), h); }

}  // namespace stoke
