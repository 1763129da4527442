// The CUDA backend's own kernels: the steps cuDNN and cuBLAS have no node for (softmax
// cross-entropy, the optimizer update, bias and flatten steps, dropout), and the fallbacks used
// for a layer when cuDNN offers no engine for it (batch norm, ReLU, add, pooling). Every launch
// is asynchronous on the given stream. Activations are NHWC (vectors are N x C), in the compute
// type; statistics, parameters and their gradients are float32 unless said. The input's
// normalisation is the loader's (prefetch/device_batch.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace stoke::train::cuda {

enum class DType { kF32, kF16, kBF16 };
inline size_t SizeOf(DType t) { return t == DType::kF32 ? 4 : 2; }

// Written by SoftmaxCrossEntropy (accumulated: zero it first) and FindNonFinite.
struct StepStats {
  double loss_sum;
  unsigned long long top1;
  unsigned long long top5;
  int non_finite;  // a gradient held an Inf or NaN (the update is skipped)
  int pad;
};

struct SgdArgs {
  float lr;
  float momentum;
  float weight_decay;
  float inv_loss_scale;  // gradients are divided by the loss scale first
  bool nesterov;
};

// Row-wise softmax cross-entropy with label smoothing over `rows` of `classes` logits (row stride
// `classes`). Adds loss, top-1 and top-5 into `stats`; with `grad` writes
// (softmax - target) * grad_scale there (grad_scale = loss scale / batch). `row_loss` (`rows`
// doubles of scratch) holds each row's loss until they are summed in row order, so the same
// logits give the same loss_sum bit for bit.
void SoftmaxCrossEntropy(const void* logits, DType t, const int32_t* labels, int rows, int classes, float smoothing,
                         void* grad, float grad_scale, StepStats* stats, double* row_loss, cudaStream_t s);

// y[r, c] += bias[c] for rows x channels.
void AddChannelBias(void* y, DType t, const float* bias, int64_t rows, int channels, cudaStream_t s);
// out[c] = sum over rows of x[r, c], in a fixed order; `partials` holds BatchNormWorkspace floats.
void ChannelSums(const void* x, DType t, int64_t rows, int channels, float* out, float* partials, cudaStream_t s);

void Relu(const void* x, void* y, DType t, int64_t n, cudaStream_t s);
void ReluBackward(const void* x, const void* dy, void* dx, DType t, int64_t n, cudaStream_t s);
void Add(const void* a, const void* b, void* y, DType t, int64_t n, cudaStream_t s);
void Accumulate(void* dst, const void* src, DType t, int64_t n, cudaStream_t s);  // dst += src

// Inverted dropout. The mask of element (n, c, h, w) is the one the CPU backend draws for logical
// index ((n * C + c) * H + h) * W + w from SplitMix64(seed): the two backends drop the same units.
void Dropout(const void* x, void* y, uint8_t* keep, DType t, int64_t n, int c, int h, int w, uint64_t seed, double p,
             cudaStream_t s);
void DropoutBackward(const void* dy, const uint8_t* keep, void* dx, DType t, int64_t n, double p, cudaStream_t s);

// Batch norm over rows x channels (training statistics; running ones updated with the unbiased
// variance). `partials` holds BatchNormWorkspace(rows, channels) floats.
size_t BatchNormWorkspace(int64_t rows, int channels);
void BatchNormTrain(const void* x, void* y, DType t, int64_t rows, int channels, const float* scale, const float* shift,
                    float eps, float momentum, float* running_mean, float* running_var, float* save_mean,
                    float* save_inv_std, float* partials, cudaStream_t s);
void BatchNormBackward(const void* x, const void* dy, void* dx, DType t, int64_t rows, int channels,
                       const float* scale, const float* save_mean, const float* save_inv_std, float* dscale,
                       float* dshift, float* partials, cudaStream_t s);
// Synchronised batch norm: the statistics of every rank's samples. Each pass has two halves, and the
// caller sums `sums` (2 x channels doubles, on the device) over the ranks between them; `count` is
// the number of rows behind the summed values (rows x ranks).
// Forward: sums = (sum of x - m, sum of (x - m)^2) per channel over this rank's rows, m the running
// mean (the same on every rank: taking the moments about it keeps E[v^2] - E[v]^2 accurate) ...
void BatchNormLocalMoments(const void* x, DType t, int64_t rows, int channels, const float* running_mean,
                           double* sums, float* partials, cudaStream_t s);
// ... then the statistics of the summed moments (running ones updated as BatchNormTrain does) and y.
void BatchNormTrainFromMoments(const void* x, void* y, DType t, int64_t rows, int channels, const float* scale,
                               const float* shift, const double* sums, int64_t count, float eps, float momentum,
                               float* running_mean, float* running_var, float* save_mean, float* save_inv_std,
                               cudaStream_t s);
// Backward: this rank's sums of dy and of dy * xhat, both into `sums` and into dshift / dscale (the
// parameter gradients, averaged over the ranks with the others) ...
void BatchNormLocalGradSums(const void* x, const void* dy, DType t, int64_t rows, int channels,
                            const float* save_mean, const float* save_inv_std, float* dscale, float* dshift,
                            double* sums, float* partials, cudaStream_t s);
