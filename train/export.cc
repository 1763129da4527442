#include "train/export.h"

#include <cmath>
#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <set>
#include <span>
#include <unordered_map>
#include <variant>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <onnx/checker.h>
#include <onnx/onnx_pb.h>
#include <onnx/shape_inference/implementation.h>

#include "common/file_util.h"

namespace stoke::train {
namespace {

// A tensor of the graph being built: its name and rank (4: N x C x H x W, 2: N x F).
struct Value {
  std::string name;
  int rank = 4;
};

class GraphBuilder {
 public:
  explicit GraphBuilder(onnx::GraphProto* g) : g_(g) {}

  // Node names must be unique too (ONNX Runtime refuses a graph where two are not): a layer may be
  // named like a helper node ("fc_flatten", "normalize_scale", "logits"), so a taken name gets
  // a "_k" suffix.
  onnx::NodeProto* Node(const std::string& op, const std::vector<std::string>& inputs, const std::string& output,
                        const std::string& name) {
    onnx::NodeProto* n = g_->add_node();
    n->set_op_type(op);
    std::string unique = name;
    for (int k = 1; !node_names_.insert(unique).second; ++k) unique = fmt::format("{}_{}", name, k);
    n->set_name(unique);
    for (const std::string& in : inputs) n->add_input(in);
    n->add_output(output);
    ++nodes;
    return n;
  }

  static void Ints(onnx::NodeProto* n, const std::string& name, const std::vector<int64_t>& values) {
    onnx::AttributeProto* a = n->add_attribute();
    a->set_name(name);
    a->set_type(onnx::AttributeProto::INTS);
    for (int64_t v : values) a->add_ints(v);
  }
  static void Int(onnx::NodeProto* n, const std::string& name, int64_t value) {
    onnx::AttributeProto* a = n->add_attribute();
    a->set_name(name);
    a->set_type(onnx::AttributeProto::INT);
    a->set_i(value);
  }
  static void Float(onnx::NodeProto* n, const std::string& name, float value) {
    onnx::AttributeProto* a = n->add_attribute();
    a->set_name(name);
    a->set_type(onnx::AttributeProto::FLOAT);
    a->set_f(value);
  }

  // A float32 constant, stored little-endian in raw_data (the compact form every reader accepts).
  void Initializer(const std::string& name, const std::vector<int64_t>& dims, const std::vector<float>& values) {
    onnx::TensorProto* t = g_->add_initializer();
    t->set_name(name);
    t->set_data_type(onnx::TensorProto::FLOAT);
    for (int64_t d : dims) t->add_dims(d);
    std::string raw(values.size() * sizeof(float), '\0');
    std::memcpy(raw.data(), values.data(), raw.size());  // x86-64 and aarch64: little-endian
    t->set_raw_data(std::move(raw));
    ++initializers;
    parameters += static_cast<int64_t>(values.size());
  }

  int nodes = 0, initializers = 0;
  int64_t parameters = 0;

