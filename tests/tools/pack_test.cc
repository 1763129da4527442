// Tests for the pack and inspect tools: pack -> read is the identity, deterministic shuffles,
// stratified splits, bad inputs skipped and reported, interrupted packs resumed exactly.
#include <gtest/gtest.h>
#include <lmdb.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <tuple>
#include <chrono>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <opencv2/core.hpp>
#include <opencv2/imgcodecs.hpp>
#include <turbojpeg.h>

#include "dataset/dataset.h"
#include "dataset/writer.h"
#include "decode/jpeg_decoder.h"
#include "decode/jpeg_transcode.h"
#include "tests/testing/test_util.h"
#include "tools/inspect/inspect.h"
#include "tools/pack/packer.h"

namespace stoke::pack {
namespace {
namespace fs = std::filesystem;
using dataset::Dataset;
using dataset::RecordView;
using testing::TempDir;

const std::vector<std::string> kClasses = {"ant", "bee", "cat", "dog"};

PackOptions Options(const fs::path& src, const fs::path& out) {
  PackOptions o;
  o.source = src;
  o.output = out;
  o.threads = 2;
  o.progress = false;
  return o;
}

// Two damaged JPEGs (truncated scan, lost EOI) in src/ant.
void AddBadInputsForModes(const fs::path& src) {
  auto good = testing::EncodeJpeg(testing::MakeImage(64, 48, 3));
  testing::WriteBytes(src / "ant" / "zz_cut.jpg",
                      std::vector<std::byte>(good.begin(), good.begin() + static_cast<ptrdiff_t>(good.size() * 2 / 3)));
  ASSERT_GT(good.size(), 2u);
  // Copy all but the last two bytes (the EOI marker). A copy rather than resize(): GCC 12's
  // -Wstringop-overflow misreads the shrinking resize under -fsanitize=address.
  const std::vector<std::byte> no_eoi(good.begin(), good.end() - 2);
  testing::WriteBytes(src / "ant" / "zz_no_eoi.jpg", no_eoi);
}

struct Rec {
  std::vector<std::byte> payload;  // the image bytes (a restart index left out)
  int32_t label;
  uint32_t width, height, channels;
  std::string path;
  bool operator==(const Rec&) const = default;
};

std::vector<Rec> ReadAll(const fs::path& db) {
  auto ds = Dataset::Open(db);
  EXPECT_TRUE(ds.ok()) << ds.status().ToString();
  if (!ds.ok()) return {};
  auto reader = ds->NewReader();
  std::vector<Rec> out;
  EXPECT_OK(reader->Scan(0, ds->size(), [&](const RecordView& r) {
    out.push_back({std::vector<std::byte>(r.image.begin(), r.image.end()), r.header.label,
                   r.header.width, r.header.height, r.header.channels, *reader->SourcePath(r.index)});
    return OkStatus();
  }));
  return out;
}

TEST(Pack, FolderTreeRoundTripsBytesLabelsAndOrder) {
  TempDir dir;
  auto files = testing::MakeImageTree(dir / "src", kClasses, 6);
  ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(Options(dir / "src", dir / "out.lmdb")));
  EXPECT_EQ(s.inputs, 24);
  EXPECT_TRUE(s.bad.empty());
  ASSERT_EQ(s.splits.size(), 1u);
  EXPECT_EQ(s.splits[0].records, 24);
  EXPECT_FALSE(fs::exists(dir / "out.lmdb.partial"));
  auto recs = ReadAll(dir / "out.lmdb");
  ASSERT_EQ(recs.size(), files.size());
  decode::JpegDecoder decoder;
  for (size_t i = 0; i < files.size(); ++i) {
    // Transcoded with a restart index by default: the same pixels, other bytes.
    Image stored, original;
    ASSERT_OK(decoder.Decode(recs[i].payload, &stored));
    ASSERT_OK(decoder.Decode(testing::ReadBytes(files[i]), &original));
    EXPECT_EQ(stored.pixels, original.pixels) << files[i];
    EXPECT_EQ(recs[i].label, static_cast<int32_t>(i / 6));  // sorted class names
    EXPECT_EQ(recs[i].path, fs::relative(files[i], dir / "src").string());
  }
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "out.lmdb"));
  EXPECT_EQ(ds.manifest().classes, kClasses);
  EXPECT_EQ(ds.manifest().class_counts, (std::vector<int64_t>{6, 6, 6, 6}));
  EXPECT_EQ(ds.manifest().packing["tool"], "stoke pack");
  EXPECT_EQ(ds.manifest().format_version, dataset::kFormatVersion);
  ASSERT_OK_AND_ASSIGN(auto reader, ds.NewReader());
  ASSERT_OK_AND_ASSIGN(RecordView first, reader.Get(0));
  EXPECT_EQ(first.header.encoding, dataset::PayloadEncoding::kJpegIndexed);
  EXPECT_GT(first.jpeg_index.intervals, 0u);

  // --index none stores the bytes as they came.
  auto o = Options(dir / "src", dir / "plain.lmdb");
  o.index = IndexMode::kNone;
  ASSERT_OK(Pack(o).status());
  recs = ReadAll(dir / "plain.lmdb");
  ASSERT_EQ(recs.size(), files.size());
  for (size_t i = 0; i < files.size(); ++i) EXPECT_EQ(recs[i].payload, testing::ReadBytes(files[i])) << files[i];
}

TEST(Pack, ThreadCountDoesNotChangeTheDataset) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 9);
  auto o1 = Options(dir / "src", dir / "one");
  o1.threads = 1;
  o1.shuffle = true;
  o1.seed = 5;
  auto o4 = o1;
  o4.output = dir / "four";
  o4.threads = 4;
  ASSERT_OK(Pack(o1).status());
  ASSERT_OK(Pack(o4).status());
  EXPECT_EQ(ReadAll(dir / "one"), ReadAll(dir / "four"));
}

TEST(Pack, ValidationModesKeepAndRejectTheSameInputs) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 4);
  AddBadInputsForModes(dir / "src");
  auto coeff = Options(dir / "src", dir / "coeff");
  auto pixels = Options(dir / "src", dir / "pixels");
  pixels.validate = ValidateMode::kPixels;
  ASSERT_OK_AND_ASSIGN(PackSummary a, Pack(coeff));
  ASSERT_OK_AND_ASSIGN(PackSummary b, Pack(pixels));
  EXPECT_EQ(ReadAll(dir / "coeff"), ReadAll(dir / "pixels"));
  ASSERT_EQ(a.bad.size(), b.bad.size());
  EXPECT_EQ(a.bad.size(), 2u);
  for (size_t i = 0; i < a.bad.size(); ++i) EXPECT_EQ(a.bad[i].path, b.bad[i].path);
}

TEST(Pack, ListFileWithCaffeConvention) {
  TempDir dir;
  auto files = testing::MakeImageTree(dir / "src", {"a", "b"}, 3);
  std::ofstream list(dir / "list.txt");
  list << "# comment\n\n";
  list << "b/b_101.jpg 7\n";
  list << "a/a_100.jpg 2\r\n";
  list << "a/a_102.jpg    0\n";
  list.close();
  auto o = Options(dir / "src", dir / "out");
  o.list_file = dir / "list.txt";
  ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(o));
  EXPECT_EQ(s.classes, 8);  // labels 0..7
  auto recs = ReadAll(dir / "out");
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(recs[0].path, "b/b_101.jpg");  // list order kept
  EXPECT_EQ(recs[0].label, 7);
  EXPECT_EQ(recs[1].label, 2);
  EXPECT_EQ(recs[2].label, 0);
}

TEST(Pack, BadListLinesNameTheLine) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", {"a"}, 1);
  // A NUL after the label, a lone carriage return (old Mac line ends: the rest of the file would be
  // one line) are refused; a UTF-8 byte order mark before the first line is not part of its path.
  for (std::string bad : std::vector<std::string>{"a/a_100.jpg\n", "a/a_100.jpg x\n", "a/a_100.jpg -1\n", "a/a_100.jpg 1\n",
                          std::string("a/a_100.jpg 0\0junk\n", 19), std::string("a/a_100.jpg 0\ra/a_100.jpg 0\n")}) {
    std::ofstream(dir / "list.txt") << "a/a_100.jpg 0\n" << bad;
    auto o = Options(dir / "src", dir / "out");
    o.list_file = dir / "list.txt";
    auto r = Pack(o);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("list.txt:2"), std::string::npos) << r.status().ToString();
  }
  {
    std::ofstream(dir / "list.txt") << "\xEF\xBB\xBF" "a/a_100.jpg 0\n";
    auto o = Options(dir / "src", dir / "bom");
    o.list_file = dir / "list.txt";
    ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(o));
    EXPECT_EQ(s.splits[0].records, 1) << "the first path read without the mark";
    o = Options(dir / "no_such_root", dir / "rootless");
    o.list_file = dir / "list.txt";
    EXPECT_EQ(Pack(o).status().code(), StatusCode::kNotFound) << "a root that does not exist";
  }
  // The conflict names both lines; the same image twice under one label is allowed (oversampling).
  std::ofstream(dir / "list.txt") << "a/a_100.jpg 0\na/a_100.jpg 1\n";
  auto o = Options(dir / "src", dir / "out");
  o.list_file = dir / "list.txt";
  auto r = Pack(o);
  EXPECT_NE(r.status().message().find("'a/a_100.jpg' has label 1 here and label 0 on line 1"), std::string::npos)
      << r.status().ToString();
  // Another spelling of the same file is the same image, and so is a link to it.
  std::filesystem::create_symlink("a/a_100.jpg", dir / "src" / "alias.jpg");
  const std::vector<std::string> spellings{"./a/a_100.jpg", "a//a_100.jpg", "a/../a/a_100.jpg",
                                           (dir / "src/a/a_100.jpg").string(), "alias.jpg"};
  for (const std::string& other : spellings) {
    std::ofstream(dir / "list.txt") << "a/a_100.jpg 0\n" << other << " 1\n";
    r = Pack(o);
    EXPECT_NE(r.status().message().find("has label 1 here and label 0 on line 1"), std::string::npos)
        << other << ": " << r.status().ToString();
  }
  // "link/../x" is the parent of the link's target, not "x": two files, two labels are fine.
  std::filesystem::create_directories(dir / "src" / "deep" / "sub");
  std::filesystem::copy_file(dir / "src/a/a_100.jpg", dir / "src/deep/a_100.jpg");
  std::filesystem::create_symlink("deep/sub", dir / "src" / "link");
  std::ofstream(dir / "list.txt") << "a_100.jpg 0\nlink/../a_100.jpg 1\n";
  std::filesystem::copy_file(dir / "src/a/a_100.jpg", dir / "src/a_100.jpg");
  auto o2 = o;
  o2.output = dir / "out2";
  ASSERT_OK_AND_ASSIGN(PackSummary linked, Pack(o2));
  EXPECT_EQ(linked.splits[0].records, 2);
  std::ofstream(dir / "list.txt") << "a/a_100.jpg 0\na/a_100.jpg 0\n";
  ASSERT_OK_AND_ASSIGN(PackSummary twice, Pack(o));
  EXPECT_EQ(twice.splits[0].records, 2);
}

