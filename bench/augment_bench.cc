// The per-sample work of the CPU stage, one stage at a time and together: crop planning from the
// header, region decode at the planned DCT scale, resize + flip into a batch slot, and the
// normalisation the CPU backend applies to a whole batch. One thread; run `stoke bench decode`
// for the same figures as ratios to a plain full decode.
#include <benchmark/benchmark.h>

#include <algorithm>

#include "augment/crop_plan.h"
#include "augment/transform.h"
#include "bench_data.h"
#include "common/random.h"
#include "decode/jpeg_decoder.h"
#include "prefetch/loader.h"

namespace stoke::bench {
namespace {

constexpr int kOut = 224;

void SetImageCounters(benchmark::State& state, size_t images_per_iteration, const std::string& label) {
  state.counters["img/s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * static_cast<double>(images_per_iteration),
      benchmark::Counter::kIsRate);
  state.SetLabel(label);
}

struct Planned {
  augment::CropPlan plan;
  int scale = 1;
};

// The plan the loader would make for image i in `epoch` (seed 1): torchvision's RandomResizedCrop
// defaults, snapped to the DCT scale the region is decoded at.
Planned PlanFor(decode::JpegDecoder& decoder, const std::vector<std::byte>& jpeg, size_t i, int64_t epoch) {
  auto info = decoder.ReadHeader(jpeg);
  if (!info.ok()) return {};
  SplitMix64 rng = SampleRng(1, epoch, static_cast<int64_t>(i));
  const augment::RandomResizedCropOptions options;
  augment::CropPlan plan = augment::PlanRandomResizedCrop(info->width, info->height, options, rng);
  const int d = prefetch::SnapToBestScale(plan, info->width, info->height, kOut, kOut);  // as the loader does
  return {plan, d};
}

decode::Region RegionOf(const augment::CropPlan& p) {
  return {static_cast<int>(p.region.x), static_cast<int>(p.region.y),
          static_cast<int>(p.region.width), static_cast<int>(p.region.height)};
}

void BM_HeaderAndPlan(benchmark::State& state) {
  const auto& images = LoadBenchImages();
  decode::JpegDecoder decoder;
  int64_t epoch = 0;
  for (auto _ : state) {
    for (size_t i = 0; i < images.jpegs.size(); ++i) {
      benchmark::DoNotOptimize(PlanFor(decoder, images.jpegs[i], i, epoch));
    }
    ++epoch;
  }
  SetImageCounters(state, images.jpegs.size(), images.source);
}
BENCHMARK(BM_HeaderAndPlan)->Unit(benchmark::kMillisecond);

void BM_RegionDecode(benchmark::State& state) {
  const auto& images = LoadBenchImages();
  decode::JpegDecoder decoder;
  Image out;
  int64_t epoch = 0;
  for (auto _ : state) {
    for (size_t i = 0; i < images.jpegs.size(); ++i) {
      const Planned p = PlanFor(decoder, images.jpegs[i], i, epoch);
      auto where = decoder.DecodeRegion(images.jpegs[i], RegionOf(p.plan), kOut, kOut, &out, p.scale);
      benchmark::DoNotOptimize(where);
    }
    ++epoch;
  }
  SetImageCounters(state, images.jpegs.size(), images.source);
}
BENCHMARK(BM_RegionDecode)->Unit(benchmark::kMillisecond)->MinTime(2.0);

// Resize (+ flip for half of them) of already decoded regions into one 224x224 slot.
void BM_ResizeFlipIntoSlot(benchmark::State& state) {
  const auto& images = LoadBenchImages();
  augment::UseCallerThreadsOnly();
  decode::JpegDecoder decoder;
  struct Decoded {
    Image image;
    augment::RectF where;
    augment::CropPlan plan;
  };
  std::vector<Decoded> decoded;
  const size_t n = std::min<size_t>(images.jpegs.size(), 200);  // bounded memory
  for (size_t i = 0; i < n; ++i) {
    const Planned p = PlanFor(decoder, images.jpegs[i], i, 0);
    Decoded d;
    auto where = decoder.DecodeRegion(images.jpegs[i], RegionOf(p.plan), kOut, kOut, &d.image, p.scale);
    if (!where.ok()) continue;
    d.where = {where->x, where->y, where->width, where->height};
    d.plan = p.plan;
    decoded.push_back(std::move(d));
  }
  std::vector<uint8_t> slot(kOut * kOut * 3);
  for (auto _ : state) {
    for (const auto& d : decoded) {
      augment::ImageView view{d.image.pixels.data(), d.image.width, d.image.height,
                              d.image.channels, d.image.row_bytes()};
      benchmark::DoNotOptimize(augment::ApplyPlan(view, d.where, d.plan, slot));
    }
  }
  SetImageCounters(state, decoded.size(), images.source);
}
BENCHMARK(BM_ResizeFlipIntoSlot)->Unit(benchmark::kMillisecond);

// Everything one sample costs the CPU stage, decoding included.
void BM_WholeSample(benchmark::State& state) {
  const auto& images = LoadBenchImages();
  augment::UseCallerThreadsOnly();
  decode::JpegDecoder decoder;
  Image out;
  std::vector<uint8_t> slot(kOut * kOut * 3);
  int64_t epoch = 0;
  for (auto _ : state) {
    for (size_t i = 0; i < images.jpegs.size(); ++i) {
      const Planned p = PlanFor(decoder, images.jpegs[i], i, epoch);
      auto where = decoder.DecodeRegion(images.jpegs[i], RegionOf(p.plan), kOut, kOut, &out, p.scale);
      if (!where.ok()) continue;
      augment::ImageView view{out.pixels.data(), out.width, out.height, out.channels, out.row_bytes()};
      benchmark::DoNotOptimize(
          augment::ApplyPlan(view, {where->x, where->y, where->width, where->height}, p.plan, slot));
    }
    ++epoch;
  }
  SetImageCounters(state, images.jpegs.size(), images.source);
}
BENCHMARK(BM_WholeSample)->Unit(benchmark::kMillisecond)->MinTime(2.0);

// Normalisation of a batch of 64 uint8 224x224 samples (what the CPU backend does first).
// Args: layout (0 NCHW, 1 NHWC), dtype (0 f32, 1 f16).
void BM_NormalizeBatch(benchmark::State& state) {
  constexpr int kBatch = 64;
  std::vector<uint8_t> batch(static_cast<size_t>(kBatch) * kOut * kOut * 3);
  SplitMix64 rng(7);
  for (auto& v : batch) v = static_cast<uint8_t>(rng.Next());
  augment::NormalizeOptions o;
  o.layout = state.range(0) == 0 ? augment::Layout::kNCHW : augment::Layout::kNHWC;
  o.dtype = state.range(1) == 0 ? augment::DType::kFloat32 : augment::DType::kFloat16;
  std::vector<std::byte> dst(augment::NormalizedBytes(kBatch, kOut, kOut, o.dtype));
  for (auto _ : state) {
    benchmark::DoNotOptimize(augment::Normalize(batch, kBatch, kOut, kOut, o, dst));
    benchmark::ClobberMemory();
  }
  SetImageCounters(state, kBatch, state.range(0) == 0 ? "NCHW" : "NHWC");
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(batch.size()));
}
BENCHMARK(BM_NormalizeBatch)->Args({0, 0})->Args({1, 0})->Args({0, 1})->Args({1, 1})
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace stoke::bench

BENCHMARK_MAIN();
