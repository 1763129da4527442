#include "train/cuda/kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>

namespace stoke::train::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float Load(const T* p, int64_t i);
template <>
__device__ __forceinline__ float Load<float>(const float* p, int64_t i) { return p[i]; }
template <>
__device__ __forceinline__ float Load<__half>(const __half* p, int64_t i) { return __half2float(p[i]); }
template <>
__device__ __forceinline__ float Load<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}

template <typename T>
__device__ __forceinline__ void Store(T* p, int64_t i, float v);
template <>
__device__ __forceinline__ void Store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <>
__device__ __forceinline__ void Store<__half>(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }
template <>
__device__ __forceinline__ void Store<__nv_bfloat16>(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}

// Calls f(T*) with the pointer type matching `t`.
#define STOKE_DISPATCH(t, F)                      \
  switch (t) {                                    \
    case DType::kF32: { using T = float; F; break; }          \
    case DType::kF16: { using T = __half; F; break; }         \
    case DType::kBF16: { using T = __nv_bfloat16; F; break; } \
  }

unsigned Blocks(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 8));
}

#define STOKE_GRID_LOOP(i, n) \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

// ---------------------------------------------------------------- loss

template <typename Op>
__device__ float BlockReduce(float v, Op op, float identity, float* shared) {
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_down_sync(0xffffffffu, v, offset));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  v = threadIdx.x < warps ? shared[threadIdx.x] : identity;
  if (warp == 0) {
    for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_down_sync(0xffffffffu, v, offset));
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  v = shared[0];
  __syncthreads();
  return v;
}
struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};

template <typename T>
__global__ void SoftmaxCrossEntropyKernel(const T* logits, const int32_t* labels, int classes, float smoothing,
                                          T* grad, float grad_scale, StepStats* stats, double* row_loss) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const T* z = logits + row * classes;
  const int y = labels[row];
  const float zy = Load(z, y);
  // `ahead`: classes ranked before the label (larger, or equal with a lower index: LabelRank's rule);
  // `nan`: a NaN in the row, which makes it a miss.
  float zmax = -FLT_MAX, zsum = 0, ahead = 0, nan = 0;
  for (int k = threadIdx.x; k < classes; k += blockDim.x) {
    const float v = Load(z, k);
    zmax = fmaxf(zmax, v);
    zsum += v;
    ahead += v > zy || (v == zy && k < y) ? 1.f : 0.f;
    nan += isnan(v) ? 1.f : 0.f;
  }
  zmax = BlockReduce(zmax, MaxOp{}, -FLT_MAX, shared);
  zsum = BlockReduce(zsum, SumOp{}, 0.f, shared);
  ahead = BlockReduce(ahead, SumOp{}, 0.f, shared);
  nan = BlockReduce(nan, SumOp{}, 0.f, shared);
  float sum = 0;
  for (int k = threadIdx.x; k < classes; k += blockDim.x) sum += __expf(Load(z, k) - zmax);
  sum = BlockReduce(sum, SumOp{}, 0.f, shared);
  const float off = smoothing / classes, on = 1.f - smoothing + off;
  if (threadIdx.x == 0) {
    const double lse = static_cast<double>(zmax) + log(static_cast<double>(sum));
    const double loss = lse - static_cast<double>(on - off) * zy - static_cast<double>(off) * zsum;
    row_loss[row] = loss;  // summed in row order by SumRowLossKernel: the same bits every run
    if (!isfinite(loss)) stats->non_finite = 1;  // no update from a step whose loss overflowed
    if (nan < 0.5f && ahead < 0.5f) atomicAdd(&stats->top1, 1ull);
    if (nan < 0.5f && ahead < 4.5f) atomicAdd(&stats->top5, 1ull);
  }
  if (grad != nullptr) {
    T* g = grad + row * classes;
    for (int k = threadIdx.x; k < classes; k += blockDim.x) {
      const float q = k == y ? on : off;
      Store(g, k, (__expf(Load(z, k) - zmax) / sum - q) * grad_scale);
    }
  }
}

// stats->loss_sum += the rows' losses, in a fixed order (each thread a fixed stride, then a fixed
// tree), unlike an atomic add whose order follows the blocks' finishing times.
__global__ void SumRowLossKernel(const double* row_loss, int rows, StepStats* stats) {
  __shared__ double shared[kThreads];
  double acc = 0;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) acc += row_loss[r];
  shared[threadIdx.x] = acc;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) shared[threadIdx.x] += shared[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) stats->loss_sum += shared[0];
}

// ---------------------------------------------------------------- channel-wise steps

template <typename T>
__global__ void AddChannelBiasKernel(T* y, const float* bias, int64_t n, int channels) {
  STOKE_GRID_LOOP(i, n) { Store(y, i, Load(y, i) + bias[i % channels]); }
}

// Partial per-channel sums of f(r, c) over chunks of rows: block (32, 8) covers 32 channels and one
// chunk; out[chunk * channels + c].
constexpr int kChunkRows = 8;
int Chunks(int64_t rows) { return static_cast<int>(std::min<int64_t>((rows + 255) / 256, 256)); }

template <typename F>
__device__ void ChannelPartials(int64_t rows, int channels, int chunks, F f, float* out) {
  __shared__ float shared[kChunkRows][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  const int chunk = blockIdx.y;
  const int64_t per_chunk = (rows + chunks - 1) / chunks;
  const int64_t begin = chunk * per_chunk, end = min(rows, begin + per_chunk);
  float acc = 0;
  if (c < channels) {
    for (int64_t r = begin + threadIdx.y; r < end; r += kChunkRows) acc += f(r, c);
  }
  shared[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < channels) {
    float total = 0;
    for (int k = 0; k < kChunkRows; ++k) total += shared[k][threadIdx.x];
    out[static_cast<int64_t>(chunk) * channels + c] = total;
  }
  __syncthreads();  // the caller may reuse `shared` for a second sum
}

template <typename T>
__global__ void ChannelSumsKernel(const T* x, int64_t rows, int channels, int chunks, float* partials) {
  ChannelPartials(rows, channels, chunks, [=] __device__(int64_t r, int c) { return Load(x, r * channels + c); },
                  partials);
}

// Channel c's total over the chunks of one plane of partial sums (chunks x channels), in double.
__device__ double SumChunks(const float* plane, int chunks, int channels, int c) {
  double total = 0;
  for (int k = 0; k < chunks; ++k) total += plane[static_cast<int64_t>(k) * channels + c];
  return total;
}

__global__ void CombinePartialsKernel(const float* partials, int chunks, int channels, float* out) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  out[c] = static_cast<float>(SumChunks(partials, chunks, channels, c));
}

