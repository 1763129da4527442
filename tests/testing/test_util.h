// Test helpers: Status assertions, temporary directories, synthetic images and JPEGs, and the
// location of the optional shared corpus.
#pragma once

#include <gtest/gtest.h>
#include <pthread.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/image.h"
#include "common/status.h"

#define STOKE_TEST_CONCAT_INNER(a, b) a##b
#define STOKE_TEST_CONCAT(a, b) STOKE_TEST_CONCAT_INNER(a, b)

#define ASSERT_OK(expr)                                  \
  do {                                                   \
    const ::stoke::Status stoke_s_ = (expr);             \
    ASSERT_TRUE(stoke_s_.ok()) << stoke_s_.ToString();   \
  } while (0)
#define EXPECT_OK(expr)                                  \
  do {                                                   \
    const ::stoke::Status stoke_s_ = (expr);             \
    EXPECT_TRUE(stoke_s_.ok()) << stoke_s_.ToString();   \
  } while (0)
#define ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  ASSERT_OK_AND_ASSIGN_IMPL(STOKE_TEST_CONCAT(stoke_r_, __LINE__), lhs, rexpr)
#define ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, rexpr)           \
  auto tmp = (rexpr);                                        \
  ASSERT_TRUE(tmp.ok()) << tmp.status().ToString();          \
  lhs = std::move(tmp).value()

namespace stoke::testing {

// Whether the calling thread carries the name `name` (pthread_setname_np; stoke names its threads,
// e.g. "stoke-read"). Allocates nothing, so a replaced operator new may call it.
inline bool CurrentThreadIs(const char* name) {
  char current[16] = {};
  return ::pthread_getname_np(::pthread_self(), current, sizeof(current)) == 0 && std::strcmp(current, name) == 0;
}

// A fresh directory under the system temp dir, removed (recursively) on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// A w x h image whose pixels encode their position and a seed, so that crops, flips and
// reorderings are detectable: smooth gradients (JPEG-friendly) plus a per-seed offset.
Image MakeImage(int width, int height, int channels, uint32_t seed = 0);

// JPEG bytes of `image` (TurboJPEG, 4:2:0 for colour unless subsampling_444).
std::vector<std::byte> EncodeJpeg(const Image& image, int quality = 90, bool progressive = false,
                                  bool subsampling_444 = false);

// Inserts an EXIF APP1 segment carrying `orientation` right after the SOI marker.
std::vector<std::byte> WithExifOrientation(const std::vector<std::byte>& jpeg, int orientation,
                                           bool little_endian = true);

void WriteBytes(const std::filesystem::path& path, const std::vector<std::byte>& bytes);
std::vector<std::byte> ReadBytes(const std::filesystem::path& path);

// Zeroes the `nth` leaf page of a dataset's records table in its data.mdb (a bad disk block) and
// returns how many records it held; 0 when the table has fewer leaf pages. A records leaf is told
// from the paths table's by its values' size (a record's, not a path's dozen bytes).
size_t ZeroRecordsLeafPage(const std::filesystem::path& data_mdb, size_t nth);

// Writes root/<class>/<class>_<i>.jpg for each class name, `per_class` images each, with sizes
// varying by index. Returns the written paths in sorted order.
std::vector<std::filesystem::path> MakeImageTree(const std::filesystem::path& root,
                                                 const std::vector<std::string>& classes,
                                                 int per_class);

// Mean absolute difference between two same-shaped images.
double MeanAbsDiff(const Image& a, const Image& b);

// Every regular file under `dir`, recursively, sorted.
std::vector<std::filesystem::path> FilesUnder(const std::filesystem::path& dir);

// The shared corpus (../shared/data, or $STOKE_TEST_DATA), if present.
std::optional<std::filesystem::path> SharedDataDir();

// Path of the built stoke CLI (for end-to-end tests).
std::filesystem::path StokeBinary();

// A full disk, simulated: while alive, this process cannot grow a regular file past `bytes`
// (RLIMIT_FSIZE), and such a write fails with EFBIG instead of raising SIGXFSZ. Restores both.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(uint64_t bytes);
  ~FileSizeLimit();
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  uint64_t old_soft_ = 0;
  void (*old_handler_)(int) = nullptr;
};

}  // namespace stoke::testing

// Skips the current test, visibly, when the shared corpus is absent.
#define STOKE_REQUIRE_SHARED_DATA(var)                                                      \
  auto var##_opt = ::stoke::testing::SharedDataDir();                                       \
  if (!var##_opt) GTEST_SKIP() << "shared corpus not found (../shared/data or $STOKE_TEST_DATA)"; \
  const std::filesystem::path var = *var##_opt