TEST(Pack, ShuffleIsADeterministicPermutation) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 10);
  auto sorted = Options(dir / "src", dir / "sorted");
  ASSERT_OK(Pack(sorted).status());
  auto base = ReadAll(dir / "sorted");
  std::vector<std::vector<Rec>> runs;
  for (auto [name, seed] : std::vector<std::pair<std::string, int>>{{"s1", 1}, {"s1b", 1}, {"s2", 2}}) {
    auto o = Options(dir / "src", dir / name);
    o.shuffle = true;
    o.seed = static_cast<uint64_t>(seed);
    ASSERT_OK(Pack(o).status());
    runs.push_back(ReadAll(dir / name));
  }
  EXPECT_EQ(runs[0], runs[1]);  // same seed, same order
  EXPECT_NE(runs[0], runs[2]);  // other seed, other order
  EXPECT_NE(runs[0], base);
  auto key = [](const Rec& r) { return r.path; };
  std::vector<std::string> a, b;
  for (const auto& r : runs[0]) a.push_back(key(r));
  for (const auto& r : base) b.push_back(key(r));
  std::sort(a.begin(), a.end());
  EXPECT_EQ(a, b);  // a permutation of the sorted set
}

TEST(Pack, ValidationSplitIsStratifiedAndDisjoint) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 10);
  auto o = Options(dir / "src", dir / "train.lmdb");
  o.val_fraction = 0.2;
  o.seed = 3;
  ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(o));
  ASSERT_EQ(s.splits.size(), 2u);
  EXPECT_EQ(s.splits[1].output, dir / "train_val.lmdb");
  ASSERT_OK_AND_ASSIGN(Dataset train, Dataset::Open(dir / "train.lmdb"));
  ASSERT_OK_AND_ASSIGN(Dataset val, Dataset::Open(dir / "train_val.lmdb"));
  EXPECT_EQ(train.manifest().class_counts, (std::vector<int64_t>{8, 8, 8, 8}));
  EXPECT_EQ(val.manifest().class_counts, (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(val.manifest().classes, kClasses);
  std::set<std::string> seen;
  for (const auto& r : ReadAll(dir / "train.lmdb")) seen.insert(r.path);
  for (const auto& r : ReadAll(dir / "train_val.lmdb")) EXPECT_TRUE(seen.insert(r.path).second);
  EXPECT_EQ(seen.size(), 40u);
}

// Copies of one image (a list naming it twice, a hard link, a link, a class folder linked to another)
// land in one split: a validation image must not also be trained on.
TEST(Pack, CopiesOfOneImageStayInOneSplit) {
  TempDir dir;
  const auto paths = testing::MakeImageTree(dir / "src", {"a", "b"}, 8);
  std::string list;
  for (const auto& p : paths) {
    const std::string rel = p.lexically_relative(dir / "src").generic_string();
    const fs::path copy = p.parent_path() / ("copy_" + p.filename().string());
    if (rel[0] == 'a') {
      fs::create_hard_link(p, copy);
    } else {
      fs::create_symlink(p.filename(), copy);
    }
    list += fmt::format("{} {}\n./{} {}\n", rel, rel[0] - 'a', rel, rel[0] - 'a');
  }
  std::ofstream(dir / "list.txt") << list;
  fs::create_directories(dir / "linked");
  fs::create_directory_symlink(dir / "src" / "a", dir / "linked" / "a");
  fs::create_directory_symlink(dir / "src" / "a", dir / "linked" / "b");  // class b is class a again

  // Payloads identify images: every one of MakeImageTree's is different.
  auto split_payloads = [](const fs::path& db) {
    std::multiset<std::vector<std::byte>> out;
    for (auto& r : ReadAll(db)) out.insert(std::move(r.payload));
    return out;
  };
  for (const std::string source : {"tree", "list", "linked"}) {
    for (uint64_t seed = 1; seed <= 4; ++seed) {
      SCOPED_TRACE(fmt::format("{} seed {}", source, seed));
      const fs::path out = dir / fmt::format("{}_{}.lmdb", source, seed);
      auto o = Options(dir / (source == "linked" ? "linked" : "src"), out);
      if (source == "list") o.list_file = dir / "list.txt";
      o.val_fraction = 0.5;
      o.seed = seed;
      ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(o));
      ASSERT_EQ(s.splits.size(), 2u);
      EXPECT_EQ(s.splits[0].records + s.splits[1].records, 32);
      const auto train = split_payloads(out), val = split_payloads(s.splits[1].output);
      // Each image twice (four times when class b is class a), all copies on one side.
      const size_t copies = source == "linked" ? 4 : 2;
      for (const auto& image : val) EXPECT_EQ(train.count(image), 0u);
      for (const auto& image : train) EXPECT_EQ(train.count(image), copies);
      if (source == "linked") {
        ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(out));
        EXPECT_EQ(ds.manifest().classes, (std::vector<std::string>{"a", "b"}));
      }
    }
  }
  // A hard link under another label (a deduplicated tree) is packed under both, as a folder tree
  // does, in one split; the same path under two labels stays the list's mistake.
  std::ofstream(dir / "list.txt") << "a/a_100.jpg 0\na/copy_a_100.jpg 1\nb/b_100.jpg 1\nb/b_101.jpg 1\n";
  auto o = Options(dir / "src", dir / "hardlinked.lmdb");
  o.list_file = dir / "list.txt";
  o.val_fraction = 0.5;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    o.seed = seed;
    o.overwrite = true;
    ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(o));
    const auto train = split_payloads(o.output), val = split_payloads(s.splits[1].output);
    for (const auto& image : val) EXPECT_EQ(train.count(image), 0u) << "seed " << seed;
  }
  std::ofstream(dir / "list.txt") << "a/a_100.jpg 0\n./a/a_100.jpg 1\n";
  o.val_fraction = 0;
  auto r = Pack(o);
  EXPECT_NE(r.status().message().find("'./a/a_100.jpg' has label 1 here and label 0 on line 1"), std::string::npos)
      << r.status().ToString();
}

// A class whose every image is a copy of another class's file keeps a training image, even when
// the split sends those files to validation.
TEST(Pack, AClassOfCopiesKeepsATrainingImage) {
  TempDir dir;
  for (int i = 0; i < 2; ++i) {
    testing::WriteBytes(dir / "src" / "a" / fmt::format("x{}.jpg", i),
                        testing::EncodeJpeg(testing::MakeImage(32, 24, 3, static_cast<uint32_t>(i))));
  }
  fs::create_directories(dir / "src" / "b");
  fs::create_hard_link(dir / "src" / "a" / "x1.jpg", dir / "src" / "b" / "y.jpg");
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    auto o = Options(dir / "src", dir / fmt::format("t{}.lmdb", seed));
    o.val_fraction = 0.5;
    o.seed = seed;
    ASSERT_OK(Pack(o).status());
    ASSERT_OK_AND_ASSIGN(Dataset train, Dataset::Open(o.output));
    EXPECT_GE(train.manifest().class_counts[1], 1) << "seed " << seed;
    EXPECT_GE(train.manifest().class_counts[0], 1) << "seed " << seed;
  }
}

// A fraction that would send a small class wholly to validation keeps one of its images in training.
TEST(Pack, ValidationSplitLeavesEveryClassATrainingImage) {
  TempDir dir;
  for (const auto& [cls, n] : std::vector<std::pair<std::string, int>>{{"one", 1}, {"two", 2}, {"ten", 10}}) {
    for (int i = 0; i < n; ++i) {
      testing::WriteBytes(dir / "src" / cls / fmt::format("{}.jpg", i), testing::EncodeJpeg(testing::MakeImage(32, 24, 3)));
    }
  }
  auto o = Options(dir / "src", dir / "train.lmdb");
  o.val_fraction = 0.9;
  ASSERT_OK(Pack(o).status());
  ASSERT_OK_AND_ASSIGN(Dataset train, Dataset::Open(dir / "train.lmdb"));
  ASSERT_OK_AND_ASSIGN(Dataset val, Dataset::Open(dir / "train_val.lmdb"));
  // Classes sorted: one, ten, two.
  EXPECT_EQ(train.manifest().class_counts, (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(val.manifest().class_counts, (std::vector<int64_t>{0, 9, 1}));
}

// Writes a few bad inputs into src/<class>/ and returns their relative paths.
std::set<std::string> AddBadInputs(const fs::path& src) {
  auto good = testing::EncodeJpeg(testing::MakeImage(64, 48, 3));
  std::vector<std::byte> truncated(good.begin(), good.begin() + static_cast<ptrdiff_t>(good.size() / 2));
  std::vector<std::byte> text(40, std::byte{'x'});
  auto flipped = good;
  flipped[flipped.size() - 2] = std::byte{0x00};  // EOI marker destroyed
  testing::WriteBytes(src / "ant" / "zz_truncated.jpg", truncated);
  testing::WriteBytes(src / "bee" / "zz_text.jpg", text);
  testing::WriteBytes(src / "cat" / "zz_empty.jpg", {});
  testing::WriteBytes(src / "dog" / "zz_no_eoi.jpg", flipped);
  return {"ant/zz_truncated.jpg", "bee/zz_text.jpg", "cat/zz_empty.jpg", "dog/zz_no_eoi.jpg"};
}

TEST(Pack, CorruptInputsAreSkippedAndReported) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 3);
  auto bad = AddBadInputs(dir / "src");
  auto o = Options(dir / "src", dir / "out");
  o.report_file = dir / "report.json";
  ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(o));
  EXPECT_EQ(s.splits[0].records, 12);
  std::set<std::string> reported;
  for (const auto& b : s.bad) {
    reported.insert(b.path);
    EXPECT_FALSE(b.reason.empty());
  }
  EXPECT_EQ(reported, bad);
  std::ifstream in(dir / "report.json");
  auto report = nlohmann::json::parse(in);
  EXPECT_EQ(report["skipped"].size(), 4u);
  EXPECT_EQ(report["splits"][0]["records"], 12);
  EXPECT_NE(FormatSummary(s).find("zz_truncated.jpg"), std::string::npos);
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "out"));
  EXPECT_EQ(ds.manifest().packing["bad"].size(), 4u);
}

TEST(Pack, OnErrorFailStopsAtTheFirstBadInput) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 3);
  AddBadInputs(dir / "src");
  auto o = Options(dir / "src", dir / "out");
  o.on_error = OnError::kFail;
  auto r = Pack(o);
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(r.status().message().find("ant/zz_truncated.jpg"), std::string::npos)
      << r.status().ToString();
  EXPECT_FALSE(fs::exists(dir / "out"));  // never a half-written dataset under the final name
}

