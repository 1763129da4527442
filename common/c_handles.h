// Move-only RAII owners for the C handles stoke wraps (LMDB, TurboJPEG). One alias per handle
// type; the deleter is the library's own destroy function and is never called on null.
#pragma once

#include <lmdb.h>
#include <turbojpeg.h>

#include <filesystem>
#include <memory>
#include <string>

#include "common/status.h"

namespace stoke {

template <auto DestroyFn>
struct CDeleter {
  template <typename T>
  void operator()(T* p) const noexcept {
    if (p) DestroyFn(p);
  }
};

// LMDB environment. Closing never fails.
using MdbEnv = std::unique_ptr<MDB_env, CDeleter<mdb_env_close>>;
// LMDB transaction. Destruction aborts (rolls back); commit explicitly with CommitTxn().
using MdbTxn = std::unique_ptr<MDB_txn, CDeleter<mdb_txn_abort>>;
// LMDB cursor. Must be destroyed before the transaction it belongs to ends.
using MdbCursor = std::unique_ptr<MDB_cursor, CDeleter<mdb_cursor_close>>;

// TurboJPEG handle (compressor or decompressor). Not thread-safe: one per thread.
using TjHandle = std::unique_ptr<void, CDeleter<tjDestroy>>;

// Maps an LMDB return code to a Status: MDB_NOTFOUND -> kNotFound, MDB_MAP_FULL ->
// kResourceExhausted, MDB_CORRUPTED / MDB_INVALID / MDB_VERSION_MISMATCH / MDB_PAGE_NOTFOUND ->
// kCorrupt, errno values -> kIoError (kNotFound for ENOENT). `what` names the object.
Status MdbStatus(int rc, const std::string& what);

// Commits `txn` (releasing ownership) and maps the result to a Status.
Status CommitTxn(MdbTxn& txn, const std::string& what);

// Begins a transaction on `env`: read-only when `flags` has MDB_RDONLY.
Result<MdbTxn> BeginTxn(MDB_env* env, unsigned flags, const std::string& what);

// Checks an LMDB data file before mdb_env_open maps it, since LMDB trusts what its two meta pages
// say: a page size of 0 divides by zero, one of another size reads the wrong pages, and a file
// shorter than the last page they name faults (SIGBUS) when that page is touched. OK for a
// regular file whose meta pages carry LMDB's magic and version, equal power-of-two page sizes,
// a last page inside the file and table roots (none, or pages 2 to the last) LMDB can follow;
// kInvalidArgument for a file that is not an LMDB data file at all (`what` names the object for
// that message); kCorrupt naming the file and the damage otherwise; kIoError when it cannot be
// read.
Status CheckMdbDataFile(const std::filesystem::path& data_file, const std::string& what);

}  // namespace stoke
