// Helpers shared by the trainer's test suites: layer specs in one line, and the small packed
// synthetic dataset the training-loop tests learn from.
#pragma once

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/testing/test_util.h"
#include "tools/pack/packer.h"
#include "tools/synth/synth.h"
#include "train/model.h"

namespace stoke::train {

inline LayerSpec L(LayerType type, std::string name = "", std::vector<std::string> inputs = {}) {
  LayerSpec l;
  l.type = type;
  l.name = std::move(name);
  l.inputs = std::move(inputs);
  return l;
}
inline LayerSpec Conv(int out, int k, int s, int p, std::string name = "", std::vector<std::string> in = {}) {
  LayerSpec l = L(LayerType::kConv, std::move(name), std::move(in));
  l.out = out;
  l.kernel = k;
  l.stride = s;
  l.pad = p;
  return l;
}
inline LayerSpec NoBias(LayerSpec l) {
  l.bias = false;
  return l;
}
inline LayerSpec Linear(int out, std::string name = "") {
  LayerSpec l = L(LayerType::kLinear, std::move(name));
  l.out = out;
  return l;
}
inline LayerSpec Pool(LayerType type, int k, int s, int p) {
  LayerSpec l = L(type);
  l.kernel = k;
  l.stride = s;
  l.pad = p;
  return l;
}

// 4 classes x 40 synthetic JPEGs packed into `dir`/train.lmdb, with 20% in train_val.lmdb.
inline void PackSmallSyntheticSet(const testing::TempDir& dir) {
  synth::SynthOptions so{.classes = 4, .per_class = 40, .min_side = 24, .max_side = 40, .seed = 3};
  ASSERT_OK(synth::WriteSyntheticTree(dir / "images", so));
  pack::PackOptions po;
  po.source = dir / "images";
  po.output = dir / "train.lmdb";
  po.val_fraction = 0.2;
  po.shuffle = true;
  po.progress = false;
  ASSERT_OK(pack::Pack(po).status());
}

}  // namespace stoke::train