// ---------------------------------------------------------------- elementwise

template <typename T>
__global__ void ReluKernel(const T* x, T* y, int64_t n) {
  STOKE_GRID_LOOP(i, n) { Store(y, i, fmaxf(Load(x, i), 0.f)); }
}
template <typename T>
__global__ void ReluBackwardKernel(const T* x, const T* dy, T* dx, int64_t n) {
  STOKE_GRID_LOOP(i, n) { Store(dx, i, Load(x, i) > 0.f ? Load(dy, i) : 0.f); }
}
template <typename T>
__global__ void AddKernel(const T* a, const T* b, T* y, int64_t n) {
  STOKE_GRID_LOOP(i, n) { Store(y, i, Load(a, i) + Load(b, i)); }
}
template <typename T>
__global__ void AccumulateKernel(T* dst, const T* src, int64_t n) {
  STOKE_GRID_LOOP(i, n) { Store(dst, i, Load(dst, i) + Load(src, i)); }
}
// 16-byte vectors: 8 bfloat16 / float16 or 4 float values, converted to float and back.
template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

template <typename T>
__device__ __forceinline__ void LoadVec(const T* p, int64_t i, float (&v)[kVec<T>]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p + i);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec<T>; ++k) v[k] = Load(e, k);
}
template <typename T>
__device__ __forceinline__ void StoreVec(T* p, int64_t i, const float (&v)[kVec<T>]) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec<T>; ++k) Store(e, k, v[k]);
  *reinterpret_cast<uint4*>(p + i) = raw;
}

// The same over 16-byte chunks (both pointers 16-byte aligned): one load of each and one store
// per vector.
template <typename T>
__global__ void AccumulateChunksKernel(T* dst, const T* src, int64_t chunks) {
  constexpr int N = kVec<T>;
  STOKE_GRID_LOOP(i, chunks) {
    float d[N], v[N];
    LoadVec(dst, i * N, d);
    LoadVec(src, i * N, v);
#pragma unroll
    for (int k = 0; k < N; ++k) d[k] += v[k];
    StoreVec(dst, i * N, d);
  }
}
template <typename T>
void AccumulateTyped(T* dst, const T* src, int64_t n, bool aligned, cudaStream_t s) {
  constexpr int64_t per = kVec<T>;
  const int64_t chunks = aligned ? n / per : 0, done = chunks * per;
  if (chunks > 0) AccumulateChunksKernel<T><<<Blocks(chunks), kThreads, 0, s>>>(dst, src, chunks);
  if (done < n) AccumulateKernel<T><<<Blocks(n - done), kThreads, 0, s>>>(dst + done, src + done, n - done);
}

__device__ __forceinline__ uint64_t SplitMixAt(uint64_t seed, uint64_t index) {
  uint64_t z = seed + (index + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <typename T>
__global__ void DropoutKernel(const T* x, T* y, uint8_t* keep, int64_t n, int c, int h, int w, uint64_t seed,
                              double p, float scale) {
  STOKE_GRID_LOOP(i, n) {
    // i walks NHWC; the mask is drawn in logical NCHW order.
    const int64_t ch = i % c, pixel = (i / c) % (static_cast<int64_t>(h) * w), sample = i / (static_cast<int64_t>(c) * h * w);
    const int64_t logical = (sample * c + ch) * h * w + pixel;
    const double u = static_cast<double>(SplitMixAt(seed, static_cast<uint64_t>(logical)) >> 11) * 0x1.0p-53;
    const bool k = !(u < p);
    keep[i] = k ? 1 : 0;
    Store(y, i, k ? Load(x, i) * scale : 0.f);
  }
}
template <typename T>
__global__ void DropoutBackwardKernel(const T* dy, const uint8_t* keep, T* dx, int64_t n, float scale) {
  STOKE_GRID_LOOP(i, n) { Store(dx, i, keep[i] ? Load(dy, i) * scale : 0.f); }
}

// ---------------------------------------------------------------- batch norm (fallback)

// Per-chunk sums of x - k[c] and of its square (k == nullptr: of x and x^2).
template <typename T>
__global__ void MomentsKernel(const T* x, int64_t rows, int channels, int chunks, const float* k, float* partials) {
  const int64_t plane = static_cast<int64_t>(chunks) * channels;
  ChannelPartials(rows, channels, chunks, [=] __device__(int64_t r, int c) {
    return Load(x, r * channels + c) - (k != nullptr ? k[c] : 0.f);
  }, partials);
  ChannelPartials(rows, channels, chunks, [=] __device__(int64_t r, int c) {
    const float v = Load(x, r * channels + c) - (k != nullptr ? k[c] : 0.f);
    return v * v;
  }, partials + plane);
}

// Channel c's statistics from the sum and the sum of squares of its `rows` values less `k`.
__device__ void StoreBatchStats(int c, double s, double s2, int64_t rows, double k, float eps, float momentum,
                                float* running_mean, float* running_var, float* save_mean, float* save_inv_std) {
  const double shifted = s / rows;
  const double mean = k + shifted;
  const double var = fmax(s2 / rows - shifted * shifted, 0.0);
  save_mean[c] = static_cast<float>(mean);
  save_inv_std[c] = static_cast<float>(1.0 / sqrt(var + eps));
  const double unbias = rows > 1 ? static_cast<double>(rows) / (rows - 1) : 1.0;
  running_mean[c] = static_cast<float>((1 - momentum) * running_mean[c] + momentum * mean);
  running_var[c] = static_cast<float>((1 - momentum) * running_var[c] + momentum * var * unbias);
}

// With `affine` (fused batch norm + ReLU): also a = scale * inv_std into affine[c] and
// b = shift - mean a into affine[channels + c].
__global__ void BatchNormStatsKernel(const float* partials, int chunks, int channels, int64_t rows, float eps,
                                     float momentum, float* running_mean, float* running_var, float* save_mean,
                                     float* save_inv_std, const float* scale = nullptr,
                                     const float* shift = nullptr, float* affine = nullptr) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const int64_t plane = static_cast<int64_t>(chunks) * channels;
  StoreBatchStats(c, SumChunks(partials, chunks, channels, c), SumChunks(partials + plane, chunks, channels, c), rows,
                  0.0, eps, momentum, running_mean, running_var, save_mean, save_inv_std);
  if (affine == nullptr) return;
  const float a = scale[c] * save_inv_std[c];
  affine[c] = a;
  affine[channels + c] = shift[c] - save_mean[c] * a;
}

// The two partial planes summed per channel, in double: sums[c] from the first, sums[C + c] from the
// second.
__global__ void PlaneSumsKernel(const float* partials, int chunks, int channels, double* sums) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const int64_t plane = static_cast<int64_t>(chunks) * channels;
  sums[c] = SumChunks(partials, chunks, channels, c);
  sums[channels + c] = SumChunks(partials + plane, chunks, channels, c);
}

