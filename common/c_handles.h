// Move-only RAII owners for the C handles stoke wraps (LMDB, TurboJPEG). One alias per handle
// type; the deleter is the library's own destroy function and is never called on null.
#pragma once

#include <lmdb.h>
#include <turbojpeg.h>

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

}  // namespace stoke
