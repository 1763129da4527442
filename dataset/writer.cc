#include "dataset/writer.h"

#include <chrono>
#include <cstring>
#include <system_error>

#include <fmt/format.h>

#include "common/crc32c.h"
#include "common/logging.h"
#include "common/map_guard.h"
#include "dataset/detail/guarded_mdb.h"

namespace stoke::dataset {
namespace {

MDB_val Val(const void* p, size_t n) { return MDB_val{n, const_cast<void*>(p)}; }

}  // namespace

Result<DatasetWriter> DatasetWriter::OpenEnv(const std::filesystem::path& dir,
                                             WriterOptions options) {
  if (options.commit_every_records <= 0 || options.commit_every_bytes <= 0) {
    return InvalidArgumentError("dataset writer: commit thresholds must be > 0");
  }
  MDB_env* raw = nullptr;
  int rc = mdb_env_create(&raw);
  if (rc != MDB_SUCCESS) return MdbStatus(rc, dir.string() + ": create environment");
  MdbEnv env(raw);
  // A damaged page met in the resume's guarded reads is an error, not abort().
  mdb_env_set_assert(raw, detail::OnMdbAssert);
  rc = mdb_env_set_maxdbs(raw, 4);
  if (rc == MDB_SUCCESS) rc = mdb_env_set_mapsize(raw, options.initial_map_bytes);
  if (rc != MDB_SUCCESS) return MdbStatus(rc, dir.string() + ": configure environment");
  // MDB_NOLOCK: one writer is held by the packer's own lock file (readers never open a dataset
  // being written), and LMDB's lock.mdb is written through a map, where a disk with a page or so
  // left raised SIGBUS instead of an error.
  rc = mdb_env_open(raw, dir.c_str(), MDB_NOTLS | MDB_NOLOCK, 0644);
  if (rc != MDB_SUCCESS) return MdbStatus(rc, dir.string() + ": open for writing");
  MDB_envinfo info;
  mdb_env_info(raw, &info);
  return DatasetWriter(dir, options, std::move(env), info.me_mapsize);
}

Result<DatasetWriter> DatasetWriter::Create(const std::filesystem::path& dir,
                                            WriterOptions options) {
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_empty(dir, ec)) {
    return InvalidArgumentError(dir.string() + ": already exists and is not empty");
  }
  std::filesystem::create_directories(dir, ec);
  if (ec) return IoError(fmt::format("{}: create directory: {}", dir.string(), ec.message()));
  return OpenEnv(dir, options);
}

