// Pack: turns an image folder tree or a list file into a validated stoke dataset (one LMDB).
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "common/limits.h"
#include "common/status.h"
#include "dataset/record.h"

namespace stoke::pack {

enum class OnError { kSkip, kFail };

// How an input JPEG that is stored as it is gets validated. Both reject a warning as corruption.
enum class ValidateMode {
  kCoefficients,  // JpegDecoder::Validate: every coefficient decoded, output at 1/8 (~1.5x faster)
  kPixels,        // a strict full-resolution decode of every pixel
};

// What is stored for a JPEG record.
enum class IndexMode {
  kRestart,  // losslessly transcoded (baseline, optimised Huffman tables, restart markers) with a
             // restart index, so a crop decodes only its own rows and columns (docs/FORMAT.md)
  kNone,     // the JPEG's bytes as they came (after any resize / re-encode)
};

struct PackOptions {
  std::filesystem::path source;     // folder tree (one sub-folder per class) or the list's root
  std::filesystem::path list_file;  // optional: "relative/path label" lines (Caffe convention)
  std::filesystem::path output;     // the training (or only) dataset directory
  std::filesystem::path val_output; // default: output with "_val" before ".lmdb"
  int threads = 0;                  // 0 = every core TBB may use
  int max_side = 0;                 // > 0: shrink images whose longer side exceeds this
  int quality = 0;                  // > 0: re-encode every image at this JPEG quality (1..100)
  int reencode_quality = 90;        // quality for images that must be re-encoded anyway
  dataset::PayloadEncoding encoding = dataset::PayloadEncoding::kJpeg;
  bool shuffle = false;             // seeded random record order (else sorted / list order)
  uint64_t seed = 0;                // for --shuffle and the validation split
  double val_fraction = 0;          // [0, 1): stratified share of each class held out
  OnError on_error = OnError::kSkip;
  ValidateMode validate = ValidateMode::kCoefficients;
  IndexMode index = IndexMode::kRestart;
  int index_intervals_per_row = 8;  // kRestart: restart intervals per MCU row (at least; a divisor)
  bool resume = false;              // continue an interrupted pack (or accept a finished one)
  bool overwrite = false;           // replace existing outputs
  bool store_paths = true;          // keep each record's source path (for reports)
  std::filesystem::path report_file;  // optional JSON report of what was skipped and why
  int64_t commit_every = 2048;      // records per transaction (resume granularity)
  size_t max_file_bytes = 1ull << 30;  // larger input files are skipped as bad inputs
  int64_t max_pixels = kMaxImagePixels;  // larger non-JPEG images are skipped (JPEG: the decoder's cap); at most that
  bool progress = true;             // progress line on stderr
  // Set from another thread (a signal handler) to stop at the next commit, leaving a resumable
  // partial dataset. Not owned.
  const std::atomic<bool>* stop = nullptr;
  // Called on the writer thread after each commit with the records committed so far (those of
  // the pack's earlier splits included): progress for the Python package, and a test hook.
  std::function<void(int64_t)> after_commit;
};

// An input that was not packed, and why.
struct BadInput {
  std::string path;
  std::string reason;
};

struct SplitSummary {
  std::string name;  // "train" or "val"
  std::filesystem::path output;
  int64_t inputs = 0;
  int64_t records = 0;
  int64_t payload_bytes = 0;
  bool already_complete = false;  // --resume found it finished
};

struct PackSummary {
  std::vector<SplitSummary> splits;
  int64_t inputs = 0;
  int64_t classes = 0;
  int64_t converted = 0;   // non-JPEG inputs stored as JPEG
  int64_t reencoded = 0;   // JPEGs decoded and encoded again (resize, quality, orientation, CMYK)
  int64_t reoriented = 0;  // of those, because of an EXIF orientation
  std::vector<BadInput> bad;
  double seconds = 0;
  int threads = 0;
};

// Packs per `options`. Bad inputs are skipped and listed (OnError::kSkip) or fail the pack with
// kCorrupt naming the file (kFail). The dataset is written under "<output>.partial" and renamed
// when complete; an interrupted run leaves that partial dataset, which `resume` continues to
// exactly the dataset an uninterrupted run gives. Stopping via options.stop returns kUnavailable.
Result<PackSummary> Pack(const PackOptions& options);

// One line per split plus the skipped inputs (first `max_bad` of them), for the CLI.
std::string FormatSummary(const PackSummary& summary, size_t max_bad = 20);

// The default validation output for `output`: "x.lmdb" -> "x_val.lmdb", "x" -> "x_val".
std::filesystem::path DefaultValOutput(const std::filesystem::path& output);

}  // namespace stoke::pack
