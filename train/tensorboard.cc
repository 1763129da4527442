#include "train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/crc32c.h"
#if STOKE_WITH_TENSORBOARD
#include "train/tensorboard_event.pb.h"
#endif

namespace stoke::train {
#if STOKE_WITH_TENSORBOARD
using ::stoke::tensorboard::Event;
using ::stoke::tensorboard::Summary;
#endif
namespace {

// Which fields of each metrics line type become scalars, and under which tag.
struct TagMap {
  const char* type;
  const char* prefix;
  std::array<const char*, 5> fields;
};
constexpr TagMap kTags[] = {
    {"train", "train/", {"loss", "top1", "lr", "images_per_s", "data_wait"}},
    {"val", "val/", {"loss", "top1", "top5", nullptr, nullptr}},
    {"epoch", "epoch/", {"loss", "top1", nullptr, nullptr, nullptr}},
};

uint32_t Crc(std::string_view data) {
  return Crc32c(std::span(reinterpret_cast<const std::byte*>(data.data()), data.size()));
}

[[maybe_unused]] uint32_t Unmask(uint32_t masked) {
  const uint32_t rot = masked - 0xa282ead8u;
  return (rot >> 17) | (rot << 15);
}

template <typename T>
void PutLe(std::string& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

template <typename T>
[[maybe_unused]] T GetLe(const char* p) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

}  // namespace

double WallTime() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

MetricsScalars ScalarsOfMetricsLine(std::string_view line, double fallback_time) {
  return ScalarsOfMetrics(nlohmann::json::parse(line, nullptr, false), fallback_time);
}

MetricsScalars ScalarsOfMetrics(const nlohmann::json& j, double fallback_time) {
  MetricsScalars out;
  if (!j.is_object()) return out;
  auto type = j.find("type");
  auto step = j.find("step");
  if (type == j.end() || !type->is_string() || step == j.end() || !step->is_number_integer()) return out;
  auto time = j.find("time");
  const double wall = time != j.end() && time->is_number() ? time->get<double>() : fallback_time;
  for (const TagMap& map : kTags) {
    if (*type != map.type) continue;
    for (const char* field : map.fields) {
      if (field == nullptr) continue;
      auto v = j.find(field);
      // Not finite: metrics.jsonl holds null, which a rebuild skips; the live file skips it too.
      if (v == j.end() || !v->is_number() || !std::isfinite(v->get<double>())) continue;
      out.scalars.push_back({std::string(map.prefix) + field, static_cast<float>(v->get<double>())});
    }
  }
  if (!out.scalars.empty()) {
    out.step = step->get<int64_t>();
    out.wall_time = wall;
  }
  return out;
}

uint32_t MaskedCrc32c(std::string_view data) {
  const uint32_t crc = Crc(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string FrameRecord(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  PutLe<uint64_t>(out, data.size());
  PutLe<uint32_t>(out, MaskedCrc32c(out));
  out.append(data);
  PutLe<uint32_t>(out, MaskedCrc32c(data));
  return out;
}

bool EventWriter::Available() { return STOKE_WITH_TENSORBOARD != 0; }

Result<std::unique_ptr<EventWriter>> EventWriter::Create(const std::filesystem::path& dir, double wall_time) {
#if STOKE_WITH_TENSORBOARD
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return IoError(fmt::format("tensorboard: {}: {}", dir.string(), ec.message()));
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  std::unique_ptr<EventWriter> w(new EventWriter());
  w->path_ = dir / fmt::format("events.out.tfevents.{}.{}.{}", static_cast<int64_t>(wall_time), host, getpid());
  w->out_.open(w->path_, std::ios::binary | std::ios::trunc);
  if (!w->out_) return IoError(fmt::format("tensorboard: cannot create {}: {}", w->path_.string(), std::strerror(errno)));
  Event version;
  version.set_wall_time(wall_time);
  version.set_file_version("brain.Event:2");
  STOKE_RETURN_IF_ERROR(w->Append(version.SerializeAsString()));
  return w;
#else
  (void)dir;
  (void)wall_time;
  return UnavailableError("tensorboard: this build has no TensorBoard event files (protobuf was not found at build time)");
#endif
}

Status EventWriter::Append(const std::string& serialized) {
  const std::string record = FrameRecord(serialized);
  out_.write(record.data(), static_cast<std::streamsize>(record.size()));
  out_.flush();
  if (!out_) return IoError(fmt::format("tensorboard: {}: write failed (is the disk full?)", path_.string()));
  return OkStatus();
}

Status EventWriter::Write(int64_t step, double wall_time, const std::vector<Scalar>& scalars) {
#if STOKE_WITH_TENSORBOARD
  Event event;
  event.set_wall_time(wall_time);
  event.set_step(step);
  Summary* summary = event.mutable_summary();
  for (const Scalar& s : scalars) {
    Summary::Value* v = summary->add_value();
    v->set_tag(s.tag);
    v->set_simple_value(s.value);
  }
  return Append(event.SerializeAsString());
#else
  (void)step;
  (void)wall_time;
  (void)scalars;
  return UnavailableError("tensorboard: not in this build");
#endif
}

Result<std::unique_ptr<EventWriter>> RebuildEvents(const std::filesystem::path& metrics_path,
                                                   const std::filesystem::path& dir, double now) {
  std::error_code ec;
  if (std::filesystem::is_directory(dir, ec)) {
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      if (entry.path().filename().string().starts_with("events.out.tfevents.")) {
        std::filesystem::remove(entry.path(), ec);
        if (ec) return IoError(fmt::format("tensorboard: cannot remove {}: {}", entry.path().string(), ec.message()));
      }
    }
  }
  STOKE_ASSIGN_OR_RETURN(auto writer, EventWriter::Create(dir, now));
  std::ifstream in(metrics_path);
  std::string line;
  while (std::getline(in, line)) {
    MetricsScalars m = ScalarsOfMetricsLine(line, now);
    if (m.scalars.empty()) continue;
    STOKE_RETURN_IF_ERROR(writer->Write(m.step, m.wall_time, m.scalars));
  }
  return writer;
}

Result<std::vector<ScalarEvent>> ReadScalarEvents(const std::filesystem::path& path) {
#if STOKE_WITH_TENSORBOARD
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError(fmt::format("tensorboard: cannot open {}", path.string()));
  std::vector<ScalarEvent> out;
  int64_t offset = 0;
  std::string data;
  while (true) {
    char head[12];
    in.read(head, sizeof head);
    if (in.gcount() < static_cast<std::streamsize>(sizeof head)) break;  // the end, or a record being written
    const uint64_t length = GetLe<uint64_t>(head);
    if (Unmask(GetLe<uint32_t>(head + 8)) != Crc(std::string_view(head, 8))) {
      return CorruptError(fmt::format("tensorboard: {}: record at byte {}: bad length checksum", path.string(), offset));
    }
    if (length > (1u << 30)) {
      return CorruptError(fmt::format("tensorboard: {}: record at byte {}: length {} is implausible", path.string(),
                                      offset, length));
    }
    data.resize(length + 4);
    in.read(data.data(), static_cast<std::streamsize>(data.size()));
    if (in.gcount() < static_cast<std::streamsize>(data.size())) break;
    const std::string_view body(data.data(), length);
    if (Unmask(GetLe<uint32_t>(data.data() + length)) != Crc(body)) {
      return CorruptError(fmt::format("tensorboard: {}: record at byte {}: bad data checksum", path.string(), offset));
    }
    Event event;
    if (!event.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
      return CorruptError(fmt::format("tensorboard: {}: record at byte {}: not an Event", path.string(), offset));
    }
    if (event.has_summary()) {
      for (const auto& v : event.summary().value()) {
        out.push_back({event.step(), event.wall_time(), v.tag(), v.simple_value()});
      }
    }
    offset += static_cast<int64_t>(sizeof head + data.size());
  }
  return out;
#else
  (void)path;
  return UnavailableError("tensorboard: not in this build");
#endif
}

}  // namespace stoke::train
