// What this process may use of the machine: how much memory it can still take (what the kernel
// says is available, capped by the memory limit of its cgroup, v1 or v2, when it has one), and on
// how many cores it may run.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace stoke {

// Bytes a new allocation (or page cache this process causes) can take without pushing the
// machine or the process's cgroup past what it can reclaim cheaply: min(MemAvailable, the
// cgroup's room). 0 when nothing can be read.
uint64_t AvailableMemoryBytes();

// The folders of this process's cgroups, each list its own folder first and then every ancestor up
// to the top its mount shows: a limit set on a parent (a Slurm job's, a systemd slice's) binds
// too. Found through the mount table (`mountinfo`, as /proc/self/mountinfo reads) and the
// process's membership (`self_cgroup`, as /proc/self/cgroup reads): a container's mount shows
// its own cgroup at the mount point, whatever path the membership names. Empty lists when absent.
struct CgroupFolders {
  std::vector<std::string> memory_v1;  // v1 memory controller
  std::vector<std::string> cpu_v1;     // v1 cpu controller
  std::vector<std::string> v2;         // the unified hierarchy
};
CgroupFolders FindCgroupFolders(std::string_view mountinfo, std::string_view self_cgroup);

// The room a cgroup leaves, from its v1 memory controller folder `v1` or its v2 folder `v2` ("" for
// none): its limit less its usage, the inactive page cache (memory.stat's inactive_file) not
// counted as used, as MemAvailable does not count it; UINT64_MAX when it has no limit.
uint64_t CgroupRoomBytes(const std::string& v1, const std::string& v2);

// The CPU time a cgroup folder allows, in cores (its quota over its period: 1.5 for
// "150000 100000"), from its v1 cpu controller folder `v1` or its v2 folder `v2` ("" for none); 0
// when it sets no quota.
double CgroupCpuQuotaCores(const std::string& v1, const std::string& v2);

// The memory limit of the process's cgroup in bytes; 0 when there is none (or it is unlimited).
uint64_t CgroupMemoryLimitBytes();

// The machine's physical memory in bytes, capped by the cgroup's limit; 0 when unknown. What no
// allocation of this process can exceed, however much is free.
uint64_t PhysicalMemoryBytes();

// The cores this process may run on: its CPU affinity mask (taskset, a container's cpuset, a
// launcher's binding of ranks to cores), not every core of the machine, and no more than its
// cgroups' CPU quota allows (a container run with --cpus=2, rounded up); at least 1. What a
// thread count of 0 ("every core") means.
int UsableCores();

// UsableCores() for a process in `folders`: its affinity mask capped by the lowest quota of them.
int UsableCoresIn(const CgroupFolders& folders);

// The parts of UsableCores(): the cores of the affinity mask (at least 1); the lowest CPU quota
// of the process's cgroups in cores (0: none), of `folders`' for CpuQuotaCoresIn; and `cores`
// capped by a quota (rounded up; at least 1). Processes sharing a cgroup share its quota.
int AffinityCores();
double CpuQuotaCores();
double CpuQuotaCoresIn(const CgroupFolders& folders);
int CoresWithinQuota(int cores, double quota);

// One process's share of the cores when `processes` processes (ranks of a job) share this machine:
// rather than each starting a team of all of them, they divide them; a process the launcher bound
// to cores of its own (fewer than the machine's) uses those. A cgroup's CPU quota is the whole
// container's: the processes in it share it too. UsableCores() for 1 process; at least 1.
int CoreShare(int processes);

// A configured thread count: `threads` when positive, else UsableCores() (0 means "every core").
int ThreadsOrCores(int threads);

}  // namespace stoke
