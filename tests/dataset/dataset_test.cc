// Tests for dataset/: the record format, writer and reader (identity, zero-copy views, damaged
// files), and the sampler (determinism, permutations, shards).
#include <gtest/gtest.h>
#include <lmdb.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <set>
#include <thread>
#include <atomic>

#include <fmt/format.h>

#include "common/c_handles.h"
#include "common/crc32c.h"
#include "common/json_util.h"
#include "common/random.h"
#include "dataset/dataset.h"
#include "dataset/manifest.h"
#include "dataset/record.h"
#include "dataset/sampler.h"
#include "dataset/writer.h"
#include "tests/testing/test_util.h"

namespace stoke::dataset {
namespace {
namespace fs = std::filesystem;
using testing::TempDir;

std::vector<std::byte> RandomPayload(size_t n, uint64_t seed) {
  std::vector<std::byte> p(n);
  SplitMix64 g(seed);
  for (auto& b : p) b = static_cast<std::byte>(g.Next());
  return p;
}

struct Written {
  std::vector<std::vector<std::byte>> payloads;
  std::vector<int32_t> labels;
};

// Writes `n` records with random payloads (sizes vary, some span several pages).
Written WriteDataset(const fs::path& dir, int n, WriterOptions options = {}) {
  Written w;
  auto writer = DatasetWriter::Create(dir, options);
  EXPECT_TRUE(writer.ok()) << writer.status().ToString();
  Manifest m;
  m.format_version = kFormatVersion;
  m.classes = {"cat", "dog", "eel"};
  m.class_counts = {0, 0, 0};
  for (int i = 0; i < n; ++i) {
    auto payload = RandomPayload(100 + static_cast<size_t>(i) * 997 % 20000, static_cast<uint64_t>(i));
    RecordHeader h;
    h.label = i % 3;
    h.width = 10 + i;
    h.height = 20 + i;
    h.channels = 3;
    w.payloads.push_back(payload);
    w.labels.push_back(h.label);
    m.class_counts[h.label]++;
    writer->Append(h, payload, "src/" + std::to_string(i) + ".jpg");
    if (writer->ShouldCommit()) EXPECT_OK(writer->Commit("{}"));
  }
  m.records = n;
  m.has_paths = true;
  m.packing = {{"tool", "test"}};
  EXPECT_OK(writer->Finish(m));
  return w;
}

TEST(Record, HeaderRoundTrip) {
  RecordHeader h;
  h.encoding = PayloadEncoding::kRaw;
  h.channels = 1;
  h.label = 41;
  h.width = 3;
  h.height = 2;
  std::vector<std::byte> value(kRecordHeaderSize + 6, std::byte{7});
  h.payload_size = 6;
  h.crc32c = 0x12345678;
  EncodeRecordHeader(h, std::span<std::byte, kRecordHeaderSize>(value.data(), kRecordHeaderSize));
  ASSERT_OK_AND_ASSIGN(RecordView r, ParseRecord(value, 5));
  EXPECT_EQ(r.index, 5);
  EXPECT_EQ(r.header.label, 41);
  EXPECT_EQ(r.header.encoding, PayloadEncoding::kRaw);
  EXPECT_EQ(r.header.width, 3u);
  EXPECT_EQ(r.header.crc32c, 0x12345678u);
  EXPECT_EQ(r.header_bytes.data(), value.data());
  EXPECT_EQ(r.payload.data(), value.data() + kRecordHeaderSize);  // a view, not a copy
  EXPECT_EQ(CheckCrc(r).code(), StatusCode::kCorrupt);
}

TEST(Record, RejectsMalformedValues) {
  RecordHeader h;
  h.payload_size = 4;
  std::vector<std::byte> value(kRecordHeaderSize + 4);
  EncodeRecordHeader(h, std::span<std::byte, kRecordHeaderSize>(value.data(), kRecordHeaderSize));
  EXPECT_OK(ParseRecord(value, 0).status());
  // Too short.
  EXPECT_EQ(ParseRecord(std::span(value).first(10), 9).status().code(), StatusCode::kCorrupt);
  EXPECT_NE(ParseRecord(std::span(value).first(10), 9).status().message().find("record 9"),
            std::string::npos);
  // Length mismatch.
  EXPECT_EQ(ParseRecord(std::span(value).first(kRecordHeaderSize + 3), 0).status().code(),
            StatusCode::kCorrupt);
  // Bad magic.
  auto bad = value;
  bad[0] = std::byte{0};
  EXPECT_EQ(ParseRecord(bad, 0).status().code(), StatusCode::kCorrupt);
  // Another format version: a clear instruction, not "corrupt".
  bad = value;
  bad[4] = std::byte{9};
  auto v = ParseRecord(bad, 0);
  EXPECT_EQ(v.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(v.status().message().find("v9"), std::string::npos);
  // Unknown encoding.
  bad = value;
  bad[6] = std::byte{77};
  EXPECT_EQ(ParseRecord(bad, 0).status().code(), StatusCode::kCorrupt);
}

TEST(Record, VersionOneRecordsStillReadAndIndexedOnesNeedVersionTwo) {
  RecordHeader h;
  h.format_version = 1;
  h.payload_size = 4;
  std::vector<std::byte> value(kRecordHeaderSize + 4);
  EncodeRecordHeader(h, std::span<std::byte, kRecordHeaderSize>(value.data(), kRecordHeaderSize));
  ASSERT_OK_AND_ASSIGN(RecordView v1, ParseRecord(value, 3));
  EXPECT_EQ(v1.header.format_version, 1);
  EXPECT_EQ(v1.image.size(), 4u);
  EXPECT_EQ(v1.jpeg_index.entry_bytes, 0);
  h.encoding = PayloadEncoding::kJpegIndexed;  // encoding 3 did not exist in v1
  EncodeRecordHeader(h, std::span<std::byte, kRecordHeaderSize>(value.data(), kRecordHeaderSize));
  EXPECT_EQ(ParseRecord(value, 3).status().code(), StatusCode::kCorrupt);
}

// The payload of a kJpegIndexed record: the JPEG, then its index with 16-bit distances when they
// fit (else 32-bit offsets), then the trailer.
TEST(Record, IndexedPayloadsRoundTripAndBadTrailersAreCorrupt) {
  const std::vector<std::byte> jpeg = RandomPayload(300000, 4);
  for (const std::vector<uint32_t>& offsets :
       {std::vector<uint32_t>{600, 900, 1300, 2000, 2100, 5000}, std::vector<uint32_t>{600, 900, 1300, 90000, 91000, 95000}}) {
    const auto payload = EncodeJpegIndexedPayload(jpeg, offsets, 2, 6, 2);
    RecordHeader h;
    h.encoding = PayloadEncoding::kJpegIndexed;
    SealRecordHeader(h, payload, 0);
    std::vector<std::byte> value(kRecordHeaderSize);
    EncodeRecordHeader(h, std::span<std::byte, kRecordHeaderSize>(value.data(), kRecordHeaderSize));
    value.insert(value.end(), payload.begin(), payload.end());
    ASSERT_OK_AND_ASSIGN(RecordView r, ParseRecord(value, 0));
    EXPECT_OK(CheckCrc(r));
    EXPECT_EQ(r.image.size(), jpeg.size());
    EXPECT_TRUE(std::equal(r.image.begin(), r.image.end(), jpeg.begin()));
    const bool narrow = offsets[3] - offsets[2] < 65536;
    EXPECT_EQ(r.jpeg_index.entry_bytes, narrow ? 2 : 4);
    EXPECT_EQ(r.jpeg_index.intervals, 6u);
    EXPECT_EQ(r.jpeg_index.restart_mcus, 2);
    EXPECT_EQ(r.jpeg_index.mcus_per_row, 6);
    EXPECT_EQ(r.jpeg_index.mcu_rows, 2);
    EXPECT_EQ(r.jpeg_index.entries.size(), narrow ? 4 + 2 * 5u : 4 * 6u);
    // Every field of the trailer matters.
    for (size_t at : {size_t{0}, size_t{4}, size_t{8}, size_t{10}, size_t{12}, size_t{14}, size_t{16}}) {
      auto bad = value;
      bad[bad.size() - kJpegIndexTrailerSize + at] ^= std::byte{0x01};
      auto parsed = ParseRecord(bad, 7);
      EXPECT_EQ(parsed.status().code(), StatusCode::kCorrupt) << "trailer byte " << at;
      EXPECT_NE(parsed.status().message().find("record 7"), std::string::npos);
    }
  }
}

TEST(Record, KeysSortInIndexOrder) {
  std::array<std::byte, 8> a, b;
  for (uint64_t i : {0ull, 1ull, 255ull, 256ull, 65535ull, 1ull << 40}) {
    EncodeKey(i, a);
    EncodeKey(i + 1, b);
    EXPECT_LT(std::memcmp(a.data(), b.data(), 8), 0);
    EXPECT_EQ(DecodeKey(a), i);
  }
}

TEST(Manifest, JsonRoundTripAndValidation) {
  Manifest m;
  m.format_version = 1;
  m.records = 3;
  m.classes = {"a", "b"};
  m.class_counts = {1, 2};
  m.packing = {{"seed", 4}};
  ASSERT_OK_AND_ASSIGN(Manifest back, Manifest::Parse(m.ToJson().dump()));
  EXPECT_EQ(back, m);
  m.class_counts = {1, 1};
  EXPECT_EQ(Manifest::Parse(m.ToJson().dump()).status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(Manifest::Parse("{\"records\": \"x\"").status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(Manifest::Parse("{\"records\": \"x\", \"format_version\": 1, \"classes\": [], "
                            "\"class_counts\": []}").status().code(),
            StatusCode::kCorrupt);
}


TEST(Manifest, NumbersMustBeIntegersInRange) {
  // Found by fuzz_record: a float too large for int64 was converted with undefined behaviour.
  const std::string base = R"({"format_version":1,"classes":["a","b"],"class_counts":[2,2],"records":)";
  for (const std::string records : {"5e26", "4.5", "-4", "18446744073709551615", "\"4\""}) {
    auto m = Manifest::Parse(base + records + "}");
    ASSERT_FALSE(m.ok()) << records;
    EXPECT_EQ(m.status().code(), StatusCode::kCorrupt) << records;
    EXPECT_NE(m.status().message().find("'records'"), std::string::npos) << m.status().ToString();
  }
  auto counts = Manifest::Parse(R"({"format_version":1,"classes":["a","b"],"class_counts":[1099511627776,1e300],"records":4})");
  ASSERT_FALSE(counts.ok());
  EXPECT_NE(counts.status().message().find("class_counts[1]"), std::string::npos) << counts.status().ToString();
  ASSERT_OK(Manifest::Parse(base + "4}").status());
}

// A class name or has_paths of the wrong type is an error naming the key (it was nlohmann's
// "type must be string, but is number", naming nothing).
TEST(Manifest, FieldsOfTheWrongTypeAreNamed) {
  const std::string head = R"({"format_version":1,"class_counts":[2,2],"records":4,)";
  for (const auto& [body, key] : std::vector<std::pair<std::string, std::string>>{
           {R"("classes":["a",5]})", "classes[1] is number"},
           {R"("classes":"ab"})", "'classes' is not a list"},
           {R"("classes":["a","b"],"has_paths":"yes"})", "'has_paths' is string, not true or false"},
           {R"("classes":["a","a"]})", "classes[0] and classes[1] are both named 'a'"}}) {
    auto m = Manifest::Parse(head + body);
    ASSERT_FALSE(m.ok()) << body;
    EXPECT_EQ(m.status().code(), StatusCode::kCorrupt) << body;
    EXPECT_NE(m.status().message().find(key), std::string::npos) << m.status().ToString();
  }
  ASSERT_OK_AND_ASSIGN(Manifest ok, Manifest::Parse(head + R"("classes":["a","b"],"has_paths":true})"));
  EXPECT_TRUE(ok.has_paths);
  EXPECT_FALSE(ok.payload_bytes_stored);  // left out by older writers
}

// IsUtf8: what JSON text holds, and what it does not (stored, such bytes become U+FFFD).
TEST(Json, IsUtf8) {
  for (const char* good : {"", "plain", "caf\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80", "\xEF\xBF\xBD"}) {
    EXPECT_TRUE(IsUtf8(good)) << good;
  }
  for (const char* bad : {"\xFF", "\xFE", "caf\xE9", "\xC3", "\xE2\x82", "\xC0\xAF", "\xED\xA0\x80", "\xF4\x90\x80\x80",
                          "\x80"}) {
    EXPECT_FALSE(IsUtf8(bad)) << bad;
  }
}

// A raw record's size check multiplied width * height * channels in 64 bits, which wraps:
// 1432163965 x 4293443238 x 3 is 4394 modulo 2^64, so a 4394-byte payload passed (and inspect
// --verify called the record good), and an empty 0 x 0 image passed too.
TEST(Record, RawDimensionsThatWrapAreEmptyOrTooLargeAreCorrupt) {
  auto parse_raw = [](uint32_t width, uint32_t height, uint8_t channels,
                      std::span<std::byte> value) {
    RecordHeader h;
    h.encoding = PayloadEncoding::kRaw;
    h.width = width;
    h.height = height;
    h.channels = channels;
    h.payload_size = value.size() - kRecordHeaderSize;
    EncodeRecordHeader(h, std::span<std::byte, kRecordHeaderSize>(value.data(), kRecordHeaderSize));
    return ParseRecord(value, 4);
  };
  std::vector<std::byte> value(kRecordHeaderSize + 4394);
  ASSERT_EQ(uint64_t{1432163965u} * 4293443238u * 3, 4394u);  // the wrap itself
  auto wrapped = parse_raw(1432163965u, 4293443238u, 3, value);
  ASSERT_FALSE(wrapped.ok()) << "a 1432163965x4293443238x3 image in 4394 bytes was accepted";
  EXPECT_EQ(wrapped.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(wrapped.status().message().find("record 4"), std::string::npos)
      << wrapped.status().ToString();
  EXPECT_NE(wrapped.status().message().find("1432163965x4293443238x3"), std::string::npos)
      << wrapped.status().ToString();
  value.resize(kRecordHeaderSize);
  for (auto [w, h] : {std::pair{0u, 0u}, std::pair{0u, 7u}, std::pair{7u, 0u}}) {
    auto empty = parse_raw(w, h, 3, value);
    EXPECT_EQ(empty.status().code(), StatusCode::kCorrupt)
        << w << "x" << h << ": " << empty.status().ToString();
  }
  value.resize(kRecordHeaderSize + 6);
  EXPECT_OK(parse_raw(1, 2, 3, value).status());
  // The decoder's pixel cap holds for raw records too: 250,000,000 one-channel pixels are the most.
  // The payload is mapped, not touched: only the header page becomes memory.
  constexpr size_t kCap = 250'000'000;
  const size_t bytes = kRecordHeaderSize + kCap + 1;
  void* map = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  std::span<std::byte> big(static_cast<std::byte*>(map), bytes);
  auto over = parse_raw(kCap + 1, 1, 1, big);
  EXPECT_EQ(over.status().code(), StatusCode::kCorrupt) << over.status().ToString();
  EXPECT_OK(parse_raw(kCap, 1, 1, big.first(bytes - 1)).status());
  ::munmap(map, bytes);
}

// A manifest is copied (its "packing" object) and printed recursively, one stack frame per level:
// one nested 60,000 deep overflowed the stack (SIGSEGV in stoke inspect).
TEST(Manifest, DeeplyNestedJsonIsCorruptNotAStackOverflow) {
  const std::string head =
      R"({"format_version":3,"records":2,"classes":["a","b"],"class_counts":[1,1],"packing":{"x":)";
  const int kDeep = 60000;
  auto deep = Manifest::Parse(head + std::string(kDeep, '[') + std::string(kDeep, ']') + "}}");
  ASSERT_FALSE(deep.ok());
  EXPECT_EQ(deep.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(deep.status().message().find("manifest: JSON nested 60002 levels deep"),
            std::string::npos)
      << deep.status().ToString();
  // Brackets inside strings are not nesting; a few real levels are fine.
  ASSERT_OK_AND_ASSIGN(Manifest ok,
                       Manifest::Parse(head + R"("[[[[{{{{", "y": [[[[[[[[1]]]]]]]]}})"));
  EXPECT_EQ(ok.packing["y"][0][0][0][0][0][0][0][0], 1);
}

TEST(Dataset, WriteThenReadIsTheIdentity) {
  TempDir dir;
  const fs::path db = dir / "d.lmdb";
  Written w = WriteDataset(db, 300, {.commit_every_records = 64});
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(db));
  EXPECT_EQ(ds.size(), 300);
  EXPECT_EQ(ds.manifest().classes, (std::vector<std::string>{"cat", "dog", "eel"}));
  EXPECT_EQ(ds.manifest().class_counts, (std::vector<int64_t>{100, 100, 100}));
  ASSERT_OK_AND_ASSIGN(Reader reader, ds.NewReader());
  // Random access.
  for (int i : {299, 0, 150, 7}) {
    ASSERT_OK_AND_ASSIGN(RecordView r, reader.Get(i));
    EXPECT_EQ(r.index, i);
    EXPECT_EQ(r.header.label, w.labels[i]);
    EXPECT_EQ(r.header.width, static_cast<uint32_t>(10 + i));
    ASSERT_EQ(r.payload.size(), w.payloads[i].size());
    EXPECT_EQ(std::memcmp(r.payload.data(), w.payloads[i].data(), r.payload.size()), 0);
    ASSERT_OK_AND_ASSIGN(std::string src, reader.SourcePath(i));
    EXPECT_EQ(src, "src/" + std::to_string(i) + ".jpg");
  }
  // Out of range is an error, as for Get() (it read as a record without a path).
  for (int64_t bad : {int64_t{-1}, int64_t{300}}) {
    EXPECT_EQ(reader.SourcePath(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
  // Sequential scan: every record, in order.
  int64_t expected = 10;
  ASSERT_OK(reader.Scan(10, 300, [&](const RecordView& r) {
    EXPECT_EQ(r.index, expected);
    EXPECT_EQ(r.payload.size(), w.payloads[expected].size());
    EXPECT_EQ(std::memcmp(r.payload.data(), w.payloads[expected].data(), r.payload.size()), 0);
    ++expected;
    return OkStatus();
  }));
  EXPECT_EQ(expected, 300);
  EXPECT_EQ(reader.Get(300).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reader.Get(-1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reader.Scan(5, 301, [](const RecordView&) { return OkStatus(); }).code(),
            StatusCode::kInvalidArgument);
}

TEST(Dataset, ViewsPointIntoTheMap) {
  TempDir dir;
  WriteDataset(dir / "d", 3);
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "d"));
  ASSERT_OK_AND_ASSIGN(Reader reader, ds.NewReader());
  ASSERT_OK_AND_ASSIGN(RecordView a, reader.Get(0));
  ASSERT_OK_AND_ASSIGN(RecordView again, reader.Get(0));
  EXPECT_EQ(a.payload.data(), again.payload.data());  // same bytes in the map, no copies
}

TEST(Dataset, MapGrowsWhenFull) {
  TempDir dir;
  // A 1 MiB initial map cannot hold 300 records of up to 20 KB: the writer must grow it.
  Written w = WriteDataset(dir / "d", 300, {.commit_every_records = 1000, .initial_map_bytes = 1 << 20});
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "d"));
  ASSERT_OK_AND_ASSIGN(Reader reader, ds.NewReader());
  ASSERT_OK_AND_ASSIGN(RecordView r, reader.Get(299));
  EXPECT_EQ(r.payload.size(), w.payloads[299].size());
}

TEST(Dataset, ConcurrentReadersEachWithTheirOwnTransaction) {
  TempDir dir;
  Written w = WriteDataset(dir / "d", 200);
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "d"));
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto reader = ds.NewReader();
      if (!reader.ok()) {
        ++errors;
        return;
      }
      SplitMix64 g(static_cast<uint64_t>(t));
      for (int k = 0; k < 500; ++k) {
        auto i = static_cast<int64_t>(g.Below(200));
        auto r = reader->Get(i);
        if (!r.ok() || r->payload.size() != w.payloads[i].size()) ++errors;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors.load(), 0);
}

// Finds `needle` in the file and flips one byte in the middle of it.
void FlipByteOf(const fs::path& file, std::span<const std::byte> needle) {
  auto bytes = testing::ReadBytes(file);
  auto it = std::search(bytes.begin(), bytes.end(), needle.begin(), needle.end());
  ASSERT_NE(it, bytes.end());
  *(it + static_cast<ptrdiff_t>(needle.size() / 2)) ^= std::byte{0x01};
  testing::WriteBytes(file, bytes);
}

TEST(Dataset, FlippedPayloadByteIsCaughtByTheCrc) {
  TempDir dir;
  Written w = WriteDataset(dir / "d", 20);
  FlipByteOf(dir / "d" / "data.mdb", std::span(w.payloads[13]).first(64));
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "d"));
  ASSERT_OK_AND_ASSIGN(Reader reader, ds.NewReader());
  EXPECT_OK(reader.Get(12).status());
  auto bad = reader.Get(13);
  ASSERT_EQ(bad.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(bad.status().message().find("record 13"), std::string::npos) << bad.status().ToString();
  EXPECT_NE(bad.status().message().find("CRC"), std::string::npos);
  // Scan stops at the damaged record and names it.
  Status s = reader.Scan(0, 20, [](const RecordView&) { return OkStatus(); });
  EXPECT_NE(s.message().find("record 13"), std::string::npos);
  // Without CRC checks the view is returned (the decoder's strictness is then the guard).
  ASSERT_OK_AND_ASSIGN(Reader unchecked, ds.NewReader({.verify_crc = false}));
  EXPECT_OK(unchecked.Get(13).status());
}

TEST(Record, CrcCoversHeaderFieldsPayloadAndIndex) {
  std::vector<std::byte> payload(50, std::byte{3});
  RecordHeader h;
  h.label = 2;
  h.width = 5;
  SealRecordHeader(h, payload, 0);
  std::vector<std::byte> value(kRecordHeaderSize);
  EncodeRecordHeader(h, std::span<std::byte, kRecordHeaderSize>(value.data(), kRecordHeaderSize));
  value.insert(value.end(), payload.begin(), payload.end());
  ASSERT_OK_AND_ASSIGN(RecordView ok, ParseRecord(value, 0));
  EXPECT_OK(CheckCrc(ok));
  // The same bytes served as another record (a damaged B-tree pointing one key at another's
  // value) fail their check: the CRC covers the index since v3.
  ASSERT_OK_AND_ASSIGN(RecordView moved, ParseRecord(value, 1));
  const Status elsewhere = CheckCrc(moved);
  EXPECT_EQ(elsewhere.code(), StatusCode::kCorrupt);
  EXPECT_NE(elsewhere.message().find("record 1"), std::string::npos) << elsewhere.ToString();
  // A v2 record's CRC does not cover it: still read as before.
  RecordHeader v2 = h;
  v2.format_version = 2;
  v2.crc32c = 0;
  std::vector<std::byte> header_bytes(kRecordHeaderSize);
  EncodeRecordHeader(v2, std::span<std::byte, kRecordHeaderSize>(header_bytes.data(), kRecordHeaderSize));
  uint32_t crc = Crc32c(std::span(header_bytes).first(20));
  crc = Crc32c(std::span(header_bytes).subspan(24), crc);
  v2.crc32c = Crc32c(payload, crc);
  std::vector<std::byte> old(kRecordHeaderSize);
  EncodeRecordHeader(v2, std::span<std::byte, kRecordHeaderSize>(old.data(), kRecordHeaderSize));
  old.insert(old.end(), payload.begin(), payload.end());
  for (int64_t index : {0, 7}) {
    ASSERT_OK_AND_ASSIGN(RecordView r, ParseRecord(old, index));
    EXPECT_OK(CheckCrc(r));
  }
  // A flipped bit anywhere but the CRC field itself is caught: label, size fields, payload.
  for (size_t byte : {8, 12, 16, 40, 81}) {
    SCOPED_TRACE(byte);
    auto damaged = value;
    damaged[byte] ^= std::byte{0x04};
    auto r = ParseRecord(damaged, 0);
    if (r.ok()) {
      EXPECT_EQ(CheckCrc(*r).code(), StatusCode::kCorrupt);
    }
  }
}

TEST(Dataset, LabelOutsideTheClassesIsCorrupt) {
  TempDir dir;
  auto writer = DatasetWriter::Create(dir / "d", {});
  ASSERT_TRUE(writer.ok());
  RecordHeader h;
  h.label = 5;  // the manifest lists 2 classes
  writer->Append(h, RandomPayload(10, 1), "");
  Manifest m;
  m.format_version = kFormatVersion;
  m.records = 1;
  m.classes = {"a", "b"};
  m.class_counts = {1, 0};
  ASSERT_OK(writer->Finish(m));
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "d"));
  ASSERT_OK_AND_ASSIGN(Reader reader, ds.NewReader());
  auto r = reader.Get(0);
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(r.status().message().find("label 5"), std::string::npos) << r.status().ToString();
}

TEST(Dataset, MissingPathIsNotFound) {
  TempDir dir;
  auto r = Dataset::Open(dir / "nothing.lmdb");
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("nothing.lmdb"), std::string::npos);
}

TEST(Dataset, DirectoryWithoutDataIsRejected) {
  TempDir dir;
  auto r = Dataset::Open(dir.path());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("no data.mdb"), std::string::npos);
}

TEST(Dataset, GarbageFileIsRejectedCleanly) {
  TempDir dir;
  for (size_t size : {0, 10, 5000, 100000}) {
    SCOPED_TRACE(size);
    fs::create_directories(dir / "g");
    testing::WriteBytes(dir / "g" / "data.mdb", RandomPayload(size, size));
    auto r = Dataset::Open(dir / "g");
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(dir.path().string()), std::string::npos)
        << r.status().ToString();
    if (size == 0) {  // once "open: Bad file descriptor" (LMDB took it for a new environment)
      EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
      EXPECT_NE(r.status().message().find("is empty"), std::string::npos) << r.status().ToString();
    }
    // Also as a bare file path.
    auto f = Dataset::Open(dir / "g" / "data.mdb");
    EXPECT_FALSE(f.ok());
    fs::remove_all(dir / "g");
  }
}

TEST(Dataset, TruncatedDataFileIsCorruptNotACrash) {
  TempDir dir;
  WriteDataset(dir / "d", 100);
  const fs::path data = dir / "d" / "data.mdb";
  const auto full = fs::file_size(data);
  for (double keep : {0.9, 0.5, 0.2}) {
    SCOPED_TRACE(keep);
    fs::remove_all(dir / "t");
    fs::copy(dir / "d", dir / "t");
    fs::resize_file(dir / "t" / "data.mdb", static_cast<uintmax_t>(full * keep));
    auto r = Dataset::Open(dir / "t");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
    EXPECT_NE(r.status().message().find("truncated"), std::string::npos);
  }
}

// LMDB trusts its meta pages: a page size of 0 divided by zero (SIGFPE), another size read the
// wrong pages. Each damage is a kCorrupt naming the data file and the meta page, and the file's
// type is checked before LMDB opens it.
TEST(Dataset, DamagedMetaPagesAreCorruptNotACrash) {
  TempDir dir;
  WriteDataset(dir / "d", 20);
  const std::vector<std::byte> good = testing::ReadBytes(dir / "d" / "data.mdb");
  constexpr size_t kPageSizeAt = 40;  // the first meta page's page size field (meta page 1: + 4096)
  struct Damage {
    size_t at;
    uint32_t page_size;
    const char* want;
  };
  for (const Damage& d : {Damage{kPageSizeAt, 0, "meta page 0 is damaged (page size 0"},
                          Damage{4096 + kPageSizeAt, 0, "meta page 1 is damaged (page size 0"},
                          Damage{kPageSizeAt, 0x3000, "meta page 0 is damaged (page size 12288"},
                          Damage{4096 + kPageSizeAt, 8192, "meta page 1 is damaged (page size 8192"}}) {
    SCOPED_TRACE(d.want);
    std::vector<std::byte> bad = good;
    std::memcpy(bad.data() + d.at, &d.page_size, sizeof(d.page_size));
    fs::remove_all(dir / "m");
    fs::create_directories(dir / "m");
    testing::WriteBytes(dir / "m" / "data.mdb", bad);
    auto r = Dataset::Open(dir / "m");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
    EXPECT_NE(r.status().message().find(d.want), std::string::npos) << r.status().ToString();
    EXPECT_NE(r.status().message().find((dir / "m" / "data.mdb").string()), std::string::npos);
  }
  // One page: the second meta page is missing.
  testing::WriteBytes(dir / "m" / "data.mdb", std::vector<std::byte>(good.begin(), good.begin() + 4096));
  auto one_page = Dataset::Open(dir / "m");
  EXPECT_EQ(one_page.status().code(), StatusCode::kCorrupt) << one_page.status().ToString();
  EXPECT_NE(one_page.status().message().find("truncated: 4096 bytes"), std::string::npos) << one_page.status().ToString();
  // data.mdb that is a folder or a FIFO: named, and said what was expected.
  fs::remove_all(dir / "m");
  fs::create_directories(dir / "m" / "data.mdb");
  auto folder = Dataset::Open(dir / "m");
  EXPECT_NE(folder.status().message().find("data.mdb is not a regular file"), std::string::npos)
      << folder.status().ToString();
  fs::remove_all(dir / "m");
  fs::create_directories(dir / "m");
  ASSERT_EQ(::mkfifo((dir / "m" / "data.mdb").c_str(), 0600), 0);
  auto fifo = Dataset::Open(dir / "m");
  EXPECT_NE(fifo.status().message().find("data.mdb is not a regular file"), std::string::npos) << fifo.status().ToString();
}

// Resuming a partial dataset whose file lost its tail crashed LMDB (SIGBUS) or appended records
// after the hole and reported success; it is refused, saying the pack must start over.
// A zeroed leaf page of the records table (a bad disk block): LMDB asserts on it while walking the
// table (which aborted the process), and a transaction that met it refused every later read
// (MDB_BAD_TXN: one bad page made every following record "bad"). Now the records on that page are
// bad, each an error, and every other record reads as before.
TEST(Dataset, AZeroedLeafPageCostsItsRecordsOnly) {
  TempDir dir;
  Written w = WriteDataset(dir / "d", 600);
  const size_t lost = testing::ZeroRecordsLeafPage(dir / "d" / "data.mdb", 1);
  ASSERT_GT(lost, 0u) << "expected the records table to span several leaf pages";
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "d"));
  auto extents = ds.RecordExtents();  // walks the table: an error, not abort()
  if (!extents.ok()) {
    EXPECT_EQ(extents.status().code(), StatusCode::kCorrupt) << extents.status().ToString();
  }
  ASSERT_OK_AND_ASSIGN(Reader reader, ds.NewReader());
  size_t bad = 0;
  for (int64_t i = 0; i < ds.size(); ++i) {
    auto r = reader.Get(i);
    if (!r.ok()) {
      ++bad;
      EXPECT_EQ(r.status().message().find("BAD_TXN"), std::string::npos) << r.status().ToString();
      EXPECT_NE(r.status().message().find("record " + std::to_string(i)), std::string::npos) << r.status().ToString();
      continue;
    }
    EXPECT_TRUE(std::equal(r->payload.begin(), r->payload.end(), w.payloads[static_cast<size_t>(i)].begin(),
                           w.payloads[static_cast<size_t>(i)].end()))
        << "record " << i;
  }
  EXPECT_EQ(bad, lost);
  // A scan stops at the first bad record; the same reader then reads on.
  int64_t scanned = 0;
  const Status scan = reader.Scan(0, ds.size(), [&](const RecordView&) {
    ++scanned;
    return OkStatus();
  });
  EXPECT_FALSE(scan.ok());
  EXPECT_LT(scanned, ds.size());
  EXPECT_OK(reader.Get(0).status());
  EXPECT_OK(reader.Get(ds.size() - 1).status());
}

TEST(Dataset, DamagedPartialDatasetIsNotResumed) {
  TempDir dir;
  {
    auto writer = DatasetWriter::Create(dir / "p", {});
    ASSERT_TRUE(writer.ok());
    for (int i = 0; i < 40; ++i) writer->Append(RecordHeader{}, RandomPayload(20000, static_cast<uint32_t>(i)), "a");
    ASSERT_OK(writer->Commit("{\"next_input\": 40}"));
  }  // dropped without Finish(): like a killed pack
  const auto full = fs::file_size(dir / "p" / "data.mdb");
  for (uintmax_t size : {uintmax_t{8192}, uintmax_t{12288}, full / 2, full - 4096}) {
    SCOPED_TRACE(size);
    fs::remove_all(dir / "t");
    fs::copy(dir / "p", dir / "t");
    fs::resize_file(dir / "t" / "data.mdb", size);
    auto r = DatasetWriter::OpenForAppend(dir / "t", {});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
    EXPECT_NE(r.status().message().find("truncated"), std::string::npos) << r.status().ToString();
    EXPECT_NE(r.status().message().find("--overwrite"), std::string::npos) << r.status().ToString();
  }
  // An empty data file (a pack stopped before LMDB wrote its first pages) resumes from nothing.
  fs::create_directories(dir / "e");
  testing::WriteBytes(dir / "e" / "data.mdb", {});
  ASSERT_OK_AND_ASSIGN(DatasetWriter fresh, DatasetWriter::OpenForAppend(dir / "e", {}));
  EXPECT_EQ(fresh.committed_records(), 0);
}

TEST(Dataset, OtherFormatVersionIsRejectedWithAdvice) {
  TempDir dir;
  auto writer = DatasetWriter::Create(dir / "v2", {});
  ASSERT_TRUE(writer.ok());
  Manifest m;
  m.format_version = kFormatVersion + 1;
  ASSERT_OK(writer->Finish(m));
  auto r = Dataset::Open(dir / "v2");
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("re-pack"), std::string::npos) << r.status().ToString();
}

TEST(Dataset, VersionOneDatasetsStillOpen) {
  TempDir dir;
  auto writer = DatasetWriter::Create(dir / "v1", {});
  ASSERT_TRUE(writer.ok());
  Manifest m;
  m.format_version = 1;
  ASSERT_OK(writer->Finish(m));
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "v1"));
  EXPECT_EQ(ds.manifest().format_version, 1u);
}

// A manifest the writer could not have written right is refused by Finish, which can be called
// again: no format_version (finished, the dataset then could not be opened), another record count.
TEST(Dataset, FinishRefusesAManifestWithoutAVersionOrOfAnotherRecordCount) {
  TempDir dir;
  auto writer = DatasetWriter::Create(dir / "d", {});
  ASSERT_OK(writer.status());
  writer->Append(RecordHeader{}, RandomPayload(64, 1), "");
  Manifest m;
  m.records = 1;
  m.classes = {"only"};
  m.class_counts = {1};
  Status s = writer->Finish(m);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("format_version 0 (not set)"), std::string::npos) << s.ToString();
  m.format_version = kFormatVersion;
  m.records = 2;
  EXPECT_EQ(writer->Finish(m).code(), StatusCode::kInvalidArgument);
  m.records = 1;
  ASSERT_OK(writer->Finish(m));
  ASSERT_OK(Dataset::Open(dir / "d").status());
}

