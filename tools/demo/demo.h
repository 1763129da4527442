// `stoke demo`: the whole system on a built-in example. Writes a labelled set of synthetic JPEGs,
// packs it with a validation split, trains a small CNN from a YAML config on the available
// backend, evaluates, and reports accuracy, images/s, data-wait and where the curves are.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <string>

#include "common/status.h"

namespace stoke::demo {

struct DemoOptions {
  std::filesystem::path dir = "build/demo";  // working directory (recreated)
  int classes = 10;
  int per_class = 500;  // images per class before the 10% validation split
  int epochs = 15;
  int threads = 0;      // decoding and compute threads; 0 = every core
  const std::atomic<bool>* stop = nullptr;
};

struct DemoResult {
  double val_top1 = 0;
  double seconds = 0;  // data generation + pack + training + evaluation
  std::string report;  // human-readable
};

// The YAML config the demo trains with, for datasets in `dir`.
std::string DemoConfigYaml(const std::filesystem::path& dir, int classes, int epochs, int threads);

Result<DemoResult> RunDemo(const DemoOptions& options);

}  // namespace stoke::demo