 private:
  onnx::GraphProto* g_;
  std::set<std::string> node_names_;
};

void DeclareTensor(onnx::ValueInfoProto* v, const std::string& name, int32_t elem_type,
                   const std::vector<std::variant<int64_t, std::string>>& dims) {
  v->set_name(name);
  onnx::TypeProto_Tensor* t = v->mutable_type()->mutable_tensor_type();
  t->set_elem_type(elem_type);
  onnx::TensorShapeProto* shape = t->mutable_shape();
  for (const auto& d : dims) {
    onnx::TensorShapeProto_Dimension* dim = shape->add_dim();
    if (std::holds_alternative<int64_t>(d)) {
      dim->set_dim_value(std::get<int64_t>(d));
    } else {
      dim->set_dim_param(std::get<std::string>(d));
    }
  }
}

std::string JsonFloats(std::span<const float> values) {
  nlohmann::json j = nlohmann::json::array();
  for (float v : values) j.push_back(v);
  return j.dump();
}

}  // namespace

Result<ExportReport> ExportOnnx(const ExportSource& source, const ExportOptions& options) {
  ModelSpec model = source.model;
  const Shape input_shape{3, source.image_height, source.image_width};
  auto shapes_or = ResolveModel(model, input_shape);
  if (!shapes_or.ok()) {
    return InvalidArgumentError(fmt::format("cannot export {}: {}", source.origin, shapes_or.status().message()));
  }
  const std::vector<Shape>& shapes = *shapes_or;
  const size_t n_layers = model.layers.size();
  if (!source.classes.empty() && static_cast<int>(source.classes.size()) != model.classes) {
    return InvalidArgumentError(fmt::format("cannot export {}: {} class names for a model of {} classes", source.origin,
                                            source.classes.size(), model.classes));
  }

  // Every tensor the model needs, with its shape, before anything is built.
  const auto found = FindState(source.state, ModelTensors(model, shapes, input_shape));
  if (!found.ok()) {
    return InvalidArgumentError(fmt::format("cannot export {}: {}", source.origin, found.status().message()));
  }
  std::unordered_map<std::string, const NamedTensor*> by_name;
  for (const NamedTensor* t : *found) by_name[t->name] = t;
  auto tensor = [&](size_t layer, const char* suffix) { return by_name.at(model.layers[layer].name + suffix); };

  // The layers each layer reads (-1: the network input), and the layers reading each one.
  std::unordered_map<std::string, int> index{{"input", -1}};
  std::vector<std::vector<int>> inputs(n_layers);
  for (size_t i = 0; i < n_layers; ++i) {
    for (const std::string& name : model.layers[i].inputs) inputs[i].push_back(index.at(name));
    index[model.layers[i].name] = static_cast<int>(i);
  }
  const std::vector<std::vector<int>> readers = LayerReaders(model);

  ExportReport report;
  onnx::ModelProto proto;
  proto.set_ir_version(onnx::IR_VERSION);
  proto.set_producer_name("stoke");
  proto.set_producer_version(STOKE_VERSION);
  proto.set_model_version(source.step);
  onnx::OperatorSetIdProto* opset = proto.add_opset_import();
  opset->set_domain("");
  opset->set_version(kOnnxOpset);
  onnx::GraphProto* g = proto.mutable_graph();
  g->set_name(model.preset.empty() ? "stoke_model" : model.preset);
  GraphBuilder b(g);

  // Every tensor name in the graph is unique: a layer's output, weight or helper tensor takes its
  // natural name ("conv1", "conv1.weight", "fc_flat") unless an earlier tensor or the graph's own
  // names hold it already, and then the first free "<name>_<k>".
  std::set<std::string> used = {"input", "image", "logits", "image_f32", "image_nchw", "image_scaled",
                                "normalize_scale", "normalize_shift"};
  auto unique = [&](const std::string& base) {
    std::string name = base;
    for (int k = 1; used.count(name) != 0; ++k) name = fmt::format("{}_{}", base, k);
    used.insert(name);
    return name;
  };

  // ---- the input
  const auto H = static_cast<int64_t>(source.image_height), W = static_cast<int64_t>(source.image_width);
  Value network_input;
  if (options.uint8_input) {
    report.input_name = "image";
    DeclareTensor(g->add_input(), "image", onnx::TensorProto::UINT8, {std::string("N"), H, W, int64_t{3}});
    onnx::NodeProto* cast = b.Node("Cast", {"image"}, "image_f32", "normalize_cast");
    GraphBuilder::Int(cast, "to", onnx::TensorProto::FLOAT);
    onnx::NodeProto* tr = b.Node("Transpose", {"image_f32"}, "image_nchw", "normalize_transpose");
    GraphBuilder::Ints(tr, "perm", {0, 3, 1, 2});
    // The loader's arithmetic exactly: x * (1 / (255 std)) + (-mean / std), per channel in float.
    std::vector<float> scale(3), shift(3);
    for (int c = 0; c < 3; ++c) {
      scale[static_cast<size_t>(c)] = 1.0f / (255.0f * source.normalize.std[static_cast<size_t>(c)]);
      shift[static_cast<size_t>(c)] = -source.normalize.mean[static_cast<size_t>(c)] /
                                       source.normalize.std[static_cast<size_t>(c)];
    }
    b.Initializer("normalize_scale", {1, 3, 1, 1}, scale);
    b.Initializer("normalize_shift", {1, 3, 1, 1}, shift);
    b.Node("Mul", {"image_nchw", "normalize_scale"}, "image_scaled", "normalize_scale");
    b.Node("Add", {"image_scaled", "normalize_shift"}, "input", "normalize_shift");
  } else {
    report.input_name = "input";
    DeclareTensor(g->add_input(), "input", onnx::TensorProto::FLOAT, {std::string("N"), int64_t{3}, H, W});
  }
  network_input = {"input", 4};

  // ---- the layers
  std::vector<Value> values(n_layers);
  std::vector<bool> folded(n_layers, false);
  auto in_value = [&](size_t i, size_t k) -> const Value& {
    const int j = inputs[i][k];
    return j < 0 ? network_input : values[static_cast<size_t>(j)];
  };
  const double eps = source.bn_epsilon;
  for (size_t i = 0; i < n_layers; ++i) {
    if (folded[i]) continue;
    const LayerSpec& l = model.layers[i];
    const Value& x = in_value(i, 0);
    // Conv and linear name their output once they know whether a batch norm folds into them.
    const bool weighted = l.type == LayerType::kConv || l.type == LayerType::kLinear;
    const std::string out = weighted || l.type == LayerType::kDropout ? std::string() : unique(l.name);
    switch (l.type) {
      case LayerType::kConv:
      case LayerType::kLinear: {
        const bool conv = l.type == LayerType::kConv;
        const NamedTensor* w = tensor(i, ".weight");
        std::vector<float> weight = w->values;
        std::vector<float> bias(static_cast<size_t>(l.out), 0.f);
        bool has_bias = l.bias;
        if (l.bias) bias = tensor(i, ".bias")->values;
        std::string output;
        size_t target = i;  // the layer whose tensor this node computes
        // A batch norm that is the only reader of this layer folds into it:
        //   w' = w * gamma / sqrt(var + eps),  b' = (b - mean) * gamma / sqrt(var + eps) + beta.
        const std::vector<int>& next = readers[i];
        if (options.fold_batchnorm && next.size() == 1 && inputs[static_cast<size_t>(next[0])].size() == 1 &&
            model.layers[static_cast<size_t>(next[0])].type == LayerType::kBatchNorm) {
          const auto j = static_cast<size_t>(next[0]);
          const NamedTensor *gamma = tensor(j, ".weight"), *beta = tensor(j, ".bias");
          const NamedTensor *mean = tensor(j, ".running_mean"), *var = tensor(j, ".running_var");
          const size_t per_out = weight.size() / static_cast<size_t>(l.out);
          for (size_t o = 0; o < static_cast<size_t>(l.out); ++o) {
            const double k = static_cast<double>(gamma->values[o]) / std::sqrt(static_cast<double>(var->values[o]) + eps);
            for (size_t e = 0; e < per_out; ++e) {
              float& v = weight[o * per_out + e];
              v = static_cast<float>(static_cast<double>(v) * k);
            }
            bias[o] = static_cast<float>((static_cast<double>(bias[o]) - mean->values[o]) * k + beta->values[o]);
          }
          has_bias = true;
          folded[j] = true;
          target = j;
          output = unique(model.layers[j].name);
          ++report.folded_batchnorms;
        }
        if (output.empty()) output = unique(l.name);
        const std::string wname = unique(l.name + ".weight"), bname = has_bias ? unique(l.name + ".bias") : "";
        if (conv) {
          b.Initializer(wname, w->dims, weight);
          if (has_bias) b.Initializer(bname, {l.out}, bias);
          std::vector<std::string> ins{x.name, wname};
          if (has_bias) ins.push_back(bname);
          onnx::NodeProto* n = b.Node("Conv", ins, output, l.name);
          GraphBuilder::Ints(n, "kernel_shape", {l.kernel, l.kernel});
          GraphBuilder::Ints(n, "strides", {l.stride, l.stride});
          GraphBuilder::Ints(n, "pads", {l.pad, l.pad, l.pad, l.pad});
          GraphBuilder::Ints(n, "dilations", {1, 1});
          GraphBuilder::Int(n, "group", 1);
        } else {
          // Linear layers read C x H x W in C, H, W order: ONNX's Flatten of NCHW, then Gemm with
          // the O x (C*H*W) weight (the same floats).
          std::string a = x.name;
          if (x.rank != 2) {
            a = unique(l.name + "_flat");
            onnx::NodeProto* f = b.Node("Flatten", {x.name}, a, l.name + "_flatten");
            GraphBuilder::Int(f, "axis", 1);
          }
          const int64_t features = static_cast<int64_t>(weight.size()) / l.out;
          b.Initializer(wname, {l.out, features}, weight);
          if (has_bias) b.Initializer(bname, {l.out}, bias);
          std::vector<std::string> ins{a, wname};
          if (has_bias) ins.push_back(bname);
          onnx::NodeProto* n = b.Node("Gemm", ins, output, l.name);
          GraphBuilder::Int(n, "transB", 1);
        }
        values[target] = {output, conv ? 4 : 2};
        break;
      }
      case LayerType::kBatchNorm: {
        const NamedTensor *gamma = tensor(i, ".weight"), *beta = tensor(i, ".bias");
        const NamedTensor *mean = tensor(i, ".running_mean"), *var = tensor(i, ".running_var");
        std::vector<std::string> ins{x.name};
        for (const NamedTensor* t : {gamma, beta, mean, var}) {
          ins.push_back(unique(t->name));
          b.Initializer(ins.back(), t->dims, t->values);
        }
        onnx::NodeProto* n = b.Node("BatchNormalization", ins, out, l.name);
        GraphBuilder::Float(n, "epsilon", static_cast<float>(eps));
        values[i] = {out, x.rank};
        ++report.kept_batchnorms;
        break;
      }
      case LayerType::kRelu:
        b.Node("Relu", {x.name}, out, l.name);
        values[i] = {out, x.rank};
        break;
      case LayerType::kMaxPool:
      case LayerType::kAvgPool: {
        const bool max = l.type == LayerType::kMaxPool;
        onnx::NodeProto* n = b.Node(max ? "MaxPool" : "AveragePool", {x.name}, out, l.name);
        GraphBuilder::Ints(n, "kernel_shape", {l.kernel, l.kernel});
        GraphBuilder::Ints(n, "strides", {l.stride, l.stride});
        GraphBuilder::Ints(n, "pads", {l.pad, l.pad, l.pad, l.pad});
        if (!max) GraphBuilder::Int(n, "count_include_pad", 1);  // stoke divides by the whole window
        values[i] = {out, 4};
        break;
      }
      case LayerType::kGlobalAvgPool:
        b.Node("GlobalAveragePool", {x.name}, out, l.name);
        values[i] = {out, 4};
        break;
      case LayerType::kFlatten: {
        onnx::NodeProto* n = b.Node("Flatten", {x.name}, out, l.name);
        GraphBuilder::Int(n, "axis", 1);
        values[i] = {out, 2};
        break;
      }
      case LayerType::kAdd: {
        const Value& y = in_value(i, 1);
        b.Node("Add", {x.name, y.name}, out, l.name);
        values[i] = {out, x.rank};
        break;
      }
      case LayerType::kDropout:
        // Identity at inference: its readers read its input.
        values[i] = x;
        ++report.removed_dropouts;
        break;
    }
  }

  // ---- the output: the last layer's tensor renamed "logits" (an Identity when it is also read
  // elsewhere or is the input itself)
  const Value& last = values[n_layers - 1];
  bool renamed = false;
  for (int k = g->node_size() - 1; k >= 0 && !renamed; --k) {
    onnx::NodeProto* n = g->mutable_node(k);
    if (n->output(0) != last.name) continue;
    bool read = false;
    for (const onnx::NodeProto& other : g->node()) {
      for (const std::string& in : other.input()) read = read || in == last.name;
    }
    if (!read) {
      n->set_output(0, "logits");
      renamed = true;
    }
    break;
  }
  if (!renamed) b.Node("Identity", {last.name}, "logits", "logits");
  report.output_name = "logits";
  onnx::ValueInfoProto* output = g->add_output();
  output->set_name("logits");
  {
    // Rank 2, dimensions left for shape inference to find (checked below).
    onnx::TypeProto_Tensor* t = output->mutable_type()->mutable_tensor_type();
    t->set_elem_type(onnx::TensorProto::FLOAT);
    t->mutable_shape()->add_dim();
    t->mutable_shape()->add_dim();
  }

  // ---- metadata: what a user of the file needs to feed it and read its output
  std::vector<std::string> classes = source.classes;
  if (classes.empty()) {
    for (int c = 0; c < model.classes; ++c) classes.push_back(std::to_string(c));
  }
  auto meta = [&](const std::string& key, const std::string& value) {
    onnx::StringStringEntryProto* e = proto.add_metadata_props();
    e->set_key(key);
    e->set_value(value);
  };
  meta("stoke.classes", nlohmann::json(classes).dump());
  meta("stoke.input", options.uint8_input ? "image: uint8 N x H x W x 3, RGB 0..255; normalised inside the graph"
                                          : "input: float32 N x 3 x H x W, RGB, (x / 255 - mean) / std");
  meta("stoke.layout", options.uint8_input ? "NHWC" : "NCHW");
  meta("stoke.mean", JsonFloats(source.normalize.mean));
  meta("stoke.std", JsonFloats(source.normalize.std));
  meta("stoke.image_height", std::to_string(source.image_height));
  meta("stoke.image_width", std::to_string(source.image_width));
  meta("stoke.val_resize", std::to_string(source.val_resize));
  meta("stoke.preprocess",
       fmt::format("resize the shorter side to {}, centre crop {}x{} (stoke maps the crop to whole source pixels, may "
                   "decode a JPEG at a reduced DCT scale, and resizes with OpenCV: INTER_AREA when shrinking by more "
                   "than 2, else bilinear; other resamplers give slightly different pixels)",
                   source.val_resize, source.image_width, source.image_height));
  meta("stoke.step", std::to_string(source.step));
  if (!model.preset.empty()) meta("stoke.preset", model.preset);
  g->set_doc_string(fmt::format("stoke {} model, {} classes, exported from {}", model.preset.empty() ? "layer-list" : model.preset,
                                model.classes, source.origin));

  // ---- ONNX's own checks: the checker, then strict shape inference must give N x classes
  try {
    onnx::checker::check_model(proto);
    onnx::ModelProto inferred = proto;
    onnx::shape_inference::InferShapes(inferred, onnx::OpSchemaRegistry::Instance(),
                                       onnx::ShapeInferenceOptions(true, 1, false));
    const onnx::TypeProto_Tensor& t = inferred.graph().output(0).type().tensor_type();
    const bool good = t.has_shape() && t.shape().dim_size() == 2 && t.shape().dim(0).dim_param() == "N" &&
                      t.shape().dim(1).dim_value() == model.classes;
    if (!good) {
      std::string got = t.has_shape() ? "" : "unknown";
      for (const auto& d : t.shape().dim()) {
        got += (got.empty() ? "" : " x ") + (d.has_dim_value() ? std::to_string(d.dim_value()) : d.dim_param());
      }
      return InternalError(fmt::format("export of {}: ONNX shape inference gives logits of shape {}, not N x {}",
                                       source.origin, got, model.classes));
    }
  } catch (const std::exception& e) {
    return InternalError(fmt::format("export of {}: ONNX refuses the graph stoke built: {}", source.origin, e.what()));
  }
  output->Clear();
  DeclareTensor(output, "logits", onnx::TensorProto::FLOAT, {std::string("N"), int64_t{model.classes}});

  report.nodes = b.nodes;
  report.initializers = b.initializers;
  report.parameters = b.parameters;
  if (!proto.SerializeToString(&report.bytes)) {
    return InternalError(fmt::format("export of {}: protobuf could not serialise the model", source.origin));
  }
  return report;
}

Result<ExportReport> WriteOnnx(const ExportSource& source, const ExportOptions& options,
                               const std::filesystem::path& path) {
  STOKE_ASSIGN_OR_RETURN(ExportReport report, ExportOnnx(source, options));
  STOKE_RETURN_IF_ERROR(WriteFileAtomic(path, report.bytes));
  return report;
}

}  // namespace stoke::train
