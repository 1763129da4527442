// Tests for decode/jpeg_transcode: the transcode is lossless (the same pixels at every DCT scale),
// its restart index matches the bytes, a crop decoded from the index is bit-identical to the same
// crop of a full decode at the same scale (every subsampling, odd sizes, grayscale, progressive
// inputs), damage to the index is caught, and on the shared corpus the transcode accepts and
// refuses exactly what validation does and keeps imagenet_like within 3% of its size.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <span>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <jpeglib.h>
#include <turbojpeg.h>

#include "decode/jpeg_decoder.h"
#include "decode/jpeg_transcode.h"
#include "tests/testing/test_util.h"

namespace stoke::decode {
namespace {

// A JPEG of `image` with TurboJPEG's chroma subsampling `subsamp` (TJSAMP_*).
std::vector<std::byte> Encode(const Image& image, int subsamp, bool progressive = false, int quality = 88) {
  tjhandle h = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  const int rc = tjCompress2(h, image.pixels.data(), image.width, 0, image.height,
                             image.channels == 1 ? TJPF_GRAY : TJPF_RGB, &buf, &size,
                             image.channels == 1 ? TJSAMP_GRAY : subsamp, quality, progressive ? TJFLAG_PROGRESSIVE : 0);
  EXPECT_EQ(rc, 0) << tjGetErrorStr2(h);
  std::vector<std::byte> out(reinterpret_cast<std::byte*>(buf), reinterpret_cast<std::byte*>(buf) + size);
  tjFree(buf);
  tjDestroy(h);
  return out;
}

// The index of a transcoded JPEG as DecodeRegion takes it (offsets as little-endian bytes).
struct OwnedIndex {
  std::vector<std::byte> bytes;
  RestartIndex index;
};
// entry_bytes 4: absolute offsets; 2: the first offset, then 16-bit distances.
OwnedIndex IndexOf(const TranscodedJpeg& t, int entry_bytes = 4) {
  OwnedIndex o;
  auto put = [&](uint32_t v, int bytes) {
    for (int b = 0; b < bytes; ++b) o.bytes.push_back(static_cast<std::byte>((v >> (8 * b)) & 0xFF));
  };
  for (size_t i = 0; i < t.offsets.size(); ++i) {
    if (entry_bytes == 4 || i == 0) {
      put(t.offsets[i], 4);
    } else {
      put(t.offsets[i] - t.offsets[i - 1], 2);
    }
  }
  o.index = {t.restart_mcus, t.mcus_per_row, t.mcu_rows, entry_bytes, t.offsets.size(), o.bytes};
  return o;
}

// A JPEG of `image` (3 channels) through libjpeg's own API at quality 85, with `configure` applied
// to the compressor after its defaults.
std::vector<std::byte> EncodeWith(const Image& image, const std::function<void(jpeg_compress_struct&)>& configure) {
  jpeg_compress_struct c{};
  jpeg_error_mgr err{};
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &buf, &size);
  c.image_width = static_cast<JDIMENSION>(image.width);
  c.image_height = static_cast<JDIMENSION>(image.height);
  c.input_components = 3;
  c.in_color_space = JCS_RGB;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, 85, TRUE);
  configure(c);
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) {
    auto* row = const_cast<JSAMPROW>(image.row(static_cast<int>(c.next_scanline)));
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  std::vector<std::byte> out(reinterpret_cast<std::byte*>(buf), reinterpret_cast<std::byte*>(buf) + size);
  std::free(buf);
  return out;
}

// A JPEG whose components have the given sampling factors {h, v}, for samplings TurboJPEG does not
// offer (4:1:0, 2x4, chroma sampled finer than luma).
std::vector<std::byte> EncodeSampled(const Image& image, std::array<std::pair<int, int>, 3> sampling) {
  return EncodeWith(image, [&](jpeg_compress_struct& c) {
    for (int k = 0; k < 3; ++k) {
      c.comp_info[k].h_samp_factor = sampling[k].first;
      c.comp_info[k].v_samp_factor = sampling[k].second;
    }
  });
}