Result<DatasetWriter> DatasetWriter::OpenForAppend(const std::filesystem::path& dir,
                                                   WriterOptions options) {
  std::error_code ec;
  if (!std::filesystem::exists(dir / "data.mdb", ec)) {
    return NotFoundError(dir.string() + ": no partial dataset here (no data.mdb)");
  }
  // A damaged or truncated file would crash LMDB (or have records appended after a hole). An
  // empty one is a pack stopped before LMDB wrote its first pages: LMDB starts it afresh.
  const bool empty = std::filesystem::file_size(dir / "data.mdb", ec) == 0 && !ec;
  if (Status s = empty ? OkStatus() : CheckMdbDataFile(dir / "data.mdb", dir.string()); !s.ok()) {
    return Status(s.code(), s.message() + " (this interrupted pack cannot be resumed: pack again with --overwrite)");
  }
  STOKE_ASSIGN_OR_RETURN(DatasetWriter w, OpenEnv(dir, options));
  STOKE_ASSIGN_OR_RETURN(MdbTxn txn, BeginTxn(w.env_.get(), MDB_RDONLY, dir.string()));
  // What the interrupted pack left is read under RunGuarded: a damaged page (in the main table
  // first of all) is an error naming the dataset, not a SIGBUS.
  const std::string advice = "this interrupted pack cannot be resumed: pack again with --overwrite";
  const std::string where = dir.string();
  MDB_dbi meta = 0, records = 0;
  STOKE_ASSIGN_OR_RETURN(int rc, detail::OpenTableGuarded(txn.get(), kMetaDb, &meta, dir, advice));
  if (rc == MDB_NOTFOUND) return w;  // created but nothing committed yet
  if (rc == MDB_INCOMPATIBLE) {
    return InvalidArgumentError(
        where +
        ": not a partial stoke dataset ('meta' in its LMDB file is a plain key, not a table)");
  }
  if (rc != MDB_SUCCESS) return MdbStatus(rc, where + ": open meta table");
  MDB_val k = Val(kManifestKey, std::strlen(kManifestKey)), v;
  detail::GuardedRead read{
      .txn = txn.get(), .dbi = meta, .key = &k, .value = &v, .touch_value = false};
  if (!RunGuarded(read)) return detail::GuardedFault(dir, "manifest", advice);
  if (read.rc == MDB_SUCCESS) return InvalidArgumentError(where + ": dataset is already complete");
  k = Val(kPackStateKey, std::strlen(kPackStateKey));
  read.touch_value = true;  // copied below
  if (!RunGuarded(read)) return detail::GuardedFault(dir, "pack state", advice);
  if (read.rc == MDB_SUCCESS) {
    w.resume_state_.assign(static_cast<const char*>(v.mv_data), v.mv_size);
  }
  STOKE_ASSIGN_OR_RETURN(rc,
                         detail::OpenTableGuarded(txn.get(), kRecordsDb, &records, dir, advice));
  if (rc == MDB_SUCCESS) {
    MDB_stat st;
    rc = mdb_stat(txn.get(), records, &st);
    if (rc != MDB_SUCCESS) return MdbStatus(rc, where + ": stat records");
    w.committed_ = static_cast<int64_t>(st.ms_entries);
  } else if (rc == MDB_INCOMPATIBLE) {
    return InvalidArgumentError(
        where +
        ": not a partial stoke dataset ('records' in its LMDB file is a plain key, not a table)");
  } else if (rc != MDB_NOTFOUND) {
    return MdbStatus(rc, where + ": open records table");
  }
  return w;
}

void DatasetWriter::Append(RecordHeader header, std::vector<std::byte> payload,
                           std::string source_path) {
  SealRecordHeader(header, payload, committed_ + static_cast<int64_t>(pending_.size()));
  pending_bytes_ += static_cast<int64_t>(payload.size() + kRecordHeaderSize);
  if (!options_.store_paths) source_path.clear();
  pending_.push_back(Pending{header, std::move(payload), std::move(source_path)});
}

bool DatasetWriter::ShouldCommit() const {
  return static_cast<int64_t>(pending_.size()) >= options_.commit_every_records ||
         pending_bytes_ >= options_.commit_every_bytes;
}

