// Reading untrusted JSON (manifests, checkpoint headers, metrics files). nlohmann's
// get<int64_t>() converts a float such as 5e26 with a cast whose result is undefined, and wraps
// negative numbers into unsigned types; these helpers accept only integers within a range. And
// copying or serialising a value recurses once per level of nesting, so text nested without bound
// is measured (NestingDepth) before it is parsed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/status.h"

namespace stoke {

// Whether `text` is well-formed UTF-8 (JSON text is; nlohmann's dump replaces what is not with
// U+FFFD, so two names that differ only in such bytes would be stored as one).
inline bool IsUtf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    int more = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      more = 1, cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      more = 2, cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      more = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + static_cast<size_t>(more) >= text.size()) return false;  // cut short
    for (int k = 1; k <= more; ++k) {
      const auto n = static_cast<unsigned char>(text[i + k]);
      if ((n & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (n & 0x3F);
    }
    // Overlong forms, surrogates and code points past U+10FFFF.
    if ((more == 2 && cp < 0x800) || (more == 3 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += static_cast<size_t>(more) + 1;
  }
  return true;
}

// j[key] as an integer in [lo, hi]; kCorrupt naming `what` and the key otherwise (missing, not an
// integer, out of range).
inline Result<int64_t> JsonInt(const nlohmann::json& j, std::string_view key, int64_t lo, int64_t hi,
                               std::string_view what) {
  const auto it = j.find(key);
  if (it == j.end()) return CorruptError(fmt::format("{}: missing field '{}'", what, key));
  const nlohmann::json& v = *it;
  bool in_range = false;
  int64_t value = 0;
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    in_range = u <= static_cast<uint64_t>(hi) && (lo <= 0 || u >= static_cast<uint64_t>(lo));
    value = in_range ? static_cast<int64_t>(u) : 0;
  } else if (v.is_number_integer()) {
    value = v.get<int64_t>();
    in_range = value >= lo && value <= hi;
  } else {
    return CorruptError(fmt::format("{}: field '{}' is not an integer", what, key));
  }
  if (!in_range) return CorruptError(fmt::format("{}: field '{}' = {} is out of range [{}, {}]", what, key, v.dump(), lo, hi));
  return value;
}

// The deepest nesting of arrays and objects in a JSON text, strings skipped (their brackets are
// not structure). Linear, no recursion. Meant as a check before parsing: for invalid text the
// number is only an upper bound of what a parser would accept.
inline int NestingDepth(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

}  // namespace stoke
