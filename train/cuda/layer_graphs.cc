#include "train/cuda/layer_graphs.h"

#include <algorithm>
#include <map>

namespace stoke::train::cuda {
namespace {

TensorSpec Act(cudnnDataType_t t, const Dims4& d) { return Nhwc(0, t, d[0], d[1], d[2], d[3]); }

OpSpec Op(OpSpec::Kind kind, std::vector<TensorSpec> tensors, int64_t pad = 0, int64_t stride = 1,
          int64_t window = 1, bool max = false) {
  OpSpec op;
  op.kind = kind;
  op.tensors = std::move(tensors);
  op.pad = pad;
  op.stride = stride;
  op.window = window;
  op.max_pool = max;
  return op;
}

}  // namespace

cudnnDataType_t CudnnType(Precision p) {
  return p == Precision::kFloat32 ? CUDNN_DATA_FLOAT : p == Precision::kFloat16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
}

ConvGraphs ConvOps(cudnnDataType_t t, const Dims4& x, const Dims4& y, const LayerSpec& l) {
  const TensorSpec w = Nhwc(0, t, l.out, x[1], l.kernel, l.kernel);  // K x R x S x C
  using K = OpSpec::Kind;
  return {Op(K::kConvForward, {Act(t, x), w, Act(t, y)}, l.pad, l.stride),
          Op(K::kConvBackwardFilter, {Act(t, x), Act(t, y), w}, l.pad, l.stride),
          Op(K::kConvBackwardData, {Act(t, y), w, Act(t, x)}, l.pad, l.stride)};
}

PairOps BatchNormOps(cudnnDataType_t t, const Dims4& x) {
  const TensorSpec v = ChannelVector(0, x[1]);
  return {Op(OpSpec::Kind::kBatchNormTrain, {Act(t, x), v, v, Scalar(0), Scalar(0), v, v, v, v, v, v, Act(t, x)}),
          Op(OpSpec::Kind::kBatchNormBackward, {Act(t, x), Act(t, x), v, v, v, v, v, Act(t, x)})};
}

PairOps ReluOps(cudnnDataType_t t, const Dims4& x) {
  return {Op(OpSpec::Kind::kRelu, {Act(t, x), Act(t, x)}),
          Op(OpSpec::Kind::kReluBackward, {Act(t, x), Act(t, x), Act(t, x)})};
}

OpSpec AddOp(cudnnDataType_t t, const Dims4& x) { return Op(OpSpec::Kind::kAdd, {Act(t, x), Act(t, x), Act(t, x)}); }

PairOps PoolOps(cudnnDataType_t t, const Dims4& x, const Dims4& y, int64_t window, int64_t stride, int64_t pad,
                bool max) {
  std::vector<TensorSpec> f{Act(t, x), Act(t, y)}, b{Act(t, y), Act(t, x)};
  if (max) {
    f.push_back(Nhwc(0, CUDNN_DATA_INT8, y[0], y[1], y[2], y[3]));
    b.push_back(f.back());
  }
  return {Op(OpSpec::Kind::kPool, std::move(f), pad, stride, window, max),
          Op(OpSpec::Kind::kPoolBackward, std::move(b), pad, stride, window, max)};
}

int64_t DeviceInputChannels(const ModelSpec& model, Precision precision, int wanted) {
  if (wanted == 3 || precision == Precision::kFloat32) return 3;
  const bool only_convolutions = std::none_of(model.layers.begin(), model.layers.end(), [](const LayerSpec& l) {
    return l.type != LayerType::kConv && std::find(l.inputs.begin(), l.inputs.end(), "input") != l.inputs.end();
  });
  return only_convolutions ? wanted : 3;
}

std::vector<std::pair<std::string, OpSpec>> ModelGraphs(const ModelSpec& model, const std::vector<Shape>& shapes,
                                                         int batch, int image_size, Precision precision,
                                                         int input_channels) {
  const cudnnDataType_t t = CudnnType(precision);
  const int64_t c = DeviceInputChannels(model, precision, input_channels);
  std::map<std::string, Dims4> dims{{"input", Dims4{batch, c, image_size, image_size}}};
  // A convolution's backward-data graph is planned only where its input needs a gradient (not the
  // network input, nor a layer with nothing learnable upstream of it).
  const std::vector<bool> needs_grad = LayersNeedingGradient(model);
  std::map<std::string, bool> grad_of{{"input", false}};
  std::vector<std::pair<std::string, OpSpec>> out;
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const LayerSpec& l = model.layers[i];
    const Shape& s = shapes[i];
    const Dims4 x = dims[l.inputs[0]];
    const Dims4 y{batch, s.c, s.h, s.w};
    dims[l.name] = y;
    grad_of[l.name] = needs_grad[i];
    auto add = [&](const char* what, OpSpec op) { out.emplace_back(l.name + ": " + what, std::move(op)); };
    switch (l.type) {
      case LayerType::kConv: {
        ConvGraphs g = ConvOps(t, x, y, l);
        add("convolution forward", std::move(g.forward));
        add("convolution backward filter", std::move(g.backward_filter));
        if (grad_of.at(l.inputs[0])) add("convolution backward data", std::move(g.backward_data));
        break;
      }
      case LayerType::kBatchNorm: {
        PairOps g = BatchNormOps(t, x);
        add("batch norm forward", std::move(g.forward));
        add("batch norm backward", std::move(g.backward));
        break;
      }
      case LayerType::kRelu: {
        PairOps g = ReluOps(t, x);
        add("relu forward", std::move(g.forward));
        add("relu backward", std::move(g.backward));
        break;
      }
      case LayerType::kMaxPool:
      case LayerType::kAvgPool:
      case LayerType::kGlobalAvgPool: {
        const bool global = l.type == LayerType::kGlobalAvgPool;
        PairOps g = PoolOps(t, x, y, global ? x[2] : l.kernel, global ? x[2] : l.stride, global ? 0 : l.pad,
                            l.type == LayerType::kMaxPool);
        add("pooling forward", std::move(g.forward));
        add("pooling backward", std::move(g.backward));
        break;
      }
      case LayerType::kAdd:
        add("add", AddOp(t, x));
        break;
      case LayerType::kLinear:
      case LayerType::kFlatten:
      case LayerType::kDropout:
        break;
    }
  }
  return out;
}

}  // namespace stoke::train::cuda
