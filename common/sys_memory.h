// How much memory this process can still use: what the kernel says is available, capped by the
// memory limit of the process's cgroup (v1 or v2) when it has one.
#pragma once

#include <cstdint>

namespace stoke {

// Bytes a new allocation (or page cache this process causes) can take without pushing the
// machine or the process's cgroup into reclaim: min(MemAvailable, cgroup limit - cgroup usage).
// 0 when nothing can be read.
uint64_t AvailableMemoryBytes();

// The memory limit of the process's cgroup in bytes; 0 when there is none (or it is unlimited).
uint64_t CgroupMemoryLimitBytes();

// The machine's physical memory in bytes, capped by the cgroup's limit; 0 when unknown. What no
// allocation of this process can exceed, however much is free.
uint64_t PhysicalMemoryBytes();

}  // namespace stoke
