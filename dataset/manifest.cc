#include "dataset/manifest.h"

#include <numeric>

#include <fmt/format.h>

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
    for (const char* key : {"format_version", "records", "classes", "class_counts"}) {
      if (!j.contains(key)) return CorruptError(fmt::format("manifest: missing field '{}'", key));
    }
    Manifest m;
    m.format_version = j.at("format_version").get<uint32_t>();
    m.records = j.at("records").get<int64_t>();
    m.classes = j.at("classes").get<std::vector<std::string>>();
    m.class_counts = j.at("class_counts").get<std::vector<int64_t>>();
    m.payload_bytes = j.value("payload_bytes", int64_t{0});
    m.has_paths = j.value("has_paths", false);
    if (j.contains("packing")) m.packing = j.at("packing");
    if (!m.packing.is_object()) return CorruptError("manifest: 'packing' is not an object");
    if (m.class_counts.size() != m.classes.size()) {
      return CorruptError(fmt::format("manifest: {} class counts for {} classes",
                                      m.class_counts.size(), m.classes.size()));
    }
    int64_t sum = std::accumulate(m.class_counts.begin(), m.class_counts.end(), int64_t{0});
    if (sum != m.records) {
      return CorruptError(
          fmt::format("manifest: class counts sum to {}, records is {}", sum, m.records));
    }
    return m;
  } catch (const nlohmann::json::exception& e) {
    return CorruptError(fmt::format("manifest: {}", e.what()));
  }
}

Result<Manifest> Manifest::Parse(std::string_view text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return CorruptError("manifest: not valid JSON");
  return FromJson(j);
}

}  // namespace stoke::dataset