TEST(Pack, RefusesToClobberWithoutOverwrite) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 2);
  auto o = Options(dir / "src", dir / "out");
  ASSERT_OK(Pack(o).status());
  auto again = Pack(o);
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(again.status().message().find("--overwrite"), std::string::npos);
  o.overwrite = true;
  EXPECT_OK(Pack(o).status());
}

TEST(Pack, RejectsBadOptionsAndSources) {
  TempDir dir;
  auto o = Options(dir / "missing", dir / "out");
  EXPECT_EQ(Pack(o).status().code(), StatusCode::kNotFound);
  fs::create_directories(dir / "flat");
  testing::WriteBytes(dir / "flat" / "x.jpg", testing::EncodeJpeg(testing::MakeImage(8, 8, 3)));
  o.source = dir / "flat";
  auto flat = Pack(o);
  EXPECT_EQ(flat.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(flat.status().message().find("class sub-folders"), std::string::npos);
  testing::MakeImageTree(dir / "src", kClasses, 1);
  o.source = dir / "src";
  o.val_fraction = 1.5;
  EXPECT_EQ(Pack(o).status().code(), StatusCode::kInvalidArgument);
  o.val_fraction = 0;
  o.quality = 101;
  EXPECT_EQ(Pack(o).status().code(), StatusCode::kInvalidArgument);
}

// Everything that defines a dataset except the creation date.
nlohmann::json Comparable(const fs::path& db) {
  auto ds = Dataset::Open(db);
  EXPECT_TRUE(ds.ok()) << ds.status().ToString();
  auto j = ds->manifest().ToJson();
  j["packing"].erase("created");
  j["packing"].erase("source");
  return j;
}

TEST(Pack, StoppedPackResumesToTheSameDataset) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 25);
  AddBadInputs(dir / "src");
  auto full = Options(dir / "src", dir / "full");
  full.shuffle = true;
  full.seed = 1;
  full.val_fraction = 0.2;
  ASSERT_OK_AND_ASSIGN(PackSummary whole, Pack(full));
  // Bad inputs in both splits: the report lists the training split's first, also after a resume.
  ASSERT_EQ(whole.splits.size(), 2u);
  for (const SplitSummary& split : whole.splits) ASSERT_GT(split.inputs, split.records) << split.name;
  const auto paths = [](const PackSummary& s) {
    std::vector<std::string> out;
    for (const auto& b : s.bad) out.push_back(b.path);
    return out;
  };

  // Stopped in the training split, and in the validation split (the training one finished).
  for (const int64_t stop_at : {21, 84}) {
    SCOPED_TRACE(fmt::format("stopped after {} records", stop_at));
    auto o = full;
    o.output = dir / fmt::format("part{}", stop_at);
    o.commit_every = 7;
    std::atomic<bool> stop{false};
    o.stop = &stop;
    o.after_commit = [&](int64_t committed) {
      if (committed >= stop_at) stop = true;
    };
    auto first = Pack(o);
    EXPECT_EQ(first.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(first.status().message().find("--resume"), std::string::npos);
    EXPECT_TRUE(fs::exists(o.output.string() + ".partial"));
    EXPECT_FALSE(fs::exists(o.output));
    // Without --resume, the partial pack is neither lost nor silently restarted.
    o.stop = nullptr;
    o.after_commit = nullptr;
    EXPECT_EQ(Pack(o).status().code(), StatusCode::kInvalidArgument);
    o.resume = true;
    ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(o));
    EXPECT_EQ(s.bad.size(), 4u);
    EXPECT_EQ(paths(s), paths(whole));  // in the same order (a finished split's came last)
    EXPECT_EQ(ReadAll(o.output), ReadAll(dir / "full"));
    EXPECT_EQ(ReadAll(o.output.string() + "_val"), ReadAll(dir / "full_val"));
    EXPECT_EQ(Comparable(o.output), Comparable(dir / "full"));
    // Resuming a finished pack is a no-op that reports it complete.
    ASSERT_OK_AND_ASSIGN(PackSummary again, Pack(o));
    EXPECT_TRUE(again.splits[0].already_complete);
    EXPECT_EQ(paths(again), paths(whole));
  }
}

// Re-executes this test binary with one environment variable (NAME=value), which selects one
// of the child modes below; returns the child's pid.
pid_t SpawnSelf(std::string env) {
  char* child_argv[] = {const_cast<char*>("/proc/self/exe"), nullptr};
  char* child_env[] = {env.data(), nullptr};
  pid_t child = 0;
  EXPECT_EQ(posix_spawn(&child, "/proc/self/exe", nullptr, nullptr, child_argv, child_env), 0);
  return child;
}

// The victim of KilledPackResumesToTheSameDataset: this binary re-executed with
// STOKE_PACK_VICTIM=<dir> packs <dir>/src into <dir>/killed and is SIGKILLed by its own commit
// hook after 30 records, before any test runs. A fresh process (not a fork of a threaded one) is
// what a real `kill -9` hits, and what TBB and TSan need.
const bool kVictimMode = [] {
  const char* dir = std::getenv("STOKE_PACK_VICTIM");
  if (dir == nullptr) return false;
  PackOptions o = Options(fs::path(dir) / "src", fs::path(dir) / "killed");
  o.commit_every = 5;
  o.after_commit = [](int64_t committed) {
    if (committed >= 30) raise(SIGKILL);  // no destructors, no final commit
  };
  auto r = Pack(o);
  _exit(r.ok() ? 0 : 1);
}();

TEST(Pack, KilledPackResumesToTheSameDataset) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 20);
  const pid_t child = SpawnSelf("STOKE_PACK_VICTIM=" + dir.path().string());
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
      << "the child was meant to be killed; status " << status;
  EXPECT_FALSE(fs::exists(dir / "killed"));
  EXPECT_TRUE(fs::exists(dir / "killed.partial"));

  auto full = Options(dir / "src", dir / "full");
  ASSERT_OK(Pack(full).status());
  auto o = Options(dir / "src", dir / "killed");
  o.commit_every = 5;
  o.resume = true;
  ASSERT_OK(Pack(o).status());
  EXPECT_EQ(ReadAll(dir / "killed"), ReadAll(dir / "full"));
  EXPECT_EQ(Comparable(dir / "killed"), Comparable(dir / "full"));
}

// The process `kill -9` hits in KillNineAtRandomMomentsThenResume: this binary re-executed with
// STOKE_PACK_RESUMER=<dir> packs (or resumes packing) <dir>/src into <dir>/killed, small
// transactions, and exits 0 on success, 3 with the error on stderr otherwise. A short pause after
// each commit stretches the pack well beyond the variation in process start-up (hundreds of ms
// under TSan), so random kill moments land inside it.
const bool kResumerMode = [] {
  const char* dir = std::getenv("STOKE_PACK_RESUMER");
  if (dir == nullptr) return false;
  PackOptions o = Options(fs::path(dir) / "src", fs::path(dir) / "killed");
  o.commit_every = 3;
  o.resume = true;
  o.after_commit = [](int64_t) { std::this_thread::sleep_for(std::chrono::milliseconds(3)); };
  auto r = Pack(o);
  if (!r.ok()) std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
  _exit(r.ok() ? 0 : 3);
}();

TEST(Pack, KillNineAtRandomMomentsThenResumeGivesTheSameDataset) {
  // Eight SIGKILLs from outside, each at a random moment of a run that resumes the previous one
  // (before the output exists, mid-transaction, mid-commit, at the rename...), then a run to the
  // end: the dataset equals an uninterrupted pack, byte for byte in every record.
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 60);
  ASSERT_OK(Pack(Options(dir / "src", dir / "full")).status());
  auto spawn = [](const fs::path& where) { return SpawnSelf("STOKE_PACK_RESUMER=" + where.string()); };
  // How long one whole run takes, process start-up included: the window the kills fall in.
  TempDir calib;
  fs::create_directory_symlink(dir / "src", calib / "src");
  const auto t0 = std::chrono::steady_clock::now();
  pid_t probe = spawn(calib.path());
  int probe_status = 0;
  ASSERT_EQ(waitpid(probe, &probe_status, 0), probe);
  ASSERT_TRUE(WIFEXITED(probe_status) && WEXITSTATUS(probe_status) == 0);
  // Kills fall in [lo, hi) after the spawn. The range closes in on the pack itself: a kill that
  // came before any dataset existed raises lo to its moment, a run that finished before its kill
  // lowers hi to that delay (start-up dominates under sanitizers and varies, so both are kept
  // loose).
  double hi = static_cast<double>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
  double lo = 0;
  std::mt19937 rng(11);
  int killed = 0, mid_pack = 0, finished = 0;
  const auto want_records = ReadAll(dir / "full");
  const auto want_manifest = Comparable(dir / "full");
  // Until 8 kills have landed mid-pack: kill each run at a random moment of the range and let
  // the next run resume it. A run that finishes first is checked and removed, and a new chain
  // starts.
  for (int round = 0; round < 150 && mid_pack < 8; ++round) {
    const double delay = lo + std::uniform_real_distribution<double>(0, 1)(rng) * (hi - lo);
    const pid_t child = spawn(dir.path());
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(delay)));
    kill(child, SIGKILL);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    // A kill can also land after the pack finished, while the process exits (slow under TSan).
    const bool completed = fs::exists(dir / "killed");
    if (WIFSIGNALED(status)) {
      ASSERT_EQ(WTERMSIG(status), SIGKILL);
      ++killed;
      if (fs::exists(dir / "killed.partial")) {
        ++mid_pack;
        continue;
      }
      if (!completed) {
        lo = std::min(std::max(lo, 0.8 * delay), 0.8 * hi);
        continue;
      }
    } else {
      ASSERT_TRUE(WIFEXITED(status));
      ASSERT_EQ(WEXITSTATUS(status), 0) << "round " << round << ": a run after a kill failed (its error is above)";
    }
    ++finished;
    hi = std::max(1.1 * delay, 1.25 * lo);
    ASSERT_EQ(ReadAll(dir / "killed"), want_records) << "round " << round;
    ASSERT_EQ(Comparable(dir / "killed"), want_manifest) << "round " << round;
    fs::remove_all(dir / "killed");
  }
  // The last chain, run to the end without a kill.
  const pid_t last = spawn(dir.path());
  int status = 0;
  ASSERT_EQ(waitpid(last, &status, 0), last);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(ReadAll(dir / "killed"), want_records);
  EXPECT_EQ(Comparable(dir / "killed"), want_manifest);
  EXPECT_GE(mid_pack, 8) << killed << " kills, " << finished << " runs finished first";
  std::printf("%d kills (%d with a partial dataset on disk), %d runs finished before their kill\n", killed, mid_pack,
              finished);
}

