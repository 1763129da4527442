// Builds a preset model on stoke's CPU backend and takes one training step on a batch of noise:
// the smallest program on stoke::train (oneDNN, and the CUDA libraries when stoke has them).
//   cpp_model [PRESET]
#include <cstdio>
#include <random>
#include <vector>

#include "train/cpu_network.h"
#include "train/model.h"

int main(int argc, char** argv) {
  using namespace stoke::train;
  NetworkOptions o;
  o.model.preset = argc > 1 ? argv[1] : "resnet20";
  o.model.classes = 10;
  auto layers = ExpandPreset(o.model.preset, o.model.classes);
  if (!layers.ok()) {
    std::fprintf(stderr, "cpp_model: %s\n", layers.status().ToString().c_str());
    return 1;
  }
  o.model.layers = *layers;
  o.image_size = 32;
  o.batch = 8;
  o.threads = 1;
  auto net = CpuNetwork::Create(o);
  if (!net.ok()) {
    std::fprintf(stderr, "cpp_model: %s\n", net.status().ToString().c_str());
    return 1;
  }
  std::vector<uint8_t> pixels(static_cast<size_t>(o.batch) * 32 * 32 * 3);
  std::vector<int32_t> labels(static_cast<size_t>(o.batch));
  std::mt19937 rng(1);
  for (auto& p : pixels) p = static_cast<uint8_t>(rng());
  for (auto& l : labels) l = static_cast<int32_t>(rng() % 10);
  stoke::prefetch::Batch batch;
  batch.size = o.batch;
  batch.width = batch.height = 32;
  batch.images = pixels;
  batch.labels = labels;
  auto stats = (*net)->TrainStep(batch, 0.1f, SgdOptions{}, 0);
  if (!stats.ok()) {
    std::fprintf(stderr, "cpp_model: %s\n", stats.status().ToString().c_str());
    return 1;
  }
  std::printf("%s: %zu layers, one step on the %s backend, loss %.3f\n", o.model.preset.c_str(), layers->size(),
              std::string((*net)->backend()).c_str(), stats->loss());
  return 0;
}