TEST(Dataset, UnfinishedPackSaysHowToFinishIt) {
  TempDir dir;
  {
    auto writer = DatasetWriter::Create(dir / "p", {});
    ASSERT_TRUE(writer.ok());
    writer->Append(RecordHeader{}, RandomPayload(10, 1), "a");
    ASSERT_OK(writer->Commit("{\"next_input\": 1}"));
  }  // dropped without Finish(): like a killed pack
  auto r = Dataset::Open(dir / "p");
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("--resume"), std::string::npos);
  ASSERT_OK_AND_ASSIGN(DatasetWriter again, DatasetWriter::OpenForAppend(dir / "p", {}));
  EXPECT_EQ(again.committed_records(), 1);
  EXPECT_EQ(again.resume_state(), "{\"next_input\": 1}");
}

TEST(Dataset, CreateRefusesNonEmptyDirectory) {
  TempDir dir;
  testing::WriteBytes(dir / "x" / "file", RandomPayload(3, 1));
  EXPECT_EQ(DatasetWriter::Create(dir / "x", {}).status().code(), StatusCode::kInvalidArgument);
}

// ---- Damaged and foreign LMDB files ----

// Writes key = value into a dataset's LMDB file through LMDB itself, as another program (or a
// hostile one) could: into the named table `table` (created if missing), or with nullptr into
// LMDB's main table, beside the named tables' entries.
// Runs `edit` in a write transaction on the dataset's LMDB file, committed when it returns without
// a fatal failure.
void EditLmdb(const fs::path& dir, const std::function<void(MDB_txn*)>& edit) {
  MDB_env* raw = nullptr;
  ASSERT_EQ(mdb_env_create(&raw), MDB_SUCCESS);
  MdbEnv env(raw);
  mdb_env_set_maxdbs(raw, 4);
  ASSERT_EQ(mdb_env_open(raw, dir.c_str(), MDB_NOLOCK, 0644), MDB_SUCCESS);
  MDB_txn* txn = nullptr;
  ASSERT_EQ(mdb_txn_begin(raw, nullptr, 0, &txn), MDB_SUCCESS);
  edit(txn);
  if (::testing::Test::HasFatalFailure()) return mdb_txn_abort(txn);
  ASSERT_EQ(mdb_txn_commit(txn), MDB_SUCCESS);
}

