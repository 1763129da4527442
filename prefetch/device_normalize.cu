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

// One thread per output value; `C` output channels a pixel, of which the first 3 are the image's
// and the rest zero (a padded input for tensor-core convolutions).
template <int C, typename T>
__global__ void NormalizeKernel(const uint8_t* src, int64_t valid_pixels, int64_t total_values, Affine a, T* dst) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total_values;
       i += int64_t{blockDim.x} * gridDim.x) {
    const int64_t p = i / C;
    const int c = static_cast<int>(i - p * C);
    Put(dst + i, c < 3 && p < valid_pixels ? src[p * 3 + c] * a.scale[c] + a.shift[c] : 0.f);
  }
}

template <int C>
void Launch(const uint8_t* src, int64_t valid_pixels, int64_t total_values, const Affine& a, int dtype, void* dst,
            cudaStream_t s) {
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((total_values + kThreads - 1) / kThreads, 65535 * 8));
  switch (dtype) {
    case 0:
      NormalizeKernel<C><<<blocks, kThreads, 0, s>>>(src, valid_pixels, total_values, a, static_cast<float*>(dst));
      break;
    case 1:
      NormalizeKernel<C><<<blocks, kThreads, 0, s>>>(src, valid_pixels, total_values, a, static_cast<__half*>(dst));
      break;
    default:
      NormalizeKernel<C><<<blocks, kThreads, 0, s>>>(src, valid_pixels, total_values, a,
                                                     static_cast<__nv_bfloat16*>(dst));
      break;
  }
}

}  // namespace

// dtype: 0 float32, 1 float16, 2 bfloat16 (DeviceDType's order). channels: 3, 4 or 8 a pixel out.
cudaError_t LaunchNormalize(const uint8_t* src, int64_t valid_pixels, int64_t total_pixels, int channels,
                            const float* scale, const float* shift, int dtype, void* dst, cudaStream_t s) {
  Affine a{};
  for (int c = 0; c < 3; ++c) {
    a.scale[c] = scale[c];
    a.shift[c] = shift[c];
  }
  switch (channels) {
    case 3:
      Launch<3>(src, valid_pixels, total_pixels * 3, a, dtype, dst, s);
      break;
    case 4:
      Launch<4>(src, valid_pixels, total_pixels * 4, a, dtype, dst, s);
      break;
    case 8:
      Launch<8>(src, valid_pixels, total_pixels * 8, a, dtype, dst, s);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace stoke::prefetch::detail
