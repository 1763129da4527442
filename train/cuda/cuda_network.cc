#include "train/cuda_network.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <span>
#include <utility>

#include <fmt/format.h>

#include "common/logging.h"
#include "common/random.h"
#include "prefetch/batch_memory.h"
#include "prefetch/device_batch.h"
#include "train/cuda/cudnn_graph.h"
#include "train/cuda/kernels.h"
#include "train/cuda/layer_graphs.h"
#include "train/device_buckets.h"
#if STOKE_WITH_NCCL
#include <chrono>
#include <cstdlib>
#include <thread>

#include "train/cuda/nccl.h"
#endif

namespace stoke::train {
namespace {

using cuda::CudaError;
using cuda::DType;
using cuda::OpSpec;

// A failed call is returned as a status and cleared from the thread's last error, so that the next
// step's launch check (LastLaunch) does not report it a second time.
#define STOKE_CUDA_OK(call)                          \
  do {                                               \
    cudaError_t stoke_rc_ = (call);                  \
    if (stoke_rc_ != cudaSuccess) {                  \
      (void)cudaGetLastError();                      \
      return CudaError(stoke_rc_, #call);            \
    }                                                \
  } while (0)

#define STOKE_CUBLAS_OK(call, what)                                                                        \
  do {                                                                                                     \
    cublasStatus_t stoke_bs_ = (call);                                                                     \
    if (stoke_bs_ != CUBLAS_STATUS_SUCCESS) {                                                              \
      return InternalError(fmt::format("cuBLAS: {}: {}", what, cublasGetStatusString(stoke_bs_)));         \
    }                                                                                                      \
  } while (0)

// Launch errors surface at the next CUDA call; checked once per step and after set-up.
Status LastLaunch(std::string_view where) {
  cudaError_t rc = cudaGetLastError();
  return rc == cudaSuccess ? OkStatus() : CudaError(rc, where);
}

// Milliseconds from `from` to `to` (both recorded and complete). A failed timing leaves no error
// behind for the next step's launch check.
Result<double> ElapsedMs(cudaEvent_t from, cudaEvent_t to, std::string_view what) {
  float ms = 0;
  if (const cudaError_t rc = cudaEventElapsedTime(&ms, from, to); rc != cudaSuccess) {
    (void)cudaGetLastError();
    return CudaError(rc, what);
  }
  return static_cast<double>(ms);
}

// Begins the error of a convolution on the padded input that cuDNN could not plan.
constexpr std::string_view kPaddedInputUnplanned = "(conv, input padded to ";

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), bytes_(o.bytes_), owned_(std::exchange(o.owned_, true)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    std::swap(owned_, o.owned_);
    return *this;
  }
  ~DeviceBuffer() {
    if (p_ != nullptr && owned_) cudaFree(p_);
  }
  // Frees this buffer's memory and makes it a view of `other`'s, which must outlive it.
  Status Share(const DeviceBuffer& other) {
    if (p_ != nullptr && owned_) STOKE_CUDA_OK(cudaFree(p_));
    p_ = other.p_;
    bytes_ = other.bytes_;
    owned_ = false;
    return OkStatus();
  }
  Status Alloc(size_t bytes) {
    bytes_ = std::max<size_t>(bytes, 256);
    STOKE_CUDA_OK(cudaMalloc(&p_, bytes_));
    // The zeroing runs on the legacy default stream, which the network's non-blocking stream does
    // not wait for: finish it before anything else touches the buffer.
    STOKE_CUDA_OK(cudaMemset(p_, 0, bytes_));
    STOKE_CUDA_OK(cudaDeviceSynchronize());
    return OkStatus();
  }
  void* get() const { return p_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
  bool owned_ = true;
};

cudaDataType_t BlasType(DType t) { return t == DType::kF32 ? CUDA_R_32F : t == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF; }
char* Offset(void* p, int64_t elements, DType t) {
  return static_cast<char*>(p) + elements * static_cast<int64_t>(cuda::SizeOf(t));
}

// One activation: NHWC (vectors: h = w = 1) for the whole batch.
struct Node {
  DeviceBuffer out, diff;
  int64_t n = 0, c = 0, h = 1, w = 1;
  bool vector = false;
  bool claimed = false;    // a consumer's backward writes its gradient first
  bool zero_diff = false;  // no consumer: the gradient is zero
  int64_t count() const { return n * c * h * w; }
};

// A learnable tensor inside one of the two flat parameter groups.
struct ParamInfo {
  std::string name;
  std::vector<int64_t> dims;  // plain (checkpoint) dims
  int group = 0;              // 0: convolution weights (gradient in the compute type); 1: the rest (float32)
  int64_t offset = 0, count = 0;
  bool krsc = false;  // convolution weights: stored K x R x S x C on the device, O x I x KH x KW in checkpoints
  int64_t device_c = 0;  // krsc: C on the device (more than I where the input is padded: those weights are 0)
  bool decay = true;
  bool copy = false;  // needs a copy in the compute type (convolution and linear weights)
  int layer = 0;      // the layer that owns it (its backward writes the gradient)
  std::vector<float> init;
};

struct Group {
  DeviceBuffer master, momentum, grad, copy;
  int64_t size = 0, decay_end = 0, copy_end = 0;
  DType grad_type = DType::kF32;
};

struct RunningStat {
  std::string name;
  float* value = nullptr;  // c floats in Net::running_values
  int64_t offset = 0;      // where, in floats
  int64_t c = 0;
  float init = 0;
};

class Net;

// A cuDNN graph operation with its cached plan and a variant pack bound once.
struct GraphOp {
  const cuda::Plan* plan = nullptr;
  std::vector<int64_t> uids;
  std::vector<void*> pointers;  // what the pack binds (kept to bind it again to a new workspace)
  cuda::Desc pack;
  bool ok() const { return plan != nullptr; }
};

class Layer {
 public:
  virtual ~Layer() = default;
  virtual Status Forward(Net& net, bool training, int64_t step) = 0;
  virtual Status Backward(Net& net) = 0;
  // After parameters and workspace exist, in backward order: claims input gradients and binds the
  // graph operations to their buffers.
  virtual Status Bind(Net& net) = 0;
};

class Net {
 public:
  NetworkOptions opt;
  std::vector<Shape> shapes;
  std::vector<bool> needs_grad;  // per layer: its output's gradient is used (LayersNeedingGradient)
  DType t = DType::kF32;
  cudnnDataType_t ct = CUDNN_DATA_FLOAT;  // t, for cuDNN
  cudaStream_t stream = nullptr;
  cudnnHandle_t dnn = nullptr;
  cublasHandle_t blas = nullptr;
  std::unique_ptr<cuda::Graphs> graphs;
  DeviceBuffer input, staging, labels, workspace, scratch, partials, stats, row_loss, upload;
  cuda::StepStats* host_stats = nullptr;  // pinned
  std::vector<Node> nodes;
  std::vector<std::unique_ptr<Layer>> layers;
  std::vector<ParamInfo> params;
  std::array<Group, 2> groups;
  std::vector<std::unique_ptr<RunningStat>> running;
  // Every running statistic in one allocation, and its copy from before the step in flight: a step
  // skipped (float16 overflow, a non-finite data-parallel step) puts the statistics back as they were,
  // so a batch whose forward pass overflowed cannot leave them infinite for good.
  DeviceBuffer running_values, running_saved;
  int64_t running_floats = 0;
  std::vector<std::string> fallbacks;
  std::vector<std::string> nondeterministic;  // operations whose only engines are non-deterministic
  std::vector<std::string> rounded;           // float32 operations whose only engines round to TF32
  std::vector<GraphOp*> bound;       // every bound graph operation (while the network is made)
  std::string autotuned;             // what autotuning reported ("" without it)
  int fused_pairs = 0;               // batch norm + ReLU pairs running as one step
  int64_t in_c = 3;                  // channels of the input on the device (NetworkOptions::input_channels)
  size_t partial_floats = 0;
  std::array<cudaEvent_t, 2> done{};
  cudaEvent_t ready = nullptr;
  cudaEvent_t timeline_start = nullptr;  // StartTimeline's mark
  int cur = 0;
  bool have_prev = false;  // the last call was a TrainStep that completed: ready and done[1 - cur] are its
  double last_wait = -1;
  float loss_scale = 1, last_grad_scale = 1;
  int good_steps = 0;
  int64_t skipped = 0;
  int building_layer = 0;  // while layers are made: the one adding parameters
  // Synchronised batch norm (model.sync_batchnorm, data-parallel): sums `n` doubles on the device
  // over the ranks, in place, ordered on `stream`; the number of ranks. Unset: each rank alone.
  std::function<Status(double* values, size_t n)> sum_over_ranks;
  int ranks = 1;

  ~Net() {
    if (stream != nullptr) cudaStreamSynchronize(stream);
    layers.clear();
    graphs.reset();
    for (auto e : done) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (ready != nullptr) cudaEventDestroy(ready);
    if (timeline_start != nullptr) cudaEventDestroy(timeline_start);
    if (host_stats != nullptr) cudaFreeHost(host_stats);
    if (blas != nullptr) cublasDestroy(blas);
    if (dnn != nullptr) cudnnDestroy(dnn);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  const std::string& Name(int layer) const { return opt.model.layers[static_cast<size_t>(layer)].name; }
  // Whether the backward pass needs node `i`'s gradient (LayersNeedingGradient); never the input's.
  bool NeedsGrad(int i) const { return i >= 0 && needs_grad[static_cast<size_t>(i)]; }
  Node& node(int i) { return nodes[static_cast<size_t>(i)]; }
  const void* In(int i) const { return i < 0 ? input.get() : nodes[static_cast<size_t>(i)].out.get(); }
  // Dims of a node (or of the input, -1).
  std::array<int64_t, 4> Dims(int i) const {
    if (i < 0) return {opt.batch, in_c, opt.height(), opt.image_size};
    const Node& n = nodes[static_cast<size_t>(i)];
    return {n.n, n.c, n.h, n.w};
  }
  Status SetOutput(int self, int64_t c, int64_t h, int64_t w, bool vector) {
    Node& n = node(self);
    n.n = opt.batch;
    n.c = c;
    n.h = h;
    n.w = w;
    n.vector = vector;
    STOKE_RETURN_IF_ERROR(n.out.Alloc(static_cast<size_t>(n.count()) * cuda::SizeOf(t)));
    if (!NeedsGrad(self)) return OkStatus();
    return n.diff.Alloc(static_cast<size_t>(n.count()) * cuda::SizeOf(t));
  }

  int AddParam(ParamInfo p) {
    p.layer = building_layer;
    params.push_back(std::move(p));
    return static_cast<int>(params.size()) - 1;
  }
  const ParamInfo& param(int i) const { return params[static_cast<size_t>(i)]; }
  float* Master(int i) const { return groups[param(i).group].master.as<float>() + param(i).offset; }
  // The weight in the compute type (the master itself in float32).
  void* Copy(int i) const {
    if (t == DType::kF32) return Master(i);
    return Offset(groups[param(i).group].copy.get(), param(i).offset, t);
  }
  void* Grad(int i) const {
    const Group& g = groups[param(i).group];
    return Offset(g.grad.get(), param(i).offset, g.grad_type);
  }
  // A running statistic, allocated with the parameters.
  void AddStat(const std::string& name, int64_t c, float init) {
    auto r = std::make_unique<RunningStat>();
    r->name = name;
    r->c = c;
    r->init = init;
    r->offset = running_floats;
    running_floats += (c + 63) / 64 * 64;  // 256-byte aligned, as cuDNN prefers
    running.push_back(std::move(r));
  }

  // Backward order: the first consumer to deliver writes the gradient, later ones add to it.
  bool Claim(int i) {
    if (!NeedsGrad(i)) return false;
    Node& n = node(i);
    const bool first = !n.claimed;
    n.claimed = true;
    return first;
  }
  void* DiffTarget(int i, bool direct) const {
    return direct ? nodes[static_cast<size_t>(i)].diff.get() : scratch.get();
  }
  void Deliver(int i, bool direct) {
    if (!NeedsGrad(i) || direct) return;
    Node& n = node(i);
    cuda::Accumulate(n.diff.get(), scratch.get(), t, n.count(), stream);
  }

  // Builds the cached plan of `op`; tensors get uids 1, 2, ... in order.
  Result<GraphOp> Plan(OpSpec op) {
    GraphOp g;
    for (size_t k = 0; k < op.tensors.size(); ++k) {
      op.tensors[k].uid = static_cast<int64_t>(k) + 1;
      g.uids.push_back(op.tensors[k].uid);
    }
    STOKE_ASSIGN_OR_RETURN(g.plan, graphs->PlanFor(op));
    if (g.plan->nondeterministic) {
      nondeterministic.push_back(fmt::format("{}: {}", Name(building_layer), cuda::OpKindName(op.kind)));
    }
    if (g.plan->rounds_inputs) rounded.push_back(fmt::format("{}: {}", Name(building_layer), cuda::OpKindName(op.kind)));
    return g;
  }
  Status Bind(GraphOp& g, const std::vector<void*>& pointers) {
    STOKE_ASSIGN_OR_RETURN(g.pack, cuda::Graphs::Bind(g.uids, pointers, workspace.get()));
    g.pointers = pointers;
    bound.push_back(&g);
    return OkStatus();
  }
  Status Run(const GraphOp& g) const { return graphs->Execute(*g.plan, g.pack); }

  void NeedPartials(int64_t rows, int c) {
    partial_floats = std::max(partial_floats, cuda::BatchNormWorkspace(rows, c));
  }
  void Fallback(int layer, std::string_view what, const Status& why) {
    fallbacks.push_back(fmt::format("{}: {} ({})", Name(layer), what, why.message()));
  }
  // Plans a layer's forward and backward graphs; false, with the layer listed as a fallback, when
  // cuDNN has no engine for either (the layer then runs both on stoke's kernels).
  bool PlanPair(int layer, std::string_view what, cuda::PairOps ops, GraphOp& fwd, GraphOp& bwd) {
    auto f = Plan(std::move(ops.forward));
    auto b = f.ok() ? Plan(std::move(ops.backward)) : Result<GraphOp>(f.status());
    if (f.ok() && b.ok()) {
      fwd = std::move(*f);
      bwd = std::move(*b);
      return true;
    }
    Fallback(layer, what, f.ok() ? b.status() : f.status());
    return false;
  }
};

// A layer reading one earlier node (or the input, -1). Bind, called in backward order, claims
// that node's gradient: the first claimer writes it, later ones add to it.
class OneInputLayer : public Layer {
 public:
  OneInputLayer(int self, int in) : self_(self), in_(in) {}
  Status Bind(Net& net) final {
    direct_ = net.Claim(in_);
    return BindGraphs(net);
  }

