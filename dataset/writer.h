// DatasetWriter: appends records in index order to a new (or partially written) dataset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "common/c_handles.h"
#include "common/status.h"
#include "dataset/manifest.h"
#include "dataset/record.h"

namespace stoke::dataset {

struct WriterOptions {
  int64_t commit_every_records = 2048;      // a commit is a resume point; > 0
  int64_t commit_every_bytes = 64ll << 20;  // bounds memory held between commits; > 0
  // Address space reserved for the map (the file grows only as data is written); doubled
  // whenever a commit finds it full.
  size_t initial_map_bytes = 16ull << 30;
  bool store_paths = true;                  // write the "paths" sub-database
};

// Writes one dataset. Records are held in memory until Commit(), which writes them with
// MDB_APPEND in one transaction together with an opaque resume state; the map is grown and the
// transaction replayed when LMDB reports it full. Memory held is bounded by the commit thresholds.
// Thread-compatible: one thread appends (the pack pipeline's in-order writer stage).
class DatasetWriter {
 public:
  // Creates the dataset directory `dir` (it must not exist, or be empty).
  static Result<DatasetWriter> Create(const std::filesystem::path& dir, WriterOptions options);
  // Reopens a dataset that was being written and never finished, to append after its last
  // committed record. kInvalidArgument if it is already finished (has a manifest).
  static Result<DatasetWriter> OpenForAppend(const std::filesystem::path& dir,
                                             WriterOptions options);

  DatasetWriter(DatasetWriter&&) = default;
  DatasetWriter& operator=(DatasetWriter&&) = default;
  ~DatasetWriter() = default;  // uncommitted records are dropped; committed ones stay

  // Records appended so far, committed or pending. The next Append gets this index.
  int64_t records() const { return committed_ + static_cast<int64_t>(pending_.size()); }
  int64_t committed_records() const { return committed_; }
  // The state passed to the last Commit() ("" for a fresh dataset).
  const std::string& resume_state() const { return resume_state_; }

  // Queues a record. `header` gives encoding, channels, label, width and height; the payload
  // size and CRC are filled in here. `source_path` is stored when options.store_paths.
  void Append(RecordHeader header, std::vector<std::byte> payload, std::string source_path);
  // True once the pending records reach either commit threshold.
  bool ShouldCommit() const;
  // Writes pending records and `state` (stored under meta "pack_state") in one transaction.
  Status Commit(std::string_view state);
  // Commits pending records, writes `manifest` (records must equal records()), removes the resume
  // state and flushes to disk. The writer is unusable afterwards. kInvalidArgument, writing
  // nothing, for a manifest of another record count or with no format_version set.
  Status Finish(const Manifest& manifest);

 private:
  struct Pending {
    RecordHeader header;
    std::vector<std::byte> payload;
    std::string source_path;
  };

  DatasetWriter(std::filesystem::path dir, WriterOptions options, MdbEnv env, size_t map_bytes)
      : dir_(std::move(dir)), options_(options), env_(std::move(env)), map_bytes_(map_bytes) {}
  static Result<DatasetWriter> OpenEnv(const std::filesystem::path& dir, WriterOptions options);
  // One attempt at writing pending_ (+ meta puts) in a transaction.
  int TryCommit(std::string_view state, const std::string* manifest_json, Status* status);
  Status CommitWithGrowth(std::string_view state, const std::string* manifest_json);

  std::filesystem::path dir_;
  WriterOptions options_;
  MdbEnv env_;
  size_t map_bytes_ = 0;
  int64_t committed_ = 0;
  int64_t pending_bytes_ = 0;
  std::vector<Pending> pending_;
  std::string resume_state_;
};

// Sub-database names inside a dataset environment.
inline constexpr const char* kRecordsDb = "records";
inline constexpr const char* kMetaDb = "meta";
inline constexpr const char* kPathsDb = "paths";
inline constexpr const char* kManifestKey = "manifest";
inline constexpr const char* kPackStateKey = "pack_state";

}  // namespace stoke::dataset
