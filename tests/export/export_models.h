// The models the export checks cover: every preset, the example layer list of
// configs/residual_layers.yaml, and a list that uses every layer type in the places folding must
// and must not happen. Each comes with a state whose batch-norm statistics and affine terms are far
// from their initial values, so that folding them changes the weights for real.
#pragma once

#include <random>
#include <string>
#include <vector>

#include "train/config.h"
#include "train/cpu_network.h"
#include "train/model.h"

namespace stoke::train::export_cases {

struct ExportCase {
  std::string name;
  ModelSpec model;
  int size = 32;
  augment::NormalizeOptions normalize;
};

inline LayerSpec Layer(LayerType type, std::string name, std::vector<std::string> inputs = {}) {
  LayerSpec l;
  l.type = type;
  l.name = std::move(name);
  l.inputs = std::move(inputs);
  return l;
}

// conv (bias) + relu + avgpool (padded) + a conv read twice (no folding) + kept BN + maxpool
// (padded) + flatten + linear on C x H x W + BN on a vector (folded) + dropout + linear.
inline ModelSpec EveryLayerModel(int classes) {
  ModelSpec m;
  m.classes = classes;
  auto conv = [](std::string name, int out, int k, int s, int p, bool bias, std::vector<std::string> in = {}) {
    LayerSpec l = Layer(LayerType::kConv, std::move(name), std::move(in));
    l.out = out, l.kernel = k, l.stride = s, l.pad = p, l.bias = bias;
    return l;
  };
  auto pool = [](LayerType t, std::string name, int k, int s, int p) {
    LayerSpec l = Layer(t, std::move(name));
    l.kernel = k, l.stride = s, l.pad = p;
    return l;
  };
  LayerSpec fc1 = Layer(LayerType::kLinear, "fc1");
  fc1.out = 24;
  LayerSpec fc2 = Layer(LayerType::kLinear, "fc2");
  fc2.out = classes;
  LayerSpec drop = Layer(LayerType::kDropout, "drop");
  drop.p = 0.3;
  m.layers = {conv("c1", 8, 3, 1, 1, true),
              // Named like c2's weight: tensor names stay unique whatever the layers are called.
              Layer(LayerType::kRelu, "c2.weight"),
              pool(LayerType::kAvgPool, "avg", 3, 2, 1),
              conv("c2", 8, 3, 1, 1, false),
              Layer(LayerType::kBatchNorm, "bn_c2"),          // c2 also feeds `sum`: not folded
              Layer(LayerType::kAdd, "sum", {"bn_c2", "c2"}),
              // Named like a helper node of the export (uint8 input's scaling): node names stay
              // unique too.
              Layer(LayerType::kRelu, "normalize_scale"),
              Layer(LayerType::kBatchNorm, "logits"),  // nothing to fold into; named like the output
              pool(LayerType::kMaxPool, "max", 3, 2, 1),
              Layer(LayerType::kFlatten, "flat"),
              fc1,
              Layer(LayerType::kBatchNorm, "bn_fc1"),         // folded into fc1
              Layer(LayerType::kRelu, "r3"),
              drop,
              fc2};
  return m;
}

inline Result<std::vector<ExportCase>> ExportCases(const std::string& source_dir) {
  std::vector<ExportCase> cases;
  for (const auto& [preset, size, classes] : std::vector<std::tuple<std::string, int, int>>{
           {"lenet", 32, 10}, {"resnet20", 32, 10}, {"resnet18", 64, 10}, {"resnet34", 64, 10}, {"resnet50", 64, 20}}) {
    ExportCase c{.name = preset, .size = size};
    c.model.preset = preset;
    c.model.classes = classes;
    STOKE_ASSIGN_OR_RETURN(c.model.layers, ExpandPreset(preset, classes));
    cases.push_back(std::move(c));
  }
  STOKE_ASSIGN_OR_RETURN(TrainConfig config, LoadConfig(source_dir + "/configs/residual_layers.yaml"));
  cases.push_back({.name = "residual_layers", .model = ModelFromConfig(config.model), .size = config.data.image_size,
                   .normalize = NormalizeFromConfig(config.data)});
  cases.push_back({.name = "every_layer", .model = EveryLayerModel(7), .size = 20});
  return cases;
}

// A CPU network for the case with every batch norm's scale, shift and running statistics drawn at
// random (non-trivial folding), and its state.
inline Result<std::unique_ptr<CpuNetwork>> BuildPerturbed(const ExportCase& c, int batch, uint64_t seed) {
  NetworkOptions o;
  o.model = c.model;
  o.image_size = c.size;
  o.batch = batch;
  o.normalize = c.normalize;
  o.seed = seed;
  o.threads = 2;
  STOKE_ASSIGN_OR_RETURN(auto net, CpuNetwork::Create(o));
  ModelSpec resolved = c.model;
  STOKE_RETURN_IF_ERROR(ResolveModel(resolved, {3, c.size, c.size}).status());
  std::vector<std::string> bns;
  for (const LayerSpec& l : resolved.layers) {
    if (l.type == LayerType::kBatchNorm) bns.push_back(l.name);
  }
  STOKE_ASSIGN_OR_RETURN(std::vector<NamedTensor> state, net->State());
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uniform(0.5f, 1.5f);
  for (NamedTensor& t : state) {
    for (const std::string& bn : bns) {
      if (t.name == bn + ".running_mean" || t.name == bn + ".bias") {
        for (float& v : t.values) v = 0.2f * normal(rng);
      } else if (t.name == bn + ".running_var" || t.name == bn + ".weight") {
        for (float& v : t.values) v = uniform(rng);
      }
    }
  }
  STOKE_RETURN_IF_ERROR(net->LoadState(state));
  return net;
}

// Smooth random pictures (a gradient plus noise) as `count` HWC uint8 RGB images.
inline std::vector<uint8_t> RandomImages(int count, int size, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> px(static_cast<size_t>(count) * size * size * 3);
  size_t k = 0;
  for (int n = 0; n < count; ++n) {
    const int base = static_cast<int>(rng() % 128), slope = static_cast<int>(rng() % 4);
    for (int y = 0; y < size; ++y) {
      for (int x = 0; x < size; ++x) {
        for (int ch = 0; ch < 3; ++ch) {
          px[k++] = static_cast<uint8_t>(std::clamp(base + slope * (x + y) + static_cast<int>(rng() % 64) - 32 + 20 * ch, 0, 255));
        }
      }
    }
  }
  return px;
}

}  // namespace stoke::train::export_cases