void PutLmdb(const fs::path& dir, const char* table, const std::string& key,
             const std::string& value) {
  EditLmdb(dir, [&](MDB_txn* txn) {
    MDB_dbi dbi = 0;
    ASSERT_EQ(mdb_dbi_open(txn, table, table != nullptr ? MDB_CREATE : 0, &dbi), MDB_SUCCESS);
    MDB_val k{key.size(), const_cast<char*>(key.data())},
        v{value.size(), const_cast<char*>(value.data())};
    ASSERT_EQ(mdb_put(txn, dbi, &k, &v, 0), MDB_SUCCESS);
  });
}

uint64_t Load64(const std::vector<std::byte>& bytes, size_t at) {
  uint64_t v;
  std::memcpy(&v, bytes.data() + at, sizeof v);
  return v;
}

// Where the newer of the two LMDB meta pages starts (the one LMDB reads through); 4096-byte pages.
size_t NewerMetaAt(const std::vector<std::byte>& bytes) {
  return Load64(bytes, 4096 + 144) > Load64(bytes, 144) ? 4096 : 0;
}
constexpr size_t kMainRootAt = 128;  // in a meta page: the main table's root page number

// Overwrites every copy of the named table's entry in the main table: `at` bytes into the entry
// (its 8-byte node header, the name, then LMDB's 48-byte table record), with `patch`. Returns how
// many copies there were.
size_t PatchTableEntry(const fs::path& data_mdb, const std::string& table, size_t at,
                       std::span<const std::byte> patch) {
  auto bytes = testing::ReadBytes(data_mdb);
  std::vector<std::byte> node(8);
  // The node header: data size (low and high 16 bits), flags (F_SUBDATA), key size.
  const uint16_t header[4] = {48, 0, 2, static_cast<uint16_t>(table.size())};
  std::memcpy(node.data(), header, sizeof header);
  for (char c : table) node.push_back(static_cast<std::byte>(c));
  size_t copies = 0;
  for (auto it = bytes.begin();
       (it = std::search(it, bytes.end(), node.begin(), node.end())) != bytes.end(); ++it) {
    std::copy(patch.begin(), patch.end(), it + static_cast<ptrdiff_t>(at));
    ++copies;
  }
  testing::WriteBytes(data_mdb, bytes);
  return copies;
}

