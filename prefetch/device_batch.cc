#include "prefetch/device_batch.h"

#include <fmt/format.h>

#include "augment/transform.h"

#if STOKE_WITH_CUDA
#include <cuda_runtime.h>

namespace stoke::prefetch::detail {
// device_normalize.cu
cudaError_t LaunchNormalize(const uint8_t* src, int64_t valid_pixels, int64_t total_pixels, int channels,
                            const float* scale, const float* shift, int dtype, void* dst, cudaStream_t s);
}  // namespace stoke::prefetch::detail
#endif

namespace stoke::prefetch {

#if STOKE_WITH_CUDA

namespace {
Status Failed(cudaError_t rc, const char* what) {
  return UnavailableError(fmt::format("CUDA: {}: {} ({})", what, cudaGetErrorString(rc), cudaGetErrorName(rc)));
}
}  // namespace

Status WaitForCopy(const Batch& batch, void* stream) {
  if (batch.device_images == nullptr || batch.copied_event == nullptr) return OkStatus();
  const cudaError_t rc = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                             static_cast<cudaEvent_t>(batch.copied_event), 0);
  return rc == cudaSuccess ? OkStatus() : Failed(rc, "waiting for the batch's copy");
}

#else

Status WaitForCopy(const Batch& batch, void*) {
  if (batch.device_images == nullptr) return OkStatus();
  return UnavailableError("a batch on a GPU in a build without CUDA");
}

#endif

Status NormalizeOnDevice(const uint8_t* images, int valid, int total, int64_t pixels,
                         const std::array<float, 3>& mean, const std::array<float, 3>& std, DeviceDType t,
                         void* dst, void* stream, int channels) {
  if (valid < 0 || total < valid || pixels < 0) {
    return InvalidArgumentError(fmt::format("normalise on device: {} of {} images of {} pixels", valid, total, pixels));
  }
  if (channels != 3 && channels != 4 && channels != 8) {
    return InvalidArgumentError(fmt::format("normalise on device: {} channels out; expected 3, 4 or 8", channels));
  }
  STOKE_RETURN_IF_ERROR(augment::ValidateNormalize(mean, std, augment::NormalizeLimit(t == DeviceDType::kFloat16)));
  float scale[3], shift[3];
  for (int c = 0; c < 3; ++c) {
    scale[c] = 1.f / (255.f * std[static_cast<size_t>(c)]);
    shift[c] = -mean[static_cast<size_t>(c)] / std[static_cast<size_t>(c)];
  }
  if (int64_t{total} * pixels == 0) return OkStatus();
#if STOKE_WITH_CUDA
  // An error left by earlier work on this thread is named as such, not as this launch's; taking
  // it clears it (unless sticky), so one stale error fails one batch, not every later one.
  if (const cudaError_t pending = cudaGetLastError(); pending != cudaSuccess) {
    return Failed(pending, "an earlier CUDA error, pending before the normalise kernel");
  }
  const cudaError_t rc = detail::LaunchNormalize(images, int64_t{valid} * pixels, int64_t{total} * pixels, channels,
                                                 scale, shift, static_cast<int>(t), dst,
                                                 static_cast<cudaStream_t>(stream));
  return rc == cudaSuccess ? OkStatus() : Failed(rc, "normalise kernel launch");
#else
  (void)images, (void)t, (void)dst, (void)stream, (void)scale, (void)shift;
  return UnavailableError("normalising on a GPU: stoke was built without CUDA");
#endif
}

}  // namespace stoke::prefetch
