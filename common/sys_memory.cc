#include "common/sys_memory.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>

namespace stoke {
namespace {

// The first number in `path`, or 0.
uint64_t ReadNumber(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return 0;
  try {
    return std::stoull(text);
  } catch (...) {
    return 0;
  }
}

// The cgroup directories of this process: v1 memory controller and v2 unified ("" if absent).
void CgroupDirs(std::string* v1, std::string* v2) {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    // "ID:CONTROLLERS:PATH"
    const auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    std::stringstream list(controllers);
    std::string c;
    while (std::getline(list, c, ',')) {
      if (c == "memory") *v1 = "/sys/fs/cgroup/memory" + path;
    }
    if (controllers.empty()) *v2 = "/sys/fs/cgroup" + path;
  }
}

// The value of `key` in a cgroup's memory.stat ("inactive_file 123"), or 0.
uint64_t ReadStat(const std::string& path, std::string_view key) {
  std::ifstream in(path);
  std::string name;
  uint64_t value = 0;
  while (in >> name >> value) {
    if (name == key) return value;
  }
  return 0;
}

// A v1 "unlimited" limit is a huge page-aligned number.
constexpr uint64_t kUnlimited = uint64_t{1} << 60;

// The machine's RAM as sysconf reports it, or 0.
uint64_t MachineMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
}

}  // namespace

uint64_t CgroupMemoryLimitBytes() {
  std::string v1, v2;
  CgroupDirs(&v1, &v2);
  if (!v1.empty()) {
    const uint64_t limit = ReadNumber(v1 + "/memory.limit_in_bytes");
    if (limit > 0 && limit < kUnlimited) return limit;
  }
  if (!v2.empty()) {
    const uint64_t limit = ReadNumber(v2 + "/memory.max");
    if (limit > 0 && limit < kUnlimited) return limit;
  }
  return 0;
}

uint64_t PhysicalMemoryBytes() {
  uint64_t physical = MachineMemoryBytes();
  if (const uint64_t limit = CgroupMemoryLimitBytes(); limit > 0 && (physical == 0 || limit < physical)) {
    physical = limit;
  }
  return physical;
}

uint64_t AvailableMemoryBytes() {
  uint64_t available = 0;
  {
    std::ifstream in("/proc/meminfo");
    std::string key, unit;
    uint64_t kib = 0;
    while (in >> key >> kib >> unit) {
      if (key == "MemAvailable:") {
        available = kib * 1024;
        break;
      }
    }
  }
  if (available == 0) available = MachineMemoryBytes();
  std::string v1, v2;
  CgroupDirs(&v1, &v2);
  const uint64_t room = CgroupRoomBytes(v1, v2);
  if (room != UINT64_MAX) available = available > 0 ? std::min(available, room) : room;
  return available;
}

uint64_t CgroupRoomBytes(const std::string& v1, const std::string& v2) {
  uint64_t limit = 0, usage = 0, cache = 0;
  if (!v1.empty()) {
    limit = ReadNumber(v1 + "/memory.limit_in_bytes");
    usage = ReadNumber(v1 + "/memory.usage_in_bytes");
    cache = ReadStat(v1 + "/memory.stat", "total_inactive_file");
  }
  if ((limit == 0 || limit >= kUnlimited) && !v2.empty()) {
    limit = ReadNumber(v2 + "/memory.max");
    usage = ReadNumber(v2 + "/memory.current");
    cache = ReadStat(v2 + "/memory.stat", "inactive_file");
  }
  if (limit == 0 || limit >= kUnlimited) return UINT64_MAX;
  // Inactive page cache is reclaimed before anything else, as MemAvailable counts it: a dataset
  // read through the page cache left the room at 0 and refused what would have fit.
  const uint64_t used = usage > cache ? usage - cache : 0;
  return limit > used ? limit - used : 0;
}

int UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

int ThreadsOrCores(int threads) { return threads > 0 ? threads : UsableCores(); }

}  // namespace stoke