// mdb_dbi_open reads LMDB's main table, which lists the named tables; it ran unguarded, so one
// damaged byte there killed stoke inspect and stoke pack --resume with SIGBUS. Now it is a
// kCorrupt naming the dataset and saying the file is damaged.
TEST(Dataset, DamagedMainTablePageIsCorruptNotACrash) {
  TempDir dir;
  WriteDataset(dir / "d", 30);
  const std::vector<std::byte> good = testing::ReadBytes(dir / "d" / "data.mdb");
  const uint64_t root = Load64(good, NewerMetaAt(good) + kMainRootAt);
  ASSERT_GE(root, 2u);
  // The root page's mp_lower (end of its slot array) 22 -> 6: LMDB then counts about 2^31 keys.
  std::vector<std::byte> bad = good;
  bad[root * 4096 + 12] = std::byte{6};
  bad[root * 4096 + 13] = std::byte{0};
  testing::WriteBytes(dir / "d" / "data.mdb", bad);
  auto r = Dataset::Open(dir / "d");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
  EXPECT_NE(r.status().message().find((dir / "d").string()), std::string::npos)
      << r.status().ToString();
  EXPECT_NE(r.status().message().find("damaged"), std::string::npos) << r.status().ToString();
  EXPECT_EQ(r.status().message().find("not a stoke dataset"), std::string::npos)
      << r.status().ToString();

  // The flags of the paths table's entry all set (a table with duplicates, in overflow pages).
  testing::WriteBytes(dir / "d" / "data.mdb", good);
  const std::array<std::byte, 2> all_flags{std::byte{0xff}, std::byte{0xff}};
  ASSERT_GT(PatchTableEntry(dir / "d" / "data.mdb", "paths", 4, all_flags), 0u);
  auto paths = Dataset::Open(dir / "d");
  ASSERT_FALSE(paths.ok());
  EXPECT_EQ(paths.status().code(), StatusCode::kCorrupt) << paths.status().ToString();

  // The same damage in an interrupted pack: resuming it is refused, saying to pack again.
  {
    auto writer = DatasetWriter::Create(dir / "p", {});
    ASSERT_TRUE(writer.ok());
    for (int i = 0; i < 5; ++i) {
      writer->Append(RecordHeader{}, RandomPayload(1000, static_cast<uint64_t>(i)), "a");
    }
    ASSERT_OK(writer->Commit("{\"next_input\": 5}"));
  }
  auto partial = testing::ReadBytes(dir / "p" / "data.mdb");
  const uint64_t partial_root = Load64(partial, NewerMetaAt(partial) + kMainRootAt);
  partial[partial_root * 4096 + 12] = std::byte{6};
  partial[partial_root * 4096 + 13] = std::byte{0};
  testing::WriteBytes(dir / "p" / "data.mdb", partial);
  auto resumed = DatasetWriter::OpenForAppend(dir / "p", {});
  ASSERT_FALSE(resumed.ok());
  EXPECT_EQ(resumed.status().code(), StatusCode::kCorrupt) << resumed.status().ToString();
  EXPECT_NE(resumed.status().message().find("damaged"), std::string::npos)
      << resumed.status().ToString();
  EXPECT_NE(resumed.status().message().find("--overwrite"), std::string::npos)
      << resumed.status().ToString();
}

