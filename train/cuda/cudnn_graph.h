// A small C++ layer over cuDNN 9's graph (backend) API: descriptors with RAII, tensors, the
// one-operation graphs the CUDA backend uses (convolution forward / backward data / backward
// filter, pointwise ReLU and add, batch norm forward and backward, pooling through resampling),
// execution plans chosen by cuDNN's heuristics and cached per shape, and variant packs built once
// per layer (every buffer of a layer is fixed for the network's lifetime).
//
// Only non-deprecated entry points are used: the project builds this file with
// CUDNN_WARN_DEPRECATED and deprecation warnings as errors. The device comes to the heuristics and
// plans through a device-property descriptor (the handle attributes of graphs and plans are
// deprecated in cuDNN 9).
#pragma once

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace stoke::train::cuda {

Status CudnnError(cudnnStatus_t status, const std::string& what);
// kInternal "CUDA: <what>: <message> (<error name>)".
Status CudaError(cudaError_t rc, std::string_view what);

// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  Desc() = default;
  static Result<Desc> Make(cudnnBackendDescriptorType_t type);
  Desc(Desc&& o) noexcept : d_(o.d_) { o.d_ = nullptr; }
  Desc& operator=(Desc&& o) noexcept;
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  ~Desc();

  cudnnBackendDescriptor_t get() const { return d_; }
  Status Set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count, const void* values);
  Status SetDesc(cudnnBackendAttributeName_t name, const Desc& other);
  Status Finalize(const char* what);

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

// A tensor of a graph: dims and strides in cuDNN's N, C, (H, W) order.
struct TensorSpec {
  int64_t uid = 0;
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  std::vector<int64_t> dims, strides;
  bool by_value = false;  // a host scalar passed at execution (epsilon, momentum)
};
// NHWC activations (n, c, h, w), KRSC filters and (1, c, 1, 1) per-channel vectors.
TensorSpec Nhwc(int64_t uid, cudnnDataType_t type, int64_t n, int64_t c, int64_t h, int64_t w);
TensorSpec ChannelVector(int64_t uid, int64_t c);
TensorSpec Scalar(int64_t uid);

// What one graph computes; `key` identifies the shape for the plan cache.
struct OpSpec {
  enum class Kind { kConvForward, kConvBackwardData, kConvBackwardFilter, kRelu, kReluBackward, kAdd, kBatchNormTrain,
                    kBatchNormBackward, kPool, kPoolBackward };
  Kind kind = Kind::kConvForward;
  // Tensors, by role:
  //   conv forward: x, w, y | backward data: dy, w, dx | backward filter: x, dy, dw
  //   relu: x, y | relu backward: x, dy, dx | add: a, b, y
  //   batch norm train: x, scale, bias, eps, factor, in_mean, in_var, out_mean, out_var, mean, inv_var, y
  //   batch norm backward: x, dy, scale, mean, inv_var, dscale, dbias, dx
  //   pool: x, y [, index] | pool backward: dy, dx [, index]
  std::vector<TensorSpec> tensors;
  int64_t pad = 0, stride = 1, window = 1;  // conv, pool
  bool max_pool = false;
  std::string Key() const;
};
// "convolution forward", "pooling backward", ...: for logs and errors.
std::string_view OpKindName(OpSpec::Kind kind);

// A finalised plan and the workspace it needs.
struct Plan {
  // Every descriptor the plan was made from (tensors, operation, graph, heuristics, engine
  // configurations), kept for the plan's life as cuDNN's own frontend does: the plan is never
  // left pointing at a destroyed one. Declared first, so it is destroyed after the plan.
  std::shared_ptr<void> sources;
  Desc plan;
  int64_t workspace = 0;
  std::string engine;  // "engine N" for reports
  int64_t heuristic_rank = 0;  // its place in the heuristics' list (0: their first choice)
  int64_t engine_index = -1;   // cuDNN's global engine index
  // cuDNN marks the engine non-deterministic (atomics): taken only when no deterministic engine
  // runs the operation, and listed by the network, since the same inputs may then differ in
  // their last bits from run to run.
  bool nondeterministic = false;
  // Float32 only: cuDNN had no engine that keeps float32 inputs, and this one rounds them (TF32
  // tensor cores). Listed by the network, since its results then differ from a float32 reference.
  bool rounds_inputs = false;
};

