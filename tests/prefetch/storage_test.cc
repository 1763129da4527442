// Tests for the loader's storage stage (prefetch/storage.h): with records read ahead into
// buffers the batches are exactly those of the map path in every order, resumed or sharded; the
// budget holds; damaged records read through it are caught and skipped as before; records in the
// page cache are served from the map; ranges read can be dropped from the page cache; a window
// larger than the budget is refused; stopping anywhere with reads in flight neither hangs nor
// leaks.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <random>

#include <gtest/gtest.h>

#include "prefetch/loader.h"
#include "prefetch/storage.h"
#include "tests/prefetch/loader_test_util.h"
#include "tests/prefetch/storage_test_util.h"
#include "tests/testing/test_util.h"

namespace stoke::prefetch {
namespace {

// Fraction of the data file's pages in the page cache.
double ResidentFraction(const dataset::Dataset& ds) {
  const auto map = ds.map();
  const size_t pages = (map.size() + 4095) / 4096;
  std::vector<unsigned char> vec(pages);
  if (::mincore(const_cast<std::byte*>(map.data()), map.size(), vec.data()) != 0) return -1;
  size_t in = 0;
  for (unsigned char v : vec) in += v & 1;
  return static_cast<double>(in) / static_cast<double>(pages);
}

TEST(Storage, BatchesMatchTheMapPathInEveryOrder) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 45, .bad = {9}}));
  ASSERT_OK(ds.status());
  for (auto mode : {dataset::ShuffleMode::kFull, dataset::ShuffleMode::kBlock, dataset::ShuffleMode::kSequential}) {
    for (int threads : {1, 3}) {
      SCOPED_TRACE(fmt::format("mode {} threads {}", static_cast<int>(mode), threads));
      LoaderOptions o = SmallOptions(threads);
      o.sampler.mode = mode;
      o.sampler.block_size = 4;
      o.sampler.window_blocks = 3;
      o.max_skip_fraction = 0.1;
      o.storage.enabled = false;
      const auto want = RunLoader(*ds, o);
      ASSERT_EQ(want.size(), 16u);  // 2 epochs of ceil(45 / 6) batches
      o.storage = ReadEverything(mode == dataset::ShuffleMode::kBlock ? 0 : 7);
      StorageStats stats;
      EXPECT_EQ(RunLoader(*ds, o, &stats), want);
      EXPECT_GT(stats.records_buffered, 80);
      EXPECT_EQ(stats.records_mapped, 0);
      EXPECT_GT(stats.bytes_read, 0);
      // The block window (3 blocks of 4) is the segment in block shuffle.
      EXPECT_EQ(stats.segment_positions, mode == dataset::ShuffleMode::kBlock ? 12 : 7);
    }
  }
}

TEST(Storage, ResumedShardedAndDropLastRunsMatchTheMapPath) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 50}));
  ASSERT_OK(ds.status());
  for (int rank : {0, 1}) {
    for (bool drop_last : {false, true}) {
      SCOPED_TRACE(fmt::format("rank {} drop_last {}", rank, drop_last));
      LoaderOptions o = SmallOptions(2);
      o.sampler.world_size = 2;
      o.sampler.rank = rank;
      o.drop_last_batch = drop_last;
      o.start_epoch = 1;
      o.start_batch = 2;
      o.epochs = 2;
      o.storage.enabled = false;
      const auto want = RunLoader(*ds, o);
      ASSERT_FALSE(want.empty());
      EXPECT_EQ(want.front().epoch, 1);
      EXPECT_EQ(want.front().number, 2);
      o.storage = ReadEverything(5);
      EXPECT_EQ(RunLoader(*ds, o), want);
    }
  }
}

// A count of epochs so large that numbering its segments overflows is an endless run: the stage
// still reads ahead (the product wrapped and the stage read nothing, or one epoch only).
TEST(Storage, AHugeEpochCountStillReadsAhead) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 40}));
  ASSERT_OK(ds.status());
  for (int64_t epochs : {int64_t{1} << 61, int64_t{1} << 62, (int64_t{1} << 62) + 1}) {
    SCOPED_TRACE(fmt::format("epochs {}", epochs));
    LoaderOptions o = SmallOptions(2);
    o.epochs = epochs;
    o.storage = ReadEverything(10);  // 4 segments per epoch
    auto loader = Loader::Create(*ds, o);
    ASSERT_OK(loader.status());
    EXPECT_EQ(Drain(**loader, 10).size(), 10u);  // past the first epoch
    const StorageStats stats = (*loader)->stats().storage;
    EXPECT_GT(stats.records_buffered, 40);  // past the first epoch's 40
    EXPECT_EQ(stats.records_direct, 0);
  }
}