// A meta page's table roots were not checked: a main root of 0 (or 1, a meta page) made LMDB
// assert ("Assertion 'root > 1' failed") and abort the process.
TEST(Dataset, MetaPageRootsOutsideThePagesAreCorrupt) {
  TempDir dir;
  WriteDataset(dir / "d", 20);
  const std::vector<std::byte> good = testing::ReadBytes(dir / "d" / "data.mdb");
  const size_t meta = NewerMetaAt(good);
  const uint64_t last_page = Load64(good, meta + 136);
  struct Damage {
    size_t at;
    uint64_t root;
    std::string want;
  };
  for (const Damage& d :
       {Damage{kMainRootAt, 0, "main table's root is page 0"},
        Damage{kMainRootAt, 1, "main table's root is page 1"},
        Damage{kMainRootAt, last_page + 1,
               fmt::format("root is page {}; expected 2 to {}", last_page + 1, last_page)},
        Damage{80, 0, "free-page table's root is page 0"}}) {
    SCOPED_TRACE(d.want);
    std::vector<std::byte> bad = good;
    std::memcpy(bad.data() + meta + d.at, &d.root, sizeof d.root);
    testing::WriteBytes(dir / "d" / "data.mdb", bad);
    auto r = Dataset::Open(dir / "d");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
    EXPECT_NE(r.status().message().find(d.want), std::string::npos) << r.status().ToString();
    EXPECT_NE(r.status().message().find((dir / "d" / "data.mdb").string()), std::string::npos)
        << r.status().ToString();
  }
  // An empty table has no root (~0): an untouched first meta page says so for both.
  testing::WriteBytes(dir / "d" / "data.mdb", good);
  EXPECT_OK(Dataset::Open(dir / "d").status());
}

