// Record reads from a packed LMDB: random Get() and sequential Scan(), with and without CRC
// checks, plus raw CRC-32C speed. The dataset is built once in a temp directory from the bench
// images.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>

#include "bench_data.h"
#include "common/crc32c.h"
#include "common/file_util.h"
#include "common/random.h"
#include "dataset/dataset.h"
#include "dataset/writer.h"

namespace stoke::bench {
namespace {
namespace fs = std::filesystem;

// A dataset of the bench images, packed as they are (no validation: that is not measured here).
struct BenchDataset {
  fs::path dir;
  std::unique_ptr<dataset::Dataset> ds;
  BenchDataset() {
    Result<fs::path> tmp = TemporaryFolder("the benchmark's dataset");
    if (!tmp.ok()) {
      std::fprintf(stderr, "dataset_bench: %s\n", tmp.status().ToString().c_str());
      std::exit(1);
    }
    dir = *tmp / ("stoke-dataset-bench-" + std::to_string(::getpid()));
    fs::remove_all(dir);
    const auto& images = LoadBenchImages();
    auto writer = dataset::DatasetWriter::Create(dir, {});
    dataset::Manifest m;
    m.format_version = dataset::kFormatVersion;
    m.classes = {"all"};
    for (const auto& j : images.jpegs) {
      writer->Append(dataset::RecordHeader{}, j, "");
      if (writer->ShouldCommit()) (void)writer->Commit("{}");
    }
    m.records = static_cast<int64_t>(images.jpegs.size());
    m.class_counts = {m.records};
    if (!writer->Finish(m).ok()) std::abort();
    ds = std::make_unique<dataset::Dataset>(std::move(dataset::Dataset::Open(dir)).value());
  }
  ~BenchDataset() { fs::remove_all(dir); }
};

BenchDataset& Data() {
  static BenchDataset d;
  return d;
}

void BM_Reader_RandomGet(benchmark::State& state) {
  auto& d = Data();
  auto reader = d.ds->NewReader({.verify_crc = state.range(0) != 0});
  const int64_t n = d.ds->size();
  std::vector<int64_t> order(1 << 16);
  SplitMix64 rng(1);
  for (auto& i : order) i = static_cast<int64_t>(rng.Below(static_cast<uint64_t>(n)));
  size_t k = 0;
  double bytes = 0;
  for (auto _ : state) {
    auto r = reader->Get(order[k++ & (order.size() - 1)]);
    bytes += static_cast<double>(r->payload.size());
    benchmark::DoNotOptimize(r->payload.data());
  }
  state.counters["records/s"] = benchmark::Counter(static_cast<double>(state.iterations()),
                                                   benchmark::Counter::kIsRate);
  // Without the CRC the payload is not read, so bytes per second would mean nothing.
  if (state.range(0) != 0) {
    state.counters["MB/s"] = benchmark::Counter(bytes / 1e6, benchmark::Counter::kIsRate);
  }
}
BENCHMARK(BM_Reader_RandomGet)->ArgName("crc")->Arg(0)->Arg(1);

void BM_Reader_SequentialScan(benchmark::State& state) {
  auto& d = Data();
  auto reader = d.ds->NewReader({.verify_crc = state.range(0) != 0});
  double bytes = 0;
  for (auto _ : state) {
    Status s = reader->Scan(0, d.ds->size(), [&](const dataset::RecordView& r) {
      bytes += static_cast<double>(r.payload.size());
      return OkStatus();
    });
    benchmark::DoNotOptimize(s);
  }
  state.counters["records/s"] = benchmark::Counter(
      static_cast<double>(state.iterations() * d.ds->size()), benchmark::Counter::kIsRate);
  if (state.range(0) != 0) {
    state.counters["MB/s"] = benchmark::Counter(bytes / 1e6, benchmark::Counter::kIsRate);
  }
}
BENCHMARK(BM_Reader_SequentialScan)->ArgName("crc")->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

void BM_Crc32c(benchmark::State& state) {
  std::vector<std::byte> data(static_cast<size_t>(state.range(0)), std::byte{0x5A});
  for (auto _ : state) benchmark::DoNotOptimize(Crc32c(data));
  state.SetBytesProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_Crc32c)->Arg(4096)->Arg(110 << 10);

}  // namespace
}  // namespace stoke::bench

BENCHMARK_MAIN();