// The dataset is replaced on disk while it is open (`pack --overwrite` of a dataset a trainer is
// reading): the stage reads the file the map shows, not the one its path names now, which holds
// other records at other offsets (read by path, every record failed its CRC).
TEST(Storage, ADatasetReplacedOnDiskIsReadFromTheFileItOpened) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 40}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.storage.enabled = false;
  const auto want = RunLoader(*ds, o);
  fs::rename(dir.path() / "d", dir.path() / "old");
  WriteDataset(dir.path() / "d", {.records = 40, .scale = 2});  // the same name, other bytes
  o.storage = ReadEverything(7);
  auto loader = Loader::Create(*ds, o);
  ASSERT_OK(loader.status());
  EXPECT_EQ(Drain(**loader), want);
  EXPECT_TRUE((*loader)->bad_records().empty());
  EXPECT_GT((*loader)->stats().storage.records_buffered, 0);
}

TEST(Storage, ReadAheadStaysWithinTheBudget) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 60}));
  ASSERT_OK(ds.status());
  const int64_t mean = ds->manifest().payload_bytes / ds->size();
  for (int threads : {2, 8}) {
    SCOPED_TRACE(threads);
    LoaderOptions o = SmallOptions(threads);
    o.epochs = 3;
    o.storage = ReadEverything(6);
    o.storage.memory_bytes = 3 * 6 * mean;  // about three segments
    StorageStats stats;
    const auto seen = RunLoader(*ds, o, &stats);
    EXPECT_EQ(seen.size(), 30u);
    EXPECT_GT(stats.peak_held_bytes, 0);
    // Segments decoders already wait for are read over the budget: those that the samples in
    // flight reach into (4 x threads chunks of one sample here, so ceil(4 x threads / 6) + 1
    // segments of six records; each bounded generously by three times the mean size).
    const int64_t over = (4 * threads + 5) / 6 + 1;
    EXPECT_LE(stats.peak_held_bytes, stats.budget_bytes + over * 6 * 3 * mean);
    EXPECT_EQ(stats.held_bytes, 0) << "every buffer is freed at the end";
  }
}

TEST(Storage, DamagedRecordsReadAheadAreCaughtAndSkipped) {
  testing::TempDir dir;
  const auto path = WriteDataset(dir.path() / "d", {.records = 30});
  int64_t damaged = 0;
  {
    auto ds = dataset::Dataset::Open(path);
    ASSERT_OK(ds.status());
    ASSERT_OK_AND_ASSIGN(auto extents, ds->RecordExtents());
    // Flip a payload byte of record 11 in the file: its CRC no longer matches.
    damaged = 11;
    const auto e = extents[static_cast<size_t>(damaged)];
    ASSERT_GT(e.size, 100u);
    const int fd = ::open(ds->data_file().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    std::byte b{};
    const off_t at = static_cast<off_t>(e.offset + e.size - 7);
    ASSERT_EQ(::pread(fd, &b, 1, at), 1);
    b ^= std::byte{0x40};
    ASSERT_EQ(::pwrite(fd, &b, 1, at), 1);
    ::close(fd);
  }
  auto ds = dataset::Dataset::Open(path);
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.epochs = 1;
  o.max_skip_fraction = 0.1;
  o.storage = ReadEverything(4);
  auto loader = Loader::Create(*ds, o);
  ASSERT_OK(loader.status());
  const auto seen = Drain(**loader);
  EXPECT_EQ(seen.size(), 5u);
  const auto bad = (*loader)->bad_records();
  ASSERT_EQ(bad.size(), 1u);
  EXPECT_EQ(bad[0].index, damaged);
  EXPECT_NE(bad[0].reason.find("CRC"), std::string::npos) << bad[0].reason;
  EXPECT_GT((*loader)->stats().storage.records_buffered, 20);
}

// A zeroed leaf page of the records table made the stage's walk of the table abort the process
// (an LMDB assertion); then refuse to start. Now the stage steps aside (the decoders read each
// record through the map) and the records on that page are skipped like any bad record.
TEST(Storage, AZeroedLeafPageLeavesTheRecordsToTheMapPath) {
  testing::TempDir dir;
  const auto path = WriteDataset(dir.path() / "d", {.records = 400, .scale = 2});
  const size_t lost = testing::ZeroRecordsLeafPage(path / "data.mdb", 1);
  ASSERT_GT(lost, 0u) << "expected the records table to span several leaf pages";
  auto ds = dataset::Dataset::Open(path);
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.batch_size = 20;
  o.epochs = 1;
  o.max_skip_fraction = 1;
  o.storage = ReadEverything(16);
  auto loader = Loader::Create(*ds, o);
  ASSERT_OK(loader.status());
  EXPECT_EQ(Drain(**loader).size(), 20u);
  EXPECT_EQ((*loader)->bad_records().size(), lost);
  EXPECT_EQ((*loader)->stats().storage.records_buffered, 0) << "the stage stepped aside";
}

TEST(Storage, ResidentRecordsComeFromTheMapWithoutReads) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 40}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.storage.io_threads = 2;
  // Read once to be sure every page is cached, then run again: nothing to read.
  RunLoader(*ds, o);
  StorageStats stats;
  RunLoader(*ds, o, &stats);
  EXPECT_EQ(stats.bytes_read, 0);
  EXPECT_EQ(stats.records_buffered, 0);
  EXPECT_EQ(stats.records_mapped, 2 * 40);
}