__global__ void BatchNormStatsFromSumsKernel(const double* sums, int channels, int64_t rows, float eps,
                                             float momentum, float* running_mean, float* running_var,
                                             float* save_mean, float* save_inv_std) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  // The moments were taken about the running mean (read before it is updated).
  StoreBatchStats(c, sums[c], sums[channels + c], rows, running_mean[c], eps, momentum, running_mean, running_var,
                  save_mean, save_inv_std);
}

// Sums of dy (first half) and dy * xhat (second half) into the float parameter gradients.
__global__ void SumsToGradsKernel(const double* sums, int channels, float* dscale, float* dshift) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  dshift[c] = static_cast<float>(sums[c]);
  dscale[c] = static_cast<float>(sums[channels + c]);
}

template <typename T>
__global__ void ChannelNormalizeKernel(const T* x, T* y, int64_t n, int channels, const float* scale,
                                       const float* shift, const float* mean, const float* inv_std) {
  STOKE_GRID_LOOP(i, n) {
    const int c = static_cast<int>(i % channels);
    Store(y, i, (Load(x, i) - mean[c]) * inv_std[c] * scale[c] + shift[c]);
  }
}

template <typename T>
__global__ void BatchNormGradPartialsKernel(const T* x, const T* dy, int64_t rows, int channels, int chunks,
                                            const float* mean, const float* inv_std, float* partials) {
  const int64_t plane = static_cast<int64_t>(chunks) * channels;
  ChannelPartials(rows, channels, chunks, [=] __device__(int64_t r, int c) { return Load(dy, r * channels + c); },
                  partials);
  ChannelPartials(rows, channels, chunks, [=] __device__(int64_t r, int c) {
    const int64_t i = r * channels + c;
    return Load(dy, i) * (Load(x, i) - mean[c]) * inv_std[c];
  }, partials + plane);
}

__global__ void BatchNormGradCombineKernel(const float* partials, int chunks, int channels, float* dscale,
                                           float* dshift) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const int64_t plane = static_cast<int64_t>(chunks) * channels;
  dshift[c] = static_cast<float>(SumChunks(partials, chunks, channels, c));
  dscale[c] = static_cast<float>(SumChunks(partials + plane, chunks, channels, c));
}

template <typename T>
__global__ void BatchNormDxKernel(const T* x, const T* dy, T* dx, int64_t n, int64_t rows, int channels,
                                  const float* scale, const float* mean, const float* inv_std, const float* dscale,
                                  const float* dshift) {
  STOKE_GRID_LOOP(i, n) {
    const int c = static_cast<int>(i % channels);
    const float xhat = (Load(x, i) - mean[c]) * inv_std[c];
    const float m = static_cast<float>(rows);
    Store(dx, i, scale[c] * inv_std[c] * (Load(dy, i) - dshift[c] / m - xhat * dscale[c] / m));
  }
}

template <typename T>
__global__ void BatchNormInferenceKernel(const T* x, T* y, int64_t n, int channels, const float* scale,
                                         const float* shift, const float* mean, const float* var, float eps,
                                         bool relu) {
  STOKE_GRID_LOOP(i, n) {
    const int c = static_cast<int>(i % channels);
    const float v = (Load(x, i) - mean[c]) * rsqrtf(var[c] + eps) * scale[c] + shift[c];
    Store(y, i, relu ? fmaxf(v, 0.f) : v);
  }
}

// ---------------------------------------------------------------- batch norm + ReLU (fused)
//
// Rows x channels in 16-byte vectors: a thread owns one group of kVec<T> consecutive channels (its
// per-channel constants stay in registers) and walks rows. Block: gx channel groups (x) by gy rows
// (y); grid: the groups (x) by chunks of rows (y).

template <int N>
__device__ __forceinline__ void LoadConsts(const float* p, int c0, float (&v)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = p[c0 + k];
}

// The block's per-thread sums a and b of its group reduced over threadIdx.y (in order) into this
// chunk's row of the two partial planes (BatchNormWorkspace's layout: chunk x channels, sums of a
// then sums of b). `shared`: blockDim.x * blockDim.y * 2N floats.
template <int N>
__device__ void StoreGroupPartials(const float (&a)[N], const float (&b)[N], int g, int groups, int channels,
                                   float* partials, float* shared) {
  const int slot = (threadIdx.y * blockDim.x + threadIdx.x) * 2 * N;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    shared[slot + k] = a[k];
    shared[slot + N + k] = b[k];
  }
  __syncthreads();
  if (threadIdx.y != 0 || g >= groups) return;
  float ta[N] = {}, tb[N] = {};
  for (unsigned y = 0; y < blockDim.y; ++y) {
    const int o = (y * blockDim.x + threadIdx.x) * 2 * N;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      ta[k] += shared[o + k];
      tb[k] += shared[o + N + k];
    }
  }
  const int64_t plane = static_cast<int64_t>(gridDim.y) * channels;
  const int64_t at = static_cast<int64_t>(blockIdx.y) * channels + static_cast<int64_t>(g) * N;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    partials[at + k] = ta[k];
    partials[plane + at + k] = tb[k];
  }
}

// This thread's channel group (of `groups`) and the rows [begin, end) of its block's chunk.
struct GroupChunk {
  int groups, g;
  int64_t begin, end;
};
__device__ __forceinline__ GroupChunk ThisGroupChunk(int64_t rows, int channels, int n) {
  const int64_t per_chunk = (rows + gridDim.y - 1) / gridDim.y;
  const int64_t begin = blockIdx.y * per_chunk;
  return {channels / n, static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x), begin, min(rows, begin + per_chunk)};
}

// Per chunk: sums of x and of x^2 (one read of x).
template <typename T>
__global__ void MomentsVecKernel(const T* x, int64_t rows, int channels, float* partials) {
  constexpr int N = kVec<T>;
  extern __shared__ float shared[];
  const auto [groups, g, begin, end] = ThisGroupChunk(rows, channels, N);
  float s[N] = {}, s2[N] = {};
  if (g < groups) {
#pragma unroll 4
    for (int64_t r = begin + threadIdx.y; r < end; r += blockDim.y) {
      float v[N];
      LoadVec(x, r * channels + static_cast<int64_t>(g) * N, v);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        s[k] += v[k];
        s2[k] += v[k] * v[k];
      }
    }
  }
  StoreGroupPartials<N>(s, s2, g, groups, channels, partials, shared);
}

