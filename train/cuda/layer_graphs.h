// The cuDNN graphs of each layer, built from the layer and its activation shapes alone: the CUDA
// backend plans and runs them, and ModelGraphs lists a whole model's so that tests (and machines
// without a GPU) can have cuDNN check every descriptor the backend would build.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "train/cuda/cudnn_graph.h"
#include "train/model.h"
#include "train/network.h"

namespace stoke::train::cuda {

using Dims4 = std::array<int64_t, 4>;  // n, c, h, w of an NHWC activation

cudnnDataType_t CudnnType(Precision p);

struct ConvGraphs {
  OpSpec forward, backward_filter, backward_data;
};
ConvGraphs ConvOps(cudnnDataType_t t, const Dims4& x, const Dims4& y, const LayerSpec& l);
// Training forward and backward.
struct PairOps {
  OpSpec forward, backward;
};
PairOps BatchNormOps(cudnnDataType_t t, const Dims4& x);
PairOps ReluOps(cudnnDataType_t t, const Dims4& x);
OpSpec AddOp(cudnnDataType_t t, const Dims4& x);
// Square windows only; max pooling carries cuDNN's int8 index tensor.
PairOps PoolOps(cudnnDataType_t t, const Dims4& x, const Dims4& y, int64_t window, int64_t stride, int64_t pad,
                bool max);

// The channels of the input on the device for NetworkOptions::input_channels `wanted`: `wanted`
// where the precision has tensor-core engines (not float32) and only convolutions read the input
// (they keep zero weights for the added channels; other layers would see them), else 3.
int64_t DeviceInputChannels(const ModelSpec& model, Precision precision, int wanted);

// Every graph of a resolved model at `batch` (names "layer: operation"), in the order the backend
// builds them, with the input on the device in DeviceInputChannels(model, precision,
// input_channels) channels. Layers with no cuDNN graph (linear, flatten, dropout) contribute none.
std::vector<std::pair<std::string, OpSpec>> ModelGraphs(const ModelSpec& model, const std::vector<Shape>& shapes,
                                                         int batch, int image_size, Precision precision,
                                                         int input_channels = 3);

}  // namespace stoke::train::cuda
