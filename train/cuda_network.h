// The CUDA backend: the CPU backend's layers and optimizer on one GPU. Activations are NHWC in the
// compute precision (float32, bfloat16, or float16 with dynamic loss scaling), parameters keep
// float32 master copies. Convolutions (forward, backward data, backward filter), batch norm in
// training, ReLU, residual adds and pooling are cuDNN graph operations with execution plans chosen
// once per shape; fully connected layers are cuBLAS GEMMs; input normalisation, softmax
// cross-entropy, the SGD update, bias, flatten and dropout steps are stoke's own kernels. Where
// cuDNN has no engine for a batch-norm, ReLU, add or pooling shape, the layer runs on stoke's own
// kernel instead and FallbackKernels() names it.
//
// Batches come straight from the prefetch ring's device buffers (Batch::device_images) after the
// ring's copy event; batches in host memory are uploaded. Compiled only when the CUDA toolkit is
// found (STOKE_WITH_CUDA); CudaAvailable() says whether a GPU can be used.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "train/network.h"

namespace stoke::train {

// OK when the CUDA backend is built and a GPU is usable; otherwise kUnavailable saying why.
Status CudaAvailable();

class CudaNetwork final : public Network {
 public:
  // Resolves the model, builds every cuDNN plan (cached per shape), allocates the activations and
  // initialises the parameters exactly as the CPU backend does for the same seed.
  // kInvalidArgument for a bad model or options, kUnavailable without a GPU, kInternal when CUDA,
  // cuDNN or cuBLAS fail (naming the layer), kResourceExhausted when memory runs out. No method
  // throws: what a library throws comes back as an error.
  static Result<std::unique_ptr<CudaNetwork>> Create(NetworkOptions options);
  ~CudaNetwork() override;

  std::string_view backend() const override { return "cuda"; }
  const NetworkOptions& options() const override;
  Result<BatchStats> TrainStep(const prefetch::Batch& batch, float lr, const SgdOptions& sgd,
                               int64_t step) override;
  Result<BatchStats> Evaluate(const prefetch::Batch& batch) override;
  Result<std::vector<NamedTensor>> State() const override;
  Status LoadState(const std::vector<NamedTensor>& state) override;
  void* stream() const override;
  double LastInputWaitSeconds() const override;
  std::vector<float> LastLogits() const override;
  // Data-parallel with NCCL (loaded at run time; see train/cuda/nccl.h): gradients averaged on
  // their own stream while backward runs; with model.sync_batchnorm, batch norm's per-channel sums
  // added over the ranks in both passes. kUnavailable without NCCL.
  Status SetStepSync(StepSync* sync) override;
  Status AverageRunningStats() override;

  // For parity tests: forward + backward on a normalised float input (batch x 3 x H x W, plain
  // NCHW, cast to the compute precision) in training mode; parameters unchanged.
  Result<BatchStats> ForwardBackward(std::span<const float> input, std::span<const int32_t> labels, int64_t step);
  // Gradients of the last ForwardBackward/TrainStep, plain layout, named like the parameters.
  Result<std::vector<NamedTensor>> Gradients() const;
  // What cuDNN autotuning (NetworkOptions::autotune) measured at creation: shapes timed, engines
  // changed, one step's convolution time before and after; "" when it did not run.
  const std::string& AutotuneSummary() const;
  struct AutotuneCounts {
    int timed = 0, changed = 0;
    int reused = 0;  // decided by an earlier network of this process
    int single = 0;  // one usable engine
  };
  AutotuneCounts Autotuned() const;
  // Batch norm + ReLU pairs running as stoke's fused kernels (NetworkOptions::fuse_bn_relu).
  int FusedBatchNormRelu() const;
  // Channels of the input on the device: NetworkOptions::input_channels where it applies
  // (cuda::DeviceInputChannels: bfloat16 or float16, only convolutions reading the input), else 3.
  int InputChannels() const;
  // "layer: operation" for each step running on stoke's own kernel because cuDNN had no engine.
  const std::vector<std::string>& FallbackKernels() const;
  // "layer: operation" for each cuDNN step whose only engines cuDNN marks non-deterministic.
  const std::vector<std::string>& NondeterministicSteps() const;
  // "layer: operation" for each float32 step whose only cuDNN engines round inputs to TF32.
  const std::vector<std::string>& RoundedFloat32Steps() const;
  // Float16: the current loss scale and the updates skipped for overflowing gradients.
  float loss_scale() const;
  int64_t skipped_steps() const;

  // A timeline on the device's clock (stoke bench train --timeline): StartTimeline() marks time 0
  // on the network's stream; after each TrainStep, LastStepTimeline(batch) gives that step's
  // compute (from the batch being ready to the step's end) and the interval in which the batch's
  // host-to-device copy ran (the ring's timing events; NaN for a batch uploaded from the host),
  // in milliseconds from the mark. Call it while the batch is still held, right after a TrainStep
  // that succeeded; the batch must come from a loader on the network's device.
  Status StartTimeline();
  Result<StepTimeline> LastStepTimeline(const prefetch::Batch& batch) const;

  struct Impl;

 private:
  explicit CudaNetwork(std::unique_ptr<Impl> impl);
  static Result<std::unique_ptr<CudaNetwork>> CreateUnguarded(NetworkOptions options);
  std::unique_ptr<Impl> impl_;
};

}  // namespace stoke::train
