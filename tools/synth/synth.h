// Synth: writes a labelled folder tree of synthetic JPEGs, the built-in example for the demo,
// the CLI tests and quick experiments. Two styles:
//  - stripes: each class has its own colour and stripe direction (learnable from colour alone);
//    each image has its own size, phase and noise.
//  - shapes: each class is a shape (disc, ring, square, frame, triangle, diamond, plus, cross,
//    bars, star) drawn in a random colour on a random background, at a random place, size and
//    slight rotation, with noise: only the shape tells the classes apart.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>

#include "common/status.h"

namespace stoke::synth {

enum class SynthStyle { kStripes, kShapes };

struct SynthOptions {
  SynthStyle style = SynthStyle::kStripes;
  int classes = 4;          // > 0 (shapes: classes past 10 reuse the shapes with other sizes)
  int per_class = 16;       // > 0
  int min_side = 48;        // image sides vary in [min_side, max_side]
  int max_side = 96;
  uint64_t seed = 0;
  const std::atomic<bool>* stop = nullptr;  // set: WriteSyntheticTree ends at the next image (kUnavailable), out_dir not written
};

// Writes out_dir/class_<k>/img_<i>.jpg. out_dir must be absent or an empty folder (kInvalidArgument
// otherwise, as for bad options). The tree is built in out_dir.partial and renamed to out_dir once
// complete, so an interrupted or killed synth leaves no partial out_dir; the next call removes
// out_dir.partial when it holds only synth's files. kUnavailable when another synth writes out_dir,
// kIoError when a file cannot be written. Deterministic in (options).
Status WriteSyntheticTree(const std::filesystem::path& out_dir, const SynthOptions& options);

}  // namespace stoke::synth
