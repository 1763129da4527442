// NCCL, loaded at run time (dlopen) rather than linked: the library is ~200 MiB, most machines
// that run stoke never need it, and the GPU machines that do carry their own copy (CUDA's, or
// PyTorch's nvidia-nccl wheel). Where it is searched: $STOKE_NCCL_LIBRARY, then libnccl.so.2 on
// the loader's path. CUDA sources only.
#pragma once

#include <nccl.h>

#include <string>

#include "common/status.h"

namespace stoke::train::cuda {

struct Nccl {
  decltype(&ncclGetVersion) GetVersion;
  decltype(&ncclGetUniqueId) GetUniqueId;
  decltype(&ncclCommInitRank) CommInitRank;
  decltype(&ncclCommDestroy) CommDestroy;
  decltype(&ncclCommAbort) CommAbort;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&ncclAllReduce) AllReduce;
  decltype(&ncclGroupStart) GroupStart;
  decltype(&ncclGroupEnd) GroupEnd;
  decltype(&ncclGetErrorString) GetErrorString;
  int version = 0;
  std::string path;

  Status Check(ncclResult_t r, std::string_view what) const;
};

// The library, loaded once (thread-safe); kUnavailable saying where it looked.
Result<const Nccl*> LoadNccl();

}  // namespace stoke::train::cuda