TEST(Dataset, DeeplyNestedManifestIsCorruptNamingTheDataset) {
  TempDir dir;
  WriteDataset(dir / "d", 3);
  const int kDeep = 60000;
  PutLmdb(
      dir / "d", kMetaDb, kManifestKey,
      R"({"format_version":3,"records":3,"classes":["cat","dog","eel"],"class_counts":[1,1,1],"packing":{"x":)" +
          std::string(kDeep, '[') + std::string(kDeep, ']') + "}}");
  auto r = Dataset::Open(dir / "d");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
  EXPECT_NE(r.status().message().find((dir / "d").string() + ": manifest: JSON nested"),
            std::string::npos)
      << r.status().ToString();
}

// LMDB's entry count for the records table was taken as the record count: with a manifest to
// match, 2^33 entries claimed for 30 stored made inspect walk 2^33 missing records and the
// sampler allocate 64 GiB. The count is held against the file's size and the first and last keys.
TEST(Dataset, RecordCountBeyondTheStoredKeysIsCorrupt) {
  TempDir dir;
  WriteDataset(dir / "d", 30);
  const std::vector<std::byte> good = testing::ReadBytes(dir / "d" / "data.mdb");
  for (int64_t claimed : {int64_t{1} << 33, int64_t{31}}) {
    SCOPED_TRACE(claimed);
    testing::WriteBytes(dir / "d" / "data.mdb", good);
    PutLmdb(
        dir / "d", kMetaDb, kManifestKey,
        fmt::format(
            R"({{"format_version":3,"records":{},"classes":["cat","dog","eel"],"class_counts":[{},10,10]}})",
            claimed, claimed - 20));
    const uint64_t entries = static_cast<uint64_t>(claimed);
    ASSERT_GT(PatchTableEntry(dir / "d" / "data.mdb", "records", 15 + 32,
                              std::as_bytes(std::span(&entries, 1))),
              0u);
    auto r = Dataset::Open(dir / "d");
    ASSERT_FALSE(r.ok()) << "opened with " << r->size() << " records";
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
    EXPECT_NE(r.status().message().find(fmt::format("counts {} records", claimed)),
              std::string::npos)
        << r.status().ToString();
    if (claimed == 31) {
      EXPECT_NE(r.status().message().find("last key is record 29, not record 30"),
                std::string::npos)
          << r.status().ToString();
    }
  }
  testing::WriteBytes(dir / "d" / "data.mdb", good);
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "d"));
  EXPECT_EQ(ds.size(), 30);
}

// Deletes the records `gone` from the records table and stores a copy of record 0 as each of
// `added`, as a damaged or hand-edited file would have them.
void EditRecordKeys(const fs::path& dir, std::initializer_list<uint64_t> gone, std::initializer_list<uint64_t> added) {
  EditLmdb(dir, [&](MDB_txn* txn) {
    MDB_dbi dbi = 0;
    ASSERT_EQ(mdb_dbi_open(txn, kRecordsDb, 0, &dbi), MDB_SUCCESS);
    std::array<std::byte, 8> key;
    MDB_val k{key.size(), key.data()}, first;
    EncodeKey(0, key);
    ASSERT_EQ(mdb_get(txn, dbi, &k, &first), MDB_SUCCESS);
    const std::vector<std::byte> copy(static_cast<const std::byte*>(first.mv_data),
                                      static_cast<const std::byte*>(first.mv_data) + first.mv_size);
    for (uint64_t i : gone) {
      EncodeKey(i, key);
      ASSERT_EQ(mdb_del(txn, dbi, &k, nullptr), MDB_SUCCESS) << i;
    }
    for (uint64_t i : added) {
      EncodeKey(i, key);
      MDB_val v{copy.size(), const_cast<std::byte*>(copy.data())};
      ASSERT_EQ(mdb_put(txn, dbi, &k, &v, 0), MDB_SUCCESS) << i;
    }
  });
}

// A records table with records deleted (or others added) gave only the two counts: which record
// to restore or repack was not said. The open error now names them.
TEST(Dataset, MissingOrExtraRecordsAreNamedWhenTheCountsDisagree) {
  TempDir dir;
  WriteDataset(dir / "d", 30);
  const std::vector<std::byte> good = testing::ReadBytes(dir / "d" / "data.mdb");
  struct Case {
    std::initializer_list<uint64_t> gone, added;
    std::string says;
  };
  for (const Case& c : {Case{{17}, {}, "holds 29 records, manifest says 30; record 17 is missing"},
                        Case{{0, 29}, {}, "records 0, 29 are missing"},
                        Case{{3, 4, 5, 6, 7}, {}, "records 3, 4, 5 and 2 more are missing"},
                        Case{{}, {30, 1000}, "holds 32 records, manifest says 30; records 30, 1000 are beyond the manifest's 30"},
                        Case{{12}, {40}, "its last key is record 40, not record 29"},
                        // Keys past int64 (damage): named as they are (they were clamped, and overflowed).
                        Case{{}, {uint64_t{1} << 63, 0xFFFFFFFFFFFFFFF0u},
                             "records 9223372036854775808, 18446744073709551600 are beyond the manifest's 30"}}) {
    SCOPED_TRACE(c.says);
    testing::WriteBytes(dir / "d" / "data.mdb", good);
    EditRecordKeys(dir / "d", c.gone, c.added);
    auto r = Dataset::Open(dir / "d");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
    // (With as many added as deleted the counts agree: the last key is what differs.)
    EXPECT_NE(r.status().message().find(c.says), std::string::npos) << r.status().ToString();
  }
}

// A folder whose data.mdb cannot be looked at was called "not a stoke dataset (no data.mdb
// inside)": the error the system gave was dropped.
TEST(Dataset, UnreadableDataFileIsAnIoErrorNotNotADataset) {
  TempDir dir;
  WriteDataset(dir / "d", 3);
  fs::create_directories(dir / "loop");
  fs::create_symlink("data.mdb", dir / "loop" / "data.mdb");  // a link to itself: ELOOP
  auto loop = Dataset::Open(dir / "loop");
  EXPECT_EQ(loop.status().code(), StatusCode::kIoError) << loop.status().ToString();
  EXPECT_NE(loop.status().message().find((dir / "loop" / "data.mdb").string()), std::string::npos)
      << loop.status().ToString();
  EXPECT_NE(loop.status().message().find(std::strerror(ELOOP)), std::string::npos)
      << loop.status().ToString();
  // A folder that may be listed but not entered (EACCES), opened by an unprivileged user: a child
  // process drops root's rights first, where the tests run as root.
  fs::permissions(dir.path(), fs::perms::others_exec, fs::perm_options::add);
  fs::permissions(dir / "d", fs::perms::owner_all | fs::perms::group_read | fs::perms::others_read);
  EXPECT_EXIT(
      {
        if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) std::_Exit(100);
        const Status s = Dataset::Open(dir / "d").status();
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        std::_Exit(static_cast<int>(s.code()));
      },
      ::testing::ExitedWithCode(static_cast<int>(StatusCode::kIoError)),
      "I/O error: dataset: .*/d: .*/d/data.mdb: Permission denied");
  fs::permissions(dir / "d", fs::perms::owner_all);
}

