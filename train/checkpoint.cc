#include "train/checkpoint.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/crc32c.h"
#include "common/file_util.h"

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
  const std::string header = nlohmann::json{{"step", c.step},
                                            {"steps_per_epoch", c.steps_per_epoch},
                                            {"seed", c.seed},
                                            {"backend", c.backend},
                                            {"config", c.config_yaml},
                                            {"tensors", tensors}}
                                 .dump();
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
  if (bytes.size() < kFixed + sizeof(uint32_t) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return corrupt(fmt::format("not a stoke checkpoint ({} bytes, no STOKECKP header)", bytes.size()));
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
  try {
    const auto header = nlohmann::json::parse(
        std::string_view(reinterpret_cast<const char*>(bytes.data() + kFixed), header_len));
    c.step = header.at("step").get<int64_t>();
    c.steps_per_epoch = header.at("steps_per_epoch").get<int64_t>();
    c.seed = header.at("seed").get<uint64_t>();
    c.backend = header.at("backend").get<std::string>();
    c.config_yaml = header.at("config").get<std::string>();
    const size_t data_floats = (body - kFixed - header_len) / sizeof(float);
    const std::byte* data = bytes.data() + kFixed + header_len;
    for (const auto& t : header.at("tensors")) {
      NamedTensor tensor;
      tensor.name = t.at("name").get<std::string>();
      tensor.dims = t.at("dims").get<std::vector<int64_t>>();
      const auto offset = t.at("offset").get<uint64_t>();
      const auto count = t.at("count").get<uint64_t>();
      int64_t product = 1;
      for (auto d : tensor.dims) product *= d;
      if (offset + count > data_floats || static_cast<uint64_t>(product) != count) {
        return corrupt(fmt::format("tensor '{}' does not fit the file", tensor.name));
      }
      tensor.values.resize(count);
      std::memcpy(tensor.values.data(), data + offset * sizeof(float), count * sizeof(float));
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

void PruneCheckpoints(const std::filesystem::path& run_dir, int keep) {
  auto all = ListCheckpoints(run_dir);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) {
    std::error_code ec;
    std::filesystem::remove(all[i], ec);
  }
}

}  // namespace stoke::train
