#include "train/model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <numbers>
#include <utility>

#include <fmt/format.h>

#include "common/random.h"

namespace stoke::train {
namespace {

constexpr std::array<std::pair<LayerType, std::string_view>, 10> kTypeNames = {{
    {LayerType::kConv, "conv"},
    {LayerType::kBatchNorm, "batchnorm"},
    {LayerType::kRelu, "relu"},
    {LayerType::kMaxPool, "maxpool"},
    {LayerType::kAvgPool, "avgpool"},
    {LayerType::kGlobalAvgPool, "global_avgpool"},
    {LayerType::kLinear, "linear"},
    {LayerType::kAdd, "add"},
    {LayerType::kFlatten, "flatten"},
    {LayerType::kDropout, "dropout"},
}};

// Builds layer lists for the presets; each helper returns the name of the layer it ended with.
class Builder {
 public:
  std::string Conv(const std::string& in, const std::string& name, int out, int k, int s, int p) {
    return Add({.name = name, .type = LayerType::kConv, .inputs = {in}, .out = out, .kernel = k,
                .stride = s, .pad = p, .bias = false});
  }
  std::string Bn(const std::string& in, const std::string& name, bool zero_init = false) {
    return Add({.name = name, .type = LayerType::kBatchNorm, .inputs = {in}, .zero_init = zero_init});
  }
  std::string Relu(const std::string& in, const std::string& name) {
    return Add({.name = name, .type = LayerType::kRelu, .inputs = {in}});
  }
  std::string ConvBnRelu(const std::string& in, const std::string& name, int out, int k, int s, int p) {
    return Relu(Bn(Conv(in, name, out, k, s, p), name + "_bn"), name + "_relu");
  }
  std::string Sum(const std::string& a, const std::string& b, const std::string& name) {
    return Add({.name = name, .type = LayerType::kAdd, .inputs = {a, b}});
  }
  std::string Add(LayerSpec spec) {
    layers_.push_back(std::move(spec));
    return layers_.back().name;
  }
  std::vector<LayerSpec> Take() { return std::move(layers_); }

  // Basic residual block (two 3x3 convolutions); projection shortcut when the shape changes.
  std::string BasicBlock(const std::string& in, const std::string& name, int in_ch, int out, int stride) {
    std::string x = ConvBnRelu(in, name + "_conv1", out, 3, stride, 1);
    x = Bn(Conv(x, name + "_conv2", out, 3, 1, 1), name + "_conv2_bn");
    std::string shortcut = in;
    if (stride != 1 || in_ch != out) {
      shortcut = Bn(Conv(in, name + "_proj", out, 1, stride, 0), name + "_proj_bn");
    }
    return Relu(Sum(x, shortcut, name + "_add"), name + "_relu");
  }
  // Bottleneck block (1x1, 3x3 with the stride, 1x1 to 4x the width).
  std::string Bottleneck(const std::string& in, const std::string& name, int in_ch, int width, int stride) {
    std::string x = ConvBnRelu(in, name + "_conv1", width, 1, 1, 0);
    x = ConvBnRelu(x, name + "_conv2", width, 3, stride, 1);
    x = Bn(Conv(x, name + "_conv3", width * 4, 1, 1, 0), name + "_conv3_bn");
    std::string shortcut = in;
    if (stride != 1 || in_ch != width * 4) {
      shortcut = Bn(Conv(in, name + "_proj", width * 4, 1, stride, 0), name + "_proj_bn");
    }
    return Relu(Sum(x, shortcut, name + "_add"), name + "_relu");
  }

