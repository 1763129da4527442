// TensorBoard event files: every training run writes its scalar curves into run_dir/tensorboard/
// in TensorBoard's own format, so `tensorboard --logdir RUN_DIR` shows what metrics.jsonl holds.
//
// A file is a sequence of records, each framed as TensorBoard (and TFRecord) expect:
//   uint64 length (little-endian) | uint32 masked CRC-32C of those 8 bytes | length bytes of a
//   serialised Event | uint32 masked CRC-32C of those bytes
// where masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8. The first record names the file
// version; each later one holds the scalars of one metrics line at its step and wall time.
//
// metrics.jsonl stays the source of truth: the event files are derived from it. A resumed run
// rebuilds them from the metrics it kept, so TensorBoard never shows the steps a resume replaced.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace stoke::train {

struct Scalar {
  std::string tag;  // "train/loss", "val/top1", ...
  float value = 0;
};

// The scalars TensorBoard shows for one metrics.jsonl line (a JSON object) and its step and wall
// time (the line's "time", or `fallback_time` when it has none). Lines of other types, and lines
// that are not objects with a step, give no scalars.
struct MetricsScalars {
  int64_t step = -1;
  double wall_time = 0;
  std::vector<Scalar> scalars;
};
MetricsScalars ScalarsOfMetricsLine(std::string_view json_line, double fallback_time);
MetricsScalars ScalarsOfMetrics(const nlohmann::json& line, double fallback_time);  // already parsed

// TFRecord framing of one record, and the checksum it uses.
uint32_t MaskedCrc32c(std::string_view data);
std::string FrameRecord(std::string_view data);

// Appends events to one file. Not thread-safe.
class EventWriter {
 public:
  // True when this build writes event files (protobuf was found at build time).
  static bool Available();
  // Creates `dir` and a new file events.out.tfevents.<seconds>.<host>.<pid> in it, starting with
  // the file-version record.
  static Result<std::unique_ptr<EventWriter>> Create(const std::filesystem::path& dir, double wall_time);
  // One record holding `scalars` at `step`; written through to the file (flushed).
  Status Write(int64_t step, double wall_time, const std::vector<Scalar>& scalars);
  const std::filesystem::path& path() const { return path_; }

 private:
  EventWriter() = default;
  Status Append(const std::string& serialized_event);
  std::filesystem::path path_;
  std::ofstream out_;
};

// Removes run_dir/tensorboard's event files and writes one new file replaying every line of
// `metrics_path` (kept by a resume); returns the writer for the lines that follow.
Result<std::unique_ptr<EventWriter>> RebuildEvents(const std::filesystem::path& metrics_path,
                                                   const std::filesystem::path& dir, double now);

// Reads an event file back (checking both checksums of every record): the scalars of each event,
// in file order. kCorrupt names the file and the byte offset of the first bad record; a record cut
// short at the end (a writer still writing) ends the list without error.
struct ScalarEvent {
  int64_t step = 0;
  double wall_time = 0;
  std::string tag;
  float value = 0;
};
Result<std::vector<ScalarEvent>> ReadScalarEvents(const std::filesystem::path& path);

// Seconds since the Unix epoch.
double WallTime();

}  // namespace stoke::train
