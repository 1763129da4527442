// Tests for prefetch/: the loader's batches are deterministic (any thread count, any ring size,
// resumed or not), follow the sampler, replace bad records by policy, stay within the ring, and
// the loader stops cleanly wherever the consumer leaves it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <fstream>
#include <random>
#include <set>
#include <map>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <oneapi/tbb/global_control.h>

#include "augment/transform.h"
#include "dataset/dataset.h"
#include "dataset/writer.h"
#include "decode/jpeg_decoder.h"
#include "prefetch/batch_memory.h"
#include "prefetch/device_batch.h"
#include "prefetch/loader.h"
#include "tests/prefetch/loader_test_util.h"
#include "tests/testing/test_util.h"
#include "tools/inspect/inspect.h"

#if STOKE_WITH_CUDA
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

namespace stoke::prefetch {
namespace {


std::vector<Seen> RunAll(const dataset::Dataset& ds, const LoaderOptions& o) {
  auto loader = Loader::Create(ds, o);
  EXPECT_TRUE(loader.ok()) << loader.status().ToString();
  if (!loader.ok()) return {};
  return Drain(**loader);
}

// The DCT scale is chosen again after snapping: these regions allowed 1/4 before it, and snapping
// to 1/4 left 223 decoded pixels for an output of 224 (an upscale).
TEST(Loader, SnappedRegionsStillCoverTheOutput) {
  struct Case {
    int width, height;
    augment::RectF region;
  };
  for (const Case& c : {Case{1197, 898, {36, 2, 1117, 896}}, Case{1799, 2398, {6, 213, 1793, 2059}}}) {
    augment::CropPlan plan{.region = c.region, .out_width = 224, .out_height = 224};
    const int d = SnapToBestScale(plan, c.width, c.height, 224, 224);
    EXPECT_GE(plan.region.width / d, 224) << c.width << "x" << c.height << " at 1/" << d;
    EXPECT_GE(plan.region.height / d, 224) << c.width << "x" << c.height << " at 1/" << d;
    EXPECT_GE(d, 2) << "a scale below the first choice, not the full size";
  }
  // Sweep: every snapped plan covers its output at the scale returned.
  SplitMix64 rng(5);
  augment::RandomResizedCropOptions o;
  o.size = 224;
  for (int i = 0; i < 20000; ++i) {
    const int w = 224 + static_cast<int>(rng.Below(2200)), h = 224 + static_cast<int>(rng.Below(2200));
    augment::CropPlan plan = augment::PlanRandomResizedCrop(w, h, o, rng);
    const augment::RectF wanted = plan.region;
    const int d = SnapToBestScale(plan, w, h, 224, 224);
    if (wanted.width >= 224 && wanted.height >= 224) {
      ASSERT_GE(plan.region.width / d, 224) << w << "x" << h;
      ASSERT_GE(plan.region.height / d, 224) << w << "x" << h;
    }
  }
}

TEST(Loader, BatchesAreBitIdenticalForAnyThreadCountAndRing) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {}));
  ASSERT_OK(ds.status());
  const auto one = RunAll(*ds, SmallOptions(1));
  ASSERT_EQ(one.size(), 14u);  // 40 samples in batches of 6: 7 per epoch, the last one short
  for (int threads : {2, 4}) {
    for (int ring : {2, 5}) {
      LoaderOptions o = SmallOptions(threads);
      o.ring_size = ring;
      EXPECT_EQ(RunAll(*ds, o), one) << threads << " threads, ring " << ring;
    }
  }
}

// A loader holds its own share of the dataset: made from a temporary (`*Dataset::Open(...)`), or
// from a Dataset moved away and destroyed while it runs, it reads the same batches (both read
// freed memory, and crashed in the workers' first read transaction). With the storage stage too.
TEST(Loader, HoldsItsOwnShareOfTheDatasetItWasMadeFrom) {
  testing::TempDir dir;
  const auto path = WriteDataset(dir.path() / "d", {});
  auto ds = dataset::Dataset::Open(path);
  ASSERT_OK(ds.status());
  for (const bool storage : {false, true}) {
    SCOPED_TRACE(storage ? "with the storage stage" : "reading the map");
    LoaderOptions o = SmallOptions(2);
    o.storage.enabled = storage;
    const auto want = RunAll(*ds, o);
    auto from_temporary = Loader::Create(*dataset::Dataset::Open(path), o);
    ASSERT_OK(from_temporary.status());
    EXPECT_EQ(Drain(**from_temporary), want);
    auto moved = dataset::Dataset::Open(path);
    ASSERT_OK(moved.status());
    auto loader = Loader::Create(*moved, o);
    ASSERT_OK(loader.status());
    { dataset::Dataset gone = std::move(*moved); }
    EXPECT_EQ(Drain(**loader), want);
  }
  // A Reader, too, outlives the Dataset it came from.
  std::optional<dataset::Reader> reader;
  {
    auto opened = dataset::Dataset::Open(path);
    ASSERT_OK(opened.status());
    auto r = opened->NewReader();
    ASSERT_OK(r.status());
    reader.emplace(std::move(*r));
  }
  auto record = reader->Get(3);
  ASSERT_OK(record.status());
  EXPECT_EQ(record->header.label, (*ds).NewReader()->Get(3)->header.label);
}

// Each loader asking for more threads than cores once set its own TBB limit, and TBB applies the
// smallest of those: a loader of cores + 1 threads held a live one of cores + 3 to cores + 1 (and
// TBB warned on stderr). The limit in force is the largest any live loader asked for.
TEST(Loader, LoadersAskingForMoreThreadsThanCoresDoNotCapEachOther) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {}));
  ASSERT_OK(ds.status());
  const auto limit = [] { return tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism); };
  const size_t cores = limit();
  const int more = static_cast<int>(cores);
  auto big = Loader::Create(*ds, SmallOptions(more + 3));
  ASSERT_OK(big.status());
  EXPECT_EQ(limit(), cores + 3);
  {
    auto small = Loader::Create(*ds, SmallOptions(more + 1));
    ASSERT_OK(small.status());
    EXPECT_EQ(limit(), cores + 3);
    Drain(**small, 2);
    EXPECT_EQ(limit(), cores + 3);
    big->reset();
    EXPECT_EQ(limit(), cores + 1);  // the one left
  }
  EXPECT_EQ(limit(), cores);  // none left: TBB's own
}