 private:
  std::vector<LayerSpec> layers_;
};

std::vector<LayerSpec> LeNet(int classes) {
  Builder b;
  std::string x = b.Add({.name = "conv1", .type = LayerType::kConv, .inputs = {"input"}, .out = 6, .kernel = 5});
  x = b.Relu(x, "relu1");
  x = b.Add({.name = "pool1", .type = LayerType::kMaxPool, .inputs = {x}, .kernel = 2, .stride = 2});
  x = b.Add({.name = "conv2", .type = LayerType::kConv, .inputs = {x}, .out = 16, .kernel = 5});
  x = b.Relu(x, "relu2");
  x = b.Add({.name = "pool2", .type = LayerType::kMaxPool, .inputs = {x}, .kernel = 2, .stride = 2});
  x = b.Add({.name = "flatten", .type = LayerType::kFlatten, .inputs = {x}});
  x = b.Add({.name = "fc1", .type = LayerType::kLinear, .inputs = {x}, .out = 120});
  x = b.Relu(x, "relu3");
  x = b.Add({.name = "fc2", .type = LayerType::kLinear, .inputs = {x}, .out = 84});
  x = b.Relu(x, "relu4");
  b.Add({.name = "fc3", .type = LayerType::kLinear, .inputs = {x}, .out = classes});
  return b.Take();
}

// CIFAR-style ResNet-20: a 3x3 stem, three stages of three basic blocks (16, 32, 64 channels).
std::vector<LayerSpec> ResNet20(int classes) {
  Builder b;
  std::string x = b.ConvBnRelu("input", "stem", 16, 3, 1, 1);
  int in_ch = 16;
  const std::array<int, 3> widths = {16, 32, 64};
  for (int s = 0; s < 3; ++s) {
    for (int i = 0; i < 3; ++i) {
      const int stride = (s > 0 && i == 0) ? 2 : 1;
      x = b.BasicBlock(x, fmt::format("s{}b{}", s + 1, i + 1), in_ch, widths[s], stride);
      in_ch = widths[s];
    }
  }
  x = b.Add({.name = "pool", .type = LayerType::kGlobalAvgPool, .inputs = {x}});
  b.Add({.name = "fc", .type = LayerType::kLinear, .inputs = {x}, .out = classes});
  return b.Take();
}

// ImageNet-style ResNets: 7x7/2 stem + 3x3/2 max pool, four stages, stride on the 3x3.
std::vector<LayerSpec> ImageNetResNet(std::array<int, 4> blocks, bool bottleneck, int classes) {
  Builder b;
  std::string x = b.ConvBnRelu("input", "stem", 64, 7, 2, 3);
  x = b.Add({.name = "stem_pool", .type = LayerType::kMaxPool, .inputs = {x}, .kernel = 3,
             .stride = 2, .pad = 1});
  int in_ch = 64;
  const std::array<int, 4> widths = {64, 128, 256, 512};
  for (int s = 0; s < 4; ++s) {
    for (int i = 0; i < blocks[s]; ++i) {
      const int stride = (s > 0 && i == 0) ? 2 : 1;
      const std::string name = fmt::format("s{}b{}", s + 1, i + 1);
      if (bottleneck) {
        x = b.Bottleneck(x, name, in_ch, widths[s], stride);
        in_ch = widths[s] * 4;
      } else {
        x = b.BasicBlock(x, name, in_ch, widths[s], stride);
        in_ch = widths[s];
      }
    }
  }
  x = b.Add({.name = "pool", .type = LayerType::kGlobalAvgPool, .inputs = {x}});
  b.Add({.name = "fc", .type = LayerType::kLinear, .inputs = {x}, .out = classes});
  return b.Take();
}

int Out(int in, int kernel, int stride, int pad) { return (in + 2 * pad - kernel) / stride + 1; }

}  // namespace

std::string_view LayerTypeName(LayerType type) {
  for (const auto& [t, name] : kTypeNames) {
    if (t == type) return name;
  }
  return "?";
}

Result<LayerType> ParseLayerType(std::string_view name) {
  std::string known;
  for (const auto& [t, n] : kTypeNames) {
    if (n == name) return t;
    known += known.empty() ? "" : ", ";
    known += n;
  }
  return InvalidArgumentError(fmt::format("unknown layer type '{}'; expected one of: {}", name, known));
}

std::vector<std::string> PresetNames() { return {"lenet", "resnet20", "resnet18", "resnet34", "resnet50"}; }

Result<std::vector<LayerSpec>> ExpandPreset(std::string_view preset, int classes) {
  if (classes < 1) return InvalidArgumentError(fmt::format("classes must be >= 1, got {}", classes));
  if (preset == "lenet") return LeNet(classes);
  if (preset == "resnet20") return ResNet20(classes);
  if (preset == "resnet18") return ImageNetResNet({2, 2, 2, 2}, false, classes);
  if (preset == "resnet34") return ImageNetResNet({3, 4, 6, 3}, false, classes);
  if (preset == "resnet50") return ImageNetResNet({3, 4, 6, 3}, true, classes);
  return InvalidArgumentError(fmt::format("unknown preset '{}'; expected one of: {}", preset,
                                          fmt::join(PresetNames(), ", ")));
}

Result<std::vector<Shape>> ResolveModel(ModelSpec& model, Shape input) {
  if (model.layers.empty()) return InvalidArgumentError("the model has no layers");
  if (model.classes < 2) {
    // With one class the loss is always zero: there would be nothing to learn.
    return InvalidArgumentError(fmt::format("the model needs classes >= 2, got {}", model.classes));
  }
  std::map<std::string, int> index;  // layer name -> position; "input" -> -1
  index["input"] = -1;
  std::vector<Shape> shapes;
  auto shape_of = [&](int i) { return i < 0 ? input : shapes[static_cast<size_t>(i)]; };
  for (size_t i = 0; i < model.layers.size(); ++i) {
    LayerSpec& l = model.layers[i];
    if (l.name.empty()) l.name = fmt::format("{}{}", LayerTypeName(l.type), i);
    auto fail = [&](const std::string& what) {
      return InvalidArgumentError(fmt::format("layer {} ('{}', {}): {}", i, l.name, LayerTypeName(l.type), what));
    };
    if (index.count(l.name)) return fail("the name is already used by an earlier layer (or is 'input')");
    if (l.inputs.empty()) l.inputs.push_back(i == 0 ? "input" : model.layers[i - 1].name);
    const size_t want_inputs = l.type == LayerType::kAdd ? 2 : 1;
    if (l.inputs.size() != want_inputs) {
      return fail(fmt::format("takes {} input(s), {} given", want_inputs, l.inputs.size()));
    }
    std::vector<Shape> in;
    for (const std::string& name : l.inputs) {
      auto it = index.find(name);
      if (it == index.end()) {
        return fail(fmt::format("input '{}' is not 'input' or the name of an earlier layer", name));
      }
      in.push_back(shape_of(it->second));
    }
    const Shape x = in[0];
    Shape y = x;
    switch (l.type) {
      case LayerType::kConv:
      case LayerType::kMaxPool:
      case LayerType::kAvgPool: {
        const bool conv = l.type == LayerType::kConv;
        if (x.vector) return fail("needs a C x H x W input, but its input is a vector (from linear or flatten)");
        if (l.stride == 0) l.stride = conv ? 1 : l.kernel;
        if (conv && l.out < 1) return fail(fmt::format("out (channels) must be >= 1, got {}", l.out));
        if (l.kernel < 1 || l.stride < 1 || l.pad < 0 || l.pad >= l.kernel) {
          return fail(fmt::format("need kernel >= 1, stride >= 1 and 0 <= pad < kernel; got kernel {}, "
                                  "stride {}, pad {}", l.kernel, l.stride, l.pad));
        }
        if (x.h + 2 * l.pad < l.kernel || x.w + 2 * l.pad < l.kernel) {
          return fail(fmt::format("kernel {} does not fit its {}x{} input", l.kernel, x.h, x.w));
        }
        y = {conv ? l.out : x.c, Out(x.h, l.kernel, l.stride, l.pad), Out(x.w, l.kernel, l.stride, l.pad)};
        break;
      }
      case LayerType::kGlobalAvgPool:
        if (x.vector) return fail("needs a C x H x W input, but its input is a vector (from linear or flatten)");
        y = {x.c, 1, 1};
        break;
      case LayerType::kLinear:
        if (l.out < 1) return fail(fmt::format("out (features) must be >= 1, got {}", l.out));
        y = {l.out, 1, 1, true};
        break;
      case LayerType::kFlatten:
        y = {static_cast<int>(x.size()), 1, 1, true};
        break;
      case LayerType::kAdd:
        if (in[0] != in[1]) {
          return fail(fmt::format("inputs '{}' ({}x{}x{}) and '{}' ({}x{}x{}) differ in shape", l.inputs[0],
                                  in[0].c, in[0].h, in[0].w, l.inputs[1], in[1].c, in[1].h, in[1].w));
        }
        break;
      case LayerType::kDropout:
        if (!(l.p >= 0 && l.p < 1)) return fail(fmt::format("p must be in [0, 1), got {}", l.p));
        break;
      case LayerType::kBatchNorm:
      case LayerType::kRelu:
        break;
    }
    // Kernels index a sample's values and a layer's weights with 32-bit integers.
    if (y.size() > kMaxLayerElements) {
      return fail(fmt::format("its output is {}x{}x{} = {} values per image; at most {} are supported", y.c, y.h,
                              y.w, y.size(), kMaxLayerElements));
    }
    const int64_t weights = l.type == LayerType::kConv     ? int64_t{l.out} * x.c * l.kernel * l.kernel
                            : l.type == LayerType::kLinear ? int64_t{l.out} * x.size()
                                                           : 0;
    if (weights > kMaxLayerElements) {
      return fail(fmt::format("it has {} weights; at most {} are supported per layer", weights, kMaxLayerElements));
    }
    index[l.name] = static_cast<int>(i);
    shapes.push_back(y);
  }
  // Every layer but the last must feed a later one: an unused output is almost always a
  // misspelt `inputs` entry, and its parameters would never learn.
  std::vector<bool> used(model.layers.size(), false);
  bool learnable = false;
  for (const LayerSpec& l : model.layers) {
    for (const std::string& name : l.inputs) {
      if (const int k = index.at(name); k >= 0) used[static_cast<size_t>(k)] = true;
    }
    learnable = learnable || HasParameters(l.type);
  }
  for (size_t i = 0; i + 1 < model.layers.size(); ++i) {
    if (!used[i]) {
      const LayerSpec& l = model.layers[i];
      return InvalidArgumentError(fmt::format(
          "layer {} ('{}', {}): its output is not an input of any later layer; only the last layer may "
          "end the network (check the `inputs` of the layers after it)",
          i, l.name, LayerTypeName(l.type)));
    }
  }
  if (!learnable) {
    return InvalidArgumentError(
        "the model has no learnable parameters: add a conv, linear or batchnorm layer (there is nothing to train)");
  }
  const Shape last = shapes.back();
  if (!last.vector || last.c != model.classes) {
    return InvalidArgumentError(fmt::format(
        "the last layer ('{}') gives {} {}x{}x{}; the loss needs a vector of {} logits (classes) "
        "from a linear or flatten layer",
        model.layers.back().name, last.vector ? "a vector of" : "an image of", last.c, last.h, last.w,
        model.classes));
  }
  return shapes;
}

bool HasParameters(LayerType type) {
  return type == LayerType::kConv || type == LayerType::kLinear || type == LayerType::kBatchNorm;
}

std::vector<bool> LayersNeedingGradient(const ModelSpec& model) {
  std::map<std::string, size_t> index;
  std::vector<bool> needs(model.layers.size(), false);
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const LayerSpec& l = model.layers[i];
    bool n = HasParameters(l.type);
    for (const std::string& name : l.inputs) {
      auto it = index.find(name);
      if (it != index.end()) n = n || needs[it->second];
    }
    needs[i] = n;
    index[l.name] = i;
  }
  return needs;
}

