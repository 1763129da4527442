// Helpers of the storage stage's tests (storage_test, storage_fault_test): dropping a dataset from
// the page cache, options that send every record through the stage's reads, and running a loader
// to its end.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <vector>

#include "dataset/dataset.h"
#include "prefetch/loader.h"
#include "prefetch/storage.h"
#include "tests/prefetch/loader_test_util.h"

namespace stoke::prefetch {

// Drops the dataset's data file from the page cache (written back first).
inline void Evict(const dataset::Dataset& ds) {
  const int fd = ::open(ds.data_file().c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// Every record through the read path, in small segments, so that a 40-record dataset spans
// several segments and reads.
inline StorageOptions ReadEverything(int64_t segment = 7) {
  StorageOptions s;
  s.use_map_when_resident = false;
  s.segment_positions = segment;
  s.io_threads = 3;
  return s;
}

// The samples of a loader over `ds` with `o`, to its end; `stats`: its storage figures; `bad`: how
// many bad records it met.
inline std::vector<Seen> RunLoader(const dataset::Dataset& ds, const LoaderOptions& o, StorageStats* stats = nullptr,
                                   size_t* bad = nullptr) {
  auto loader = Loader::Create(ds, o);
  EXPECT_TRUE(loader.ok()) << loader.status().ToString();
  if (!loader.ok()) return {};
  auto seen = Drain(**loader);
  if (stats) *stats = (*loader)->stats().storage;
  if (bad) *bad = (*loader)->bad_records().size();
  return seen;
}

}  // namespace stoke::prefetch
