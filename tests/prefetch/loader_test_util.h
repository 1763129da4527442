// Helpers shared by the prefetch tests: a small packed dataset of synthetic JPEGs (or raw
// pixels) with chosen bad records, small loader options, and draining a loader into plain copies.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <vector>

#include <fmt/format.h>

#include "dataset/dataset.h"
#include "dataset/writer.h"
#include "prefetch/loader.h"
#include "tests/testing/test_util.h"

namespace stoke::prefetch {
namespace fs = std::filesystem;
using dataset::PayloadEncoding;
using dataset::RecordHeader;

struct Spec {
  int records = 40;
  std::set<int> bad;  // these records get a truncated JPEG (with a valid CRC: only decode fails)
  bool raw = false;   // raw-pixel records instead of JPEGs
  int scale = 1;      // image sides times this (4: records of tens of KB, outside LMDB's leaf pages)
  int big = -1;       // this record is 2400x2400 (its decode needs far more memory than the others')
  int width = 0, height = 0;  // > 0: every image this size
};

// A packed dataset of synthetic pictures of varied sizes, every fifth one grayscale; label i % 4.
inline fs::path WriteDataset(const fs::path& dir, const Spec& spec) {
  auto writer = dataset::DatasetWriter::Create(dir, {});
  EXPECT_TRUE(writer.ok()) << writer.status().ToString();
  dataset::Manifest m;
  m.format_version = dataset::kFormatVersion;
  m.classes = {"a", "b", "c", "d"};
  m.class_counts = {0, 0, 0, 0};
  for (int i = 0; i < spec.records; ++i) {
    const int channels = i % 5 == 4 ? 1 : 3;
    const int side = i == spec.big ? 2400 / spec.scale : 0;
    Image img = spec.width > 0 ? testing::MakeImage(spec.width, spec.height, channels, static_cast<uint32_t>(i))
                               : testing::MakeImage((side > 0 ? side : 60 + (i * 37) % 90) * spec.scale,
                                                    (side > 0 ? side : 50 + (i * 23) % 80) * spec.scale, channels,
                                                    static_cast<uint32_t>(i));
    RecordHeader h;
    h.label = i % 4;
    h.width = static_cast<uint32_t>(img.width);
    h.height = static_cast<uint32_t>(img.height);
    h.channels = static_cast<uint8_t>(channels);
    std::vector<std::byte> payload;
    if (spec.raw) {
      h.encoding = PayloadEncoding::kRaw;
      payload.assign(reinterpret_cast<const std::byte*>(img.pixels.data()),
                     reinterpret_cast<const std::byte*>(img.pixels.data()) + img.pixels.size());
    } else {
      payload = testing::EncodeJpeg(img);
      if (spec.bad.contains(i)) payload.resize(payload.size() / 2);
    }
    m.class_counts[static_cast<size_t>(h.label)]++;
    m.payload_bytes += static_cast<int64_t>(payload.size());
    writer->Append(h, std::move(payload), fmt::format("class/{}.jpg", i));
  }
  m.records = spec.records;
  m.has_paths = true;
  m.packing = {{"tool", "loader_test"}};
  EXPECT_OK(writer->Finish(m));
  return dir;
}

inline LoaderOptions SmallOptions(int threads) {
  LoaderOptions o;
  o.sampler.seed = 17;
  o.augment.random.size = 32;
  o.augment.random.brightness = 0.2;
  o.batch_size = 6;
  o.threads = threads;
  o.ring_size = 3;
  o.epochs = 2;
  o.device = DeviceMode::kHost;
  return o;
}

struct Seen {
  int64_t epoch, number;
  std::vector<uint8_t> images;
  std::vector<int32_t> labels;
  std::vector<int64_t> indices;
  int replaced;
  std::vector<uint8_t> stand_in;
  bool operator==(const Seen&) const = default;
};

inline std::vector<Seen> Drain(Loader& loader, int limit = -1) {
  std::vector<Seen> out;
  while (limit < 0 || static_cast<int>(out.size()) < limit) {
    auto lease = loader.Next();
    EXPECT_TRUE(lease.ok()) << lease.status().ToString();
    if (!lease.ok() || !*lease) break;
    const Batch& b = **lease;
    out.push_back({b.epoch, b.number, {b.images.begin(), b.images.end()}, {b.labels.begin(), b.labels.end()},
                   {b.indices.begin(), b.indices.end()}, b.replaced, {b.stand_in.begin(), b.stand_in.end()}});
  }
  return out;
}

}  // namespace stoke::prefetch