TEST(Loader, FollowsTheSamplerAndCarriesLabels) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  auto sampler = dataset::Sampler::Create(ds->size(), o.sampler);
  ASSERT_OK(sampler.status());
  const auto seen = RunAll(*ds, o);
  ASSERT_EQ(seen.size(), 14u);
  for (int64_t e = 0; e < 2; ++e) {
    const auto order = sampler->Epoch(e);
    std::vector<int64_t> got;
    for (const auto& b : seen) {
      if (b.epoch != e) continue;
      EXPECT_EQ(b.number, static_cast<int64_t>(got.size()) / 6);
      for (size_t s = 0; s < b.indices.size(); ++s) EXPECT_EQ(b.labels[s], b.indices[s] % 4);
      EXPECT_EQ(b.images.size(), b.indices.size() * 32 * 32 * 3);
      got.insert(got.end(), b.indices.begin(), b.indices.end());
    }
    EXPECT_EQ(got, order) << "epoch " << e;
  }
  EXPECT_NE(seen[0].indices, seen[7].indices);  // a fresh shuffle each epoch
  // drop_last_batch keeps only full batches.
  o.drop_last_batch = true;
  const auto full = RunAll(*ds, o);
  ASSERT_EQ(full.size(), 12u);
  for (const auto& b : full) EXPECT_EQ(b.indices.size(), 6u);
}

TEST(Loader, SamplesDependOnlyOnSeedEpochAndRecord) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {}));
  ASSERT_OK(ds.status());
  // Different batch sizes put a record in different slots; its pixels stay the same.
  auto by_record = [&](int batch) {
    LoaderOptions o = SmallOptions(2);
    o.batch_size = batch;
    o.epochs = 1;
    std::map<int64_t, std::vector<uint8_t>> m;
    for (const auto& b : RunAll(*ds, o)) {
      for (size_t s = 0; s < b.indices.size(); ++s) {
        m[b.indices[s]].assign(b.images.begin() + static_cast<ptrdiff_t>(s * 3072),
                               b.images.begin() + static_cast<ptrdiff_t>((s + 1) * 3072));
      }
    }
    return m;
  };
  const auto a = by_record(6), b = by_record(16);
  ASSERT_EQ(a.size(), 40u);
  EXPECT_EQ(a, b);
}

TEST(Loader, ResumeFromABatchGivesTheSameBatches) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.epochs = 3;
  const auto whole = RunAll(*ds, o);
  ASSERT_EQ(whole.size(), 21u);
  for (int64_t start : {1, 7, 10, 20}) {
    LoaderOptions r = o;
    r.start_epoch = start / 7;
    r.start_batch = start % 7;
    r.epochs = 3 - r.start_epoch;
    const auto resumed = RunAll(*ds, r);
    EXPECT_EQ(resumed, std::vector<Seen>(whole.begin() + start, whole.end())) << "from batch " << start;
  }
}

TEST(Loader, SkipPolicyReplacesBadRecordsDeterministicallyAndCounts) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.bad = {3, 4, 21}}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(1);
  o.max_skip_fraction = 0.1;  // 4 of 40
  auto loader = Loader::Create(*ds, o);
  ASSERT_OK(loader.status());
  const auto one = Drain(**loader);
  ASSERT_EQ(one.size(), 14u);
  int replaced = 0;
  std::map<std::pair<int64_t, int64_t>, int> seen;  // (epoch, record) -> samples made of it
  for (const auto& b : one) {
    replaced += b.replaced;
    // The stand-ins are flagged: leaving them out leaves each good record once an epoch.
    ASSERT_EQ(b.stand_in.size(), b.indices.size());
    EXPECT_EQ(std::count(b.stand_in.begin(), b.stand_in.end(), 1), b.replaced);
    for (size_t i = 0; i < b.indices.size(); ++i) {
      if (b.stand_in[i] == 0) seen[{b.epoch, b.indices[i]}]++;
    }
    for (int64_t i : b.indices) EXPECT_TRUE(i != 3 && i != 4 && i != 21) << "bad record " << i << " served";
    EXPECT_EQ(b.indices.size(), b.epoch == 0 && b.number == 6 ? 4u : b.indices.size());
  }
  EXPECT_EQ(replaced, 6);  // three bad records in each of two epochs
  EXPECT_EQ(seen.size(), 2u * 37u);  // the 37 good records of each epoch
  for (const auto& [key, n] : seen) EXPECT_EQ(n, 1) << "record " << key.second << " of epoch " << key.first;
  const auto bad = (*loader)->bad_records();
  ASSERT_EQ(bad.size(), 3u);  // each named once
  EXPECT_EQ(bad[0].index, 3);
  EXPECT_NE(bad[0].reason.find("class/3.jpg"), std::string::npos) << bad[0].reason;
  EXPECT_NE(bad[0].reason.find("record 3"), std::string::npos) << bad[0].reason;
  EXPECT_EQ((*loader)->stats().bad_records, 3);
  LoaderOptions four = o;
  four.threads = 4;
  EXPECT_EQ(RunAll(*ds, four), one);
}

