// Memory for the batch ring: page-aligned host buffers, pinned with cudaHostAlloc when batches
// go to a GPU, plus the device side of each slot and the asynchronous copy between them.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include "common/status.h"

namespace stoke::prefetch {

// Whether this build and this machine can put batches on a GPU.
struct CudaProbe {
  bool built = false;  // the CUDA backend was compiled in
  int devices = 0;     // usable devices (0 when not built, no driver or no GPU)
  std::string reason;  // why devices == 0, for skip messages and errors
};
CudaProbe ProbeCuda();

// `slots` host buffers of `bytes` each, and, when `device` >= 0, as many device buffers, a copy
// stream, and two events per slot: `copied` (recorded after the slot's host-to-device copy) and
// `consumed` (recorded by the consumer on its own stream when it hands the slot back).
// Host buffers are pinned when a device is used (so copies are truly asynchronous) and 4 KiB
// aligned otherwise. Thread-compatible per slot: the ring protocol gives each slot one owner at a
// time.
class BatchMemory {
 public:
  // device < 0: host memory only. kUnavailable when a device is asked for and CUDA is not built
  // or has no such device; kResourceExhausted when an allocation fails.
  static Result<std::unique_ptr<BatchMemory>> Create(int slots, size_t bytes, int device);
  ~BatchMemory();
  BatchMemory(const BatchMemory&) = delete;
  BatchMemory& operator=(const BatchMemory&) = delete;

  int slots() const { return slots_; }
  size_t bytes() const { return bytes_; }
  bool on_device() const { return device_ >= 0; }
  bool pinned() const { return on_device(); }
  std::byte* host(int slot) const;
  void* device(int slot) const;  // nullptr without a device

  // Blocks until the slot's last copy has read its host buffer (no-op without a device), so the
  // buffer may be refilled.
  Status WaitHostReusable(int slot);
  // Issues the copy of the slot's first `bytes` bytes to its device buffer on the copy stream,
  // after the consumer's `consumed` event, and records `copied`. No-op without a device.
  Status CopyToDevice(int slot, size_t bytes);
  // The cudaEvent_t (as void*) a consumer waits on before reading device(slot); nullptr without
  // a device.
  void* copied_event(int slot) const;
  // Timing cudaEvent_t's (as void*) recorded on the copy stream just before and just after the
  // slot's last copy: where the copy ran on the device's clock (a timeline's evidence that copies
  // overlap compute). {nullptr, nullptr} without a device.
  std::pair<void*, void*> copy_timing_events(int slot) const;
  // Records `consumed` on the consumer's cudaStream_t (nullptr: the legacy default stream): the
  // next copy into this slot waits for the work queued there so far.
  Status MarkConsumed(int slot, void* stream);

 private:
  BatchMemory() = default;
  struct Cuda;
  int slots_ = 0;
  size_t bytes_ = 0;
  int device_ = -1;
  std::unique_ptr<std::byte*[]> host_;
  std::unique_ptr<Cuda> cuda_;
};

}  // namespace stoke::prefetch
