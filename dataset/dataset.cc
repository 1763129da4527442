#include "dataset/dataset.h"

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <system_error>

#include <fmt/format.h>

#include "common/digest.h"
#include "common/map_guard.h"
#include "dataset/detail/guarded_mdb.h"
#include "dataset/writer.h"

namespace stoke::dataset {
namespace {

MDB_val Val(const void* p, size_t n) { return MDB_val{n, const_cast<void*>(p)}; }

std::span<const std::byte> Bytes(const MDB_val& v) {
  return {static_cast<const std::byte*>(v.mv_data), v.mv_size};
}

}  // namespace

namespace {

using detail::GuardedRead;

// Where the data file's first byte is mapped, found from an address inside the map (LMDB keeps
// the map's address to itself: mdb_env_info reports the fixed-map hint, not the map). From
// /proc/self/maps: the mapping holding `inside`, less its file offset. nullptr if not found.
const std::byte* MapStart(const void* inside) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const auto p = reinterpret_cast<uintptr_t>(inside);
  while (std::getline(maps, line)) {
    // "start-end perms offset dev inode path", numbers in hex.
    unsigned long long start = 0, end = 0, offset = 0;
    char perms[8] = {};
    if (std::sscanf(line.c_str(), "%llx-%llx %7s %llx", &start, &end, perms, &offset) != 4) continue;
    if (p >= start && p < end) return reinterpret_cast<const std::byte*>(start - offset);
  }
  return nullptr;
}

Status MapFault(const std::filesystem::path& path, const std::string& what) {
  return detail::GuardedFault(path, what);
}

// What a records table whose entry count is not the manifest's record count lacks or holds beyond
// it, read off its keys (leaf pages only): "record 37 is missing" says what to restore or repack,
// where the counts alone do not. Empty when the keys cannot be walked or show nothing amiss (the
// count field itself is then what is damaged).
std::string DescribeRecordKeys(MDB_txn* txn, MDB_dbi records_dbi, int64_t records) {
  MDB_cursor* raw = nullptr;
  if (mdb_cursor_open(txn, records_dbi, &raw) != MDB_SUCCESS) return {};
  MdbCursor cursor(raw);
  MDB_val k, v;
  GuardedRead read{.cursor = raw, .op = MDB_FIRST, .key = &k, .value = &v, .touch_value = false};
  constexpr uint64_t kNamed = 3;
  // Keys are unsigned 64-bit record numbers: a damaged one may be anything up to 2^64 - 1.
  const auto want = static_cast<uint64_t>(records);
  std::vector<uint64_t> missing, beyond;
  uint64_t missing_count = 0, beyond_count = 0, next = 0;
  auto note = [&](std::vector<uint64_t>& named, uint64_t& count, uint64_t first, uint64_t n) {
    for (uint64_t i = 0; i < n && named.size() < kNamed; ++i) named.push_back(first + i);
    count += n;
  };
  for (;;) {
    if (!RunGuarded(read) || (read.rc != MDB_SUCCESS && read.rc != MDB_NOTFOUND)) return {};
    if (read.rc == MDB_NOTFOUND) break;
    read.op = MDB_NEXT;
    if (k.mv_size != 8) continue;
    const uint64_t key = DecodeKey(std::span<const std::byte, 8>(static_cast<const std::byte*>(k.mv_data), 8));
    if (key >= want) {
      note(beyond, beyond_count, key, 1);
      continue;
    }
    if (key > next) note(missing, missing_count, next, key - next);
    next = std::max(next, key + 1);
  }
  if (next < want) note(missing, missing_count, next, want - next);
  auto list = [](const std::vector<uint64_t>& named, uint64_t count) {
    std::string text = count == 1 ? "record " : "records ";
    for (size_t i = 0; i < named.size(); ++i) text += (i ? ", " : "") + std::to_string(named[i]);
    if (count > named.size()) text += fmt::format(" and {} more", count - named.size());
    return text;
  };
  std::string text;
  if (missing_count > 0) text += fmt::format("; {} {} missing", list(missing, missing_count), missing_count == 1 ? "is" : "are");
  if (beyond_count > 0) {
    text += fmt::format("; {} {} beyond the manifest's {}", list(beyond, beyond_count), beyond_count == 1 ? "is" : "are",
                        records);
  }
  return text;
}

// The entry count LMDB reports is a field of the records table's entry in the main table, not a
// count of anything: damaged (with a manifest to match), it would have readers walk, and the
// sampler allocate for, records that are not there. Each entry takes at least 18 bytes of a leaf
// page (node header, 8-byte key, slot), so the file bounds the count. And the first and last keys
// must be records 0 and records - 1: every stored key then names a record in range, and with as
// many entries as records (and unique keys) they are exactly 0 .. records - 1. A record missing
// between them anyway is an error for that record when it is read.
Status CheckRecordKeys(MDB_txn* txn, MDB_dbi records_dbi, int64_t records, uint64_t file_bytes,
                       const std::filesystem::path& path) {
  const std::string where = "dataset: " + path.string();
  constexpr uint64_t kMinEntryBytes = 18;
  if (static_cast<uint64_t>(records) > file_bytes / kMinEntryBytes) {
    return CorruptError(fmt::format(
        "{}: the records table counts {} records, more than its {}-byte data file can hold", where,
        records, file_bytes));
  }
  if (records == 0) return OkStatus();
  MDB_cursor* raw = nullptr;
  const int rc = mdb_cursor_open(txn, records_dbi, &raw);
  if (rc != MDB_SUCCESS) return MdbStatus(rc, where + ": open cursor");
  MdbCursor cursor(raw);
  for (const auto& [op, want] :
       {std::pair{MDB_FIRST, uint64_t{0}}, std::pair{MDB_LAST, uint64_t(records - 1)}}) {
    MDB_val k, v;
    GuardedRead read{.cursor = raw, .op = op, .key = &k, .value = &v, .touch_value = false};
    if (!RunGuarded(read)) return MapFault(path, "records table");
    if (read.rc == MDB_NOTFOUND) {
      return CorruptError(
          fmt::format("{}: the records table counts {} records, but holds none", where, records));
    }
    if (read.rc != MDB_SUCCESS) return MdbStatus(read.rc, where + ": records table");
    const auto* key = static_cast<const std::byte*>(k.mv_data);
    if (k.mv_size != 8 || DecodeKey(std::span<const std::byte, 8>(key, 8)) != want) {
      const std::string got =
          k.mv_size == 8
              ? fmt::format("record {}", DecodeKey(std::span<const std::byte, 8>(key, 8)))
              : fmt::format("a {}-byte key", k.mv_size);
      return CorruptError(fmt::format(
          "{}: the records table counts {} records, but its {} key is {}, not record {}", where,
          records, op == MDB_FIRST ? "first" : "last", got, want));
    }
  }
  return OkStatus();
}

}  // namespace

