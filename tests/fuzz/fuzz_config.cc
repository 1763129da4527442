// Fuzz target: arbitrary bytes as a `stoke train` YAML config. A config that parses must print
// (ConfigToYaml) to a config that parses again to the same text.
#include <cstddef>
#include <cstdint>
#include <string>

#include "train/config.h"

using namespace stoke;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 64 * 1024) return 0;  // a config is small; deep YAML nesting is the parser's own limit
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto config = train::ParseConfig(text, "fuzz.yaml");
  if (!config.ok()) return 0;
  const std::string printed = train::ConfigToYaml(*config);
  auto again = train::ParseConfig(printed, "printed.yaml");
  if (!again.ok() || train::ConfigToYaml(*again) != printed) __builtin_trap();
  return 0;
}
