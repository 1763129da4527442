// The CPU backend: every layer is a oneDNN primitive built once for the batch shape. Activations
// stay in the layouts oneDNN's kernels prefer (blocked channels on AVX-512/AVX2); conversions are
// made only where two layers disagree, and parameters are converted to a plain layout only for
// checkpoints. Runs on oneDNN's OpenMP thread team, sized by NetworkOptions::threads.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "train/network.h"

namespace stoke::train {

class CpuNetwork final : public Network {
 public:
  // Resolves the model, creates every primitive and initialises the parameters from the seed
  // (Kaiming-normal convolutions, PyTorch-style uniform linear layers, BN scale 1 / shift 0).
  // kInvalidArgument for a bad model or options (naming them), kInternal if oneDNN refuses a layer
  // (naming it), kResourceExhausted when the batch does not fit in memory (naming the batch size).
  // No method throws: what oneDNN or the allocator throws comes back as an error naming the
  // operation and the layer.
  static Result<std::unique_ptr<CpuNetwork>> Create(NetworkOptions options);
  ~CpuNetwork() override;

  std::string_view backend() const override { return "cpu"; }
  const NetworkOptions& options() const override;
  Result<BatchStats> TrainStep(const prefetch::Batch& batch, float lr, const SgdOptions& sgd,
                               int64_t step) override;
  Result<BatchStats> Evaluate(const prefetch::Batch& batch) override;
  Result<std::vector<NamedTensor>> State() const override;
  Status LoadState(const std::vector<NamedTensor>& state) override;
  std::vector<float> LastLogits() const override;
  // Gradients are averaged in buckets as backward finishes each layer; sync BN when
  // options().sync_batchnorm. Set it on every rank before the first step.
  Status SetStepSync(StepSync* sync) override;
  Status AverageRunningStats() override;

  // For gradient checks: forward + backward on an already normalised input (batch x 3 x H x W,
  // plain NCHW) in training mode, leaving the gradients in place and the parameters unchanged.
  Result<BatchStats> ForwardBackward(std::span<const float> input, std::span<const int32_t> labels,
                                     int64_t step);
  // The gradients of the last ForwardBackward/TrainStep, named like the parameters.
  Result<std::vector<NamedTensor>> Gradients() const;
  // Layers where oneDNN fell back to a reference (unoptimised) kernel: "layer: kind impl". Empty
  // for every preset on AVX2/AVX-512; Create() logs a warning when it is not.
  const std::vector<std::string>& ReferenceKernels() const;

  struct Impl;

 private:
  explicit CpuNetwork(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace stoke::train
