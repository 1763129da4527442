// The backend interface: a model built for one batch shape that normalises uint8 batches, runs
// forward/backward, applies SGD and exposes its state for checkpoints. The CPU backend (oneDNN)
// implements it in cpu_network.h; the CUDA backend plugs into the same interface.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "augment/transform.h"
#include "common/status.h"
#include "prefetch/loader.h"
#include "train/model.h"

namespace stoke::train {

// Arithmetic of the backend: float32 everywhere (the reference), or mixed precision with float32
// master weights: bfloat16, or float16 with dynamic loss scaling. The CPU backend trains in float32.
enum class Precision { kFloat32, kBFloat16, kFloat16 };
std::string_view PrecisionName(Precision p);

struct NetworkOptions {
  ModelSpec model;  // resolved against `input` (ResolveModel) by Create
  int image_size = 32;    // input width, and height unless image_height is set
  int image_height = 0;   // input height when it differs from the width; 0: square
  int height() const { return image_height > 0 ? image_height : image_size; }
  int batch = 64;       // samples per step (training batches must be full)
  augment::NormalizeOptions normalize;  // the backend's first step: mean/std, dtype, layout
  double label_smoothing = 0;           // [0, 1)
  double bn_momentum = 0.1;             // running statistics: r = (1 - m) r + m batch
  double bn_epsilon = 1e-5;
  uint64_t seed = 0;  // parameter initialisation and dropout masks
  int threads = 0;    // compute threads; 0 = every core (CPU backend)
  Precision precision = Precision::kFloat32;
  int device = 0;  // CUDA backend: the GPU
};

struct SgdOptions {
  double momentum = 0.9;  // [0, 1)
  bool nesterov = false;
  double weight_decay = 0;           // L2, added to the gradient
  bool decay_bn_and_bias = false;    // false: no weight decay on BN scale/shift and biases
};

// Sums over the samples of one batch (or of several, with +=).
struct BatchStats {
  double loss_sum = 0;  // cross-entropy (with label smoothing) summed over samples
  int64_t top1 = 0;     // samples whose label is the arg-max
  int64_t top5 = 0;     // samples whose label is among the 5 largest logits
  int64_t count = 0;
  BatchStats& operator+=(const BatchStats& o) {
    loss_sum += o.loss_sum;
    top1 += o.top1;
    top5 += o.top5;
    count += o.count;
    return *this;
  }
  double loss() const { return count ? loss_sum / static_cast<double>(count) : 0; }
  double top1_rate() const { return count ? static_cast<double>(top1) / static_cast<double>(count) : 0; }
  double top5_rate() const { return count ? static_cast<double>(top5) / static_cast<double>(count) : 0; }
};

// One named tensor of the network's state, in a plain row-major layout (weights O x I x KH x KW,
// linear O x I, vectors). Names: "<layer>.weight", ".bias", ".running_mean", ".running_var",
// and "<param>.momentum" for the optimizer's buffers.
struct NamedTensor {
  std::string name;
  std::vector<int64_t> dims;
  std::vector<float> values;
};

class Network {
 public:
  virtual ~Network() = default;
  virtual std::string_view backend() const = 0;
  virtual const NetworkOptions& options() const = 0;

  // One training step on a full batch: normalise, forward, loss, backward, SGD with `lr`.
  // `step` keys the dropout masks. Statistics are of the forward pass before the update.
  virtual Result<BatchStats> TrainStep(const prefetch::Batch& batch, float lr, const SgdOptions& sgd,
                                       int64_t step) = 0;
  // Forward in evaluation mode (running BN statistics, no dropout) on up to `batch` samples.
  virtual Result<BatchStats> Evaluate(const prefetch::Batch& batch) = 0;

  // Every parameter, running statistic and momentum buffer, plain layout. Fails only when the
  // backend cannot read them back (out of memory, a device error).
  virtual Result<std::vector<NamedTensor>> State() const = 0;
  // Loads a State(); kInvalidArgument naming the first missing or mis-shaped tensor.
  virtual Status LoadState(const std::vector<NamedTensor>& state) = 0;

  // Device backends: the stream their work runs on (a cudaStream_t), for handing batches back to
  // the prefetch ring; nullptr for host backends.
  virtual void* stream() const { return nullptr; }
  // Device backends: how long the device sat idle before the last TrainStep's batch was ready,
  // measured with events on its stream (the trainer's data-wait); < 0 when not measured.
  virtual double LastInputWaitSeconds() const { return -1; }
  // Logits of the last TrainStep/Evaluate/ForwardBackward (batch x classes, row-major).
  virtual std::vector<float> LastLogits() const = 0;
};

// A batch fits the network: its image size, at most (or, with `full`, exactly) `batch` samples, and
// labels within the classes (naming the record). kInvalidArgument otherwise.
Status CheckBatch(const NetworkOptions& options, const prefetch::Batch& batch, bool full);

// Checks that `state` holds every tensor in `wanted` (name, plain dims) with the right size and
// returns them by name; kInvalidArgument naming the first missing or mis-shaped one.
Result<std::vector<const NamedTensor*>> FindState(
    const std::vector<NamedTensor>& state, const std::vector<std::pair<std::string, std::vector<int64_t>>>& wanted);

}  // namespace stoke::train
