// The dataset manifest: what a packed LMDB holds and how it was made. Stored as JSON under the
// key "manifest" of the "meta" sub-database (docs/FORMAT.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace stoke::dataset {

struct Manifest {
  uint32_t format_version = 0;
  int64_t records = 0;
  std::vector<std::string> classes;   // class names in label order
  std::vector<int64_t> class_counts;  // records per label, same length as classes
  int64_t payload_bytes = 0;          // sum of payload sizes
  bool payload_bytes_stored = true;   // false: read from a manifest without the field (older writers)
  bool has_paths = false;             // the "paths" sub-database maps index -> source path
  // How it was packed: tool version, options, seed, date, source. Free-form but always an object.
  nlohmann::json packing = nlohmann::json::object();

  nlohmann::json ToJson() const;
  // kCorrupt naming the missing or mistyped field; checks class_counts against classes and
  // records (at most kMaxRecords). kInvalidArgument for a format_version newer than this build
  // reads, checked before any other field.
  static Result<Manifest> FromJson(const nlohmann::json& j);
  // FromJson of a JSON text; kCorrupt for text that is not JSON or nests more than 64 levels.
  static Result<Manifest> Parse(std::string_view text);

  bool operator==(const Manifest&) const = default;
};

}  // namespace stoke::dataset