// Records a little over 2 KB each fill most of an LMDB overflow page, and the rest of the page
// is read anyway. Those tails were counted as gaps against the allowance of a quarter of the
// records' bytes: it ran out halfway through each segment and every later record was read on its
// own, even in sequential order on a contiguous file (2,019 reads for 4,000 such records).
TEST(Storage, PageTailsAreNotGapsSoContiguousRecordsAreReadTogether) {
  testing::TempDir dir;
  // Raw 28 x 27 x 3 pixels: 2,268 bytes plus the header, one overflow page each.
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 200, .raw = true, .width = 28, .height = 27}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.sampler.mode = dataset::ShuffleMode::kSequential;
  o.epochs = 1;
  o.storage = ReadEverything(50);
  StorageStats stats;
  const auto seen = RunLoader(*ds, o, &stats);
  ASSERT_EQ(seen.size(), static_cast<size_t>((200 + 5) / 6));
  EXPECT_EQ(stats.records_buffered, 200);
  // Four segments of 50 contiguous records: a read or two each, not one per record.
  EXPECT_LE(stats.read_calls, 8) << stats.bytes_read << " bytes";
}

TEST(Storage, EvictedRecordsAreReadAndCanBeDroppedFromThePageCache) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 120, .scale = 4}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.epochs = 1;
  o.storage.segment_positions = 8;
  for (auto cache : {StorageOptions::Cache::kKeep, StorageOptions::Cache::kDrop}) {
    Evict(*ds);
    if (ResidentFraction(*ds) > 0.2) GTEST_SKIP() << "this filesystem keeps the file cached (tmpfs?): " << ResidentFraction(*ds);
    o.storage.cache = cache;
    StorageStats stats;
    RunLoader(*ds, o, &stats);
    EXPECT_GT(stats.records_buffered, 100);
    EXPECT_GE(stats.bytes_read, ds->manifest().payload_bytes);
    const double resident = ResidentFraction(*ds);
    if (cache == StorageOptions::Cache::kKeep) {
      EXPECT_GT(resident, 0.5) << "ranges read stay cached for the next epoch";
    } else {
      EXPECT_LT(resident, 0.5) << "ranges read were dropped from the page cache; mapped " << stats.records_mapped << " buffered " << stats.records_buffered << " read " << stats.bytes_read << " file " << ds->map().size();
      EXPECT_TRUE(stats.drops_cache);
    }
  }
}

TEST(Storage, AWindowLargerThanTheBudgetIsRefused) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 40}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.sampler.mode = dataset::ShuffleMode::kBlock;
  o.sampler.block_size = 8;
  o.sampler.window_blocks = 4;
  o.storage.memory_bytes = 1000;
  auto loader = Loader::Create(*ds, o);
  ASSERT_FALSE(loader.ok());
  EXPECT_EQ(loader.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(loader.status().message().find("data.io.memory_mb"), std::string::npos) << loader.status().ToString();
  // The budget given, not 0 (1000 bytes in MB, rounded down).
  EXPECT_NE(loader.status().message().find("StorageOptions::memory_bytes) of 1.0 KB cannot hold"), std::string::npos)
      << loader.status().ToString();
}