// What Graphs::Autotune did: convolution shapes timed, how many changed engine, candidates that
// failed on the real buffers, and one step's convolutions (each shape times its uses) with
// heuristics' first choices and with the winners.
struct AutotuneReport {
  int shapes = 0, changed = 0, failed = 0;
  int reused = 0;  // shapes whose engine an earlier network in this process chose
  int single = 0;  // shapes with one usable engine (nothing to time)
  double first_ms = 0, tuned_ms = 0;
  double seconds = 0;  // time spent tuning
};
// A plan and a variant pack that runs it (a layer's bound operation).
struct PlanUse {
  const Plan* plan = nullptr;
  const Desc* pack = nullptr;
};

// Autotuning keeps this many plans per convolution shape, runs each kAutotuneWarmup times untimed
// and then kAutotuneTrials times kAutotuneRuns runs between events (the fastest trial counts),
// never adds a candidate that asks for more workspace than kAutotuneWorkspaceLimit, and replaces
// heuristics' choice only for a gain of kAutotuneMinGain or more (timing noise must not decide).
inline constexpr int kAutotuneCandidates = 6;
inline constexpr int kAutotuneWarmup = 2;
inline constexpr int kAutotuneTrials = 3;
inline constexpr int kAutotuneRuns = 3;
inline constexpr double kAutotuneMinGain = 0.03;
inline constexpr int64_t kAutotuneWorkspaceLimit = int64_t{1} << 30;

class Graphs {
 public:
  // `allow_reduced_precision` false (float32 training) refuses engines that down-convert inputs
  // (TF32), so the float32 backend is a reference. `autotune`: convolutions are timed (Autotune).
  static Result<std::unique_ptr<Graphs>> Create(cudnnHandle_t handle, bool allow_reduced_precision,
                                                bool autotune = false);

  // The plan for `op`, built once per shape (heuristics A, then the fallback list; the first
  // engine configuration that finalises). kUnavailable when cuDNN has no engine for it. With
  // autotuning, a convolution's plan is the one an earlier Autotune in this process chose for the
  // same shape and device; failing that, heuristics A's first, with up to kAutotuneCandidates - 1
  // more kept for Autotune (none compiled at run time, none over kAutotuneWorkspaceLimit of
  // workspace; max_workspace() covers them all).
  Result<const Plan*> PlanFor(const OpSpec& op);
  // Times every convolution shape's candidates on `stream` with the variant pack of one of its
  // `uses` (the network's own buffers; convolutions only write their output, so this changes no
  // state that matters) and makes the fastest the shape's plan: the Plan objects layers point to
  // take the winners' contents. Records the choices for the process and frees the losers. A
  // candidate that fails to run is skipped (counted in `failed`); heuristics' choice failing is an
  // error, and so is a fault on the device (it ends the CUDA context; the error names the engine).
  // Nothing to do without autotuning. max_workspace() is then the winners' (and other plans').
  Result<AutotuneReport> Autotune(cudaStream_t stream, const std::vector<PlanUse>& uses);
  // Builds and finalises `op`'s tensors, operation and operation graph without a device or a
  // handle: what cuDNN checks of the descriptors themselves (attribute names, types, roles,
  // shapes), with no engine chosen. For tests on machines without a GPU.
  static Status Validate(const OpSpec& op);
  // A variant pack binding `uids` to `pointers` and the workspace.
  static Result<Desc> Bind(const std::vector<int64_t>& uids, const std::vector<void*>& pointers, void* workspace);
  Status Execute(const Plan& plan, const Desc& variant_pack) const;

  int64_t max_workspace() const { return max_workspace_; }
  size_t cached_plans() const { return plans_.size(); }

 private:
  Graphs(cudnnHandle_t handle, bool reduced, bool autotune)
      : handle_(handle), reduced_(reduced), autotune_(autotune) {}
  cudnnHandle_t handle_;
  bool reduced_, autotune_;
  int ordinal_ = 0;  // the device
  Desc device_;
  std::map<std::string, std::unique_ptr<Plan>> plans_;
  struct Candidates {
    std::string tuned_key;  // device, precision and shape: where the decision is recorded
    std::vector<std::unique_ptr<Plan>> plans;  // besides plans_[key]
  };
  std::map<std::string, Candidates> candidates_;  // shape key -> plans still to be timed
  int reused_ = 0, single_ = 0;                   // for the report
  int64_t max_workspace_ = 0;
};

}  // namespace stoke::train::cuda
