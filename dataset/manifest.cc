#include "dataset/manifest.h"

#include <climits>
#include <cstdint>
#include <map>
#include <string_view>

#include <fmt/format.h>

#include "common/json_util.h"
#include "dataset/record.h"

namespace stoke::dataset {

nlohmann::json Manifest::ToJson() const {
  return nlohmann::json{{"format_version", format_version},
                        {"records", records},
                        {"classes", classes},
                        {"class_counts", class_counts},
                        {"payload_bytes", payload_bytes},
                        {"has_paths", has_paths},
                        {"packing", packing}};
}

Result<Manifest> Manifest::FromJson(const nlohmann::json& j) {
  // nlohmann throws on type mismatches; wrap so a damaged manifest is a Status, not a crash.
  try {
    if (!j.is_object()) return CorruptError("manifest: not a JSON object");
    // The version before the other fields: a newer stoke may have renamed or moved them, and its
    // dataset is to be named as that, not as a damaged one.
    STOKE_ASSIGN_OR_RETURN(const int64_t version,
                           JsonInt(j, "format_version", 0, INT32_MAX, "manifest"));
    if (version > kFormatVersion) {
      return InvalidArgumentError(
          fmt::format("manifest: written by a newer stoke (format v{}, this build reads up to v{}): "
                      "read it with that stoke, or re-pack it with this one",
                      version, kFormatVersion));
    }
    for (const char* key : {"records", "classes", "class_counts"}) {
      if (!j.contains(key)) return CorruptError(fmt::format("manifest: missing field '{}'", key));
    }
    Manifest m;
    m.format_version = static_cast<uint32_t>(version);
    STOKE_ASSIGN_OR_RETURN(m.records, JsonInt(j, "records", 0, kMaxRecords, "manifest"));
    const nlohmann::json& classes = j.at("classes");
    if (!classes.is_array()) return CorruptError("manifest: 'classes' is not a list");
    for (size_t i = 0; i < classes.size(); ++i) {
      if (!classes[i].is_string()) {
        return CorruptError(fmt::format("manifest: classes[{}] is {}, not a name (a string)", i, classes[i].type_name()));
      }
      m.classes.push_back(classes[i].get<std::string>());
    }
    {
      // Names are how models, evaluation and predictions tell classes apart: two alike would
      // merge them in every report.
      std::map<std::string_view, size_t> first;
      for (size_t i = 0; i < m.classes.size(); ++i) {
        if (auto [at, fresh] = first.emplace(m.classes[i], i); !fresh) {
          return CorruptError(fmt::format("manifest: classes[{}] and classes[{}] are both named '{}'", at->second, i,
                                          m.classes[i]));
        }
      }
    }
    const nlohmann::json& counts = j.at("class_counts");
    if (!counts.is_array()) return CorruptError("manifest: 'class_counts' is not a list");
    for (size_t i = 0; i < counts.size(); ++i) {
      STOKE_ASSIGN_OR_RETURN(const int64_t count,
                             JsonInt(nlohmann::json{{"count", counts[i]}}, "count", 0, kMaxRecords,
                                     fmt::format("manifest: class_counts[{}]", i)));
      m.class_counts.push_back(count);
    }
    m.payload_bytes_stored = j.contains("payload_bytes");
    if (m.payload_bytes_stored) {
      STOKE_ASSIGN_OR_RETURN(m.payload_bytes, JsonInt(j, "payload_bytes", 0, INT64_MAX / 2, "manifest"));
    }
    if (const auto paths = j.find("has_paths"); paths != j.end()) {
      if (!paths->is_boolean()) {
        return CorruptError(fmt::format("manifest: 'has_paths' is {}, not true or false", paths->type_name()));
      }
      m.has_paths = paths->get<bool>();
    }
    if (j.contains("packing")) m.packing = j.at("packing");
    if (!m.packing.is_object()) return CorruptError("manifest: 'packing' is not an object");
    if (m.class_counts.size() != m.classes.size()) {
      return CorruptError(fmt::format("manifest: {} class counts for {} classes",
                                      m.class_counts.size(), m.classes.size()));
    }
    int64_t sum = 0;  // each count <= 2^40, so the running sum stops before it could overflow
    for (int64_t c : m.class_counts) {
      sum += c;
      if (sum > m.records) break;
    }
    if (sum != m.records) {
      return CorruptError(fmt::format("manifest: class counts sum to {}{}, records is {}", sum > m.records ? "more than " : "",
                                      sum > m.records ? m.records : sum, m.records));
    }
    return m;
  } catch (const nlohmann::json::exception& e) {
    return CorruptError(fmt::format("manifest: {}", e.what()));
  }
}

Result<Manifest> Manifest::Parse(std::string_view text) {
  // Copying or printing a parsed value recurses once per level: a manifest nested tens of
  // thousands deep would exhaust the stack. Real ones nest three or four levels ("packing").
  constexpr int kMaxDepth = 64;
  if (const int depth = NestingDepth(text); depth > kMaxDepth) {
    return CorruptError(fmt::format(
        "manifest: JSON nested {} levels deep, more than the {} allowed", depth, kMaxDepth));
  }
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return CorruptError("manifest: not valid JSON");
  return FromJson(j);
}

}  // namespace stoke::dataset