// Decodes random regions of `jpeg` at every scale, through `index` when there is one, and
// compares each with the same pixels of a full decode at that scale. Returns the number of
// regions compared.
int CheckRegions(std::span<const std::byte> jpeg, const RestartIndex* index, uint32_t seed, int crops_per_scale,
                 const std::string& what) {
  JpegDecoder decoder;
  std::mt19937 rng(seed);
  int compared = 0;
  auto info = decoder.ReadHeader(jpeg);
  EXPECT_TRUE(info.ok()) << what << ": " << info.status().ToString();
  if (!info.ok()) return 0;
  const int w = info->width, h = info->height;
  for (int d : {1, 2, 4, 8}) {
    Image full;
    EXPECT_OK(decoder.Decode(jpeg, &full, d));
    for (int c = 0; c < crops_per_scale; ++c) {
      // Regions on the scale's grid, as prefetch asks for them (SnapToScale).
      const int x0 = static_cast<int>(rng() % static_cast<uint32_t>(w)) / d * d;
      const int y0 = static_cast<int>(rng() % static_cast<uint32_t>(h)) / d * d;
      const int x1 = std::min(w, x0 + d * (1 + static_cast<int>(rng() % static_cast<uint32_t>((w - x0 + d - 1) / d))));
      const int y1 = std::min(h, y0 + d * (1 + static_cast<int>(rng() % static_cast<uint32_t>((h - y0 + d - 1) / d))));
      Image block;
      auto where = decoder.DecodeRegion(jpeg, {x0, y0, x1 - x0, y1 - y0}, 1, 1, &block, d, index);
      EXPECT_TRUE(where.ok()) << what << ": " << where.status().ToString();
      if (!where.ok()) return compared;
      EXPECT_EQ(where->scale_denom, d);
      // Whole output pixels covering the region, in full-decode and in block coordinates.
      const int fx0 = x0 / d, fy0 = y0 / d, fx1 = (x1 + d - 1) / d, fy1 = (y1 + d - 1) / d;
      const int bx0 = static_cast<int>(where->x), by0 = static_cast<int>(where->y);
      EXPECT_EQ(where->x, static_cast<double>(bx0));
      for (int y = fy0; y < fy1; ++y) {
        for (int x = fx0; x < fx1; ++x) {
          const int bx = bx0 + (x - fx0), by = by0 + (y - fy0);
          if (bx >= block.width || by >= block.height) {
            ADD_FAILURE() << what << ": pixel (" << x << "," << y << ") falls outside the " << block.width << "x"
                          << block.height << " block";
            return compared;
          }
          for (int ch = 0; ch < 3; ++ch) {
            const uint8_t want = full.channels == 1 ? full.row(y)[x] : full.row(y)[3 * x + ch];
            const uint8_t got = block.row(by)[3 * bx + ch];
            if (want != got) {
              ADD_FAILURE() << what << ": scale 1/" << d << " region " << x0 << "," << y0 << "-" << x1 << ","
                            << y1 << (index ? " (index)" : " (no index)") << ": pixel (" << x << "," << y
                            << ") channel " << ch << " is " << int{got} << ", a full decode gives " << int{want};
              return compared;
            }
          }
        }
      }
      ++compared;
    }
  }
  return compared;
}

// A progressive JPEG whose scans leave coefficients out, as valid files may: `chroma_dc_only`
// sends no AC for the chroma, else no scan refines the last bit.
std::vector<std::byte> EncodeIncompleteProgressive(const Image& image, bool chroma_dc_only) {
  std::vector<jpeg_scan_info> scans;
  auto scan = [&](std::initializer_list<int> comps, int ss, int se, int al) {
    jpeg_scan_info s{};
    s.comps_in_scan = static_cast<int>(comps.size());
    int k = 0;
    for (int comp : comps) s.component_index[k++] = comp;
    s.Ss = ss, s.Se = se, s.Ah = 0, s.Al = al;
    scans.push_back(s);
  };
  const int al = chroma_dc_only ? 0 : 1;
  scan({0, 1, 2}, 0, 0, al);
  scan({0}, 1, 63, al);
  if (!chroma_dc_only) {
    scan({1}, 1, 63, al);
    scan({2}, 1, 63, al);
  }
  return EncodeWith(image, [&](jpeg_compress_struct& c) {
    c.scan_info = scans.data();
    c.num_scans = static_cast<int>(scans.size());
  });
}

