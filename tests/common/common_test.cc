// Tests for common/: Status/Result, CRC-32C, deterministic random numbers, JSON nesting,
// progress lines.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/crc32c.h"
#include "common/file_util.h"
#include "common/json_util.h"
#include "common/progress.h"
#include "common/random.h"
#include "common/status.h"
#include "common/sys_memory.h"
#include "tests/testing/test_util.h"

namespace stoke {
namespace {

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgumentError("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  STOKE_ASSIGN_OR_RETURN(int h, Half(x));
  STOKE_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

TEST(Status, OkAndErrors) {
  EXPECT_TRUE(OkStatus().ok());
  Status s = CorruptError("record 3: bad magic");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_EQ(s.ToString(), "corrupt: record 3: bad magic");
  EXPECT_EQ(s.Prepend("dataset: /d").message(), "dataset: /d: record 3: bad magic");
  EXPECT_TRUE(OkStatus().Prepend("x").ok());
}

TEST(Result, PropagatesErrors) {
  ASSERT_OK_AND_ASSIGN(int q, Quarter(12));
  EXPECT_EQ(q, 3);
  auto r = Quarter(6);  // 6 -> 3 -> odd
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

// Bitwise reference CRC-32C, independent of the implementation's table and SSE4.2 paths.
uint32_t ReferenceCrc32c(const std::vector<std::byte>& data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (std::byte b : data) {
    crc ^= static_cast<uint8_t>(b);
    for (int k = 0; k < 8; ++k) crc = (crc & 1) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  return ~crc;
}

TEST(Crc32c, KnownVector) {
  const char* text = "123456789";
  auto bytes = std::as_bytes(std::span(text, 9));
  EXPECT_EQ(Crc32c(bytes), 0xE3069283u);  // the standard check value of CRC-32C
  EXPECT_EQ(Crc32c({}), 0u);
}

TEST(Crc32c, MatchesReferenceAtEveryLengthAndAlignment) {
  std::vector<std::byte> data(300);
  SplitMix64 rng(7);
  for (auto& b : data) b = static_cast<std::byte>(rng.Next());
  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t len = 0; len + offset <= data.size(); len += 13) {
      std::vector<std::byte> piece(data.begin() + offset, data.begin() + offset + len);
      ASSERT_EQ(Crc32c(std::span(data).subspan(offset, len)), ReferenceCrc32c(piece))
          << "offset " << offset << " len " << len;
    }
  }
}

TEST(Crc32c, Continues) {
  std::vector<std::byte> data(100, std::byte{0x5A});
  uint32_t whole = Crc32c(data);
  uint32_t part = Crc32c(std::span(data).first(37));
  EXPECT_EQ(Crc32c(std::span(data).subspan(37), part), whole);
}

TEST(Random, SameSeedSameSequence) {
  SplitMix64 a(123), b(123), c(124);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    uint64_t x = a.Next();
    EXPECT_EQ(x, b.Next());
    differs |= x != c.Next();
  }
  EXPECT_TRUE(differs);
}

TEST(Random, FixedValues) {
  // Pins the generator: a change here would silently change every shuffle order on disk.
  SplitMix64 g(0);
  EXPECT_EQ(g.Next(), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(g.Next(), 0x6E789E6AA1B965F4ull);
}

TEST(Random, BelowIsInRangeAndCoversIt) {
  SplitMix64 g(99);
  std::set<uint64_t> seen;
  for (int i = 0; i < 10000; ++i) {
    uint64_t v = g.Below(7);
    ASSERT_LT(v, 7u);
    seen.insert(v);
  }
  EXPECT_EQ(seen.size(), 7u);
}

TEST(Random, ShuffleIsAPermutation) {
  for (uint64_t seed : {1ull, 2ull, 3ull}) {
    SCOPED_TRACE(seed);
    std::vector<int> v(1000);
    std::iota(v.begin(), v.end(), 0);
    SplitMix64 g(seed);
    Shuffle(std::span(v), g);
    std::vector<int> sorted = v;
    std::sort(sorted.begin(), sorted.end());
    for (int i = 0; i < 1000; ++i) ASSERT_EQ(sorted[i], i);
    int fixed = 0;
    for (int i = 0; i < 1000; ++i) fixed += v[i] == i;
    EXPECT_LT(fixed, 20);  // a uniform permutation fixes ~1 point
  }
}

TEST(Random, MixSeedSeparatesNeighbours) {
  EXPECT_NE(MixSeed(1, 0), MixSeed(1, 1));
  EXPECT_NE(MixSeed(1, 0), MixSeed(0, 1));
  EXPECT_NE(MixSeed(1, 2, 3), MixSeed(1, 2, 4));
  EXPECT_EQ(MixSeed(5, 6, 7), MixSeed(5, 6, 7));
}

TEST(JsonUtil, NestingDepthCountsStructureNotStrings) {
  EXPECT_EQ(NestingDepth(""), 0);
  EXPECT_EQ(NestingDepth("3"), 0);
  EXPECT_EQ(NestingDepth(R"({"a": [1, {"b": []}], "c": {}})"), 4);
  // Brackets inside strings, and escaped quotes and backslashes, are not structure.
  EXPECT_EQ(NestingDepth(R"(["[[[", "\"{{{", "\\", [[]]])"), 3);
  EXPECT_EQ(NestingDepth(std::string(100000, '[') + std::string(100000, ']')), 100000);
}

TEST(Progress, FormatsRateAndEta) {
  std::string line = ProgressReporter::FormatLine("pack", 500, 1000, 2.0);
  EXPECT_EQ(line, "pack: 500/1000 | 250.0/s | ETA 2.0s");
  EXPECT_EQ(ProgressReporter::FormatLine("pack", 1000, 1000, 4.0), "pack: 1000/1000 | 250.0/s | 4.0s");
}

TEST(Progress, PlainLinesWhenNotATerminal) {
  testing::TempDir dir;
  std::FILE* f = std::fopen((dir / "log").c_str(), "w+");
  ASSERT_NE(f, nullptr);
  {
    ProgressReporter p("verify", 10, f, /*plain_interval_s=*/0.0);
    for (int i = 0; i < 10; ++i) p.Advance();
  }
  std::fflush(f);
  std::rewind(f);
  char buf[4096] = {};
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  std::string text(buf, n);
  EXPECT_EQ(text.find('\r'), std::string::npos);
  EXPECT_NE(text.find("verify: 10/10"), std::string::npos) << text;
}

TEST(FileUtil, ReadAndAtomicWrite) {
  testing::TempDir dir;
  auto missing = ReadFileBytes(dir / "nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope"), std::string::npos);
  ASSERT_OK(WriteFileAtomic(dir / "a.txt", std::string("hello")));
  ASSERT_OK_AND_ASSIGN(auto bytes, ReadFileBytes(dir / "a.txt"));
  EXPECT_EQ(bytes.size(), 5u);
  auto is_dir = ReadFileBytes(dir.path());
  EXPECT_EQ(is_dir.status().code(), StatusCode::kIoError);
  // A FIFO with no writer is refused at once, not waited on.
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  auto fifo = ReadFileBytes(dir / "fifo");
  EXPECT_EQ(fifo.status().code(), StatusCode::kIoError);
  EXPECT_NE(fifo.status().message().find("not a regular file"), std::string::npos);
  EXPECT_EQ(HumanBytes(1500), "1.5 KB");
}

// An atomic write never puts a plain file where a FIFO, a device or a folder was (`stoke export -o`
// onto a FIFO replaced it with the model, and as root `-o /dev/null` would have replaced the node);
// a symbolic link is followed, so it keeps pointing at the file, which holds the new bytes.
// Read to the end, not to the size stat gives: /proc's files say 0 bytes (they read as empty).
TEST(FileUtil, ReadFileBytesReadsAFileWhoseSizeReadsZero) {
  auto status = ReadFileBytes("/proc/self/status");
  ASSERT_OK(status.status());
  const std::string text(reinterpret_cast<const char*>(status->data()), status->size());
  EXPECT_NE(text.find("Name:"), std::string::npos) << text.size() << " bytes";
  EXPECT_EQ(ReadFileBytes("/proc/self/status", 10).status().code(), StatusCode::kResourceExhausted);
}

TEST(FileUtil, AtomicWriteRefusesWhatIsNotAFileAndFollowsALink) {
  testing::TempDir dir;
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  Status fifo = WriteFileAtomic(dir / "fifo", std::string("model"));
  EXPECT_EQ(fifo.code(), StatusCode::kInvalidArgument) << fifo.ToString();
  EXPECT_NE(fifo.message().find("a FIFO"), std::string::npos) << fifo.ToString();
  EXPECT_TRUE(std::filesystem::is_fifo(dir / "fifo"));
  std::filesystem::create_directory(dir / "folder");
  EXPECT_EQ(WriteFileAtomic(dir / "folder", std::string("model")).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::filesystem::is_directory(dir / "folder"));
  // Through a link (relative, and a link to a link) to an existing file, and to one not there yet.
  ASSERT_OK(WriteFileAtomic(dir / "target.txt", std::string("old")));
  std::filesystem::create_symlink("target.txt", dir / "link");
  std::filesystem::create_symlink(dir / "link", dir / "link2");
  ASSERT_OK(WriteFileAtomic(dir / "link2", std::string("new!")));
  EXPECT_TRUE(std::filesystem::is_symlink(dir / "link2"));
  EXPECT_TRUE(std::filesystem::is_symlink(dir / "link"));
  ASSERT_OK_AND_ASSIGN(auto bytes, ReadFileBytes(dir / "target.txt"));
  EXPECT_EQ(bytes.size(), 4u);
  std::filesystem::create_symlink("later.txt", dir / "dangling");
  ASSERT_OK(WriteFileAtomic(dir / "dangling", std::string("x")));
  EXPECT_TRUE(std::filesystem::is_regular_file(dir / "later.txt"));
  EXPECT_TRUE(std::filesystem::is_symlink(dir / "dangling"));
  std::filesystem::create_symlink("fifo", dir / "to-fifo");
  EXPECT_EQ(WriteFileAtomic(dir / "to-fifo", std::string("x")).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::filesystem::is_fifo(dir / "fifo"));
  // /dev/stdout (through /proc/self/fd/1) onto a file this process has open: a rename would leave
  // the descriptor on the old file, and what is printed next would be lost. Refused, unchanged.
  const int fd = ::open((dir / "out.txt").c_str(), O_WRONLY | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  const auto fd_link = std::filesystem::path("/proc/self/fd") / std::to_string(fd);
  std::filesystem::create_symlink(fd_link, dir / "stdout-like");
  for (const auto& through : {fd_link, dir / "stdout-like"}) {
    Status s = WriteFileAtomic(through, std::string("report"));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("names an open descriptor"), std::string::npos) << s.ToString();
  }
  EXPECT_EQ(::write(fd, "x", 1), 1);
  ::close(fd);
  ASSERT_OK_AND_ASSIGN(auto kept, ReadFileBytes(dir / "out.txt"));
  EXPECT_EQ(kept.size(), 1u);
}

TEST(FileUtil, MakeFoldersReturnsWhatItMadeAndRemoveEmptyFoldersKeepsWhatWasWrittenInto) {
  testing::TempDir dir;
  ASSERT_OK_AND_ASSIGN(auto made, MakeFolders(dir / "a" / "b" / "c"));
  ASSERT_EQ(made.size(), 3u);
  EXPECT_EQ(made.front(), (dir / "a").lexically_normal());
  EXPECT_EQ(made.back(), (dir / "a" / "b" / "c").lexically_normal());
  ASSERT_OK_AND_ASSIGN(auto again, MakeFolders(dir / "a" / "b" / "c" / ""));  // all there: none made
  EXPECT_TRUE(again.empty());
  std::ofstream(dir / "a" / "kept.txt") << "x";
  RemoveEmptyFolders(made);
  EXPECT_FALSE(std::filesystem::exists(dir / "a" / "b"));
  EXPECT_TRUE(std::filesystem::exists(dir / "a" / "kept.txt"));
  // A file in the way: an error naming it, and nothing left behind.
  std::ofstream(dir / "file") << "x";
  auto blocked = MakeFolders(dir / "file" / "below");
  ASSERT_FALSE(blocked.ok());
  EXPECT_NE(blocked.status().message().find("cannot make " + (dir / "file" / "below").string()), std::string::npos)
      << blocked.status().ToString();
  auto is_file = MakeFolders(dir / "file");
  ASSERT_FALSE(is_file.ok());
  EXPECT_NE(is_file.status().message().find("something other than a folder"), std::string::npos)
      << is_file.status().ToString();
  auto under_new = MakeFolders(dir / "new" / "file2");
  ASSERT_OK(under_new.status());
  RemoveEmptyFolders(*under_new);
  EXPECT_FALSE(std::filesystem::exists(dir / "new"));
  // A path through a folder it makes and back out, as `mkdir -p` takes it (it was refused).
  ASSERT_OK_AND_ASSIGN(auto through, MakeFolders(dir / "x" / "new" / ".." / "b" / "."));
  EXPECT_EQ(through, (std::vector<std::filesystem::path>{dir / "x", dir / "x" / "new", dir / "x" / "new" / ".." / "b"}));
  EXPECT_TRUE(std::filesystem::is_directory(dir / "x" / "b"));
  RemoveEmptyFolders(through);
  EXPECT_FALSE(std::filesystem::exists(dir / "x"));
}

// An empty TMPDIR is an unset one (std::filesystem::temp_directory_path refused it, and predict
// with it); one that names no folder is an error naming it.
TEST(FileUtil, TemporaryFolderTakesAnEmptyTmpdirAsUnset) {
  testing::TempDir dir;
  const char* was = std::getenv("TMPDIR");
  const std::string saved = was != nullptr ? was : "";
  ::setenv("TMPDIR", "", 1);
  auto empty = TemporaryFolder("x");
  ::setenv("TMPDIR", dir.path().c_str(), 1);
  auto set = TemporaryFolder("x");
  ::setenv("TMPDIR", (dir / "missing").c_str(), 1);
  auto missing = TemporaryFolder("the scratch files");
  if (was != nullptr) {
    ::setenv("TMPDIR", saved.c_str(), 1);
  } else {
    ::unsetenv("TMPDIR");
  }
  ASSERT_OK(empty.status());
  EXPECT_EQ(*empty, std::filesystem::path("/tmp"));
  ASSERT_OK(set.status());
  EXPECT_EQ(*set, dir.path());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("no folder for the scratch files: TMPDIR=" + (dir / "missing").string() +
                                            " is not a folder"),
            std::string::npos)
      << missing.status().ToString();
}

TEST(FileUtil, CheckOutputClearRefusesTheInputsAndAnyDatasetFolder) {
  testing::TempDir dir;
  std::filesystem::create_directories(dir / "in");
  std::ofstream(dir / "config.yaml") << "x";
  const std::filesystem::path files[] = {dir / "config.yaml"}, folders[] = {dir / "in"};
  EXPECT_OK(CheckOutputClear("--out", dir / "out.json", files, folders));
  EXPECT_FALSE(CheckOutputClear("--out", dir / "sub" / ".." / "config.yaml", files, folders).ok());
  EXPECT_FALSE(CheckOutputClear("--out", dir / "in" / "x.json", files, folders).ok());
  // Any LMDB folder, read by the command or not.
  std::filesystem::create_directories(dir / "other.lmdb");
  std::ofstream(dir / "other.lmdb" / "data.mdb") << "records";
  const Status s = CheckOutputClear("--out", dir / "other.lmdb" / "data.mdb", files, folders);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("that is inside the dataset " + (dir / "other.lmdb").string()), std::string::npos)
      << s.ToString();
  EXPECT_FALSE(CheckOutputClear("--out", dir / "other.lmdb" / "new.json", files, folders).ok());
  // Through a link to the dataset's folder, too.
  std::filesystem::create_directory_symlink(dir / "other.lmdb", dir / "link");
  EXPECT_FALSE(CheckOutputClear("--out", dir / "link" / "x.onnx", files, folders).ok());
  EXPECT_OK(CheckOutputClear("--out", dir / "other.lmdb.onnx", files, folders));
}

// "Every core" is the cores this thread may run on (taskset, a cpuset, a rank bound to cores), not
// the machine's: a loader of threads = 0 under `taskset -c 0` started one thread per machine core.
TEST(SysMemory, UsableCoresFollowTheAffinityMask) {
  cpu_set_t all;
  CPU_ZERO(&all);
  ASSERT_EQ(sched_getaffinity(0, sizeof all, &all), 0);
  EXPECT_EQ(UsableCores(), CPU_COUNT(&all));
  int first = 0;
  while (!CPU_ISSET(first, &all)) ++first;
  int inside = 0;
  std::thread([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    ASSERT_EQ(sched_setaffinity(0, sizeof one, &one), 0);
    inside = UsableCores();
  }).join();
  EXPECT_EQ(inside, 1);
}

// A cgroup's room leaves its inactive page cache out of what it uses, as MemAvailable does: a
// dataset read through the page cache had left a 1 GB container "no room".
TEST(SysMemory, ACgroupsRoomDoesNotCountItsInactivePageCache) {
  testing::TempDir dir;
  const auto v1 = dir / "v1", v2 = dir / "v2";
  std::filesystem::create_directories(v1);
  std::filesystem::create_directories(v2);
  std::ofstream(v2 / "memory.max") << "1000000\n";
  std::ofstream(v2 / "memory.current") << "990000\n";
  std::ofstream(v2 / "memory.stat") << "anon 100000\nfile 890000\nactive_file 90000\ninactive_file 800000\n";
  EXPECT_EQ(CgroupRoomBytes("", v2.string()), 1000000u - (990000u - 800000u));
  std::ofstream(v2 / "memory.max") << "max\n";
  EXPECT_EQ(CgroupRoomBytes("", v2.string()), UINT64_MAX);
  std::ofstream(v1 / "memory.limit_in_bytes") << "2000000\n";
  std::ofstream(v1 / "memory.usage_in_bytes") << "2500000\n";  // over the limit, for all it says
  std::ofstream(v1 / "memory.stat") << "cache 5\ntotal_inactive_file 100000\n";
  EXPECT_EQ(CgroupRoomBytes(v1.string(), ""), 0u);
  std::ofstream(v1 / "memory.usage_in_bytes") << "1500000\n";
  EXPECT_EQ(CgroupRoomBytes(v1.string(), ""), 2000000u - 1400000u);
  std::ofstream(v1 / "memory.limit_in_bytes") << "9223372036854771712\n";  // v1's "unlimited"
  EXPECT_EQ(CgroupRoomBytes(v1.string(), v2.string()), UINT64_MAX);
}

// A cgroup's folders come from the mount table, not a guess at /sys/fs/cgroup/<controller>: a
// container that sees the host's cgroup names, a v1 mount of two controllers together, a v2
// hierarchy mounted elsewhere. Each list runs from the process's own folder up to the mount.
TEST(SysMemory, CgroupFoldersComeFromTheMountTable) {
  const std::string host_v1 =
      "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
      "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct\n"
      "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n";
  CgroupFolders f = FindCgroupFolders(host_v1, "9:name=systemd:/\n4:memory:/jobs/17\n1:cpu,cpuacct:/jobs\n0::/\n");
  EXPECT_EQ(f.memory_v1,
            (std::vector<std::string>{"/sys/fs/cgroup/memory/jobs/17", "/sys/fs/cgroup/memory/jobs", "/sys/fs/cgroup/memory"}));
  EXPECT_EQ(f.cpu_v1, (std::vector<std::string>{"/sys/fs/cgroup/cpu,cpuacct/jobs", "/sys/fs/cgroup/cpu,cpuacct"}));
  EXPECT_TRUE(f.v2.empty());  // member of v2's root, but nothing mounts it
  // A container without its own cgroup namespace: the membership names the host's path, the
  // mount's root is that path, and the container's files are at the mount point.
  const std::string container =
      "700 690 0:32 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
      "701 690 0:29 /docker/abc /sys/fs/cgroup/cpu ro,nosuid - cgroup cgroup rw,cpu\n";
  f = FindCgroupFolders(container, "4:memory:/docker/abc\n1:cpu:/docker/abc/inner\n");
  EXPECT_EQ(f.memory_v1, (std::vector<std::string>{"/sys/fs/cgroup/memory"}));
  EXPECT_EQ(f.cpu_v1, (std::vector<std::string>{"/sys/fs/cgroup/cpu/inner", "/sys/fs/cgroup/cpu"}));
  // A path outside the mount's root is what the mount shows: its point.
  f = FindCgroupFolders(container, "4:memory:/elsewhere\n");
  EXPECT_EQ(f.memory_v1, (std::vector<std::string>{"/sys/fs/cgroup/memory"}));
  // v2, mounted with an escaped space in its point.
  f = FindCgroupFolders("40 1 0:26 / /run/my\\040cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n",
                        "0::/user.slice/job-3.scope\n");
  EXPECT_EQ(f.v2, (std::vector<std::string>{"/run/my cgroup/user.slice/job-3.scope", "/run/my cgroup/user.slice",
                                            "/run/my cgroup"}));
  // A cgroup above the namespace's root, and a second mount over the first: what the mount shows.
  f = FindCgroupFolders("40 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
                        "90 40 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                        "0::/../other/job\n");
  EXPECT_EQ(f.v2, (std::vector<std::string>{"/sys/fs/cgroup"}));
  EXPECT_TRUE(FindCgroupFolders("", "").v2.empty());
  EXPECT_TRUE(FindCgroupFolders("garbage\n- -\n", "x\n:::\n").memory_v1.empty());
}

// "Every core" stays within a CPU quota (a container run with --cpus=1.5 may use 2 threads'
// worth), set on the process's own cgroup or any ancestor: a loader of threads = 0 had started
// one thread per core of the machine and spent its quota switching among them.
TEST(SysMemory, UsableCoresStayWithinTheCgroupsCpuQuota) {
  testing::TempDir dir;
  const auto v1 = dir / "v1", v2 = dir / "v2", parent = dir / "v2parent";
  for (const auto& d : {v1, v2, parent}) std::filesystem::create_directories(d);
  std::ofstream(v1 / "cpu.cfs_quota_us") << "-1\n";
  std::ofstream(v1 / "cpu.cfs_period_us") << "100000\n";
  EXPECT_EQ(CgroupCpuQuotaCores(v1.string(), ""), 0.0);
  std::ofstream(v1 / "cpu.cfs_quota_us") << "150000\n";
  EXPECT_DOUBLE_EQ(CgroupCpuQuotaCores(v1.string(), ""), 1.5);
  std::ofstream(v2 / "cpu.max") << "max 100000\n";
  EXPECT_EQ(CgroupCpuQuotaCores("", v2.string()), 0.0);
  std::ofstream(parent / "cpu.max") << "50000 100000\n";
  EXPECT_DOUBLE_EQ(CgroupCpuQuotaCores("", parent.string()), 0.5);
  EXPECT_EQ(CgroupCpuQuotaCores("", (dir / "none").string()), 0.0);

  const int affinity = UsableCoresIn(CgroupFolders{});
  CgroupFolders folders;
  folders.cpu_v1 = {v1.string()};
  EXPECT_EQ(UsableCoresIn(folders), std::min(affinity, 2));  // 1.5 rounds up
  folders.cpu_v1.clear();
  folders.v2 = {v2.string(), parent.string()};  // unlimited itself, half a core above it
  EXPECT_EQ(UsableCoresIn(folders), 1);
  std::ofstream(parent / "cpu.max") << "100000000 100000\n";  // a thousand cores: the mask binds
  EXPECT_EQ(UsableCoresIn(folders), affinity);
}

TEST(SysMemory, AZeroThreadCountMeansEveryUsableCore) {
  EXPECT_EQ(ThreadsOrCores(3), 3);
  EXPECT_EQ(ThreadsOrCores(0), UsableCores());
  EXPECT_EQ(ThreadsOrCores(-1), UsableCores());
}

// Processes sharing a machine (ranks of one job) divide its cores; one the launcher bound to cores
// of its own, fewer than the machine's, keeps them.
TEST(SysMemory, ProcessesSharingAMachineShareItsCores) {
  EXPECT_EQ(CoreShare(1), UsableCores());
  EXPECT_EQ(CoreShare(0), UsableCores());
  const long online = ::sysconf(_SC_NPROCESSORS_ONLN);
  const bool whole_machine = AffinityCores() == online && CpuQuotaCores() == 0;
  for (int n = 2; n <= 5; ++n) {
    EXPECT_GE(CoreShare(n), 1) << n;
    EXPECT_LE(CoreShare(n), UsableCores()) << n;
    if (whole_machine) {
      EXPECT_EQ(CoreShare(n), std::max<int>(1, static_cast<int>(online) / n)) << n;
    }
  }
  if (!whole_machine || online < 3) GTEST_SKIP() << "a binding to 2 of 3 or more cores is checked on a machine of them";
  cpu_set_t all;
  CPU_ZERO(&all);
  ASSERT_EQ(sched_getaffinity(0, sizeof all, &all), 0);
  int bound = -1;
  std::thread([&] {
    cpu_set_t two;
    CPU_ZERO(&two);
    for (int cpu = 0, taken = 0; taken < 2; ++cpu) {
      if (!CPU_ISSET(cpu, &all)) continue;
      CPU_SET(cpu, &two);
      ++taken;
    }
    ASSERT_EQ(sched_setaffinity(0, sizeof two, &two), 0);
    bound = CoreShare(static_cast<int>(online));  // one process per core, this one bound to two
  }).join();
  EXPECT_EQ(bound, 2);
}

TEST(FileUtil, PathWithinComparesAPathItCannotResolveAsWritten) {
  testing::TempDir dir;
  std::filesystem::create_directories(dir / "src" / "a");
  EXPECT_TRUE(PathWithin(dir / "src" / "a", dir / "src"));
  EXPECT_TRUE(PathWithin(dir / "src" / "b" / ".." / "a", dir / "src/"));
  EXPECT_FALSE(PathWithin(dir / "src", dir / "src" / "a"));
  // A loop of links, and a name past the file system's limit, resolve to nothing: that held
  // every path ("the output holds the source: replacing it would delete the images").
  std::filesystem::create_symlink("loop", dir / "loop");
  EXPECT_FALSE(PathWithin(dir / "src", dir / "loop" / "out.lmdb"));
  EXPECT_TRUE(PathWithin(dir / "loop" / "out.lmdb", dir / "loop"));
  const std::string long_name(300, 'n');
  EXPECT_FALSE(PathWithin(dir / "src", dir / long_name));
}

TEST(FileUtil, CheckFileWritableSaysWhyBeforeTheWrite) {
  testing::TempDir dir;
  EXPECT_OK(CheckFileWritable("--out", dir / "new.json"));
  std::ofstream(dir / "old.json") << "x";
  EXPECT_OK(CheckFileWritable("--out", dir / "old.json"));
  Status s = CheckFileWritable("--out", dir / "missing" / "r.json");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("--out " + (dir / "missing" / "r.json").string() + ": no folder"), std::string::npos)
      << s.ToString();
  s = CheckFileWritable("--out", dir.path());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--out " + dir.path().string() + ": exists and is not a regular file (a folder)"),
            std::string::npos)
      << s.ToString();
  // A link is followed: into a missing folder is refused, to a file is fine.
  std::filesystem::create_symlink(dir / "gone" / "x.json", dir / "dangling");
  EXPECT_EQ(CheckFileWritable("--out", dir / "dangling").code(), StatusCode::kNotFound);
  std::filesystem::create_symlink(dir / "old.json", dir / "to_old");
  EXPECT_OK(CheckFileWritable("--out", dir / "to_old"));
}

TEST(FileUtil, FileLockIsExclusiveNamesItsOwnerAndGoesAwayOnRelease) {
  testing::TempDir dir;
  const auto path = dir / "out.lock";
  {
    ASSERT_OK_AND_ASSIGN(FileLock held, FileLock::TryAcquire(path, "pack: out"));
    ASSERT_TRUE(std::filesystem::exists(path));
    // Another process cannot take it, and is told who holds it.
    const std::string holder = std::to_string(::getpid());
    const pid_t child = ::fork();
    if (child == 0) {
      auto other = FileLock::TryAcquire(path, "pack: out");
      ::_exit(!other.ok() && other.status().message().find("pack: out: another process (pid " + holder + ") holds " +
                                                           path.string()) != std::string::npos
                  ? 0
                  : 1);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    // A second open file description in this process cannot take it either, and is not told to
    // wait for "another process" that is itself (a pack started from a pack's progress callback).
    auto second = FileLock::TryAcquire(path, "pack: out");
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(second.status().message().find("pack: out: this process (pid " + holder + ") already holds " +
                                             path.string()),
              std::string::npos) << second.status().ToString();
    FileLock moved = std::move(held);  // the lock moves with the object
    EXPECT_FALSE(FileLock::TryAcquire(path, "pack: out").ok());
  }
  EXPECT_FALSE(std::filesystem::exists(path));  // removed on release
  ASSERT_OK_AND_ASSIGN(FileLock again, FileLock::TryAcquire(path, "pack: out"));
  auto missing_dir = FileLock::TryAcquire(dir / "no" / "such.lock", "pack: x");
  EXPECT_EQ(missing_dir.status().code(), StatusCode::kNotFound);
}

// A lock whose file was removed while held (by hand, by a cleaner) no longer unlinks the file by
// name on release: that file is the lock another holder took since, and removing it let a third in.
TEST(FileUtil, AReleasedLockRemovesOnlyItsOwnFile) {
  testing::TempDir dir;
  const auto path = dir / "x.lock";
  std::optional<FileLock> a(std::in_place, std::move(FileLock::TryAcquire(path, "train: a")).value());
  std::filesystem::remove(path);
  ASSERT_OK_AND_ASSIGN(FileLock b, FileLock::TryAcquire(path, "train: b"));
  a.reset();
  EXPECT_TRUE(std::filesystem::exists(path)) << "a's release removed b's lock file";
  auto c = FileLock::TryAcquire(path, "train: c");
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << "b still holds it";
}

// The temporary an atomic write goes through is a new file: a link planted under its name (a
// shared folder) is not followed, and a file replaced keeps its permission bits.
TEST(FileUtil, AtomicWriteNeverWritesThroughItsTemporarysNameAndKeepsTheMode) {
  testing::TempDir dir;
  const auto out = dir / "out.json";
  const auto victim = dir / "victim";
  std::ofstream(victim) << "keep";
  std::filesystem::create_symlink(victim, AtomicWriteTemporary(out));
  ASSERT_OK(WriteFileAtomic(out, std::string("PAYLOAD")));
  std::ifstream v(victim);
  std::string kept((std::istreambuf_iterator<char>(v)), std::istreambuf_iterator<char>());
  EXPECT_EQ(kept, "keep");
  EXPECT_FALSE(std::filesystem::is_symlink(out));
  std::filesystem::permissions(out, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  ASSERT_OK(WriteFileAtomic(out, std::string("again")));
  EXPECT_EQ(std::filesystem::status(out).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
}

// A lock file this process may only read (another user's, left by a killed pack) still locks.
// Root may write any file, so as root the check runs in a child that becomes user nobody and finds
// root's lock file (mode 0644) in a folder it may not write.
TEST(FileUtil, FileLockTakesAReadOnlyLeftoverFile) {
  testing::TempDir dir;
  const auto path = dir / "left.lock";
  testing::WriteBytes(path, {});
  auto check = [&]() -> int {
    auto held = FileLock::TryAcquire(path, "pack: left");
    if (!held.ok()) return 10;
    if (FileLock::TryAcquire(path, "pack: left").status().code() != StatusCode::kUnavailable) return 11;
    return 0;
  };
  if (::geteuid() != 0) {
    std::filesystem::permissions(path, std::filesystem::perms::owner_read);
    EXPECT_EQ(check(), 0);
    return;
  }
  namespace fs = std::filesystem;
  fs::permissions(dir.path(), fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                  fs::perms::others_read | fs::perms::others_exec);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(20);
    if (::access(path.c_str(), R_OK) != 0) ::_exit(30);  // TMPDIR is where nobody cannot go
    if (::access(path.c_str(), W_OK) == 0) ::_exit(21);  // the case would not be read-only
    ::_exit(check());
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 30) GTEST_SKIP() << "user nobody cannot reach " << dir.path() << " (TMPDIR)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "10: not taken, 11: not exclusive, 20: setuid, 21: writable";
  EXPECT_TRUE(fs::exists(path));  // nobody could not remove root's file; the next pack takes it over
}

}  // namespace
}  // namespace stoke