 protected:
  virtual Status BindGraphs(Net&) { return OkStatus(); }
  int self_, in_;
  bool direct_ = false;
};

// Checkpoint O x I x KH x KW (dims `d`) to the device's K x R x S x C with C = `c` >= I; the
// channels past I are zero. OihwFromKrsc is its inverse (dropping them).
std::vector<float> KrscFromOihw(const std::vector<float>& v, const std::vector<int64_t>& d, int64_t c) {
  const int64_t o = d[0], i = d[1], kh = d[2], kw = d[3];
  std::vector<float> out(static_cast<size_t>(o * kh * kw * c), 0.f);
  for (int64_t a = 0; a < o; ++a)
    for (int64_t b = 0; b < i; ++b)
      for (int64_t y = 0; y < kh; ++y)
        for (int64_t x = 0; x < kw; ++x) out[static_cast<size_t>(((a * kh + y) * kw + x) * c + b)] = v[static_cast<size_t>(((a * i + b) * kh + y) * kw + x)];
  return out;
}
std::vector<float> OihwFromKrsc(const std::vector<float>& v, const std::vector<int64_t>& d, int64_t c) {
  const int64_t o = d[0], i = d[1], kh = d[2], kw = d[3];
  std::vector<float> out(static_cast<size_t>(o * i * kh * kw));
  for (int64_t a = 0; a < o; ++a)
    for (int64_t b = 0; b < i; ++b)
      for (int64_t y = 0; y < kh; ++y)
        for (int64_t x = 0; x < kw; ++x) out[static_cast<size_t>(((a * i + b) * kh + y) * kw + x)] = v[static_cast<size_t>(((a * kh + y) * kw + x) * c + b)];
  return out;
}

// ---------------------------------------------------------------- convolution

class ConvLayer final : public OneInputLayer {
 public:
  static Result<std::unique_ptr<Layer>> Make(Net& net, const LayerSpec& l, int self, int in, uint64_t seed) {
    auto layer = std::unique_ptr<ConvLayer>(new ConvLayer(self, in));
    STOKE_RETURN_IF_ERROR(layer->Init(net, l, seed));
    return std::unique_ptr<Layer>(std::move(layer));
  }

  Status Forward(Net& net, bool, int64_t) override {
    STOKE_RETURN_IF_ERROR(net.Run(fwd_));
    if (bias_ >= 0) {
      const Node& y = net.node(self_);
      cuda::AddChannelBias(y.out.get(), net.t, net.Master(bias_), y.n * y.h * y.w, static_cast<int>(y.c), net.stream);
    }
    return OkStatus();
  }
  Status Backward(Net& net) override {
    const Node& y = net.node(self_);
    if (bias_ >= 0) {
      cuda::ChannelSums(y.diff.get(), net.t, y.n * y.h * y.w, static_cast<int>(y.c),
                        static_cast<float*>(net.Grad(bias_)), net.partials.as<float>(), net.stream);
    }
    STOKE_RETURN_IF_ERROR(net.Run(wgrad_));
    if (net.NeedsGrad(in_)) {
      STOKE_RETURN_IF_ERROR(net.Run(dgrad_));
      net.Deliver(in_, direct_);
    }
    return OkStatus();
  }
  Status BindGraphs(Net& net) override {
    void* x = const_cast<void*>(net.In(in_));
    const Node& y = net.node(self_);
    STOKE_RETURN_IF_ERROR(net.Bind(fwd_, {x, net.Copy(weight_), y.out.get()}));
    STOKE_RETURN_IF_ERROR(net.Bind(wgrad_, {x, y.diff.get(), net.Grad(weight_)}));
    if (net.NeedsGrad(in_)) STOKE_RETURN_IF_ERROR(net.Bind(dgrad_, {y.diff.get(), net.Copy(weight_), net.DiffTarget(in_, direct_)}));
    return OkStatus();
  }

 private:
  ConvLayer(int self, int in) : OneInputLayer(self, in) {}
  Status Init(Net& net, const LayerSpec& l, uint64_t seed) {
    const auto x = net.Dims(in_);
    const Shape out = net.shapes[static_cast<size_t>(self_)];
    // The input may carry zero channels past the image's 3 (NetworkOptions::input_channels): the
    // weights for them live on the device only.
    const std::vector<int64_t> w_dims{l.out, in_ < 0 ? 3 : x[1], l.kernel, l.kernel};
    InitialParameters init = InitialWeights(l, w_dims, seed);
    weight_ = net.AddParam({.name = l.name + ".weight", .dims = w_dims, .group = 0,
                            .count = l.out * l.kernel * l.kernel * x[1], .krsc = true, .device_c = x[1],
                            .decay = true, .copy = true, .init = std::move(init.weight)});
    if (l.bias) {
      bias_ = net.AddParam({.name = l.name + ".bias", .dims = {l.out}, .group = 1, .count = l.out, .decay = false,
                            .init = std::move(init.bias)});
      net.NeedPartials(x[0] * out.h * out.w, l.out);
    }
    STOKE_RETURN_IF_ERROR(net.SetOutput(self_, out.c, out.h, out.w, false));
    cuda::ConvGraphs g = cuda::ConvOps(net.ct, x, {x[0], out.c, out.h, out.w}, l);
    auto fail = [&](const Status& s, std::string_view what) {
      // kPaddedInputUnplanned tells CudaNetwork::Create that 3 input channels may still plan.
      const bool padded = in_ < 0 && net.in_c != 3;
      return InternalError(fmt::format("layer '{}' {}: {}: {}", l.name,
                                       padded ? fmt::format("{}{} channels)", kPaddedInputUnplanned, net.in_c)
                                              : std::string("(conv)"),
                                       what, s.message()));
    };
    auto f = net.Plan(std::move(g.forward));
    if (!f.ok()) return fail(f.status(), "forward");
    fwd_ = std::move(*f);
    auto wg = net.Plan(std::move(g.backward_filter));
    if (!wg.ok()) return fail(wg.status(), "backward filter");
    wgrad_ = std::move(*wg);
    if (net.NeedsGrad(in_)) {
      auto dg = net.Plan(std::move(g.backward_data));
      if (!dg.ok()) return fail(dg.status(), "backward data");
      dgrad_ = std::move(*dg);
    }
    return OkStatus();
  }

  int weight_ = -1, bias_ = -1;
  GraphOp fwd_, wgrad_, dgrad_;
};

// ---------------------------------------------------------------- linear (cuBLAS)

class LinearLayer final : public OneInputLayer {
 public:
  LinearLayer(const LayerSpec& l, int self, int in) : OneInputLayer(self, in), out_(l.out) {}

  Status Init(Net& net, const LayerSpec& l, uint64_t seed) {
    const auto x = net.Dims(in_);
    features_ = x[1] * x[2] * x[3];
    const bool vector_in = in_ >= 0 && net.node(in_).vector;
    flatten_ = x[2] * x[3] > 1;
    const std::vector<int64_t> w_dims = vector_in ? std::vector<int64_t>{l.out, x[1]}
                                                  : std::vector<int64_t>{l.out, x[1], x[2], x[3]};
    InitialParameters init = InitialWeights(l, w_dims, seed);
    weight_ = net.AddParam({.name = l.name + ".weight", .dims = w_dims, .group = 1, .count = l.out * features_,
                            .decay = true, .copy = true, .init = std::move(init.weight)});
    if (l.bias) {
      bias_ = net.AddParam({.name = l.name + ".bias", .dims = {l.out}, .group = 1, .count = l.out, .decay = false,
                            .init = std::move(init.bias)});
      net.NeedPartials(net.opt.batch, l.out);
    }
    if (flatten_) {
      STOKE_RETURN_IF_ERROR(flat_.Alloc(static_cast<size_t>(x[0] * features_) * cuda::SizeOf(net.t)));
      STOKE_RETURN_IF_ERROR(flat_diff_.Alloc(static_cast<size_t>(x[0] * features_) * cuda::SizeOf(net.t)));
    }
    return net.SetOutput(self_, l.out, 1, 1, true);
  }

  Status Forward(Net& net, bool, int64_t) override {
    const auto x = net.Dims(in_);
    const void* src = net.In(in_);
    if (flatten_) {
      cuda::Flatten(src, flat_.get(), net.t, static_cast<int>(x[0]), static_cast<int>(x[2]), static_cast<int>(x[3]),
                    static_cast<int>(x[1]), false, net.stream);
      src = flat_.get();
    }
    const Node& y = net.node(self_);
    const float one = 1, zero = 0;
    const auto type = BlasType(net.t);
    // Row-major Y[N x O] = X[N x I] W^T, i.e. column-major Y^T = W^T(stored I x O) ... as GEMM(T, N).
    STOKE_CUBLAS_OK(cublasGemmEx(net.blas, CUBLAS_OP_T, CUBLAS_OP_N, out_, static_cast<int>(x[0]),
                                 static_cast<int>(features_), &one, net.Copy(weight_), type,
                                 static_cast<int>(features_), src, type, static_cast<int>(features_), &zero,
                                 y.out.get(), type, out_, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                    fmt::format("layer '{}' forward", net.Name(self_)));
    if (bias_ >= 0) cuda::AddChannelBias(y.out.get(), net.t, net.Master(bias_), y.n, out_, net.stream);
    return OkStatus();
  }
  Status Backward(Net& net) override {
    const auto x = net.Dims(in_);
    const Node& y = net.node(self_);
    const float one = 1, zero = 0;
    const auto type = BlasType(net.t);
    const int n = static_cast<int>(x[0]), in = static_cast<int>(features_);
    const void* src = flatten_ ? flat_.get() : net.In(in_);
    if (bias_ >= 0) {
      cuda::ChannelSums(y.diff.get(), net.t, y.n, out_, static_cast<float*>(net.Grad(bias_)), net.partials.as<float>(),
                        net.stream);
    }
    // dW[O x I] = dY^T X: column-major dW^T (I x O) = X^T(I x N) dY(N x O).
    STOKE_CUBLAS_OK(cublasGemmEx(net.blas, CUBLAS_OP_N, CUBLAS_OP_T, in, out_, n, &one, src, type, in, y.diff.get(),
                                 type, out_, &zero, net.Grad(weight_), CUDA_R_32F, in, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT),
                    fmt::format("layer '{}' weight gradient", net.Name(self_)));
    if (!net.NeedsGrad(in_)) return OkStatus();
    // dX[N x I] = dY W: column-major dX^T (I x N) = W^T(I x O) dY^T(O x N).
    void* dx = flatten_ ? flat_diff_.get() : net.DiffTarget(in_, direct_);
    STOKE_CUBLAS_OK(cublasGemmEx(net.blas, CUBLAS_OP_N, CUBLAS_OP_N, in, n, out_, &one, net.Copy(weight_), type, in,
                                 y.diff.get(), type, out_, &zero, dx, type, in, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT),
                    fmt::format("layer '{}' input gradient", net.Name(self_)));
    if (flatten_) {
      cuda::Flatten(flat_diff_.get(), net.DiffTarget(in_, direct_), net.t, n, static_cast<int>(x[2]),
                    static_cast<int>(x[3]), static_cast<int>(x[1]), true, net.stream);
    }
    net.Deliver(in_, direct_);
    return OkStatus();
  }

 private:
  int out_;
  int64_t features_ = 0;
  bool flatten_ = false;
  int weight_ = -1, bias_ = -1;
  DeviceBuffer flat_, flat_diff_;
};

// ---------------------------------------------------------------- batch norm

class BatchNormLayer final : public OneInputLayer {
 public:
  BatchNormLayer(int self, int in) : OneInputLayer(self, in) {}

  Status Init(Net& net, const LayerSpec& l) {
    const auto x = net.Dims(in_);
    c_ = x[1];
    rows_ = x[0] * x[2] * x[3];
    eps_ = static_cast<float>(net.opt.bn_epsilon);
    factor_ = static_cast<float>(net.opt.bn_momentum);
    scale_ = net.AddParam({.name = l.name + ".weight", .dims = {c_}, .group = 1, .count = c_, .decay = false,
                           .init = std::vector<float>(static_cast<size_t>(c_), l.zero_init ? 0.f : 1.f)});
    shift_ = net.AddParam({.name = l.name + ".bias", .dims = {c_}, .group = 1, .count = c_, .decay = false,
                           .init = std::vector<float>(static_cast<size_t>(c_), 0.f)});
    mean_stat_ = static_cast<int>(net.running.size());
    net.AddStat(l.name + ".running_mean", c_, 0.f);
    net.AddStat(l.name + ".running_var", c_, 1.f);
    for (auto* b : {&next_mean_, &next_var_, &save_mean_, &save_inv_std_}) {
      STOKE_RETURN_IF_ERROR(b->Alloc(static_cast<size_t>(c_) * sizeof(float)));
    }
    const bool vector = in_ >= 0 && net.node(in_).vector;
    STOKE_RETURN_IF_ERROR(net.SetOutput(self_, c_, x[2], x[3], vector));

    if (net.opt.sync_batchnorm) {
      // Over the global batch (when data-parallel): stoke's kernels, whose per-channel sums can be
      // added across the ranks between the halves of each pass.
      STOKE_RETURN_IF_ERROR(sums_.Alloc(2 * static_cast<size_t>(c_) * sizeof(double)));
      STOKE_RETURN_IF_ERROR(global_grads_.Alloc(2 * static_cast<size_t>(c_) * sizeof(float)));
      net.NeedPartials(rows_, static_cast<int>(c_));
    }
    if (!net.PlanPair(self_, "batch norm", cuda::BatchNormOps(net.ct, x), fwd_, bwd_)) {
      net.NeedPartials(rows_, static_cast<int>(c_));
    }
    return OkStatus();
  }