// The same through the restart index of a transcoded JPEG (4- or 2-byte entries by the seed).
int CheckCrops(const TranscodedJpeg& t, uint32_t seed, int crops_per_scale, const std::string& what) {
  const OwnedIndex idx = IndexOf(t, seed % 2 ? 2 : 4);
  return CheckRegions(t.jpeg, &idx.index, seed, crops_per_scale, what);
}

TEST(Transcode, KeepsEveryPixelAtEveryScale) {
  JpegTranscoder transcoder;
  JpegDecoder decoder;
  struct Case {
    int w, h, channels, subsamp;
    bool progressive;
  };
  for (const Case& c : std::vector<Case>{{333, 217, 3, TJSAMP_420, false}, {500, 375, 3, TJSAMP_444, true},
                                         {161, 99, 3, TJSAMP_422, false}, {97, 203, 3, TJSAMP_440, true},
                                         {250, 130, 1, TJSAMP_GRAY, false}, {8, 8, 3, TJSAMP_420, false},
                                         {1, 1, 3, TJSAMP_444, false}, {17, 1, 1, TJSAMP_GRAY, true}}) {
    SCOPED_TRACE(::testing::Message() << c.w << "x" << c.h << " subsampling " << c.subsamp << " progressive "
                                      << c.progressive);
    const auto original = Encode(testing::MakeImage(c.w, c.h, c.channels, static_cast<uint32_t>(c.w)), c.subsamp,
                                 c.progressive);
    TranscodedJpeg t;
    ASSERT_OK(transcoder.Transcode(original, &t));
    EXPECT_FALSE(t.info.progressive);
    for (int d : {1, 2, 4, 8}) {
      Image a, b;
      ASSERT_OK(decoder.Decode(original, &a, d));
      ASSERT_OK(decoder.Decode(t.jpeg, &b, d));
      EXPECT_EQ(a.pixels, b.pixels) << "scale 1/" << d;
    }
    EXPECT_EQ(t.offsets.size(), static_cast<size_t>(t.mcus_per_row / t.restart_mcus * t.mcu_rows));
    EXPECT_EQ(t.mcus_per_row % t.restart_mcus, 0);
    const OwnedIndex idx = IndexOf(t);
    EXPECT_OK(CheckRestartIndex(t.jpeg, idx.index));
  }
}

TEST(Transcode, CropsFromTheIndexAreBitIdenticalToAFullDecode) {
  JpegTranscoder transcoder;
  int compared = 0;
  int seed = 0;
  for (int subsamp : {TJSAMP_444, TJSAMP_422, TJSAMP_420, TJSAMP_440, TJSAMP_411}) {
    for (auto [w, h] : std::vector<std::pair<int, int>>{{500, 375}, {333, 211}, {64, 48}, {45, 301}}) {
      for (bool progressive : {false, true}) {
        for (int channels : {3, 1}) {
          if (channels == 1 && subsamp != TJSAMP_444) continue;
          const std::string what = fmt::format("{}x{} subsampling {}{} channels {}", w, h, subsamp,
                                               progressive ? " progressive" : "", channels);
          const auto original = Encode(testing::MakeImage(w, h, channels, static_cast<uint32_t>(++seed)), subsamp,
                                       progressive);
          TranscodedJpeg t;
          ASSERT_OK(transcoder.Transcode(original, &t));
          compared += CheckCrops(t, static_cast<uint32_t>(seed), 12, what);
        }
      }
    }
  }
  EXPECT_GT(compared, 1500);
}