TEST(Pack, DiskFullIsACleanErrorAndThePackResumesAfterwards) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 40);
  ASSERT_OK(Pack(Options(dir / "src", dir / "full")).status());
  auto o = Options(dir / "src", dir / "out");
  o.commit_every = 8;
  {
    // The dataset needs several times this; LMDB's writes past it fail with EFBIG.
    testing::FileSizeLimit full_disk(96 * 1024);
    auto r = Pack(o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kIoError) << r.status().ToString();
    EXPECT_NE(r.status().message().find("out.partial"), std::string::npos) << r.status().ToString();
  }
  EXPECT_FALSE(fs::exists(dir / "out"));
  // Space again: the committed part is kept and the pack resumes to the same dataset.
  o.resume = true;
  ASSERT_OK(Pack(o).status());
  EXPECT_EQ(ReadAll(dir / "out"), ReadAll(dir / "full"));
  EXPECT_EQ(Comparable(dir / "out"), Comparable(dir / "full"));
}

// Packs with `o` until its first commit (4 records) and stops there, leaving OUT.partial; `o` is
// as it was, but for commit_every.
void StopAfterTheFirstCommit(PackOptions& o) {
  o.commit_every = 4;
  std::atomic<bool> stop{false};
  o.stop = &stop;
  o.after_commit = [&](int64_t) { stop = true; };
  EXPECT_EQ(Pack(o).status().code(), StatusCode::kUnavailable);
  o.stop = nullptr;
  o.after_commit = nullptr;
}

TEST(Pack, ResumeWithOtherOptionsIsRefused) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 10);
  auto o = Options(dir / "src", dir / "out");
  StopAfterTheFirstCommit(o);
  o.resume = true;
  o.shuffle = true;  // not what the partial pack was made with
  auto r = Pack(o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  // The refusal names the option and the way on, not only --overwrite (which discards the records).
  EXPECT_NE(r.status().message().find("made with other options: --shuffle false (now true)"), std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("the same command plus --resume"), std::string::npos) << r.status().message();
  o.shuffle = false;
  ASSERT_OK(Pack(o).status());  // with the options it was made with, it resumes
}

// An image replaced after it was packed (same name, other bytes) was kept as it had been by a
// resume: refused, naming it. One not packed yet is taken as it is now.
TEST(Pack, ResumeRefusesAnInputChangedSinceItWasPacked) {
  TempDir dir;
  const auto paths = testing::MakeImageTree(dir / "src", kClasses, 10);
  auto o = Options(dir / "src", dir / "out");
  StopAfterTheFirstCommit(o);  // the first 4 inputs, in sorted order
  o.resume = true;
  const auto replace = [](const fs::path& with, const fs::path& path) {
    fs::copy_file(with, path, fs::copy_options::overwrite_existing);
  };
  replace(paths.back(), paths[9]);  // not packed yet: packed as it is now
  replace(paths.back(), paths[1]);
  // (Later than the images written just before the pack, whatever the file times' granularity.)
  fs::last_write_time(paths[1], fs::last_write_time(paths[1]) + std::chrono::seconds(2));
  auto r = Pack(o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("inputs packed before the interruption changed since (their sizes or "
                                      "modification times differ; the one modified last is " + paths[1].string()),
            std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("pass --overwrite instead of --resume"), std::string::npos);
  EXPECT_TRUE(fs::exists(dir / "out.partial"));  // left as it was
  o.resume = false;
  o.overwrite = true;
  ASSERT_OK(Pack(o).status());
  // The same inputs, packed from the start, resume after a stop to the dataset of one pack.
  auto again = Options(dir / "src", dir / "again");
  StopAfterTheFirstCommit(again);
  again.resume = true;
  ASSERT_OK(Pack(again).status());
  EXPECT_EQ(Comparable(dir / "again"), Comparable(dir / "out"));
}

// A partial pack whose resume state and records table disagree on how many records were committed
// is damaged: resuming would number the next records wrongly. Refused, naming both counts.
TEST(Pack, ResumeRefusesAStateThatCountsOtherRecordsThanTheTable) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 10);
  auto o = Options(dir / "src", dir / "out");
  StopAfterTheFirstCommit(o);
  o.resume = true;
  {  // one more record in the state than in the table
    const fs::path partial = dir / "out.partial";
    MDB_env* env = nullptr;
    ASSERT_EQ(mdb_env_create(&env), MDB_SUCCESS);
    mdb_env_set_maxdbs(env, 4);
    ASSERT_EQ(mdb_env_open(env, partial.c_str(), MDB_NOLOCK, 0644), MDB_SUCCESS);
    MDB_txn* txn = nullptr;
    ASSERT_EQ(mdb_txn_begin(env, nullptr, 0, &txn), MDB_SUCCESS);
    MDB_dbi meta = 0;
    ASSERT_EQ(mdb_dbi_open(txn, dataset::kMetaDb, 0, &meta), MDB_SUCCESS);
    MDB_val key{std::strlen(dataset::kPackStateKey), const_cast<char*>(dataset::kPackStateKey)}, value;
    ASSERT_EQ(mdb_get(txn, meta, &key, &value), MDB_SUCCESS);
    auto state = nlohmann::json::parse(std::string(static_cast<const char*>(value.mv_data), value.mv_size));
    state["class_counts"][0] = state["class_counts"][0].get<int64_t>() + 1;
    std::string text = state.dump();
    MDB_val edited{text.size(), text.data()};
    ASSERT_EQ(mdb_put(txn, meta, &key, &edited, 0), MDB_SUCCESS);
    ASSERT_EQ(mdb_txn_commit(txn), MDB_SUCCESS);
    mdb_env_close(env);
  }
  auto r = Pack(o);
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(r.status().message().find("it counts 5 records, the records table holds 4"), std::string::npos)
      << r.status().ToString();
}

TEST(Pack, ExifOrientationIsApplied) {
  TempDir dir;
  // A 40x20 image, stored with orientation 6 (display rotated 90 degrees clockwise).
  Image src = testing::MakeImage(40, 20, 3, 0);
  auto jpeg = testing::WithExifOrientation(testing::EncodeJpeg(src, 95, false, true), 6);
  testing::WriteBytes(dir / "src" / "c" / "rot.jpg", jpeg);
  auto o = Options(dir / "src", dir / "out");
  ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(o));
  EXPECT_EQ(s.reoriented, 1);
  auto recs = ReadAll(dir / "out");
  ASSERT_EQ(recs.size(), 1u);
  EXPECT_EQ(recs[0].width, 20u);
  EXPECT_EQ(recs[0].height, 40u);
  decode::JpegDecoder decoder;
  Image out;
  decode::JpegInfo info;
  ASSERT_OK(decoder.Decode(recs[0].payload, &out, 1, &info));
  EXPECT_EQ(info.orientation, 1);  // the stored pixels are upright; no tag left to apply
  // Rotating 90 degrees clockwise: out(x, y) = src(y, H - 1 - x) with H = 20.
  Image expected;
  expected.Reshape(20, 40, 3);
  for (int y = 0; y < 40; ++y) {
    for (int x = 0; x < 20; ++x) {
      for (int c = 0; c < 3; ++c) expected.row(y)[x * 3 + c] = src.row(19 - x)[y * 3 + c];
    }
  }
  EXPECT_LT(testing::MeanAbsDiff(out, expected), 4.0);
}

TEST(Pack, OtherFormatsAreConvertedToJpeg) {
  TempDir dir;
  Image src = testing::MakeImage(30, 22, 3, 2);
  cv::Mat bgr(22, 30, CV_8UC3);
  for (int y = 0; y < 22; ++y) {
    for (int x = 0; x < 30; ++x) {
      for (int c = 0; c < 3; ++c) bgr.at<cv::Vec3b>(y, x)[2 - c] = src.row(y)[x * 3 + c];
    }
  }
  fs::create_directories(dir / "src" / "c");
  ASSERT_TRUE(cv::imwrite((dir / "src" / "c" / "a.png").string(), bgr));
  ASSERT_TRUE(cv::imwrite((dir / "src" / "c" / "b.bmp").string(), bgr));
  ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(Options(dir / "src", dir / "out")));
  EXPECT_EQ(s.converted, 2);
  for (const auto& r : ReadAll(dir / "out")) {
    decode::JpegDecoder decoder;
    Image out;
    ASSERT_OK(decoder.Decode(r.payload, &out));
    EXPECT_LT(testing::MeanAbsDiff(out, src), 6.0);  // RGB order kept through the conversion
  }
}

TEST(Pack, MaxSideAndQualityAndRaw) {
  TempDir dir;
  testing::WriteBytes(dir / "src" / "c" / "big.jpg", testing::EncodeJpeg(testing::MakeImage(200, 100, 3)));
  testing::WriteBytes(dir / "src" / "c" / "small.jpg", testing::EncodeJpeg(testing::MakeImage(40, 30, 3)));
  auto o = Options(dir / "src", dir / "resized");
  o.max_side = 64;
  o.index = IndexMode::kNone;  // to see which bytes are kept
  ASSERT_OK(Pack(o).status());
  auto recs = ReadAll(dir / "resized");
  ASSERT_EQ(recs.size(), 2u);
  EXPECT_EQ(recs[0].width, 64u);
  EXPECT_EQ(recs[0].height, 32u);
  EXPECT_EQ(recs[1].width, 40u);  // already within the limit: bytes kept
  EXPECT_EQ(recs[1].payload, testing::ReadBytes(dir / "src" / "c" / "small.jpg"));

  o.output = dir / "raw";
  o.encoding = dataset::PayloadEncoding::kRaw;
  ASSERT_OK(Pack(o).status());
  ASSERT_OK_AND_ASSIGN(Dataset raw, Dataset::Open(dir / "raw"));
  ASSERT_OK_AND_ASSIGN(auto reader, raw.NewReader());
  ASSERT_OK_AND_ASSIGN(RecordView r, reader.Get(1));
  EXPECT_EQ(r.header.encoding, dataset::PayloadEncoding::kRaw);
  EXPECT_EQ(r.payload.size(), 40u * 30u * 3u);

  o.output = dir / "q";
  o.encoding = dataset::PayloadEncoding::kJpeg;
  o.max_side = 0;
  o.quality = 30;
  ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(o));
  EXPECT_EQ(s.reencoded, 2);
  auto q = ReadAll(dir / "q");
  EXPECT_LT(q[0].payload.size(), testing::ReadBytes(dir / "src" / "c" / "big.jpg").size());
}

