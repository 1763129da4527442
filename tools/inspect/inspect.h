// Inspect: what a packed dataset holds (summary), whether every record is intact (verify), and
// one record's payload (extract).
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace stoke::inspect {

struct InspectOptions {
  bool verify = false;  // check every CRC and strictly decode every record
  int threads = 0;      // verify threads; 0 = all cores; at most kMaxThreads
  bool progress = true;
  // Set from another thread to end a verify early: Inspect then returns kUnavailable. Not owned.
  const std::atomic<bool>* stop = nullptr;
};

struct BadRecord {
  int64_t index = 0;
  std::string source_path;  // "" when the dataset has no paths table
  std::string reason;
};

struct InspectReport {
  nlohmann::json summary;        // records, classes, class_counts, sizes, packing, ...
  bool verified = false;
  std::vector<BadRecord> bad;    // sorted by index; empty when verified and intact
  // Where the manifest's totals (class_counts, payload_bytes) disagree with the records; empty
  // when they agree, and not compared when a record's header could not be read.
  std::vector<std::string> manifest_problems;
  bool intact() const { return bad.empty() && manifest_problems.empty(); }
};

// Summarises (and with options.verify, checks) the dataset at `path`. Errors opening the dataset
// name the path; bad records are listed in the report, not returned as an error.
Result<InspectReport> Inspect(const std::filesystem::path& path, const InspectOptions& options);

// The report as JSON (summary plus "verify": {"checked", "bad": [...]}).
nlohmann::json ReportJson(const InspectReport& report);
// The report for people: a few aligned lines, per-class counts abbreviated past `max_classes`.
std::string FormatReport(const InspectReport& report, size_t max_classes = 20);

// Writes the payload of record `index` to `output`: JPEG bytes as they are stored, raw pixels as
// a binary PGM/PPM. kInvalidArgument for an index out of range.
Status ExtractRecord(const std::filesystem::path& dataset, int64_t index,
                     const std::filesystem::path& output);

}  // namespace stoke::inspect