// The fast table builder counts symbols itself; libjpeg's own optimising pass is the reference.
// Equal tables give equal bytes, so the outputs must match exactly: every subsampling, odd sizes
// (dummy blocks at the right and bottom edges), grayscale, restarts, progressive inputs.
TEST(Transcode, FastTablesGiveTheBytesOfLibjpegsOwnOptimisingPass) {
  JpegTranscoder fast({}, {.check_counts = false}), reference({}, {.fast_tables = false});
  int compared = 0;
  for (int subsamp : {TJSAMP_444, TJSAMP_422, TJSAMP_420, TJSAMP_440, TJSAMP_411, TJSAMP_GRAY}) {
    for (auto [w, h] : std::vector<std::pair<int, int>>{{500, 375}, {333, 211}, {333, 217}, {17, 9}, {1, 1}, {45, 301}}) {
      for (bool progressive : {false, true}) {
        const int channels = subsamp == TJSAMP_GRAY ? 1 : 3;
        const auto jpeg = Encode(testing::MakeImage(w, h, channels, static_cast<uint32_t>(w + h)), subsamp,
                                 progressive, 70 + (w % 29));
        TranscodedJpeg a, b;
        ASSERT_OK(fast.Transcode(jpeg, &a));
        ASSERT_OK(reference.Transcode(jpeg, &b));
        EXPECT_EQ(a.jpeg, b.jpeg) << w << "x" << h << " subsampling " << subsamp << " progressive " << progressive;
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 72);
}

// A progressive file that leaves coefficients out was decoded with libjpeg's block smoothing: its
// pixels then depended on the blocks decoded (a crop differed from a full decode), and the packed
// record (the same coefficients, sequential, never smoothed) decoded to other pixels than its
// source, up to 77 levels apart. stoke decodes the coefficients as they are, every way.
TEST(Transcode, ProgressiveFilesWithCoefficientsLeftOutDecodeTheSameEveryWay) {
  JpegTranscoder transcoder;
  JpegDecoder decoder;
  int compared = 0;
  for (bool chroma_dc_only : {false, true}) {
    const std::string what = chroma_dc_only ? "chroma DC only" : "no last refinement";
    const auto original = EncodeIncompleteProgressive(testing::MakeImage(333, 251, 3, 41), chroma_dc_only);
    TranscodedJpeg t;
    ASSERT_OK(transcoder.Transcode(original, &t));
    for (int d : {1, 2, 4, 8}) {
      Image a, b;
      ASSERT_OK(decoder.Decode(original, &a, d));
      ASSERT_OK(decoder.Decode(t.jpeg, &b, d));
      EXPECT_TRUE(a.pixels == b.pixels) << what << ": the record decodes to other pixels than its source at 1/" << d;
    }
    compared += CheckCrops(t, 7, 10, what + ", index");
    compared += CheckRegions(original, nullptr, 8, 10, what + ", the original without an index");
  }
  EXPECT_EQ(compared, 2 * 2 * 4 * 10);
}

// Bits flipped inside one interval of a transcoded JPEG make its entropy data end early or run on
// (the CRC is what catches that in a dataset, but a writer's fault would pass it). A strict full
// decode refuses such data; a decode through the index skipped the bytes left over, or read the
// padding before the next marker as data, whatever their number, and gave pixels.
TEST(Transcode, AnIntervalThatEndsEarlyOrRunsOnIsRefusedThroughTheIndex) {
  JpegTranscoder transcoder;
  JpegDecoder decoder;
  TranscodedJpeg t;
  ASSERT_OK(transcoder.Transcode(Encode(testing::MakeImage(320, 240, 3, 9), TJSAMP_420), &t));
  const OwnedIndex idx = IndexOf(t);
  const size_t n = t.offsets.size();
  ASSERT_GT(n, 20u);
  std::mt19937 rng(3);
  int refused_in_full = 0, passed_through_index = 0;
  Image out;
  for (int trial = 0; trial < 400; ++trial) {
    // An interval that is not the last (before EOI a shortfall cannot be told from read-ahead).
    const size_t i = 1 + rng() % (n - 2);
    const uint32_t begin = t.offsets[i], end = t.offsets[i + 1] - 2;
    if (end - begin < 4) continue;
    std::vector<std::byte> damaged = t.jpeg;
    const size_t at = begin + 1 + rng() % (end - begin - 2);
    const auto flipped = damaged[at] ^ static_cast<std::byte>(1u << (rng() % 8));
    // No new marker and no broken stuffing: the bytes around stay entropy-coded data.
    if (flipped == std::byte{0xFF} || damaged[at] == std::byte{0xFF} || damaged[at - 1] == std::byte{0xFF}) continue;
    damaged[at] = flipped;
    if (decoder.Decode(damaged, &out).ok()) continue;  // the same code lengths: nothing to tell
    ++refused_in_full;
    const int w = t.info.width, h = t.info.height;
    auto r = decoder.DecodeRegion(damaged, {0, 0, w, h}, 1, 1, &out, 1, &idx.index);
    if (r.ok()) {
      ++passed_through_index;
    } else {
      EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
    }
  }
  EXPECT_GT(refused_in_full, 50);
  EXPECT_EQ(passed_through_index, 0) << "of " << refused_in_full << " damaged intervals a strict decode refuses";
}

TEST(Transcode, ChoosesAnIntervalThatDividesTheRow) {
  JpegTranscoder eight;  // the default: at least 8 intervals per row
  TranscodedJpeg t;
  ASSERT_OK(eight.Transcode(Encode(testing::MakeImage(500, 375, 3, 1), TJSAMP_420), &t));
  EXPECT_EQ(t.mcus_per_row, 32);  // 500 / 16, rounded up
  EXPECT_EQ(t.restart_mcus, 4);
  ASSERT_OK(eight.Transcode(Encode(testing::MakeImage(500, 375, 3, 1), TJSAMP_444), &t));
  EXPECT_EQ(t.mcus_per_row, 63);
  EXPECT_EQ(t.restart_mcus, 7);  // 63 = 9 x 7
  JpegTranscoder rows({}, {.intervals_per_row = 1});
  ASSERT_OK(rows.Transcode(Encode(testing::MakeImage(500, 375, 3, 1), TJSAMP_420), &t));
  EXPECT_EQ(t.restart_mcus, 32);  // one interval per MCU row
}

TEST(Transcode, RefusesWhatValidationRefusesAndLeavesCmykAlone) {
  JpegTranscoder transcoder;
  JpegDecoder decoder;
  TranscodedJpeg t;
  auto jpeg = Encode(testing::MakeImage(120, 80, 3, 2), TJSAMP_420);
  std::vector<std::byte> cut(jpeg.begin(), jpeg.begin() + static_cast<ptrdiff_t>(jpeg.size() * 2 / 3));
  const Status want = decoder.Validate(cut);
  const Status got = transcoder.Transcode(cut, &t);
  ASSERT_FALSE(want.ok());
  EXPECT_EQ(got.code(), want.code());
  EXPECT_EQ(got.message(), want.message());
  EXPECT_EQ(transcoder.Transcode({}, &t).code(), StatusCode::kCorrupt);
  std::vector<std::byte> garbage(300, std::byte{0x5A});
  garbage[0] = std::byte{0xFF};
  garbage[1] = std::byte{0xD8};
  EXPECT_EQ(transcoder.Transcode(garbage, &t).code(), decoder.Validate(garbage).code());
  // The transcoder keeps working after errors.
  ASSERT_OK(transcoder.Transcode(jpeg, &t));
}

TEST(Transcode, DamageToTheIndexIsCaught) {
  JpegTranscoder transcoder;
  TranscodedJpeg t;
  ASSERT_OK(transcoder.Transcode(Encode(testing::MakeImage(300, 200, 3, 5), TJSAMP_420), &t));
  OwnedIndex idx = IndexOf(t);
  ASSERT_OK(CheckRestartIndex(t.jpeg, idx.index));
  idx.bytes[4 * 5] ^= std::byte{0x01};  // interval 5 moves by a byte
  EXPECT_EQ(CheckRestartIndex(t.jpeg, idx.index).code(), StatusCode::kCorrupt);
  JpegDecoder decoder;
  Image out;
  // A region that needs interval 5 finds the markers do not line up.
  int refused = 0;
  for (int y = 0; y < 200; y += 16) {
    auto r = decoder.DecodeRegion(t.jpeg, {0, y, 300, 16}, 1, 1, &out, 1, &idx.index);
    refused += !r.ok();
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
    }
  }
  EXPECT_GT(refused, 0);
  idx.bytes[4 * 5] ^= std::byte{0x01};
  idx.index.mcu_rows += 1;
  EXPECT_EQ(CheckRestartIndex(t.jpeg, idx.index).code(), StatusCode::kCorrupt);
  EXPECT_EQ(decoder.DecodeRegion(t.jpeg, {0, 0, 30, 30}, 1, 1, &out, 1, &idx.index).status().code(),
            StatusCode::kCorrupt);
}

// Misplaced offsets in an index whose bytes are otherwise intact (its CRC would pass: a writer's
// fault, not damage in storage): every region decode either refuses with kCorrupt or gives the
// full decode's pixels, and the whole image, which reads every interval, is always refused.
TEST(Transcode, AMisplacedIntervalIsRefusedNeverDecodedWrong) {
  JpegTranscoder transcoder;
  JpegDecoder decoder;
  for (int subsamp : {TJSAMP_420, TJSAMP_444}) {
    TranscodedJpeg t;
    ASSERT_OK(transcoder.Transcode(Encode(testing::MakeImage(300, 200, 3, 7), subsamp), &t));
    const int w = t.info.width, h = t.info.height;
    Image full, out;
    ASSERT_OK(decoder.Decode(t.jpeg, &full));
    const size_t n = t.offsets.size();
    ASSERT_GT(n, 16u);
    int refused = 0, exact = 0;
    auto check = [&](const OwnedIndex& idx, const std::string& what) {
      EXPECT_EQ(decoder.DecodeRegion(t.jpeg, {0, 0, w, h}, 1, 1, &out, 1, &idx.index).status().code(),
                StatusCode::kCorrupt)
          << what;
      for (int y = 0; y < h; y += 8) {
        auto r = decoder.DecodeRegion(t.jpeg, {0, y, w, std::min(8, h - y)}, 1, 1, &out, 1, &idx.index);
        if (!r.ok()) {
          EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << what << ": " << r.status().ToString();
          ++refused;
          continue;
        }
        for (int yy = y; yy < std::min(h, y + 8); ++yy) {
          const uint8_t* got = out.row(yy - y + static_cast<int>(r->y)) + 3 * static_cast<int>(r->x);
          ASSERT_TRUE(std::equal(got, got + 3 * w, full.row(yy))) << what << ": row " << yy << " decoded wrong";
        }
        ++exact;
      }
    };
    for (size_t i : {size_t{0}, size_t{1}, size_t{3}, size_t{8}, n / 2, n - 1}) {
      for (int64_t moved : {-3, -2, -1, 1, 2, 3, 8}) {
        OwnedIndex idx = IndexOf(t);
        const uint32_t v = static_cast<uint32_t>(static_cast<int64_t>(t.offsets[i]) + moved);
        std::memcpy(idx.bytes.data() + 4 * i, &v, 4);  // little-endian, as the format stores it
        check(idx, fmt::format("subsampling {}: interval {} moved by {}", subsamp, i, moved));
      }
      for (uint32_t v : {0u, 1u, 2u}) {  // offsets before the scan (once read 2 bytes before the JPEG)
        OwnedIndex idx = IndexOf(t);
        std::memcpy(idx.bytes.data() + 4 * i, &v, 4);
        check(idx, fmt::format("subsampling {}: interval {} at {}", subsamp, i, v));
      }
    }
    for (size_t i : {size_t{1}, size_t{4}, n - 9}) {  // two entries swapped, one and eight apart
      for (size_t j : {i + 1, i + 8}) {
        OwnedIndex idx = IndexOf(t);
        std::swap_ranges(idx.bytes.begin() + static_cast<ptrdiff_t>(4 * i),
                         idx.bytes.begin() + static_cast<ptrdiff_t>(4 * i + 4),
                         idx.bytes.begin() + static_cast<ptrdiff_t>(4 * j));
        check(idx, fmt::format("subsampling {}: intervals {} and {} swapped", subsamp, i, j));
      }
    }
    EXPECT_GT(refused, 0);
    EXPECT_GT(exact, 0);
  }
}

// Without an index (datasets packed with --index none, CMYK, format 1), a region is decoded
// straight from the JPEG with its columns cropped: the same pixels as a full decode at the same
// scale too, whatever the sampling, including those libjpeg-turbo cannot crop.
TEST(RegionDecode, CropsWithoutAnIndexAreBitIdenticalToAFullDecode) {
  int compared = 0;
  uint32_t seed = 100;
  for (int subsamp : {TJSAMP_444, TJSAMP_422, TJSAMP_420, TJSAMP_440, TJSAMP_411}) {
    for (auto [w, h] : std::vector<std::pair<int, int>>{{500, 375}, {333, 211}, {45, 301}}) {
      for (bool progressive : {false, true}) {
        for (int channels : {3, 1}) {
          if (channels == 1 && subsamp != TJSAMP_444) continue;
          const std::string what = fmt::format("{}x{} subsampling {}{} channels {}", w, h, subsamp,
                                               progressive ? " progressive" : "", channels);
          const auto jpeg = Encode(testing::MakeImage(w, h, channels, ++seed), subsamp, progressive);
          compared += CheckRegions(jpeg, nullptr, seed, 10, what);
        }
      }
    }
  }
  // 4:1:0, luma 2x4, chroma sampled finer than luma.
  for (auto sampling : std::vector<std::array<std::pair<int, int>, 3>>{
           {{{4, 2}, {1, 1}, {1, 1}}}, {{{2, 4}, {1, 1}, {1, 1}}}, {{{1, 1}, {2, 2}, {1, 1}}}}) {
    for (auto [w, h] : std::vector<std::pair<int, int>>{{333, 211}, {97, 45}}) {
      const std::string what = fmt::format("{}x{} sampling {}x{},{}x{},{}x{}", w, h, sampling[0].first,
                                           sampling[0].second, sampling[1].first, sampling[1].second,
                                           sampling[2].first, sampling[2].second);
      ++seed;
      compared += CheckRegions(EncodeSampled(testing::MakeImage(w, h, 3, seed), sampling), nullptr, seed, 16, what);
    }
  }
  EXPECT_GT(compared, 1000);
}

using testing::FilesUnder;

TEST(TranscodeCorpus, PhotosKeepTheirPixelsAndCropsAreExactWithinThreePercentOfTheSize) {
  STOKE_REQUIRE_SHARED_DATA(data);
  JpegTranscoder transcoder;
  JpegDecoder decoder;
  int64_t before = 0, after = 0, index_bytes = 0, progressive = 0;
  int compared = 0, n = 0;
  const auto files = FilesUnder(data / "imagenet_like");
  JpegTranscoder reference({}, {.fast_tables = false});
  for (size_t i = 0; i < files.size(); ++i) {
    const auto jpeg = testing::ReadBytes(files[i]);
    TranscodedJpeg t;
    const Status s = transcoder.Transcode(jpeg, &t);
    ASSERT_TRUE(s.ok()) << files[i] << ": " << s.ToString();
    if (i % 4 == 0) {  // libjpeg's own optimising pass writes the same bytes
      TranscodedJpeg r;
      ASSERT_OK(reference.Transcode(jpeg, &r));
      ASSERT_EQ(t.jpeg, r.jpeg) << files[i];
    }
    ASSERT_OK_AND_ASSIGN(JpegInfo info, decoder.ReadHeader(jpeg));
    progressive += info.progressive;
    before += static_cast<int64_t>(jpeg.size());
    after += static_cast<int64_t>(t.jpeg.size());
    index_bytes += static_cast<int64_t>(2 * t.offsets.size()) + 2 + 20;  // 16-bit distances, trailer
    ++n;
    // Every photo: the same pixels at full size and two crops at each scale; every tenth: the
    // same pixels at every scale and eight crops at each.
    const bool deep = i % 10 == 0;
    for (int d : deep ? std::vector<int>{1, 2, 4, 8} : std::vector<int>{1}) {
      Image a, b;
      ASSERT_OK(decoder.Decode(jpeg, &a, d));
      ASSERT_OK(decoder.Decode(t.jpeg, &b, d));
      ASSERT_EQ(a.pixels, b.pixels) << files[i] << " scale 1/" << d;
    }
    compared += CheckCrops(t, static_cast<uint32_t>(i), deep ? 8 : 2, files[i].string());
  }
  const double ratio = static_cast<double>(after + index_bytes) / static_cast<double>(before);
  std::printf("imagenet_like: %d photos (%lld progressive), %lld bytes -> %lld transcoded + %lld index = %.4fx; "
              "%d crops compared bit for bit\n",
              n, static_cast<long long>(progressive), static_cast<long long>(before), static_cast<long long>(after),
              static_cast<long long>(index_bytes), ratio, compared);
  EXPECT_LE(ratio, 1.03);
  EXPECT_GT(compared, 10000);
}

TEST(TranscodeCorpus, EdgeFilesTranscodeLosslesslyOrStayAsTheyAre) {
  STOKE_REQUIRE_SHARED_DATA(data);
  JpegTranscoder transcoder;
  JpegDecoder decoder;
  int transcoded = 0, kept = 0, compared = 0, direct = 0;
  for (const auto& f : FilesUnder(data / "edge")) {
    const auto jpeg = testing::ReadBytes(f);
    TranscodedJpeg t;
    const Status s = transcoder.Transcode(jpeg, &t);
    const Status v = decoder.Validate(jpeg);
    if (!v.ok()) {  // the transcode refuses what validation refuses, for the same reason
      EXPECT_EQ(s.code(), v.code()) << f;
      EXPECT_EQ(s.message(), v.message()) << f;
      continue;
    }
    direct += CheckRegions(jpeg, nullptr, static_cast<uint32_t>(direct), 6, f.string() + " (as it is)");
    if (s.code() == StatusCode::kUnavailable) {  // CMYK/YCCK: stored as they are
      ++kept;
      continue;
    }
    ASSERT_TRUE(s.ok()) << f << ": " << s.ToString();
    TranscodedJpeg r;
    ASSERT_OK(JpegTranscoder({}, {.fast_tables = false}).Transcode(jpeg, &r));
    EXPECT_EQ(t.jpeg, r.jpeg) << f << ": the fast tables differ from libjpeg's";
    for (int d : {1, 2, 4, 8}) {
      Image a, b;
      ASSERT_OK(decoder.Decode(jpeg, &a, d));
      ASSERT_OK(decoder.Decode(t.jpeg, &b, d));
      ASSERT_EQ(a.pixels, b.pixels) << f << " scale 1/" << d;
    }
    compared += CheckCrops(t, static_cast<uint32_t>(transcoded), 6, f.string());
    ++transcoded;
  }
  std::printf("edge: %d transcoded (%d crops compared), %d kept as they are; %d crops of the files as they are\n",
              transcoded, compared, kept, direct);
  EXPECT_GT(transcoded, 80);
}

TEST(TranscodeCorpus, EveryBadFileIsRefusedAsValidationRefusesIt) {
  STOKE_REQUIRE_SHARED_DATA(data);
  JpegTranscoder transcoder;
  JpegDecoder decoder;
  for (const auto& f : FilesUnder(data / "bad")) {
    const auto jpeg = testing::ReadBytes(f);
    TranscodedJpeg t;
    const Status s = transcoder.Transcode(jpeg, &t);
    const Status v = decoder.Validate(jpeg);
    EXPECT_EQ(s.ok(), v.ok()) << f << ": transcode " << s.ToString() << ", validate " << v.ToString();
    if (!v.ok()) {
      EXPECT_EQ(s.message(), v.message()) << f;
    }
  }
}

}  // namespace
}  // namespace stoke::decode