int DatasetWriter::TryCommit(std::string_view state, const std::string* manifest_json,
                             Status* status) {
  const std::string where = dir_.string();
  auto fail = [&](int rc, const std::string& what) {
    *status = MdbStatus(rc, where + ": " + what);
    return rc;
  };
  auto txn_or = BeginTxn(env_.get(), 0, where);
  if (!txn_or.ok()) {
    *status = txn_or.status();
    return MDB_PANIC;
  }
  MdbTxn txn = std::move(txn_or).value();
  MDB_dbi records = 0, meta = 0, paths = 0;
  int rc = mdb_dbi_open(txn.get(), kRecordsDb, MDB_CREATE, &records);
  if (rc != MDB_SUCCESS) return fail(rc, "open records table");
  rc = mdb_dbi_open(txn.get(), kMetaDb, MDB_CREATE, &meta);
  if (rc != MDB_SUCCESS) return fail(rc, "open meta table");
  if (options_.store_paths) {
    rc = mdb_dbi_open(txn.get(), kPathsDb, MDB_CREATE, &paths);
    if (rc != MDB_SUCCESS) return fail(rc, "open paths table");
  }
  std::array<std::byte, 8> key;
  for (size_t i = 0; i < pending_.size(); ++i) {
    const Pending& p = pending_[i];
    const int64_t index = committed_ + static_cast<int64_t>(i);
    EncodeKey(static_cast<uint64_t>(index), key);
    MDB_val k = Val(key.data(), key.size());
    // MDB_RESERVE hands back space in the page, so the payload is copied exactly once.
    MDB_val v{kRecordHeaderSize + p.payload.size(), nullptr};
    rc = mdb_put(txn.get(), records, &k, &v, MDB_APPEND | MDB_RESERVE);
    if (rc != MDB_SUCCESS) return fail(rc, fmt::format("write record {}", index));
    auto* out = static_cast<std::byte*>(v.mv_data);
    EncodeRecordHeader(p.header, std::span<std::byte, kRecordHeaderSize>(out, kRecordHeaderSize));
    if (!p.payload.empty()) std::memcpy(out + kRecordHeaderSize, p.payload.data(), p.payload.size());
    if (options_.store_paths && !p.source_path.empty()) {
      MDB_val pv = Val(p.source_path.data(), p.source_path.size());
      rc = mdb_put(txn.get(), paths, &k, &pv, MDB_APPEND);
      if (rc != MDB_SUCCESS) return fail(rc, fmt::format("write path of record {}", index));
    }
  }
  MDB_val sk = Val(kPackStateKey, std::strlen(kPackStateKey));
  if (manifest_json != nullptr) {
    rc = mdb_del(txn.get(), meta, &sk, nullptr);
    if (rc != MDB_SUCCESS && rc != MDB_NOTFOUND) return fail(rc, "remove pack state");
    MDB_val mk = Val(kManifestKey, std::strlen(kManifestKey));
    MDB_val mv = Val(manifest_json->data(), manifest_json->size());
    rc = mdb_put(txn.get(), meta, &mk, &mv, 0);
    if (rc != MDB_SUCCESS) return fail(rc, "write manifest");
  } else {
    MDB_val sv = Val(state.data(), state.size());
    rc = mdb_put(txn.get(), meta, &sk, &sv, 0);
    if (rc != MDB_SUCCESS) return fail(rc, "write pack state");
  }
  // The commit itself may need map space (freelist, table roots): keep its MDB_MAP_FULL visible.
  rc = mdb_txn_commit(txn.release());
  if (rc != MDB_SUCCESS) return fail(rc, "commit");
  return MDB_SUCCESS;
}

Status DatasetWriter::CommitWithGrowth(std::string_view state, const std::string* manifest_json) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    Status status;
    int rc = TryCommit(state, manifest_json, &status);
    if (rc == MDB_SUCCESS) break;
    if (rc != MDB_MAP_FULL) return status;
    // The failed transaction was aborted, so no transaction is active and the map may grow.
    size_t grown = map_bytes_ * 2;
    int src = mdb_env_set_mapsize(env_.get(), grown);
    if (src != MDB_SUCCESS) return MdbStatus(src, dir_.string() + ": grow map");
    STOKE_LOG(DEBUG, "{}: map grown to {} bytes", dir_.string(), grown);
    map_bytes_ = grown;
  }
  STOKE_LOG(DEBUG, "{}: committed {} records in {:.3f} s", dir_.string(), pending_.size(),
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  committed_ += static_cast<int64_t>(pending_.size());
  pending_.clear();
  pending_bytes_ = 0;
  resume_state_.assign(state);
  return OkStatus();
}

Status DatasetWriter::Commit(std::string_view state) {
  if (!env_) return InternalError("dataset writer: used after Finish()");
  return CommitWithGrowth(state, nullptr);
}

Status DatasetWriter::Finish(const Manifest& manifest) {
  if (!env_) return InternalError("dataset writer: used after Finish()");
  // The caller's mistakes, refused before anything is written (format_version 0 finished, and
  // then the dataset could not be opened: "format v0").
  if (manifest.format_version == 0) {
    return InvalidArgumentError(fmt::format("dataset writer: manifest format_version 0 (not set); expected {} "
                                            "(kFormatVersion)", kFormatVersion));
  }
  if (manifest.records != records()) {
    return InvalidArgumentError(fmt::format("dataset writer: manifest says {} records, wrote {}",
                                            manifest.records, records()));
  }
  const std::string json =
      manifest.ToJson().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  STOKE_RETURN_IF_ERROR(CommitWithGrowth("", &json));
  resume_state_.clear();
  int rc = mdb_env_sync(env_.get(), 1);
  if (rc != MDB_SUCCESS) return MdbStatus(rc, dir_.string() + ": sync");
  env_.reset();
  return OkStatus();
}

}  // namespace stoke::dataset
