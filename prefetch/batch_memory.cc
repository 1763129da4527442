#include "prefetch/batch_memory.h"

#include <cstdlib>
#include <vector>

#include <fmt/format.h>

#if STOKE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace stoke::prefetch {
namespace {

constexpr size_t kAlign = 4096;

size_t RoundUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Page-aligned host buffers for a ring without a device.
Status AllocateAligned(std::byte** host, int slots, size_t bytes) {
  for (int i = 0; i < slots; ++i) {
    host[i] = static_cast<std::byte*>(std::aligned_alloc(kAlign, RoundUp(bytes)));
    if (host[i] == nullptr) {
      return ResourceExhaustedError(fmt::format("batch memory: cannot allocate {} bytes", bytes));
    }
  }
  return OkStatus();
}

}  // namespace

#if STOKE_WITH_CUDA

namespace {

Status CudaError(cudaError_t rc, const char* what) {
  return UnavailableError(fmt::format("CUDA: {}: {} ({})", what, cudaGetErrorString(rc),
                                      cudaGetErrorName(rc)));
}

}  // namespace

#define STOKE_CUDA_RETURN(call)                            \
  do {                                                     \
    cudaError_t stoke_rc_ = (call);                        \
    if (stoke_rc_ != cudaSuccess) return CudaError(stoke_rc_, #call); \
  } while (0)

struct BatchMemory::Cuda {
  cudaStream_t stream = nullptr;
  std::vector<void*> device;
  std::vector<cudaEvent_t> copied;
  std::vector<cudaEvent_t> consumed;
  std::vector<cudaEvent_t> copy_begin, copy_end;  // timing events around each slot's copy
};

CudaProbe ProbeCuda() {
  CudaProbe p;
  p.built = true;
  int n = 0;
  cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    p.reason = fmt::format("no usable GPU: {}", cudaGetErrorString(rc));
    (void)cudaGetLastError();  // clear the sticky-free error state
    return p;
  }
  p.devices = n;
  if (n == 0) p.reason = "no GPU present";
  return p;
}

Result<std::unique_ptr<BatchMemory>> BatchMemory::Create(int slots, size_t bytes, int device) {
  if (slots <= 0 || bytes == 0) return InvalidArgumentError("batch memory: empty ring");
  std::unique_ptr<BatchMemory> m(new BatchMemory());
  m->slots_ = slots;
  m->bytes_ = bytes;
  m->host_ = std::make_unique<std::byte*[]>(static_cast<size_t>(slots));
  if (device >= 0) {
    CudaProbe probe = ProbeCuda();
    if (device >= probe.devices) {
      return UnavailableError(fmt::format("CUDA device {} requested: {}", device,
                                          probe.devices == 0 ? probe.reason
                                                             : fmt::format("only {} present", probe.devices)));
    }
    m->device_ = device;
    m->cuda_ = std::make_unique<Cuda>();
    STOKE_CUDA_RETURN(cudaSetDevice(device));
    STOKE_CUDA_RETURN(cudaStreamCreateWithFlags(&m->cuda_->stream, cudaStreamNonBlocking));
    for (int i = 0; i < slots; ++i) {
      void* h = nullptr;
      STOKE_CUDA_RETURN(cudaHostAlloc(&h, RoundUp(bytes), cudaHostAllocDefault));
      m->host_[i] = static_cast<std::byte*>(h);
      void* d = nullptr;
      STOKE_CUDA_RETURN(cudaMalloc(&d, RoundUp(bytes)));
      m->cuda_->device.push_back(d);
      cudaEvent_t copied = nullptr, consumed = nullptr;
      // A worker refilling the slot waits on `copied` (WaitHostReusable), which waits for the consumer:
      // it sleeps rather than spinning a core the other workers decode on.
      STOKE_CUDA_RETURN(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming | cudaEventBlockingSync));
      m->cuda_->copied.push_back(copied);
      STOKE_CUDA_RETURN(cudaEventCreateWithFlags(&consumed, cudaEventDisableTiming));
      m->cuda_->consumed.push_back(consumed);
      cudaEvent_t begin = nullptr, end = nullptr;
      STOKE_CUDA_RETURN(cudaEventCreate(&begin));
      m->cuda_->copy_begin.push_back(begin);
      STOKE_CUDA_RETURN(cudaEventCreate(&end));
      m->cuda_->copy_end.push_back(end);
    }
    return m;
  }
  STOKE_RETURN_IF_ERROR(AllocateAligned(m->host_.get(), slots, bytes));
  return m;
}

BatchMemory::~BatchMemory() {
  if (host_ == nullptr) return;
  if (cuda_ != nullptr) {
    int current = -1;  // the destroying thread (a framework's, from a deleter) keeps its device
    const bool restore = cudaGetDevice(&current) == cudaSuccess;
    cudaSetDevice(device_);
    if (cuda_->stream != nullptr) cudaStreamSynchronize(cuda_->stream);
    // The consumers' work on the last batches (their streams, recorded by MarkConsumed) ends before
    // the device buffers go; an event never recorded returns at once.
    for (auto e : cuda_->consumed) cudaEventSynchronize(e);
    for (auto e : cuda_->copied) cudaEventDestroy(e);
    for (auto e : cuda_->consumed) cudaEventDestroy(e);
    for (auto e : cuda_->copy_begin) cudaEventDestroy(e);
    for (auto e : cuda_->copy_end) cudaEventDestroy(e);
    for (void* d : cuda_->device) cudaFree(d);
    for (int i = 0; i < slots_; ++i) {
      if (host_[i] != nullptr) cudaFreeHost(host_[i]);
    }
    if (cuda_->stream != nullptr) cudaStreamDestroy(cuda_->stream);
    if (restore) cudaSetDevice(current);
    return;
  }
  for (int i = 0; i < slots_; ++i) std::free(host_[i]);
}

