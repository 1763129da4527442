// An exception inside the loader's pipeline (here an allocation that fails while a large record is
// decoded) reaches the consumer as an error naming the record, after every batch before it, and
// never leaves Next() waiting: left to TBB, it cancelled the pipeline, dropped the batches in
// flight and, while the consumer held a lease, waited forever for an input stage blocked on the
// ring. This binary replaces the global operator new so that, once armed, a large allocation made
// off the test's own thread throws std::bad_alloc, or (armed so) any allocation of the storage
// stage's scheduler thread does.
// GCC sees the replacement delete's free() meet the replacement new's malloc() and calls the pair
// mismatched; they are this file's own matching pair.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <pthread.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <new>
#include <thread>

#include "prefetch/loader.h"
#include "tests/prefetch/loader_test_util.h"
#include "tests/testing/test_util.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define STOKE_SANITIZED_NEW 1  // the sanitizer owns operator new; the test skips
#else
#define STOKE_SANITIZED_NEW 0
#endif

namespace {
std::atomic<size_t> fail_above{SIZE_MAX};  // armed: allocations larger than this throw
std::atomic<bool> fail_storage_thread{false};  // armed: every allocation of the storage scheduler throws
std::atomic<int> failed_allocations{0};
std::thread::id test_thread;

}  // namespace

#if !STOKE_SANITIZED_NEW
void* operator new(size_t n) {
  if ((n > fail_above.load(std::memory_order_relaxed) && std::this_thread::get_id() != test_thread) ||
      (fail_storage_thread.load(std::memory_order_relaxed) && stoke::testing::CurrentThreadIs("stoke-storage"))) {
    failed_allocations.fetch_add(1);
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

// Every record but `big` decodes its 32x32 centre crop with well under 100 KB; `big` needs more.
constexpr size_t kFailAbove = 100'000;

class Armed {
 public:
  Armed() {
    failed_allocations = 0;
    fail_above = kFailAbove;
  }
  ~Armed() { fail_above = SIZE_MAX; }
};

LoaderOptions CentreCrops(int threads, int batch) {
  LoaderOptions o = SmallOptions(threads);
  o.sampler.mode = dataset::ShuffleMode::kSequential;
  o.augment.mode = CropMode::kCenter;
  o.augment.resize = 40;
  o.augment.crop = 32;
  o.batch_size = batch;
  o.ring_size = 2;
  o.epochs = 1;
  return o;
}

class LoaderException : public ::testing::Test {
 protected:
  void SetUp() override {
    if (STOKE_SANITIZED_NEW) GTEST_SKIP() << "replaces the global operator new, which this sanitizer build owns";
    test_thread = std::this_thread::get_id();
  }
};

// Batch 0 is whole; record 9 (batch 1) fails: batch 0 comes out, then the error naming record 9,
// whatever the threads' timing.
TEST_F(LoaderException, TheErrorNamesTheRecordAndFollowsTheBatchesBeforeIt) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.big = 9}));
  ASSERT_OK(ds.status());
  for (int run = 0; run < 20; ++run) {
    SCOPED_TRACE(fmt::format("run {}", run));
    Armed armed;
    auto loader = Loader::Create(*ds, CentreCrops(2, 6));
    ASSERT_OK(loader.status());
    int batches = 0;
    Status end;
    for (;;) {
      auto lease = (*loader)->Next();
      if (!lease.ok()) {
        end = lease.status();
        break;
      }
      if (!*lease) break;
      ++batches;
    }
    EXPECT_GE(failed_allocations.load(), 1);
    EXPECT_EQ(batches, 1);
    EXPECT_EQ(end.code(), StatusCode::kResourceExhausted) << end.ToString();
    EXPECT_NE(end.message().find("record 9 of"), std::string::npos) << end.ToString();
  }
}

// The consumer keeps the batch it has while it asks for the next (one lease of a ring of two):
// the error still comes back, within seconds.
TEST_F(LoaderException, NextReturnsTheErrorWhileTheConsumerHoldsALease) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 100, .big = 95}));
  ASSERT_OK(ds.status());
  for (int run = 0; run < 10; ++run) {
    SCOPED_TRACE(fmt::format("run {}", run));
    Armed armed;
    auto loader = Loader::Create(*ds, CentreCrops(4, 32));
    ASSERT_OK(loader.status());
    std::atomic<int> batches{0};
    auto consumer = std::async(std::launch::async, [&]() -> Status {
      BatchLease held;
      for (;;) {
        auto lease = (*loader)->Next();
        if (!lease.ok()) return lease.status();
        if (!*lease) return OkStatus();
        ++batches;
        held = std::move(*lease);  // the previous batch goes back only now
      }
    });
    const bool returned = consumer.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
    if (!returned) (*loader)->Stop();  // the only way out of the old hang
    const Status end = consumer.get();
    ASSERT_TRUE(returned) << "Next() still waiting 30 s after a stage failed";
    EXPECT_EQ(batches.load(), 2);
    EXPECT_EQ(end.code(), StatusCode::kResourceExhausted) << end.ToString();
    EXPECT_NE(end.message().find("record 95 of"), std::string::npos) << end.ToString();
  }
}

// The storage stage's scheduler runs out of memory while it plans a segment, at the start or in
// the middle of a run: the rest of the records are read through the map and the batches are those
// of the map path. Before, the exception ended the process (std::terminate from the thread).
TEST_F(LoaderException, AStorageSchedulerOutOfMemoryLeavesTheRecordsToTheMap) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 40}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.epochs = 4;  // 32 segments of 5: far more than the scheduler plans ahead of the first batch
  o.storage.enabled = false;
  std::vector<Seen> want;
  {
    auto loader = Loader::Create(*ds, o);
    ASSERT_OK(loader.status());
    want = Drain(**loader);
  }
  ASSERT_EQ(want.size(), 28u);  // 4 epochs of ceil(40 / 6) batches
  o.storage.enabled = true;
  o.storage.use_map_when_resident = false;
  o.storage.segment_positions = 5;
  o.storage.io_threads = 2;
  for (int armed_after : {0, 1, 9}) {
    SCOPED_TRACE(fmt::format("armed after {} batches", armed_after));
    failed_allocations = 0;
    if (armed_after == 0) fail_storage_thread = true;
    auto loader = Loader::Create(*ds, o);
    ASSERT_OK(loader.status());
    std::vector<Seen> got = Drain(**loader, armed_after);
    fail_storage_thread = true;
    const std::vector<Seen> rest = Drain(**loader);
    got.insert(got.end(), rest.begin(), rest.end());
    const StorageStats stats = (*loader)->stats().storage;
    loader->reset();
    fail_storage_thread = false;
    EXPECT_GE(failed_allocations.load(), 1);
    EXPECT_EQ(got, want);
    EXPECT_GT(stats.records_direct, 0);  // read through the map once planning stopped
    if (armed_after > 0) {
      EXPECT_GT(stats.records_buffered, 0);
    }
  }
}

}  // namespace
}  // namespace stoke::prefetch