// affine = (a, b): a = scale * inv_std, b = shift - mean * a.
// z = max(a x + b, 0), the pre-activation as fmaf(x, a, b) (backward recomputes the same value).
template <typename T>
__global__ void AffineReluVecKernel(const T* x, T* z, int64_t rows, int channels, const float* affine) {
  constexpr int N = kVec<T>;
  const int groups = channels / N, g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  float a[N], b[N];
  LoadConsts(affine, g * N, a);
  LoadConsts(affine + channels, g * N, b);
#pragma unroll 4
  for (int64_t r = blockIdx.y * static_cast<int64_t>(blockDim.y) + threadIdx.y; r < rows;
       r += static_cast<int64_t>(gridDim.y) * blockDim.y) {
    const int64_t i = r * channels + static_cast<int64_t>(g) * N;
    float v[N];
    LoadVec(x, i, v);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = fmaxf(fmaf(v[k], a[k], b[k]), 0.f);
    StoreVec(z, i, v);
  }
}

// A channel group's constants for the fused backward: a, b (affine), mean and inv_std.
template <int N>
struct BnReluConsts {
  float a[N], b[N], m[N], inv[N];
  __device__ __forceinline__ BnReluConsts(const float* affine, const float* mean, const float* inv_std, int channels,
                                          int c0) {
    LoadConsts(affine, c0, a);
    LoadConsts(affine + channels, c0, b);
    LoadConsts(mean, c0, m);
    LoadConsts(inv_std, c0, inv);
  }
};
// Row r of group g: x, and dy = dz where fmaf(x, a, b) > 0 (else 0), as forward decided; returns
// the element index of the row's vector.
template <typename T, int N>
__device__ __forceinline__ int64_t MaskedRow(const T* x, const T* dz, int64_t r, int channels, int g,
                                             const BnReluConsts<N>& k, float (&xv)[N], float (&dy)[N]) {
  const int64_t i = r * channels + static_cast<int64_t>(g) * N;
  LoadVec(x, i, xv);
  LoadVec(dz, i, dy);
#pragma unroll
  for (int j = 0; j < N; ++j) dy[j] = fmaf(xv[j], k.a[j], k.b[j]) > 0.f ? dy[j] : 0.f;
  return i;
}

// Per chunk, dy = dz where a x + b > 0 (else 0): sums of dy and of dy * xhat.
template <typename T>
__global__ void BatchNormReluGradPartialsKernel(const T* x, const T* dz, int64_t rows, int channels,
                                                const float* affine, const float* mean, const float* inv_std,
                                                float* partials) {
  constexpr int N = kVec<T>;
  extern __shared__ float shared[];
  const auto [groups, g, begin, end] = ThisGroupChunk(rows, channels, N);
  float s[N] = {}, s2[N] = {};
  if (g < groups) {
    const BnReluConsts<N> k(affine, mean, inv_std, channels, g * N);
#pragma unroll 4
    for (int64_t r = begin + threadIdx.y; r < end; r += blockDim.y) {
      float xv[N], dy[N];
      MaskedRow<T, N>(x, dz, r, channels, g, k, xv, dy);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        s[j] += dy[j];
        s2[j] += dy[j] * (xv[j] - k.m[j]) * k.inv[j];
      }
    }
  }
  StoreGroupPartials<N>(s, s2, g, groups, channels, partials, shared);
}

// dx = a (dy - sum_dy / rows - xhat sum_dy_xhat / rows), dy masked as above.
template <typename T>
__global__ void BatchNormReluDxKernel(const T* x, const T* dz, T* dx, int64_t rows, int channels,
                                      const float* affine, const float* mean, const float* inv_std,
                                      const float* sum_dy_xhat, const float* sum_dy) {
  constexpr int N = kVec<T>;
  const int groups = channels / N, g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const BnReluConsts<N> k(affine, mean, inv_std, channels, g * N);
  float k1[N], k2[N];
  LoadConsts(sum_dy, g * N, k1);
  LoadConsts(sum_dy_xhat, g * N, k2);
  const float per = 1.f / static_cast<float>(rows);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    k1[j] *= per;
    k2[j] *= per;
  }
#pragma unroll 4
  for (int64_t r = blockIdx.y * static_cast<int64_t>(blockDim.y) + threadIdx.y; r < rows;
       r += static_cast<int64_t>(gridDim.y) * blockDim.y) {
    float xv[N], dy[N];
    const int64_t i = MaskedRow<T, N>(x, dz, r, channels, g, k, xv, dy);
#pragma unroll
    for (int j = 0; j < N; ++j) dy[j] = k.a[j] * (dy[j] - k1[j] - (xv[j] - k.m[j]) * k.inv[j] * k2[j]);
    StoreVec(dx, i, dy);
  }
}

// ---------------------------------------------------------------- pooling (fallback)

template <typename T>
__global__ void PoolKernel(const T* x, T* y, int32_t* argmax, PoolShape p) {
  const int64_t n = static_cast<int64_t>(p.n) * p.oh * p.ow * p.c;
  STOKE_GRID_LOOP(i, n) {
    const int c = static_cast<int>(i % p.c);
    const int ox = static_cast<int>((i / p.c) % p.ow), oy = static_cast<int>((i / p.c / p.ow) % p.oh);
    const int64_t s = i / (static_cast<int64_t>(p.c) * p.ow * p.oh);
    const T* base = x + s * p.h * p.w * p.c;
    float best = -FLT_MAX, sum = 0;
    int arg = -1;
    for (int ky = 0; ky < p.kh; ++ky) {
      const int iy = oy * p.stride - p.pad + ky;
      if (iy < 0 || iy >= p.h) continue;
      for (int kx = 0; kx < p.kw; ++kx) {
        const int ix = ox * p.stride - p.pad + kx;
        if (ix < 0 || ix >= p.w) continue;
        const float v = Load(base, (static_cast<int64_t>(iy) * p.w + ix) * p.c + c);
        sum += v;
        if (arg < 0 || v > best) {
          best = v;
          arg = iy * p.w + ix;
        }
      }
    }
    if (p.max) {
      argmax[i] = arg;
      Store(y, i, best);
    } else {
      Store(y, i, sum / static_cast<float>(p.kh * p.kw));
    }
  }
}