void* BatchMemory::device(int slot) const {
  return cuda_ == nullptr ? nullptr : cuda_->device[static_cast<size_t>(slot)];
}

Status BatchMemory::WaitHostReusable(int slot) {
  if (cuda_ == nullptr) return OkStatus();
  STOKE_CUDA_RETURN(cudaEventSynchronize(cuda_->copied[static_cast<size_t>(slot)]));
  return OkStatus();
}

Status BatchMemory::CopyToDevice(int slot, size_t bytes) {
  if (cuda_ == nullptr) return OkStatus();
  const auto i = static_cast<size_t>(slot);
  STOKE_CUDA_RETURN(cudaSetDevice(device_));  // the calling worker thread may be new to CUDA
  STOKE_CUDA_RETURN(cudaStreamWaitEvent(cuda_->stream, cuda_->consumed[i], 0));
  STOKE_CUDA_RETURN(cudaEventRecord(cuda_->copy_begin[i], cuda_->stream));
  STOKE_CUDA_RETURN(cudaMemcpyAsync(cuda_->device[i], host_[i], bytes, cudaMemcpyHostToDevice,
                                    cuda_->stream));
  STOKE_CUDA_RETURN(cudaEventRecord(cuda_->copy_end[i], cuda_->stream));
  STOKE_CUDA_RETURN(cudaEventRecord(cuda_->copied[i], cuda_->stream));
  return OkStatus();
}

void* BatchMemory::copied_event(int slot) const {
  return cuda_ == nullptr ? nullptr : static_cast<void*>(cuda_->copied[static_cast<size_t>(slot)]);
}

std::pair<void*, void*> BatchMemory::copy_timing_events(int slot) const {
  if (cuda_ == nullptr) return {nullptr, nullptr};
  const auto i = static_cast<size_t>(slot);
  return {static_cast<void*>(cuda_->copy_begin[i]), static_cast<void*>(cuda_->copy_end[i])};
}

Status BatchMemory::MarkConsumed(int slot, void* stream) {
  if (cuda_ == nullptr) return OkStatus();
  // The consumer's thread (a framework's, when a tensor's deleter returns the slot) keeps its
  // current device.
  int current = -1;
  STOKE_CUDA_RETURN(cudaGetDevice(&current));
  STOKE_CUDA_RETURN(cudaSetDevice(device_));
  const cudaError_t rc = cudaEventRecord(cuda_->consumed[static_cast<size_t>(slot)], static_cast<cudaStream_t>(stream));
  // Without the event, the slot's next copy would wait on its previous one and could overwrite a
  // batch the consumer is still reading: wait for the consumer's stream here instead.
  const cudaError_t synced = rc == cudaSuccess ? cudaSuccess : cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  STOKE_CUDA_RETURN(cudaSetDevice(current));
  if (rc == cudaSuccess) return OkStatus();
  return CudaError(synced != cudaSuccess ? synced : rc,
                   synced != cudaSuccess ? "waiting for the consumer's stream (its event could not be recorded)"
                                         : "recording the slot's consumed event");
}

#else  // !STOKE_WITH_CUDA

struct BatchMemory::Cuda {};

CudaProbe ProbeCuda() { return {false, 0, "stoke was built without CUDA"}; }

Result<std::unique_ptr<BatchMemory>> BatchMemory::Create(int slots, size_t bytes, int device) {
  if (slots <= 0 || bytes == 0) return InvalidArgumentError("batch memory: empty ring");
  if (device >= 0) {
    return UnavailableError(fmt::format("CUDA device {} requested: {}", device, ProbeCuda().reason));
  }
  std::unique_ptr<BatchMemory> m(new BatchMemory());
  m->slots_ = slots;
  m->bytes_ = bytes;
  m->host_ = std::make_unique<std::byte*[]>(static_cast<size_t>(slots));
  STOKE_RETURN_IF_ERROR(AllocateAligned(m->host_.get(), slots, bytes));
  return m;
}

BatchMemory::~BatchMemory() {
  if (host_ == nullptr) return;
  for (int i = 0; i < slots_; ++i) std::free(host_[i]);
}

void* BatchMemory::device(int) const { return nullptr; }
Status BatchMemory::WaitHostReusable(int) { return OkStatus(); }
Status BatchMemory::CopyToDevice(int, size_t) { return OkStatus(); }
void* BatchMemory::copied_event(int) const { return nullptr; }
std::pair<void*, void*> BatchMemory::copy_timing_events(int) const { return {nullptr, nullptr}; }
Status BatchMemory::MarkConsumed(int, void*) { return OkStatus(); }

#endif

std::byte* BatchMemory::host(int slot) const { return host_[static_cast<size_t>(slot)]; }

}  // namespace stoke::prefetch