// The elastic guarantee with bad records: a stand-in comes from the global order, so rank r's
// batch k is its slice of the one-rank global batch k, stand-ins included, at any world size.
TEST(Loader, StandInsAreTheSameAtAnyWorldSize) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.bad = {2, 3, 9, 17, 30}}));
  ASSERT_OK(ds.status());
  constexpr int kGlobal = 12;
  LoaderOptions one = SmallOptions(2);
  one.max_skip_fraction = 0.2;
  one.sampler.sharding = dataset::Sharding::kGlobalBatch;
  one.sampler.global_batch = kGlobal;
  one.batch_size = kGlobal;
  const auto reference = RunAll(*ds, one);
  ASSERT_FALSE(reference.empty());
  const size_t sample_bytes = reference[0].images.size() / reference[0].indices.size();
  int stand_ins = 0;
  for (const auto& b : reference) stand_ins += b.replaced;
  ASSERT_GT(stand_ins, 0);
  for (int world : {2, 3, 4}) {
    SCOPED_TRACE(::testing::Message() << "world " << world);
    std::vector<std::vector<Seen>> ranks;
    for (int r = 0; r < world; ++r) {
      LoaderOptions o = one;
      o.sampler.rank = r;
      o.sampler.world_size = world;
      o.batch_size = kGlobal / world;
      o.skip_budget_samples = 40;  // the global epoch's, as the trainer passes
      ranks.push_back(RunAll(*ds, o));
      ASSERT_EQ(ranks.back().size(), reference.size());
    }
    for (size_t k = 0; k < reference.size(); ++k) {
      Seen joined{reference[k].epoch, reference[k].number, {}, {}, {}, 0, {}};
      for (const auto& mine : ranks) {
        const Seen& b = mine[k];
        joined.images.insert(joined.images.end(), b.images.begin(), b.images.end());
        joined.labels.insert(joined.labels.end(), b.labels.begin(), b.labels.end());
        joined.indices.insert(joined.indices.end(), b.indices.begin(), b.indices.end());
        joined.stand_in.insert(joined.stand_in.end(), b.stand_in.begin(), b.stand_in.end());
        joined.replaced += b.replaced;
      }
      // An epoch's last global batch is short (40 = 3 x 12 + 4) and three ranks pad it to 6 with
      // the epoch's first samples: what one rank made is then the first 4 of them.
      const Seen& want = reference[k];
      const size_t n = want.indices.size();
      ASSERT_GE(joined.indices.size(), n) << "batch " << k;
      if (joined.indices.size() > n) {
        joined.images.resize(n * sample_bytes);
        joined.labels.resize(n);
        joined.indices.resize(n);
        joined.stand_in.resize(n);
        joined.replaced = static_cast<int>(std::count(joined.stand_in.begin(), joined.stand_in.end(), 1));
      }
      EXPECT_EQ(joined, want) << "batch " << k;
    }
  }
}

TEST(Loader, FailPolicyStopsAtTheBadRecordAfterTheBatchesBeforeIt) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.bad = {5}}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(3);
  o.sampler.mode = dataset::ShuffleMode::kSequential;
  o.on_error = ErrorPolicy::kFail;
  o.batch_size = 2;  // record 5 is in batch 2
  auto loader = Loader::Create(*ds, o);
  ASSERT_OK(loader.status());
  for (int b = 0; b < 2; ++b) {
    auto lease = (*loader)->Next();
    ASSERT_OK(lease.status());
    ASSERT_TRUE(*lease);
    EXPECT_EQ((*lease)->number, b);
  }
  auto failed = (*loader)->Next();
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(failed.status().message().find("record 5 (class/5.jpg)"), std::string::npos)
      << failed.status().ToString();
  auto after = (*loader)->Next();  // the run is over
  ASSERT_OK(after.status());
  EXPECT_FALSE(*after);
}

// Takes every batch of a run: how many came, and the run's error (OK when it simply ended). Drain()
// (loader_test_util.h) keeps the batches and expects no error.
std::pair<int, Status> RunToEnd(Loader& loader) {
  int batches = 0;
  for (;;) {
    auto lease = loader.Next();
    if (!lease.ok()) return {batches, lease.status()};
    if (!*lease) return {batches, OkStatus()};
    ++batches;
  }
}

TEST(Loader, TooManyBadRecordsEndTheRun) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.bad = {1, 2, 3, 30}}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.max_skip_fraction = 0.05;  // 2 of 40
  auto loader = Loader::Create(*ds, o);
  ASSERT_OK(loader.status());
  const Status end = RunToEnd(**loader).second;
  EXPECT_EQ(end.code(), StatusCode::kCorrupt);
  EXPECT_NE(end.message().find("max_skip_fraction"), std::string::npos) << end.ToString();
}

// Where a run over its skip budget stops follows the sampler's order, not which thread met which
// bad record first: records 15 and 16 are the last of batch 1 and the first of batch 2; one is
// allowed, so batches 0 and 1 come out and the error names record 16, at any thread count.
TEST(Loader, TheSkipBudgetEndsTheRunAtTheSameBatchWhateverTheThreads) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.bad = {15, 16}}));
  ASSERT_OK(ds.status());
  for (int threads : {1, 4}) {
    for (int run = 0; run < (threads == 1 ? 2 : 40); ++run) {  // the old count went wrong in 1 run of 10
      SCOPED_TRACE(fmt::format("{} threads, run {}", threads, run));
      LoaderOptions o = SmallOptions(threads);
      o.sampler.mode = dataset::ShuffleMode::kSequential;
      o.batch_size = 8;
      o.epochs = 1;
      o.max_skip_fraction = 0.025;  // 1 of 40
      auto loader = Loader::Create(*ds, o);
      ASSERT_OK(loader.status());
      const auto [batches, end] = RunToEnd(**loader);
      EXPECT_EQ(batches, 2);
      EXPECT_EQ(end.code(), StatusCode::kCorrupt) << end.ToString();
      EXPECT_NE(end.message().find("latest: record 16 "), std::string::npos) << end.ToString();
    }
  }
}