// A JPEG cut losslessly to 1x1 keeps its first block's other 63 pixels as hidden padding. Decoded
// at a reduced DCT scale, its one pixel would be that block's average: the stored pixel is the one
// a full decode gives.
TEST(Pack, AScaledDecodeStoresNoHiddenPaddingPixels) {
  TempDir dir;
  const std::vector<std::byte> big = testing::EncodeJpeg(testing::MakeImage(16, 16, 3, 7), 100);
  tjhandle tj = tjInitTransform();
  ASSERT_NE(tj, nullptr);
  tjtransform crop{};
  crop.r = {0, 0, 1, 1};
  crop.op = TJXOP_NONE;
  crop.options = TJXOPT_CROP;
  unsigned char* cut = nullptr;
  unsigned long cut_size = 0;
  ASSERT_EQ(tjTransform(tj, reinterpret_cast<const unsigned char*>(big.data()), big.size(), 1, &cut, &cut_size, &crop, 0),
            0) << tjGetErrorStr2(tj);
  const std::vector<std::byte> one(reinterpret_cast<std::byte*>(cut), reinterpret_cast<std::byte*>(cut) + cut_size);
  tjFree(cut);
  tjDestroy(tj);
  testing::WriteBytes(dir / "src" / "c" / "one.jpg", one);
  decode::JpegDecoder decoder;
  Image full;
  ASSERT_OK(decoder.Decode(one, &full));
  ASSERT_EQ(full.width, 1);
  auto o = Options(dir / "src", dir / "raw");
  o.encoding = dataset::PayloadEncoding::kRaw;
  ASSERT_OK(Pack(o).status());
  auto recs = ReadAll(dir / "raw");
  ASSERT_EQ(recs.size(), 1u);
  ASSERT_EQ(recs[0].payload.size(), 3u);
  std::vector<int> stored, want;
  for (std::byte b : recs[0].payload) stored.push_back(std::to_integer<int>(b));
  for (uint8_t v : full.pixels) want.push_back(v);
  EXPECT_EQ(stored, want);
}

TEST(Pack, MaxSideKeepsTheAspectRatioWhateverTheDctScale) {
  // Decoded at 1/8 or 1/4 first, these would round to another shape (1000x505 -> 125x64).
  TempDir dir;
  const std::vector<std::tuple<int, int, int, int, int>> cases = {
      {1000, 9, 125, 125, 1}, {1000, 505, 125, 125, 63}, {600, 450, 75, 75, 56}, {2000, 1001, 250, 250, 125}};
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& [w, h, side, want_w, want_h] = cases[i];
    SCOPED_TRACE(fmt::format("{}x{} to {}", w, h, side));
    testing::WriteBytes(dir / fmt::format("src{}", i) / "c" / "a.jpg", testing::EncodeJpeg(testing::MakeImage(w, h, 3)));
    auto o = Options(dir / fmt::format("src{}", i), dir / fmt::format("out{}", i));
    o.max_side = side;
    ASSERT_OK(Pack(o).status());
    auto recs = ReadAll(dir / fmt::format("out{}", i));
    ASSERT_EQ(recs.size(), 1u);
    EXPECT_EQ(recs[0].width, static_cast<uint32_t>(want_w));
    EXPECT_EQ(recs[0].height, static_cast<uint32_t>(want_h));
  }
}

TEST(Pack, OutputsThatWouldDestroyOrSwallowTheSourceAreRefused) {
  TempDir dir;
  testing::MakeImageTree(dir / "data" / "imgs", kClasses, 2);
  const fs::path src = dir / "data" / "imgs";
  auto refused = [&](PackOptions o, const std::string& needle) {
    o.overwrite = true;
    auto r = Pack(o);
    ASSERT_FALSE(r.ok()) << o.output;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  refused(Options(src, dir / "data"), "holds the source");            // replacing it would delete the images
  refused(Options(src, src), "holds the source");
  refused(Options(src, src / "out.lmdb"), "inside the source folder");  // the next pack would list it
  auto val = Options(src, dir / "o.lmdb");
  val.val_fraction = 0.5;
  val.val_output = dir / "o.lmdb/";
  refused(val, "is the training output");
  // The validation output holding the training one: publishing it deleted the training dataset.
  auto nested = Options(src, dir / "vv" / "train.lmdb");
  nested.val_fraction = 0.5;
  nested.val_output = dir / "vv";
  refused(nested, "is inside the other output");
  // --overwrite replaces datasets only: a folder of the user's files, or the working directory, stays.
  testing::WriteBytes(dir / "docs" / "thesis.txt", {std::byte{'x'}});
  refused(Options(src, dir / "docs"), "is not a dataset (it holds thesis.txt)");
  EXPECT_TRUE(fs::exists(dir / "docs" / "thesis.txt"));
  const fs::path cwd = fs::current_path();
  fs::create_directories(dir / "work");
  fs::current_path(dir / "work");
  testing::WriteBytes(dir / "work" / "keep.txt", {std::byte{'x'}});
  auto here = Options(src, ".");
  here.overwrite = true;
  auto r_here = Pack(here);
  fs::current_path(cwd);
  ASSERT_FALSE(r_here.ok());
  EXPECT_NE(r_here.status().message().find("holds the working directory"), std::string::npos) << r_here.status().message();
  EXPECT_TRUE(fs::exists(dir / "work" / "keep.txt"));
  EXPECT_EQ(fs::directory_iterator(src / "cat") != fs::directory_iterator(), true) << "the images are still there";
  // A link loop, a dangling link, a FIFO and a link to a folder in the tree are inputs that cannot
  // be read: each is reported as skipped (not an internal error, not a hang, not left out silently).
  fs::create_symlink("loop", src / "cat" / "loop");
  fs::create_symlink("gone.jpg", src / "cat" / "dangling.jpg");
  ASSERT_EQ(::mkfifo((src / "cat" / "pipe.jpg").c_str(), 0600), 0);
  fs::create_symlink(src / "dog", src / "cat" / "linked_folder");
  ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(Options(src, dir / "fine.lmdb")));
  EXPECT_EQ(s.inputs, 12);
  ASSERT_EQ(s.bad.size(), 4u);
  std::map<std::string, std::string> why;
  for (const auto& b : s.bad) why[b.path] = b.reason;
  EXPECT_NE(why["cat/loop"].find("symbolic links"), std::string::npos) << why["cat/loop"];
  EXPECT_NE(why["cat/dangling.jpg"].find("No such file"), std::string::npos) << why["cat/dangling.jpg"];
  EXPECT_NE(why["cat/pipe.jpg"].find("not a regular file"), std::string::npos) << why["cat/pipe.jpg"];
  EXPECT_NE(why["cat/linked_folder"].find("not a regular file"), std::string::npos) << why["cat/linked_folder"];
  auto strict = Options(src, dir / "strict.lmdb");
  strict.on_error = OnError::kFail;
  EXPECT_FALSE(Pack(strict).ok());
  // A report that cannot be written is refused before the pack, not found after it.
  auto report = Options(src, dir / "reported.lmdb");
  report.report_file = dir / "no" / "such" / "r.json";
  auto r = Pack(report);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("pack: --report " + report.report_file.string() + ": no folder"),
            std::string::npos)
      << r.status().message();
  report.report_file = dir.path();  // a folder
  r = Pack(report);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("exists and is not a regular file (a folder)"), std::string::npos)
      << r.status().message();
  EXPECT_FALSE(fs::exists(dir / "reported.lmdb"));
  EXPECT_FALSE(fs::exists(dir / "reported.lmdb.partial"));
}

TEST(Pack, NonJpegImagesOverThePixelCapAreSkippedBeforeDecoding) {
  TempDir dir;
  std::vector<uchar> png;
  ASSERT_TRUE(cv::imencode(".png", cv::Mat(30, 40, CV_8UC3, cv::Scalar(10, 200, 30)), png));
  auto bytes = [](const auto& v) {
    const auto b = std::as_bytes(std::span(v));
    return std::vector<std::byte>(b.begin(), b.end());
  };
  testing::WriteBytes(dir / "src" / "c" / "a.png", bytes(png));
  // A PNG header claiming 100000 x 100000 pixels in a file of a few dozen bytes (a decompression bomb).
  std::vector<unsigned char> bomb(png.begin(), png.begin() + 33);
  for (int k : {16, 20}) {
    bomb[static_cast<size_t>(k)] = 0, bomb[static_cast<size_t>(k) + 1] = 0x01, bomb[static_cast<size_t>(k) + 2] = 0x86,
    bomb[static_cast<size_t>(k) + 3] = 0xa0;
  }
  testing::WriteBytes(dir / "src" / "c" / "bomb.png", bytes(bomb));
  auto o = Options(dir / "src", dir / "out");
  o.max_pixels = 1000;  // 40 x 30 = 1200: over
  ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(o));
  ASSERT_EQ(s.bad.size(), 2u);
  EXPECT_NE(s.bad[0].reason.find("40x30 = 1200 pixels, more than the 1000"), std::string::npos) << s.bad[0].reason;
  EXPECT_NE(s.bad[1].reason.find("100000x100000"), std::string::npos) << s.bad[1].reason;
  o.max_pixels = 250'000'000;
  o.output = dir / "out2";
  ASSERT_OK_AND_ASSIGN(s, Pack(o));
  ASSERT_EQ(s.bad.size(), 1u);  // the bomb, still refused by its header
  EXPECT_NE(s.bad[0].reason.find("100000x100000"), std::string::npos) << s.bad[0].reason;
  o.max_pixels = kMaxImagePixels + 1;  // a raw record that large could not be read back
  o.output = dir / "out3";
  EXPECT_EQ(Pack(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(Pack, TrailingSlashOnTheOutputIsTheSameDataset) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 2);
  auto o = Options(dir / "src", (dir / "out.lmdb").string() + "/");
  o.val_fraction = 0.5;
  ASSERT_OK(Pack(o).status());
  EXPECT_EQ(ReadAll(dir / "out.lmdb").size(), 4u);
  EXPECT_EQ(ReadAll(dir / "out_val.lmdb").size(), 4u);
  EXPECT_FALSE(fs::exists(dir / "out.lmdb" / ".partial"));
}

TEST(Pack, FinishedButUnrenamedPackIsPublishedOnResume) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 3);
  auto o = Options(dir / "src", dir / "out");
  ASSERT_OK(Pack(o).status());
  auto want = ReadAll(dir / "out");
  // As if stopped after the final commit, before the rename.
  fs::rename(dir / "out", dir / "out.partial");
  o.resume = true;
  ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(o));
  EXPECT_TRUE(s.splits[0].already_complete);
  EXPECT_FALSE(fs::exists(dir / "out.partial"));
  EXPECT_EQ(ReadAll(dir / "out"), want);
}

TEST(Pack, InterruptedOverwriteCanBeResumed) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 10);
  auto o = Options(dir / "src", dir / "out");
  ASSERT_OK(Pack(o).status());
  // Repack with other options, interrupted: the old dataset stays until the new one is done.
  o.overwrite = true;
  o.quality = 50;
  o.commit_every = 4;
  std::atomic<bool> stop{false};
  o.stop = &stop;
  o.after_commit = [&](int64_t) { stop = true; };
  EXPECT_EQ(Pack(o).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(ReadAll(dir / "out").size(), 40u);
  o.overwrite = false;
  o.resume = true;
  o.stop = nullptr;
  o.after_commit = nullptr;
  ASSERT_OK(Pack(o).status());
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "out"));
  EXPECT_EQ(ds.manifest().packing["options"]["quality"], 50);
  EXPECT_EQ(ds.size(), 40);
}

