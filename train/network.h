// The backend interface: a model built for one batch shape that normalises uint8 batches, runs
// forward/backward, applies SGD and exposes its state for checkpoints. The CPU backend (oneDNN)
// implements it in cpu_network.h; the CUDA backend plugs into the same interface.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
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

// How a device backend averages over the ranks: NCCL on the GPUs, or through the host over MPI.
enum class DeviceComm { kAuto, kNccl, kHost };

// How the CUDA backend of a data-parallel run averages, from dist.device_comm (`wanted`), the number
// of ranks that share their GPU with another rank (NCCL refuses them), and whether NCCL can be used
// on every rank (built, and loaded everywhere). kAuto picks NCCL when it can, else the host, and
// says why in `why`; kNccl where NCCL cannot run is kInvalidArgument (shared GPUs) or kUnavailable
// (no NCCL) naming dist.device_comm. The same answer on every rank when the inputs are.
Result<DeviceComm> ChooseDeviceComm(DeviceComm wanted, int ranks_sharing_a_gpu, const Status& nccl_usable,
                                    std::string* why);

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
  // Data-parallel runs: this rank's first sample within the global batch (rank x batch). Dropout
  // draws the mask of the global batch and applies its rows from here, so that W ranks drop what
  // one rank with the global batch drops.
  int64_t first_sample = 0;
  int threads = 0;    // compute threads; 0 = every core (CPU backend)
  Precision precision = Precision::kFloat32;
  int device = 0;  // CUDA backend: the GPU
  // CUDA backend: time each convolution's candidate engines at creation and keep the fastest (as
  // PyTorch's cudnn.benchmark); false keeps cuDNN heuristics' first choice. The config's
  // cuda.autotune (on by default) sets it for training, evaluation and benchmarks.
  bool autotune = false;
  // CUDA backend: a batch norm whose only consumer is a ReLU runs both as stoke's fused kernels
  // (one pass fewer over the activations each way; not with sync_batchnorm). cuda.fuse_bn_relu.
  bool fuse_bn_relu = false;
  // CUDA backend: channels of the input on the device, 3, or 4 or 8 with zero channels added, for
  // the tensor-core engines that want whole vectors of channels. Only in bfloat16 and float16, and
  // where every layer reading the input is a convolution (its weights for the added channels stay
  // zero and are never saved: checkpoints keep 3 input channels). cuda.input_channels.
  int input_channels = 3;
  // Data-parallel runs: batch statistics of batch norm over the global batch (every rank's
  // samples) instead of this rank's; see StepSync. No effect on one rank.
  bool sync_batchnorm = false;
  // Data-parallel runs on the CUDA backend: how gradients are averaged (dist.device_comm; see
  // ChooseDeviceComm above).
  DeviceComm device_comm = DeviceComm::kAuto;
};

// Layer-wise adaptive rate scaling for large batches. Each weight tensor w (not BN scale/shift or
// biases) gets its gradient g' = g + wd w scaled by the trust ratio
//   r = trust_coefficient * |w| / (|g| + wd |w| + eps)      (1 when |w| or |g| is 0)
// before momentum. kLars uses r as is; kLarc clips it (when `clip`) so the rate never exceeds the
// global one: min(r / lr, 1).
enum class LayerAdaptation { kNone, kLars, kLarc };

struct SgdOptions {
  double momentum = 0.9;  // [0, 1)
  bool nesterov = false;
  double weight_decay = 0;           // L2, added to the gradient
  bool decay_bn_and_bias = false;    // false: no weight decay on BN scale/shift and biases
  LayerAdaptation adaptation = LayerAdaptation::kNone;
  double trust_coefficient = 0;  // 0: the default of the adaptation (kLars 0.001, kLarc 0.02)
  bool clip = true;              // kLarc: clip the adapted rate at the global one
  double eps = 1e-8;
  double trust() const {
    if (trust_coefficient > 0) return trust_coefficient;
    return adaptation == LayerAdaptation::kLarc ? 0.02 : 0.001;
  }
};
std::string_view LayerAdaptationName(LayerAdaptation a);  // "sgd", "lars", "larc"