// A resumed run holds the bad records its earlier part met against the budget, as one uninterrupted
// run does: record 15 (batch 1) was met before the resume at batch 2, so record 16 is one too many.
TEST(Loader, AResumedRunCountsTheBadRecordsMetBeforeIt) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.bad = {15, 16}}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.sampler.mode = dataset::ShuffleMode::kSequential;
  o.batch_size = 8;
  o.max_skip_fraction = 0.025;  // 1 of 40
  o.epochs = 1;
  o.start_batch = 2;
  {
    auto fresh = Loader::Create(*ds, o);
    ASSERT_OK(fresh.status());
    const Status end = RunToEnd(**fresh).second;
    EXPECT_TRUE(end.ok()) << "without the earlier part, one bad record is within the budget: " << end.ToString();
  }
  o.known_bad = {{15, "record 15: met before the resume"}};
  auto resumed = Loader::Create(*ds, o);
  ASSERT_OK(resumed.status());
  const auto [batches, end] = RunToEnd(**resumed);
  EXPECT_EQ(batches, 0);
  EXPECT_EQ(end.code(), StatusCode::kCorrupt) << end.ToString();
  EXPECT_NE(end.message().find("2 bad records"), std::string::npos) << end.ToString();
  EXPECT_NE(end.message().find("latest: record 16 "), std::string::npos) << end.ToString();
  std::vector<int64_t> listed;
  for (const auto& b : (*resumed)->bad_records()) listed.push_back(b.index);
  EXPECT_EQ(listed, (std::vector<int64_t>{15, 16}));  // 16 ended the run, and is said with its error

  // Already over the budget: the run ends at the first bad record it meets (16, in batch 2)...
  o.known_bad = {{15, "a"}, {16, "b"}};
  {
    auto over = Loader::Create(*ds, o);
    ASSERT_OK(over.status());
    const auto [none, over_end] = RunToEnd(**over);
    EXPECT_EQ(none, 0);
    EXPECT_NE(over_end.message().find("latest: record 16 "), std::string::npos) << over_end.ToString();
  }
  // ... and goes on where the records were repaired since (the same records, none bad now), or
  // are no longer records of the dataset (it was re-packed smaller).
  testing::TempDir clean_dir;
  auto clean = dataset::Dataset::Open(WriteDataset(clean_dir.path() / "d", {}));
  ASSERT_OK(clean.status());
  for (const std::vector<BadRecord>& known : {std::vector<BadRecord>{{15, "a"}, {16, "b"}},
                                              std::vector<BadRecord>{{40, "c"}, {41, "d"}}}) {
    o.known_bad = known;
    auto repaired = Loader::Create(*clean, o);
    ASSERT_OK(repaired.status());
    const auto [made, repaired_end] = RunToEnd(**repaired);
    EXPECT_EQ(made, 3);
    EXPECT_TRUE(repaired_end.ok()) << repaired_end.ToString();
  }
}

// bad_records() (what a resumed run passes back as known_bad) holds what the batches handed out
// met. The loader makes up to ring_size batches ahead; when their bad records were reported too,
// a run stopped after batch 1 and resumed counted record 19 (batch 2) before reaching it, and
// ended at batch 2 where the uninterrupted run made batch 2 and ended at batch 3.
TEST(Loader, BadRecordsOfBatchesNotYetHandedOutAreNotReported) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.bad = {19, 28}}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.sampler.mode = dataset::ShuffleMode::kSequential;
  o.batch_size = 8;
  o.ring_size = 4;
  o.max_skip_fraction = 0.025;  // 1 of 40
  o.epochs = 1;
  {
    auto whole = Loader::Create(*ds, o);
    ASSERT_OK(whole.status());
    const auto [batches, end] = RunToEnd(**whole);
    EXPECT_EQ(batches, 3);
    EXPECT_NE(end.message().find("latest: record 28 "), std::string::npos) << end.ToString();
  }
  std::vector<BadRecord> state;
  {
    auto first = Loader::Create(*ds, o);
    ASSERT_OK(first.status());
    for (int i = 0; i < 2; ++i) {
      auto lease = (*first)->Next();
      ASSERT_OK(lease.status());
      ASSERT_TRUE(*lease);
    }
    // Batches 2 and 3 (records 19 and 28) are made ahead meanwhile, and the budget's end queued.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    state = (*first)->bad_records();
    EXPECT_TRUE(state.empty()) << state.front().index;
    EXPECT_EQ((*first)->stats().bad_records, 0);
    auto third = (*first)->Next();
    ASSERT_OK(third.status());
    ASSERT_TRUE(*third);
    ASSERT_EQ((*first)->bad_records().size(), 1u);
    EXPECT_EQ((*first)->bad_records()[0].index, 19);
    EXPECT_EQ((*first)->stats().bad_records, 1);
  }
  o.start_batch = 2;
  o.known_bad = state;
  auto resumed = Loader::Create(*ds, o);
  ASSERT_OK(resumed.status());
  const auto [batches, end] = RunToEnd(**resumed);
  EXPECT_EQ(batches, 1) << "the resumed run makes batch 2, as the uninterrupted one did";
  EXPECT_NE(end.message().find("latest: record 28 "), std::string::npos) << end.ToString();
}

// A bad record met only on a stand-in walk may be another rank's sample: it is listed, marked not
// own, and a resumed run that knows it does not count it against its own budget (it counted every
// known record, so a rank resumed after a break failed where the uninterrupted run went on).
TEST(Loader, ABadRecordOfAnotherRanksShardIsListedButNotCounted) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.bad = {3, 4}}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.sampler.mode = dataset::ShuffleMode::kSequential;
  o.sampler.world_size = 2;
  o.sampler.rank = 1;  // global batches of 4: rank 1 takes records 2, 3, rank 0 records 0, 1, 4, 5, ...
  o.sampler.sharding = dataset::Sharding::kGlobalBatch;
  o.sampler.global_batch = 4;
  o.batch_size = 2;
  o.max_skip_fraction = 0.05;  // one of rank 1's 20 samples
  o.epochs = 2;
  std::vector<BadRecord> met;
  {
    auto whole = Loader::Create(*ds, o);
    ASSERT_OK(whole.status());
    const Status end = RunToEnd(**whole).second;
    ASSERT_TRUE(end.ok()) << end.ToString();
    met = (*whole)->bad_records();
  }
  ASSERT_EQ(met.size(), 2u);
  EXPECT_EQ(met[0].index, 3);
  EXPECT_TRUE(met[0].own);
  EXPECT_EQ(met[1].index, 4);  // record 3's stand-in walk went past it: rank 0's sample
  EXPECT_FALSE(met[1].own);
  o.start_epoch = 1;
  o.epochs = 1;
  o.known_bad = met;
  auto resumed = Loader::Create(*ds, o);
  ASSERT_OK(resumed.status());
  const Status end = RunToEnd(**resumed).second;
  EXPECT_TRUE(end.ok()) << end.ToString();
  EXPECT_EQ((*resumed)->stats().bad_records, 1);
}

