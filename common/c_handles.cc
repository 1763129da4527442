#include "common/c_handles.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace stoke {

Status MdbStatus(int rc, const std::string& what) {
  if (rc == MDB_SUCCESS) return OkStatus();
  std::string m = what + ": " + mdb_strerror(rc);
  switch (rc) {
    case MDB_NOTFOUND: return NotFoundError(std::move(m));
    case MDB_MAP_FULL: return ResourceExhaustedError(std::move(m));
    case MDB_CORRUPTED:
    case MDB_INVALID:
    case MDB_VERSION_MISMATCH:
    case MDB_PAGE_NOTFOUND:
    case MDB_BAD_TXN:
      return CorruptError(std::move(m));
    case ENOENT: return NotFoundError(std::move(m));
    case ENOMEM: return ResourceExhaustedError(std::move(m));
    // LMDB reports a write the file system refused (no space, quota, file size limit) as the
    // errno of that write, or as EIO when it surfaced at the flush.
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
    case EIO:
      return IoError(m + " (is the disk full, or a quota or file size limit reached?)");
    default: break;
  }
  if (rc > 0) return IoError(std::move(m));  // errno values
  return InternalError(std::move(m));
}

Status CommitTxn(MdbTxn& txn, const std::string& what) {
  // mdb_txn_commit frees the handle whether it succeeds or not.
  int rc = mdb_txn_commit(txn.release());
  return MdbStatus(rc, what + ": commit");
}

Result<MdbTxn> BeginTxn(MDB_env* env, unsigned flags, const std::string& what) {
  MDB_txn* raw = nullptr;
  int rc = mdb_txn_begin(env, nullptr, flags, &raw);
  if (rc != MDB_SUCCESS) return MdbStatus(rc, what + ": begin transaction");
  return MdbTxn(raw);
}

namespace {

// LMDB 0.9's on-disk meta page (64-bit builds): a 16-byte page header (page number, pad, flags at
// 10, lower/upper), then MDB_meta: magic, version, address, map size, two 48-byte MDB_db records
// (the free-page table's, whose leading 32-bit field holds the page size, then the main table's;
// each ends with its root page number), the last page number, the txnid.
constexpr size_t kMetaFlagsAt = 10, kMagicAt = 16, kVersionAt = 20, kPageSizeAt = 40,
                 kFreeRootAt = 80, kMainRootAt = 128, kLastPageAt = 136, kTxnIdAt = 144,
                 kMetaBytes = 152;
constexpr uint64_t kNoPage = ~uint64_t{0};  // LMDB's P_INVALID: an empty table has no root
constexpr uint16_t kPageIsMeta = 0x08;
constexpr uint32_t kMdbMagic = 0xBEEFC0DE, kMdbDataVersion = 1;

template <typename T>
T Field(const unsigned char* page, size_t at) {
  T v;
  std::memcpy(&v, page + at, sizeof(T));
  return v;
}

}  // namespace

Status CheckMdbDataFile(const std::filesystem::path& data_file, const std::string& what) {
  const std::string name = data_file.string();
  // O_NONBLOCK: a FIFO is refused below instead of waiting for a writer.
  const int fd = ::open(data_file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    std::string m = fmt::format("{}: open {}: {}", what, name, std::strerror(err));
    return err == ENOENT ? NotFoundError(std::move(m)) : IoError(std::move(m));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return IoError(fmt::format("{}: stat {}: {}", what, name, std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgumentError(fmt::format("{}: {} is not a regular file (expected an LMDB data file)", what, name));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes == 0) return CorruptError(fmt::format("{}: the data file {} is empty", what, name));
  unsigned char meta[2][kMetaBytes];
  uint32_t page_size = 0;
  for (int i = 0; i < 2; ++i) {
    const off_t at = static_cast<off_t>(i) * page_size;
    const ssize_t n = ::pread(fd, meta[i], kMetaBytes, at);
    if (n < 0) return IoError(fmt::format("{}: read {}: {}", what, name, std::strerror(errno)));
    const bool is_meta = static_cast<size_t>(n) == kMetaBytes && Field<uint32_t>(meta[i], kMagicAt) == kMdbMagic &&
                         (Field<uint16_t>(meta[i], kMetaFlagsAt) & kPageIsMeta) != 0;
    if (i == 0 && !is_meta) {
      if (static_cast<size_t>(n) < kMetaBytes || file_bytes < 4096) {
        return CorruptError(fmt::format("{}: data file {} truncated: {} bytes, not even LMDB's first page", what,
                                        name, file_bytes));
      }
      return InvalidArgumentError(fmt::format("{}: {} is not an LMDB data file (is this a stoke dataset?)", what, name));
    }
    if (!is_meta) {
      if (static_cast<size_t>(n) < kMetaBytes) {
        return CorruptError(fmt::format("{}: data file {} truncated: {} bytes, its second meta page is at {}", what,
                                        name, file_bytes, at));
      }
      return CorruptError(fmt::format("{}: data file {}: LMDB meta page 1 is damaged (no meta page at {})", what,
                                      name, at));
    }
    const uint32_t version = Field<uint32_t>(meta[i], kVersionAt);
    if (version != kMdbDataVersion) {
      return CorruptError(fmt::format("{}: data file {}: LMDB meta page {} has format version {} (expected {})", what,
                                      name, i, version, kMdbDataVersion));
    }
    const uint32_t psize = Field<uint32_t>(meta[i], kPageSizeAt);
    if (psize < 512 || psize > 65536 || (psize & (psize - 1)) != 0 || (i == 1 && psize != page_size)) {
      return CorruptError(fmt::format(
          "{}: data file {}: LMDB meta page {} is damaged (page size {}; expected a power of two from 512 to 65536{})",
          what, name, i, psize, i == 1 ? fmt::format(", equal to meta page 0's {}", page_size) : std::string()));
    }
    page_size = psize;
  }
  // LMDB reads through the meta page of the newer transaction.
  const int newer = Field<uint64_t>(meta[1], kTxnIdAt) > Field<uint64_t>(meta[0], kTxnIdAt) ? 1 : 0;
  const uint64_t last_page = Field<uint64_t>(meta[newer], kLastPageAt);
  if (last_page >= file_bytes / page_size) {  // (last_page + 1) * page_size > file_bytes, without overflow
    return CorruptError(fmt::format("{}: data file {} truncated: {} bytes, its pages need {}", what, name, file_bytes,
                                    last_page < (UINT64_MAX / page_size) - 1
                                        ? fmt::format("{}", (last_page + 1) * page_size)
                                        : fmt::format("page {} of {} bytes", last_page, page_size)));
  }
  // Pages 0 and 1 are the meta pages, so a table's root is a later page, up to the last one: LMDB
  // asserts on a root below 2 (abort()) the first time it reads the table.
  for (const auto& [at, table] :
       {std::pair{kFreeRootAt, "free-page"}, std::pair{kMainRootAt, "main"}}) {
    const uint64_t root = Field<uint64_t>(meta[newer], at);
    if (root != kNoPage && (root < 2 || root > last_page)) {
      return CorruptError(
          fmt::format("{}: data file {}: LMDB meta page {} is damaged (the {} table's root is page "
                      "{}; expected 2 to {})",
                      what, name, newer, table, root, last_page));
    }
  }
  return OkStatus();
}

}  // namespace stoke