Result<Dataset> Dataset::Open(const std::filesystem::path& path) {
  const std::string where = "dataset: " + path.string();
  std::error_code ec;
  auto st = std::filesystem::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) {
    return IoError(fmt::format("{}: {}", where, ec.message()));  // e.g. a folder this user cannot enter
  }
  if (!std::filesystem::exists(st)) return NotFoundError(where + ": no such file or directory");
  unsigned flags = MDB_RDONLY | MDB_NOTLS | MDB_NOLOCK;
  std::filesystem::path data_file = path;
  if (std::filesystem::is_directory(st)) {
    data_file = path / "data.mdb";
    const bool has_data = std::filesystem::exists(data_file, ec);
    if (ec) {  // e.g. a folder this user may list but not enter
      return IoError(fmt::format("{}: {}: {}", where, data_file.string(), ec.message()));
    }
    if (!has_data) {
      return InvalidArgumentError(where + ": not a stoke dataset (no data.mdb inside)");
    }
  } else {
    flags |= MDB_NOSUBDIR;
  }
  // Before LMDB maps it: LMDB takes an empty file for a new environment (and would write to it),
  // divides by the page size its meta page holds, and faults on pages past the end of the file.
  STOKE_RETURN_IF_ERROR(CheckMdbDataFile(data_file, where));
  const auto file_bytes = std::filesystem::file_size(data_file, ec);
  if (ec) return IoError(fmt::format("{}: {}", where, ec.message()));

  auto d = std::make_shared<State>();
  d->path = path;
  MDB_env* raw = nullptr;
  int rc = mdb_env_create(&raw);
  if (rc != MDB_SUCCESS) return MdbStatus(rc, where + ": create environment");
  d->env.reset(raw);
  // A damaged page inside a guarded read is an error, not abort().
  mdb_env_set_assert(raw, detail::OnMdbAssert);
  mdb_env_set_maxdbs(raw, 4);
  rc = mdb_env_open(raw, path.c_str(), flags, 0444);
  if (rc == MDB_INVALID) {
    return InvalidArgumentError(where + ": not an LMDB data file (is this a stoke dataset?)");
  }
  if (rc != MDB_SUCCESS) return MdbStatus(rc, where + ": open");

  // (A data file shorter than its last page, which would fault on access, was refused above.)
  MDB_envinfo info;
  mdb_env_info(raw, &info);

  STOKE_ASSIGN_OR_RETURN(MdbTxn txn, BeginTxn(raw, MDB_RDONLY, where));
  // The tables are looked up in LMDB's main table, whose pages are read here first: guarded. A
  // name there that is a plain key, not a table, is another program's LMDB file.
  MDB_dbi meta = 0;
  STOKE_ASSIGN_OR_RETURN(rc, detail::OpenTableGuarded(txn.get(), kMetaDb, &meta, path));
  if (rc == MDB_NOTFOUND) return InvalidArgumentError(where + ": not a stoke dataset (no meta table)");
  if (rc == MDB_INCOMPATIBLE) {
    return InvalidArgumentError(
        where + ": not a stoke dataset ('meta' in its LMDB file is a plain key, not a table)");
  }
  if (rc != MDB_SUCCESS) return MdbStatus(rc, where + ": open meta table");
  MDB_val k = Val(kManifestKey, std::strlen(kManifestKey)), v;
  GuardedRead read{.txn = txn.get(), .dbi = meta, .key = &k, .value = &v};
  if (!RunGuarded(read)) return MapFault(path, "manifest");
  rc = read.rc;
  if (rc == MDB_NOTFOUND) {
    MDB_val sk = Val(kPackStateKey, std::strlen(kPackStateKey));
    GuardedRead state{.txn = txn.get(), .dbi = meta, .key = &sk, .value = &v, .touch_value = false};
    if (!RunGuarded(state)) return MapFault(path, "pack state");
    if (state.rc == MDB_SUCCESS) {
      return InvalidArgumentError(where + ": unfinished pack (finish it with stoke pack --resume)");
    }
    return CorruptError(where + ": no manifest");
  }
  if (rc != MDB_SUCCESS) return MdbStatus(rc, where + ": read manifest");
  const std::byte* map_start = MapStart(v.mv_data);
  // (Parse checks format_version before anything else: a newer stoke's manifest is named as that.)
  auto manifest = Manifest::Parse(
      std::string_view(static_cast<const char*>(v.mv_data), v.mv_size));
  if (!manifest.ok()) return manifest.status().Prepend(where);
  d->manifest = std::move(manifest).value();
  if (!ReadableFormatVersion(d->manifest.format_version)) {
    return InvalidArgumentError(fmt::format("{}: format v{}, this stoke reads v{} to v{} (re-pack it)", where,
                                            d->manifest.format_version, kOldestFormatVersion, kFormatVersion));
  }
  STOKE_ASSIGN_OR_RETURN(rc,
                         detail::OpenTableGuarded(txn.get(), kRecordsDb, &d->records_dbi, path));
  if (rc == MDB_NOTFOUND) return CorruptError(where + ": no records table");
  if (rc == MDB_INCOMPATIBLE) {
    return InvalidArgumentError(
        where + ": not a stoke dataset ('records' in its LMDB file is a plain key, not a table)");
  }
  if (rc != MDB_SUCCESS) return MdbStatus(rc, where + ": open records table");
  MDB_stat rs;
  rc = mdb_stat(txn.get(), d->records_dbi, &rs);
  if (rc != MDB_SUCCESS) return MdbStatus(rc, where + ": stat records");
  if (static_cast<int64_t>(rs.ms_entries) != d->manifest.records) {
    return CorruptError(fmt::format("{}: records table holds {} records, manifest says {}{}", where,
                                    rs.ms_entries, d->manifest.records,
                                    DescribeRecordKeys(txn.get(), d->records_dbi, d->manifest.records)));
  }
  STOKE_RETURN_IF_ERROR(
      CheckRecordKeys(txn.get(), d->records_dbi, d->manifest.records, file_bytes, path));
  STOKE_ASSIGN_OR_RETURN(rc, detail::OpenTableGuarded(txn.get(), kPathsDb, &d->paths_dbi, path));
  d->has_paths_dbi = rc == MDB_SUCCESS;
  if (rc != MDB_SUCCESS && (rc != MDB_NOTFOUND || d->manifest.has_paths)) {
    // The records do not depend on it: the dataset opens, and whatever asks for a source path
    // (inspect, a bad-record report, eval) gets this error instead of an empty path.
    d->paths_status = CorruptError(fmt::format(
        "{}: the table of source paths {} (the records themselves are not affected; repack to have the paths)",
        where, rc == MDB_NOTFOUND ? "that the manifest lists is missing"
                                  : fmt::format("cannot be opened ({})", mdb_strerror(rc))));
  }
  // Absolute: the storage stage opens it again later, perhaps after the process changed its
  // working directory (and a relative name would then find another file, or none).
  std::error_code abs_ec;
  d->data_file = std::filesystem::absolute(data_file, abs_ec);
  if (abs_ec) d->data_file = data_file;
  if (map_start != nullptr) {
    d->map = std::span<const std::byte>(map_start, static_cast<size_t>(std::min<uint64_t>(file_bytes, info.me_mapsize)));
  }
  // Committing (not aborting) keeps the table handles open for later transactions.
  STOKE_RETURN_IF_ERROR(CommitTxn(txn, where));
  return Dataset(std::move(d));
}