// The batches of a resumed run that knows the earlier part's bad records are those of the
// uninterrupted run: a known bad record is still replaced by the same stand-in.
TEST(Loader, KnownBadRecordsLeaveTheBatchesAsTheUninterruptedRunMadeThem) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.bad = {3, 4, 21}}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.max_skip_fraction = 0.1;
  o.epochs = 3;
  const auto whole = RunAll(*ds, o);
  ASSERT_EQ(whole.size(), 21u);
  LoaderOptions r = o;
  r.start_epoch = 1;
  r.start_batch = 3;
  r.epochs = 2;
  r.known_bad = {{3, "r3"}, {4, "r4"}, {21, "r21"}};
  EXPECT_EQ(RunAll(*ds, r), std::vector<Seen>(whole.begin() + 10, whole.end()));
}

// Stop() ends the run for the consumer at once: batches already made are not handed out.
TEST(Loader, NextAfterStopIsEmptyThoughBatchesAreReady) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {}));
  ASSERT_OK(ds.status());
  auto loader = Loader::Create(*ds, SmallOptions(2));
  ASSERT_OK(loader.status());
  ASSERT_TRUE((*loader)->WaitReady(std::chrono::seconds(30)));
  (*loader)->Stop();
  auto lease = (*loader)->Next();
  ASSERT_OK(lease.status());
  EXPECT_FALSE(*lease);
}

TEST(Loader, RawRecordsAreCroppedWithoutDecoding) {
  testing::TempDir dir;
  auto raw = dataset::Dataset::Open(WriteDataset(dir.path() / "raw", {.records = 12, .raw = true}));
  ASSERT_OK(raw.status());
  LoaderOptions o = SmallOptions(2);
  o.augment.mode = CropMode::kCenter;
  o.augment.resize = 40;
  o.augment.crop = 32;
  o.sampler.mode = dataset::ShuffleMode::kSequential;
  o.epochs = 1;
  const auto seen = RunAll(*raw, o);
  ASSERT_EQ(seen.size(), 2u);
  // Record 0's sample is its centre-crop plan applied to its pixels.
  Image img = testing::MakeImage(60, 50, 3, 0);
  augment::CropPlan plan = augment::PlanCenterCrop(60, 50, 40, 32);
  std::vector<uint8_t> expect(32 * 32 * 3);
  ASSERT_OK(augment::ApplyPlan({img.pixels.data(), 60, 50, 3, 180}, plan.region, plan, expect));
  EXPECT_EQ(std::vector<uint8_t>(seen[0].images.begin(), seen[0].images.begin() + 3072), expect);
}

TEST(Loader, MemoryInFlightIsBoundedByTheRing) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.ring_size = 3;
  auto loader = Loader::Create(*ds, o);
  ASSERT_OK(loader.status());
  std::vector<BatchLease> held;
  for (int i = 0; i < 3; ++i) {
    auto lease = (*loader)->Next();
    ASSERT_OK(lease.status());
    held.push_back(std::move(*lease));
  }
  // Every buffer is with the consumer: nothing more can be produced, and asking says so at once
  // instead of waiting forever.
  auto stuck = (*loader)->Next();
  ASSERT_FALSE(stuck.ok());
  EXPECT_EQ(stuck.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(stuck.status().message().find("all 3 ring buffers"), std::string::npos);
  EXPECT_EQ((*loader)->stats().batches, 3);
  // With one back, the next batch is produced into it.
  held.front().Release();
  auto next = (*loader)->Next();
  ASSERT_OK(next.status());
  ASSERT_TRUE(*next);
  EXPECT_EQ((*next)->number, 3);
  // While the consumer holds two, at most one batch can wait in the ready queue.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  held.clear();
  EXPECT_LE((*loader)->stats().ready_depth_max, 3);
}

TEST(Loader, StopsCleanlyWhereverTheConsumerLeaves) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.bad = {7}}));
  ASSERT_OK(ds.status());
  // 1,000 stops at random places (any thread count and ring size, after 0-5 batches, some from
  // another thread while the consumer waits, some leases outliving the loader): a hang fails
  // the test's timeout, a leak fails it under ASan (LeakSanitizer), a race under TSan.
  std::mt19937 rng(5);
  for (int round = 0; round < 1000; ++round) {
    LoaderOptions o = SmallOptions(1 + static_cast<int>(rng() % 4));
    o.ring_size = 2 + static_cast<int>(rng() % 3);
    o.epochs = 0;  // endless: only the consumer ends it
    o.max_skip_fraction = 0.1;
    auto loader = Loader::Create(*ds, o);
    ASSERT_OK(loader.status());
    const int take = static_cast<int>(rng() % 6);
    std::vector<BatchLease> kept;
    for (int i = 0; i < take; ++i) {
      auto lease = (*loader)->Next();
      if (static_cast<int>(kept.size()) == o.ring_size) {
        EXPECT_EQ(lease.status().code(), StatusCode::kInvalidArgument);  // all buffers held
        break;
      }
      ASSERT_OK(lease.status());
      if (rng() % 2) kept.push_back(std::move(*lease));  // some outlive the loader
    }
    if (rng() % 3 == 0) {  // a stop from another thread while the consumer may be waiting
      kept.clear();
      std::thread stopper([&] { (*loader)->Stop(); });
      while (true) {
        auto lease = (*loader)->Next();
        ASSERT_OK(lease.status());
        if (!*lease) break;
      }
      stopper.join();
    }
    loader->reset();
    for (auto& lease : kept) EXPECT_EQ(lease->images.size(), lease->indices.size() * 3072);
  }
}