// --overwrite exchanges the old dataset for the new one and removes the old: nothing is left
// beside the output, and a leftover from a pack stopped before its removal goes at the next one.
TEST(Pack, OverwriteLeavesOnlyTheNewDataset) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 3);
  auto o = Options(dir / "src", dir / "out");
  ASSERT_OK(Pack(o).status());
  o.overwrite = true;
  o.quality = 50;
  ASSERT_OK(Pack(o).status());
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "out"));
  EXPECT_EQ(ds.manifest().packing["options"]["quality"], 50);
  EXPECT_FALSE(fs::exists(dir / "out.partial"));
  EXPECT_FALSE(fs::exists(dir / "out.replaced"));
  EXPECT_FALSE(fs::exists(dir / "out.publishing"));
  // A replaced dataset left by a stopped pack (a copy of the current one) goes at the next pack.
  fs::copy(dir / "out", dir / "out.replaced", fs::copy_options::recursive);
  o.quality = 60;
  ASSERT_OK(Pack(o).status());
  EXPECT_FALSE(fs::exists(dir / "out.replaced"));
  EXPECT_FALSE(fs::exists(dir / "out.publishing"));
}

// The journal Publish writes before it exchanges: the new folder's device and inode.
void WriteJournal(const fs::path& journal, const fs::path& fresh) {
  struct stat st {};
  ASSERT_EQ(::stat(fresh.c_str(), &st), 0);
  const std::string text = fmt::format("{} {}\n", static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
  testing::WriteBytes(journal, std::vector<std::byte>(reinterpret_cast<const std::byte*>(text.data()),
                                                      reinterpret_cast<const std::byte*>(text.data() + text.size())));
}

// A pack stopped at each step of the publication resumes to the new dataset in place and nothing
// else: the journal, not the datasets' fingerprints, says which folder is the new one. (Guessing
// from fingerprints put the old dataset back when only the images' contents had changed, and
// removed a finished pack of other options that sat at the partial name.)
TEST(Pack, APackStoppedWhilePublishingResumesToTheNewDataset) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 3);
  auto o = Options(dir / "src", dir / "old");
  ASSERT_OK(Pack(o).status());
  // The same names and options, other contents: the same fingerprint.
  const fs::path changed = dir / "src" / "ant" / fs::directory_iterator(dir / "src" / "ant")->path().filename();
  testing::WriteBytes(changed, testing::EncodeJpeg(testing::MakeImage(40, 30, 3, 99)));
  o.output = dir / "new";
  ASSERT_OK(Pack(o).status());
  const auto old_bytes = testing::ReadBytes(dir / "old" / "data.mdb");
  const auto new_bytes = testing::ReadBytes(dir / "new" / "data.mdb");
  ASSERT_NE(old_bytes, new_bytes);
  o.output = dir / "out";
  o.resume = true;
  enum Step { kBeforeTheExchange, kAfterTheExchange, kAfterTheMove, kBetweenTheTwoRenames };
  for (Step step : {kBeforeTheExchange, kAfterTheExchange, kAfterTheMove, kBetweenTheTwoRenames}) {
    SCOPED_TRACE(fmt::format("stopped at step {}", static_cast<int>(step)));
    for (const char* name : {"out", "out.partial", "out.replaced", "out.publishing"}) fs::remove_all(dir / name);
    fs::copy(dir / "old", dir / "old-copy", fs::copy_options::recursive);
    fs::copy(dir / "new", dir / "new-copy", fs::copy_options::recursive);
    switch (step) {
      case kBeforeTheExchange:
        fs::rename(dir / "old-copy", dir / "out");
        fs::rename(dir / "new-copy", dir / "out.partial");
        WriteJournal(dir / "out.publishing", dir / "out.partial");
        break;
      case kAfterTheExchange:
        fs::rename(dir / "new-copy", dir / "out");
        fs::rename(dir / "old-copy", dir / "out.partial");
        WriteJournal(dir / "out.publishing", dir / "out");
        break;
      case kAfterTheMove:
        fs::rename(dir / "new-copy", dir / "out");
        fs::rename(dir / "old-copy", dir / "out.replaced");
        WriteJournal(dir / "out.publishing", dir / "out");
        break;
      case kBetweenTheTwoRenames:  // a filesystem without the exchange
        fs::rename(dir / "old-copy", dir / "out.replaced");
        fs::rename(dir / "new-copy", dir / "out.partial");
        WriteJournal(dir / "out.publishing", dir / "out.partial");
        break;
    }
    ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(o));
    EXPECT_TRUE(s.splits[0].already_complete);
    EXPECT_EQ(testing::ReadBytes(dir / "out" / "data.mdb"), new_bytes);
    for (const char* name : {"out.partial", "out.replaced", "out.publishing"}) {
      EXPECT_FALSE(fs::exists(dir / name)) << name;
    }
  }
  // Without a journal, a finished dataset at the partial name that this command did not pack is
  // not taken for a replaced one: refused, and kept.
  for (const char* name : {"out", "out.partial", "out.replaced", "out.publishing"}) fs::remove_all(dir / name);
  o.resume = false;
  ASSERT_OK(Pack(o).status());
  auto other = Options(dir / "src", dir / "other");
  other.quality = 50;
  ASSERT_OK(Pack(other).status());
  fs::rename(dir / "other", dir / "out.partial");
  o.resume = true;
  auto refused = Pack(o);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status().ToString();
  EXPECT_TRUE(fs::exists(dir / "out.partial" / "data.mdb"));
}

// Stopped between the two renames of a filesystem without the exchange (the old dataset at
// OUT.replaced, the new one at OUT.partial, nothing at OUT): whatever the next command, a dataset is
// at OUT afterwards. The next pack used to remove the old one before publishing the new one, and a
// rerun without --resume, or with other options, then ended with no dataset at all.
TEST(Pack, APackStoppedBetweenTheTwoRenamesNeverLeavesTheOutputEmpty) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 3);
  auto o = Options(dir / "src", dir / "old");
  ASSERT_OK(Pack(o).status());
  o.output = dir / "new";
  o.quality = 70;
  ASSERT_OK(Pack(o).status());
  const auto new_bytes = testing::ReadBytes(dir / "new" / "data.mdb");
  auto stopped = [&] {
    for (const char* name : {"out", "out.partial", "out.replaced", "out.publishing"}) fs::remove_all(dir / name);
    fs::copy(dir / "old", dir / "out.replaced", fs::copy_options::recursive);
    fs::copy(dir / "new", dir / "out.partial", fs::copy_options::recursive);
    WriteJournal(dir / "out.publishing", dir / "out.partial");
  };
  o.output = dir / "out";
  // Without --resume: the output exists by then, and is not replaced without --overwrite.
  stopped();
  o.quality = 70;
  auto plain = Pack(o);
  EXPECT_EQ(plain.status().code(), StatusCode::kInvalidArgument) << plain.status().ToString();
  EXPECT_EQ(testing::ReadBytes(dir / "out" / "data.mdb"), new_bytes);
  // --resume with other options: refused, the published dataset kept.
  stopped();
  o.quality = 50;
  o.resume = true;
  auto other = Pack(o);
  EXPECT_EQ(other.status().code(), StatusCode::kInvalidArgument) << other.status().ToString();
  EXPECT_EQ(testing::ReadBytes(dir / "out" / "data.mdb"), new_bytes);
  for (const char* name : {"out.partial", "out.replaced", "out.publishing"}) {
    EXPECT_FALSE(fs::exists(dir / name)) << name;
  }
  // The journal, nothing at OUT, and the new folder moved away from the partial name by hand: the
  // dataset being replaced is put back, not removed.
  stopped();
  fs::rename(dir / "out.partial", dir / "elsewhere");
  o.quality = 70;
  o.resume = false;
  auto again = Pack(o);
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument) << again.status().ToString();
  EXPECT_EQ(testing::ReadBytes(dir / "out" / "data.mdb"), testing::ReadBytes(dir / "old" / "data.mdb"));
  EXPECT_FALSE(fs::exists(dir / "out.replaced"));
  // No journal: a leftover OUT.replaced is removed, even with nothing at OUT (the user removed the
  // dataset since), and the pack goes on; it is not brought back.
  for (const char* name : {"out", "out.partial", "out.replaced", "out.publishing", "elsewhere"}) {
    fs::remove_all(dir / name);
  }
  fs::copy(dir / "old", dir / "out.replaced", fs::copy_options::recursive);
  ASSERT_OK(Pack(o).status());
  EXPECT_FALSE(fs::exists(dir / "out.replaced"));
  EXPECT_OK(Dataset::Open(dir / "out").status());
}

// The splits of a pack are published together, after both are packed: a repack stopped while it
// packs the validation set leaves both old outputs as they were (it published the new training
// set beside the old validation set), and --resume publishes both.
TEST(Pack, ARepackStoppedInItsSecondSplitLeavesBothOldOutputs) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 10);
  auto o = Options(dir / "src", dir / "train.lmdb");
  o.val_fraction = 0.5;
  ASSERT_OK_AND_ASSIGN(PackSummary first, Pack(o));
  const int64_t train_records = first.splits[0].records;
  const auto old_train = ReadAll(dir / "train.lmdb");
  const auto old_val = ReadAll(dir / "train_val.lmdb");
  o.overwrite = true;
  o.quality = 50;
  o.commit_every = 4;
  std::atomic<bool> stop{false};
  o.stop = &stop;
  o.after_commit = [&](int64_t records) {
    if (records > train_records) stop = true;  // in the validation split
  };
  EXPECT_EQ(Pack(o).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(ReadAll(dir / "train.lmdb"), old_train);
  EXPECT_EQ(ReadAll(dir / "train_val.lmdb"), old_val);
  o.overwrite = false;
  o.resume = true;
  o.stop = nullptr;
  o.after_commit = nullptr;
  ASSERT_OK(Pack(o).status());
  for (const char* name : {"train.lmdb", "train_val.lmdb"}) {
    ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / name));
    EXPECT_EQ(ds.manifest().packing["options"]["quality"], 50) << name;
  }
  for (const char* name : {"train.lmdb.partial", "train_val.lmdb.partial", "train.lmdb.replaced",
                           "train_val.lmdb.replaced", "train.lmdb.publishing"}) {
    EXPECT_FALSE(fs::exists(dir / name)) << name;
  }
}

