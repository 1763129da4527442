// Small file-system helpers with Status errors that name the path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace stoke {

// Reads a whole file. kNotFound if missing, kIoError if unreadable or a directory,
// kResourceExhausted if larger than `max_bytes`.
Result<std::vector<std::byte>> ReadFileBytes(const std::filesystem::path& path,
                                             size_t max_bytes = SIZE_MAX);

// Writes `data` to `path` atomically: a temporary file in the same directory, fsync, rename,
// fsync of the directory. Readers see the old file or the new one, never a half-written one, and
// after a crash or power loss the new one stays once this returned OK. A symbolic link at `path` is
// followed (its target is the file replaced); a folder, FIFO, device or socket there is refused
// (kInvalidArgument), never replaced by a file.
Status WriteFileAtomic(const std::filesystem::path& path, std::span<const std::byte> data);
// The temporary file WriteFileAtomic writes `path` through in this process (removed on failure; a
// signal handler may remove it too).
std::filesystem::path AtomicWriteTemporary(const std::filesystem::path& path);
// Removes the temporary files that WriteFileAtomic left in `dir` for names accepted by `is_target`
// (the file being written, e.g. "step-*.ckpt") when the process that wrote them is gone (killed
// mid-write); a live writer's are kept. Best effort: errors are ignored.
void RemoveStaleAtomicTemporaries(const std::filesystem::path& dir,
                                  const std::function<bool(const std::string& target)>& is_target);
// The same for one file: its own stale temporaries, in its folder (a command whose earlier run
// was killed while writing `file`, before it writes it again).
void RemoveStaleAtomicTemporariesOf(const std::filesystem::path& file);
Status WriteFileAtomic(const std::filesystem::path& path, const std::string& text);

// Whether `inner` is `outer` or lies below it, component by component, after resolving both as far
// as they exist (symlinks, "..", a trailing separator).
bool PathWithin(const std::filesystem::path& inner, const std::filesystem::path& outer);

// kInvalidArgument when writing `output` (what the flag `flag` names) would overwrite what the
// command reads or writes besides: the same file as one of `files` (by any name), or a path at or
// below one of `folders` (a dataset, an image folder), or a path in any LMDB dataset's folder (a
// data.mdb beside it). Empty paths in either list are ignored.
Status CheckOutputClear(std::string_view flag, const std::filesystem::path& output,
                        std::span<const std::filesystem::path> files,
                        std::span<const std::filesystem::path> folders);

// Whether WriteFileAtomic(path) could write there, checked before a long run whose result goes
// there: kNotFound when its folder is missing, kIoError when that folder is not writable,
// kInvalidArgument when a folder, FIFO or device is at `path`. Messages begin with "flag path: ".
Status CheckFileWritable(std::string_view flag, const std::filesystem::path& path);

// Makes `dir` and whichever of its parents are missing (as create_directories does) and returns
// the folders it made, outermost first: a command that fails before writing into them takes them
// away again with RemoveEmptyFolders instead of leaving an empty tree behind.
Result<std::vector<std::filesystem::path>> MakeFolders(const std::filesystem::path& dir);
// Removes those of `made` that are still empty, innermost first (best effort: errors are ignored,
// a folder something was written into is kept).
void RemoveEmptyFolders(std::span<const std::filesystem::path> made);

// The folder for scratch files: $TMPDIR when set and not empty (an empty one is unset, as POSIX
// has it), else /tmp. kIoError naming `what` and the folder when it is not one.
Result<std::filesystem::path> TemporaryFolder(std::string_view what);

// fsyncs a directory, so that the names created, renamed or removed in it survive a crash.
Status SyncDirectory(const std::filesystem::path& dir);

// An exclusive advisory lock (flock) held on a lock file for as long as the object lives; the
// file holds the owner's pid and is removed on release. Two processes asking for the same path:
// the second gets kUnavailable naming `what` and the owner's pid, at once (no waiting).
class FileLock {
 public:
  static Result<FileLock> TryAcquire(const std::filesystem::path& path, const std::string& what);
  FileLock(FileLock&& other) noexcept : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}
  FileLock& operator=(FileLock&&) = delete;
  FileLock(const FileLock&) = delete;
  ~FileLock();

 private:
  FileLock(std::filesystem::path path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::filesystem::path path_;
  int fd_ = -1;
};

// "1.5 MB", "312 KB", "17 B" (powers of 1000).
std::string HumanBytes(double bytes);

}  // namespace stoke