std::vector<std::vector<int>> LayerReaders(const ModelSpec& model) {
  std::map<std::string, size_t> index;
  std::vector<std::vector<int>> readers(model.layers.size());
  for (size_t i = 0; i < model.layers.size(); ++i) {
    for (const std::string& name : model.layers[i].inputs) {
      if (auto it = index.find(name); it != index.end()) readers[it->second].push_back(static_cast<int>(i));
    }
    index[model.layers[i].name] = i;
  }
  return readers;
}

namespace {
// What makes a layer compute what it computes. A dropout's p is left out: evaluation and export
// skip dropout, and a resumed run may change it as it may change the learning rate.
std::string DescribeLayer(const LayerSpec& l) {
  std::string d(LayerTypeName(l.type));
  switch (l.type) {
    case LayerType::kConv:
      d += fmt::format(" out {} kernel {} stride {} pad {}{}", l.out, l.kernel, l.stride, l.pad, l.bias ? "" : " no bias");
      break;
    case LayerType::kLinear:
      d += fmt::format(" out {}{}", l.out, l.bias ? "" : " no bias");
      break;
    case LayerType::kMaxPool:
    case LayerType::kAvgPool:
      d += fmt::format(" kernel {} stride {} pad {}", l.kernel, l.stride, l.pad);
      break;
    default:
      break;
  }
  if (!l.inputs.empty()) d += fmt::format(" of {}", fmt::join(l.inputs, " + "));
  return d;
}
}  // namespace