TEST(LoaderCorpus, EveryFileOfTheBadSetIsSkippedWithAReasonOrDecoded) {
  // Each file of ../shared/data/bad stored as a JPEG record with a valid CRC (as a packer that
  // did not validate would have written it), between good records. The loader must skip each
  // with a reason naming it, or decode it (a crop that does not reach a damaged part is fine):
  // never crash (the ASan+UBSan build runs this too), never hang.
  STOKE_REQUIRE_SHARED_DATA(data);
  testing::TempDir dir;
  const auto files = testing::FilesUnder(data / "bad");
  ASSERT_GT(files.size(), 100u);
  auto writer = dataset::DatasetWriter::Create(dir / "d", {});
  ASSERT_OK(writer.status());
  dataset::Manifest m;
  m.format_version = dataset::kFormatVersion;
  m.classes = {"good", "bad"};
  m.class_counts = {0, 0};
  decode::JpegDecoder probe;
  std::set<int64_t> bad_indices;
  int64_t index = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    const Image img = testing::MakeImage(40 + static_cast<int>(i % 50), 40, 3, static_cast<uint32_t>(i));
    RecordHeader good;
    good.label = 0;
    good.width = static_cast<uint32_t>(img.width);
    good.height = static_cast<uint32_t>(img.height);
    good.channels = 3;
    auto jpeg = testing::EncodeJpeg(img);
    m.payload_bytes += static_cast<int64_t>(jpeg.size());
    writer->Append(good, std::move(jpeg), fmt::format("good/{}.jpg", i));
    m.class_counts[0]++;
    ++index;

    auto bytes = testing::ReadBytes(files[i]);
    RecordHeader bad;
    bad.label = 1;
    bad.width = bad.height = 1;
    bad.channels = 3;
    if (auto info = probe.ReadHeader(bytes); info.ok()) {
      bad.width = static_cast<uint32_t>(info->width);
      bad.height = static_cast<uint32_t>(info->height);
    }
    m.payload_bytes += static_cast<int64_t>(bytes.size());
    writer->Append(bad, std::move(bytes), fs::relative(files[i], data).string());
    m.class_counts[1]++;
    bad_indices.insert(index++);
  }
  m.records = index;
  m.has_paths = true;
  ASSERT_OK(writer->Finish(m));
  ASSERT_OK_AND_ASSIGN(auto ds, dataset::Dataset::Open(dir / "d"));

  LoaderOptions o = SmallOptions(2);
  o.sampler.mode = dataset::ShuffleMode::kSequential;
  o.epochs = 1;
  o.max_skip_fraction = 1.0;
  ASSERT_OK_AND_ASSIGN(auto loader, Loader::Create(ds, o));
  std::set<int64_t> delivered;
  while (true) {
    ASSERT_OK_AND_ASSIGN(auto lease, loader->Next());
    if (!lease) break;
    delivered.insert(lease->indices.begin(), lease->indices.end());
  }
  std::map<int64_t, std::string> skipped;
  for (const auto& b : loader->bad_records()) skipped[b.index] = b.reason;
  int decoded = 0;
  for (int64_t i : bad_indices) {
    if (skipped.count(i)) {
      const std::string& reason = skipped[i];
      EXPECT_NE(reason.find(fmt::format("record {}", i)), std::string::npos) << reason;
      EXPECT_NE(reason.find("bad/"), std::string::npos) << reason;  // the source path
      EXPECT_FALSE(delivered.count(i)) << i;
    } else {
      EXPECT_TRUE(delivered.count(i)) << "record " << i << " was neither skipped nor delivered";
      ++decoded;
    }
  }
  for (const auto& [i, reason] : skipped) EXPECT_TRUE(bad_indices.count(i)) << "good record " << i << ": " << reason;
  // stoke inspect --verify decodes every record in full, strictly: it names every bad file.
  ASSERT_OK_AND_ASSIGN(auto report, inspect::Inspect(dir / "d", {.verify = true, .progress = false}));
  std::set<int64_t> flagged;
  for (const auto& b : report.bad) flagged.insert(b.index);
  EXPECT_EQ(flagged, bad_indices);
  std::printf("%zu bad files: the loader skipped %zu with a reason and decoded %d (crop clear of the damage); "
              "inspect --verify flagged %zu\n",
              bad_indices.size(), skipped.size(), decoded, flagged.size());
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;  // shadow memory and quarantines make RSS meaningless
#else
constexpr bool kSanitized = false;
#endif

double ResidentMiB() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
}

TEST(LoaderSoak, ResidentMemoryStaysFlatOver300Epochs) {
  if (kSanitized) GTEST_SKIP() << "RSS is not meaningful under a sanitizer";
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 96, .bad = {5, 50}}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.batch_size = 8;
  o.epochs = 300;
  o.max_skip_fraction = 0.1;
  ASSERT_OK_AND_ASSIGN(auto loader, Loader::Create(*ds, o));
  std::vector<double> rss;  // sampled at the end of each epoch
  int64_t batches = 0;
  while (true) {
    ASSERT_OK_AND_ASSIGN(auto lease, loader->Next());
    if (!lease) break;
    ++batches;
    if (lease->number == loader->batches_per_epoch() - 1) rss.push_back(ResidentMiB());
  }
  ASSERT_EQ(rss.size(), 300u);
  EXPECT_EQ(batches, 300 * loader->batches_per_epoch());
  // After a warm-up of 10 epochs (allocator pools, TBB workers), the resident size stays within
  // 2% of its level.
  const double base = rss[10];
  double lo = base, hi = base;
  for (size_t e = 10; e < rss.size(); ++e) {
    lo = std::min(lo, rss[e]);
    hi = std::max(hi, rss[e]);
  }
  EXPECT_LE(hi - lo, 0.02 * base) << "RSS from " << lo << " to " << hi << " MiB over epochs 10-299";
  std::printf("RSS over epochs 10-299: %.2f to %.2f MiB (%.2f%% of %.2f)\n", lo, hi, 100 * (hi - lo) / base, base);
}