template <typename T>
__global__ void PoolBackwardKernel(const T* dy, const int32_t* argmax, T* dx, PoolShape p) {
  const int64_t n = static_cast<int64_t>(p.n) * p.h * p.w * p.c;
  STOKE_GRID_LOOP(i, n) {
    const int c = static_cast<int>(i % p.c);
    const int ix = static_cast<int>((i / p.c) % p.w), iy = static_cast<int>((i / p.c / p.w) % p.h);
    const int64_t s = i / (static_cast<int64_t>(p.c) * p.w * p.h);
    // Outputs whose window covers (iy, ix): oy * stride - pad <= iy < oy * stride - pad + kh.
    const int oy0 = max(0, (iy + p.pad - p.kh + p.stride) / p.stride), oy1 = min(p.oh - 1, (iy + p.pad) / p.stride);
    const int ox0 = max(0, (ix + p.pad - p.kw + p.stride) / p.stride), ox1 = min(p.ow - 1, (ix + p.pad) / p.stride);
    float acc = 0;
    for (int oy = oy0; oy <= oy1; ++oy) {
      if (iy < oy * p.stride - p.pad || iy >= oy * p.stride - p.pad + p.kh) continue;
      for (int ox = ox0; ox <= ox1; ++ox) {
        if (ix < ox * p.stride - p.pad || ix >= ox * p.stride - p.pad + p.kw) continue;
        const int64_t o = ((s * p.oh + oy) * p.ow + ox) * p.c + c;
        if (p.max) {
          if (argmax[o] == iy * p.w + ix) acc += Load(dy, o);
        } else {
          acc += Load(dy, o);
        }
      }
    }
    Store(dx, i, p.max ? acc : acc / static_cast<float>(p.kh * p.kw));
  }
}

// ---------------------------------------------------------------- flatten

template <typename T>
__global__ void FlattenKernel(const T* x, T* y, int64_t n, int h, int w, int c, bool inverse) {
  STOKE_GRID_LOOP(i, n) {  // i walks NHWC
    const int ch = static_cast<int>(i % c);
    const int64_t pixel = (i / c) % (static_cast<int64_t>(h) * w), sample = i / (static_cast<int64_t>(c) * h * w);
    const int64_t j = sample * c * h * w + ch * static_cast<int64_t>(h) * w + pixel;
    if (inverse) {
      Store(y, i, Load(x, j));
    } else {
      Store(y, j, Load(x, i));
    }
  }
}

// ---------------------------------------------------------------- optimizer

template <typename T>
__global__ void NonFiniteKernel(const T* g, int64_t n, StepStats* stats) {
  bool bad = false;
  STOKE_GRID_LOOP(i, n) { bad |= !isfinite(Load(g, i)); }
  if (__syncthreads_or(bad) && threadIdx.x == 0) stats->non_finite = 1;
}

template <typename G, typename C>
__device__ __forceinline__ void SgdElement(int64_t i, float r, float* master, float* momentum, const G* grad,
                                           C* copy, int64_t decay_end, int64_t copy_end, const SgdArgs& a) {
  const float w = master[i];
  const float g = r * (Load(grad, i) * a.inv_loss_scale + (i < decay_end ? a.weight_decay * w : 0.f));
  const float m = a.momentum * momentum[i] + g;
  momentum[i] = m;
  const float updated = w - a.lr * (a.nesterov ? g + a.momentum * m : m);
  master[i] = updated;
  if (copy != nullptr && i < copy_end) Store(copy, i, updated);
}

// Grid-stride over the group, or (with chunks) one block per chunk at its segment's ratio.
template <typename G, typename C>
__global__ void SgdKernel(float* master, float* momentum, const G* grad, C* copy, int64_t n, int64_t decay_end,
                          int64_t copy_end, SgdArgs a, const StepStats* stats, const LarsChunk* chunks,
                          const float* ratios) {
  if (stats->non_finite) return;
  if (chunks == nullptr) {
    STOKE_GRID_LOOP(i, n) { SgdElement(i, 1.f, master, momentum, grad, copy, decay_end, copy_end, a); }
    return;
  }
  const LarsChunk c = chunks[blockIdx.x];
  const float r = ratios[c.segment];
  for (int64_t i = c.begin + threadIdx.x; i < c.end; i += blockDim.x) {
    SgdElement(i, r, master, momentum, grad, copy, decay_end, copy_end, a);
  }
}

// Per chunk: the sums of w^2 and (g / loss scale)^2, in double, reduced in a fixed order.
template <typename G>
__global__ void LarsPartialsKernel(const float* master, const G* grad, const LarsChunk* chunks, float inv_loss_scale,
                                   double* partials, const StepStats* stats) {
  __shared__ double shared[2][kThreads / 32];
  if (stats->non_finite) return;
  const LarsChunk c = chunks[blockIdx.x];
  double ww = 0, gg = 0;
  for (int64_t i = c.begin + threadIdx.x; i < c.end; i += blockDim.x) {
    const double w = master[i];
    const double g = static_cast<double>(Load(grad, i)) * inv_loss_scale;
    ww += w * w;
    gg += g * g;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    ww += __shfl_down_sync(0xffffffffu, ww, offset);
    gg += __shfl_down_sync(0xffffffffu, gg, offset);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    shared[0][warp] = ww;
    shared[1][warp] = gg;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double sw = 0, sg = 0;
    for (int k = 0; k < kThreads / 32; ++k) {
      sw += shared[0][k];
      sg += shared[1][k];
    }
    partials[2 * blockIdx.x] = sw;
    partials[2 * blockIdx.x + 1] = sg;
  }
}

// One thread per segment: its chunks' partials in order, then the trust ratio (train/network.cc
// TrustRatio).
__global__ void LarsRatiosKernel(const LarsSegment* segments, int num_segments, const double* partials, LarsArgs a,
                                 float* ratios, const StepStats* stats) {
  if (stats->non_finite) return;
  STOKE_GRID_LOOP(s, num_segments) {
    const LarsSegment seg = segments[s];
    double ww = 0, gg = 0;
    for (int k = seg.first_chunk; k < seg.first_chunk + seg.chunks; ++k) {
      ww += partials[2 * k];
      gg += partials[2 * k + 1];
    }
    const double wn = sqrt(ww), gn = sqrt(gg);
    double r = 1;
    if (seg.adapt != 0 && wn > 0 && gn > 0) {
      r = a.trust * wn / (gn + a.weight_decay * wn + a.eps);
      if (a.clip_by_lr != 0 && a.lr > 0) r = fmin(r / a.lr, 1.0);
    }
    ratios[s] = static_cast<float>(r);
  }
}