Result<Reader> Dataset::NewReader(ReaderOptions options) const {
  STOKE_ASSIGN_OR_RETURN(MdbTxn txn,
                         BeginTxn(s_->env.get(), MDB_RDONLY, "dataset: " + s_->path.string()));
  return Reader(*this, std::move(txn), options);
}

Result<RecordView> Dataset::CheckRecord(std::span<const std::byte> value, int64_t index, bool verify_crc) const {
  auto record = ParseRecord(value, index);
  if (!record.ok()) return record.status().Prepend("dataset: " + s_->path.string());
  if (verify_crc) {
    Status s = CheckCrc(*record);
    if (!s.ok()) return s.Prepend("dataset: " + s_->path.string());
  }
  const int32_t label = record->header.label;
  if (label < 0 || static_cast<size_t>(label) >= s_->manifest.classes.size()) {
    return CorruptError(fmt::format("dataset: {}: record {}: label {} not in [0, {})", s_->path.string(), index, label,
                                    s_->manifest.classes.size()));
  }
  return record;
}

uint64_t Dataset::Fingerprint() const {
  uint64_t h = Fnv1a(fmt::format("{} records, {} payload bytes\n", s_->manifest.records, s_->manifest.payload_bytes));
  for (size_t c = 0; c < s_->manifest.classes.size(); ++c) {
    h = Fnv1a(fmt::format("{}\t{}\n", s_->manifest.classes[c], s_->manifest.class_counts[c]), h);
  }
  const int64_t n = size();
  if (n == 0) return h;
  auto reader = NewReader({.verify_crc = false});
  if (!reader.ok()) return Fnv1a(reader.status().message(), h);
  constexpr int64_t kSamples = 64;
  for (int64_t i = 0; i < std::min(n, kSamples); ++i) {
    const int64_t index = n <= kSamples ? i : i * (n - 1) / (kSamples - 1);
    auto record = reader->Get(index);
    if (!record.ok()) {
      h = Fnv1a(fmt::format("record {} unreadable\n", index), h);
      continue;
    }
    const RecordHeader& r = record->header;
    h = Fnv1a(fmt::format("{} {} {} {} {} {} {}\n", index, r.label, r.width, r.height, r.channels, r.payload_size,
                          r.crc32c),
              h);
  }
  return h;
}