// WaitReady() (the interruptible wait of the Python binding): true once Next() would not block,
// for a batch, the end of the run, or a consumer that holds every slot.
TEST(Loader, WaitReadyReportsWhenNextWouldNotBlock) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(2);
  o.ring_size = 2;
  o.epochs = 1;
  ASSERT_OK_AND_ASSIGN(auto loader, Loader::Create(*ds, o));
  std::vector<BatchLease> held;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(loader->WaitReady(std::chrono::seconds(30)));
    ASSERT_OK_AND_ASSIGN(auto lease, loader->Next());
    ASSERT_TRUE(lease);
    held.push_back(std::move(lease));
  }
  // Every slot is with the consumer: ready at once, and Next() says why instead of blocking.
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(loader->WaitReady(std::chrono::seconds(30)));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  EXPECT_FALSE(loader->Next().ok());
  held.clear();
  int batches = 2;
  while (true) {
    ASSERT_TRUE(loader->WaitReady(std::chrono::seconds(30)));
    ASSERT_OK_AND_ASSIGN(auto lease, loader->Next());
    if (!lease) break;
    ++batches;
  }
  EXPECT_EQ(batches, 7);
  EXPECT_TRUE(loader->WaitReady(std::chrono::milliseconds(1)));  // the end stays ready
}

// WaitReady() is thread-safe: another thread may wait while the consumer takes batches (the
// consumer's end-of-run flag was a plain bool that both read; TSan runs this).
TEST(Loader, WaitReadyFromAnotherThreadWhileTheConsumerDrains) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {}));
  ASSERT_OK(ds.status());
  ASSERT_OK_AND_ASSIGN(auto loader, Loader::Create(*ds, SmallOptions(2)));
  std::atomic<bool> done{false};
  std::thread watcher([&] {
    while (!done.load()) loader->WaitReady(std::chrono::milliseconds(1));
  });
  const auto seen = Drain(*loader);
  done = true;
  watcher.join();
  EXPECT_EQ(seen.size(), 14u);
}

TEST(Loader, RejectsBadOptionsByName) {
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 4}));
  ASSERT_OK(ds.status());
  auto expect_error = [&](LoaderOptions o, const char* what) {
    auto loader = Loader::Create(*ds, o);
    ASSERT_FALSE(loader.ok()) << what;
    EXPECT_EQ(loader.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(loader.status().message().find(what), std::string::npos) << loader.status().ToString();
  };
  LoaderOptions o = SmallOptions(1);
  o.batch_size = 0;
  expect_error(o, "batch_size");
  o = SmallOptions(1);
  o.ring_size = 1;
  expect_error(o, "ring_size");
  o.ring_size = kMaxRingSize + 1;
  expect_error(o, "ring_size");
  o = SmallOptions(1);
  o.threads = kMaxThreads + 1;
  expect_error(o, "threads");
  // A ring larger than the machine is refused before anything is allocated (its byte count
  // once wrapped around 64 bits here, and the ring came out far too small).
  o = SmallOptions(1);
  o.batch_size = 1 << 24;
  o.augment.random.size = 1 << 20;
  expect_error(o, "machine's");
  o = SmallOptions(1);
  o.max_skip_fraction = 2;
  expect_error(o, "max_skip_fraction");
  o = SmallOptions(1);
  o.drop_last_batch = true;
  o.batch_size = 8;
  expect_error(o, "drop_last_batch");
  o = SmallOptions(1);
  o.start_batch = 5;
  expect_error(o, "start_batch");
  o.start_batch = -3;  // each field named with its value
  expect_error(o, "start_batch -3 (expected >= 0)");
  o = SmallOptions(1);
  o.storage.enabled = true;
  o.storage.io_threads = -2;
  expect_error(o, "storage io_threads -2 (expected >= 0)");
  o = SmallOptions(1);
  o.start_epoch = std::numeric_limits<int64_t>::max();
  o.epochs = 1;  // the sum would wrap around, and the run end before it began
  expect_error(o, "start_epoch");
  o = SmallOptions(1);
  o.augment.random.scale_min = 0;
  expect_error(o, "scale");
  EXPECT_EQ(ParseErrorPolicy("ignore").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseCropMode("random-resized").value(), CropMode::kRandomResized);
}

TEST(LoaderDevice, CudaWithoutAGpuIsAClearError) {
  const CudaProbe probe = ProbeCuda();
  if (probe.devices > 0) GTEST_SKIP() << "a GPU is present; LoaderDevice.BatchesArriveOnTheGpu covers it";
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {.records = 8}));
  ASSERT_OK(ds.status());
  LoaderOptions o = SmallOptions(1);
  o.device = DeviceMode::kCuda;
  auto loader = Loader::Create(*ds, o);
  ASSERT_FALSE(loader.ok());
  EXPECT_EQ(loader.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(loader.status().message().find("CUDA device 0"), std::string::npos) << loader.status().ToString();
  // kAuto falls back to host memory.
  o.device = DeviceMode::kAuto;
  auto host = Loader::Create(*ds, o);
  ASSERT_OK(host.status());
  EXPECT_FALSE((*host)->stats().pinned);
}

#if STOKE_WITH_CUDA
// Batches of SmallOptions(2) over `ds`, copied to GPU 0.
Result<std::unique_ptr<Loader>> DeviceLoader(const dataset::Dataset& ds) {
  LoaderOptions o = SmallOptions(2);
  o.device = DeviceMode::kCuda;
  return Loader::Create(ds, o);
}
#endif

