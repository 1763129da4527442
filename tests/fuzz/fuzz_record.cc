// Fuzz target: arbitrary bytes as an LMDB record value (header + payload) and as a manifest. The
// first byte picks the record index the parser is told about; the rest is the value.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "dataset/manifest.h"
#include "dataset/record.h"

using namespace stoke;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  const int64_t index = size > 0 ? data[0] : 0;
  auto record = dataset::ParseRecord(std::span<const std::byte>(bytes, size), index);
  if (record.ok()) {
    (void)dataset::CheckCrc(*record);
    // A parsed view stays inside the input.
    const auto* begin = bytes;
    const auto* end = bytes + size;
    if (record->payload.data() < begin || record->payload.data() + record->payload.size() > end) __builtin_trap();
  }
  (void)dataset::Manifest::Parse(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