// ... then dx from the summed sums. `scratch` holds 2 x channels floats.
void BatchNormBackwardFromSums(const void* x, const void* dy, void* dx, DType t, int64_t rows, int channels,
                               const float* scale, const float* save_mean, const float* save_inv_std,
                               const double* sums, int64_t count, float* scratch, cudaStream_t s);
// Evaluation: y = (x - mean) / sqrt(var + eps) * scale + shift; with `relu`, max(y, 0).
void BatchNormInference(const void* x, void* y, DType t, int64_t rows, int channels, const float* scale,
                        const float* shift, const float* mean, const float* var, float eps, cudaStream_t s,
                        bool relu = false);

// Batch norm and the ReLU after it as one step each way (training, this rank's batch), over
// 16-byte vectors: channels a multiple of 16 / SizeOf(t) (FusedBatchNormReluFits) and 16-byte
// aligned buffers. A thread keeps one group of channels' constants in registers and walks rows.
// Forward: one read of x for both moments (per-chunk float partials in `partials`, summed in double
// in a fixed order; running statistics updated as BatchNormTrain does), then z = max(fmaf(x, a, b), 0)
// with a = scale * inv_std and b = shift - mean * a, kept in `affine` (2 x channels floats) for
// backward. The batch-norm output itself is never stored.
bool FusedBatchNormReluFits(DType t, int channels);
void BatchNormReluTrain(const void* x, void* z, DType t, int64_t rows, int channels, const float* scale,
                        const float* shift, float eps, float momentum, float* running_mean, float* running_var,
                        float* save_mean, float* save_inv_std, float* affine, float* partials, cudaStream_t s);
// Backward from dz (the ReLU output's gradient); the ReLU's mask is fmaf(x, a, b) > 0, recomputed
// exactly as forward computed it. One read of x and dz for the sums of dy and dy * xhat (written to
// dshift and dscale, the parameter gradients), one more for dx.
void BatchNormReluBackward(const void* x, const void* dz, void* dx, DType t, int64_t rows, int channels,
                           const float* save_mean, const float* save_inv_std, const float* affine, float* dscale,
                           float* dshift, float* partials, cudaStream_t s);

struct PoolShape {
  int n, h, w, c, oh, ow, kh, kw, stride, pad;
  bool max;  // else average, divisor kh * kw (padding counted)
};
void Pool(const void* x, void* y, int32_t* argmax, DType t, PoolShape p, cudaStream_t s);
void PoolBackward(const void* dy, const int32_t* argmax, void* dx, DType t, PoolShape p, cudaStream_t s);

// NHWC (n, h, w, c) <-> vector (n, c * h * w) in C, H, W order.
void Flatten(const void* x, void* y, DType t, int n, int h, int w, int c, bool inverse, cudaStream_t s);

// Sets stats->non_finite when any of the n values is Inf or NaN.
void FindNonFinite(const void* g, DType t, int64_t n, StepStats* stats, cudaStream_t s);
// Layer-wise adaptation (LARS / LARC, train/network.h): a parameter group cut into chunks of at
// most kLarsChunk elements, each inside one tensor (a segment); a segment's chunks are consecutive.
constexpr int64_t kLarsChunk = 16384;
struct LarsChunk {
  int64_t begin, end;  // elements of the group
  int segment;
  int pad;
};
struct LarsSegment {
  int first_chunk, chunks;
  int adapt;  // 0: the ratio is 1 (batch norm, biases)
  int pad;
};
struct LarsArgs {
  float trust, eps, weight_decay, lr, inv_loss_scale;
  int clip_by_lr;  // LARC with clipping: min(r / lr, 1)
};
// ratios[s] = trust * |w| / (|g| + wd |w| + eps) for each adapted segment (1 where |w| or |g| is 0),
// g being the gradient divided by the loss scale; the norms are summed in a fixed order (per chunk
// into `partials`, 2 doubles each, then per segment). Does nothing when stats->non_finite is set.
void LarsTrustRatios(const float* master, const void* grad, DType gt, const LarsChunk* chunks, int num_chunks,
                     const LarsSegment* segments, int num_segments, LarsArgs a, double* partials, float* ratios,
                     const StepStats* stats, cudaStream_t s);

// SGD with momentum over a flat group of parameters: master (float32), momentum, gradient (type
// `gt`); weight decay on [0, decay_end); the compute copy (type `ct`) rewritten on [0, copy_end).
// With `chunks`, each chunk's gradient (with its weight decay) is scaled by its segment's ratio
// (LarsTrustRatios) and only the chunks' elements are updated. Does nothing when
// stats->non_finite is set.
void SgdUpdate(float* master, float* momentum, const void* grad, DType gt, void* copy, DType ct, int64_t n,
               int64_t decay_end, int64_t copy_end, SgdArgs a, const StepStats* stats, cudaStream_t s,
               const LarsChunk* chunks = nullptr, int num_chunks = 0, const float* ratios = nullptr);
void CastFromFloat(const float* src, void* dst, DType t, int64_t n, cudaStream_t s);
void CastToFloat(const void* src, DType t, float* dst, int64_t n, cudaStream_t s);

}  // namespace stoke::train::cuda
