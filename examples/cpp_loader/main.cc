// Iterates one epoch of a stoke dataset with the loader (RandomResizedCrop 224 + flip, uint8 HWC
// batches) and prints what it saw: the smallest program on top of the installed package.
//   cpp_loader DATASET [BATCH]
#include <cstdio>
#include <cstdlib>

#include "dataset/dataset.h"
#include "prefetch/loader.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DATASET [BATCH]\n", argv[0]);
    return 2;
  }
  auto dataset = stoke::dataset::Dataset::Open(argv[1]);
  if (!dataset.ok()) {
    std::fprintf(stderr, "cpp_loader: %s\n", dataset.status().ToString().c_str());
    return 1;
  }
  stoke::prefetch::LoaderOptions options;
  options.batch_size = argc > 2 ? std::atoi(argv[2]) : 32;
  options.device = stoke::prefetch::DeviceMode::kHost;
  auto loader = stoke::prefetch::Loader::Create(*dataset, options);
  if (!loader.ok()) {
    std::fprintf(stderr, "cpp_loader: %s\n", loader.status().ToString().c_str());
    return 1;
  }
  long batches = 0, samples = 0;
  unsigned long checksum = 0;
  while (true) {
    auto lease = (*loader)->Next();
    if (!lease.ok()) {
      std::fprintf(stderr, "cpp_loader: %s\n", lease.status().ToString().c_str());
      return 1;
    }
    if (!*lease) break;
    const stoke::prefetch::Batch& b = **lease;
    ++batches;
    samples += b.size;
    for (int i = 0; i < b.size; ++i) checksum += static_cast<unsigned long>(b.labels[static_cast<size_t>(i)]);
  }
  const auto stats = (*loader)->stats();
  std::printf("%ld batches, %ld samples of %lld records, %.0f images/s, label sum %lu\n", batches, samples,
              static_cast<long long>(dataset->size()), stats.images_per_s, checksum);
  return 0;
}