// The default budget stays within half of the memory the process may use: three windows of a
// small machine's worth are cut to half of it, and a window larger than that half is refused by
// name (a large block x window got the process killed for memory instead).
TEST(Storage, TheDefaultBudgetFitsTheMachine) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 40}));
  ASSERT_OK(ds.status());
  uint64_t stored = 0;
  ASSERT_OK_AND_ASSIGN(auto extents, ds->RecordExtents());
  for (const auto& e : extents) stored += e.size;
  LoaderOptions o = SmallOptions(2);
  o.sampler.mode = dataset::ShuffleMode::kBlock;
  o.sampler.block_size = 8;
  o.sampler.window_blocks = 5;  // the whole dataset: one window of about `stored` bytes
  o.storage.physical_memory_bytes = 4 * stored;  // half of it holds one window, not three
  StorageStats stats;
  const auto seen = RunLoader(*ds, o, &stats);
  EXPECT_EQ(seen.size(), 14u);  // 7 batches of 6 (the last padded) in each of 2 epochs
  EXPECT_EQ(stats.budget_bytes, static_cast<int64_t>(2 * stored));
  o.storage.physical_memory_bytes = stored;  // half of it holds no window
  auto loader = Loader::Create(*ds, o);
  ASSERT_FALSE(loader.ok());
  EXPECT_NE(loader.status().message().find("does not fit in half of the"), std::string::npos)
      << loader.status().ToString();
}

// A budget asked for beyond what the process may ever use is refused by name (read ahead up to it,
// the process was killed for memory); one over half of it, and one below the smallest segment
// (read over the budget all the same), are said.
TEST(Storage, ABudgetTheProcessCannotHoldIsRefusedAndAnOddOneSaid) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 200}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.storage = ReadEverything(0);  // the stage's own segments
  o.storage.physical_memory_bytes = int64_t{1} << 30;
  o.storage.memory_bytes = int64_t{2} << 30;
  auto refused = Loader::Create(*ds, o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("of 2048 MB is more than the 1024 MB this process may use"),
            std::string::npos)
      << refused.status().ToString();

  auto warned_with = [&](int64_t budget) {
    o.storage.memory_bytes = budget;
    ::testing::internal::CaptureStderr();
    StorageStats stats;
    const auto seen = RunLoader(*ds, o, &stats);
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(seen.size(), 68u);  // 2 epochs of ceil(200 / 6) batches, whatever the budget
    return err;
  };
  EXPECT_NE(warned_with(int64_t{600} << 20).find("of 600 MB is more than half of the 1024 MB"), std::string::npos);
  const std::string tiny = warned_with(1000);
  EXPECT_NE(tiny.find("of 1.0 KB holds less than one segment of 64 records"), std::string::npos) << tiny;
  EXPECT_EQ(warned_with(int64_t{100} << 20).find("read-ahead budget"), std::string::npos);
}

TEST(Storage, StopsCleanlyWithReadsInFlight) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 40}));
  ASSERT_OK(ds.status());
  std::mt19937 rng(9);
  for (int round = 0; round < 200; ++round) {
    LoaderOptions o = SmallOptions(1 + static_cast<int>(rng() % 3));
    o.epochs = 0;
    o.sampler.mode = rng() % 2 ? dataset::ShuffleMode::kFull : dataset::ShuffleMode::kBlock;
    o.sampler.block_size = 3;
    o.sampler.window_blocks = 2;
    o.storage = ReadEverything(1 + static_cast<int64_t>(rng() % 9));
    o.storage.memory_bytes = static_cast<int64_t>(rng() % 3) * 200000;
    auto loader = Loader::Create(*ds, o);
    ASSERT_OK(loader.status());
    const int take = static_cast<int>(rng() % 5);
    for (int i = 0; i < take; ++i) {
      auto lease = (*loader)->Next();
      ASSERT_OK(lease.status());
    }
    if (rng() % 2) {
      std::thread stopper([&] { (*loader)->Stop(); });
      for (;;) {
        auto lease = (*loader)->Next();
        ASSERT_OK(lease.status());
        if (!*lease) break;
      }
      stopper.join();
    }
    loader->reset();
  }
}

}  // namespace
}  // namespace stoke::prefetch