Result<RecordView> Reader::Check(const MDB_val& value, int64_t index) const {
  return dataset_.CheckRecord(Bytes(value), index, options_.verify_crc);
}

Result<std::vector<RecordExtent>> Dataset::RecordExtents() const {
  const std::string where = "dataset: " + s_->path.string();
  std::vector<RecordExtent> extents(static_cast<size_t>(size()));
  if (extents.empty()) return extents;
  if (s_->map.empty()) return UnavailableError(where + ": the map's address is unknown (no /proc/self/maps?)");
  STOKE_ASSIGN_OR_RETURN(MdbTxn txn, BeginTxn(s_->env.get(), MDB_RDONLY, where));
  MDB_cursor* raw = nullptr;
  int rc = mdb_cursor_open(txn.get(), s_->records_dbi, &raw);
  if (rc != MDB_SUCCESS) return MdbStatus(rc, where + ": open cursor");
  MdbCursor cursor(raw);
  MDB_val k, v;
  // Only the leaf pages are read: LMDB hands out a large value's address without touching it.
  GuardedRead read{.cursor = raw, .op = MDB_FIRST, .key = &k, .value = &v, .touch_value = false};
  const auto* base = s_->map.data();
  const uint64_t file_bytes = s_->map.size();
  // The leaf pages lie scattered through the file between the records: without this each cold
  // one would make the kernel read around it (up to read_ahead_kb, often megabytes), and the
  // walk would read most of the file.
  ::madvise(const_cast<std::byte*>(base), s_->map.size(), MADV_RANDOM);
  struct RestoreAdvice {
    const std::byte* base;
    size_t size;
    ~RestoreAdvice() { ::madvise(const_cast<std::byte*>(base), size, MADV_NORMAL); }
  } restore{base, s_->map.size()};
  for (;;) {
    if (!RunGuarded(read)) return MapFault(s_->path, "records table");
    if (read.rc == MDB_NOTFOUND) break;
    if (read.rc != MDB_SUCCESS) return MdbStatus(read.rc, where + ": walk records table");
    read.op = MDB_NEXT;
    if (k.mv_size != 8) continue;
    const uint64_t index = DecodeKey(std::span<const std::byte, 8>(static_cast<const std::byte*>(k.mv_data), 8));
    const auto* at = static_cast<const std::byte*>(v.mv_data);
    if (index >= extents.size() || at < base || v.mv_size > UINT32_MAX) continue;
    const auto offset = static_cast<uint64_t>(at - base);
    if (offset > file_bytes || v.mv_size > file_bytes - offset) continue;  // damaged: a Reader reports it
    extents[index] = {offset, static_cast<uint32_t>(v.mv_size)};
  }
  return extents;
}