std::string ModelDifference(const ModelSpec& here, std::string_view here_is, const ModelSpec& other,
                            std::string_view other_is) {
  const size_t n = std::min(here.layers.size(), other.layers.size());
  for (size_t i = 0; i < n; ++i) {
    const LayerSpec &a = here.layers[i], &b = other.layers[i];
    const std::string da = DescribeLayer(a), db = DescribeLayer(b);
    if (a.name != b.name || da != db) {
      return fmt::format("layer {} is '{}' ({}) in {}, '{}' ({}) in {}", i, a.name, da, here_is, b.name, db, other_is);
    }
  }
  if (here.layers.size() != other.layers.size()) {
    return fmt::format("{} has {} layers, {} has {}", here_is, here.layers.size(), other_is, other.layers.size());
  }
  return std::string();
}

std::vector<std::pair<std::string, std::vector<int64_t>>> ModelTensors(const ModelSpec& model,
                                                                      const std::vector<Shape>& shapes, Shape input) {
  std::map<std::string, Shape> by_name{{"input", input}};
  std::vector<std::pair<std::string, std::vector<int64_t>>> wanted;
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const LayerSpec& l = model.layers[i];
    const Shape x = by_name[l.inputs[0]];
    if (l.type == LayerType::kConv || l.type == LayerType::kLinear) {
      std::vector<int64_t> w{l.out, x.c, l.kernel, l.kernel};  // conv: O x I x K x K
      if (l.type == LayerType::kLinear) w = x.vector ? std::vector<int64_t>{l.out, x.c} : std::vector<int64_t>{l.out, x.c, x.h, x.w};
      wanted.push_back({l.name + ".weight", w});
      if (l.bias) wanted.push_back({l.name + ".bias", {l.out}});
    } else if (l.type == LayerType::kBatchNorm) {
      for (const char* suffix : {".weight", ".bias", ".running_mean", ".running_var"}) {
        wanted.push_back({l.name + suffix, {x.c}});
      }
    }
    by_name[l.name] = shapes[i];
  }
  return wanted;
}

