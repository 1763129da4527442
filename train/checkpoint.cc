#include "train/checkpoint.h"

#include <algorithm>
#include <climits>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/crc32c.h"
#include "common/file_util.h"
#include "common/json_util.h"

namespace stoke::train {
namespace {

constexpr char kMagic[8] = {'S', 'T', 'O', 'K', 'E', 'C', 'K', 'P'};
constexpr size_t kFixed = sizeof(kMagic) + sizeof(uint32_t) + sizeof(uint64_t);

template <typename T>
void Put(std::vector<std::byte>& out, T value) {
  const auto* p = reinterpret_cast<const std::byte*>(&value);
  out.insert(out.end(), p, p + sizeof(T));
}
template <typename T>
T Get(const std::byte* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

}  // namespace

std::vector<std::byte> SerializeCheckpoint(const Checkpoint& c) {
  nlohmann::json tensors = nlohmann::json::array();
  uint64_t offset = 0;
  for (const auto& t : c.tensors) {
    tensors.push_back({{"name", t.name}, {"dims", t.dims}, {"offset", offset}, {"count", t.values.size()}});
    offset += t.values.size();
  }
  nlohmann::json head{{"step", c.step},       {"steps_per_epoch", c.steps_per_epoch},
                    {"seed", c.seed},       {"backend", c.backend},
                    {"config", c.config_yaml}, {"tensors", tensors}};
  if (!c.classes.empty()) head["classes"] = c.classes;  // optional: older checkpoints lack it
  // Optional too. JSON keeps a double's 17 digits, so the sums come back bit for bit.
  auto sums = [](const BatchStats& r) { return nlohmann::json::array({r.loss_sum, r.top1, r.top5, r.count}); };
  head["running"] = {{"interval", sums(c.interval)}, {"epoch", sums(c.epoch)}};
  const std::string header = head.dump();
  std::vector<std::byte> out;
  out.reserve(kFixed + header.size() + offset * sizeof(float) + sizeof(uint32_t));
  for (char ch : kMagic) out.push_back(static_cast<std::byte>(ch));
  Put<uint32_t>(out, kCheckpointFormatVersion);
  Put<uint64_t>(out, header.size());
  const auto* h = reinterpret_cast<const std::byte*>(header.data());
  out.insert(out.end(), h, h + header.size());
  for (const auto& t : c.tensors) {
    const auto* v = reinterpret_cast<const std::byte*>(t.values.data());
    out.insert(out.end(), v, v + t.values.size() * sizeof(float));
  }
  Put<uint32_t>(out, Crc32c(out));
  return out;
}

Result<Checkpoint> ParseCheckpoint(std::span<const std::byte> bytes, const std::string& source) {
  auto corrupt = [&](const std::string& what) {
    return CorruptError(fmt::format("checkpoint {}: {}", source, what));
  };
  if (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return corrupt(fmt::format("not a stoke checkpoint ({} bytes, no STOKECKP header)", bytes.size()));
  }
  if (bytes.size() < kFixed + sizeof(uint32_t)) {
    return corrupt(fmt::format("truncated: {} bytes, fewer than a checkpoint's fixed header and checksum ({})",
                               bytes.size(), kFixed + sizeof(uint32_t)));
  }
  const auto version = Get<uint32_t>(bytes.data() + sizeof(kMagic));
  if (version != kCheckpointFormatVersion) {
    return corrupt(fmt::format("format version {}; this build reads version {}", version, kCheckpointFormatVersion));
  }
  const size_t body = bytes.size() - sizeof(uint32_t);
  const auto stored = Get<uint32_t>(bytes.data() + body);
  if (Crc32c(bytes.first(body)) != stored) {
    return corrupt("checksum mismatch: the file is truncated or damaged");
  }
  const auto header_len = Get<uint64_t>(bytes.data() + sizeof(kMagic) + sizeof(uint32_t));
  if (header_len > body - kFixed) return corrupt("header length past the end of the file");
  Checkpoint c;
  const std::string what = fmt::format("checkpoint {}", source);
  try {
    const auto header = nlohmann::json::parse(
        std::string_view(reinterpret_cast<const char*>(bytes.data() + kFixed), header_len), nullptr, false);
    if (!header.is_object()) return corrupt("the header is not a JSON object");
    STOKE_ASSIGN_OR_RETURN(c.step, JsonInt(header, "step", 0, INT64_MAX / 2, what));
    STOKE_ASSIGN_OR_RETURN(c.steps_per_epoch, JsonInt(header, "steps_per_epoch", 1, INT64_MAX / 2, what));
    STOKE_ASSIGN_OR_RETURN(const int64_t seed, JsonInt(header, "seed", 0, INT64_MAX, what));
    c.seed = static_cast<uint64_t>(seed);
    c.backend = header.at("backend").get<std::string>();
    c.config_yaml = header.at("config").get<std::string>();
    if (header.contains("classes")) c.classes = header.at("classes").get<std::vector<std::string>>();
    if (header.contains("running")) {
      for (auto [key, out] : {std::pair{"interval", &c.interval}, std::pair{"epoch", &c.epoch}}) {
        const nlohmann::json& r = header.at("running").at(key);
        if (!r.is_array() || r.size() != 4) return corrupt(fmt::format("'running.{}' is not 4 numbers", key));
        *out = {.loss_sum = r[0].get<double>(), .top1 = r[1].get<int64_t>(), .top5 = r[2].get<int64_t>(),
                .count = r[3].get<int64_t>()};
      }
    }
    const auto data_floats = static_cast<int64_t>((body - kFixed - header_len) / sizeof(float));
    const std::byte* data = bytes.data() + kFixed + header_len;
    const nlohmann::json& tensors = header.at("tensors");
    if (!tensors.is_array()) return corrupt("'tensors' is not a list");
    for (const auto& t : tensors) {
      NamedTensor tensor;
      tensor.name = t.at("name").get<std::string>();
      const std::string where = fmt::format("{}: tensor '{}'", what, tensor.name);
      STOKE_ASSIGN_OR_RETURN(const int64_t offset, JsonInt(t, "offset", 0, data_floats, where));
      STOKE_ASSIGN_OR_RETURN(const int64_t count, JsonInt(t, "count", 0, data_floats - offset, where));
      const nlohmann::json& dims = t.at("dims");
      if (!dims.is_array() || dims.size() > 8) return corrupt(fmt::format("tensor '{}': bad dims", tensor.name));
      int64_t product = 1;
      for (const auto& d : dims) {
        STOKE_ASSIGN_OR_RETURN(const int64_t dim, JsonInt(nlohmann::json{{"dim", d}}, "dim", 0, INT32_MAX, where));
        tensor.dims.push_back(dim);
        product = product > data_floats ? product : product * dim;  // stops growing once too large
      }
      if (product != count) return corrupt(fmt::format("tensor '{}': its dims do not give its count", tensor.name));
      tensor.values.resize(static_cast<size_t>(count));
      std::memcpy(tensor.values.data(), data + offset * static_cast<int64_t>(sizeof(float)),
                  static_cast<size_t>(count) * sizeof(float));
      c.tensors.push_back(std::move(tensor));
    }
  } catch (const nlohmann::json::exception& e) {
    return corrupt(fmt::format("bad header: {}", e.what()));
  }
  if (c.step < 0 || c.steps_per_epoch < 1) return corrupt("bad step or steps_per_epoch");
  return c;
}

Status SaveCheckpoint(const std::filesystem::path& path, const Checkpoint& checkpoint) {
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  if (ec) return IoError(fmt::format("checkpoint {}: {}", path.parent_path().string(), ec.message()));
  return WriteFileAtomic(path, SerializeCheckpoint(checkpoint));
}

Result<Checkpoint> LoadCheckpoint(const std::filesystem::path& path) {
  STOKE_ASSIGN_OR_RETURN(auto bytes, ReadFileBytes(path));
  return ParseCheckpoint(bytes, path.string());
}

std::filesystem::path CheckpointPath(const std::filesystem::path& run_dir, int64_t step) {
  return run_dir / "checkpoints" / fmt::format("step-{:010}.ckpt", step);
}

std::vector<std::filesystem::path> ListCheckpoints(const std::filesystem::path& run_dir) {
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  // step-<10 digits>.ckpt; temporary files of an interrupted write do not match.
  auto is_checkpoint = [](const std::string& name) {
    if (name.size() != 20 || !name.starts_with("step-") || !name.ends_with(".ckpt")) return false;
    return std::all_of(name.begin() + 5, name.begin() + 15, [](char c) { return c >= '0' && c <= '9'; });
  };
  for (const auto& entry : std::filesystem::directory_iterator(run_dir / "checkpoints", ec)) {
    if (entry.is_regular_file() && is_checkpoint(entry.path().filename().string())) {
      out.push_back(entry.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

Result<std::filesystem::path> SetAsideCheckpointsAfter(const std::filesystem::path& run_dir, int64_t step) {
  // A folder of its own each time (a second resume from the same step sets aside another run).
  std::filesystem::path aside = run_dir / "checkpoints" / fmt::format("after-step-{:010}", step);
  for (int n = 2; std::filesystem::exists(aside); ++n) {
    aside = run_dir / "checkpoints" / fmt::format("after-step-{:010}.{}", step, n);
  }
  int moved = 0;
  for (const auto& path : ListCheckpoints(run_dir)) {
    if (path.filename() <= CheckpointPath(run_dir, step).filename()) continue;  // fixed-width: by step
    std::error_code ec;
    std::filesystem::create_directories(aside, ec);
    if (!ec) std::filesystem::rename(path, aside / path.filename(), ec);
    if (ec) return IoError(fmt::format("checkpoint {}: moving it to {}: {}", path.string(), aside.string(), ec.message()));
    ++moved;
  }
  if (moved == 0) return std::filesystem::path();
  // Both folders' names change: sync them, so that a crash cannot bring the moved ones back.
  STOKE_RETURN_IF_ERROR(SyncDirectory(aside));
  STOKE_RETURN_IF_ERROR(SyncDirectory(run_dir / "checkpoints"));
  return aside;
}

void PruneCheckpoints(const std::filesystem::path& run_dir, int keep) {
  auto all = ListCheckpoints(run_dir);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) {
    std::error_code ec;
    std::filesystem::remove(all[i], ec);
  }
  // The temporary file of a write that a killed process left (as large as a checkpoint): removed
  // once that process is gone, so they do not pile up.
  RemoveStaleAtomicTemporaries(run_dir / "checkpoints", [](const std::string& target) {
    return target.starts_with("step-") && target.ends_with(".ckpt");
  });
}

}  // namespace stoke::train