// The trust ratio of one tensor (see LayerAdaptation), from its norms; 1 when no adaptation applies.
float TrustRatio(const SgdOptions& sgd, double weight_norm, double grad_norm, double weight_decay, float lr);

// One training step on a device's clock, in milliseconds from a mark: its compute (from its batch
// being ready to the step's end) and when its batch's host-to-device copy ran (NaN: the batch was
// not copied by the ring). CudaNetwork::LastStepTimeline, read by `stoke bench train --timeline`.
struct StepTimeline {
  double compute_begin_ms = 0, compute_end_ms = 0;
  double copy_begin_ms = 0, copy_end_ms = 0;
};

// Sums over the samples of one batch (or of several, with +=).
struct BatchStats {
  double loss_sum = 0;  // cross-entropy (with label smoothing) summed over samples
  int64_t top1 = 0;     // samples whose label is the arg-max
  int64_t top5 = 0;     // samples whose label is among the 5 largest logits
  int64_t count = 0;
  // Data-parallel steps skipped by every rank because the loss or the averaged gradient was not
  // finite on some rank (the parameters are then left as they were).
  int64_t skipped = 0;
  // Float16 steps whose scaled gradients overflowed: the update was skipped and the loss scale
  // halved (dynamic loss scaling, expected now and then; the loss figures are not meaningful).
  int64_t overflowed = 0;
  BatchStats& operator+=(const BatchStats& o) {
    loss_sum += o.loss_sum;
    top1 += o.top1;
    top5 += o.top5;
    count += o.count;
    skipped += o.skipped;
    overflowed += o.overflowed;
    return *this;
  }
  double loss() const { return count ? loss_sum / static_cast<double>(count) : 0; }
  double top1_rate() const { return count ? static_cast<double>(top1) / static_cast<double>(count) : 0; }
  double top5_rate() const { return count ? static_cast<double>(top5) / static_cast<double>(count) : 0; }
};

// How many classes rank ahead of `label` in one row of logits: those with a larger logit, and those
// with an equal one and a lower index (the order of a stable arg-sort). Top-k holds the label when
// this is below k. A row holding a NaN ranks nothing: the result is then the row's length, a miss
// at every k. Both backends and `stoke eval` count hits by this rule.
int LabelRank(std::span<const float> logits, int label);

// Softmax cross-entropy (with label smoothing) and top-1/top-5 over `rows` rows of `classes`
// logits, on the host, in double; rows with a non-zero entry in `skip` are left out (the loader's
// stand-ins for bad records, Batch::stand_in).
BatchStats ScoreLogits(std::span<const float> logits, int classes, std::span<const int32_t> labels, double smoothing,
                       std::span<const uint8_t> skip = {});

// One named tensor of the network's state, in a plain row-major layout (weights O x I x KH x KW,
// linear O x I, vectors). Names: "<layer>.weight", ".bias", ".running_mean", ".running_var",
// and "<param>.momentum" for the optimizer's buffers.
struct NamedTensor {
  std::string name;
  std::vector<int64_t> dims;
  std::vector<float> values;
};

// Empty when every value of `tensors` is finite; otherwise the first tensor that is not, e.g.
// "tensor 'bn1.running_var' holds 1 of 64 values that are not finite (NaN or infinity)".
std::string FirstNonFiniteTensor(const std::vector<NamedTensor>& tensors);

// A gradient: `count` floats at `offset` in a backend's flat gradient buffer.
struct GradientSlice {
  size_t offset = 0;
  size_t count = 0;
};

