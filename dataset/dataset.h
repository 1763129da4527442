// Dataset and Reader: read-only, zero-copy access to a packed dataset.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/c_handles.h"
#include "common/status.h"
#include "dataset/manifest.h"
#include "dataset/record.h"

namespace stoke::dataset {

class Reader;

struct ReaderOptions {
  // Check each payload's CRC-32C in Get()/Scan(). Costs about 14 us per 110 KB record (a few
  // percent of a JPEG decode); turn off only where the decoder or a prior --verify covers it.
  bool verify_crc = true;
};

// Where a record's stored value (its 32-byte header and payload) lies in the data file.
struct RecordExtent {
  uint64_t offset = 0;  // bytes from the start of Dataset::data_file()
  uint32_t size = 0;    // value bytes; 0: no extent could be taken (a Reader says why)
};

// An open dataset: the LMDB environment mapped read-only (MDB_RDONLY | MDB_NOTLS | MDB_NOLOCK:
// packed datasets are immutable, so no lock file is needed and read-only media work) and its
// manifest. Thread-safe: share one Dataset; give each thread its own Reader. Copies share the one
// open dataset (a copy is a reference count), and every Reader, Loader or storage stage holds one:
// the Dataset they were made from may be moved or destroyed while they read.
class Dataset {
 public:
  // Opens `path` (a dataset directory, or the data file itself). Errors name the path:
  // kNotFound (missing), kInvalidArgument (not a stoke dataset, another format version, an
  // unfinished pack), kCorrupt (truncated data file, damaged manifest or tables).
  static Result<Dataset> Open(const std::filesystem::path& path);

  Dataset(const Dataset&) = default;
  Dataset& operator=(const Dataset&) = default;
  Dataset(Dataset&&) = default;
  Dataset& operator=(Dataset&&) = default;

  const Manifest& manifest() const { return s_->manifest; }
  int64_t size() const { return s_->manifest.records; }
  const std::filesystem::path& path() const { return s_->path; }

  // A reader with its own read transaction (and its own share of the dataset).
  Result<Reader> NewReader(ReaderOptions options = {}) const;

  // For readers that fetch records with their own I/O (prefetch's storage stage):
  // The LMDB data file, and the whole of it as mapped read-only (valid while the Dataset or a copy of it lives;
  // touching a page that is not in the page cache reads it from storage).
  const std::filesystem::path& data_file() const { return s_->data_file; }
  // LMDB's descriptor of the data file the map shows (-1 when LMDB does not say): that file even
  // when data_file() names another one by now (the dataset was replaced since it was opened).
  int data_fd() const;
  std::span<const std::byte> map() const { return s_->map; }
  // Ok unless the table of source paths that the manifest lists is missing or cannot be opened
  // (Reader::SourcePath then returns this error).
  const Status& paths_status() const { return s_->paths_status; }
  // The extent of every record in the data file, from one pass over the records table's leaf
  // pages (the payloads are not read: about 1% of the file). A record whose extent is missing,
  // out of sequence or outside the file gets size 0. kCorrupt when the table cannot be walked.
  Result<std::vector<RecordExtent>> RecordExtents() const;
  // A digest of what the dataset holds, for telling copies apart (ranks of a data-parallel run
  // must read the same data): the manifest's counts, classes and payload bytes, and the stored
  // header (label, size, CRC) of 64 records spread over the dataset. Equal for byte copies; a few
  // random reads.
  uint64_t Fingerprint() const;
  // Checks a stored value read by other means exactly as Reader::Get does: parse, CRC (when
  // `verify_crc`) and label range. The view points into `value`.
  Result<RecordView> CheckRecord(std::span<const std::byte> value, int64_t index, bool verify_crc) const;

 private:
  struct State {
    std::filesystem::path path;
    std::filesystem::path data_file;
    std::span<const std::byte> map;
    MdbEnv env;
    MDB_dbi records_dbi = 0;
    MDB_dbi paths_dbi = 0;
    bool has_paths_dbi = false;
    Status paths_status;  // the paths table the manifest promises cannot be read
    Manifest manifest;
  };
  explicit Dataset(std::shared_ptr<const State> state) : s_(std::move(state)) {}
  std::shared_ptr<const State> s_;
  friend class Reader;
};

// Reads records of one Dataset in place. Thread-compatible: one Reader per thread.
// Every view it returns points into the LMDB map and stays valid until the Reader is destroyed.
// One damaged record is one error: after LMDB fails a read (a damaged page), the Reader starts a
// fresh read transaction, so the records after it read as before.
class Reader {
 public:
  Reader(Reader&&) = default;
  Reader& operator=(Reader&&) = default;

  // The record at `index`, as a view into the map. kInvalidArgument for an index out of range;
  // kCorrupt (naming the index) for a missing or malformed record or a CRC mismatch.
  Result<RecordView> Get(int64_t index);

  // Calls fn on records [begin, end) in index order with a cursor (sequential pages). Stops at
  // the first error, from the data or from fn.
  Status Scan(int64_t begin, int64_t end, const std::function<Status(const RecordView&)>& fn);

  // The source path recorded at pack time ("" when the dataset has no paths table).
  // kInvalidArgument for an index out of range, as Get().
  Result<std::string> SourcePath(int64_t index);

 private:
  Reader(Dataset dataset, MdbTxn txn, ReaderOptions options)
      : dataset_(std::move(dataset)), txn_(std::move(txn)), options_(options) {}
  Result<RecordView> Check(const MDB_val& value, int64_t index) const;
  // After a failed read: LMDB refuses every later read of a transaction that met damage
  // (MDB_BAD_TXN); a reset and renew gives a fresh one on the same read-only map.
  void Renew();

  Dataset dataset_;  // a share of it: the transaction's environment lives as long as the Reader
  MdbTxn txn_;
  ReaderOptions options_;
  friend class Dataset;
};

}  // namespace stoke::dataset