// A folder of the user's files at OUT.replaced is refused before any image is packed.
TEST(Pack, AUserFolderAtTheReplacedNameIsRefusedBeforePacking) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 2);
  auto o = Options(dir / "src", dir / "out");
  ASSERT_OK(Pack(o).status());
  fs::create_directories(dir / "out.replaced");
  testing::WriteBytes(dir / "out.replaced" / "notes.txt", std::vector<std::byte>(4, std::byte{'x'}));
  o.overwrite = true;
  auto refused = Pack(o);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("notes.txt"), std::string::npos) << refused.status().ToString();
  EXPECT_FALSE(fs::exists(dir / "out.partial"));  // nothing packed
}

TEST(Pack, NonUtf8NamesAreReportedNotFatal) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 2);
  testing::WriteBytes(dir / "src" / "ant" / "caf\xe9.jpg", std::vector<std::byte>(30, std::byte{1}));
  testing::WriteBytes(dir / "src" / "bee" / "\xff\xfe.jpg",
                      testing::EncodeJpeg(testing::MakeImage(16, 16, 3)));
  auto o = Options(dir / "src", dir / "out");
  o.report_file = dir / "report.json";
  o.commit_every = 1;  // the resume state with the odd name is written at once
  ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(o));
  EXPECT_EQ(s.bad.size(), 1u);
  EXPECT_EQ(s.splits[0].records, 9);
  EXPECT_TRUE(fs::exists(dir / "report.json"));
  ASSERT_OK_AND_ASSIGN(auto report, inspect::Inspect(dir / "out", {.verify = true, .progress = false}));
  EXPECT_TRUE(report.bad.empty());
  EXPECT_FALSE(inspect::ReportJson(report).dump(-1, ' ', false,
                                                nlohmann::json::error_handler_t::replace).empty());
}

TEST(Pack, OversizedFilesAreSkipped) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", {"a"}, 3);
  auto o = Options(dir / "src", dir / "out");
  o.max_file_bytes = 64;
  ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(o));
  EXPECT_EQ(s.splits[0].records, 0);
  ASSERT_EQ(s.bad.size(), 3u);
  EXPECT_NE(s.bad[0].reason.find("limit"), std::string::npos) << s.bad[0].reason;
}

// ---- inspect ----

// Names from the dataset print as one line each, control bytes escaped: a class folder named with a
// newline split the "per class" line, and an escape sequence in a name reached the terminal.
TEST(Inspect, ControlBytesInNamesAreEscapedInTheText) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", {"a\nb", "red\x1b[31m", "csi\xc2\x9b" "1m \xc3\xa9t\xc3\xa9"}, 2);
  ASSERT_OK(Pack(Options(dir / "src", dir / "out")).status());
  ASSERT_OK_AND_ASSIGN(auto report, inspect::Inspect(dir / "out", {.progress = false}));
  const std::string text = inspect::FormatReport(report);
  EXPECT_NE(text.find("per class      a\\x0ab:2 csi\\u009b1m \xc3\xa9t\xc3\xa9:2 red\\x1b[31m:2\n"), std::string::npos)
      << text;  // (UTF-8 text as it is)
  EXPECT_EQ(text.find('\x1b'), std::string::npos) << text;
  EXPECT_EQ(inspect::ReportJson(report)["class_names"][0], "a\nb");  // the JSON keeps them as they are
}

TEST(Inspect, SummaryVerifyAndExtract) {
  TempDir dir;
  auto files = testing::MakeImageTree(dir / "src", kClasses, 5);
  ASSERT_OK(Pack(Options(dir / "src", dir / "out")).status());
  inspect::InspectOptions io{.verify = true, .threads = 2, .progress = false};
  ASSERT_OK_AND_ASSIGN(auto report, inspect::Inspect(dir / "out", io));
  EXPECT_TRUE(report.bad.empty());
  EXPECT_TRUE(report.manifest_problems.empty());
  EXPECT_TRUE(report.intact());
  auto j = inspect::ReportJson(report);
  EXPECT_EQ(j["records"], 20);
  EXPECT_EQ(j["classes"], 4);
  EXPECT_EQ(j["verify"]["bad"].size(), 0u);
  std::string text = inspect::FormatReport(report);
  EXPECT_NE(text.find("records        20"), std::string::npos) << text;
  EXPECT_EQ(j["restart_index"]["records"], 20);
  EXPECT_NE(text.find("restart index  20 records"), std::string::npos) << text;

  // The extracted JPEG (without the index) decodes to the original's pixels.
  ASSERT_OK(inspect::ExtractRecord(dir / "out", 7, dir / "seven.jpg"));
  decode::JpegDecoder decoder;
  Image extracted, original;
  ASSERT_OK(decoder.Decode(testing::ReadBytes(dir / "seven.jpg"), &extracted));
  ASSERT_OK(decoder.Decode(testing::ReadBytes(files[7]), &original));
  EXPECT_EQ(extracted.pixels, original.pixels);
  EXPECT_EQ(inspect::ExtractRecord(dir / "out", 20, dir / "x.jpg").code(), StatusCode::kInvalidArgument);
}

// A copy of `ds`'s records at `dest` under the manifest `m`, each header first passed to `edit`.
void CopyUnderManifest(const Dataset& ds, const fs::path& dest, const dataset::Manifest& m,
                       const std::function<void(int64_t, dataset::RecordHeader&)>& edit = {}) {
  ASSERT_OK_AND_ASSIGN(auto reader, ds.NewReader());
  ASSERT_OK_AND_ASSIGN(auto writer, dataset::DatasetWriter::Create(dest, {}));
  for (int64_t i = 0; i < ds.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(RecordView r, reader.Get(i));
    dataset::RecordHeader h = r.header;
    if (edit) edit(i, h);
    writer.Append(h, std::vector<std::byte>(r.payload.begin(), r.payload.end()), "");
  }
  ASSERT_OK(writer.Finish(m));
}

TEST(Inspect, AManifestWhoseTotalsDisagreeWithTheRecordsIsReported) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 3);
  ASSERT_OK(Pack(Options(dir / "src", dir / "out")).status());
  // The same records under a manifest that moves one record between classes (the sum, which
  // opening checks, still holds) and miscounts the bytes by one.
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "out"));
  dataset::Manifest m = ds.manifest();
  m.class_counts[0] += 1;
  m.class_counts[1] -= 1;
  m.payload_bytes += 1;
  ASSERT_NO_FATAL_FAILURE(CopyUnderManifest(ds, dir / "copy", m));
  for (bool verify : {false, true}) {
    SCOPED_TRACE(verify);
    ASSERT_OK_AND_ASSIGN(auto report, inspect::Inspect(dir / "copy", {.verify = verify, .progress = false}));
    EXPECT_TRUE(report.bad.empty());
    EXPECT_FALSE(report.intact());
    ASSERT_EQ(report.manifest_problems.size(), 3u);
    EXPECT_NE(report.manifest_problems[0].find("class_counts[0] ('" + m.classes[0] + "') is 4, the records hold 3"),
              std::string::npos) << report.manifest_problems[0];
    EXPECT_NE(report.manifest_problems[2].find("payload_bytes is " + std::to_string(m.payload_bytes)),
              std::string::npos) << report.manifest_problems[2];
    EXPECT_EQ(inspect::ReportJson(report)["manifest_problems"].size(), 3u);
    EXPECT_NE(inspect::FormatReport(report).find("manifest       class_counts[1]"), std::string::npos);
  }
  // A total of 0 is a total, not "left out" (it passed unreported, and 0 B was printed); the
  // summary gives what the records hold.
  dataset::Manifest zero = ds.manifest();
  zero.payload_bytes = 0;
  ASSERT_NO_FATAL_FAILURE(CopyUnderManifest(ds, dir / "zero", zero));
  ASSERT_OK_AND_ASSIGN(auto report, inspect::Inspect(dir / "zero", {.progress = false}));
  ASSERT_EQ(report.manifest_problems.size(), 1u);
  EXPECT_NE(report.manifest_problems[0].find("payload_bytes is 0, the records hold"), std::string::npos)
      << report.manifest_problems[0];
  EXPECT_EQ(report.summary["payload_bytes"], ds.manifest().payload_bytes);
}

// Records whose header cannot be read are in --json too (the text listed them; the JSON, without
// --verify, said nothing of why inspect exited 3).
TEST(Inspect, UnreadableRecordsAreInTheJsonAsInTheText) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 3);
  ASSERT_OK(Pack(Options(dir / "src", dir / "out")).status());
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "out"));
  ASSERT_NO_FATAL_FAILURE(CopyUnderManifest(ds, dir / "copy", ds.manifest(), [](int64_t i, dataset::RecordHeader& h) {
    if (i == 5) h.encoding = static_cast<dataset::PayloadEncoding>(77);  // no such encoding
  }));
  ASSERT_OK_AND_ASSIGN(auto report, inspect::Inspect(dir / "copy", {.progress = false}));
  ASSERT_EQ(report.bad.size(), 1u);
  EXPECT_NE(inspect::FormatReport(report).find("bad record 5"), std::string::npos) << inspect::FormatReport(report);
  const auto j = inspect::ReportJson(report);
  ASSERT_EQ(j["unreadable"].size(), 1u) << j.dump();
  EXPECT_EQ(j["unreadable"][0]["index"], 5);
}

// Class folders whose names are not UTF-8 are stored with U+FFFD for their odd bytes: two that
// become one name are refused (two classes no reader could tell apart), one alone is packed.
TEST(Pack, ClassFoldersThatWouldBeStoredUnderOneNameAreRefused) {
  TempDir dir;
  for (const char* name : {"\xFF", "\xFE", "fine"}) {
    fs::create_directories(dir / "src" / name);
    testing::WriteBytes(dir / "src" / name / "a.jpg", testing::EncodeJpeg(testing::MakeImage(16, 16, 3, 1)));
  }
  auto refused = Pack(Options(dir / "src", dir / "out"));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("would both be stored as the class"), std::string::npos)
      << refused.status().ToString();
  fs::remove_all(dir / "src" / "\xFE");
  ASSERT_OK(Pack(Options(dir / "src", dir / "out")).status());
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "out"));
  EXPECT_EQ(ds.manifest().classes.size(), 2u);
}

TEST(Inspect, AVerifyStoppedEarlySaysSoAndBadThreadCountsAreRefused) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 5);
  ASSERT_OK(Pack(Options(dir / "src", dir / "out")).status());
  std::atomic<bool> stop{true};
  inspect::InspectOptions io{.verify = true, .threads = 1, .progress = false, .stop = &stop};
  auto stopped = inspect::Inspect(dir / "out", io);
  EXPECT_EQ(stopped.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(stopped.status().message().find("stopped after 0 of 20"), std::string::npos)
      << stopped.status().ToString();
  stop = false;
  ASSERT_OK_AND_ASSIGN(auto whole, inspect::Inspect(dir / "out", io));
  EXPECT_TRUE(whole.verified);
  io.threads = 1 << 30;
  EXPECT_EQ(inspect::Inspect(dir / "out", io).status().code(), StatusCode::kInvalidArgument);
}

