// Fuzz target: arbitrary bytes as a `stoke train` YAML config. A config that parses must print
// (ConfigToYaml) to a config that parses again to the same text; its model is already resolved by
// the parser, and when it is small enough it must build on the CPU backend and run one training
// step on a tiny random batch without crashing (an error Status is fine, a crash or throw is not).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "train/config.h"
#include "train/cpu_network.h"

using namespace stoke;

namespace {

// Runs one step of the config's model; traps on what must not happen.
void RunOneStep(const train::TrainConfig& c) {
  const int size = c.data.image_size;
  if (size > 48) return;  // bounded work per input
  train::NetworkOptions o;
  o.model = train::ModelFromConfig(c.model);
  const train::Shape input{3, size, size};
  auto shapes = train::ResolveModel(o.model, input);
  if (!shapes.ok()) __builtin_trap();  // ParseConfig resolved this very model
  int64_t activations = 0;
  for (const auto& s : *shapes) activations += s.size();
  if (activations > (1 << 20) || train::CountParameters(o.model, *shapes, input) > (1 << 22)) return;
  o.image_size = size;
  o.batch = 2;
  o.normalize = train::NormalizeFromConfig(c.data);
  o.normalize.dtype = augment::DType::kFloat32;
  o.label_smoothing = c.model.label_smoothing;
  o.seed = c.seed;
  o.threads = 1;
  auto net = train::CpuNetwork::Create(o);
  if (!net.ok()) {
    if (net.status().code() == StatusCode::kResourceExhausted) return;
    __builtin_trap();  // a resolved model must build
  }
  std::vector<uint8_t> images(static_cast<size_t>(o.batch) * size * size * 3);
  for (size_t i = 0; i < images.size(); ++i) images[i] = static_cast<uint8_t>(i * 37);
  std::vector<int32_t> labels(static_cast<size_t>(o.batch));
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<int32_t>(i % static_cast<size_t>(c.model.classes));
  prefetch::Batch b;
  b.size = o.batch;
  b.width = b.height = size;
  b.images = images;
  b.labels = labels;
  auto step = (*net)->TrainStep(b, 0.01f, c.optimizer.sgd, 0);
  // The only acceptable failure of a step is a loss that is not finite (weights or inputs too large).
  if (!step.ok() && step.status().message().find("not finite") == std::string::npos) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 64 * 1024) return 0;  // a config is small; deep YAML nesting is the parser's own limit
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto config = train::ParseConfig(text, "fuzz.yaml");
  if (!config.ok()) return 0;
  const std::string printed = train::ConfigToYaml(*config);
  auto again = train::ParseConfig(printed, "printed.yaml");
  if (!again.ok() || train::ConfigToYaml(*again) != printed) __builtin_trap();
  RunOneStep(*config);
  return 0;
}
