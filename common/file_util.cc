#include "common/file_util.h"

#include <fcntl.h>
#include <sys/file.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string_view>
#include <utility>

#include <fmt/format.h>

namespace stoke {
namespace {

Status ErrnoStatus(int err, const std::filesystem::path& path, const char* what) {
  std::string m = fmt::format("{}: {}: {}", path.string(), what, std::strerror(err));
  if (err == ENOENT) return NotFoundError(std::move(m));
  return IoError(std::move(m));
}

// Closes an fd on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

Result<std::vector<std::byte>> ReadFileBytes(const std::filesystem::path& path,
                                             size_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; it is refused below
  // as not a regular file (and has no effect on a regular file's reads).
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoStatus(errno, path, "open");
  FdCloser closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, path, "stat");
  if (!S_ISREG(st.st_mode)) return IoError(path.string() + ": not a regular file");
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return ResourceExhaustedError(
        fmt::format("{}: {} bytes, over the {}-byte limit", path.string(), st.st_size, max_bytes));
  }
  // Read to the end, not to st_size: a file that grew meanwhile, or one of /proc or /sys (their
  // size reads 0), is read whole, up to the limit.
  // (One byte more than its size: the read that finds the end needs room to be tried.)
  std::vector<std::byte> data(std::max<size_t>(static_cast<size_t>(st.st_size) + 1, 4096));
  size_t got = 0;
  while (true) {
    if (got == data.size()) {
      if (data.size() > max_bytes) {
        return ResourceExhaustedError(fmt::format("{}: over the {}-byte limit", path.string(), max_bytes));
      }
      data.resize(data.size() * 2);
    }
    ssize_t n = ::read(fd, data.data() + got, data.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, path, "read");
    }
    if (n == 0) break;  // the end (also of a file that shrank while being read)
    got += static_cast<size_t>(n);
  }
  if (got > max_bytes) return ResourceExhaustedError(fmt::format("{}: over the {}-byte limit", path.string(), max_bytes));
  data.resize(got);
  return data;
}

namespace {
constexpr std::string_view kTemporaryInfix = ".tmp.";  // <target>.tmp.<pid>

// The file a write to `path` replaces: the target of a symbolic link (followed as the shell's `>`
// would, so a link keeps pointing at the new file), `path` itself otherwise. A FIFO, a device or a
// folder there is refused: renaming over it would put a plain file in its place (the device node
// gone), and writing into it is not what an atomic file write means.
Result<std::filesystem::path> WriteTarget(const std::filesystem::path& path) {
  std::filesystem::path target = path;
  for (int hops = 0;; ++hops) {
    struct stat st {};
    if (::lstat(target.c_str(), &st) != 0) {
      if (errno == ENOENT) return target;  // a new file (or a dangling link's target)
      return ErrnoStatus(errno, target, "stat");
    }
    if (S_ISREG(st.st_mode)) return target;
    if (!S_ISLNK(st.st_mode)) {
      return InvalidArgumentError(fmt::format("{}: exists and is not a regular file ({}); name a file to write",
                                              target.string(),
                                              S_ISDIR(st.st_mode)    ? "a folder"
                                              : S_ISFIFO(st.st_mode) ? "a FIFO"
                                              : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                                                                                           : "a socket or other"));
    }
    if (hops == 40) return ErrnoStatus(ELOOP, path, "follow");
    // /dev/stdout and the like lead to /proc/self/fd/N: a descriptor this process has open. A
    // file there replaced by a rename keeps the descriptor on the old one (what is printed after
    // it is lost); a pipe's link names no file at all ("pipe:[N]").
    const std::string hop = target.lexically_normal().string();
    if (hop.starts_with("/proc/") || hop.starts_with("/dev/fd/")) {
      return InvalidArgumentError(fmt::format(
          "{}: names an open descriptor ({}), such as standard output, which a file cannot be written over; "
          "give a file name",
          path.string(), hop));
    }
    std::error_code ec;
    std::filesystem::path next = std::filesystem::read_symlink(target, ec);
    if (ec) return ErrnoStatus(ec.value(), target, "read the link");
    target = next.is_absolute() ? next : target.parent_path() / next;
  }
}

// The temporary beside a write target already resolved by WriteTarget.
std::filesystem::path TemporaryFor(const std::filesystem::path& target) {
  std::filesystem::path tmp = target;
  tmp += fmt::format("{}{}", kTemporaryInfix, ::getpid());
  return tmp;
}
}  // namespace

