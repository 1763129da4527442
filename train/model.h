// A model is a list of layers; each reads the outputs of earlier layers (by default the one just
// before it, or the network input for the first), so residual networks are written out as plain
// lists. Presets (LeNet, ResNet-20, ResNet-18/34/50) expand to such lists. Softmax cross-entropy
// is applied to the last layer's output, which must be a vector of `classes` logits.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace stoke::train {

enum class LayerType {
  kConv,           // 2-D convolution, square kernel; out = channels
  kBatchNorm,      // per-channel, learned scale and shift, running statistics for evaluation
  kRelu,
  kMaxPool,        // square window
  kAvgPool,        // square window, padding counted in the divisor
  kGlobalAvgPool,  // C x H x W -> C x 1 x 1
  kLinear,         // fully connected; out = features; accepts C x H x W (flattened) or vectors
  kAdd,            // elementwise sum of two inputs of one shape (residual connections)
  kFlatten,        // C x H x W -> (C*H*W) vector, in C, H, W order
  kDropout,        // inverted dropout with probability `p` while training; identity in eval
};
std::string_view LayerTypeName(LayerType type);
Result<LayerType> ParseLayerType(std::string_view name);  // the names LayerTypeName gives

struct LayerSpec {
  std::string name;                 // unique; generated ("conv3") when a list leaves it empty
  LayerType type = LayerType::kRelu;
  std::vector<std::string> inputs;  // empty: the previous layer (the network input for layer 0)
  int out = 0;                      // conv: output channels; linear: output features
  int kernel = 1;                   // conv, pools
  int stride = 1;                   // conv, pools (pools: defaults to kernel when 0)
  int pad = 0;                      // conv, pools
  bool bias = true;                 // conv, linear
  double p = 0.5;                   // dropout probability, [0, 1)
  bool zero_init = false;           // batch norm: start with scale 0 (last BN of a residual branch)
};

struct ModelSpec {
  std::string preset;  // as configured ("" for an explicit list); informative only
  int classes = 10;
  std::vector<LayerSpec> layers;
};

// Shape of one activation (per sample): channels x height x width; vectors have h = w = 1.
// The most values one layer's output (per image) or weights may hold: 2^31 - 1.
inline constexpr int64_t kMaxLayerElements = 2147483647;

struct Shape {
  int c = 0, h = 0, w = 0;
  bool vector = false;  // produced by linear or flatten: no spatial layout left
  int64_t size() const { return int64_t{c} * h * w; }
  bool operator==(const Shape&) const = default;
};

// The preset names: lenet, resnet20, resnet18, resnet34, resnet50.
std::vector<std::string> PresetNames();
// Expands a preset into layers ending in a `classes`-way linear layer. kInvalidArgument for an
// unknown name (listing the known ones) or classes < 1.
Result<std::vector<LayerSpec>> ExpandPreset(std::string_view preset, int classes);

// Names unnamed layers, checks every input refers to an earlier layer, every option is in range,
// and infers every layer's output shape for `input` (3 x height x width). The last layer must give
// `classes` logits, every other layer must feed a later one, and some layer must have learnable
// parameters. Errors name the layer (index and name) and what was expected.
Result<std::vector<Shape>> ResolveModel(ModelSpec& model, Shape input);

// Whether a layer type has learnable parameters (conv, linear, batchnorm).
bool HasParameters(LayerType type);

// For a resolved model: whether each layer's output needs a gradient in the backward pass, that is
// whether the layer or any layer upstream of it has learnable parameters. Backends skip the
// backward work of the others, and never compute a gradient for the network input.
std::vector<bool> LayersNeedingGradient(const ModelSpec& model);

// For a resolved model: per layer, the layers reading its output, in layer order (a layer reading
// it twice, an add of x and x, is listed twice). Backends and export use it to find an output
// with a single reader.
std::vector<std::vector<int>> LayerReaders(const ModelSpec& model);

// A convolution's or linear layer's starting parameters, plain layout (`weight_dims`: O x I x KH x KW
// for convolutions, O x I or O x C x H x W for linear layers): Kaiming-normal (fan-out, ReLU gain)
// convolutions as in ResNet, the uniform +-1/sqrt(fan_in) of common frameworks for linear layers
// and their biases, zero convolution biases. Every backend starts from these values.
struct InitialParameters {
  std::vector<float> weight;
  std::vector<float> bias;  // empty when the layer has none
};
InitialParameters InitialWeights(const LayerSpec& layer, const std::vector<int64_t>& weight_dims, uint64_t seed);

// The tensors a resolved model holds, apart from the optimizer's buffers: "<layer>.weight" and
// ".bias" of convolutions and linear layers, and batch norm's ".weight", ".bias", ".running_mean",
// ".running_var", with their plain dims (as Network::State() gives them), in layer order.
std::vector<std::pair<std::string, std::vector<int64_t>>> ModelTensors(const ModelSpec& model,
                                                                      const std::vector<Shape>& shapes, Shape input);

// Empty when two resolved models are the same layers (types, settings and inputs, in order), so
// that one's parameters mean the same in the other; otherwise the first difference, naming the
// layer and each model by its `*_is`, e.g. "layer 2 is 'r1' (maxpool kernel 4 stride 4 pad 0) in
// the config, 'r1' (relu) in the checkpoint".
std::string ModelDifference(const ModelSpec& here, std::string_view here_is, const ModelSpec& other,
                            std::string_view other_is);

// Learnable parameters of a resolved model (for reports): weights + biases + BN scale/shift.
int64_t CountParameters(const ModelSpec& model, const std::vector<Shape>& shapes, Shape input);

}  // namespace stoke::train
