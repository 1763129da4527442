// Helpers shared by the trainer's test suites: layer specs in one line, the finite-difference
// gradient check, seeded random layer lists, and the small packed synthetic dataset the
// training-loop tests learn from.
#pragma once

#include <array>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tests/testing/test_util.h"
#include "tools/pack/packer.h"
#include "tools/synth/synth.h"
#include "train/cpu_network.h"
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

// A CPU network with a random normalised input batch and labels, for gradient checks.
struct Fixture {
  std::unique_ptr<CpuNetwork> net;
  std::vector<float> input;
  std::vector<int32_t> labels;
};

// `height` 0: a square size x size input.
inline Fixture Build(std::vector<LayerSpec> layers, int classes, int size, int batch, double smoothing = 0,
                     uint64_t seed = 1, int height = 0) {
  NetworkOptions o;
  o.model.layers = std::move(layers);
  o.model.classes = classes;
  o.image_size = size;
  o.image_height = height;
  o.batch = batch;
  o.label_smoothing = smoothing;
  o.seed = seed;
  // One oneDNN thread: these checks are about stoke's arithmetic, which is serial. Two OpenMP threads
  // spin-wait on each other, and beside another test on a 2-core machine (ctest -j2) that made the
  // small-ResNet gradient check 25 s instead of 1 s, and 121 s under ASan.
  o.threads = 1;
  auto net = CpuNetwork::Create(o);
  EXPECT_TRUE(net.ok()) << net.status().ToString();
  Fixture f;
  if (!net.ok()) return f;
  f.net = std::move(*net);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> normal(0.f, 1.f);
  f.input.resize(static_cast<size_t>(batch) * 3 * size * o.height());
  for (float& v : f.input) v = normal(rng);
  for (int i = 0; i < batch; ++i) f.labels.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(classes)));
  return f;
}

// Compares every parameter's analytic gradient with central differences of the loss, on up to
// `per_tensor` entries of each tensor.
inline void CheckGradients(Fixture& f, int64_t step = 7, int per_tensor = 12, double rel_tol = 3e-2,
                           float eps = 1e-3f) {
  ASSERT_TRUE(f.net);
  ASSERT_OK_AND_ASSIGN(BatchStats base, f.net->ForwardBackward(f.input, f.labels, step));
  ASSERT_TRUE(std::isfinite(base.loss()));
  ASSERT_OK_AND_ASSIGN(const std::vector<NamedTensor> grads, f.net->Gradients());
  ASSERT_OK_AND_ASSIGN(const std::vector<NamedTensor> state, f.net->State());
  std::map<std::string, size_t> where;
  for (size_t i = 0; i < state.size(); ++i) where[state[i].name] = i;
  std::mt19937 rng(3);
  int checked = 0;
  for (const NamedTensor& g : grads) {
    const size_t si = where.at(g.name);
    const size_t n = g.values.size();
    for (int t = 0; t < per_tensor && t < static_cast<int>(n); ++t) {
      const size_t k = n <= static_cast<size_t>(per_tensor) ? static_cast<size_t>(t) : rng() % n;
      auto loss_at = [&](float delta) {
        std::vector<NamedTensor> s = state;
        s[si].values[k] += delta;
        EXPECT_OK(f.net->LoadState(s));
        auto r = f.net->ForwardBackward(f.input, f.labels, step);
        EXPECT_TRUE(r.ok());
        return r.ok() ? r->loss() : 0.0;
      };
      const double numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps);
      const double analytic = g.values[k];
      EXPECT_NEAR(numeric, analytic, 2e-3 + rel_tol * std::abs(analytic))
          << g.name << "[" << k << "]: numeric " << numeric << ", analytic " << analytic;
      ++checked;
    }
  }
  EXPECT_OK(f.net->LoadState(state));
  EXPECT_GT(checked, 0);
}

// A seeded random model for property tests: a random input (1x1 up to 9x9, a third of them not
// square), 1 to 7 layers of random types with random kernel/stride/pad/width (some out of range on
// purpose), a tenth of the inputs taken from an earlier layer or the image, `add` joining the
// previous layer with a random earlier one, and usually a head that makes logits. Many are not
// valid models; ResolveModel is the judge.
struct RandomModel {
  ModelSpec model;
  int width = 0, height = 0;
  std::string Describe() const {
    std::string d = fmt::format("input {}x{}, {} classes:", width, height, model.classes);
    for (const LayerSpec& l : model.layers) {
      d += fmt::format(" {}={}(in:{} out:{} k:{} s:{} p:{})", l.name, LayerTypeName(l.type), fmt::join(l.inputs, "+"),
                       l.out, l.kernel, l.stride, l.pad);
    }
    return d;
  }
};

inline RandomModel MakeRandomModel(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return lo + static_cast<int>(rng() % static_cast<uint64_t>(hi - lo + 1)); };
  RandomModel r;
  r.width = pick(1, 9);
  r.height = pick(0, 2) == 0 ? pick(1, 9) : r.width;
  r.model.classes = pick(2, 6);
  std::vector<std::string> earlier = {"input"};
  auto any_earlier = [&] { return earlier[static_cast<size_t>(pick(0, static_cast<int>(earlier.size()) - 1))]; };
  const int n = pick(1, 7);
  for (int i = 0; i < n; ++i) {
    LayerSpec l;
    l.name = fmt::format("l{}", i);
    l.type = static_cast<LayerType>(pick(0, 9));
    l.out = pick(1, 6);
    l.kernel = pick(1, 4);
    l.stride = pick(l.type == LayerType::kMaxPool || l.type == LayerType::kAvgPool ? 0 : 1, 3);
    l.pad = pick(0, l.kernel - (pick(0, 9) == 0 ? 0 : 1));  // pad == kernel now and then: refused
    l.bias = pick(0, 1) == 1;
    l.p = std::array<double, 3>{0.0, 0.25, 0.5}[static_cast<size_t>(pick(0, 2))];
    l.zero_init = pick(0, 4) == 0;
    if (l.type == LayerType::kAdd) {
      l.inputs = {earlier.back(), any_earlier()};
    } else if (pick(0, 9) == 0) {
      l.inputs = {any_earlier()};
    }
    earlier.push_back(l.name);
    r.model.layers.push_back(std::move(l));
  }
  auto head = [&](LayerType t, int out = 0) {
    LayerSpec l;
    l.name = fmt::format("head{}", r.model.layers.size());
    l.type = t;
    l.out = out;
    r.model.layers.push_back(std::move(l));
  };
  switch (pick(0, 4)) {
    case 0:
      head(LayerType::kGlobalAvgPool);
      head(LayerType::kLinear, r.model.classes);
      break;
    case 1:
      head(LayerType::kFlatten);
      head(LayerType::kLinear, r.model.classes);
      break;
    case 2:
    case 3:
      head(LayerType::kLinear, r.model.classes);
      break;
    default:
      break;  // whatever the random layers end with
  }
  return r;
}

// The body of the training-loop tests' model (conv, batch norm, ReLU, max pool, flatten) as
// entries of a YAML `model.layers` list; each test adds its own head.
inline constexpr const char* kSmallConvBnLayers =
    "    - {type: conv, out: 8, kernel: 3, pad: 1, bias: false}\n"
    "    - {type: batchnorm}\n"
    "    - {type: relu}\n"
    "    - {type: maxpool, kernel: 2}\n"
    "    - {type: flatten}\n";

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