std::filesystem::path AtomicWriteTemporary(const std::filesystem::path& path) {
  auto target = WriteTarget(path);
  return TemporaryFor(target.ok() ? *target : path);
}

void RemoveStaleAtomicTemporaries(const std::filesystem::path& dir,
                                  const std::function<bool(const std::string& target)>& is_target) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const auto at = name.rfind(kTemporaryInfix);
    if (at == std::string::npos || !is_target(name.substr(0, at))) continue;
    const std::string digits = name.substr(at + kTemporaryInfix.size());
    if (digits.empty() || digits.size() > 10 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const long long pid = std::stoll(digits);
    if (pid > 0 && pid <= INT_MAX && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      std::error_code gone;
      std::filesystem::remove(entry.path(), gone);
    }
  }
}

void RemoveStaleAtomicTemporariesOf(const std::filesystem::path& file) {
  auto target = WriteTarget(file);
  if (!target.ok()) return;
  const std::string name = target->filename().string();
  RemoveStaleAtomicTemporaries(target->has_parent_path() ? target->parent_path() : std::filesystem::path("."),
                               [&](const std::string& t) { return t == name; });
}

Status WriteFileAtomic(const std::filesystem::path& named, std::span<const std::byte> data) {
  STOKE_ASSIGN_OR_RETURN(const std::filesystem::path path, WriteTarget(named));
  const std::filesystem::path tmp = TemporaryFor(path);
  // A fresh file, never one already there under the temporary's name: a link planted there (in a
  // shared folder) was followed, and the write went into the file it named.
  ::unlink(tmp.c_str());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, path, "create");  // the file asked for, not the temporary one
  // A file replaced keeps its permission bits (a 0600 file became 0644).
  if (struct stat before {}; ::stat(path.c_str(), &before) == 0 && S_ISREG(before.st_mode)) {
    (void)::fchmod(fd, before.st_mode & 07777);
  }
  size_t put = 0;
  while (put < data.size()) {
    ssize_t n = ::write(fd, data.data() + put, data.size() - put);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return ErrnoStatus(err, tmp, "write");
    }
    put += static_cast<size_t>(n);
  }
  const int synced = ::fsync(fd) == 0 ? 0 : errno;
  const int closed = ::close(fd) == 0 ? 0 : errno;  // closed even when the sync failed
  if (synced != 0 || closed != 0) {
    ::unlink(tmp.c_str());
    return ErrnoStatus(synced != 0 ? synced : closed, tmp, "sync");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoStatus(err, path, "rename");
  }
  // The rename itself is durable only once the directory that holds the name is synced.
  return SyncDirectory(path.has_parent_path() ? path.parent_path() : std::filesystem::path("."));
}

Status SyncDirectory(const std::filesystem::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, dir, "open the directory");
  const int synced = ::fsync(fd) == 0 ? 0 : errno;
  ::close(fd);
  // Some file systems cannot sync a directory (EINVAL): their renames are as durable as they get.
  if (synced != 0 && synced != EINVAL) return ErrnoStatus(synced, dir, "sync the directory");
  return OkStatus();
}

Status WriteFileAtomic(const std::filesystem::path& path, const std::string& text) {
  return WriteFileAtomic(path, std::as_bytes(std::span(text.data(), text.size())));
}

std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (bytes >= 1000 && u < 4) {
    bytes /= 1000;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} {}", bytes, units[u]) : fmt::format("{:.1f} {}", bytes, units[u]);
}

namespace {
// The lock files this process holds, by device and inode, with the pid that took each (a child
// made by fork() inherits the list, not the locks' ownership): a lock refused because this process
// holds it says so. (The pid written in the file cannot tell: a process in another container on a
// shared folder, or on another host, may have this one's pid.) Never destroyed: a thread still
// packing while the process exits releases its lock after the static destructors ran.
std::mutex held_mu;
std::map<std::pair<dev_t, ino_t>, pid_t>& HeldLocks() {
  static auto* held = new std::map<std::pair<dev_t, ino_t>, pid_t>;
  return *held;
}
void HoldHere(const struct stat& st, bool held) {
  std::lock_guard lock(held_mu);
  if (held) {
    HeldLocks()[{st.st_dev, st.st_ino}] = ::getpid();
  } else {
    HeldLocks().erase({st.st_dev, st.st_ino});
  }
}
bool HeldHere(const struct stat& st) {
  std::lock_guard lock(held_mu);
  const auto it = HeldLocks().find({st.st_dev, st.st_ino});
  return it != HeldLocks().end() && it->second == ::getpid();
}
}  // namespace

