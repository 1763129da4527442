// What this process may use of the machine: how much memory it can still take (what the kernel
// says is available, capped by the memory limit of its cgroup, v1 or v2, when it has one), and on
// how many cores it may run.
#pragma once

#include <cstdint>
#include <string>

namespace stoke {

// Bytes a new allocation (or page cache this process causes) can take without pushing the
// machine or the process's cgroup past what it can reclaim cheaply: min(MemAvailable, the
// cgroup's room). 0 when nothing can be read.
uint64_t AvailableMemoryBytes();

// The room a cgroup leaves, from its v1 memory controller folder `v1` or its v2 folder `v2` ("" for
// none): its limit less its usage, the inactive page cache (memory.stat's inactive_file) not
// counted as used, as MemAvailable does not count it; UINT64_MAX when it has no limit.
uint64_t CgroupRoomBytes(const std::string& v1, const std::string& v2);

// The memory limit of the process's cgroup in bytes; 0 when there is none (or it is unlimited).
uint64_t CgroupMemoryLimitBytes();

// The machine's physical memory in bytes, capped by the cgroup's limit; 0 when unknown. What no
// allocation of this process can exceed, however much is free.
uint64_t PhysicalMemoryBytes();

// The cores this process may run on: its CPU affinity mask (taskset, a container's cpuset, a
// launcher's binding of ranks to cores), not every core of the machine; at least 1. What a thread
// count of 0 ("every core") means.
int UsableCores();

// A configured thread count: `threads` when positive, else UsableCores() (0 means "every core").
int ThreadsOrCores(int threads);

}  // namespace stoke
