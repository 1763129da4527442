#include "common/sys_memory.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
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

// The whole of a small file (a /proc or /sys one), or "".
std::string ReadText(const char* path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// `list` split at `separator`.
std::vector<std::string> Split(std::string_view list, char separator) {
  std::vector<std::string> parts;
  std::stringstream in{std::string(list)};
  std::string part;
  while (std::getline(in, part, separator)) parts.push_back(part);
  return parts;
}

// A mount table field with its octal escapes ("\040" for a space) undone.
std::string Unescape(const std::string& field) {
  std::string out;
  for (size_t i = 0; i < field.size(); ++i) {
    if (field[i] == '\\' && i + 3 < field.size() && std::isdigit(static_cast<unsigned char>(field[i + 1]))) {
      out += static_cast<char>(std::stoi(field.substr(i + 1, 3), nullptr, 8));
      i += 3;
    } else {
      out += field[i];
    }
  }
  return out;
}

// Where a cgroup mount of root `root` at `point` keeps the files of cgroup `path`, and each
// ancestor up to `point`. A path outside the mount's root (a container that sees the host's
// names) is the mount point itself: what the container was given.
std::vector<std::string> FolderAndAncestors(const std::string& root, const std::string& point,
                                            const std::string& path) {
  std::string rel;
  if (path.find("/..") != std::string::npos) {
    // A cgroup above the namespace's root ("/../x"): outside what the mount shows.
  } else if (root == "/") {
    rel = path;
  } else if (path == root || path.rfind(root + "/", 0) == 0) {
    rel = path.substr(root.size());
  }
  std::string base = point;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  std::vector<std::string> names;
  for (const std::string& name : Split(rel, '/')) {
    if (!name.empty()) names.push_back(name);
  }
  std::vector<std::string> folders;
  for (size_t depth = names.size() + 1; depth-- > 0;) {
    std::string folder = base;
    for (size_t i = 0; i < depth; ++i) folder += (folder == "/" ? "" : "/") + names[i];
    folders.push_back(folder);
  }
  return folders;
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

// This process's cgroup folders, from /proc/self.
CgroupFolders OwnCgroupFolders() {
  return FindCgroupFolders(ReadText("/proc/self/mountinfo"), ReadText("/proc/self/cgroup"));
}

}  // namespace

CgroupFolders FindCgroupFolders(std::string_view mountinfo, std::string_view self_cgroup) {
  // Membership lines are "ID:CONTROLLERS:PATH"; v2's has ID 0 and no controllers.
  std::string memory_path, cpu_path, v2_path;
  bool memory_member = false, cpu_member = false, v2_member = false;
  for (const std::string& line : Split(self_cgroup, '\n')) {
    const auto a = line.find(':'), b = line.find(':', a == std::string::npos ? a : a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers.empty()) {
      v2_path = path;
      v2_member = true;
    }
    for (const std::string& c : Split(controllers, ',')) {
      if (c == "memory") memory_path = path, memory_member = true;
      if (c == "cpu") cpu_path = path, cpu_member = true;
    }
  }
  // Mount lines are "ID PARENT MAJ:MIN ROOT POINT OPTIONS [TAGS...] - TYPE SOURCE SUPEROPTIONS";
  // a v1 mount names its controllers among its super options. A later mount of a controller
  // covers an earlier one (a container's over a host's): the last one is what is seen.
  CgroupFolders found;
  for (const std::string& line : Split(mountinfo, '\n')) {
    std::vector<std::string> fields;
    for (const std::string& f : Split(line, ' ')) {
      if (!f.empty()) fields.push_back(f);
    }
    const auto dash = std::find(fields.begin(), fields.end(), "-");
    if (fields.size() < 5 || dash == fields.end() || fields.end() - dash < 2) continue;
    const std::string& type = dash[1];
    const std::string root = Unescape(fields[3]), point = Unescape(fields[4]);
    if (type == "cgroup2" && v2_member) {
      found.v2 = FolderAndAncestors(root, point, v2_path);
    } else if (type == "cgroup" && fields.end() - dash >= 4) {
      for (const std::string& option : Split(dash[3], ',')) {
        if (option == "memory" && memory_member) {
          found.memory_v1 = FolderAndAncestors(root, point, memory_path);
        }
        if (option == "cpu" && cpu_member) {
          found.cpu_v1 = FolderAndAncestors(root, point, cpu_path);
        }
      }
    }
  }
  return found;
}

uint64_t CgroupMemoryLimitBytes() {
  const CgroupFolders folders = OwnCgroupFolders();
  uint64_t lowest = 0;
  const auto take = [&](const std::string& file) {
    const uint64_t limit = ReadNumber(file);
    if (limit > 0 && limit < kUnlimited && (lowest == 0 || limit < lowest)) lowest = limit;
  };
  for (const std::string& f : folders.memory_v1) take(f + "/memory.limit_in_bytes");
  for (const std::string& f : folders.v2) take(f + "/memory.max");
  return lowest;
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
  const CgroupFolders folders = OwnCgroupFolders();
  uint64_t room = UINT64_MAX;
  for (const std::string& f : folders.memory_v1) room = std::min(room, CgroupRoomBytes(f, ""));
  for (const std::string& f : folders.v2) room = std::min(room, CgroupRoomBytes("", f));
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

double CgroupCpuQuotaCores(const std::string& v1, const std::string& v2) {
  long long quota = -1, period = 0;
  if (!v1.empty()) {
    std::ifstream q(v1 + "/cpu.cfs_quota_us"), p(v1 + "/cpu.cfs_period_us");
    if (!(q >> quota) || !(p >> period)) quota = -1;
  } else if (!v2.empty()) {
    // "QUOTA PERIOD", QUOTA "max" when unlimited.
    std::ifstream in(v2 + "/cpu.max");
    std::string q;
    if (in >> q >> period && q != "max") {
      try {
        quota = std::stoll(q);
      } catch (...) {
        quota = -1;
      }
    }
  }
  return quota > 0 && period > 0 ? static_cast<double>(quota) / static_cast<double>(period) : 0.0;
}

int AffinityCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cores = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                               : static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, cores);
}

double CpuQuotaCoresIn(const CgroupFolders& folders) {
  double quota = 0;
  const auto take = [&](double q) {
    if (q > 0 && (quota == 0 || q < quota)) quota = q;
  };
  for (const std::string& f : folders.cpu_v1) take(CgroupCpuQuotaCores(f, ""));
  for (const std::string& f : folders.v2) take(CgroupCpuQuotaCores("", f));
  return quota;
}

double CpuQuotaCores() { return CpuQuotaCoresIn(OwnCgroupFolders()); }

int CoresWithinQuota(int cores, double quota) {
  // A quota of 1.5 cores keeps two threads busy part of the time: rounded up, as a runtime does.
  if (quota > 0) cores = std::min(cores, static_cast<int>(std::ceil(quota - 1e-9)));
  return std::max(1, cores);
}

int UsableCores() { return UsableCoresIn(OwnCgroupFolders()); }

int UsableCoresIn(const CgroupFolders& folders) { return CoresWithinQuota(AffinityCores(), CpuQuotaCoresIn(folders)); }

int CoreShare(int processes) {
  if (processes <= 1) return UsableCores();
  const int affinity = AffinityCores();
  const int share = affinity < ::sysconf(_SC_NPROCESSORS_ONLN) ? affinity : std::max(1, affinity / processes);
  return CoresWithinQuota(share, CpuQuotaCores() / processes);
}

int ThreadsOrCores(int threads) { return threads > 0 ? threads : UsableCores(); }

}  // namespace stoke