// Another program's LMDB file whose main table holds plain keys "meta" and "records" (stoke's
// table names) gave "internal: ... MDB_INCOMPATIBLE".
TEST(Dataset, AnotherProgramsLmdbFileIsNotAStokeDataset) {
  TempDir dir;
  fs::create_directories(dir / "f");
  PutLmdb(dir / "f", nullptr, "meta", "hello");
  PutLmdb(dir / "f", nullptr, "records", "hello");
  auto r = Dataset::Open(dir / "f");
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("not a stoke dataset"), std::string::npos)
      << r.status().ToString();
  auto resumed = DatasetWriter::OpenForAppend(dir / "f", {});
  EXPECT_EQ(resumed.status().code(), StatusCode::kInvalidArgument) << resumed.status().ToString();
  // A real meta table with a manifest, but "records" a plain key.
  fs::create_directories(dir / "g");
  PutLmdb(dir / "g", kMetaDb, kManifestKey,
          R"({"format_version":3,"records":0,"classes":[],"class_counts":[]})");
  PutLmdb(dir / "g", nullptr, "records", "hello");
  auto g = Dataset::Open(dir / "g");
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument) << g.status().ToString();
  EXPECT_NE(g.status().message().find("'records'"), std::string::npos) << g.status().ToString();
}

// A dataset whose manifest lists source paths but whose paths table is gone (or is a plain key
// another program wrote) read as a dataset without paths: every source path came back "" and
// nothing said why. It still opens (the records are intact), and a source path is an error.
TEST(Dataset, AMissingPathsTableIsAnErrorNotEmptyPaths) {
  TempDir dir;
  for (const bool plain_key : {false, true}) {
    SCOPED_TRACE(plain_key ? "plain key" : "dropped");
    const fs::path db = dir / (plain_key ? "p" : "d");
    WriteDataset(db, 5);
    {
      ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(db));
      ASSERT_TRUE(ds.manifest().has_paths);
      EXPECT_OK(ds.paths_status());
    }
    MDB_env* raw = nullptr;
    ASSERT_EQ(mdb_env_create(&raw), MDB_SUCCESS);
    {
      MdbEnv env(raw);
      mdb_env_set_maxdbs(raw, 4);
      ASSERT_EQ(mdb_env_open(raw, db.c_str(), MDB_NOLOCK, 0644), MDB_SUCCESS);
      MDB_txn* txn = nullptr;
      ASSERT_EQ(mdb_txn_begin(raw, nullptr, 0, &txn), MDB_SUCCESS);
      MDB_dbi dbi = 0;
      ASSERT_EQ(mdb_dbi_open(txn, kPathsDb, 0, &dbi), MDB_SUCCESS);
      ASSERT_EQ(mdb_drop(txn, dbi, 1), MDB_SUCCESS);  // deletes the table and its entry
      ASSERT_EQ(mdb_txn_commit(txn), MDB_SUCCESS);
    }
    if (plain_key) PutLmdb(db, nullptr, kPathsDb, "not a table");
    ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(db));
    EXPECT_EQ(ds.paths_status().code(), StatusCode::kCorrupt);
    ASSERT_OK_AND_ASSIGN(Reader reader, ds.NewReader());
    ASSERT_OK(reader.Get(3).status());
    auto source = reader.SourcePath(3);
    EXPECT_EQ(source.status().code(), StatusCode::kCorrupt) << source.status().ToString();
    EXPECT_NE(source.status().message().find("source paths"), std::string::npos) << source.status().ToString();
    EXPECT_NE(source.status().message().find(db.string()), std::string::npos) << source.status().ToString();
  }
}

// A manifest of a newer format (whose fields may have moved) was reported as damaged: "missing
// field 'class_counts'". Its version is read first.
TEST(Dataset, NewerFormatIsNamedAsSuchNotAsDamage) {
  TempDir dir;
  WriteDataset(dir / "d", 3);
  const std::string v4 = fmt::format(
      R"({{"format_version":{},"records":3,"classes":{{"names":["a","b","c"]}},"counts":[1,1,1]}})",
      kFormatVersion + 1);
  PutLmdb(dir / "d", kMetaDb, kManifestKey, v4);
  auto r = Dataset::Open(dir / "d");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find(
                fmt::format("written by a newer stoke (format v{}, this build reads up to v{})",
                            kFormatVersion + 1, kFormatVersion)),
            std::string::npos)
      << r.status().ToString();
  EXPECT_NE(r.status().message().find((dir / "d").string()), std::string::npos)
      << r.status().ToString();
}

// ---- Sampler ----

std::vector<int64_t> Sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<int64_t> Iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

TEST(Sampler, SequentialIsIndexOrder) {
  ASSERT_OK_AND_ASSIGN(Sampler s, Sampler::Create(10, {.mode = ShuffleMode::kSequential}));
  EXPECT_EQ(s.Epoch(0), Iota(10));
  EXPECT_EQ(s.Epoch(5), Iota(10));
}

TEST(Sampler, ShufflesAreDeterministicPermutations) {
  for (ShuffleMode mode : {ShuffleMode::kFull, ShuffleMode::kBlock}) {
    for (uint64_t seed : {0ull, 1ull, 977ull}) {
      SCOPED_TRACE(::testing::Message() << "mode " << static_cast<int>(mode) << " seed " << seed);
      SamplerOptions o{.mode = mode, .seed = seed, .block_size = 16, .window_blocks = 4};
      ASSERT_OK_AND_ASSIGN(Sampler a, Sampler::Create(1003, o));
      ASSERT_OK_AND_ASSIGN(Sampler b, Sampler::Create(1003, o));
      auto e0 = a.Epoch(0);
      EXPECT_EQ(e0, b.Epoch(0));               // same (seed, epoch): same order
      EXPECT_EQ(Sorted(e0), Iota(1003));       // a permutation
      EXPECT_NE(e0, a.Epoch(1));               // a new order each epoch
      EXPECT_NE(e0, Iota(1003));               // actually shuffled
      o.seed += 1;
      ASSERT_OK_AND_ASSIGN(Sampler c, Sampler::Create(1003, o));
      EXPECT_NE(e0, c.Epoch(0));               // another seed: another order
    }
  }
}

TEST(Sampler, BlockShuffleKeepsReadsLocal) {
  // Within any window of window_blocks*block_size consecutive samples, indices come from at most
  // window_blocks distinct blocks.
  SamplerOptions o{.mode = ShuffleMode::kBlock, .seed = 3, .block_size = 32, .window_blocks = 4};
  ASSERT_OK_AND_ASSIGN(Sampler s, Sampler::Create(4096, o));
  auto order = s.Epoch(2);
  for (size_t start = 0; start < order.size(); start += 128) {
    std::set<int64_t> blocks;
    for (size_t i = start; i < start + 128; ++i) blocks.insert(order[i] / 32);
    EXPECT_LE(blocks.size(), 4u);
  }
}

TEST(Sampler, HugeBlocksAndWindowsAreTheWholeDatasetNotAnOverflow) {
  // block_size * window_blocks once overflowed: a crash in the shuffle, a window of 0 that never
  // advanced. Clamped to the dataset, they give the order their values mean.
  const SamplerOptions whole{.mode = ShuffleMode::kBlock, .seed = 5, .block_size = 100, .window_blocks = 1};
  ASSERT_OK_AND_ASSIGN(Sampler want, Sampler::Create(100, whole));
  for (auto [bs, wb] : std::vector<std::pair<int64_t, int64_t>>{
           {int64_t{1} << 32, int64_t{1} << 32}, {INT64_MAX, 1}, {100, INT64_MAX}, {101, 7}}) {
    SamplerOptions o = whole;
    o.block_size = bs;
    o.window_blocks = wb;
    ASSERT_OK_AND_ASSIGN(Sampler s, Sampler::Create(100, o));
    EXPECT_EQ(s.Epoch(3), want.Epoch(3)) << bs << " x " << wb;
    EXPECT_EQ(s.options().block_size, 100);
    EXPECT_EQ(s.options().window_blocks, 1);
  }
  // Values that fit are left as they are (the order of existing runs does not change).
  SamplerOptions fits{.mode = ShuffleMode::kBlock, .seed = 5, .block_size = 8, .window_blocks = 3};
  ASSERT_OK_AND_ASSIGN(Sampler a, Sampler::Create(100, fits));
  EXPECT_EQ(a.options().block_size, 8);
  EXPECT_EQ(a.options().window_blocks, 3);
}

