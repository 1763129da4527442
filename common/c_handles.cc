#include "common/c_handles.h"

#include <cerrno>

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

}  // namespace stoke