// A dataset folder `copy` holding only `data` as its data.mdb, verified.
Result<inspect::InspectReport> VerifyCopy(const fs::path& copy, const std::vector<std::byte>& data) {
  fs::remove_all(copy);
  fs::create_directories(copy);
  testing::WriteBytes(copy / "data.mdb", data);
  return inspect::Inspect(copy, {.verify = true, .progress = false});
}

TEST(Inspect, RandomBitFlipsInTheDataFileAreCaughtOrHarmless) {
  // 1,000 copies of a packed dataset, each with one random bit of data.mdb flipped (B-tree pages,
  // meta pages, records, free space). Opening and verifying each must fail cleanly or report the
  // damaged records; when it reports nothing, every record must read back unchanged: no crash and
  // no silently wrong record.
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 12);
  ASSERT_OK(Pack(Options(dir / "src", dir / "ds")).status());
  const auto original = ReadAll(dir / "ds");
  const auto data = testing::ReadBytes(dir / "ds" / "data.mdb");
  std::mt19937 rng(3);
  int refused = 0, flagged = 0, harmless = 0;
  for (int trial = 0; trial < 1000; ++trial) {
    const fs::path copy = dir / ("flip" + std::to_string(trial % 2));
    auto bytes = data;
    const size_t pos = rng() % bytes.size();
    bytes[pos] ^= std::byte{static_cast<unsigned char>(1u << (rng() % 8))};
    auto report = VerifyCopy(copy, bytes);
    if (!report.ok()) {
      ++refused;
      EXPECT_NE(report.status().message().find(copy.filename().string()), std::string::npos)
          << "byte " << pos << ": " << report.status().ToString();
      continue;
    }
    if (!report->bad.empty()) {
      ++flagged;
      for (const auto& b : report->bad) EXPECT_FALSE(b.reason.empty());
      continue;
    }
    ++harmless;
    // Nothing reported: then nothing may differ.
    auto ds = Dataset::Open(copy);
    ASSERT_OK(ds.status());
    auto reader = ds->NewReader();
    ASSERT_OK(reader.status());
    ASSERT_EQ(ds->size(), static_cast<int64_t>(original.size())) << "byte " << pos;
    for (int64_t i = 0; i < ds->size(); ++i) {
      auto r = reader->Get(i);
      ASSERT_OK(r.status());
      const auto& want = original[static_cast<size_t>(i)];
      EXPECT_TRUE(std::equal(r->image.begin(), r->image.end(), want.payload.begin(), want.payload.end()) &&
                  r->header.label == want.label)
          << "byte " << pos << " changed record " << i << " without being reported";
    }
  }
  std::printf("1000 single-bit flips: %d refused at open, %d reported as bad records, %d harmless\n", refused,
              flagged, harmless);
  EXPECT_GT(flagged, 0);
}

TEST(Inspect, EveryZeroedPageIsCaughtOrHarmlessToRecordsAndPaths) {
  // Each 4 KiB page of data.mdb zeroed in turn (meta, B-tree branches and leaves of the records,
  // paths and meta tables, overflow pages). An intact verify must mean that every record and every
  // source path reads back as packed: a zeroed page of the paths table lost every path while the
  // records verified as intact.
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 6);
  ASSERT_OK(Pack(Options(dir / "src", dir / "ds")).status());
  const auto original = ReadAll(dir / "ds");
  const auto data = testing::ReadBytes(dir / "ds" / "data.mdb");
  constexpr size_t kPage = 4096;
  int refused = 0, reported = 0, harmless = 0;
  for (size_t page = 0; page * kPage < data.size(); ++page) {
    const fs::path copy = dir / "zeroed";
    auto bytes = data;
    std::fill(bytes.begin() + static_cast<ptrdiff_t>(page * kPage),
              bytes.begin() + static_cast<ptrdiff_t>(std::min(bytes.size(), (page + 1) * kPage)), std::byte{0});
    auto report = VerifyCopy(copy, bytes);
    if (!report.ok()) {
      ++refused;
      continue;
    }
    if (!report->intact()) {
      ++reported;
      continue;
    }
    ++harmless;
    ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(copy));
    ASSERT_OK_AND_ASSIGN(auto reader, ds.NewReader());
    ASSERT_EQ(ds.size(), static_cast<int64_t>(original.size())) << "page " << page;
    for (int64_t i = 0; i < ds.size(); ++i) {
      const auto& want = original[static_cast<size_t>(i)];
      ASSERT_OK_AND_ASSIGN(RecordView r, reader.Get(i));
      EXPECT_TRUE(std::equal(r.image.begin(), r.image.end(), want.payload.begin(), want.payload.end()) &&
                  r.header.label == want.label)
          << "page " << page << " changed record " << i << " without being reported";
      auto path = reader.SourcePath(i);
      EXPECT_TRUE(path.ok() && *path == want.path)
          << "page " << page << " lost the path of record " << i << " without being reported: "
          << (path.ok() ? *path : path.status().ToString());
    }
  }
  std::printf("%zu pages zeroed: %d refused at open, %d reported, %d harmless\n", data.size() / kPage, refused,
              reported, harmless);
  EXPECT_GT(reported, 0);
}

TEST(Inspect, VerifyNamesTheDamagedRecord) {
  TempDir dir;
  auto files = testing::MakeImageTree(dir / "src", kClasses, 5);
  ASSERT_OK(Pack(Options(dir / "src", dir / "out")).status());
  // Damage record 11's payload inside the data file.
  std::vector<std::byte> payload;
  {
    ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "out"));
    ASSERT_OK_AND_ASSIGN(auto reader, ds.NewReader());
    ASSERT_OK_AND_ASSIGN(RecordView r, reader.Get(11));
    payload.assign(r.image.begin(), r.image.end());
  }
  auto data = testing::ReadBytes(dir / "out" / "data.mdb");
  // Entropy-coded bytes near the end are unique to this image (the tables before are shared).
  auto it = std::search(data.begin(), data.end(), payload.end() - 80, payload.end() - 16);
  ASSERT_NE(it, data.end());
  *(it + 10) ^= std::byte{0x40};
  testing::WriteBytes(dir / "out" / "data.mdb", data);
  ASSERT_OK_AND_ASSIGN(auto report,
                       inspect::Inspect(dir / "out", {.verify = true, .threads = 2, .progress = false}));
  ASSERT_EQ(report.bad.size(), 1u);
  EXPECT_EQ(report.bad[0].index, 11);
  EXPECT_EQ(report.bad[0].source_path, "cat/cat_101.jpg");
  EXPECT_NE(report.bad[0].reason.find("CRC"), std::string::npos);
}

TEST(Inspect, VerifyChecksTheRestartIndexAgainstTheBytes) {
  TempDir dir;
  testing::MakeImageTree(dir / "src", kClasses, 3);
  ASSERT_OK(Pack(Options(dir / "src", dir / "out")).status());
  // A record whose index was damaged before its CRC was computed (a writer's bug, not the disk):
  // the CRC holds, so only the check of the index against the bytes can catch it.
  ASSERT_OK_AND_ASSIGN(Dataset ds, Dataset::Open(dir / "out"));
  ASSERT_OK_AND_ASSIGN(auto reader, ds.NewReader());
  ASSERT_OK_AND_ASSIGN(RecordView r, reader.Get(4));
  std::vector<std::byte> payload(r.payload.begin(), r.payload.end());
  payload[r.image.size() + 4] ^= std::byte{0x01};  // the second interval's distance
  dataset::RecordHeader h = r.header;
  dataset::SealRecordHeader(h, payload, 4);
  std::vector<std::byte> value(dataset::kRecordHeaderSize);
  dataset::EncodeRecordHeader(h, std::span<std::byte, dataset::kRecordHeaderSize>(value.data(), value.size()));
  value.insert(value.end(), payload.begin(), payload.end());
  ASSERT_OK_AND_ASSIGN(RecordView damaged, ds.CheckRecord(value, 4, true));
  decode::JpegDecoder decoder;
  decode::RestartIndex index{damaged.jpeg_index.restart_mcus, damaged.jpeg_index.mcus_per_row,
                             damaged.jpeg_index.mcu_rows,      damaged.jpeg_index.entry_bytes,
                             damaged.jpeg_index.intervals,     damaged.jpeg_index.entries};
  const Status s = decode::CheckRestartIndex(damaged.image, index);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("interval 1"), std::string::npos) << s.ToString();
}

// ---- Shared corpus ----

TEST(PackCorpus, EdgeAndBadSetsPackWithoutCrashing) {
  STOKE_REQUIRE_SHARED_DATA(data);
  TempDir dir;
  auto o = Options(data / "edge", dir / "edge");
  o.max_side = 2048;  // keeps the 108-Mpixel bomb's re-encode small
  ASSERT_OK_AND_ASSIGN(PackSummary edge, Pack(o));
  EXPECT_EQ(edge.splits[0].records, 98);
  EXPECT_EQ(edge.bad.size(), 8u);
  for (const auto& b : edge.bad) EXPECT_EQ(b.path.rfind("unsupported_by_ljt2/", 0), 0u) << b.path;
  ASSERT_OK_AND_ASSIGN(auto report, inspect::Inspect(dir / "edge", {.verify = true, .progress = false}));
  EXPECT_TRUE(report.bad.empty());

  ASSERT_OK_AND_ASSIGN(PackSummary bad, Pack(Options(data / "bad", dir / "bad")));
  // Every JPEG in bad/ is rejected; what is kept is only non-JPEG payloads OpenCV can read.
  EXPECT_EQ(bad.splits[0].records, bad.converted);
  EXPECT_EQ(static_cast<int64_t>(bad.bad.size()) + bad.splits[0].records, 271);
  ASSERT_OK_AND_ASSIGN(auto bad_report, inspect::Inspect(dir / "bad", {.verify = true, .progress = false}));
  EXPECT_TRUE(bad_report.bad.empty());
}

TEST(PackCorpus, ImagenetLikePacksAndVerifies) {
  STOKE_REQUIRE_SHARED_DATA(data);
  TempDir dir;
  ASSERT_OK_AND_ASSIGN(PackSummary s, Pack(Options(data / "imagenet_like", dir / "in")));
  EXPECT_EQ(s.splits[0].records, 1000);
  EXPECT_EQ(s.classes, 1000);
  EXPECT_EQ(s.reoriented, 1);  // n02951585_can_opener carries orientation 6
  ASSERT_OK_AND_ASSIGN(auto report, inspect::Inspect(dir / "in", {.verify = true, .progress = false}));
  EXPECT_TRUE(report.bad.empty());
  EXPECT_EQ(report.summary["records"], 1000);
}

}  // namespace
}  // namespace stoke::pack
