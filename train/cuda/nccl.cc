#include "train/cuda/nccl.h"

#include <dlfcn.h>

#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

namespace stoke::train::cuda {

Status Nccl::Check(ncclResult_t r, std::string_view what) const {
  if (r == ncclSuccess) return OkStatus();
  return UnavailableError(fmt::format("NCCL {}: {} ({})", what, GetErrorString(r), static_cast<int>(r)));
}

namespace {

Result<Nccl> Load() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("STOKE_NCCL_LIBRARY"); env != nullptr && *env != '\0') candidates.emplace_back(env);
  candidates.emplace_back("libnccl.so.2");
  candidates.emplace_back("libnccl.so");
  std::string tried;
  for (const std::string& name : candidates) {
    void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      tried += fmt::format("{}{}: {}", tried.empty() ? "" : "; ", name, dlerror());
      continue;
    }
    Nccl n{};
    bool ok = true;
    auto sym = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, symbol));
      ok = ok && fn != nullptr;
    };
    sym(n.GetVersion, "ncclGetVersion");
    sym(n.GetUniqueId, "ncclGetUniqueId");
    sym(n.CommInitRank, "ncclCommInitRank");
    sym(n.CommDestroy, "ncclCommDestroy");
    sym(n.CommAbort, "ncclCommAbort");
    sym(n.CommGetAsyncError, "ncclCommGetAsyncError");
    sym(n.AllReduce, "ncclAllReduce");
    sym(n.GroupStart, "ncclGroupStart");
    sym(n.GroupEnd, "ncclGroupEnd");
    sym(n.GetErrorString, "ncclGetErrorString");
    if (!ok) {
      tried += fmt::format("{}{}: not NCCL (symbols missing)", tried.empty() ? "" : "; ", name);
      dlclose(h);
      continue;
    }
    n.GetVersion(&n.version);
    if (n.version < 21000) {  // ncclAvg
      tried += fmt::format("{}{}: NCCL {} is older than 2.10", tried.empty() ? "" : "; ", name, n.version);
      dlclose(h);
      continue;
    }
    n.path = name;
    return n;  // kept loaded for the life of the process
  }
  return UnavailableError(fmt::format(
      "NCCL could not be loaded ({}); set STOKE_NCCL_LIBRARY to libnccl.so.2 (CUDA's, or PyTorch's nvidia/nccl/lib)",
      tried));
}

}  // namespace

Result<const Nccl*> LoadNccl() {
  static const Result<Nccl> loaded = Load();
  if (!loaded.ok()) return loaded.status();
  return &*loaded;
}

}  // namespace stoke::train::cuda