TEST(Sampler, ShardsAreDisjointEqualAndCoverTheEpoch) {
  for (int64_t n : {1000, 1001, 1003, 7}) {
    for (int world : {1, 2, 3, 4}) {
      for (bool drop_last : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "n " << n << " world " << world << " drop " << drop_last);
        std::vector<std::vector<int64_t>> shards;
        for (int rank = 0; rank < world; ++rank) {
          SamplerOptions o{.mode = ShuffleMode::kFull, .seed = 11, .rank = rank,
                           .world_size = world, .drop_last = drop_last};
          ASSERT_OK_AND_ASSIGN(Sampler s, Sampler::Create(n, o));
          shards.push_back(s.Epoch(4));
        }
        const size_t per = shards[0].size();
        std::vector<int64_t> all;
        for (const auto& sh : shards) {
          EXPECT_EQ(sh.size(), per);  // equal-sized
          all.insert(all.end(), sh.begin(), sh.end());
        }
        std::set<int64_t> distinct(all.begin(), all.end());
        if (drop_last) {
          EXPECT_EQ(distinct.size(), all.size());  // disjoint
          EXPECT_EQ(per, static_cast<size_t>(n / world));
        } else {
          EXPECT_EQ(distinct.size(), static_cast<size_t>(n));  // covers the epoch
          EXPECT_EQ(all.size() - distinct.size(), static_cast<size_t>((world - n % world) % world));
        }
        if (n % world == 0) {
          EXPECT_EQ(distinct.size(), static_cast<size_t>(n));
          EXPECT_EQ(all.size(), static_cast<size_t>(n));
        }
      }
    }
  }
}

// The elastic guarantee: with a fixed global batch, global batch k is the same samples whatever
// the world size, and rank r's batch k is its slice [rB, (r+1)B) of it.
TEST(Sampler, GlobalBatchSlicesAreTheSameBatchForEveryWorldSize) {
  for (ShuffleMode mode : {ShuffleMode::kFull, ShuffleMode::kBlock, ShuffleMode::kSequential}) {
    for (int64_t n : {1000, 1003, 840}) {
      const int64_t g = 840;  // divisible by 1..8
      for (bool drop_last : {false, true}) {
        SamplerOptions one{.mode = mode, .seed = 5, .block_size = 16, .window_blocks = 4, .drop_last = drop_last,
                           .sharding = Sharding::kGlobalBatch, .global_batch = g};
        ASSERT_OK_AND_ASSIGN(Sampler single, Sampler::Create(n, one));
        const std::vector<int64_t> reference = single.Epoch(3);
        const int64_t full = n / g;
        for (int world = 1; world <= 8; ++world) {
          SCOPED_TRACE(::testing::Message() << "mode " << static_cast<int>(mode) << " n " << n << " world " << world
                                            << " drop " << drop_last);
          const int64_t b = g / world;
          std::vector<std::vector<int64_t>> ranks;
          for (int r = 0; r < world; ++r) {
            SamplerOptions o = one;
            o.rank = r;
            o.world_size = world;
            ASSERT_OK_AND_ASSIGN(Sampler s, Sampler::Create(n, o));
            ranks.push_back(s.Epoch(3));
            EXPECT_EQ(static_cast<int64_t>(ranks.back().size()), s.samples_per_rank());
            // The positions name the same samples in the global order.
            const std::vector<int64_t> positions = s.ShardPositions(), global = s.GlobalOrder(3);
            ASSERT_EQ(positions.size(), ranks.back().size());
            for (size_t i = 0; i < positions.size(); ++i) {
              ASSERT_EQ(global[static_cast<size_t>(positions[i])], ranks.back()[i]) << "sample " << i;
            }
            EXPECT_EQ(ranks.back().size(), ranks[0].size());  // equal on every rank
          }
          for (int64_t k = 0; k < full; ++k) {
            std::vector<int64_t> joined;
            for (int r = 0; r < world; ++r) {
              const auto& mine = ranks[static_cast<size_t>(r)];
              joined.insert(joined.end(), mine.begin() + k * b, mine.begin() + (k + 1) * b);
            }
            const std::vector<int64_t> want(reference.begin() + k * g, reference.begin() + (k + 1) * g);
            ASSERT_EQ(joined, want) << "global batch " << k;  // same samples, in the same order
          }
          // The tail: every leftover record once when padded (some twice); disjoint when cut.
          std::multiset<int64_t> tail;
          for (const auto& mine : ranks) tail.insert(mine.begin() + full * b, mine.end());
          std::set<int64_t> tail_distinct(tail.begin(), tail.end());
          if (drop_last) {
            EXPECT_EQ(tail_distinct.size(), tail.size());
            EXPECT_EQ(static_cast<int64_t>(tail.size()), (n % g) / world * world);
          } else {
            std::set<int64_t> single_tail(reference.begin() + full * g, reference.begin() + full * g + (n % g));
            for (int64_t x : single_tail) EXPECT_TRUE(tail_distinct.count(x)) << x;
          }
        }
      }
    }
  }
}

TEST(Sampler, ExactShardsCountEveryRecordOnce) {
  for (int64_t n : {0, 1, 7, 1000, 1003}) {
    for (int world = 1; world <= 8; ++world) {
      SCOPED_TRACE(::testing::Message() << "n " << n << " world " << world);
      std::vector<int64_t> all;
      for (int r = 0; r < world; ++r) {
        SamplerOptions o{.mode = ShuffleMode::kSequential, .rank = r, .world_size = world, .sharding = Sharding::kExact};
        ASSERT_OK_AND_ASSIGN(Sampler s, Sampler::Create(n, o));
        auto mine = s.Epoch(0);
        EXPECT_EQ(static_cast<int64_t>(mine.size()), s.samples_per_rank());
        EXPECT_LE(static_cast<int64_t>(mine.size()), n / world + 1);
        all.insert(all.end(), mine.begin(), mine.end());
      }
      std::vector<int64_t> want(static_cast<size_t>(n));
      std::iota(want.begin(), want.end(), int64_t{0});
      EXPECT_EQ(all, want);
    }
  }
}

TEST(Sampler, RejectsBadOptions) {
  EXPECT_EQ(Sampler::Create(10, {.rank = 2, .world_size = 2}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Sampler::Create(10, {.world_size = 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Sampler::Create(10, {.block_size = 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Sampler::Create(3, {.world_size = 4, .drop_last = true}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Sampler::Create(10, {.world_size = 3, .sharding = Sharding::kGlobalBatch, .global_batch = 4})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Sampler::Create(10, {.sharding = Sharding::kGlobalBatch}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseShuffleMode("blocks").status().code(), StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(ShuffleMode m, ParseShuffleMode("block"));
  EXPECT_EQ(m, ShuffleMode::kBlock);
  ASSERT_OK_AND_ASSIGN(Sampler empty, Sampler::Create(0, {}));
  EXPECT_TRUE(empty.Epoch(0).empty());
}

// Record counts past the format's limit were taken: Create(INT64_MAX, world 7) overflowed
// n + world - 1 into a negative share. And the exact shares multiplied rank * n, which overflows
// for 2^40 records and a world of 2^30.
TEST(Sampler, CountsPastTheFormatLimitAreRefusedAndSharesDoNotOverflow) {
  const int64_t kMost = int64_t{1} << 40;  // kMaxRecords
  for (Sharding sharding : {Sharding::kContiguous, Sharding::kExact}) {
    auto huge = Sampler::Create(INT64_MAX, {.rank = 6, .world_size = 7, .sharding = sharding});
    ASSERT_FALSE(huge.ok()) << "per rank " << huge->samples_per_rank();
    EXPECT_EQ(huge.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_FALSE(Sampler::Create(kMost + 1, {}).ok());
  ASSERT_OK_AND_ASSIGN(Sampler most, Sampler::Create(kMost, {.rank = 2, .world_size = 3}));
  EXPECT_EQ(most.samples_per_rank(), (kMost + 2) / 3);
  const int world = 1 << 30;
  for (int rank : {0, 1, world / 2, world - 1}) {
    SCOPED_TRACE(rank);
    ASSERT_OK_AND_ASSIGN(Sampler s, Sampler::Create(kMost, {.mode = ShuffleMode::kSequential,
                                                            .rank = rank,
                                                            .world_size = world,
                                                            .sharding = Sharding::kExact}));
    EXPECT_EQ(s.samples_per_rank(), 1024);
    const std::vector<int64_t> positions = s.ShardPositions();
    ASSERT_EQ(positions.size(), 1024u);
    EXPECT_EQ(positions.front(), int64_t{rank} * 1024);
  }
  // Uneven shares of a large count still add up to it.
  int64_t sum = 0;
  for (int rank = 0; rank < 7; ++rank) {
    ASSERT_OK_AND_ASSIGN(
        Sampler s,
        Sampler::Create(kMost - 3, {.rank = rank, .world_size = 7, .sharding = Sharding::kExact}));
    sum += s.samples_per_rank();
  }
  EXPECT_EQ(sum, kMost - 3);
}

}  // namespace
}  // namespace stoke::dataset