template <typename T>
__global__ void CastFromFloatKernel(const float* src, T* dst, int64_t n) {
  STOKE_GRID_LOOP(i, n) { Store(dst, i, src[i]); }
}
template <typename T>
__global__ void CastToFloatKernel(const T* src, float* dst, int64_t n) {
  STOKE_GRID_LOOP(i, n) { dst[i] = Load(src, i); }
}

}  // namespace

void SoftmaxCrossEntropy(const void* logits, DType t, const int32_t* labels, int rows, int classes, float smoothing,
                         void* grad, float grad_scale, StepStats* stats, double* row_loss, cudaStream_t s) {
  if (rows <= 0) return;
  STOKE_DISPATCH(t, (SoftmaxCrossEntropyKernel<T><<<rows, kThreads, 0, s>>>(
                        static_cast<const T*>(logits), labels, classes, smoothing, static_cast<T*>(grad), grad_scale,
                        stats, row_loss)));
  SumRowLossKernel<<<1, kThreads, 0, s>>>(row_loss, rows, stats);
}

void AddChannelBias(void* y, DType t, const float* bias, int64_t rows, int channels, cudaStream_t s) {
  const int64_t n = rows * channels;
  STOKE_DISPATCH(t, (AddChannelBiasKernel<T><<<Blocks(n), kThreads, 0, s>>>(static_cast<T*>(y), bias, n, channels)));
}

void ChannelSums(const void* x, DType t, int64_t rows, int channels, float* out, float* partials, cudaStream_t s) {
  const int chunks = Chunks(rows);
  const dim3 block(32, kChunkRows), grid((channels + 31) / 32, chunks);
  STOKE_DISPATCH(t, (ChannelSumsKernel<T><<<grid, block, 0, s>>>(static_cast<const T*>(x), rows, channels, chunks,
                                                               partials)));
  CombinePartialsKernel<<<(channels + 127) / 128, 128, 0, s>>>(partials, chunks, channels, out);
}

void Relu(const void* x, void* y, DType t, int64_t n, cudaStream_t s) {
  STOKE_DISPATCH(t, (ReluKernel<T><<<Blocks(n), kThreads, 0, s>>>(static_cast<const T*>(x), static_cast<T*>(y), n)));
}
void ReluBackward(const void* x, const void* dy, void* dx, DType t, int64_t n, cudaStream_t s) {
  STOKE_DISPATCH(t, (ReluBackwardKernel<T><<<Blocks(n), kThreads, 0, s>>>(
                        static_cast<const T*>(x), static_cast<const T*>(dy), static_cast<T*>(dx), n)));
}
void Add(const void* a, const void* b, void* y, DType t, int64_t n, cudaStream_t s) {
  STOKE_DISPATCH(t, (AddKernel<T><<<Blocks(n), kThreads, 0, s>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                                                               static_cast<T*>(y), n)));
}
void Accumulate(void* dst, const void* src, DType t, int64_t n, cudaStream_t s) {
  const bool aligned = reinterpret_cast<uintptr_t>(dst) % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0;
  STOKE_DISPATCH(t, (AccumulateTyped<T>(static_cast<T*>(dst), static_cast<const T*>(src), n, aligned, s)));
}

void Dropout(const void* x, void* y, uint8_t* keep, DType t, int64_t n, int c, int h, int w, uint64_t seed, double p,
             cudaStream_t s) {
  const auto scale = static_cast<float>(1.0 / (1.0 - p));
  STOKE_DISPATCH(t, (DropoutKernel<T><<<Blocks(n), kThreads, 0, s>>>(static_cast<const T*>(x), static_cast<T*>(y),
                                                                   keep, n, c, h, w, seed,
                                                                   p, scale)));
}
void DropoutBackward(const void* dy, const uint8_t* keep, void* dx, DType t, int64_t n, double p, cudaStream_t s) {
  const auto scale = static_cast<float>(1.0 / (1.0 - p));
  STOKE_DISPATCH(t, (DropoutBackwardKernel<T><<<Blocks(n), kThreads, 0, s>>>(static_cast<const T*>(dy), keep,
                                                                           static_cast<T*>(dx), n, scale)));
}

namespace {

// The launches batch norm's forms share (whole batch, or split around a sum over the ranks).
void LaunchMoments(const void* x, DType t, int64_t rows, int channels, const float* k, float* partials,
                   cudaStream_t s) {
  const dim3 block(32, kChunkRows), grid((channels + 31) / 32, Chunks(rows));
  STOKE_DISPATCH(t, (MomentsKernel<T><<<grid, block, 0, s>>>(static_cast<const T*>(x), rows, channels, Chunks(rows),
                                                           k, partials)));
}
void LaunchGradPartials(const void* x, const void* dy, DType t, int64_t rows, int channels, const float* mean,
                        const float* inv_std, float* partials, cudaStream_t s) {
  const dim3 block(32, kChunkRows), grid((channels + 31) / 32, Chunks(rows));
  STOKE_DISPATCH(t, (BatchNormGradPartialsKernel<T><<<grid, block, 0, s>>>(
                        static_cast<const T*>(x), static_cast<const T*>(dy), rows, channels, Chunks(rows), mean,
                        inv_std, partials)));
}
void LaunchNormalize(const void* x, void* y, DType t, int64_t rows, int channels, const float* scale,
                     const float* shift, const float* mean, const float* inv_std, cudaStream_t s) {
  const int64_t n = rows * channels;
  STOKE_DISPATCH(t, (ChannelNormalizeKernel<T><<<Blocks(n), kThreads, 0, s>>>(
                        static_cast<const T*>(x), static_cast<T*>(y), n, channels, scale, shift, mean, inv_std)));
}
// dx from the sums of dy and dy * xhat over `count` rows.
void LaunchDx(const void* x, const void* dy, void* dx, DType t, int64_t rows, int channels, int64_t count,
              const float* scale, const float* mean, const float* inv_std, const float* sum_dy_xhat,
              const float* sum_dy, cudaStream_t s) {
  const int64_t n = rows * channels;
  STOKE_DISPATCH(t, (BatchNormDxKernel<T><<<Blocks(n), kThreads, 0, s>>>(
                        static_cast<const T*>(x), static_cast<const T*>(dy), static_cast<T*>(dx), n, count, channels,
                        scale, mean, inv_std, sum_dy_xhat, sum_dy)));
}

}  // namespace

size_t BatchNormWorkspace(int64_t rows, int channels) {
  return 2 * static_cast<size_t>(Chunks(rows)) * static_cast<size_t>(channels);
}