Result<FileLock> FileLock::TryAcquire(const std::filesystem::path& path, const std::string& what) {
  // The owner removes the file on release while still holding the lock, so a process that opened
  // the old file and then got its lock holds a lock on a name nobody sees: it checks that the
  // locked file is still the one at `path`, and tries again when it is not.
  for (int attempt = 0; attempt < 100; ++attempt) {
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    const int open_error = errno;
    // A lock file another user left (a killed process's): flock needs only a read descriptor.
    const bool read_only = fd < 0 && (open_error == EACCES || open_error == EPERM || open_error == EROFS);
    if (read_only) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return ErrnoStatus(open_error, path, "open lock file");
    FdCloser closer{fd};
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err != EWOULDBLOCK) return ErrnoStatus(err, path, "lock");
      char buf[32] = {};
      const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
      std::string owner = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
      while (!owner.empty() && (owner.back() == '\n' || owner.back() == ' ')) owner.pop_back();
      struct stat busy {};
      if (::fstat(fd, &busy) == 0 && HeldHere(busy)) {
        // Waiting for it would wait for ourselves: a second job into the same output started by this
        // program (from a progress callback of the first, or another thread).
        return UnavailableError(fmt::format(
            "{}: this process (pid {}) already holds {}: another job of it is writing there (started from a "
            "progress callback or another thread?); wait for that one to return",
            what, ::getpid(), path.string()));
      }
      return UnavailableError(fmt::format("{}: another process{} holds {} (wait for it to finish, or stop it)",
                                                 what, owner.empty() ? "" : " (pid " + owner + ")", path.string()));
    }
    struct stat locked {}, named {};
    if (::fstat(fd, &locked) != 0) return ErrnoStatus(errno, path, "stat lock file");
    if (::stat(path.c_str(), &named) != 0 || named.st_ino != locked.st_ino || named.st_dev != locked.st_dev) {
      continue;  // released and removed between our open and our lock
    }
    const std::string pid = fmt::format("{}\n", ::getpid());
    if (!read_only &&
        (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size()))) {
      return ErrnoStatus(errno, path, "write lock file");
    }
    closer.fd = -1;
    HoldHere(locked, true);
    return FileLock(path, fd);
  }
  return UnavailableError(fmt::format("{}: {} keeps being replaced by other processes", what, path.string()));
}

FileLock::~FileLock() {
  if (fd_ < 0) return;
  // While still locked (see TryAcquire), and only the file this lock holds: when it was removed
  // meanwhile and another process made and locked a new one, unlinking that let a third in.
  struct stat held {}, named {};
  const bool known = ::fstat(fd_, &held) == 0;
  if (known && ::stat(path_.c_str(), &named) == 0 && held.st_ino == named.st_ino && held.st_dev == named.st_dev) {
    ::unlink(path_.c_str());
  }
  if (known) HoldHere(held, false);
  ::close(fd_);
}

Status CheckFileWritable(std::string_view flag, const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  auto target = WriteTarget(path);
  // (Its messages begin with the path refused: the one given, or where its link leads.)
  if (!target.ok()) return Status(target.status().code(), fmt::format("{} {}", flag, target.status().message()));
  const fs::path folder = target->has_parent_path() ? target->parent_path() : fs::path(".");
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) {
    return NotFoundError(fmt::format("{} {}: no folder {} to write it in", flag, path.string(), folder.string()));
  }
  if (::access(folder.c_str(), W_OK) != 0) {
    return IoError(fmt::format("{} {}: cannot write in {}: {}", flag, path.string(), folder.string(),
                               std::strerror(errno)));
  }
  return OkStatus();
}

