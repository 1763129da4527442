// Full-image JPEG decode: stoke's strict libjpeg-API decoder against TurboJPEG's one-call API on
// the same images (the yardstick the pack target is expressed in).
#include <benchmark/benchmark.h>
#include <turbojpeg.h>

#include "bench_data.h"
#include "decode/jpeg_decoder.h"

namespace stoke::bench {
namespace {

void SetCounters(benchmark::State& state, const BenchImages& images) {
  const double n = static_cast<double>(state.iterations()) * static_cast<double>(images.jpegs.size());
  state.counters["img/s"] = benchmark::Counter(n, benchmark::Counter::kIsRate);
  state.counters["MB/s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * static_cast<double>(images.total_bytes) / 1e6,
      benchmark::Counter::kIsRate);
  state.SetLabel(images.source);
}

void BM_TurboJpeg_FullDecode(benchmark::State& state) {
  const auto& images = LoadBenchImages();
  tjhandle tj = tjInitDecompress();
  std::vector<unsigned char> rgb;
  for (auto _ : state) {
    for (const auto& j : images.jpegs) {
      int w, h, sub, cs;
      const auto* p = reinterpret_cast<const unsigned char*>(j.data());
      if (tjDecompressHeader3(tj, p, j.size(), &w, &h, &sub, &cs) != 0) continue;
      rgb.resize(static_cast<size_t>(w) * h * 3);
      tjDecompress2(tj, p, j.size(), rgb.data(), w, 0, h, TJPF_RGB, 0);
      benchmark::DoNotOptimize(rgb.data());
    }
  }
  tjDestroy(tj);
  SetCounters(state, images);
}
BENCHMARK(BM_TurboJpeg_FullDecode)->Unit(benchmark::kMillisecond)->MinTime(2.0);

void BM_JpegDecoder_StrictFullDecode(benchmark::State& state) {
  const auto& images = LoadBenchImages();
  decode::JpegDecoder decoder;
  Image out;
  for (auto _ : state) {
    for (const auto& j : images.jpegs) {
      Status s = decoder.Decode(j, &out, static_cast<int>(state.range(0)));
      benchmark::DoNotOptimize(s);
      benchmark::DoNotOptimize(out.pixels.data());
    }
  }
  SetCounters(state, images);
}
BENCHMARK(BM_JpegDecoder_StrictFullDecode)->Arg(1)->Arg(2)->Arg(4)->Arg(8)
    ->Unit(benchmark::kMillisecond)->MinTime(2.0);

void BM_JpegDecoder_Header(benchmark::State& state) {
  const auto& images = LoadBenchImages();
  decode::JpegDecoder decoder;
  for (auto _ : state) {
    for (const auto& j : images.jpegs) benchmark::DoNotOptimize(decoder.ReadHeader(j));
  }
  SetCounters(state, images);
}
BENCHMARK(BM_JpegDecoder_Header)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace stoke::bench

BENCHMARK_MAIN();