void Reader::Renew() {
  mdb_txn_reset(txn_.get());
  (void)mdb_txn_renew(txn_.get());  // on failure the next read says MDB_BAD_TXN, naming its record
}

Result<RecordView> Reader::Get(int64_t index) {
  if (index < 0 || index >= dataset_.size()) {
    return InvalidArgumentError(fmt::format("dataset: {}: record {} out of range [0, {})",
                                            dataset_.s_->path.string(), index, dataset_.size()));
  }
  std::array<std::byte, 8> key;
  EncodeKey(static_cast<uint64_t>(index), key);
  MDB_val k = Val(key.data(), key.size()), v;
  GuardedRead read{.txn = txn_.get(), .dbi = dataset_.s_->records_dbi, .key = &k, .value = &v};
  if (!RunGuarded(read)) {
    Renew();
    return MapFault(dataset_.s_->path, fmt::format("record {}", index));
  }
  const int rc = read.rc;
  if (rc == MDB_NOTFOUND) {
    return CorruptError(
        fmt::format("dataset: {}: record {} missing", dataset_.s_->path.string(), index));
  }
  if (rc != MDB_SUCCESS) {
    Renew();
    return MdbStatus(rc, fmt::format("dataset: {}: record {}", dataset_.s_->path.string(), index));
  }
  return Check(v, index);
}