int64_t CountParameters(const ModelSpec& model, const std::vector<Shape>& shapes, Shape input) {
  std::map<std::string, Shape> by_name{{"input", input}};
  int64_t total = 0;
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const LayerSpec& l = model.layers[i];
    const Shape x = by_name[l.inputs[0]];
    if (l.type == LayerType::kConv) {
      total += int64_t{l.out} * x.c * l.kernel * l.kernel + (l.bias ? l.out : 0);
    } else if (l.type == LayerType::kLinear) {
      total += int64_t{l.out} * x.size() + (l.bias ? l.out : 0);
    } else if (l.type == LayerType::kBatchNorm) {
      total += 2 * int64_t{x.c};
    }
    by_name[l.name] = shapes[i];
  }
  return total;
}

InitialParameters InitialWeights(const LayerSpec& l, const std::vector<int64_t>& w_dims, uint64_t seed) {
  int64_t fan_in = 1, count = 1;
  for (size_t i = 1; i < w_dims.size(); ++i) fan_in *= w_dims[i];
  for (auto d : w_dims) count *= d;
  const bool conv = l.type == LayerType::kConv;
  SplitMix64 rng(seed);
  InitialParameters p;
  p.weight.resize(static_cast<size_t>(count));
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  if (conv) {
    const double std_dev = std::sqrt(2.0 / static_cast<double>(l.out * l.kernel * l.kernel));
    for (auto& v : p.weight) {
      const double u1 = 1.0 - Uniform01(rng), u2 = Uniform01(rng);
      v = static_cast<float>(std_dev * std::sqrt(-2 * std::log(u1)) * std::cos(2 * std::numbers::pi * u2));
    }
  } else {
    for (auto& v : p.weight) v = static_cast<float>(Uniform(rng, -bound, bound));
  }
  if (l.bias) {
    p.bias.assign(static_cast<size_t>(l.out), 0.f);
    if (!conv) {
      for (auto& v : p.bias) v = static_cast<float>(Uniform(rng, -bound, bound));
    }
  }
  return p;
}

}  // namespace stoke::train
