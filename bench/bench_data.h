// Inputs for the benchmarks: the shared ImageNet-like corpus when present ($STOKE_BENCH_DATA or
// ../shared/data/imagenet_like), synthetic JPEGs otherwise (so the programs always run).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace stoke::bench {

struct BenchImages {
  std::string source;  // where they came from, for the report
  std::vector<std::vector<std::byte>> jpegs;
  size_t total_bytes = 0;
};

// Loaded once per process.
const BenchImages& LoadBenchImages();

}  // namespace stoke::bench