  Status Forward(Net& net, bool training, int64_t) override {
    const Node& y = net.node(self_);
    float* rm = RunningMean(net);
    float* rv = RunningVar(net);
    if (!training) {
      cuda::BatchNormInference(net.In(in_), y.out.get(), net.t, rows_, static_cast<int>(c_), net.Master(scale_),
                               net.Master(shift_), rm, rv, eps_, net.stream, fused_relu_);
      return OkStatus();
    }
    if (fused_relu_) {  // y.out is the ReLU's output buffer
      cuda::BatchNormReluTrain(net.In(in_), y.out.get(), net.t, rows_, static_cast<int>(c_), net.Master(scale_),
                               net.Master(shift_), eps_, factor_, rm, rv, save_mean_.as<float>(),
                               save_inv_std_.as<float>(), affine_.as<float>(), net.partials.as<float>(), net.stream);
      return OkStatus();
    }
    if (Synchronised(net)) {
      const int c = static_cast<int>(c_);
      cuda::BatchNormLocalMoments(net.In(in_), net.t, rows_, c, rm, sums_.as<double>(), net.partials.as<float>(),
                                  net.stream);
      STOKE_RETURN_IF_ERROR(net.sum_over_ranks(sums_.as<double>(), 2 * static_cast<size_t>(c_)));
      cuda::BatchNormTrainFromMoments(net.In(in_), y.out.get(), net.t, rows_, c, net.Master(scale_),
                                      net.Master(shift_), sums_.as<double>(), rows_ * net.ranks, eps_, factor_, rm,
                                      rv, save_mean_.as<float>(), save_inv_std_.as<float>(), net.stream);
      return OkStatus();
    }
    if (!fwd_.ok()) {
      cuda::BatchNormTrain(net.In(in_), y.out.get(), net.t, rows_, static_cast<int>(c_), net.Master(scale_),
                           net.Master(shift_), eps_, factor_, rm, rv, save_mean_.as<float>(),
                           save_inv_std_.as<float>(), net.partials.as<float>(), net.stream);
      return OkStatus();
    }
    STOKE_RETURN_IF_ERROR(net.Run(fwd_));
    const size_t bytes = static_cast<size_t>(c_) * sizeof(float);
    STOKE_CUDA_OK(cudaMemcpyAsync(rm, next_mean_.get(), bytes, cudaMemcpyDeviceToDevice, net.stream));
    STOKE_CUDA_OK(cudaMemcpyAsync(rv, next_var_.get(), bytes, cudaMemcpyDeviceToDevice, net.stream));
    return OkStatus();
  }
  Status Backward(Net& net) override {
    const Node& y = net.node(self_);
    void* dx = net.NeedsGrad(in_) ? net.DiffTarget(in_, direct_) : net.scratch.get();
    if (fused_relu_) {  // y.diff is the ReLU's output gradient
      cuda::BatchNormReluBackward(net.In(in_), y.diff.get(), dx, net.t, rows_, static_cast<int>(c_),
                                  save_mean_.as<float>(), save_inv_std_.as<float>(), affine_.as<float>(),
                                  static_cast<float*>(net.Grad(scale_)), static_cast<float*>(net.Grad(shift_)),
                                  net.partials.as<float>(), net.stream);
    } else if (Synchronised(net)) {
      // The parameter gradients are this rank's sums (averaged over the ranks with every other
      // gradient); the input gradient needs the sums of all ranks.
      const int c = static_cast<int>(c_);
      cuda::BatchNormLocalGradSums(net.In(in_), y.diff.get(), net.t, rows_, c, save_mean_.as<float>(),
                                   save_inv_std_.as<float>(), static_cast<float*>(net.Grad(scale_)),
                                   static_cast<float*>(net.Grad(shift_)), sums_.as<double>(),
                                   net.partials.as<float>(), net.stream);
      STOKE_RETURN_IF_ERROR(net.sum_over_ranks(sums_.as<double>(), 2 * static_cast<size_t>(c_)));
      cuda::BatchNormBackwardFromSums(net.In(in_), y.diff.get(), dx, net.t, rows_, c, net.Master(scale_),
                                      save_mean_.as<float>(), save_inv_std_.as<float>(), sums_.as<double>(),
                                      rows_ * net.ranks, global_grads_.as<float>(), net.stream);
    } else if (!bwd_.ok()) {
      cuda::BatchNormBackward(net.In(in_), y.diff.get(), dx, net.t, rows_, static_cast<int>(c_), net.Master(scale_),
                              save_mean_.as<float>(), save_inv_std_.as<float>(), static_cast<float*>(net.Grad(scale_)),
                              static_cast<float*>(net.Grad(shift_)), net.partials.as<float>(), net.stream);
    } else {
      STOKE_RETURN_IF_ERROR(net.Run(bwd_));
    }
    net.Deliver(in_, direct_);
    return OkStatus();
  }
  // Before binding: whether this batch norm and `relu`, its only consumer, can run as one fused
  // step (model.sync_batchnorm off, channels in whole 16-byte vectors, the same gradient needs).
  bool CanFuse(Net& net, int relu) const {
    // The kernels load 16-byte vectors: every buffer they touch must start on a 16-byte boundary
    // (all do today, being whole allocations; a future view at an offset would not be fused).
    auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    const bool buffers = aligned(net.In(in_)) && aligned(net.node(relu).out.get()) &&
                         aligned(net.node(relu).diff.get()) && aligned(net.scratch.get()) &&
                         (in_ < 0 || aligned(net.node(in_).diff.get()));
    return !net.opt.sync_batchnorm && cuda::FusedBatchNormReluFits(net.t, static_cast<int>(c_)) &&
           net.NeedsGrad(self_) == net.NeedsGrad(relu) && buffers;
  }
  // Makes this layer write the ReLU's output (and read its gradient) directly: this node's buffers
  // become views of `relu`'s, and the ReLU layer does nothing.
  Status FuseRelu(Net& net, int relu) {
    STOKE_RETURN_IF_ERROR(affine_.Alloc(2 * static_cast<size_t>(c_) * sizeof(float)));
    STOKE_RETURN_IF_ERROR(net.node(self_).out.Share(net.node(relu).out));
    if (net.NeedsGrad(self_)) STOKE_RETURN_IF_ERROR(net.node(self_).diff.Share(net.node(relu).diff));
    net.NeedPartials(rows_, static_cast<int>(c_));
    fused_relu_ = true;
    return OkStatus();
  }
  Status BindGraphs(Net& net) override {
    if (!fwd_.ok() || fused_relu_) return OkStatus();
    void* x = const_cast<void*>(net.In(in_));
    const Node& y = net.node(self_);
    STOKE_RETURN_IF_ERROR(net.Bind(fwd_, {x, net.Master(scale_), net.Master(shift_), &eps_, &factor_,
                                          RunningMean(net), RunningVar(net), next_mean_.get(), next_var_.get(),
                                          save_mean_.get(), save_inv_std_.get(), y.out.get()}));
    void* dx = net.NeedsGrad(in_) ? net.DiffTarget(in_, direct_) : net.scratch.get();
    return net.Bind(bwd_, {x, y.diff.get(), net.Master(scale_), save_mean_.get(), save_inv_std_.get(),
                           net.Grad(scale_), net.Grad(shift_), dx});
  }

 private:
  static bool Synchronised(const Net& net) { return net.opt.sync_batchnorm && net.sum_over_ranks != nullptr; }
  float* RunningMean(Net& net) const { return net.running[static_cast<size_t>(mean_stat_)]->value; }
  float* RunningVar(Net& net) const { return net.running[static_cast<size_t>(mean_stat_) + 1]->value; }

  int64_t c_ = 0, rows_ = 0;
  float eps_ = 0, factor_ = 0;  // by-value scalars of the cuDNN graph: must outlive it
  int scale_ = -1, shift_ = -1, mean_stat_ = -1;
  DeviceBuffer next_mean_, next_var_, save_mean_, save_inv_std_;
  DeviceBuffer sums_, global_grads_;  // synchronised: 2 x C doubles summed over the ranks; 2 x C floats
  bool fused_relu_ = false;  // runs the ReLU after it too (FuseRelu)
  DeviceBuffer affine_;      // fused: per channel a = scale * inv_std, then b = shift - mean * a
  GraphOp fwd_, bwd_;
};

// ---------------------------------------------------------------- ReLU

class ReluLayer final : public OneInputLayer {
 public:
  ReluLayer(int self, int in) : OneInputLayer(self, in) {}
  Status Init(Net& net) {
    const auto x = net.Dims(in_);
    STOKE_RETURN_IF_ERROR(net.SetOutput(self_, x[1], x[2], x[3], in_ >= 0 && net.node(in_).vector));
    net.PlanPair(self_, "relu", cuda::ReluOps(net.ct, x), fwd_, bwd_);
    return OkStatus();
  }
  // The batch norm before it runs this ReLU too (BatchNormLayer::FuseRelu).
  void SetFused() { fused_ = true; }
  Status Forward(Net& net, bool, int64_t) override {
    if (fused_) return OkStatus();
    if (fwd_.ok()) return net.Run(fwd_);
    const Node& y = net.node(self_);
    cuda::Relu(net.In(in_), y.out.get(), net.t, y.count(), net.stream);
    return OkStatus();
  }
  Status Backward(Net& net) override {
    if (!net.NeedsGrad(in_) || fused_) return OkStatus();
    if (bwd_.ok()) {
      STOKE_RETURN_IF_ERROR(net.Run(bwd_));
    } else {
      const Node& y = net.node(self_);
      cuda::ReluBackward(net.In(in_), y.diff.get(), net.DiffTarget(in_, direct_), net.t, y.count(), net.stream);
    }
    net.Deliver(in_, direct_);
    return OkStatus();
  }
  Status BindGraphs(Net& net) override {
    if (!fwd_.ok() || fused_) return OkStatus();
    void* x = const_cast<void*>(net.In(in_));
    const Node& y = net.node(self_);
    STOKE_RETURN_IF_ERROR(net.Bind(fwd_, {x, y.out.get()}));
    if (!net.NeedsGrad(in_)) return OkStatus();
    return net.Bind(bwd_, {x, y.diff.get(), net.DiffTarget(in_, direct_)});
  }

 private:
  bool fused_ = false;
  GraphOp fwd_, bwd_;
};

// ---------------------------------------------------------------- pooling

class PoolLayer final : public OneInputLayer {
 public:
  PoolLayer(int self, int in) : OneInputLayer(self, in) {}
  Status Init(Net& net, const LayerSpec& l) {
    const auto x = net.Dims(in_);
    const Shape out = net.shapes[static_cast<size_t>(self_)];
    const bool global = l.type == LayerType::kGlobalAvgPool;
    shape_ = cuda::PoolShape{.n = static_cast<int>(x[0]), .h = static_cast<int>(x[2]), .w = static_cast<int>(x[3]),
                             .c = static_cast<int>(x[1]), .oh = out.h, .ow = out.w,
                             .kh = global ? static_cast<int>(x[2]) : l.kernel,
                             .kw = global ? static_cast<int>(x[3]) : l.kernel,
                             .stride = global ? static_cast<int>(x[2]) : l.stride, .pad = global ? 0 : l.pad,
                             .max = l.type == LayerType::kMaxPool};
    STOKE_RETURN_IF_ERROR(net.SetOutput(self_, out.c, out.h, out.w, false));
    const std::array<int64_t, 4> y{x[0], out.c, out.h, out.w};
    if (shape_.kh == shape_.kw) {
      net.PlanPair(self_, shape_.max ? "max pooling" : "average pooling",
                   cuda::PoolOps(net.ct, x, y, shape_.kh, shape_.stride, shape_.pad, shape_.max), fwd_, bwd_);
    } else {
      net.Fallback(self_, "pooling", InvalidArgumentError("non-square window"));
    }
    if (shape_.max) {
      // cuDNN's index is an int8 position in the window; the fallback keeps an int32 pixel index.
      STOKE_RETURN_IF_ERROR(index_.Alloc(static_cast<size_t>(net.node(self_).count()) * sizeof(int32_t)));
    }
    return OkStatus();
  }
  Status Forward(Net& net, bool, int64_t) override {
    if (fwd_.ok()) return net.Run(fwd_);
    cuda::Pool(net.In(in_), net.node(self_).out.get(), index_.as<int32_t>(), net.t, shape_, net.stream);
    return OkStatus();
  }
  Status Backward(Net& net) override {
    if (!net.NeedsGrad(in_)) return OkStatus();
    if (bwd_.ok()) {
      STOKE_RETURN_IF_ERROR(net.Run(bwd_));
    } else {
      cuda::PoolBackward(net.node(self_).diff.get(), index_.as<int32_t>(), net.DiffTarget(in_, direct_), net.t, shape_,
                         net.stream);
    }
    net.Deliver(in_, direct_);
    return OkStatus();
  }
  Status BindGraphs(Net& net) override {
    if (!fwd_.ok()) return OkStatus();
    void* x = const_cast<void*>(net.In(in_));
    const Node& y = net.node(self_);
    std::vector<void*> f{x, y.out.get()}, b{y.diff.get(), net.NeedsGrad(in_) ? net.DiffTarget(in_, direct_) : net.scratch.get()};
    if (shape_.max) {
      f.push_back(index_.get());
      b.push_back(index_.get());
    }
    STOKE_RETURN_IF_ERROR(net.Bind(fwd_, f));
    return net.Bind(bwd_, b);
  }

 private:
  cuda::PoolShape shape_{};
  DeviceBuffer index_;
  GraphOp fwd_, bwd_;
};

// ---------------------------------------------------------------- residual add

class AddLayer final : public Layer {
 public:
  AddLayer(int self, int a, int b) : self_(self), a_(a), b_(b) {}
  Status Init(Net& net) {
    const auto x = net.Dims(a_);
    STOKE_RETURN_IF_ERROR(net.SetOutput(self_, x[1], x[2], x[3], a_ >= 0 && net.node(a_).vector));
    auto p = net.Plan(cuda::AddOp(net.ct, x));
    if (p.ok()) {
      fwd_ = std::move(*p);
    } else {
      net.Fallback(self_, "add", p.status());
    }
    return OkStatus();
  }
  Status Forward(Net& net, bool, int64_t) override {
    if (fwd_.ok()) return net.Run(fwd_);
    const Node& y = net.node(self_);
    cuda::Add(net.In(a_), net.In(b_), y.out.get(), net.t, y.count(), net.stream);
    return OkStatus();
  }
  // Before any layer binds its buffers, in reverse layer order: an input that only this add
  // consumes gets the output's gradient as its own (the gradient of a + b with respect to either is
  // the output's), so backward copies nothing for it. `readers`: LayerReaders of the model.
  Status ShareGradients(Net& net, const std::vector<std::vector<int>>& readers) {
    if (!net.NeedsGrad(self_) || a_ == b_) return OkStatus();
    for (auto [in, shared] : {std::pair{a_, &shared_a_}, std::pair{b_, &shared_b_}}) {
      if (!net.NeedsGrad(in) || readers[static_cast<size_t>(in)].size() != 1) continue;
      STOKE_RETURN_IF_ERROR(net.node(in).diff.Share(net.node(self_).diff));
      *shared = true;
    }
    return OkStatus();
  }
  Status Backward(Net& net) override {
    const Node& y = net.node(self_);
    for (auto [in, direct, shared] : {std::tuple{a_, direct_a_, shared_a_}, std::tuple{b_, direct_b_, shared_b_}}) {
      if (!net.NeedsGrad(in) || shared) continue;
      if (direct) {
        STOKE_CUDA_OK(cudaMemcpyAsync(net.node(in).diff.get(), y.diff.get(), y.diff.bytes(), cudaMemcpyDeviceToDevice,
                                      net.stream));
      } else {
        cuda::Accumulate(net.node(in).diff.get(), y.diff.get(), net.t, y.count(), net.stream);
      }
    }
    return OkStatus();
  }
  Status Bind(Net& net) override {
    direct_a_ = net.Claim(a_);
    direct_b_ = net.Claim(b_);
    if (!fwd_.ok()) return OkStatus();
    return net.Bind(fwd_, {const_cast<void*>(net.In(a_)), const_cast<void*>(net.In(b_)), net.node(self_).out.get()});
  }