TEST(LoaderDevice, BatchesArriveOnTheGpu) {
  const CudaProbe probe = ProbeCuda();
  if (probe.devices == 0) GTEST_SKIP() << "no GPU: " << probe.reason;
#if STOKE_WITH_CUDA
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {}));
  ASSERT_OK(ds.status());
  auto loader = DeviceLoader(*ds);
  ASSERT_OK(loader.status());
  EXPECT_TRUE((*loader)->stats().pinned);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const auto host_run = RunAll(*ds, SmallOptions(2));
  size_t k = 0;
  for (;;) {
    auto lease = (*loader)->Next();
    ASSERT_OK(lease.status());
    if (!*lease) break;
    const Batch& b = **lease;
    ASSERT_NE(b.device_images, nullptr);
    ASSERT_EQ(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(b.copied_event), 0), cudaSuccess);
    std::vector<uint8_t> images(b.images.size());
    std::vector<int32_t> labels(b.labels.size());
    ASSERT_EQ(cudaMemcpyAsync(images.data(), b.device_images, images.size(), cudaMemcpyDeviceToHost, stream), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(labels.data(), static_cast<const std::byte*>(b.device_images) + b.device_labels_offset,
                              labels.size() * 4, cudaMemcpyDeviceToHost, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ASSERT_LT(k, host_run.size());
    EXPECT_EQ(images, host_run[k].images);
    EXPECT_EQ(labels, host_run[k].labels);
    lease->Release(stream);
    ++k;
  }
  EXPECT_EQ(k, host_run.size());
  cudaStreamDestroy(stream);
#endif
}

TEST(LoaderDevice, DeviceWorkOnAHostBatchOrWithBadArgumentsIsRefusedWithoutAGpu) {
  Batch host;  // no device copy: nothing to wait for
  EXPECT_OK(WaitForCopy(host, nullptr));
  Status bad = NormalizeOnDevice(nullptr, 1, 1, 4, {0, 0, 0}, {1, 0, 1}, DeviceDType::kFloat32, nullptr, nullptr);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("std[1]"), std::string::npos) << bad.ToString();
  bad = NormalizeOnDevice(nullptr, 3, 2, 4, {0, 0, 0}, {1, 1, 1}, DeviceDType::kFloat32, nullptr, nullptr);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.ToString();
  bad = NormalizeOnDevice(nullptr, 1, 1, 4, {0, 0, 0}, {1, 1, 1}, DeviceDType::kFloat32, nullptr, nullptr, 5);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.ToString();
  EXPECT_NE(bad.message().find("expected 3, 4 or 8"), std::string::npos) << bad.ToString();
}

// The device normalisation (the CUDA trainer's first step, the Python package's device batches)
// against the host's augment::Normalize: float32 within rounding, float16 and bfloat16 within
// their precision, and the images past `valid` zero; in 3 channels a pixel, and in 4 and 8 (the
// channels past the image's zero).
TEST(LoaderDevice, NormalizeOnDeviceIsTheHostNormalize) {
  const CudaProbe probe = ProbeCuda();
  if (probe.devices == 0) GTEST_SKIP() << "no GPU: " << probe.reason;
#if STOKE_WITH_CUDA
  testing::TempDir dir;
  auto ds = dataset::Dataset::Open(WriteDataset(dir.path() / "d", {}));
  ASSERT_OK(ds.status());
  auto loader = DeviceLoader(*ds);
  ASSERT_OK(loader.status());
  auto lease = (*loader)->Next();
  ASSERT_OK(lease.status());
  ASSERT_TRUE(*lease);
  const Batch& b = **lease;
  augment::NormalizeOptions n;
  n.mean = {0.5f, 0.4f, 0.3f};
  n.std = {0.2f, 0.25f, 0.3f};
  n.layout = augment::Layout::kNHWC;
  std::vector<std::byte> want_bytes(augment::NormalizedBytes(b.size, b.width, b.height, augment::DType::kFloat32));
  ASSERT_OK(augment::Normalize(b.images, b.size, b.width, b.height, n, want_bytes));
  const auto* want = reinterpret_cast<const float*>(want_bytes.data());
  const int64_t pixels = int64_t{b.width} * b.height, image_pixels = b.size * pixels;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_OK(WaitForCopy(b, stream));
  void* out = nullptr;
  ASSERT_EQ(cudaMalloc(&out, (image_pixels + pixels) * 8 * 4), cudaSuccess);
  for (const int channels : {3, 4, 8}) {
    for (DeviceDType t : {DeviceDType::kFloat32, DeviceDType::kFloat16, DeviceDType::kBFloat16}) {
      const size_t width = t == DeviceDType::kFloat32 ? 4 : 2;
      const int64_t written = (image_pixels + pixels) * channels;  // one zero image past `valid`
      ASSERT_EQ(cudaMemsetAsync(out, 0xff, static_cast<size_t>(written) * width, stream), cudaSuccess);
      ASSERT_OK(NormalizeOnDevice(static_cast<const uint8_t*>(b.device_images), b.size, b.size + 1, pixels, n.mean,
                                  n.std, t, out, stream, channels));
      std::vector<std::byte> got(static_cast<size_t>(written) * width);
      ASSERT_EQ(cudaMemcpyAsync(got.data(), out, got.size(), cudaMemcpyDeviceToHost, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      auto value = [&](int64_t i) -> float {
        if (t == DeviceDType::kFloat32) return reinterpret_cast<const float*>(got.data())[i];
        if (t == DeviceDType::kFloat16) return __half2float(reinterpret_cast<const __half*>(got.data())[i]);
        return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(got.data())[i]);
      };
      const float tol = t == DeviceDType::kFloat32 ? 1e-5f : t == DeviceDType::kFloat16 ? 4e-3f : 3e-2f;
      int64_t wrong = 0;
      for (int64_t p = 0; p < image_pixels + pixels; ++p) {
        for (int c = 0; c < channels; ++c) {
          const float v = value(p * channels + c);
          if (p >= image_pixels || c >= 3) {
            wrong += v != 0.f;
          } else {
            const float w = want[p * 3 + c];
            wrong += std::abs(v - w) > tol * std::max(1.f, std::abs(w));
          }
        }
      }
      EXPECT_EQ(wrong, 0) << "dtype " << static_cast<int>(t) << ", " << channels << " channels";
    }
  }
  lease->Release(stream);
  cudaFree(out);
  cudaStreamDestroy(stream);
#endif
}

}  // namespace
}  // namespace stoke::prefetch