void BatchNormTrain(const void* x, void* y, DType t, int64_t rows, int channels, const float* scale, const float* shift,
                    float eps, float momentum, float* running_mean, float* running_var, float* save_mean,
                    float* save_inv_std, float* partials, cudaStream_t s) {
  LaunchMoments(x, t, rows, channels, nullptr, partials, s);
  BatchNormStatsKernel<<<(channels + 127) / 128, 128, 0, s>>>(partials, Chunks(rows), channels, rows, eps, momentum,
                                                              running_mean, running_var, save_mean, save_inv_std);
  LaunchNormalize(x, y, t, rows, channels, scale, shift, save_mean, save_inv_std, s);
}

void BatchNormBackward(const void* x, const void* dy, void* dx, DType t, int64_t rows, int channels,
                       const float* scale, const float* save_mean, const float* save_inv_std, float* dscale,
                       float* dshift, float* partials, cudaStream_t s) {
  LaunchGradPartials(x, dy, t, rows, channels, save_mean, save_inv_std, partials, s);
  BatchNormGradCombineKernel<<<(channels + 127) / 128, 128, 0, s>>>(partials, Chunks(rows), channels, dscale, dshift);
  LaunchDx(x, dy, dx, t, rows, channels, rows, scale, save_mean, save_inv_std, dscale, dshift, s);
}

void BatchNormLocalMoments(const void* x, DType t, int64_t rows, int channels, const float* running_mean,
                           double* sums, float* partials, cudaStream_t s) {
  LaunchMoments(x, t, rows, channels, running_mean, partials, s);
  PlaneSumsKernel<<<(channels + 127) / 128, 128, 0, s>>>(partials, Chunks(rows), channels, sums);
}

void BatchNormTrainFromMoments(const void* x, void* y, DType t, int64_t rows, int channels, const float* scale,
                               const float* shift, const double* sums, int64_t count, float eps, float momentum,
                               float* running_mean, float* running_var, float* save_mean, float* save_inv_std,
                               cudaStream_t s) {
  BatchNormStatsFromSumsKernel<<<(channels + 127) / 128, 128, 0, s>>>(sums, channels, count, eps, momentum,
                                                                      running_mean, running_var, save_mean,
                                                                      save_inv_std);
  LaunchNormalize(x, y, t, rows, channels, scale, shift, save_mean, save_inv_std, s);
}

void BatchNormLocalGradSums(const void* x, const void* dy, DType t, int64_t rows, int channels,
                            const float* save_mean, const float* save_inv_std, float* dscale, float* dshift,
                            double* sums, float* partials, cudaStream_t s) {
  LaunchGradPartials(x, dy, t, rows, channels, save_mean, save_inv_std, partials, s);
  PlaneSumsKernel<<<(channels + 127) / 128, 128, 0, s>>>(partials, Chunks(rows), channels, sums);
  SumsToGradsKernel<<<(channels + 127) / 128, 128, 0, s>>>(sums, channels, dscale, dshift);
}

void BatchNormBackwardFromSums(const void* x, const void* dy, void* dx, DType t, int64_t rows, int channels,
                               const float* scale, const float* save_mean, const float* save_inv_std,
                               const double* sums, int64_t count, float* scratch, cudaStream_t s) {
  float* sum_dy_xhat = scratch + channels;  // scratch: sums of dy, then of dy * xhat
  SumsToGradsKernel<<<(channels + 127) / 128, 128, 0, s>>>(sums, channels, sum_dy_xhat, scratch);
  LaunchDx(x, dy, dx, t, rows, channels, count, scale, save_mean, save_inv_std, sum_dy_xhat, scratch, s);
}

void BatchNormInference(const void* x, void* y, DType t, int64_t rows, int channels, const float* scale,
                        const float* shift, const float* mean, const float* var, float eps, cudaStream_t s,
                        bool relu) {
  const int64_t n = rows * channels;
  STOKE_DISPATCH(t, (BatchNormInferenceKernel<T><<<Blocks(n), kThreads, 0, s>>>(
                        static_cast<const T*>(x), static_cast<T*>(y), n, channels, scale, shift, mean, var, eps,
                        relu)));
}

namespace {

// The fused kernels' launch shape for rows x channels of T: gx channel groups by gy rows (at most
// 256 threads); `reduce`: grid rows are Chunks(rows) chunks (the partial planes' rows), else blocks
// over the rows up to about 4,096 in all (a few waves on a large GPU; each thread then walks
// several rows with its channels' constants in registers).
struct GroupLaunch {
  dim3 block, grid;
  size_t shared;
};
GroupLaunch GroupShape(int groups, int64_t rows, bool reduce, int floats_per_group) {
  const int gx = std::min(groups, 32), gy = std::max(1, 256 / gx);
  const auto x_blocks = static_cast<unsigned>((groups + gx - 1) / gx);
  const auto y_blocks = reduce ? static_cast<unsigned>(Chunks(rows))
                               : static_cast<unsigned>(std::clamp<int64_t>(
                                     std::min<int64_t>((rows + gy - 1) / gy, 4096 / x_blocks), 1, 65535));
  return {dim3(gx, gy), dim3(x_blocks, y_blocks),
          static_cast<size_t>(gx) * gy * static_cast<size_t>(floats_per_group) * sizeof(float)};
}

template <typename T>
void BatchNormReluTrainTyped(const T* x, T* z, int64_t rows, int channels, const float* scale, const float* shift,
                             float eps, float momentum, float* running_mean, float* running_var, float* save_mean,
                             float* save_inv_std, float* affine, float* partials, cudaStream_t s) {
  constexpr int N = kVec<T>;
  const int groups = channels / N;
  const GroupLaunch m = GroupShape(groups, rows, true, 2 * N);
  MomentsVecKernel<T><<<m.grid, m.block, m.shared, s>>>(x, rows, channels, partials);
  BatchNormStatsKernel<<<(channels + 127) / 128, 128, 0, s>>>(partials, Chunks(rows), channels, rows, eps, momentum,
                                                              running_mean, running_var, save_mean, save_inv_std,
                                                              scale, shift, affine);
  const GroupLaunch e = GroupShape(groups, rows, false, 0);
  AffineReluVecKernel<T><<<e.grid, e.block, 0, s>>>(x, z, rows, channels, affine);
}

template <typename T>
void BatchNormReluBackwardTyped(const T* x, const T* dz, T* dx, int64_t rows, int channels, const float* save_mean,
                                const float* save_inv_std, const float* affine, float* dscale, float* dshift,
                                float* partials, cudaStream_t s) {
  constexpr int N = kVec<T>;
  const int groups = channels / N;
  const GroupLaunch m = GroupShape(groups, rows, true, 2 * N);
  BatchNormReluGradPartialsKernel<T><<<m.grid, m.block, m.shared, s>>>(x, dz, rows, channels, affine, save_mean,
                                                                       save_inv_std, partials);
  BatchNormGradCombineKernel<<<(channels + 127) / 128, 128, 0, s>>>(partials, Chunks(rows), channels, dscale, dshift);
  const GroupLaunch e = GroupShape(groups, rows, false, 0);
  BatchNormReluDxKernel<T><<<e.grid, e.block, 0, s>>>(x, dz, dx, rows, channels, affine, save_mean,
                                                      save_inv_std, dscale, dshift);
}

}  // namespace

