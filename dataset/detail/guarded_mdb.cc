#include "dataset/detail/guarded_mdb.h"

#include <cstdio>

#include <fmt/format.h>

#include "common/map_guard.h"

namespace stoke::dataset::detail {
namespace {

// What LMDB's assertion said, when one ended the guarded call on this thread (a damaged page
// that LMDB checks, e.g. a zeroed leaf page); empty after a fault.
thread_local char t_mdb_assert[400];

}  // namespace

void GuardedRead::operator()() {
  rc = cursor != nullptr ? mdb_cursor_get(cursor, key, value, op) : mdb_get(txn, dbi, key, value);
  if (rc != MDB_SUCCESS || !touch_value) return;
  const volatile char* p = static_cast<const char*>(value->mv_data);
  for (size_t i = 0; i < value->mv_size; i += 4096) (void)p[i];
  if (value->mv_size > 0) (void)p[value->mv_size - 1];
}

void OnMdbAssert(MDB_env*, const char* message) {
  std::snprintf(t_mdb_assert, sizeof t_mdb_assert, "%s", message);
  LeaveGuarded();
  t_mdb_assert[0] = '\0';
}

Status GuardedFault(const std::filesystem::path& path, const std::string& what,
                    const std::string& advice) {
  std::string why = "a page lies outside the file";
  if (t_mdb_assert[0] != '\0') {
    why = fmt::format("LMDB found a damaged page: {}", t_mdb_assert);
    t_mdb_assert[0] = '\0';
  }
  return CorruptError(fmt::format("dataset: {}: {}: the data file is damaged ({}); {}",
                                  path.string(), what, why, advice));
}

Result<int> OpenTableGuarded(MDB_txn* txn, const char* name, MDB_dbi* dbi,
                             const std::filesystem::path& path, const std::string& advice) {
  // Without MDB_CREATE the lookup only reads; a fault can come after LMDB copied the name (a few
  // bytes then leak), never inside an allocation.
  struct Open {
    MDB_txn* txn;
    const char* name;
    MDB_dbi* dbi;
    int rc = MDB_SUCCESS;
    void operator()() { rc = mdb_dbi_open(txn, name, 0, dbi); }
  } open{txn, name, dbi};
  if (!RunGuarded(open)) return GuardedFault(path, fmt::format("'{}' table", name), advice);
  return open.rc;
}

}  // namespace stoke::dataset::detail