 private:
  int self_, a_, b_;
  bool direct_a_ = false, direct_b_ = false;
  bool shared_a_ = false, shared_b_ = false;  // the input's gradient buffer is the output's
  GraphOp fwd_;
};

// ---------------------------------------------------------------- flatten and dropout (own kernels)

class FlattenLayer final : public OneInputLayer {
 public:
  FlattenLayer(int self, int in) : OneInputLayer(self, in) {}
  Status Init(Net& net) {
    const auto x = net.Dims(in_);
    return net.SetOutput(self_, x[1] * x[2] * x[3], 1, 1, true);
  }
  Status Forward(Net& net, bool, int64_t) override {
    const auto x = net.Dims(in_);
    cuda::Flatten(net.In(in_), net.node(self_).out.get(), net.t, static_cast<int>(x[0]), static_cast<int>(x[2]),
                  static_cast<int>(x[3]), static_cast<int>(x[1]), false, net.stream);
    return OkStatus();
  }
  Status Backward(Net& net) override {
    if (!net.NeedsGrad(in_)) return OkStatus();
    const auto x = net.Dims(in_);
    cuda::Flatten(net.node(self_).diff.get(), net.DiffTarget(in_, direct_), net.t, static_cast<int>(x[0]),
                  static_cast<int>(x[2]), static_cast<int>(x[3]), static_cast<int>(x[1]), true, net.stream);
    net.Deliver(in_, direct_);
    return OkStatus();
  }
};

class DropoutLayer final : public OneInputLayer {
 public:
  DropoutLayer(int self, int in, double p, uint64_t seed) : OneInputLayer(self, in), p_(p), seed_(seed) {}
  Status Init(Net& net) {
    const auto x = net.Dims(in_);
    STOKE_RETURN_IF_ERROR(net.SetOutput(self_, x[1], x[2], x[3], in_ >= 0 && net.node(in_).vector));
    return keep_.Alloc(static_cast<size_t>(net.node(self_).count()));
  }
  // The kernel draws value i of the mask as output i of a SplitMix64 stream from this seed: moving
  // the seed on by first_sample x (values per sample) draws this rank's rows of the global batch's
  // mask, as the CPU backend does (NetworkOptions::first_sample).
  uint64_t MaskSeed(const Net& net, const Node& y, int64_t step) const {
    const uint64_t per_sample = static_cast<uint64_t>(y.c) * static_cast<uint64_t>(y.h) * static_cast<uint64_t>(y.w);
    return MixSeed(seed_, static_cast<uint64_t>(step)) +
           static_cast<uint64_t>(net.opt.first_sample) * per_sample * 0x9E3779B97F4A7C15ull;
  }
  Status Forward(Net& net, bool training, int64_t step) override {
    const Node& y = net.node(self_);
    if (!training || p_ == 0) {
      STOKE_CUDA_OK(cudaMemcpyAsync(y.out.get(), net.In(in_), y.out.bytes(), cudaMemcpyDeviceToDevice, net.stream));
      return OkStatus();
    }
    cuda::Dropout(net.In(in_), y.out.get(), keep_.as<uint8_t>(), net.t, y.count(), static_cast<int>(y.c),
                  static_cast<int>(y.h), static_cast<int>(y.w), MaskSeed(net, y, step), p_, net.stream);
    return OkStatus();
  }
  Status Backward(Net& net) override {
    if (!net.NeedsGrad(in_)) return OkStatus();
    const Node& y = net.node(self_);
    void* dx = net.DiffTarget(in_, direct_);
    if (p_ == 0) {
      STOKE_CUDA_OK(cudaMemcpyAsync(dx, y.diff.get(), y.diff.bytes(), cudaMemcpyDeviceToDevice, net.stream));
    } else {
      cuda::DropoutBackward(y.diff.get(), keep_.as<uint8_t>(), dx, net.t, y.count(), p_, net.stream);
    }
    net.Deliver(in_, direct_);
    return OkStatus();
  }

 private:
  double p_;
  uint64_t seed_;
  DeviceBuffer keep_;
};

Result<std::unique_ptr<Layer>> MakeLayer(Net& net, const LayerSpec& l, int self, int in, int in2, uint64_t seed) {
  switch (l.type) {
    case LayerType::kConv:
      return ConvLayer::Make(net, l, self, in, seed);
    case LayerType::kLinear: {
      auto layer = std::make_unique<LinearLayer>(l, self, in);
      STOKE_RETURN_IF_ERROR(layer->Init(net, l, seed));
      return std::unique_ptr<Layer>(std::move(layer));
    }
    case LayerType::kBatchNorm: {
      auto layer = std::make_unique<BatchNormLayer>(self, in);
      STOKE_RETURN_IF_ERROR(layer->Init(net, l));
      return std::unique_ptr<Layer>(std::move(layer));
    }
    case LayerType::kRelu: {
      auto layer = std::make_unique<ReluLayer>(self, in);
      STOKE_RETURN_IF_ERROR(layer->Init(net));
      return std::unique_ptr<Layer>(std::move(layer));
    }
    case LayerType::kMaxPool:
    case LayerType::kAvgPool:
    case LayerType::kGlobalAvgPool: {
      auto layer = std::make_unique<PoolLayer>(self, in);
      STOKE_RETURN_IF_ERROR(layer->Init(net, l));
      return std::unique_ptr<Layer>(std::move(layer));
    }
    case LayerType::kAdd: {
      auto layer = std::make_unique<AddLayer>(self, in, in2);
      STOKE_RETURN_IF_ERROR(layer->Init(net));
      return std::unique_ptr<Layer>(std::move(layer));
    }
    case LayerType::kFlatten: {
      auto layer = std::make_unique<FlattenLayer>(self, in);
      STOKE_RETURN_IF_ERROR(layer->Init(net));
      return std::unique_ptr<Layer>(std::move(layer));
    }
    case LayerType::kDropout: {
      auto layer = std::make_unique<DropoutLayer>(self, in, l.p, seed);
      STOKE_RETURN_IF_ERROR(layer->Init(net));
      return std::unique_ptr<Layer>(std::move(layer));
    }
  }
  return InternalError("unknown layer type");
}

Result<std::vector<float>> Download(const void* p, DType t, int64_t n, cudaStream_t s) {
  std::vector<float> out(static_cast<size_t>(n));
  if (n == 0) return out;
  DeviceBuffer tmp;
  STOKE_RETURN_IF_ERROR(tmp.Alloc(static_cast<size_t>(n) * sizeof(float)));
  cuda::CastToFloat(p, t, tmp.as<float>(), n, s);
  STOKE_CUDA_OK(cudaMemcpyAsync(out.data(), tmp.get(), out.size() * sizeof(float), cudaMemcpyDeviceToHost, s));
  STOKE_CUDA_OK(cudaStreamSynchronize(s));
  STOKE_RETURN_IF_ERROR(LastLaunch("reading a tensor back"));
  return out;
}

}  // namespace

Status CudaAvailable() {
  const prefetch::CudaProbe probe = prefetch::ProbeCuda();
  if (probe.devices > 0) return OkStatus();
  return UnavailableError(probe.reason);
}

// How many ranks share their GPU with another rank, the same count on every rank (a GPU's UUID is
// unique across machines). Collective: one gather per run, which every rank joins even when it
// cannot reach its own GPU (a rank that returned before it left the others in a collective of
// another kind); the ranks then all fail with the first failing rank's error.
Result<int> RanksSharingAGpu(int device, StepSync* sync) {
  struct Entry {
    std::array<std::byte, 16> uuid{};
    char error[240] = {};  // empty: this rank has its GPU
  };
  static_assert(sizeof(Entry) == 256);
  Entry mine;
  const Status local = [&]() -> Status {
    STOKE_CUDA_OK(cudaSetDevice(device));
    cudaDeviceProp prop{};
    STOKE_CUDA_OK(cudaGetDeviceProperties(&prop, device));
    static_assert(sizeof prop.uuid.bytes == sizeof mine.uuid);
    std::memcpy(mine.uuid.data(), prop.uuid.bytes, mine.uuid.size());
    return OkStatus();
  }();
  if (!local.ok()) {
    const std::string text = fmt::format("GPU {}: {}", device, local.message());
    text.copy(mine.error, sizeof mine.error - 1);
    if (mine.error[0] == '\0') mine.error[0] = '?';
  }
  std::vector<Entry> all(static_cast<size_t>(sync->world()));
  STOKE_RETURN_IF_ERROR(sync->GatherBytes(std::as_bytes(std::span(&mine, 1)), std::as_writable_bytes(std::span(all))));
  if (!local.ok()) return local;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].error[0] != '\0') {
      return UnavailableError(fmt::format("rank {} cannot use its {}", r,
                                          std::string_view(all[r].error, strnlen(all[r].error, sizeof all[r].error))));
    }
  }
  std::map<std::array<std::byte, 16>, int> ranks_on;
  for (const Entry& e : all) ranks_on[e.uuid]++;
  int sharing = 0;
  for (const auto& [id, n] : ranks_on) sharing += n > 1 ? n : 0;
  return sharing;
}

// Data-parallel on GPUs. The gradients are cut into buckets (the same plan on every rank) that are
// launched strictly in order as backward completes them, so communication overlaps the layers
// still computing. How a bucket is averaged is the subclass's: NCCL on the device, or through the
// host over MPI (HostStagedParallel) where NCCL cannot run.
class DeviceParallel {
 public:
  virtual ~DeviceParallel() {
    for (cudaEvent_t e : ready_) cudaEventDestroy(e);
  }
  DeviceParallel(const DeviceParallel&) = delete;
  DeviceParallel& operator=(const DeviceParallel&) = delete;

  int world() const { return sync_->world(); }
  size_t buckets() const { return buckets_.size(); }
  void BeginStep() {
    pending_ = initial_;
    next_ = 0;
    error_ = OkStatus();
  }
  // Layer `layer`'s backward has been queued: its gradients are final once the stream gets there.
  void LayerDone(int layer) {
    for (int b : of_layer_[static_cast<size_t>(layer)]) pending_[static_cast<size_t>(b)]--;
    while (next_ < static_cast<int>(buckets_.size()) && pending_[static_cast<size_t>(next_)] <= 0) Launch(next_++);
  }
  // After backward: what is left, then the compute stream is ordered after the averaging.
  virtual Status FinishGradients() = 0;
  // The step's loss, top-1 and top-5 sums and its non-finite flag, summed over the ranks, in place.
  virtual Status SumStats(cuda::StepStats* s) = 0;
  // Synchronised batch norm: `n` doubles on the device summed over the ranks, in place.
  virtual Status SumChannels(double* values, size_t n) = 0;
  // The host's wait for `event` (the end of the step).
  virtual Status Wait(cudaEvent_t event) = 0;

 protected:
  DeviceParallel(Net& net, StepSync* sync) : net_(net), sync_(sync) {}
  virtual void Launch(int bucket) = 0;
  // Work queued on `stream` from now on starts once backward has written bucket `b`.
  Status AfterBackward(int b, cudaStream_t stream) {
    STOKE_CUDA_OK(cudaEventRecord(ready_[static_cast<size_t>(b)], net_.stream));
    STOKE_CUDA_OK(cudaStreamWaitEvent(stream, ready_[static_cast<size_t>(b)], 0));
    return OkStatus();
  }
  // The buckets, which parameters' layers complete each, and an event per bucket.
  Status PlanBuckets() {
    std::vector<DeviceParam> params;
    for (const ParamInfo& p : net_.params) {
      params.push_back({.group = p.group, .offset = p.offset, .count = p.count, .layer = p.layer});
    }
    std::vector<int64_t> sizes;
    std::vector<size_t> elem;
    for (const Group& g : net_.groups) {
      sizes.push_back(g.size);
      elem.push_back(cuda::SizeOf(g.grad_type));
    }
    buckets_ = PlanDeviceBuckets(params, sizes, elem, sync_->bucket_bytes(), sync_->first_bucket_bytes());
    of_layer_.assign(net_.layers.size(), {});
    initial_.assign(buckets_.size(), 0);
    for (const ParamInfo& p : net_.params) {
      for (size_t b = 0; b < buckets_.size(); ++b) {
        const DeviceBucket& k = buckets_[b];
        if (k.group == p.group && p.offset >= k.begin && p.offset < k.end) {
          of_layer_[static_cast<size_t>(p.layer)].push_back(static_cast<int>(b));
          initial_[b]++;
        }
      }
    }
    double largest = 0;
    for (const DeviceBucket& k : buckets_) {
      largest = std::max(largest, static_cast<double>(k.end - k.begin) * elem[static_cast<size_t>(k.group)] / (1 << 20));
    }
    sync_->DescribeDeviceBuckets(static_cast<int>(buckets_.size()), largest);
    ready_.resize(buckets_.size());
    for (auto& e : ready_) STOKE_CUDA_OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return OkStatus();
  }

  Net& net_;
  StepSync* sync_;
  std::vector<DeviceBucket> buckets_;        // in launch order
  std::vector<std::vector<int>> of_layer_;   // per layer: its parameters' buckets (one entry per parameter)
  std::vector<int> initial_, pending_;       // per bucket: parameters not yet written this step
  std::vector<cudaEvent_t> ready_;           // per bucket: recorded on the compute stream when it is final
  int next_ = 0;
  Status error_ = OkStatus();
};

// Averaging through the host, for ranks that share a GPU (NCCL refuses them) and machines without
// NCCL. Once backward has written a bucket, a stream of its own converts it to float32 and copies
// it into pinned memory; when the copy lands, a host function marks it ready for the StepSync's
// reducer (the CPU backend's: MPI on the communicator's thread), which averages it while backward
// goes on. After backward the host waits for the reducer, and the averages go back to the device,
// in the gradients' type, on the compute stream. The price: the gradients cross PCIe twice per
// step, and the host waits for backward to end before the update is queued.
class HostStagedParallel final : public DeviceParallel {
 public:
  static Result<std::unique_ptr<DeviceParallel>> Create(Net& net, StepSync* sync) {
    std::unique_ptr<HostStagedParallel> dp(new HostStagedParallel(net, sync));
    STOKE_RETURN_IF_ERROR(dp->PlanBuckets());
    std::vector<GradientSlice> slices;
    size_t total = 0;
    for (const DeviceBucket& k : dp->buckets_) {
      const auto n = static_cast<size_t>(k.end - k.begin);
      dp->staged_.push_back(total);
      slices.push_back({.offset = total, .count = n});
      total += n;
    }
    STOKE_CUDA_OK(cudaMallocHost(&dp->host_, std::max<size_t>(total, 1) * sizeof(float)));
    STOKE_CUDA_OK(cudaMallocHost(&dp->stats_, sizeof(cuda::StepStats)));
    STOKE_RETURN_IF_ERROR(dp->device_.Alloc(std::max<size_t>(total, 1) * sizeof(float)));
    STOKE_CUDA_OK(cudaStreamCreateWithFlags(&dp->stream_, cudaStreamNonBlocking));
    dp->landed_.resize(dp->buckets_.size());
    for (size_t b = 0; b < dp->landed_.size(); ++b) dp->landed_[b] = {dp.get(), static_cast<int>(b)};
    STOKE_RETURN_IF_ERROR(sync->AttachGradients(std::span<float>(dp->host_, total), std::move(slices)));
    return std::unique_ptr<DeviceParallel>(std::move(dp));
  }