Result<std::vector<std::filesystem::path>> MakeFolders(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  // Each folder of the path as written, outermost first, as `mkdir -p` walks it: "a/new/../b"
  // makes a/new, then a/b (a path normalised first made only a/b, and then a/new/.. did not exist).
  std::vector<fs::path> made;
  fs::path p;
  for (const fs::path& part : dir) {
    p /= part;
    if (part.empty() || part == "." || part == ".." || p == p.root_path()) continue;
    if (fs::exists(fs::symlink_status(p, ec))) continue;
    const bool created = fs::create_directory(p, ec);
    if (ec) {
      RemoveEmptyFolders(made);
      return IoError(fmt::format("cannot make {}: {}", p.string(), ec.message()));
    }
    // As walked ("a/new/../b"): removed the way it was made, through whatever links it passed.
    if (created) made.push_back(p);  // (not one another process made meanwhile)
  }
  if (!fs::is_directory(dir, ec)) {
    RemoveEmptyFolders(made);
    return IoError(fmt::format("cannot make {}: something other than a folder is there", dir.string()));
  }
  return made;
}

void RemoveEmptyFolders(std::span<const std::filesystem::path> made) {
  for (auto it = made.rbegin(); it != made.rend(); ++it) {
    std::error_code ec;
    std::filesystem::remove(*it, ec);  // a folder with anything in it stays (ENOTEMPTY)
  }
}

Result<std::filesystem::path> TemporaryFolder(std::string_view what) {
  const char* env = std::getenv("TMPDIR");
  const bool from_env = env != nullptr && env[0] != '\0';
  const std::filesystem::path dir = from_env ? env : "/tmp";
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return IoError(fmt::format("no folder for {}: {}{} is not a folder (set TMPDIR to a writable folder)", what,
                               from_env ? "TMPDIR=" : "", dir.string()));
  }
  return dir;
}

bool PathWithin(const std::filesystem::path& inner, const std::filesystem::path& outer) {
  namespace fs = std::filesystem;
  // A path that cannot be resolved (a loop of links, a name too long) is compared as written: an
  // empty one would have held everything.
  auto resolved = [](const fs::path& p) {
    std::error_code ec;
    fs::path absolute = fs::absolute(p, ec);
    if (ec) absolute = p;
    fs::path canonical = fs::weakly_canonical(absolute, ec);
    return ec ? absolute.lexically_normal() : canonical;
  };
  const fs::path a = resolved(inner);
  const fs::path b = resolved(outer);
  if (b.empty()) return false;
  auto ai = a.begin();
  for (auto bi = b.begin(); bi != b.end(); ++bi) {
    if (bi->empty()) continue;  // a trailing separator
    if (ai == a.end() || *ai != *bi) return false;
    ++ai;
  }
  return true;
}

Status CheckOutputClear(std::string_view flag, const std::filesystem::path& output,
                        std::span<const std::filesystem::path> files,
                        std::span<const std::filesystem::path> folders) {
  namespace fs = std::filesystem;
  if (output.empty()) return OkStatus();
  for (const fs::path& f : files) {
    std::error_code ec, ec2;
    if (f.empty()) continue;
    // The same file by any name, or (neither written yet) the same path.
    const bool same = fs::exists(output, ec) ? fs::equivalent(output, f, ec)
                                             : fs::weakly_canonical(output, ec) == fs::weakly_canonical(f, ec2) && !ec && !ec2;
    if (same) {
      return InvalidArgumentError(fmt::format("{} {}: that is {}, which this command reads or writes; give another path",
                                              flag, output.string(), f.string()));
    }
  }
  for (const fs::path& d : folders) {
    if (!d.empty() && PathWithin(output, d)) {
      return InvalidArgumentError(fmt::format(
          "{} {}: that is inside {}, which this command reads or writes; give a path outside it", flag,
          output.string(), d.string()));
    }
  }
  // Nor into another dataset's folder (an LMDB environment: data.mdb there): `export -o
  // other.lmdb/data.mdb` replaced that dataset's records with an ONNX file.
  std::error_code ec;
  const fs::path where = fs::weakly_canonical(fs::absolute(output, ec), ec).parent_path();
  if (!ec && fs::exists(where / "data.mdb", ec)) {
    return InvalidArgumentError(fmt::format(
        "{} {}: that is inside the dataset {} (an LMDB folder: its data.mdb is there), whose files it would "
        "replace or mix with; give a path outside it",
        flag, output.string(), where.string()));
  }
  return OkStatus();
}

}  // namespace stoke
