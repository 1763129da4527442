// The normalisation kernel behind prefetch::NormalizeOnDevice (device_batch.cc). Plain C++17 and
// CUDA types only, so nvcc never sees the project's C++20 headers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace stoke::prefetch::detail {
namespace {

constexpr int kThreads = 256;

struct Affine {
  float scale[3];
  float shift[3];
};

__device__ inline void Put(float* p, float v) { *p = v; }
__device__ inline void Put(__half* p, float v) { *p = __float2half_rn(v); }
__device__ inline void Put(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

template <typename T>
__global__ void NormalizeKernel(const uint8_t* src, int64_t valid_values, int64_t total_values, Affine a, T* dst) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total_values;
       i += int64_t{blockDim.x} * gridDim.x) {
    const int c = static_cast<int>(i % 3);
    Put(dst + i, i < valid_values ? src[i] * a.scale[c] + a.shift[c] : 0.f);
  }
}

}  // namespace

// dtype: 0 float32, 1 float16, 2 bfloat16 (DeviceDType's order).
cudaError_t LaunchNormalize(const uint8_t* src, int64_t valid_values, int64_t total_values, const float* scale,
                            const float* shift, int dtype, void* dst, cudaStream_t s) {
  Affine a{};
  for (int c = 0; c < 3; ++c) {
    a.scale[c] = scale[c];
    a.shift[c] = shift[c];
  }
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((total_values + kThreads - 1) / kThreads, 65535 * 8));
  switch (dtype) {
    case 0:
      NormalizeKernel<<<blocks, kThreads, 0, s>>>(src, valid_values, total_values, a, static_cast<float*>(dst));
      break;
    case 1:
      NormalizeKernel<<<blocks, kThreads, 0, s>>>(src, valid_values, total_values, a, static_cast<__half*>(dst));
      break;
    default:
      NormalizeKernel<<<blocks, kThreads, 0, s>>>(src, valid_values, total_values, a,
                                                  static_cast<__nv_bfloat16*>(dst));
      break;
  }
  return cudaGetLastError();
}

}  // namespace stoke::prefetch::detail