// Data-parallel training as a backend sees it: the collectives it makes during a step so that every
// rank ends the step with the same parameters. train/data_parallel.h implements it over dist/.
// Every rank makes the same calls in the same order; a failed collective means the world is broken.
class StepSync {
 public:
  virtual ~StepSync() = default;
  virtual int world() const = 0;
  virtual int rank() const = 0;
  // The backend's gradients: one flat float32 buffer and its slices, in the order backward
  // finishes them. Called once, by Network::SetStepSync; the buffer must outlive the sync.
  virtual Status AttachGradients(std::span<float> flat, std::vector<GradientSlice> slices) = 0;
  // Slice `index` holds this rank's final gradient: its bucket may start averaging now.
  virtual void GradientReady(int index) = 0;
  // Averages what is left and waits: the whole buffer then holds the mean over the ranks.
  virtual Status FinishGradients() = 0;
  // Batch norm over the global batch: per-channel mean and biased variance of this rank's samples
  // (the same count on every rank) in, those of all ranks' samples out.
  virtual Status CombineMoments(std::span<float> mean, std::span<float> var) = 0;
  // Blocking, in place.
  virtual Status SumOverRanks(std::span<float> values) = 0;
  virtual Status SumOverRanks(std::span<double> values) = 0;
  virtual Status AverageOverRanks(std::span<float> values) = 0;
  // Rank `root`'s bytes on every rank (a device backend sends its collective library's id this way).
  virtual Status BroadcastBytes(std::span<std::byte> data, int root) = 0;
  // Every rank's `mine` (the same size on every rank) in rank order: `all` holds world() of them.
  virtual Status GatherBytes(std::span<const std::byte> mine, std::span<std::byte> all) = 0;
  // This rank's GPU among the ranks of its machine.
  virtual int local_rank() const { return 0; }
  // How long a collective may take before the world is declared broken.
  virtual double timeout_s() const { return 300; }
  // A device backend that averages on its own (NCCL) reports what it cost: seconds of
  // communication in the step, how much of it ran while backward still computed, and how long the
  // step then waited for it.
  virtual void AddDeviceCommTime(double /*comm_s*/, double /*overlapped_s*/, double /*wait_s*/) {}
  // ... and how it groups the gradients: buckets, and the largest in MB.
  virtual void DescribeDeviceBuckets(int /*buckets*/, double /*largest_mb*/) {}
  // The bucket sizes to plan with (dist.bucket_mb), and the smaller first bucket.
  virtual size_t bucket_bytes() const { return size_t{25} << 20; }
  virtual size_t first_bucket_bytes() const { return size_t{1} << 20; }
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

  // Data-parallel training: from now on TrainStep averages gradients through `sync` (overlapping
  // backward), returns the statistics summed over every rank, and skips the update on every rank
  // when the loss or gradient is not finite anywhere (BatchStats::skipped). nullptr detaches.
  // kUnavailable when the backend cannot train data-parallel.
  virtual Status SetStepSync(StepSync* sync) {
    if (sync == nullptr || sync->world() == 1) return OkStatus();
    return UnavailableError("the " + std::string(backend()) + " backend does not train data-parallel in this build");
  }
  // Averages the batch-norm running statistics over the ranks (before an evaluation or a
  // checkpoint, so every rank holds and saves the same model). A no-op without a StepSync.
  virtual Status AverageRunningStats() { return OkStatus(); }
};

// A batch fits the network: its image size, at most (or, with `full`, exactly) `batch` samples, and
// labels within the classes (naming the record). kInvalidArgument otherwise.
Status CheckBatch(const NetworkOptions& options, const prefetch::Batch& batch, bool full);

// Checks that `state` holds every tensor in `wanted` (name, plain dims) with the right size and
// returns them by name; kInvalidArgument naming the first missing or mis-shaped one. `exact`:
// also refuses a tensor of `state` that `wanted` does not name (another model's state).
Result<std::vector<const NamedTensor*>> FindState(
    const std::vector<NamedTensor>& state, const std::vector<std::pair<std::string, std::vector<int64_t>>>& wanted,
    bool exact = false);

}  // namespace stoke::train