  ~HostStagedParallel() override {
    {
      std::lock_guard lock(mutex_);
      closing_ = true;  // the StepSync may be gone already: host functions still queued skip it
    }
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);  // no host function may run after this object is gone
      cudaStreamDestroy(stream_);
    }
    cudaStreamSynchronize(net_.stream);  // copies out of stats_ and channels_ that a failed step left queued
    // A step that failed between its first bucket and the reducer's end may still have averages in
    // flight into host_ on the communicator's thread: that buffer is then left to the process.
    if (host_ != nullptr && !unfinished_) cudaFreeHost(host_);
    if (stats_ != nullptr) cudaFreeHost(stats_);
    if (channels_ != nullptr) cudaFreeHost(channels_);
  }

  Status FinishGradients() override {
    while (next_ < static_cast<int>(buckets_.size())) Launch(next_++);
    // Every bucket copied out and marked ready (the host functions have run) ...
    STOKE_CUDA_OK(cudaStreamSynchronize(stream_));
    Status averaged;
    {
      // ... then averaged over the ranks (bounded by the world's timeout). Also after a failed
      // launch: the reducer ends its step, so this rank's collectives stay in step with the others'.
      std::lock_guard lock(mutex_);
      averaged = sync_->FinishGradients();
      unfinished_ = false;
    }
    STOKE_RETURN_IF_ERROR(error_);
    STOKE_RETURN_IF_ERROR(averaged);
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const DeviceBucket& k = buckets_[b];
      const Group& g = net_.groups[static_cast<size_t>(k.group)];
      const int64_t n = k.end - k.begin;
      void* grad = Offset(g.grad.get(), k.begin, g.grad_type);
      if (g.grad_type == DType::kF32) {
        STOKE_CUDA_OK(cudaMemcpyAsync(grad, host_ + staged_[b], static_cast<size_t>(n) * sizeof(float),
                                      cudaMemcpyHostToDevice, net_.stream));
      } else {
        float* dev = device_.as<float>() + staged_[b];
        STOKE_CUDA_OK(cudaMemcpyAsync(dev, host_ + staged_[b], static_cast<size_t>(n) * sizeof(float),
                                      cudaMemcpyHostToDevice, net_.stream));
        cuda::CastFromFloat(dev, grad, g.grad_type, n, net_.stream);
      }
    }
    return LastLaunch("putting the averaged gradients back");
  }

  Status SumStats(cuda::StepStats* s) override {
    STOKE_CUDA_OK(cudaMemcpyAsync(stats_, s, sizeof(cuda::StepStats), cudaMemcpyDeviceToHost, net_.stream));
    STOKE_CUDA_OK(cudaStreamSynchronize(net_.stream));
    std::array<double, 4> v = {stats_->loss_sum, static_cast<double>(stats_->top1), static_cast<double>(stats_->top5),
                               static_cast<double>(stats_->non_finite)};
    STOKE_RETURN_IF_ERROR(SumOnHost(v));
    stats_->loss_sum = v[0];
    stats_->top1 = static_cast<unsigned long long>(std::llround(v[1]));
    stats_->top5 = static_cast<unsigned long long>(std::llround(v[2]));
    stats_->non_finite = static_cast<int>(std::llround(v[3]));
    STOKE_CUDA_OK(cudaMemcpyAsync(s, stats_, sizeof(cuda::StepStats), cudaMemcpyHostToDevice, net_.stream));
    return OkStatus();
  }

  // The host waits for the forward pass to reach the batch norm: every such layer drains the GPU.
  Status SumChannels(double* values, size_t n) override {
    STOKE_CUDA_OK(cudaStreamSynchronize(net_.stream));  // also: the last copy out of channels_ is done
    if (n > channel_capacity_) {
      if (channels_ != nullptr) STOKE_CUDA_OK(cudaFreeHost(channels_));
      channels_ = nullptr;
      STOKE_CUDA_OK(cudaMallocHost(&channels_, n * sizeof(double)));
      channel_capacity_ = n;
    }
    STOKE_CUDA_OK(cudaMemcpyAsync(channels_, values, n * sizeof(double), cudaMemcpyDeviceToHost, net_.stream));
    STOKE_CUDA_OK(cudaStreamSynchronize(net_.stream));
    STOKE_RETURN_IF_ERROR(SumOnHost(std::span<double>(channels_, n)));
    STOKE_CUDA_OK(cudaMemcpyAsync(values, channels_, n * sizeof(double), cudaMemcpyHostToDevice, net_.stream));
    return OkStatus();
  }

  Status Wait(cudaEvent_t event) override {
    STOKE_CUDA_OK(cudaEventSynchronize(event));  // the averaging itself was waited for (and timed) already
    return OkStatus();
  }

 private:
  struct Landed {
    HostStagedParallel* dp = nullptr;
    int bucket = 0;
  };
  HostStagedParallel(Net& net, StepSync* sync) : DeviceParallel(net, sync) {}

  void Launch(int b) override {
    const DeviceBucket& k = buckets_[static_cast<size_t>(b)];
    const Group& g = net_.groups[static_cast<size_t>(k.group)];
    unfinished_ = true;
    Status s = [&]() -> Status {
      STOKE_RETURN_IF_ERROR(AfterBackward(b, stream_));
      const int64_t n = k.end - k.begin;
      const void* grad = Offset(g.grad.get(), k.begin, g.grad_type);
      float* host = host_ + staged_[static_cast<size_t>(b)];
      if (g.grad_type == DType::kF32) {
        STOKE_CUDA_OK(
            cudaMemcpyAsync(host, grad, static_cast<size_t>(n) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
      } else {
        float* dev = device_.as<float>() + staged_[static_cast<size_t>(b)];
        cuda::CastToFloat(grad, g.grad_type, dev, n, stream_);
        STOKE_CUDA_OK(
            cudaMemcpyAsync(host, dev, static_cast<size_t>(n) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
      }
      STOKE_CUDA_OK(cudaLaunchHostFunc(stream_, &HostStagedParallel::OnLanded, &landed_[static_cast<size_t>(b)]));
      return OkStatus();
    }();
    if (error_.ok() && !s.ok()) error_ = s;
  }
  // On CUDA's host-function thread (no CUDA calls here): the bucket is in host memory.
  static void CUDART_CB OnLanded(void* token) {
    auto* l = static_cast<Landed*>(token);
    std::lock_guard lock(l->dp->mutex_);
    if (!l->dp->closing_) l->dp->sync_->GradientReady(l->bucket);
  }
  // A blocking sum over the ranks, queued after every bucket launched so far: the buckets' host
  // functions have all run first, so every rank queues its collectives in the same order.
  Status SumOnHost(std::span<double> values) {
    STOKE_CUDA_OK(cudaStreamSynchronize(stream_));
    std::lock_guard lock(mutex_);
    return sync_->SumOverRanks(values);
  }

  cudaStream_t stream_ = nullptr;
  float* host_ = nullptr;            // pinned: every bucket in float32, in launch order
  std::vector<size_t> staged_;       // per bucket: its offset in host_ and device_
  DeviceBuffer device_;              // float32 copies of the buckets kept in another type
  cuda::StepStats* stats_ = nullptr;  // pinned
  double* channels_ = nullptr;       // pinned, synchronised batch norm's sums
  size_t channel_capacity_ = 0;
  std::vector<Landed> landed_;       // per bucket: the host function's argument
  std::mutex mutex_;                 // the StepSync is used from the host-function thread and this one
  bool unfinished_ = false;          // a bucket launched this step, the reducer's step not ended yet
  bool closing_ = false;             // under mutex_: the destructor has begun
};

#if STOKE_WITH_NCCL
// Every rank loads NCCL, or none goes on to its collective set-up: kUnavailable on every rank when
// any failed (that rank's message names the library; the others say another rank failed).
Result<const cuda::Nccl*> AgreeOnNccl(StepSync* sync) {
  auto api = cuda::LoadNccl();
  float failed[1] = {api.ok() ? 0.f : 1.f};
  STOKE_RETURN_IF_ERROR(sync->SumOverRanks(std::span<float>(failed)));
  if (!api.ok()) return api.status();
  if (failed[0] != 0) return UnavailableError("NCCL could not be loaded on another rank (its error names it)");
  return *api;
}

// Gradients averaged with NCCL on a stream of their own, bucket by bucket (events order the
// streams; the host never waits for the device mid-step), the step's statistics summed over the
// ranks on the compute stream, and the host's one wait per step bounded by the world's timeout.
class NcclParallel final : public DeviceParallel {
 public:
  static Result<std::unique_ptr<DeviceParallel>> Create(Net& net, StepSync* sync, const cuda::Nccl* api) {
    std::unique_ptr<NcclParallel> dp(new NcclParallel(net, sync));
    dp->api_ = api;
    dp->timeout_s_ = sync->timeout_s();
    // Rank 0's id, and whether it has one: a failure there reaches every rank through the same
    // broadcast, so none goes on to a collective the others are not in.
    struct {
      ncclUniqueId id;
      int32_t ok;
    } offer{};
    Status made = OkStatus();
    if (sync->rank() == 0) {
      made = dp->api_->Check(dp->api_->GetUniqueId(&offer.id), "unique id");
      offer.ok = made.ok() ? 1 : 0;
    }
    STOKE_RETURN_IF_ERROR(sync->BroadcastBytes(std::span(reinterpret_cast<std::byte*>(&offer), sizeof offer), 0));
    STOKE_RETURN_IF_ERROR(made);
    if (offer.ok != 1) {
      return UnavailableError("NCCL: rank 0 could not make the communicator's unique id (its error says why)");
    }
    const ncclUniqueId& id = offer.id;
    STOKE_RETURN_IF_ERROR(
        dp->api_->Check(dp->api_->CommInitRank(&dp->comm_, sync->world(), id, sync->rank()), "communicator set-up"));
    STOKE_CUDA_OK(cudaStreamCreateWithFlags(&dp->stream_, cudaStreamNonBlocking));
    for (cudaEvent_t* e : {&dp->start_, &dp->done_, &dp->backward_done_}) STOKE_CUDA_OK(cudaEventCreate(e));
    for (cudaEvent_t* e : {&dp->channels_ready_, &dp->channels_done_}) {
      STOKE_CUDA_OK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    }
    STOKE_RETURN_IF_ERROR(dp->PlanBuckets());
    return std::unique_ptr<DeviceParallel>(std::move(dp));
  }

  ~NcclParallel() override {
    // A broken world leaves NCCL's kernels waiting for ranks that are gone: abort them before
    // anything waits for the stream. Broken worlds seen by Wait were aborted there; one that broke
    // after the last Wait (a rank gone while an evaluation's or a failed step's collectives were
    // queued) is found here, within the world's timeout (the StepSync may be gone: a copy of it).
    if (stream_ != nullptr && comm_ != nullptr && !broken_) {
      // The statistics' collectives are on the compute stream: NCCL's stream waits for them too,
      // so polling it covers both.
      if (cudaEventRecord(channels_ready_, net_.stream) == cudaSuccess) {
        cudaStreamWaitEvent(stream_, channels_ready_, 0);
      }
      const auto t0 = std::chrono::steady_clock::now();
      while (cudaStreamQuery(stream_) == cudaErrorNotReady) {
        (void)cudaGetLastError();
        ncclResult_t async = ncclSuccess;
        api_->CommGetAsyncError(comm_, &async);
        if ((async != ncclSuccess && async != ncclInProgress) ||
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_s_) {
          Break();
          break;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    if (comm_ != nullptr && !broken_) api_->CommDestroy(comm_);
    for (cudaEvent_t e : {start_, done_, backward_done_, channels_ready_, channels_done_}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Status FinishGradients() override {
    timed_ = false;
    STOKE_CUDA_OK(cudaEventRecord(backward_done_, net_.stream));
    while (next_ < static_cast<int>(buckets_.size())) Launch(next_++);
    STOKE_CUDA_OK(cudaEventRecord(done_, stream_));
    STOKE_CUDA_OK(cudaStreamWaitEvent(net_.stream, done_, 0));
    timed_ = error_.ok() && !buckets_.empty();  // start_, backward_done_ and done_ recorded this step
    return error_;
  }
  Status SumStats(cuda::StepStats* s) override {
    if (broken_) return UnavailableError("NCCL: the communicator was aborted after an earlier failure");
    STOKE_RETURN_IF_ERROR(api_->Check(api_->GroupStart(), "group start"));
    Status r = api_->Check(api_->AllReduce(&s->loss_sum, &s->loss_sum, 1, ncclFloat64, ncclSum, comm_, net_.stream),
                           "statistics");
    if (r.ok()) {
      r = api_->Check(api_->AllReduce(&s->top1, &s->top1, 2, ncclUint64, ncclSum, comm_, net_.stream), "statistics");
    }
    if (r.ok()) {
      r = api_->Check(api_->AllReduce(&s->non_finite, &s->non_finite, 1, ncclInt32, ncclSum, comm_, net_.stream),
                      "statistics");
    }
    Status end = api_->Check(api_->GroupEnd(), "group end");
    return r.ok() ? end : r;
  }
  // On NCCL's stream behind the gradient buckets already queued (one stream keeps every rank's
  // collectives in the same order), the compute stream waiting for it by an event.
  Status SumChannels(double* values, size_t n) override {
    if (broken_) return UnavailableError("NCCL: the communicator was aborted after an earlier failure");
    STOKE_CUDA_OK(cudaEventRecord(channels_ready_, net_.stream));
    STOKE_CUDA_OK(cudaStreamWaitEvent(stream_, channels_ready_, 0));
    STOKE_RETURN_IF_ERROR(api_->Check(api_->AllReduce(values, values, n, ncclFloat64, ncclSum, comm_, stream_),
                                      "synchronised batch norm"));
    STOKE_CUDA_OK(cudaEventRecord(channels_done_, stream_));
    STOKE_CUDA_OK(cudaStreamWaitEvent(net_.stream, channels_done_, 0));
    return OkStatus();
  }
  // Bounded by the world's timeout, and ended by an asynchronous NCCL error (a rank gone, a network
  // failure) rather than hanging.
  Status Wait(cudaEvent_t event) override {
    // A launch error of this step first: the query below clears the thread's last error.
    STOKE_RETURN_IF_ERROR(LastLaunch("a training kernel"));
    const auto t0 = std::chrono::steady_clock::now();
    while (true) {
      const cudaError_t q = cudaEventQuery(event);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) return InternalError(fmt::format("waiting for the step: {}", cudaGetErrorString(q)));
      (void)cudaGetLastError();  // "not ready" is recorded as the thread's last error: not a failure
      ncclResult_t async = ncclSuccess;
      api_->CommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        Break();
        return api_->Check(async, fmt::format("rank {}: gradient averaging failed", sync_->rank()));
      }
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (waited > sync_->timeout_s()) {
        Break();
        return UnavailableError(fmt::format("rank {}: the step's gradient averaging did not finish in {:.0f} s "
                                            "(a rank has gone?)",
                                            sync_->rank(), waited));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    // What the averaging cost, from the events on the two streams (after the step: no stall);
    // once per training step (an evaluation averages nothing and would count the last step again).
    if (!std::exchange(timed_, false)) return OkStatus();
    const auto comm_ms = ElapsedMs(start_, done_, "averaging");
    const auto overlap_ms = ElapsedMs(start_, backward_done_, "averaging during backward");
    const auto wait_ms = ElapsedMs(backward_done_, done_, "averaging after backward");
    if (comm_ms.ok() && overlap_ms.ok() && wait_ms.ok()) {
      sync_->AddDeviceCommTime(*comm_ms / 1e3, std::clamp(*overlap_ms, 0.0, *comm_ms) / 1e3,
                               std::max(*wait_ms, 0.0) / 1e3);
    }
    return OkStatus();
  }

 private:
  NcclParallel(Net& net, StepSync* sync) : DeviceParallel(net, sync) {}
  // The world is broken: end NCCL's kernels now, so that nothing queued behind them (a checkpoint's
  // download) waits forever. Later steps fail at their first collective.
  void Break() {
    if (comm_ != nullptr && !broken_) api_->CommAbort(comm_);
    broken_ = true;
  }
  void Launch(int b) override {
    if (broken_) {
      if (error_.ok()) error_ = UnavailableError("NCCL: the communicator was aborted after an earlier failure");
      return;
    }
    const DeviceBucket& k = buckets_[static_cast<size_t>(b)];
    const Group& g = net_.groups[static_cast<size_t>(k.group)];
    Status s = [&]() -> Status {
      STOKE_RETURN_IF_ERROR(AfterBackward(b, stream_));
      if (b == 0) STOKE_CUDA_OK(cudaEventRecord(start_, stream_));
      void* p = Offset(g.grad.get(), k.begin, g.grad_type);
      const ncclDataType_t t = g.grad_type == DType::kF32   ? ncclFloat32
                               : g.grad_type == DType::kF16 ? ncclFloat16
                                                            : ncclBfloat16;
      return api_->Check(
          api_->AllReduce(p, p, static_cast<size_t>(k.end - k.begin), t, ncclAvg, comm_, stream_),
          fmt::format("gradient bucket {}", b));
    }();
    if (error_.ok() && !s.ok()) error_ = s;
  }

  const cuda::Nccl* api_ = nullptr;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, done_ = nullptr, backward_done_ = nullptr;
  cudaEvent_t channels_ready_ = nullptr, channels_done_ = nullptr;  // synchronised batch norm
  bool broken_ = false;
  bool timed_ = false;  // a training step recorded the timing events since the last Wait
  double timeout_s_ = 0;  // the world's, for the destructor
};
#endif

struct CudaNetwork::Impl {
  Net net;
  cuda::AutotuneReport autotune;
  std::unique_ptr<DeviceParallel> dp;  // data-parallel: set by SetStepSync
  StepSync* sync = nullptr;

  // Places the parameters in their groups (group 1: linear weights first, for their compute copies;
  // then everything without weight decay), allocates and initialises them.
  Status AllocateParameters() {
    constexpr int64_t kAlign = 64;  // elements: 256-byte aligned tensors for cuDNN and cuBLAS
    auto align = [](int64_t v) { return (v + kAlign - 1) / kAlign * kAlign; };
    std::array<std::vector<int>, 2> order;
    for (int i = 0; i < static_cast<int>(net.params.size()); ++i) order[net.param(i).group].push_back(i);
    std::stable_partition(order[1].begin(), order[1].end(), [&](int i) { return net.param(i).copy; });
    for (int g = 0; g < 2; ++g) {
      Group& group = net.groups[g];
      group.grad_type = g == 0 ? net.t : DType::kF32;
      int64_t at = 0;
      for (int i : order[g]) {
        ParamInfo& p = net.params[static_cast<size_t>(i)];
        p.offset = at;
        at = align(at + p.count);
        if (p.decay) group.decay_end = at;
        if (p.copy) group.copy_end = at;
      }
      group.size = at;
      STOKE_RETURN_IF_ERROR(group.master.Alloc(static_cast<size_t>(at) * sizeof(float)));
      STOKE_RETURN_IF_ERROR(group.momentum.Alloc(static_cast<size_t>(at) * sizeof(float)));
      STOKE_RETURN_IF_ERROR(group.grad.Alloc(static_cast<size_t>(at) * cuda::SizeOf(group.grad_type)));
      if (net.t != DType::kF32) {
        STOKE_RETURN_IF_ERROR(group.copy.Alloc(static_cast<size_t>(group.copy_end) * cuda::SizeOf(net.t)));
      }
    }
    for (auto& p : net.params) {
      STOKE_RETURN_IF_ERROR(Upload(p, p.init, net.groups[p.group].master.as<float>()));
      p.init = {};
    }
    if (net.running_floats > 0) {
      const size_t bytes = static_cast<size_t>(net.running_floats) * sizeof(float);
      STOKE_RETURN_IF_ERROR(net.running_values.Alloc(bytes));
      std::vector<float> v(static_cast<size_t>(net.running_floats), 0.f);
      for (auto& r : net.running) {
        r->value = net.running_values.as<float>() + r->offset;
        std::fill_n(v.begin() + r->offset, r->c, r->init);
      }
      STOKE_CUDA_OK(cudaMemcpyAsync(net.running_values.get(), v.data(), bytes, cudaMemcpyHostToDevice, net.stream));
      STOKE_CUDA_OK(cudaStreamSynchronize(net.stream));
    }
    RefreshCopies();
    return OkStatus();
  }

  // Layer-wise adaptation's layout of each group (chunks and segments of its tensors), made at the
  // first step that asks for LARS or LARC.
  struct LarsGroup {
    DeviceBuffer chunks, segments, partials, ratios;
    int num_chunks = 0, num_segments = 0;
  };
  std::array<LarsGroup, 2> lars;
  bool lars_ready = false;

  Status PrepareLars() {
    if (lars_ready) return OkStatus();
    for (size_t g = 0; g < lars.size(); ++g) {
      std::vector<const ParamInfo*> tensors;
      for (const ParamInfo& p : net.params) {
        if (p.group == static_cast<int>(g) && p.count > 0) tensors.push_back(&p);
      }
      std::sort(tensors.begin(), tensors.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
      std::vector<cuda::LarsChunk> chunks;
      std::vector<cuda::LarsSegment> segments;
      for (const ParamInfo* p : tensors) {
        const int segment = static_cast<int>(segments.size());
        cuda::LarsSegment seg{.first_chunk = static_cast<int>(chunks.size()), .chunks = 0, .adapt = p->decay ? 1 : 0,
                              .pad = 0};
        for (int64_t at = p->offset; at < p->offset + p->count; at += cuda::kLarsChunk) {
          chunks.push_back({.begin = at, .end = std::min(at + cuda::kLarsChunk, p->offset + p->count),
                            .segment = segment, .pad = 0});
          ++seg.chunks;
        }
        segments.push_back(seg);
      }
      LarsGroup& l = lars[g];
      l.num_chunks = static_cast<int>(chunks.size());
      l.num_segments = static_cast<int>(segments.size());
      STOKE_RETURN_IF_ERROR(l.chunks.Alloc(chunks.size() * sizeof(cuda::LarsChunk)));
      STOKE_RETURN_IF_ERROR(l.segments.Alloc(segments.size() * sizeof(cuda::LarsSegment)));
      STOKE_RETURN_IF_ERROR(l.partials.Alloc(chunks.size() * 2 * sizeof(double)));
      STOKE_RETURN_IF_ERROR(l.ratios.Alloc(segments.size() * sizeof(float)));
      // On the network's stream (which does not wait for the default one), finished before the
      // host tables go.
      STOKE_CUDA_OK(cudaMemcpyAsync(l.chunks.get(), chunks.data(), chunks.size() * sizeof(cuda::LarsChunk),
                                    cudaMemcpyHostToDevice, net.stream));
      STOKE_CUDA_OK(cudaMemcpyAsync(l.segments.get(), segments.data(),
                                    segments.size() * sizeof(cuda::LarsSegment), cudaMemcpyHostToDevice, net.stream));
      STOKE_CUDA_OK(cudaStreamSynchronize(net.stream));
    }
    lars_ready = true;
    return OkStatus();
  }

  // The optimizer step on every group, with the layer-wise ratios first when asked for.
  Status Update(float lr, const SgdOptions& sgd) {
    const bool adapt = sgd.adaptation != LayerAdaptation::kNone;
    if (adapt) STOKE_RETURN_IF_ERROR(PrepareLars());
    const cuda::SgdArgs args{.lr = lr, .momentum = static_cast<float>(sgd.momentum),
                             .weight_decay = static_cast<float>(sgd.weight_decay),
                             .inv_loss_scale = 1.f / net.loss_scale, .nesterov = sgd.nesterov};
    const cuda::LarsArgs lars_args{
        .trust = static_cast<float>(sgd.trust()), .eps = static_cast<float>(sgd.eps),
        .weight_decay = static_cast<float>(sgd.weight_decay), .lr = lr, .inv_loss_scale = 1.f / net.loss_scale,
        .clip_by_lr = sgd.adaptation == LayerAdaptation::kLarc && sgd.clip ? 1 : 0};
    auto* stats = net.stats.as<cuda::StepStats>();
    for (size_t k = 0; k < net.groups.size(); ++k) {
      const Group& g = net.groups[k];
      const int64_t decay_end = sgd.decay_bn_and_bias ? g.size : g.decay_end;
      void* copy = net.t == DType::kF32 ? nullptr : g.copy.get();
      if (!adapt) {
        cuda::SgdUpdate(g.master.as<float>(), g.momentum.as<float>(), g.grad.get(), g.grad_type, copy, net.t, g.size,
                        decay_end, g.copy_end, args, stats, net.stream);
        continue;
      }
      const LarsGroup& l = lars[k];
      const auto* chunks = l.chunks.as<const cuda::LarsChunk>();
      cuda::LarsTrustRatios(g.master.as<float>(), g.grad.get(), g.grad_type, chunks, l.num_chunks,
                            l.segments.as<const cuda::LarsSegment>(), l.num_segments, lars_args,
                            l.partials.as<double>(), l.ratios.as<float>(), stats, net.stream);
      cuda::SgdUpdate(g.master.as<float>(), g.momentum.as<float>(), g.grad.get(), g.grad_type, copy, net.t, g.size,
                      decay_end, g.copy_end, args, stats, net.stream, chunks, l.num_chunks, l.ratios.as<float>());
    }
    STOKE_CUDA_OK(cudaGetLastError());
    return OkStatus();
  }

  // Plain values of one parameter into `base` (a group's master or momentum).
  Status Upload(const ParamInfo& p, const std::vector<float>& plain, float* base) {
    const std::vector<float> v = p.krsc ? KrscFromOihw(plain, p.dims, p.device_c) : plain;
    STOKE_CUDA_OK(cudaMemcpyAsync(base + p.offset, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice,
                                  net.stream));
    STOKE_CUDA_OK(cudaStreamSynchronize(net.stream));
    return OkStatus();
  }
  Result<std::vector<float>> DownloadParam(const ParamInfo& p, const void* base, DType t, float divide = 1) const {
    STOKE_ASSIGN_OR_RETURN(std::vector<float> v,
                           Download(Offset(const_cast<void*>(base), p.offset, t), t, p.count, net.stream));
    if (divide != 1) {
      for (auto& x : v) x /= divide;
    }
    return p.krsc ? OihwFromKrsc(v, p.dims, p.device_c) : v;
  }
  void RefreshCopies() {
    if (net.t == DType::kF32) return;
    for (const Group& g : net.groups) {
      if (g.copy_end > 0) cuda::CastFromFloat(g.master.as<float>(), g.copy.get(), net.t, g.copy_end, net.stream);
    }
  }

  // The batch's pixels and labels on the device; waits (on the stream) for the ring's copy.
  Result<std::pair<const uint8_t*, const int32_t*>> Input(const prefetch::Batch& b) {
    const size_t bytes = static_cast<size_t>(b.size) * net.opt.image_size * net.opt.height() * 3;
    if (b.device_images != nullptr) {
      STOKE_RETURN_IF_ERROR(prefetch::WaitForCopy(b, net.stream));
      const auto* base = static_cast<const uint8_t*>(b.device_images);
      return std::pair{base, reinterpret_cast<const int32_t*>(base + b.device_labels_offset)};
    }
    STOKE_CUDA_OK(cudaMemcpyAsync(net.staging.get(), b.images.data(), bytes, cudaMemcpyHostToDevice, net.stream));
    STOKE_CUDA_OK(cudaMemcpyAsync(net.labels.get(), b.labels.data(), static_cast<size_t>(b.size) * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, net.stream));
    return std::pair{net.staging.as<const uint8_t>(), net.labels.as<const int32_t>()};
  }
  Status Normalise(const uint8_t* pixels, int valid) {
    const prefetch::DeviceDType t = net.t == DType::kF32   ? prefetch::DeviceDType::kFloat32
                                    : net.t == DType::kF16 ? prefetch::DeviceDType::kFloat16
                                                           : prefetch::DeviceDType::kBFloat16;
    const int64_t pixels_per_image = int64_t{net.opt.image_size} * net.opt.height();
    return prefetch::NormalizeOnDevice(pixels, valid, net.opt.batch, pixels_per_image, net.opt.normalize.mean,
                                       net.opt.normalize.std, t, net.input.get(), net.stream,
                                       static_cast<int>(net.in_c));
  }

  Status Forward(bool training, int64_t step) {
    for (auto& layer : net.layers) STOKE_RETURN_IF_ERROR(layer->Forward(net, training, step));
    return OkStatus();
  }
  Status Backward() {
    for (size_t i = net.layers.size(); i-- > 0;) {
      if (!net.needs_grad[i]) continue;  // nothing upstream of it learns
      Node& n = net.nodes[i];
      if (n.zero_diff) STOKE_CUDA_OK(cudaMemsetAsync(n.diff.get(), 0, n.diff.bytes(), net.stream));
      STOKE_RETURN_IF_ERROR(net.layers[i]->Backward(net));
      if (dp) dp->LayerDone(static_cast<int>(i));
    }
    return OkStatus();
  }
  // Forward, loss and backward on the normalised input; statistics land in host_stats after Finish().
  Status ForwardBackward(const int32_t* labels, int64_t step, float grad_scale) {
    STOKE_CUDA_OK(cudaMemsetAsync(net.stats.get(), 0, sizeof(cuda::StepStats), net.stream));
    STOKE_RETURN_IF_ERROR(Forward(true, step));
    const Node& last = net.nodes.back();
    cuda::SoftmaxCrossEntropy(last.out.get(), net.t, labels, net.opt.batch, net.opt.model.classes,
                              static_cast<float>(net.opt.label_smoothing), last.diff.get(),
                              grad_scale / static_cast<float>(net.opt.batch), net.stats.as<cuda::StepStats>(),
                              net.row_loss.as<double>(), net.stream);
    net.last_grad_scale = grad_scale;
    if (dp) dp->BeginStep();
    STOKE_RETURN_IF_ERROR(Backward());
    if (dp) STOKE_RETURN_IF_ERROR(dp->FinishGradients());  // every rank now holds the mean gradient
    for (const Group& g : net.groups) {
      cuda::FindNonFinite(g.grad.get(), g.grad_type, g.size, net.stats.as<cuda::StepStats>(), net.stream);
    }
    // Statistics of the global batch; a non-finite loss or gradient anywhere is seen everywhere.
    if (dp) STOKE_RETURN_IF_ERROR(dp->SumStats(net.stats.as<cuda::StepStats>()));
    return OkStatus();
  }
  Status Finish() {
    STOKE_CUDA_OK(cudaMemcpyAsync(net.host_stats, net.stats.get(), sizeof(cuda::StepStats), cudaMemcpyDeviceToHost,
                                  net.stream));
    STOKE_CUDA_OK(cudaEventRecord(net.done[static_cast<size_t>(net.cur)], net.stream));
    if (dp) {
      STOKE_RETURN_IF_ERROR(dp->Wait(net.done[static_cast<size_t>(net.cur)]));
    } else {
      STOKE_CUDA_OK(cudaStreamSynchronize(net.stream));
    }
    return LastLaunch("a training kernel");
  }
  BatchStats Stats(int rows) const {
    BatchStats s;
    s.loss_sum = net.host_stats->loss_sum;
    s.top1 = static_cast<int64_t>(net.host_stats->top1);
    s.top5 = static_cast<int64_t>(net.host_stats->top5);
    s.count = rows;
    return s;
  }
};

CudaNetwork::CudaNetwork(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaNetwork::~CudaNetwork() = default;

const NetworkOptions& CudaNetwork::options() const { return impl_->net.opt; }

Result<std::unique_ptr<CudaNetwork>> CudaNetwork::Create(NetworkOptions options) {
  return CatchExceptions(fmt::format("cuda backend: building the model (batch {})", options.batch), [&] {
    auto made = CreateUnguarded(options);
    // A padded input whose convolution cuDNN cannot plan: the unpadded network, said so. Any other
    // failure (a later layer, autotuning, a device fault) is returned as it is.
    if (!made.ok() && made.status().code() == StatusCode::kInternal && options.input_channels != 3 &&
        made.status().message().find(kPaddedInputUnplanned) != std::string_view::npos) {
      STOKE_LOG(WARN, "cuda.input_channels {}: {}; building with 3 input channels", options.input_channels,
                made.status().message());
      options.input_channels = 3;
      made = CreateUnguarded(std::move(options));
    }
    return made;
  });
}

Result<std::unique_ptr<CudaNetwork>> CudaNetwork::CreateUnguarded(NetworkOptions options) {
  if (options.batch < 1) return InvalidArgumentError(fmt::format("batch must be >= 1, got {}", options.batch));
  if (options.image_size < 1 || options.image_height < 0) {
    return InvalidArgumentError(
        fmt::format("image size must be >= 1, got {}x{}", options.image_size, options.height()));
  }
  if (!(options.label_smoothing >= 0 && options.label_smoothing < 1)) {
    return InvalidArgumentError(fmt::format("label smoothing must be in [0, 1), got {}", options.label_smoothing));
  }
  if (options.input_channels != 3 && options.input_channels != 4 && options.input_channels != 8) {
    return InvalidArgumentError(
        fmt::format("input channels must be 3, 4 or 8 (the image's 3 and zeros), got {}", options.input_channels));
  }
  const Shape input{3, options.height(), options.image_size};
  STOKE_ASSIGN_OR_RETURN(auto shapes, ResolveModel(options.model, input));
  STOKE_RETURN_IF_ERROR(CudaAvailable());

  auto impl = std::make_unique<Impl>();
  Net& net = impl->net;
  net.opt = std::move(options);
  net.shapes = std::move(shapes);
  net.needs_grad = LayersNeedingGradient(net.opt.model);
  net.t = net.opt.precision == Precision::kFloat32   ? DType::kF32
          : net.opt.precision == Precision::kBFloat16 ? DType::kBF16
                                                      : DType::kF16;
  net.ct = cuda::CudnnType(net.opt.precision);
  net.loss_scale = net.opt.precision == Precision::kFloat16 ? 65536.f : 1.f;
  STOKE_CUDA_OK(cudaSetDevice(net.opt.device));
  STOKE_CUDA_OK(cudaStreamCreateWithFlags(&net.stream, cudaStreamNonBlocking));
  cudnnStatus_t st = cudnnCreate(&net.dnn);
  if (st != CUDNN_STATUS_SUCCESS) return cuda::CudnnError(st, "create handle");
  st = cudnnSetStream(net.dnn, net.stream);
  if (st != CUDNN_STATUS_SUCCESS) return cuda::CudnnError(st, "set stream");
  STOKE_CUBLAS_OK(cublasCreate(&net.blas), "create handle");
  STOKE_CUBLAS_OK(cublasSetStream(net.blas, net.stream), "set stream");
  STOKE_ASSIGN_OR_RETURN(net.graphs, cuda::Graphs::Create(net.dnn, net.t != DType::kF32, net.opt.autotune));
  for (auto& e : net.done) STOKE_CUDA_OK(cudaEventCreate(&e));
  STOKE_CUDA_OK(cudaEventCreate(&net.ready));
  STOKE_CUDA_OK(cudaMallocHost(&net.host_stats, sizeof(cuda::StepStats)));

  const ModelSpec& model = net.opt.model;
  net.in_c = cuda::DeviceInputChannels(model, net.opt.precision, net.opt.input_channels);
  if (net.in_c != net.opt.input_channels) {
    STOKE_LOG(WARN, "cuda.input_channels {} not applied: {}", net.opt.input_channels,
              net.opt.precision == Precision::kFloat32
                  ? "float32 runs no tensor-core engine, so the zeros would only add work"
                  : "a layer other than a convolution reads the input");
  }
  const int n = net.opt.batch;
  const size_t image_pixels = static_cast<size_t>(n) * net.opt.image_size * net.opt.height();
  const size_t pixels = image_pixels * 3;  // uint8 values of a batch
  STOKE_RETURN_IF_ERROR(net.input.Alloc(image_pixels * static_cast<size_t>(net.in_c) * cuda::SizeOf(net.t)));
  STOKE_RETURN_IF_ERROR(net.staging.Alloc(pixels));
  STOKE_RETURN_IF_ERROR(net.labels.Alloc(static_cast<size_t>(n) * sizeof(int32_t)));
  STOKE_RETURN_IF_ERROR(net.stats.Alloc(sizeof(cuda::StepStats)));
  STOKE_RETURN_IF_ERROR(net.row_loss.Alloc(static_cast<size_t>(n) * sizeof(double)));

  std::map<std::string, int> index{{"input", -1}};
  for (size_t i = 0; i < model.layers.size(); ++i) index[model.layers[i].name] = static_cast<int>(i);
  net.nodes.resize(model.layers.size());
  int64_t largest = pixels;
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const LayerSpec& l = model.layers[i];
    const int in = index[l.inputs[0]];
    const int in2 = l.inputs.size() > 1 ? index[l.inputs[1]] : -1;
    const uint64_t seed = MixSeed(net.opt.seed, 0x6c61796572ull, i);
    net.building_layer = static_cast<int>(i);
    STOKE_ASSIGN_OR_RETURN(auto layer, MakeLayer(net, l, static_cast<int>(i), in, in2, seed));
    net.layers.push_back(std::move(layer));
    largest = std::max(largest, net.nodes[i].count());
  }
  // Residual adds hand their gradient on without a copy where they are an input's only consumer;
  // the last add first, so a chain of them ends up sharing one buffer.
  const std::vector<std::vector<int>> readers = LayerReaders(model);
  for (size_t i = net.layers.size(); i-- > 0;) {
    if (auto* add = dynamic_cast<AddLayer*>(net.layers[i].get()); add != nullptr) {
      STOKE_RETURN_IF_ERROR(add->ShareGradients(net, readers));
    }
  }
  // Then (buffers final) batch norm + ReLU pairs, where asked for.
  int fused = 0;
  for (size_t i = 0; net.opt.fuse_bn_relu && i < net.layers.size(); ++i) {
    auto* bn = dynamic_cast<BatchNormLayer*>(net.layers[i].get());
    const int j = readers[i].size() == 1 ? readers[i][0] : -1;
    auto* relu = bn != nullptr && j >= 0 ? dynamic_cast<ReluLayer*>(net.layers[static_cast<size_t>(j)].get())
                                         : nullptr;
    if (relu == nullptr || !bn->CanFuse(net, j)) continue;
    STOKE_RETURN_IF_ERROR(bn->FuseRelu(net, j));
    relu->SetFused();
    ++fused;
  }
  STOKE_RETURN_IF_ERROR(net.workspace.Alloc(static_cast<size_t>(net.graphs->max_workspace())));
  STOKE_RETURN_IF_ERROR(net.scratch.Alloc(static_cast<size_t>(largest) * cuda::SizeOf(net.t)));
  STOKE_RETURN_IF_ERROR(net.partials.Alloc(std::max<size_t>(net.partial_floats, 1) * sizeof(float)));
  STOKE_RETURN_IF_ERROR(impl->AllocateParameters());
  for (size_t i = net.layers.size(); i-- > 0;) STOKE_RETURN_IF_ERROR(net.layers[i]->Bind(net));
  for (size_t i = 0; i + 1 < net.nodes.size(); ++i) net.nodes[i].zero_diff = !net.nodes[i].claimed;
  STOKE_CUDA_OK(cudaStreamSynchronize(net.stream));
  STOKE_RETURN_IF_ERROR(LastLaunch("set-up"));
  if (net.opt.autotune) {
    // Convolutions only write their outputs (and scratch), all overwritten by the first step.
    std::vector<cuda::PlanUse> uses;
    for (const GraphOp* g : net.bound) uses.push_back({g->plan, &g->pack});
    STOKE_ASSIGN_OR_RETURN(const cuda::AutotuneReport tuned, net.graphs->Autotune(net.stream, uses));
    STOKE_RETURN_IF_ERROR(LastLaunch("autotuning"));
    impl->autotune = tuned;
    net.autotuned = fmt::format(
        "cuDNN autotuning: {} convolution shapes timed in {:.1f} s, {} changed engine{}; {} decided earlier in this "
        "process, {} with one usable engine",
        tuned.shapes, tuned.seconds, tuned.changed,
        tuned.failed > 0 ? fmt::format(" ({} candidates did not run and were dropped)", tuned.failed) : "",
        tuned.reused, tuned.single);
    if (tuned.shapes > 0) {
      net.autotuned += fmt::format("; one step's convolutions {:.2f} ms with heuristics' first choices, {:.2f} ms tuned",
                                   tuned.first_ms, tuned.tuned_ms);
    }
    STOKE_LOG(INFO, "{}", net.autotuned);
    // The losers' workspace is not needed any more: a smaller buffer, and every pack bound to it.
    if (const auto need = static_cast<size_t>(std::max<int64_t>(net.graphs->max_workspace(), 1));
        need < net.workspace.bytes()) {
      net.workspace = DeviceBuffer();
      STOKE_RETURN_IF_ERROR(net.workspace.Alloc(need));
      for (GraphOp* g : net.bound) {
        STOKE_ASSIGN_OR_RETURN(g->pack, cuda::Graphs::Bind(g->uids, g->pointers, net.workspace.get()));
      }
    }
  }
  if (!net.fallbacks.empty()) {
    STOKE_LOG(WARN, "cuDNN offered no engine for {} step(s); stoke's own kernels run them: {}", net.fallbacks.size(),
              fmt::join(net.fallbacks, "; "));
  }
  if (!net.nondeterministic.empty()) {
    STOKE_LOG(WARN, "cuDNN offered only non-deterministic engines for {} step(s) (the same inputs may differ in the "
              "last bits from run to run): {}", net.nondeterministic.size(), fmt::join(net.nondeterministic, "; "));
  }
  if (!net.rounded.empty()) {
    STOKE_LOG(WARN, "cuDNN offered only engines that round float32 inputs to TF32 for {} step(s) (about 3 decimal "
              "digits, not float32's 7): {}", net.rounded.size(), fmt::join(net.rounded, "; "));
  }
  net.fused_pairs = fused;
  STOKE_LOG(INFO,
            "CUDA backend: {} layers, {} precision, {} cuDNN operations sharing {} plans, workspace {} MiB{}{}",
            net.layers.size(), PrecisionName(net.opt.precision), net.bound.size(), net.graphs->cached_plans(),
            net.graphs->max_workspace() >> 20,
            fused > 0 ? fmt::format(", {} batch norm + ReLU pairs fused", fused) : "",
            net.in_c != 3 ? fmt::format(", input padded to {} channels", net.in_c) : "");
  net.bound.clear();
  return std::unique_ptr<CudaNetwork>(new CudaNetwork(std::move(impl)));
}

Result<BatchStats> CudaNetwork::TrainStep(const prefetch::Batch& batch, float lr, const SgdOptions& sgd,
                                          int64_t step) {
  return CatchExceptions("cuda backend: training step", [&]() -> Result<BatchStats> {
    Net& net = impl_->net;
    // Set again once this step has completed: until then the events are not a finished step's.
    const bool after_a_step = std::exchange(net.have_prev, false);
    STOKE_RETURN_IF_ERROR(CheckBatch(net.opt, batch, true));
    STOKE_ASSIGN_OR_RETURN(auto in, impl_->Input(batch));
    STOKE_CUDA_OK(cudaEventRecord(net.ready, net.stream));
    STOKE_RETURN_IF_ERROR(impl_->Normalise(in.first, batch.size));
    // Only these steps can be skipped; the others end the run when they are not finite.
    const bool may_skip = net.opt.precision == Precision::kFloat16 || impl_->dp != nullptr;
    const size_t stat_bytes = static_cast<size_t>(net.running_floats) * sizeof(float);
    if (may_skip && stat_bytes > 0) {
      if (net.running_saved.get() == nullptr) STOKE_RETURN_IF_ERROR(net.running_saved.Alloc(stat_bytes));
      STOKE_CUDA_OK(cudaMemcpyAsync(net.running_saved.get(), net.running_values.get(), stat_bytes,
                                    cudaMemcpyDeviceToDevice, net.stream));
    }
    STOKE_RETURN_IF_ERROR(impl_->ForwardBackward(in.second, step, net.loss_scale));
    STOKE_RETURN_IF_ERROR(impl_->Update(lr, sgd));
    STOKE_RETURN_IF_ERROR(impl_->Finish());
    // The device's idle time before this batch was ready: from the end of the previous step.
    const auto prev = net.done[static_cast<size_t>(1 - net.cur)];
    net.last_wait = -1;
    if (after_a_step) {
      if (const auto waited = ElapsedMs(prev, net.ready, "data-wait"); waited.ok()) net.last_wait = *waited / 1000.0;
    }
    net.have_prev = true;  // ready and done[1 - cur] are now this step's
    net.cur = 1 - net.cur;

    BatchStats stats = impl_->Stats(batch.size * (impl_->dp ? impl_->dp->world() : 1));
    const bool overflow = net.host_stats->non_finite != 0 || !std::isfinite(stats.loss_sum);
    if (overflow && may_skip && stat_bytes > 0) {
      // The step is skipped (below) or the run ends: the statistics go back to before this batch.
      STOKE_CUDA_OK(cudaMemcpyAsync(net.running_values.get(), net.running_saved.get(), stat_bytes,
                                    cudaMemcpyDeviceToDevice, net.stream));
    }
    if (net.opt.precision == Precision::kFloat16) {
      // Dynamic loss scaling: halve and skip on overflow, double after 2000 clean steps.
      if (overflow) {
        if (net.loss_scale <= 1.f) {
          return InvalidArgumentError(fmt::format(
              "the gradients are not finite at step {} even with loss scale 1 (learning rate {} too high?)", step, lr));
        }
        net.loss_scale = std::max(1.f, net.loss_scale / 2);
        net.good_steps = 0;
        ++net.skipped;
        stats.overflowed = 1;  // the update was skipped on the device (SgdUpdate reads the flag)
      } else if (++net.good_steps == 2000) {
        net.loss_scale = std::min(net.loss_scale * 2, 16777216.f);
        net.good_steps = 0;
      }
    } else if (overflow && impl_->dp) {
      // Data-parallel: every rank saw the same summed flag and skipped the update on the device;
      // the trainer counts the step as skipped by every rank (as the CPU backend reports it).
      stats.skipped = 1;
    } else if (overflow) {
      return InvalidArgumentError(fmt::format("the loss is not finite at step {} (learning rate {} too high?)", step, lr));
    }
    return stats;
  });
}

Result<BatchStats> CudaNetwork::Evaluate(const prefetch::Batch& batch) {
  return CatchExceptions("cuda backend: evaluation", [&]() -> Result<BatchStats> {
    Net& net = impl_->net;
    STOKE_RETURN_IF_ERROR(CheckBatch(net.opt, batch, false));
    STOKE_ASSIGN_OR_RETURN(auto in, impl_->Input(batch));
    STOKE_RETURN_IF_ERROR(impl_->Normalise(in.first, batch.size));
    STOKE_CUDA_OK(cudaMemsetAsync(net.stats.get(), 0, sizeof(cuda::StepStats), net.stream));
    STOKE_RETURN_IF_ERROR(impl_->Forward(false, 0));
    cuda::SoftmaxCrossEntropy(net.nodes.back().out.get(), net.t, in.second, batch.size, net.opt.model.classes,
                              static_cast<float>(net.opt.label_smoothing), nullptr, 1.f,
                              net.stats.as<cuda::StepStats>(), net.row_loss.as<double>(), net.stream);
    STOKE_RETURN_IF_ERROR(impl_->Finish());
    net.have_prev = false;  // the next step's wait is not measured across an evaluation
    return impl_->Stats(batch.size);
  });
}

Result<BatchStats> CudaNetwork::ForwardBackward(std::span<const float> input, std::span<const int32_t> labels,
                                                int64_t step) {
  return CatchExceptions("cuda backend: forward and backward", [&]() -> Result<BatchStats> {
    Net& net = impl_->net;
    const int n = net.opt.batch;
    const size_t plane = static_cast<size_t>(net.opt.image_size) * net.opt.height();
    if (input.size() != static_cast<size_t>(n) * 3 * plane || labels.size() != static_cast<size_t>(n)) {
      return InvalidArgumentError("ForwardBackward: input or labels do not match the batch shape");
    }
    const auto channels = static_cast<size_t>(net.in_c);  // the image's 3, then zeros
    std::vector<float> nhwc(input.size() / 3 * channels, 0.f);
    for (size_t s = 0; s < static_cast<size_t>(n); ++s)
      for (size_t c = 0; c < 3; ++c)
        for (size_t p = 0; p < plane; ++p) nhwc[(s * plane + p) * channels + c] = input[(s * 3 + c) * plane + p];
    DeviceBuffer tmp;
    STOKE_RETURN_IF_ERROR(tmp.Alloc(nhwc.size() * sizeof(float)));
    STOKE_CUDA_OK(cudaMemcpyAsync(tmp.get(), nhwc.data(), nhwc.size() * sizeof(float), cudaMemcpyHostToDevice,
                                  net.stream));
    cuda::CastFromFloat(tmp.as<float>(), net.input.get(), net.t, static_cast<int64_t>(nhwc.size()), net.stream);
    STOKE_CUDA_OK(cudaMemcpyAsync(net.labels.get(), labels.data(), labels.size() * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, net.stream));
    STOKE_RETURN_IF_ERROR(impl_->ForwardBackward(net.labels.as<int32_t>(), step, 1.f));
    STOKE_RETURN_IF_ERROR(impl_->Finish());
    net.have_prev = false;
    return impl_->Stats(n);
  });
}

Result<std::vector<NamedTensor>> CudaNetwork::Gradients() const {
  return CatchExceptions("cuda backend: reading the gradients", [&]() -> Result<std::vector<NamedTensor>> {
    const Net& net = impl_->net;
    std::vector<NamedTensor> out;
    for (const auto& p : net.params) {
      const Group& g = net.groups[p.group];
      STOKE_ASSIGN_OR_RETURN(auto v, impl_->DownloadParam(p, g.grad.get(), g.grad_type, net.last_grad_scale));
      out.push_back({p.name, p.dims, std::move(v)});
    }
    return out;
  });
}

Result<std::vector<NamedTensor>> CudaNetwork::State() const {
  return CatchExceptions("cuda backend: reading the state", [&]() -> Result<std::vector<NamedTensor>> {
    const Net& net = impl_->net;
    std::vector<NamedTensor> out;
    for (const auto& p : net.params) {
      STOKE_ASSIGN_OR_RETURN(auto v, impl_->DownloadParam(p, net.groups[p.group].master.get(), DType::kF32));
      out.push_back({p.name, p.dims, std::move(v)});
    }
    for (const auto& r : net.running) {
      STOKE_ASSIGN_OR_RETURN(auto v, Download(r->value, DType::kF32, r->c, net.stream));
      out.push_back({r->name, {r->c}, std::move(v)});
    }
    for (const auto& p : net.params) {
      STOKE_ASSIGN_OR_RETURN(auto v, impl_->DownloadParam(p, net.groups[p.group].momentum.get(), DType::kF32));
      out.push_back({p.name + ".momentum", p.dims, std::move(v)});
    }
    return out;
  });
}

Status CudaNetwork::LoadState(const std::vector<NamedTensor>& state) {
  return CatchExceptions("cuda backend: loading the state", [&]() -> Status {
    Net& net = impl_->net;
    std::vector<std::pair<std::string, std::vector<int64_t>>> wanted;
    for (const auto& p : net.params) wanted.emplace_back(p.name, p.dims);
    for (const auto& p : net.params) wanted.emplace_back(p.name + ".momentum", p.dims);
    for (const auto& r : net.running) wanted.emplace_back(r->name, std::vector<int64_t>{r->c});
    STOKE_ASSIGN_OR_RETURN(auto found, FindState(state, wanted, /*exact=*/true));
    size_t k = 0;
    for (const auto& p : net.params) {
      STOKE_RETURN_IF_ERROR(impl_->Upload(p, found[k++]->values, net.groups[p.group].master.as<float>()));
    }
    for (const auto& p : net.params) {
      STOKE_RETURN_IF_ERROR(impl_->Upload(p, found[k++]->values, net.groups[p.group].momentum.as<float>()));
    }
    for (const auto& r : net.running) {
      const auto& v = found[k++]->values;
      STOKE_CUDA_OK(cudaMemcpyAsync(r->value, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice,
                                    net.stream));
    }
    impl_->RefreshCopies();
    STOKE_CUDA_OK(cudaStreamSynchronize(net.stream));
    return LastLaunch("load state");
  });
}

void* CudaNetwork::stream() const { return impl_->net.stream; }
double CudaNetwork::LastInputWaitSeconds() const { return impl_->net.last_wait; }
const std::string& CudaNetwork::AutotuneSummary() const { return impl_->net.autotuned; }
int CudaNetwork::FusedBatchNormRelu() const { return impl_->net.fused_pairs; }
int CudaNetwork::InputChannels() const { return static_cast<int>(impl_->net.in_c); }
CudaNetwork::AutotuneCounts CudaNetwork::Autotuned() const {
  const cuda::AutotuneReport& r = impl_->autotune;
  return {r.shapes, r.changed, r.reused, r.single};
}

const std::vector<std::string>& CudaNetwork::FallbackKernels() const { return impl_->net.fallbacks; }
const std::vector<std::string>& CudaNetwork::NondeterministicSteps() const { return impl_->net.nondeterministic; }
const std::vector<std::string>& CudaNetwork::RoundedFloat32Steps() const { return impl_->net.rounded; }

Status CudaNetwork::StartTimeline() {
  Net& net = impl_->net;
  STOKE_CUDA_OK(cudaSetDevice(net.opt.device));  // the mark lives on the network's device
  if (net.timeline_start == nullptr) STOKE_CUDA_OK(cudaEventCreate(&net.timeline_start));
  STOKE_CUDA_OK(cudaEventRecord(net.timeline_start, net.stream));
  STOKE_CUDA_OK(cudaEventSynchronize(net.timeline_start));
  return OkStatus();
}

Result<StepTimeline> CudaNetwork::LastStepTimeline(const prefetch::Batch& batch) const {
  const Net& net = impl_->net;
  if (net.timeline_start == nullptr) return InvalidArgumentError("LastStepTimeline: StartTimeline() first");
  if (!net.have_prev) {
    return InvalidArgumentError("LastStepTimeline: the last call was not a training step that succeeded");
  }
  // Milliseconds from the mark to `e` (recorded and complete: the step has been waited for). A
  // batch copied before the mark (already in the ring) is at a negative time: the span is also
  // measured the other way round, should the driver refuse a span that ends before it begins.
  auto at = [&](void* e, const char* what) -> Result<double> {
    const auto event = static_cast<cudaEvent_t>(e);
    auto ms = ElapsedMs(net.timeline_start, event, fmt::format("timeline: {}", what));
    if (ms.ok()) return ms;
    if (const auto back = ElapsedMs(event, net.timeline_start, "timeline"); back.ok()) return -*back;
    return ms;
  };
  StepTimeline t;
  STOKE_ASSIGN_OR_RETURN(t.compute_begin_ms, at(net.ready, "the step's start"));
  STOKE_ASSIGN_OR_RETURN(t.compute_end_ms, at(net.done[static_cast<size_t>(1 - net.cur)], "the step's end"));
  if (batch.copy_begin_event != nullptr && batch.copy_end_event != nullptr) {
    STOKE_ASSIGN_OR_RETURN(t.copy_begin_ms, at(batch.copy_begin_event, "the batch's copy start"));
    STOKE_ASSIGN_OR_RETURN(t.copy_end_ms, at(batch.copy_end_event, "the batch's copy end"));
  } else {
    t.copy_begin_ms = t.copy_end_ms = std::numeric_limits<double>::quiet_NaN();
  }
  return t;
}
float CudaNetwork::loss_scale() const { return impl_->net.loss_scale; }
int64_t CudaNetwork::skipped_steps() const { return impl_->net.skipped; }

std::vector<float> CudaNetwork::LastLogits() const {
  const Net& net = impl_->net;
  const Node& last = net.nodes.back();
  auto logits = Download(last.out.get(), net.t, last.count(), net.stream);
  if (!logits.ok()) {
    STOKE_LOG(ERROR, "cuda backend: reading the logits back failed: {}", logits.status().ToString());
    return {};
  }
  return *std::move(logits);
}

}  // namespace stoke::train

namespace stoke::train {

Status CudaNetwork::SetStepSync(StepSync* sync) {
  Net& net = impl_->net;
  // STOKE_NCCL_ALWAYS=1: the device's averaging path even for a world of one (to measure what it
  // costs): NCCL's, or the host's with dist.device_comm: host.
  const char* always = std::getenv("STOKE_NCCL_ALWAYS");
  const bool force = always != nullptr && std::string_view(always) == "1";
  net.sum_over_ranks = nullptr;
  net.ranks = 1;
  impl_->dp.reset();
  impl_->sync = sync;
  if (sync == nullptr || (sync->world() == 1 && !force)) return OkStatus();
  return CatchExceptions("cuda backend: data-parallel set-up", [&]() -> Status {
    STOKE_ASSIGN_OR_RETURN(const int sharing, RanksSharingAGpu(net.opt.device, sync));  // sets the device
#if STOKE_WITH_NCCL
    Status nccl_usable = OkStatus();  // asked only where it decides
    const cuda::Nccl* api = nullptr;
    if (net.opt.device_comm != DeviceComm::kHost && sharing == 0) {
      auto loaded = AgreeOnNccl(sync);
      nccl_usable = loaded.status();
      if (loaded.ok()) api = *loaded;
    }
#else
    const Status nccl_usable = UnavailableError("this build did not find nccl.h");
#endif
    std::string why;
    STOKE_ASSIGN_OR_RETURN(const DeviceComm how, ChooseDeviceComm(net.opt.device_comm, sharing, nccl_usable, &why));
    std::string with;
    if (how == DeviceComm::kNccl) {
#if STOKE_WITH_NCCL
      STOKE_ASSIGN_OR_RETURN(impl_->dp, NcclParallel::Create(net, sync, api));
      with = fmt::format("with NCCL {} ({})", api->version, api->path);
#else
      return InternalError("NCCL was chosen in a build without it");
#endif
    } else {
      STOKE_ASSIGN_OR_RETURN(impl_->dp, HostStagedParallel::Create(net, sync));
      with = "through the host over MPI";
    }
    STOKE_LOG(INFO, "cuda backend: rank {} of {} on GPU {}, gradients averaged {} ({}), {} buckets", sync->rank(),
              sync->world(), net.opt.device, with, why, impl_->dp->buckets());
    if (net.opt.sync_batchnorm) {
      DeviceParallel* dp = impl_->dp.get();
      net.sum_over_ranks = [dp](double* values, size_t n) { return dp->SumChannels(values, n); };
      net.ranks = dp->world();
    }
    return OkStatus();
  });
}

Status CudaNetwork::AverageRunningStats() {
  if (!impl_->dp || impl_->dp->world() == 1) return OkStatus();
  if (impl_->net.sum_over_ranks != nullptr) return OkStatus();  // synchronised: the same on every rank already
  return CatchExceptions("cuda backend: averaging running statistics", [&]() -> Status {
    Net& net = impl_->net;
    // Rare (before evaluations and checkpoints): through the host, over the same world as the step.
    std::vector<float> all;
    for (const auto& r : net.running) {
      STOKE_ASSIGN_OR_RETURN(auto v, Download(r->value, DType::kF32, r->c, net.stream));
      all.insert(all.end(), v.begin(), v.end());
    }
    if (all.empty()) return OkStatus();
    STOKE_RETURN_IF_ERROR(impl_->sync->AverageOverRanks(all));
    size_t k = 0;
    for (auto& r : net.running) {
      STOKE_CUDA_OK(cudaMemcpyAsync(r->value, all.data() + k, static_cast<size_t>(r->c) * sizeof(float),
                                    cudaMemcpyHostToDevice, net.stream));
      k += static_cast<size_t>(r->c);
    }
    STOKE_CUDA_OK(cudaStreamSynchronize(net.stream));
    return OkStatus();
  });
}

}  // namespace stoke::train
