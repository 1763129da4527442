// Synth: writes a labelled folder tree of synthetic JPEGs, the built-in example for the demo,
// the CLI tests and quick experiments. Each class has its own colour and stripe direction, so
// the classes are learnable; each image has its own size, phase and noise.
#pragma once

#include <cstdint>
#include <filesystem>

#include "common/status.h"

namespace stoke::synth {

struct SynthOptions {
  int classes = 4;          // > 0
  int per_class = 16;       // > 0
  int min_side = 48;        // image sides vary in [min_side, max_side]
  int max_side = 96;
  uint64_t seed = 0;
};

// Writes out_dir/class_<k>/img_<i>.jpg. kInvalidArgument for bad options, kIoError when a file
// cannot be written. Deterministic in (options).
Status WriteSyntheticTree(const std::filesystem::path& out_dir, const SynthOptions& options);

}  // namespace stoke::synth
