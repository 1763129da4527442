#include "tests/testing/test_util.h"

#include <sys/resource.h>
#include <turbojpeg.h>
#include <unistd.h>

#include <csignal>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "common/file_util.h"

namespace stoke::testing {
namespace fs = std::filesystem;

TempDir::TempDir() {
  Result<fs::path> tmp = TemporaryFolder("the test's scratch folder");
  if (!tmp.ok()) {
    std::fprintf(stderr, "%s\n", tmp.status().ToString().c_str());
    std::abort();
  }
  std::string tmpl = (*tmp / "stoke-test-XXXXXX").string();
  char* made = ::mkdtemp(tmpl.data());
  if (made == nullptr) {
    std::perror(("mkdtemp " + tmpl).c_str());
    std::abort();
  }
  path_ = made;
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

Image MakeImage(int width, int height, int channels, uint32_t seed) {
  Image img;
  img.Reshape(width, height, channels);
  for (int y = 0; y < height; ++y) {
    uint8_t* row = img.row(y);
    for (int x = 0; x < width; ++x) {
      for (int c = 0; c < channels; ++c) {
        // Smooth in x and y, different per channel, shifted by the seed.
        int v = (x * 255 / std::max(1, width - 1)) * (c == 0) +
                (y * 255 / std::max(1, height - 1)) * (c == 1) +
                ((x + y) * 255 / std::max(1, width + height - 2)) * (c == 2) +
                static_cast<int>(seed * 37 % 64);
        if (channels == 1) v = (x * 160 / std::max(1, width - 1)) + (y * 64 / std::max(1, height - 1)) + static_cast<int>(seed % 32);
        row[x * channels + c] = static_cast<uint8_t>(std::min(255, v));
      }
    }
  }
  return img;
}

std::vector<std::byte> EncodeJpeg(const Image& image, int quality, bool progressive,
                                  bool subsampling_444) {
  tjhandle h = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  int subsamp = image.channels == 1 ? TJSAMP_GRAY : (subsampling_444 ? TJSAMP_444 : TJSAMP_420);
  int flags = progressive ? TJFLAG_PROGRESSIVE : 0;
  int rc = tjCompress2(h, image.pixels.data(), image.width, 0, image.height,
                       image.channels == 1 ? TJPF_GRAY : TJPF_RGB, &buf, &size, subsamp, quality,
                       flags);
  if (rc != 0) std::abort();
  std::vector<std::byte> out(size);
  std::memcpy(out.data(), buf, size);
  tjFree(buf);
  tjDestroy(h);
  return out;
}

std::vector<std::byte> WithExifOrientation(const std::vector<std::byte>& jpeg, int orientation,
                                           bool little_endian) {
  auto b = [](int v) { return static_cast<std::byte>(v & 0xFF); };
  auto put16 = [&](std::vector<std::byte>& v, int x) {
    if (little_endian) {
      v.push_back(b(x));
      v.push_back(b(x >> 8));
    } else {
      v.push_back(b(x >> 8));
      v.push_back(b(x));
    }
  };
  auto put32 = [&](std::vector<std::byte>& v, uint32_t x) {
    for (int i = 0; i < 4; ++i) v.push_back(b(static_cast<int>(x >> (little_endian ? 8 * i : 24 - 8 * i))));
  };
  std::vector<std::byte> tiff;
  tiff.push_back(b(little_endian ? 'I' : 'M'));
  tiff.push_back(b(little_endian ? 'I' : 'M'));
  put16(tiff, 42);
  put32(tiff, 8);      // IFD0 offset
  put16(tiff, 1);      // one entry
  put16(tiff, 0x0112); // orientation
  put16(tiff, 3);      // SHORT
  put32(tiff, 1);      // count
  put16(tiff, orientation);
  put16(tiff, 0);      // padding of the 4-byte value field
  put32(tiff, 0);      // no next IFD
  std::vector<std::byte> app1 = {b('E'), b('x'), b('i'), b('f'), b(0), b(0)};
  app1.insert(app1.end(), tiff.begin(), tiff.end());
  const int len = static_cast<int>(app1.size()) + 2;
  std::vector<std::byte> out = {jpeg[0], jpeg[1], b(0xFF), b(0xE1), b(len >> 8), b(len)};
  out.insert(out.end(), app1.begin(), app1.end());
  out.insert(out.end(), jpeg.begin() + 2, jpeg.end());
  return out;
}

void WriteBytes(const fs::path& path, const std::vector<std::byte>& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::vector<std::byte> ReadBytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(data.size());
  if (!data.empty()) std::memcpy(out.data(), data.data(), data.size());
  return out;
}

size_t ZeroRecordsLeafPage(const fs::path& data_mdb, size_t nth) {
  std::vector<std::byte> bytes = ReadBytes(data_mdb);
  constexpr size_t kPage = 4096;
  auto u16 = [&](size_t at) { return static_cast<size_t>(bytes[at]) | static_cast<size_t>(bytes[at + 1]) << 8; };
  // LMDB's page: page number (8 bytes), pad (2), flags (2: 0x02 a leaf), lower, upper; then the
  // node offsets. A leaf node: value size (4 bytes, as two halves), flags (2), key size (2), key.
  size_t seen = 0;
  for (size_t page = 2; (page + 1) * kPage <= bytes.size(); ++page) {
    const size_t at = page * kPage;
    if (u16(at + 10) != 0x02 || u16(at + 12) < 18) continue;
    const size_t nodes = (u16(at + 12) - 16) / 2, node = at + u16(at + 16);
    if (node + 8 > at + kPage) continue;
    const size_t value_size = u16(node) | u16(node + 2) << 16;
    if (u16(node + 6) != 8 || value_size < 64 || seen++ != nth) continue;
    std::fill(bytes.begin() + static_cast<std::ptrdiff_t>(at), bytes.begin() + static_cast<std::ptrdiff_t>(at + kPage),
              std::byte{0});
    WriteBytes(data_mdb, bytes);
    return nodes;
  }
  return 0;
}

std::vector<fs::path> MakeImageTree(const fs::path& root, const std::vector<std::string>& classes,
                                    int per_class) {
  std::vector<fs::path> paths;
  uint32_t seed = 0;
  for (const auto& c : classes) {
    for (int i = 0; i < per_class; ++i) {
      Image img = MakeImage(24 + 8 * (i % 5), 16 + 8 * (i % 3), (i % 7 == 6) ? 1 : 3, seed++);
      fs::path p = root / c / (c + "_" + std::to_string(100 + i) + ".jpg");
      WriteBytes(p, EncodeJpeg(img));
      paths.push_back(p);
    }
  }
  std::sort(paths.begin(), paths.end());
  return paths;
}

double MeanAbsDiff(const Image& a, const Image& b) {
  if (a.pixels.size() != b.pixels.size() || a.pixels.empty()) return 1e9;
  double sum = 0;
  for (size_t i = 0; i < a.pixels.size(); ++i) sum += std::abs(int{a.pixels[i]} - int{b.pixels[i]});
  return sum / static_cast<double>(a.pixels.size());
}

std::vector<fs::path> FilesUnder(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::optional<fs::path> SharedDataDir() {
  if (const char* env = std::getenv("STOKE_TEST_DATA"); env != nullptr && *env) {
    if (fs::is_directory(env)) return fs::path(env);
    return std::nullopt;
  }
  fs::path p = fs::path(STOKE_SOURCE_DIR) / ".." / "shared" / "data";
  if (fs::is_directory(p / "imagenet_like")) return p.lexically_normal();
  return std::nullopt;
}

fs::path StokeBinary() { return fs::path(STOKE_BINARY_DIR) / "bin" / "stoke"; }

FileSizeLimit::FileSizeLimit(uint64_t bytes) {
  rlimit r{};
  getrlimit(RLIMIT_FSIZE, &r);
  old_soft_ = r.rlim_cur;
  old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
  r.rlim_cur = bytes;
  setrlimit(RLIMIT_FSIZE, &r);
}

FileSizeLimit::~FileSizeLimit() {
  rlimit r{};
  getrlimit(RLIMIT_FSIZE, &r);
  r.rlim_cur = old_soft_;
  setrlimit(RLIMIT_FSIZE, &r);
  std::signal(SIGXFSZ, old_handler_);
}

}  // namespace stoke::testing