Status Reader::Scan(int64_t begin, int64_t end,
                    const std::function<Status(const RecordView&)>& fn) {
  const std::string where = "dataset: " + dataset_.s_->path.string();
  if (begin < 0 || end > dataset_.size() || begin > end) {
    return InvalidArgumentError(fmt::format("{}: range [{}, {}) not within [0, {})", where, begin,
                                            end, dataset_.size()));
  }
  if (begin == end) return OkStatus();
  // Declared before the cursor, so that a renewal after a failed read comes after its close.
  struct RenewAfterFailure {
    Reader* reader;
    bool failed = false;
    ~RenewAfterFailure() {
      if (failed) reader->Renew();
    }
  } renew{this};
  MDB_cursor* raw = nullptr;
  int rc = mdb_cursor_open(txn_.get(), dataset_.s_->records_dbi, &raw);
  if (rc != MDB_SUCCESS) return MdbStatus(rc, where + ": open cursor");
  MdbCursor cursor(raw);
  std::array<std::byte, 8> key;
  EncodeKey(static_cast<uint64_t>(begin), key);
  MDB_val k = Val(key.data(), key.size()), v;
  GuardedRead read{.cursor = raw, .op = MDB_SET_KEY, .key = &k, .value = &v};
  renew.failed = true;  // until the read succeeds
  if (!RunGuarded(read)) return MapFault(dataset_.s_->path, fmt::format("record {}", begin));
  rc = read.rc;
  for (int64_t index = begin; index < end; ++index) {
    if (rc == MDB_NOTFOUND) return CorruptError(fmt::format("{}: record {} missing", where, index));
    if (rc != MDB_SUCCESS) return MdbStatus(rc, fmt::format("{}: record {}", where, index));
    renew.failed = false;
    if (k.mv_size != 8 ||
        DecodeKey(std::span<const std::byte, 8>(static_cast<const std::byte*>(k.mv_data), 8)) !=
            static_cast<uint64_t>(index)) {
      return CorruptError(fmt::format("{}: record {} missing (keys out of sequence)", where, index));
    }
    STOKE_ASSIGN_OR_RETURN(RecordView record, Check(v, index));
    STOKE_RETURN_IF_ERROR(fn(record));
    if (index + 1 < end) {
      read.op = MDB_NEXT;
      renew.failed = true;
      if (!RunGuarded(read)) return MapFault(dataset_.s_->path, fmt::format("record {}", index + 1));
      rc = read.rc;
    }
  }
  return OkStatus();
}

int Dataset::data_fd() const {
  mdb_filehandle_t fd = -1;
  if (!s_->env || mdb_env_get_fd(s_->env.get(), &fd) != MDB_SUCCESS) return -1;
  return fd;
}

Result<std::string> Reader::SourcePath(int64_t index) {
  if (index < 0 || index >= dataset_.size()) {
    return InvalidArgumentError(fmt::format("dataset: {}: record {} out of range [0, {})",
                                            dataset_.s_->path.string(), index, dataset_.size()));
  }
  STOKE_RETURN_IF_ERROR(dataset_.s_->paths_status);
  if (!dataset_.s_->has_paths_dbi) return std::string();
  std::array<std::byte, 8> key;
  EncodeKey(static_cast<uint64_t>(index), key);
  MDB_val k = Val(key.data(), key.size()), v;
  GuardedRead read{.txn = txn_.get(), .dbi = dataset_.s_->paths_dbi, .key = &k, .value = &v};
  if (!RunGuarded(read)) {
    Renew();
    return MapFault(dataset_.s_->path, fmt::format("path of record {}", index));
  }
  const int rc = read.rc;
  if (rc == MDB_NOTFOUND) return std::string();
  if (rc != MDB_SUCCESS) {
    Renew();
    return MdbStatus(rc, fmt::format("dataset: {}: path of record {}", dataset_.s_->path.string(),
                                     index));
  }
  return std::string(static_cast<const char*>(v.mv_data), v.mv_size);
}

}  // namespace stoke::dataset
