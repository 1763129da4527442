// The storage stage under faults it cannot cause itself: reads that fail or come back short, an
// I/O thread that cannot allocate while it reports a failed read, and reads slow enough that the
// decoders wait. This binary replaces pread() and the global operator new; when armed they act
// only on the stage's I/O threads (named "stoke-read"), so the decoders' own reads through the
// map stay healthy and every batch must equal the map path's.
// GCC sees the replacement delete's free() meet the replacement new's malloc() and calls the pair
// mismatched; they are this file's own matching pair.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <fcntl.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>

#include <gtest/gtest.h>

#include "prefetch/loader.h"
#include "tests/prefetch/loader_test_util.h"
#include "tests/prefetch/storage_test_util.h"
#include "tests/testing/test_util.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define STOKE_SANITIZED_IO 1  // the sanitizer intercepts pread and owns operator new; the tests skip
#else
#define STOKE_SANITIZED_IO 0
#endif

namespace {
enum class ReadFault { kNone, kEveryThirdFails, kShort, kAllFail, kSlow };
std::atomic<ReadFault> read_fault{ReadFault::kNone};
std::atomic<int> io_reads{0};
std::atomic<bool> fail_io_allocations{false};

}  // namespace

#if !STOKE_SANITIZED_IO
extern "C" ssize_t pread(int fd, void* buf, size_t n, off_t offset) {
  const ReadFault fault = read_fault.load();
  if (fault != ReadFault::kNone && stoke::testing::CurrentThreadIs("stoke-read")) {
    const int call = io_reads.fetch_add(1);
    if (fault == ReadFault::kAllFail || (fault == ReadFault::kEveryThirdFails && call % 3 == 2)) {
      errno = EIO;
      return -1;
    }
    if (fault == ReadFault::kShort) n = std::min<size_t>(n, 1000);  // unaligned: O_DIRECT's rest goes buffered
    if (fault == ReadFault::kSlow) ::usleep(300'000);
  }
  return ::syscall(SYS_pread64, fd, buf, n, offset);
}

void* operator new(size_t n) {
  if (fail_io_allocations.load(std::memory_order_relaxed) && stoke::testing::CurrentThreadIs("stoke-read")) {
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
#endif

namespace stoke::prefetch {
namespace {

class StorageFault : public ::testing::Test {
 protected:
  void SetUp() override {
    if (STOKE_SANITIZED_IO) GTEST_SKIP() << "replaces pread and operator new, which this sanitizer build intercepts";
  }
  void TearDown() override {
    read_fault = ReadFault::kNone;
    fail_io_allocations = false;
  }
};

// The loader's samples to its end, which met no bad record (a failed read is never one).
std::vector<Seen> RunCleanly(const dataset::Dataset& ds, const LoaderOptions& o, StorageStats* stats = nullptr) {
  size_t bad = 0;
  auto seen = RunLoader(ds, o, stats, &bad);
  EXPECT_EQ(bad, 0u);
  return seen;
}

double CpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// Failed and short reads, through the page cache and with O_DIRECT (the cache dropped): the
// records concerned go the decoders' way and the batches are the map path's, nothing held after.
TEST_F(StorageFault, FailedAndShortReadsKeepTheBatches) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 60, .scale = 4}));
  ASSERT_OK(ds.status());
  for (auto mode : {dataset::ShuffleMode::kFull, dataset::ShuffleMode::kBlock}) {
    LoaderOptions o = SmallOptions(2);
    o.sampler.mode = mode;
    o.sampler.block_size = 5;
    o.sampler.window_blocks = 3;
    o.storage.enabled = false;
    const auto want = RunCleanly(*ds, o);
    ASSERT_EQ(want.size(), 20u);
    for (auto cache : {StorageOptions::Cache::kKeep, StorageOptions::Cache::kDrop}) {
      for (ReadFault fault : {ReadFault::kEveryThirdFails, ReadFault::kShort}) {
        SCOPED_TRACE(fmt::format("order {} cache {} fault {}", static_cast<int>(mode), static_cast<int>(cache),
                                 static_cast<int>(fault)));
        Evict(*ds);
        o.storage = ReadEverything(mode == dataset::ShuffleMode::kBlock ? 0 : 9);
        o.storage.cache = cache;
        io_reads = 0;
        read_fault = fault;
        StorageStats stats;
        EXPECT_EQ(RunCleanly(*ds, o, &stats), want);
        read_fault = ReadFault::kNone;
        EXPECT_GT(io_reads.load(), 0);
        EXPECT_GT(stats.records_buffered, 0);
        if (fault == ReadFault::kEveryThirdFails) {
          EXPECT_GT(stats.records_direct, 0);
        }
        EXPECT_EQ(stats.held_bytes, 0);
      }
    }
  }
}

// Every read fails and the I/O threads cannot allocate the warning they write about it: the
// process went down (std::terminate); now the records are read through the map.
TEST_F(StorageFault, AnIoThreadOutOfMemoryWhileReportingAFailedReadEndsNothing) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 40}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.storage.enabled = false;
  const auto want = RunCleanly(*ds, o);
  o.storage = ReadEverything(7);
  read_fault = ReadFault::kAllFail;
  fail_io_allocations = true;
  StorageStats stats;
  EXPECT_EQ(RunCleanly(*ds, o, &stats), want);
  fail_io_allocations = false;
  // (The warning is now written without allocating, so failed_allocations may stay 0: what is
  // checked is that nothing on that path can end the process.)
  EXPECT_EQ(stats.records_buffered, 0);
}

// Decoders waiting for a slow read sleep: each waiting decoder used to wake the others on every
// pass of its wait, and together they kept a core busy for as long as the read took.
TEST_F(StorageFault, DecodersWaitingForAReadDoNotSpin) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 40}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(4);
  o.batch_size = 8;
  o.epochs = 1;
  o.storage = ReadEverything(40);  // one segment: every decoder waits for all of it
  o.storage.io_threads = 1;
  read_fault = ReadFault::kSlow;
  const double cpu0 = CpuSeconds();
  const auto wall0 = std::chrono::steady_clock::now();
  StorageStats stats;
  RunCleanly(*ds, o, &stats);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  const double cpu = CpuSeconds() - cpu0;
  read_fault = ReadFault::kNone;
  ASSERT_GT(stats.wait_s, 1.0) << "the decoders did not wait: the test shows nothing";
  // Decoding 40 small images takes a few ms; spinning took about one core for the whole wait.
  EXPECT_LT(cpu, 0.25 * wall) << "cpu " << cpu << " s over " << wall << " s of waiting";
}

}  // namespace
}  // namespace stoke::prefetch
