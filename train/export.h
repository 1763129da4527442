// ONNX export of a trained model: the layer list becomes an ONNX graph (opset 17) built with ONNX's
// own protobuf classes and checked by ONNX's checker and strict shape inference before it is written.
// Batch norm after a convolution or linear layer that feeds nothing else is folded into its weights;
// dropout disappears; the class names and the input normalisation travel as metadata. With
// `uint8_input` the graph takes the loader's uint8 NHWC RGB pixels and normalises them itself.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "augment/transform.h"
#include "common/status.h"
#include "train/model.h"
#include "train/network.h"

namespace stoke::train {

inline constexpr int kOnnxOpset = 17;

struct ExportOptions {
  // false: input "input", float32 N x 3 x H x W, already normalised ((x / 255 - mean) / std).
  // true: input "image", uint8 N x H x W x 3 (RGB, as stoke's loader writes its batches); the graph
  // casts, transposes and normalises.
  bool uint8_input = false;
  bool fold_batchnorm = true;  // false keeps every BatchNormalization node (for checks)
};

// What the exporter needs to know about a trained model.
struct ExportSource {
  ModelSpec model;                 // as configured; resolved against the input by ExportOnnx
  int image_width = 224, image_height = 224;
  augment::NormalizeOptions normalize;
  double bn_epsilon = 1e-5;
  std::vector<std::string> classes;  // model.classes names ("0", "1", ... when unknown)
  std::vector<NamedTensor> state;    // Network::State() or a checkpoint's tensors
  int val_resize = 256;              // informative metadata: the evaluation crop's resize
  int64_t step = 0;                  // informative metadata
  std::string origin;                // checkpoint file (for messages and metadata)
};

struct ExportReport {
  std::string bytes;          // the serialised ModelProto
  int nodes = 0;
  int initializers = 0;
  int folded_batchnorms = 0;  // folded into the convolution or linear layer before them
  int kept_batchnorms = 0;    // exported as BatchNormalization (nothing to fold into)
  int removed_dropouts = 0;
  int64_t parameters = 0;     // floats in the initializers
  std::string input_name, output_name;
};

// Builds, checks (onnx::checker and strict shape inference: the output must come out as
// N x classes) and serialises the model. kInvalidArgument naming the layer or tensor that cannot be
// exported (a missing or mis-shaped tensor, a layer the model resolution refuses); kInternal when
// ONNX's checker refuses the graph (a bug in stoke, with the checker's words).
Result<ExportReport> ExportOnnx(const ExportSource& source, const ExportOptions& options);

// ExportOnnx, then writes the file atomically.
Result<ExportReport> WriteOnnx(const ExportSource& source, const ExportOptions& options,
                               const std::filesystem::path& path);

}  // namespace stoke::train
