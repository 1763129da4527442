// LMDB reads of a data file that may be damaged, run under RunGuarded (common/map_guard.h): shared
// by the Dataset and the writer's resume (private to dataset/).
#pragma once

#include <lmdb.h>

#include <filesystem>
#include <string>

#include "common/status.h"

namespace stoke::dataset::detail {

// Runs an LMDB read and touches every page of the value it returns, under RunGuarded: a damaged
// data file whose pages point past its end (SIGBUS) or out of the map (SIGSEGV) gives an error
// instead of killing the process, and a value that comes back is safe to read afterwards.
// Call it through RunGuarded; `rc` then holds LMDB's result.
struct GuardedRead {
  MDB_txn* txn = nullptr;
  MDB_cursor* cursor = nullptr;  // cursor reads when set, else mdb_get on dbi
  MDB_dbi dbi = 0;
  MDB_cursor_op op = MDB_SET_KEY;
  MDB_val* key = nullptr;
  MDB_val* value = nullptr;
  bool touch_value = true;  // false: only the table's own pages are read
  int rc = MDB_SUCCESS;
  void operator()();
};

// LMDB's assertion handler for environments whose reads run guarded: inside a guarded call it
// keeps LMDB's message for GuardedFault and leaves the call (which returns false); outside one it
// returns, and LMDB aborts as it would have.
void OnMdbAssert(MDB_env* env, const char* message);

// The kCorrupt for a guarded LMDB call that faulted: "dataset: <path>: <what>: the data file is
// damaged (<cause>); <advice>", the cause being LMDB's assertion when one ended the call.
Status GuardedFault(const std::filesystem::path& path, const std::string& what,
                    const std::string& advice = "run stoke inspect --verify, and repack it");

// Opens the named table `name` (mdb_dbi_open with no flags) under RunGuarded: looking it up reads
// the main table's pages, the first ones a damaged file can have point anywhere. Returns LMDB's
// code (MDB_NOTFOUND: no such table; MDB_INCOMPATIBLE: the name is a plain key, not a table), or
// GuardedFault naming `path` and the table when the lookup faulted.
Result<int> OpenTableGuarded(
    MDB_txn* txn, const char* name, MDB_dbi* dbi, const std::filesystem::path& path,
    const std::string& advice = "run stoke inspect --verify, and repack it");

}  // namespace stoke::dataset::detail
