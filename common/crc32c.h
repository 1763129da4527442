// CRC-32C (Castagnoli), the checksum of every record payload. Uses the SSE4.2 crc32
// instruction when the CPU has it (several GB/s) and a table otherwise; both give the same value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace stoke {

// CRC-32C of `data`, continuing from `crc` (0 for a fresh checksum). Thread-safe.
uint32_t Crc32c(std::span<const std::byte> data, uint32_t crc = 0);

}  // namespace stoke