bool FusedBatchNormReluFits(DType t, int channels) {
  const int per = 16 / static_cast<int>(SizeOf(t));
  return channels > 0 && channels % per == 0;
}

void BatchNormReluTrain(const void* x, void* z, DType t, int64_t rows, int channels, const float* scale,
                        const float* shift, float eps, float momentum, float* running_mean, float* running_var,
                        float* save_mean, float* save_inv_std, float* affine, float* partials, cudaStream_t s) {
  STOKE_DISPATCH(t, (BatchNormReluTrainTyped<T>(static_cast<const T*>(x), static_cast<T*>(z), rows, channels, scale,
                                                shift, eps, momentum, running_mean, running_var, save_mean,
                                                save_inv_std, affine, partials, s)));
}

void BatchNormReluBackward(const void* x, const void* dz, void* dx, DType t, int64_t rows, int channels,
                           const float* save_mean, const float* save_inv_std, const float* affine, float* dscale,
                           float* dshift, float* partials, cudaStream_t s) {
  STOKE_DISPATCH(t, (BatchNormReluBackwardTyped<T>(static_cast<const T*>(x), static_cast<const T*>(dz),
                                                   static_cast<T*>(dx), rows, channels, save_mean, save_inv_std,
                                                   affine, dscale, dshift, partials, s)));
}

void Pool(const void* x, void* y, int32_t* argmax, DType t, PoolShape p, cudaStream_t s) {
  const int64_t n = static_cast<int64_t>(p.n) * p.oh * p.ow * p.c;
  STOKE_DISPATCH(t, (PoolKernel<T><<<Blocks(n), kThreads, 0, s>>>(static_cast<const T*>(x), static_cast<T*>(y), argmax,
                                                                p)));
}
void PoolBackward(const void* dy, const int32_t* argmax, void* dx, DType t, PoolShape p, cudaStream_t s) {
  const int64_t n = static_cast<int64_t>(p.n) * p.h * p.w * p.c;
  STOKE_DISPATCH(t, (PoolBackwardKernel<T><<<Blocks(n), kThreads, 0, s>>>(static_cast<const T*>(dy), argmax,
                                                                        static_cast<T*>(dx), p)));
}

void Flatten(const void* x, void* y, DType t, int n, int h, int w, int c, bool inverse, cudaStream_t s) {
  const int64_t count = static_cast<int64_t>(n) * h * w * c;
  STOKE_DISPATCH(t, (FlattenKernel<T><<<Blocks(count), kThreads, 0, s>>>(static_cast<const T*>(x), static_cast<T*>(y),
                                                                       count, h, w, c, inverse)));
}

void FindNonFinite(const void* g, DType t, int64_t n, StepStats* stats, cudaStream_t s) {
  if (n <= 0) return;
  STOKE_DISPATCH(t, (NonFiniteKernel<T><<<Blocks(n), kThreads, 0, s>>>(static_cast<const T*>(g), n, stats)));
}

void LarsTrustRatios(const float* master, const void* grad, DType gt, const LarsChunk* chunks, int num_chunks,
                     const LarsSegment* segments, int num_segments, LarsArgs a, double* partials, float* ratios,
                     const StepStats* stats, cudaStream_t s) {
  if (num_chunks <= 0 || num_segments <= 0) return;
  STOKE_DISPATCH(gt, (LarsPartialsKernel<T><<<num_chunks, kThreads, 0, s>>>(master, static_cast<const T*>(grad), chunks,
                                                                           a.inv_loss_scale, partials, stats)));
  LarsRatiosKernel<<<Blocks(num_segments), kThreads, 0, s>>>(segments, num_segments, partials, a, ratios, stats);
}

void SgdUpdate(float* master, float* momentum, const void* grad, DType gt, void* copy, DType ct, int64_t n,
               int64_t decay_end, int64_t copy_end, SgdArgs a, const StepStats* stats, cudaStream_t s,
               const LarsChunk* chunks, int num_chunks, const float* ratios) {
  if (n <= 0 || (chunks != nullptr && num_chunks <= 0)) return;
  const unsigned blocks = chunks != nullptr ? static_cast<unsigned>(num_chunks) : Blocks(n);
  // The copy type only matters where a copy is written; float copies never are (the master is used).
  switch (gt) {
    case DType::kF32:
      STOKE_DISPATCH(ct, (SgdKernel<float, T><<<blocks, kThreads, 0, s>>>(
                             master, momentum, static_cast<const float*>(grad), static_cast<T*>(copy), n, decay_end,
                             copy_end, a, stats, chunks, ratios)));
      break;
    case DType::kF16:
      SgdKernel<__half, __half><<<blocks, kThreads, 0, s>>>(master, momentum, static_cast<const __half*>(grad),
                                                            static_cast<__half*>(copy), n, decay_end, copy_end, a,
                                                            stats, chunks, ratios);
      break;
    case DType::kBF16:
      SgdKernel<__nv_bfloat16, __nv_bfloat16><<<blocks, kThreads, 0, s>>>(
          master, momentum, static_cast<const __nv_bfloat16*>(grad), static_cast<__nv_bfloat16*>(copy), n, decay_end,
          copy_end, a, stats, chunks, ratios);
      break;
  }
}

void CastFromFloat(const float* src, void* dst, DType t, int64_t n, cudaStream_t s) {
  STOKE_DISPATCH(t, (CastFromFloatKernel<T><<<Blocks(n), kThreads, 0, s>>>(src, static_cast<T*>(dst), n)));
}
void CastToFloat(const void* src, DType t, float* dst, int64_t n, cudaStream_t s) {
  STOKE_DISPATCH(t, (CastToFloatKernel<T><<<Blocks(n), kThreads, 0, s>>>(static_cast<const T*>(src), dst, n)));
}

}  // namespace stoke::train::cuda
