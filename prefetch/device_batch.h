// Work on a batch's device copy, queued on the consumer's CUDA stream: waiting for the ring's
// copy, and normalising the uint8 pixels into the floats a network takes. Used by the CUDA
// trainer and by the Python package's device batches. Without CUDA in the build both return
// kUnavailable.
#pragma once

#include <array>
#include <cstdint>

#include "common/status.h"
#include "prefetch/loader.h"

namespace stoke::prefetch {

// Makes `stream` (a cudaStream_t; nullptr: the legacy default stream) wait, on the device, for
// the ring's host-to-device copy of `batch`. No-op for a batch without a device copy.
Status WaitForCopy(const Batch& batch, void* stream);

enum class DeviceDType { kFloat32, kFloat16, kBFloat16 };

// (v / 255 - mean[c]) / std[c] for the uint8 HWC pixels of `valid` images of `pixels` pixels
// each at device address `images`, written to `dst` as `total` >= `valid` images in `t` (the
// images past `valid` are zero: a short batch padded to a network's fixed batch). `channels`
// (3, 4 or 8) values a pixel are written: the image's 3, then zeros (an input padded for
// tensor-core convolutions). Asynchronous on `stream`; `images` and `dst` must be on the current
// device. kInvalidArgument for a std <= 0 or another channel count.
Status NormalizeOnDevice(const uint8_t* images, int valid, int total, int64_t pixels,
                         const std::array<float, 3>& mean, const std::array<float, 3>& std, DeviceDType t,
                         void* dst, void* stream, int channels = 3);

}  // namespace stoke::prefetch
