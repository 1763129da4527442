#include "tools/pack/packer.h"

#include <fmt/format.h>
#include <oneapi/tbb/concurrent_queue.h>
#include <oneapi/tbb/enumerable_thread_specific.h>
#include <oneapi/tbb/parallel_pipeline.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <opencv2/core.hpp>
#if STOKE_PACK_OTHER_FORMATS
#include <opencv2/imgcodecs.hpp>
#endif
#include <opencv2/imgproc.hpp>
#include <optional>
#include <set>
#include <span>
#include <system_error>
#include <thread>
#include <tuple>
#include <unordered_map>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/digest.h"
#include "common/file_util.h"
#include "common/json_util.h"
#include "common/limits.h"
#include "common/logging.h"
#include "common/progress.h"
#include "common/sys_memory.h"
#include "common/random.h"
#include "common/tsan.h"
#include "common/version.h"
#include "dataset/dataset.h"
#include "dataset/writer.h"
#include "decode/jpeg_decoder.h"
#include "decode/jpeg_transcode.h"
#include "decode/jpeg_encoder.h"

namespace stoke::pack {
namespace fs = std::filesystem;
using dataset::PayloadEncoding;
using dataset::RecordHeader;

namespace {

struct Input {
  fs::path path;    // as opened
  std::string key;  // as stored and reported: relative to the source root
  int32_t label = 0;
  // The first input naming the same file (itself when none): copies of one image go to one split,
  // or a validation image would also be trained on.
  size_t first = 0;
};

// What makes two paths one image: the file's device and inode (so links, hard links and any
// spelling of the path are one file), or, when it cannot be stat'ed, the absolute path as written
// (packing then reports that input).
std::string FileIdentity(const fs::path& p) {
  struct stat st {};
  if (::stat(p.c_str(), &st) == 0) return fmt::format("inode {}:{}", st.st_dev, st.st_ino);
  std::error_code ec;
  return "path " + fs::absolute(p, ec).lexically_normal().generic_string();
}

struct InputSet {
  std::vector<std::string> classes;
  std::vector<Input> inputs;
};

// ---- Listing inputs ---------------------------------------------------------------------------

Result<InputSet> ListFolderTree(const fs::path& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    return NotFoundError(fmt::format("pack: {}: not a directory", root.string()));
  }
  InputSet set;
  std::vector<fs::path> class_dirs;
  std::vector<std::string> loose;  // files beside the class folders: in no class, so not packed
  for (const auto& e : fs::directory_iterator(root, ec)) {
    std::error_code entry_ec;  // a symlink loop or a dangling link is no class folder, not a failure
    if (e.path().filename().string()[0] == '.') continue;
    if (e.is_directory(entry_ec)) {
      class_dirs.push_back(e.path());
    } else if (e.is_symlink(entry_ec) && !e.exists(entry_ec)) {
      // Dropped, it would shift the labels of every class after it: said, not silent.
      STOKE_LOG(WARN, "pack: {}: a link to no readable folder (dangling or a loop) is not a class", e.path().string());
    } else {
      loose.push_back(e.path().filename().string());
    }
  }
  if (ec) return IoError(fmt::format("pack: {}: {}", root.string(), ec.message()));
  std::sort(class_dirs.begin(), class_dirs.end());
  if (!loose.empty() && !class_dirs.empty()) {
    std::sort(loose.begin(), loose.end());
    STOKE_LOG(WARN, "pack: {}: {} file(s) directly in it (e.g. {}) are in no class folder and are not packed "
              "(expected SRC/<class>/<image>)", root.string(), loose.size(), loose.front());
  }
  // A dataset's root, given for one of its splits: its classes would be the splits.
  static const std::set<std::string> kSplitNames = {"train", "val", "validation", "valid", "test"};
  if (class_dirs.size() > 1 && std::all_of(class_dirs.begin(), class_dirs.end(), [](const fs::path& d) {
        return kSplitNames.count(d.filename().string()) > 0;
      })) {
    std::string names;
    for (const fs::path& d : class_dirs) names += (names.empty() ? "" : ", ") + d.filename().string();
    STOKE_LOG(WARN, "pack: {}: its class folders are all named as splits ({}): if it is a dataset's root, pack "
              "each split's folder instead (e.g. {})", root.string(), names, class_dirs.back().string());
  }
  if (class_dirs.empty()) {
    return InvalidArgumentError(
        fmt::format("pack: {}: no class sub-folders (expected SRC/<class>/<image>, or pass --list)",
                    root.string()));
  }
  // The manifest is UTF-8 JSON: a name that is not UTF-8 is stored with U+FFFD for its odd bytes,
  // and two such names could become one (two classes no reader could tell apart).
  std::map<std::string, fs::path> stored_as;
  for (const fs::path& d : class_dirs) {
    const std::string name = d.filename().string();
    if (IsUtf8(name)) continue;
    const std::string stored = nlohmann::json(name).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    auto [it, fresh] = stored_as.emplace(stored, d);
    if (!fresh) {
      return InvalidArgumentError(fmt::format(
          "pack: class folders {} and {} would both be stored as the class {} (their names are not UTF-8, and the "
          "manifest is UTF-8 JSON); rename one of them",
          it->second.string(), d.string(), stored));
    }
    STOKE_LOG(WARN, "pack: class folder {}: its name is not UTF-8; the manifest stores it as {}", d.string(), stored);
  }
  for (size_t label = 0; label < class_dirs.size(); ++label) {
    set.classes.push_back(class_dirs[label].filename().string());
    std::vector<Input> files;
    fs::path entered = class_dirs[label];  // the folder whose listing an error would be about
    for (auto it = fs::recursive_directory_iterator(class_dirs[label], ec);
         it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (ec) break;
      const std::string name = it->path().filename().string();
      std::error_code entry_ec;
      if (name[0] == '.') {
        if (it->is_directory(entry_ec)) it.disable_recursion_pending();
        continue;
      }
      // A folder (not a link to one) is listed by the iterator itself. Everything else is an input:
      // a FIFO, a socket, a dangling link, a link loop or a link to a folder fails to read as an
      // image and so is reported with the other skipped inputs (or fails the pack under
      // --on-error fail), instead of vanishing from the dataset without a word.
      if (it->is_directory(entry_ec) && !it->is_symlink(entry_ec)) {
        entered = it->path();
        continue;
      }
      files.push_back(Input{it->path(), it->path().lexically_relative(root).generic_string(),
                            static_cast<int32_t>(label)});
    }
    if (ec) {
      return IoError(fmt::format("pack: {}: {} (while listing class '{}'; fix or remove it and pack again)",
                                 entered.string(), ec.message(), set.classes.back()));
    }
    std::sort(files.begin(), files.end(),
              [](const Input& a, const Input& b) { return a.key < b.key; });
    set.inputs.insert(set.inputs.end(), files.begin(), files.end());
  }
  // Copies of one file (links, hard links) stay in one split. One file in two classes (a class
  // folder linked to another, a link across classes) is packed under both labels, as the tree
  // says, but said: it is rarely meant.
  std::unordered_map<std::string, size_t> first_seen;
  int64_t across = 0;
  std::string example;
  for (size_t i = 0; i < set.inputs.size(); ++i) {
    Input& in = set.inputs[i];
    in.first = first_seen.try_emplace(FileIdentity(in.path), i).first->second;
    const Input& earlier = set.inputs[in.first];
    if (earlier.label != in.label && across++ == 0) {
      example = fmt::format("{} in class '{}' is {} in class '{}'", in.key, set.classes[static_cast<size_t>(in.label)],
                            earlier.key, set.classes[static_cast<size_t>(earlier.label)]);
    }
  }
  if (across > 0) {
    STOKE_LOG(WARN,
              "pack: {}: {} input(s) are files already listed under another class (links or hard links; e.g. {}): "
              "each is packed under both labels, in the same split",
              root.string(), across, example);
  }
  return set;
}

Result<InputSet> ReadListFile(const fs::path& list, const fs::path& root) {
  std::ifstream in(list);
  if (!in) return NotFoundError(fmt::format("pack: {}: cannot open list file", list.string()));
  InputSet set;
  int32_t max_label = -1;
  std::unordered_map<std::string, std::tuple<int, long, size_t>> first_seen;  // file -> line, label, input
  int64_t across = 0;  // hard links (other paths to one file) under another label
  std::string example;
  std::string line;
  if (!fs::is_directory(root)) {
    return NotFoundError(fmt::format("pack: {}: not a directory (the root that {}'s paths are relative to)",
                                     root.string(), list.string()));
  }
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    if (line_no == 1 && line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);  // a UTF-8 byte order mark
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find('\r') != std::string::npos || line.find('\0') != std::string::npos) {
      return InvalidArgumentError(fmt::format(
          "pack: {}:{}: a carriage return or NUL byte inside the line (expected one 'relative/path label' per "
          "line, ending in \\n or \\r\\n)", list.string(), line_no));
    }
    const auto first = line.find_first_not_of(" \t");
    if (first == std::string::npos || line[first] == '#') continue;
    // The label is the last field, so paths may contain spaces (as in Caffe's convert_imageset).
    const auto last = line.find_last_not_of(" \t");
    const auto sep = line.find_last_of(" \t", last);
    auto bad = [&](const std::string& why) {
      return InvalidArgumentError(fmt::format("pack: {}:{}: {} (expected 'relative/path label')",
                                              list.string(), line_no, why));
    };
    if (sep == std::string::npos || sep < first) return bad("no label");
    const std::string label_text = line.substr(sep + 1, last - sep);
    std::string path = line.substr(first, sep - first);
    path.erase(path.find_last_not_of(" \t") + 1);
    char* end = nullptr;
    errno = 0;
    long label = std::strtol(label_text.c_str(), &end, 10);
    if (*end != '\0' || errno != 0 || label < 0 || label > 1'000'000) {
      return bad(fmt::format("label '{}' is not an integer in [0, 1000000]", label_text));
    }
    // The same image under two labels is a mistake in the list, not data: which label is right?
    // (The same image twice under one label is kept: lists repeat images to oversample them; the
    // copies stay in one split.) Spellings of one file ("./a/x.jpg", "a//x.jpg", the root's absolute
    // path + "a/x.jpg", a link or hard link to it) are one image (FileIdentity).
    fs::path p(path);
    const fs::path full = p.is_absolute() ? p : root / p;
    const auto [at, fresh] =
        first_seen.try_emplace(FileIdentity(full), std::tuple{line_no, label, set.inputs.size()});
    const auto& [seen_line, seen_label, seen_input] = at->second;
    if (!fresh && seen_label != label) {
      // The same path (however spelled, or through a link to the file) under two labels is the
      // list's mistake. Two paths that are hard links of one file (a deduplicated tree) are kept
      // under both labels, as a folder tree would be, and said.
      const fs::path& seen = set.inputs[seen_input].path;
      std::error_code ec;
      const bool linked = fs::is_symlink(full, ec) || fs::is_symlink(seen, ec);
      if (linked || fs::absolute(full, ec).lexically_normal() == fs::absolute(seen, ec).lexically_normal()) {
        return bad(fmt::format("'{}' has label {} here and label {} on line {} (the same file)", path, label,
                               seen_label, seen_line));
      }
      if (across++ == 0) {
        example = fmt::format("line {} ('{}', label {}) and line {} (label {})", line_no, path, label, seen_line,
                              seen_label);
      }
    }
    set.inputs.push_back(Input{full, path, static_cast<int32_t>(label), seen_input});
    max_label = std::max(max_label, static_cast<int32_t>(label));
  }
  for (int32_t c = 0; c <= max_label; ++c) set.classes.push_back(std::to_string(c));
  if (across > 0) {
    STOKE_LOG(WARN,
              "pack: {}: {} line(s) name a hard link of a file listed under another label (e.g. {}): each is "
              "packed under both labels, in the same split",
              list.string(), across, example);
  }
  return set;
}

// A list's inputs may be anywhere (and a folder tree's links lead out of it): the report must be
// none of them, or writing it would overwrite that image. Only a report file already there can be.
Status CheckReportIsNoInput(const fs::path& report, const std::vector<Input>& inputs) {
  struct stat st {};
  if (report.empty() || ::stat(report.c_str(), &st) != 0) return OkStatus();
  const std::string identity = FileIdentity(report);
  for (const Input& in : inputs) {
    if (FileIdentity(in.path) == identity) {
      return InvalidArgumentError(fmt::format(
          "pack: --report {}: that is the input image {}, which writing the report would overwrite; give another "
          "path", report.string(), in.path.string()));
    }
  }
  return OkStatus();
}

// ---- Per-image work ---------------------------------------------------------------------------

// What a resume compares of the inputs packed before it: each file's size and modification time,
// folded in input order (an input that cannot be stat'ed folds as -1 -1). An image replaced after
// it was packed was kept as it had been, without a word.
struct InputStamp {
  int64_t size = -1, mtime_ns = -1;
};

InputStamp StampOf(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  return {static_cast<int64_t>(st.st_size), static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec};
}

struct Processed {
  bool ok = false;
  std::string reason;  // why not ok
  RecordHeader header;
  std::vector<std::byte> payload;
  bool converted = false, reencoded = false, reoriented = false;
  InputStamp stamp;  // the file as it was read (taken by the worker, off the writer thread)
};

// Per-thread tools: decoder and encoder state is reused across images.
struct Worker {
  explicit Worker(const PackOptions& o) : transcoder({}, {.intervals_per_row = o.index_intervals_per_row}) {}
  decode::JpegDecoder decoder;
  decode::JpegTranscoder transcoder;
  decode::TranscodedJpeg transcoded;
  std::optional<decode::JpegEncoder> encoder;
  Image image;
};

// Stores `jpeg` (already validated or made here) in `out`: transcoded with its restart index when
// the options ask for one, else as it is. A JPEG the transcoder leaves alone (CMYK/YCCK) is kept.
void StoreJpeg(std::vector<std::byte> jpeg, const PackOptions& o, Worker& w, Processed& out) {
  out.header.encoding = PayloadEncoding::kJpeg;
  if (o.index == IndexMode::kRestart) {
    Status s = w.transcoder.Transcode(jpeg, &w.transcoded);
    if (s.ok()) {
      const decode::TranscodedJpeg& t = w.transcoded;
      out.header.encoding = PayloadEncoding::kJpegIndexed;
      out.payload = dataset::EncodeJpegIndexedPayload(t.jpeg, t.offsets, t.restart_mcus, t.mcus_per_row, t.mcu_rows);
      out.ok = true;
      return;
    }
    if (s.code() != StatusCode::kUnavailable) {
      out.reason = "JPEG: " + s.message();
      return;
    }
  }
  out.payload = std::move(jpeg);
  out.ok = true;
}

// Rotates/flips `src` into `dst` so that EXIF orientation `o` displays upright.
void ApplyOrientation(int o, const cv::Mat& src, cv::Mat& dst) {
  switch (o) {
    case 2:
      cv::flip(src, dst, 1);
      break;
    case 3:
      cv::rotate(src, dst, cv::ROTATE_180);
      break;
    case 4:
      cv::flip(src, dst, 0);
      break;
    case 5:
      cv::transpose(src, dst);
      break;
    case 6:
      cv::rotate(src, dst, cv::ROTATE_90_CLOCKWISE);
      break;
    case 7: {
      cv::Mat t;
      cv::transpose(src, t);
      cv::flip(t, dst, -1);
      break;
    }
    case 8:
      cv::rotate(src, dst, cv::ROTATE_90_COUNTERCLOCKWISE);
      break;
    default:
      dst = src;
      break;
  }
}

// The size that fits `max_side` on the longer side (unchanged when already within it or 0).
cv::Size FitSize(int w, int h, int max_side) {
  if (max_side <= 0 || std::max(w, h) <= max_side) return {w, h};
  double s = static_cast<double>(max_side) / std::max(w, h);
  return {std::max(1, static_cast<int>(std::lround(w * s))),
          std::max(1, static_cast<int>(std::lround(h * s)))};
}

// Largest DCT scale 1/d whose whole pixels still cover `target` (both axes). A scaled decode's last
// column and row are partial when w or h is not a multiple of d: they average the JPEG's hidden
// padding into the edge, so they are not counted here and are cut off after decoding.
int ScaleFor(int w, int h, cv::Size target) {
  for (int d : {8, 4, 2}) {
    if (w / d >= target.width && h / d >= target.height) return d;
  }
  return 1;
}

// Orientation, resize and encoding of an already decoded RGB/gray image. `wanted`: the upright size
// to store, when the image was decoded at a reduced DCT scale (its size then no longer tells the
// original's aspect ratio exactly); empty: fit the decoded image to max_side.
void Finish(cv::Mat upright_src, int orientation, const PackOptions& o, int quality, Worker& w,
            Processed& out, cv::Size wanted = {}) {
  cv::Mat upright;
  ApplyOrientation(orientation, upright_src, upright);
  const cv::Size target = wanted.area() > 0 ? wanted : FitSize(upright.cols, upright.rows, o.max_side);
  Image result;
  result.Reshape(target.width, target.height, upright.channels());
  cv::Mat dst(target.height, target.width, upright.type(), result.pixels.data());
  if (target == upright.size()) {
    upright.copyTo(dst);
  } else {
    cv::resize(upright, dst, target, 0, 0, cv::INTER_AREA);
  }
  out.header.width = static_cast<uint32_t>(result.width);
  out.header.height = static_cast<uint32_t>(result.height);
  out.header.channels = static_cast<uint8_t>(result.channels);
  if (o.encoding == PayloadEncoding::kRaw) {
    out.header.encoding = PayloadEncoding::kRaw;
    out.payload.resize(result.pixels.size());
    std::memcpy(out.payload.data(), result.pixels.data(), result.pixels.size());
    out.ok = true;
    return;
  }
  if (!w.encoder) {
    auto enc = decode::JpegEncoder::Create();
    if (!enc.ok()) {
      out.reason = enc.status().ToString();
      return;
    }
    w.encoder.emplace(std::move(enc).value());
  }
  auto jpeg = w.encoder->Encode(result, decode::EncodeOptions{.quality = quality});
  if (!jpeg.ok()) {
    out.reason = jpeg.status().ToString();
    return;
  }
  StoreJpeg(std::move(jpeg).value(), o, w, out);
}

void ProcessJpeg(std::vector<std::byte>& bytes, const PackOptions& o, Worker& w, Processed& out) {
  auto header = w.decoder.ReadHeader(bytes);
  if (!header.ok()) {
    out.reason = "JPEG: " + header.status().message();
    return;
  }
  decode::JpegInfo info = *header;
  const bool cmyk = info.color_space == decode::JpegColorSpace::kCmyk ||
                    info.color_space == decode::JpegColorSpace::kYcck;
  // Sizes in stored orientation; a transpose (orientations 5-8) swaps both axes alike.
  const bool swap = info.orientation >= 5;
  const cv::Size upright_target = FitSize(swap ? info.height : info.width,
                                          swap ? info.width : info.height, o.max_side);
  const cv::Size target = swap ? cv::Size(upright_target.height, upright_target.width)
                               : upright_target;
  const bool resize = target != cv::Size(info.width, info.height);
  const bool keep = o.quality == 0 && info.orientation == 1 && !cmyk && !resize &&
                    o.encoding == PayloadEncoding::kJpeg;
  if (keep) {
    out.header.width = static_cast<uint32_t>(info.width);
    out.header.height = static_cast<uint32_t>(info.height);
    out.header.channels = info.components == 1 ? 1 : 3;
    // The transcode reads every coefficient strictly: it is the coefficient validation. A pixel
    // validation, or a JPEG the transcoder leaves alone, is checked on its own first.
    const bool transcode_validates = o.index == IndexMode::kRestart && o.validate == ValidateMode::kCoefficients;
    if (!transcode_validates) {
      Status s = o.validate == ValidateMode::kPixels ? w.decoder.Decode(bytes, &w.image, 1, &info)
                                                     : w.decoder.Validate(bytes, &info);
      if (!s.ok()) {
        out.reason = "JPEG: " + s.message();
        return;
      }
    }
    StoreJpeg(std::move(bytes), o, w, out);
    if (transcode_validates && out.ok && out.header.encoding == PayloadEncoding::kJpeg) {
      // Left as it was by the transcoder: validate it as without an index.
      Status s = w.decoder.Validate(out.payload, &info);
      if (!s.ok()) {
        out.ok = false;
        out.payload.clear();
        out.reason = "JPEG: " + s.message();
      }
    }
    return;
  }
  // The pixels are needed: decode at the smallest DCT scale that still covers the target.
  const int d = ScaleFor(info.width, info.height, target);
  const int whole_w = info.width / d, whole_h = info.height / d;
  Status s = w.decoder.Decode(bytes, &w.image, d, &info);
  if (!s.ok()) {
    out.reason = "JPEG: " + s.message();
    return;
  }
  out.reencoded = o.encoding == PayloadEncoding::kJpeg;
  out.reoriented = info.orientation != 1;
  cv::Mat src(w.image.height, w.image.width, w.image.channels == 1 ? CV_8UC1 : CV_8UC3,
              w.image.pixels.data());
  // Only the whole pixels of a scaled decode (ScaleFor).
  src = src(cv::Rect(0, 0, std::min(whole_w, src.cols), std::min(whole_h, src.rows)));
  Finish(src, info.orientation, o, o.quality > 0 ? o.quality : o.reencode_quality, w, out, upright_target);
}

#if STOKE_PACK_OTHER_FORMATS
// Width and height from the header of a PNG, BMP or WebP file, when it is one; nullopt otherwise
// (OpenCV's own cap, 2^30 pixels, then applies). OpenCV reads OPENCV_IO_MAX_IMAGE_PIXELS once, as
// it loads, so the cap of PackOptions::max_pixels is held here, before any pixel is allocated.
std::optional<std::pair<int64_t, int64_t>> HeaderSize(std::span<const std::byte> b) {
  auto u8 = [&](size_t i) { return static_cast<uint32_t>(std::to_integer<uint8_t>(b[i])); };
  auto be32 = [&](size_t i) { return u8(i) << 24 | u8(i + 1) << 16 | u8(i + 2) << 8 | u8(i + 3); };
  auto le16 = [&](size_t i) { return u8(i) | u8(i + 1) << 8; };
  auto le24 = [&](size_t i) { return u8(i) | u8(i + 1) << 8 | u8(i + 2) << 16; };
  auto le32 = [&](size_t i) { return le24(i) | u8(i + 3) << 24; };
  auto is = [&](size_t at, std::string_view text) {
    if (b.size() < at + text.size()) return false;
    for (size_t i = 0; i < text.size(); ++i) {
      if (u8(at + i) != static_cast<unsigned char>(text[i])) return false;
    }
    return true;
  };
  if (is(0, "\x89PNG\r\n\x1a\n") && is(12, "IHDR") && b.size() >= 24) return std::make_pair(int64_t{be32(16)}, int64_t{be32(20)});
  if (is(0, "BM") && b.size() >= 26) {
    const auto height = static_cast<int32_t>(le32(22));  // negative: stored top-down
    return std::make_pair(int64_t{static_cast<int32_t>(le32(18))}, std::abs(int64_t{height}));
  }
  if (is(0, "RIFF") && is(8, "WEBP") && b.size() >= 30) {
    if (is(12, "VP8X")) return std::make_pair(int64_t{le24(24)} + 1, int64_t{le24(27)} + 1);
    if (is(12, "VP8L")) {
      const uint32_t bits = le32(21);
      return std::make_pair(int64_t{(bits & 0x3fff) + 1}, int64_t{((bits >> 14) & 0x3fff) + 1});
    }
    if (is(12, "VP8 ")) return std::make_pair(int64_t{le16(26) & 0x3fff}, int64_t{le16(28) & 0x3fff});
  }
  return std::nullopt;
}
#endif

void ProcessOther(const std::vector<std::byte>& bytes, const PackOptions& o, Worker& w,
                  Processed& out) {
#if !STOKE_PACK_OTHER_FORMATS
  (void)bytes, (void)o, (void)w;
  out.reason = "not a JPEG; this build of stoke packs JPEG only (built with STOKE_PACK_OTHER_FORMATS=OFF)";
#else
  if (const auto size = HeaderSize(bytes); size && size->first * size->second > o.max_pixels) {
    out.reason = fmt::format("{}x{} = {} pixels, more than the {} a non-JPEG image may have (max_pixels)",
                             size->first, size->second, size->first * size->second, o.max_pixels);
    return;
  }
  cv::Mat decoded = cv::imdecode(
      cv::Mat(1, static_cast<int>(bytes.size()), CV_8UC1, const_cast<std::byte*>(bytes.data())),
      cv::IMREAD_COLOR);
  if (decoded.empty()) {
    out.reason = "not a JPEG, and not an image format this build of OpenCV reads";
    return;
  }
  cv::Mat rgb;
  cv::cvtColor(decoded, rgb, cv::COLOR_BGR2RGB);
  out.converted = true;
  // imdecode(IMREAD_COLOR) has already applied any EXIF orientation.
  Finish(rgb, 1, o, o.quality > 0 ? o.quality : o.reencode_quality, w, out);
#endif
}

Processed ProcessInput(const Input& input, const PackOptions& o, Worker& w) {
  Processed out;
  out.header.label = input.label;
  out.stamp = StampOf(input.path);
  auto bytes = ReadFileBytes(input.path, o.max_file_bytes);
  if (!bytes.ok()) {
    out.reason = "unreadable: " + bytes.status().message();
    return out;
  }
  if (bytes->empty()) {
    out.reason = "empty file";
    return out;
  }
  // OpenCV throws cv::Exception; nothing may escape a TBB stage.
  try {
    if (decode::LooksLikeJpeg(*bytes)) {
      ProcessJpeg(*bytes, o, w, out);
    } else {
      ProcessOther(*bytes, o, w, out);
    }
  } catch (const cv::Exception& e) {
    out.ok = false;
    out.reason = fmt::format("OpenCV: {}", e.what());
  } catch (const std::bad_alloc&) {
    out.ok = false;
    out.reason = "out of memory";
  }
  return out;
}

// ---- Splits, order and identity ---------------------------------------------------------------

nlohmann::json OptionsJson(const PackOptions& o) {
  return {{"max_side", o.max_side},
          {"quality", o.quality},
          {"reencode_quality", o.reencode_quality},
          {"encoding", std::string(dataset::EncodingName(o.encoding))},
          {"shuffle", o.shuffle},
          {"seed", o.seed},
          {"val_fraction", o.val_fraction},
          {"store_paths", o.store_paths},
          {"validate", o.validate == ValidateMode::kPixels ? "pixels" : "coefficients"},
          {"index", o.index == IndexMode::kRestart ? "restart" : "none"},
          {"index_intervals_per_row", o.index_intervals_per_row}};
}

// Identifies what a split will contain: inputs, labels, classes and options. A resume must match.
std::string Fingerprint(const std::vector<Input>& inputs, const std::vector<std::string>& classes,
                        const PackOptions& o, const std::string& split) {
  uint64_t h = Fnv1a(OptionsJson(o).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + split + std::to_string(dataset::kFormatVersion));
  for (const auto& c : classes) h = Fnv1a(c + '\n', h);
  for (const auto& in : inputs) h = Fnv1a(fmt::format("{}\t{}\n", in.key, in.label), h);
  return fmt::format("{:016x}", h);
}

std::string Utc(std::time_t t, const char* format) {
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, format, &tm);
  return buf;
}

std::string NowIso8601() { return Utc(std::time(nullptr), "%Y-%m-%dT%H:%M:%SZ"); }

// What --overwrite may replace: a folder holding only LMDB's files (a dataset, finished or not), or
// nothing. Anything else at the output is the user's, not a dataset's.
Status ReplaceableOutput(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) return OkStatus();
  std::error_code cwd_ec;
  if (PathWithin(fs::current_path(cwd_ec), path)) {
    return InvalidArgumentError(fmt::format(
        "pack: --overwrite would replace {}, which holds the working directory; choose another output",
        path.string()));
  }
  std::vector<std::string> others;
  if (fs::is_directory(fs::symlink_status(path, ec))) {
    for (const auto& e : fs::directory_iterator(path, ec)) {
      const std::string name = e.path().filename().string();
      if (name != "data.mdb" && name != "lock.mdb") others.push_back(name);
    }
  } else {
    others.push_back("(not a folder)");
  }
  if (ec) return IoError(fmt::format("pack: {}: {}", path.string(), ec.message()));
  if (!others.empty()) {
    std::sort(others.begin(), others.end());
    if (others.size() > 3) others.resize(3), others.push_back("...");
    return InvalidArgumentError(fmt::format(
        "pack: {} is not a dataset (it holds {}); --overwrite replaces only datasets: move it away or choose "
        "another output", path.string(), fmt::join(others, ", ")));
  }
  return OkStatus();
}

// ---- One split: a resumable job ---------------------------------------------------------------

struct SplitJob {
  std::string name;
  fs::path output;
  std::vector<Input> inputs;
};

uint64_t FoldStamp(uint64_t h, const InputStamp& s) { return Fnv1a(fmt::format("{} {}\n", s.size, s.mtime_ns), h); }

struct SplitState {
  int64_t next_input = 0;
  std::string created;
  uint64_t inputs_stamp = kFnvBasis;  // FoldStamp over inputs [0, next_input); 0: not known (an older state)
  std::vector<BadInput> bad;
  std::vector<int64_t> class_counts;
  int64_t payload_bytes = 0;
  int64_t converted = 0, reencoded = 0, reoriented = 0;

  // `options`: OptionsJson of the pack, kept so that a refused resume can say which differ.
  std::string ToJson(const std::string& fingerprint, const nlohmann::json& options) const {
    nlohmann::json bad_json = nlohmann::json::array();
    for (const auto& b : bad) bad_json.push_back({b.path, b.reason});
    return nlohmann::json{{"fingerprint", fingerprint},   {"options", options}, {"next_input", next_input},
                          {"created", created},           {"bad", bad_json},
                          {"class_counts", class_counts}, {"payload_bytes", payload_bytes},
                          {"converted", converted},       {"reencoded", reencoded},
                          {"reoriented", reoriented},     {"inputs_stamp", fmt::format("{:016x}", inputs_stamp)}}
        .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  static Result<SplitState> FromJson(const std::string& text, const std::string& fingerprint,
                                     const nlohmann::json& options, size_t classes, size_t inputs,
                                     const fs::path& where, int64_t committed) {
    auto j = nlohmann::json::parse(text, nullptr, false);
    try {
      if (j.is_discarded() || !j.is_object()) throw std::runtime_error("not a JSON object");
      if (j.at("fingerprint").get<std::string>() != fingerprint) {
        // Which options differ, as flags (packs interrupted before the options were kept: unknown).
        std::vector<std::string> differ;
        if (j.contains("options") && j["options"].is_object()) {
          static const std::map<std::string, std::string> kFlag = {
              {"store_paths", "--no-paths"}, {"index_intervals_per_row", "--index-intervals"},
              {"reencode_quality", "the re-encode quality"}};
          for (const auto& [key, now] : options.items()) {
            const auto then = j["options"].find(key);
            if (then != j["options"].end() && *then == now) continue;
            const auto flag = kFlag.find(key);
            std::string name = flag != kFlag.end() ? flag->second : "--" + key;
            std::replace(name.begin(), name.end(), '_', '-');
            differ.push_back(fmt::format("{} {} (now {})", name, then != j["options"].end() ? then->dump() : "?",
                                         now.dump()));
          }
        }
        return InvalidArgumentError(fmt::format(
            "pack: {}: the partial pack ({} records committed) was made {}; resume it with the options it was made "
            "with (the same command plus --resume), or pass --overwrite instead of --resume to discard it and "
            "start over",
            where.string(), committed,
            differ.empty() ? "from other inputs (files added, removed or relabelled, or other classes) or options"
                           : fmt::format("with other options: {}", fmt::join(differ, ", "))));
      }
      SplitState s;
      s.next_input = j.at("next_input").get<int64_t>();
      s.created = j.at("created").get<std::string>();
      for (const auto& b : j.at("bad")) s.bad.push_back({b.at(0), b.at(1)});
      s.class_counts = j.at("class_counts").get<std::vector<int64_t>>();
      s.payload_bytes = j.at("payload_bytes").get<int64_t>();
      s.converted = j.at("converted").get<int64_t>();
      s.reencoded = j.at("reencoded").get<int64_t>();
      s.reoriented = j.at("reoriented").get<int64_t>();
      s.inputs_stamp = 0;  // states of earlier versions did not keep one
      if (j.contains("inputs_stamp")) s.inputs_stamp = std::stoull(j.at("inputs_stamp").get<std::string>(), nullptr, 16);
      if (s.class_counts.size() != classes || s.next_input < 0 ||
          static_cast<size_t>(s.next_input) > inputs) {
        throw std::runtime_error("counts do not match the inputs");
      }
      // The state and the records it counts are committed together: a records table holding
      // another count (a damaged entry count) would have records appended under wrong numbers.
      int64_t counted = 0;
      for (const int64_t c : s.class_counts) {  // each bounded, so the sum cannot wrap
        if (c < 0 || c > dataset::kMaxRecords) throw std::runtime_error(fmt::format("a class count of {}", c));
        counted += c;
      }
      if (counted != committed) {
        throw std::runtime_error(fmt::format("it counts {} records, the records table holds {}", counted, committed));
      }
      return s;
    } catch (const std::exception& e) {
      return CorruptError(
          fmt::format("pack: {}: unreadable resume state: {}", where.string(), e.what()));
    }
  }
};

fs::path PartialPath(const fs::path& output) {
  fs::path p = output;
  p += ".partial";
  return p;
}

// Where a dataset that a new pack replaced waits to be removed.
fs::path ReplacedPath(const fs::path& output) {
  fs::path p = output;
  p += ".replaced";
  return p;
}

// The journal of a publication in progress (see Publish).
fs::path PublishingPath(const fs::path& output) {
  fs::path p = output;
  p += ".publishing";
  return p;
}

// An output that is a symbolic link (dangling or not) is written through: the dataset goes where
// the link leads, and so do its working copies (.partial and the others go beside the dataset,
// where its publication renames them). The link was once taken for a file in the way, after the
// whole pack.
Result<fs::path> FollowOutputLinks(const fs::path& output) {
  fs::path p = output;
  for (int hops = 0; hops < 40; ++hops) {  // as the kernel's limit on a chain of links
    std::error_code ec;
    if (!fs::is_symlink(fs::symlink_status(p, ec))) {
      if (p != output) STOKE_LOG(INFO, "pack: {} is a link: writing the dataset at {}", output.string(), p.string());
      return p;
    }
    const fs::path target = fs::read_symlink(p, ec);
    if (ec) return IoError(fmt::format("pack: {}: reading the link: {}", p.string(), ec.message()));
    p = (target.is_absolute() ? target : p.parent_path() / target).lexically_normal();
    if (!p.has_filename()) p = p.parent_path();  // a link to "dir/"
  }
  return InvalidArgumentError(fmt::format("pack: {}: a loop of symbolic links; give the output's own path",
                                          output.string()));
}

// The longest name pack gives an output's working copies is its name + ".publishing": past the
// file system's limit on a name, the pack would fail only once all of it was done.
Status CheckOutputNameLength(const fs::path& output) {
  const std::string name = output.filename().string();
  const fs::path parent = output.has_parent_path() ? output.parent_path() : fs::path(".");
  const long limit = ::pathconf(parent.c_str(), _PC_NAME_MAX);
  const size_t longest = name.size() + PublishingPath("").string().size();
  if (longest > static_cast<size_t>(limit > 0 ? limit : 255)) {
    return InvalidArgumentError(fmt::format(
        "pack: {}: a name of {} bytes; the names of pack's working copies add up to {} more ('{}'), past the "
        "{}-byte limit on a name in {}; give a shorter name",
        output.string(), name.size(), longest - name.size(), PublishingPath("").string(),
        limit > 0 ? limit : 255, parent.string()));
  }
  return OkStatus();
}

// A processed input on its way from the pipeline to the writer thread.
struct Slot {
  size_t index;
  Processed result;
};

// Processed images waiting for the writer thread (about 28 MB of typical ImageNet JPEGs):
// enough to keep decoding through one commit's fsync.
constexpr std::ptrdiff_t kQueueCapacity = 256;
// Bytes per commit: smaller commits make the final, unoverlapped one shorter.
constexpr int64_t kCommitBytes = 32ll << 20;

class SplitPacker {
 public:
  // `records_before`: what the pack's earlier splits hold (progress counts across splits).
  SplitPacker(const PackOptions& o, const InputSet& set, SplitJob job, int threads, int64_t records_before)
      : o_(o),
        classes_(set.classes),
        job_(std::move(job)),
        threads_(threads),
        records_before_(records_before),
        reported_(records_before > 0 ? records_before : -1),  // the earlier splits' count was reported
        fingerprint_(Fingerprint(job_.inputs, classes_, o, job_.name)) {}

  // Packs the split into its partial dataset and finishes it, but does not publish it: Publish()
  // does, once every split of the pack is finished, so that a pack stopped before that leaves
  // every old output as it was (and --resume then publishes them all).
  Result<SplitSummary> Run(PackSummary& total) {
    SplitSummary summary{job_.name, job_.output, static_cast<int64_t>(job_.inputs.size())};
    const fs::path partial = PartialPath(job_.output);
    std::error_code ec;
    const bool leftovers = fs::exists(fs::symlink_status(PublishingPath(job_.output), ec)) ||
                           fs::exists(fs::symlink_status(ReplacedPath(job_.output), ec));
    // A finished output and nothing to resume: only read (the output may be on a read-only mount).
    if (o_.resume && !fs::exists(partial, ec) && fs::exists(job_.output, ec) && !leftovers) {
      return AlreadyComplete(summary, total);
    }
    // One pack at a time per output: a second one would remove or append to the partial
    // dataset the first is writing, and each would then publish over the other's.
    fs::path lock_path = job_.output;
    lock_path += ".lock";
    if (lock_path.has_parent_path()) {
      fs::create_directories(lock_path.parent_path(), ec);
      if (ec) return IoError(fmt::format("pack: {}: {}", lock_path.parent_path().string(), ec.message()));
    }
    STOKE_ASSIGN_OR_RETURN(FileLock lock, FileLock::TryAcquire(lock_path, "pack: " + job_.output.string()));
    lock_.emplace(std::move(lock));  // held until this split is published
    // Before any work: a publication needs OUT.replaced, and a folder of the user's files there
    // would otherwise be refused only when the pack is done.
    STOKE_RETURN_IF_ERROR(ReplaceableOutput(ReplacedPath(job_.output)));
    STOKE_ASSIGN_OR_RETURN(const bool published, FinishInterruptedPublish(partial));
    if (published && o_.resume) return AlreadyComplete(summary, total);
    const bool have_partial = fs::exists(partial, ec);
    if (o_.resume && have_partial && dataset::Dataset::Open(partial).ok()) {
      // Finished but not renamed (stopped between the last commit and the rename).
      STOKE_RETURN_IF_ERROR(CheckFingerprint(partial));
      finished_before_ = true;
      to_publish_ = true;
      return summary;
    }
    if (fs::exists(job_.output, ec) && !(o_.resume && have_partial)) {
      if (o_.resume) return AlreadyComplete(summary, total);
      if (!o_.overwrite) {
        return InvalidArgumentError(fmt::format(
            "pack: {}: already exists (pass --overwrite to replace it)", job_.output.string()));
      }
      STOKE_RETURN_IF_ERROR(ReplaceableOutput(job_.output));
    }
    std::optional<dataset::DatasetWriter> writer;
    dataset::WriterOptions wo{.commit_every_records = o_.commit_every,
                              .commit_every_bytes = kCommitBytes,
                              .store_paths = o_.store_paths};
    if (o_.resume && fs::exists(partial, ec) && !fs::exists(partial / "data.mdb", ec)) {
      // Killed between creating the directory and the data file: nothing was committed, so
      // resuming is starting over. Only a folder that holds nothing else is taken for that.
      bool only_ours = fs::is_directory(partial, ec);
      if (only_ours) {
        for (const auto& e : fs::directory_iterator(partial, ec)) only_ours = only_ours && e.path().filename() == "lock.mdb";
      }
      if (!only_ours || ec) {
        return InvalidArgumentError(fmt::format(
            "pack: {} is not an interrupted pack (no data.mdb, and not a folder holding only LMDB's lock); move it "
            "away, or pack with --overwrite instead of --resume to replace it",
            partial.string()));
      }
      fs::remove_all(partial, ec);
      if (ec) return IoError(fmt::format("pack: {}: {}", partial.string(), ec.message()));
    }
    if (fs::exists(partial, ec) && o_.resume) {
      STOKE_ASSIGN_OR_RETURN(auto w, dataset::DatasetWriter::OpenForAppend(partial, wo));
      writer.emplace(std::move(w));
      if (!writer->resume_state().empty()) {
        STOKE_ASSIGN_OR_RETURN(state_,
                               SplitState::FromJson(writer->resume_state(), fingerprint_, OptionsJson(o_),
                                                    classes_.size(), job_.inputs.size(), partial,
                                                    writer->committed_records()));
      }
      STOKE_RETURN_IF_ERROR(CheckPackedInputsUnchanged(partial));
      STOKE_LOG(INFO, "resuming {} at input {} of {} ({} records committed)", partial.string(),
                state_.next_input, job_.inputs.size(), writer->committed_records());
    } else {
      if (fs::exists(partial, ec)) {
        if (!o_.overwrite) {
          return InvalidArgumentError(
              fmt::format("pack: {}: an interrupted pack is here (pass --resume to continue it, or "
                          "--overwrite to start over)",
                          partial.string()));
        }
        STOKE_RETURN_IF_ERROR(ReplaceableOutput(partial));
        fs::remove_all(partial, ec);
        if (ec) return IoError(fmt::format("pack: {}: {}", partial.string(), ec.message()));
      }
      STOKE_ASSIGN_OR_RETURN(auto w, dataset::DatasetWriter::Create(partial, wo));
      writer.emplace(std::move(w));
    }
    if (state_.created.empty()) state_.created = NowIso8601();
    if (state_.class_counts.empty()) state_.class_counts.assign(classes_.size(), 0);
    writer_ = &*writer;

    const auto t0 = std::chrono::steady_clock::now();
    STOKE_RETURN_IF_ERROR(RunPipeline());
    const auto t1 = std::chrono::steady_clock::now();
    Accumulate(total);
    if (stopped_) {
      return UnavailableError(fmt::format(
          "pack: interrupted; {} records of {} kept in {} (rerun the same command with --resume{} to finish)",
          writer_->committed_records(), job_.name, partial.string(),
          o_.overwrite ? fmt::format(" in place of --overwrite (it still replaces {})", job_.output.string()) : ""));
    }
    STOKE_RETURN_IF_ERROR(writer_->Finish(MakeManifest()));
    to_publish_ = true;
    STOKE_LOG(DEBUG, "pack {}: pipeline {:.3f} s, finish (manifest, sync) {:.3f} s",
              job_.name, std::chrono::duration<double>(t1 - t0).count(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count());
    summary.records = writer_->records();
    summary.payload_bytes = state_.payload_bytes;
    writer_ = nullptr;  // `writer` ends here
    return summary;
  }

  // The inputs this split skipped (the report lists them split by split, in input order: a split
  // finished by an earlier pack learns its own only as it is published).
  const std::vector<BadInput>& bad() const { return bad_; }

  // Publishes what Run finished (nothing when the output was complete already). `summary` is Run's.
  Result<SplitSummary> Publish(SplitSummary summary, PackSummary& total) {
    if (!to_publish_) return summary;
    STOKE_RETURN_IF_ERROR(Publish(PartialPath(job_.output)));
    to_publish_ = false;
    if (finished_before_) return AlreadyComplete(std::move(summary), total);
    return summary;
  }

 private:
  // Replaces the output (if any) with the finished partial dataset. The old dataset stays whole
  // until the new one is complete; the two folders are then exchanged in one step (renameat2
  // RENAME_EXCHANGE), so that a reader opening the output finds one or the other, and the old one
  // is removed afterwards from ReplacedPath(). Where the filesystem cannot exchange, the old one
  // is renamed away and the new one into place: for that moment the output is missing.
  // A journal (PublishingPath(): the new folder's device and inode, which renames keep) says
  // which folder is the new one if the pack stops in between; FinishInterruptedPublish() reads it.
  Status Publish(const fs::path& partial) const {
    STOKE_RETURN_IF_ERROR(ReplaceableOutput(job_.output));
    STOKE_RETURN_IF_ERROR(RemoveReplaced());
    const fs::path replaced = ReplacedPath(job_.output);
    std::error_code ec;
    auto failed = [&](const std::string& why) {
      return IoError(fmt::format("pack: replace {} with {}: {} (the finished dataset is kept at {}; --resume "
                                 "publishes it)",
                                 job_.output.string(), partial.string(), why, partial.string()));
    };
    const fs::path parent = OutputParent();
    if (!fs::exists(fs::symlink_status(job_.output, ec))) {
      fs::rename(partial, job_.output, ec);
      if (ec) return failed(ec.message());
      return SyncDirectory(parent);  // the new name, durable
    }
    struct stat fresh {};
    if (::stat(partial.c_str(), &fresh) != 0) return failed(std::strerror(errno));
    STOKE_RETURN_IF_ERROR(WriteFileAtomic(PublishingPath(job_.output),
                                          fmt::format("{} {}\n", static_cast<uint64_t>(fresh.st_dev),
                                                      static_cast<uint64_t>(fresh.st_ino))));
    if (::renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, job_.output.c_str(), RENAME_EXCHANGE) == 0) {
      // The old dataset is at `partial` now: out of the way under its own name.
      fs::rename(partial, replaced, ec);
      if (ec) {
        return IoError(fmt::format("pack: {} is published; the dataset it replaced is at {} and could not be moved "
                                   "to {}: {} (the next pack of {} removes it)",
                                   job_.output.string(), partial.string(), replaced.string(), ec.message(),
                                   job_.output.string()));
      }
    } else if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) {  // no exchange on this filesystem
      fs::rename(job_.output, replaced, ec);
      if (!ec) {
        fs::rename(partial, job_.output, ec);
        std::error_code back;
        if (ec) fs::rename(replaced, job_.output, back);  // the old one stays in place
      }
    } else {
      return failed(std::strerror(errno));
    }
    if (ec) return failed(ec.message());
    STOKE_RETURN_IF_ERROR(SyncDirectory(parent));
    fs::remove(PublishingPath(job_.output), ec);
    const Status removed = RemoveReplaced();
    if (!removed.ok()) STOKE_LOG(WARN, "{} (the new dataset is in place)", removed.message());
    return OkStatus();
  }

  // Finishes what a pack stopped inside Publish left (see there). True when the output already
  // holds the dataset that was being published; false when that publication did not happen (the
  // finished dataset is still at `partial`, and is published again) or there was none.
  Result<bool> FinishInterruptedPublish(const fs::path& partial) const {
    const fs::path journal = PublishingPath(job_.output);
    std::error_code ec;
    bool published = false;
    if (fs::exists(fs::symlink_status(journal, ec))) {
      STOKE_ASSIGN_OR_RETURN(const std::vector<std::byte> bytes, ReadFileBytes(journal, 256));
      const std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      uint64_t dev = 0, ino = 0;
      if (std::sscanf(text.c_str(), "%" SCNu64 " %" SCNu64, &dev, &ino) != 2) {
        return CorruptError(fmt::format("pack: {}: not a publication journal of stoke (expected a device and an "
                                        "inode number); move it away",
                                        journal.string()));
      }
      auto is_new = [&](const fs::path& p) {
        struct stat st {};
        return ::stat(p.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_dev) == dev &&
               static_cast<uint64_t>(st.st_ino) == ino;
      };
      if (!fs::exists(fs::symlink_status(job_.output, ec)) && is_new(partial)) {
        // Stopped between the two renames of a filesystem without the exchange: the old dataset
        // is at ReplacedPath() and the finished new one at the partial name. The publication is
        // finished before anything is removed (removing the old one first, as the next pack did,
        // left no dataset at all when that pack then failed or started over).
        fs::rename(partial, job_.output, ec);
        if (ec) {
          return IoError(fmt::format("pack: finish publishing {} as {}: {} (both datasets are kept: the new one at "
                                     "{}, the one it replaces at {})",
                                     partial.string(), job_.output.string(), ec.message(), partial.string(),
                                     ReplacedPath(job_.output).string()));
        }
        STOKE_RETURN_IF_ERROR(SyncDirectory(OutputParent()));
      } else if (!fs::exists(fs::symlink_status(job_.output, ec)) &&
                 fs::exists(fs::symlink_status(ReplacedPath(job_.output), ec))) {
        // A publication under way, OUT missing and the new folder gone from the partial name
        // (moved by hand): the dataset it was replacing is the only one there is, and is put back
        // rather than removed below.
        STOKE_RETURN_IF_ERROR(ReplaceableOutput(ReplacedPath(job_.output)));
        fs::rename(ReplacedPath(job_.output), job_.output, ec);
        if (ec) {
          return IoError(fmt::format("pack: put {} back as {}: {}", ReplacedPath(job_.output).string(),
                                     job_.output.string(), ec.message()));
        }
        STOKE_LOG(WARN, "pack: {}: the interrupted publication's new dataset is not at {}; the dataset it was "
                  "replacing is put back", job_.output.string(), partial.string());
        STOKE_RETURN_IF_ERROR(SyncDirectory(OutputParent()));
      }
      published = is_new(job_.output);
      if (published && fs::exists(fs::symlink_status(partial, ec))) {
        // Stopped right after the exchange: the folder at the partial name is the replaced one.
        STOKE_RETURN_IF_ERROR(RemoveReplaced());
        STOKE_RETURN_IF_ERROR(ReplaceableOutput(partial));
        fs::rename(partial, ReplacedPath(job_.output), ec);
        if (ec) return IoError(fmt::format("pack: {}: {}", partial.string(), ec.message()));
      }
      STOKE_LOG(INFO, "pack: {}: {}", job_.output.string(),
                published ? "the interrupted publication had completed; removing the dataset it replaced"
                          : "the interrupted publication had not completed; it is done again");
      fs::remove(journal, ec);
      if (ec) return IoError(fmt::format("pack: {}: {}", journal.string(), ec.message()));
    }
    STOKE_RETURN_IF_ERROR(RemoveReplaced());
    return published;
  }

  // Removes what an earlier Publish left under ReplacedPath() (stopped before it removed it).
  Status RemoveReplaced() const {
    const fs::path replaced = ReplacedPath(job_.output);
    std::error_code ec;
    if (!fs::exists(fs::symlink_status(replaced, ec))) return OkStatus();
    STOKE_RETURN_IF_ERROR(ReplaceableOutput(replaced));
    fs::remove_all(replaced, ec);
    if (ec) return IoError(fmt::format("pack: remove the replaced dataset {}: {}", replaced.string(), ec.message()));
    return OkStatus();
  }

  // The folder that holds the output (and its partial, replaced and journal names).
  fs::path OutputParent() const {
    fs::path named = job_.output;
    if (!named.has_filename()) named = named.parent_path();  // "out/"
    return named.has_parent_path() ? named.parent_path() : fs::path(".");
  }

  // kInvalidArgument when an input packed before the interruption is no longer the file it was
  // (its size or modification time differs): resuming would keep the old image under its name.
  Status CheckPackedInputsUnchanged(const fs::path& partial) const {
    if (state_.inputs_stamp == 0) return OkStatus();  // an earlier version's state: not known
    uint64_t h = kFnvBasis;
    const Input* gone = nullptr;
    const Input* newest = nullptr;  // what a replaced image most likely is
    int64_t newest_ns = -1;
    for (size_t i = 0; i < static_cast<size_t>(state_.next_input); ++i) {
      const InputStamp stamp = StampOf(job_.inputs[i].path);
      h = FoldStamp(h, stamp);
      if (stamp.size < 0 && gone == nullptr) gone = &job_.inputs[i];
      if (stamp.mtime_ns > newest_ns) {
        newest_ns = stamp.mtime_ns;
        newest = &job_.inputs[i];
      }
    }
    if (h == state_.inputs_stamp) return OkStatus();
    std::string which = "their sizes or modification times differ";
    if (gone != nullptr) {
      which = fmt::format("{} is gone", gone->path.string());
    } else if (newest != nullptr) {
      which += fmt::format("; the one modified last is {}, at {}", newest->path.string(),
                           Utc(static_cast<std::time_t>(newest_ns / 1'000'000'000), "%Y-%m-%d %H:%M:%S UTC"));
    }
    return InvalidArgumentError(fmt::format(
        "pack: {}: inputs packed before the interruption changed since ({}); resuming would keep them as they "
        "were: pass --overwrite instead of --resume to pack them all again",
        partial.string(), which));
  }

  // kInvalidArgument unless the finished dataset at `path` was packed from these inputs and
  // options.
  Status CheckFingerprint(const fs::path& path) const {
    STOKE_ASSIGN_OR_RETURN(auto ds, dataset::Dataset::Open(path));
    const auto& packing = ds.manifest().packing;
    const auto fp = packing.find("fingerprint");
    if (fp == packing.end() || !fp->is_string() || fp->get<std::string>() != fingerprint_) {
      return InvalidArgumentError(fmt::format(
          "pack: {}: exists but was packed from other inputs or options (pass --overwrite "
          "without --resume to replace it)",
          path.string()));
    }
    return OkStatus();
  }

  Result<SplitSummary> AlreadyComplete(SplitSummary summary, PackSummary& total) {
    STOKE_RETURN_IF_ERROR(CheckFingerprint(job_.output));
    STOKE_ASSIGN_OR_RETURN(auto ds, dataset::Dataset::Open(job_.output));
    const auto& packing = ds.manifest().packing;
    // Written by this tool (the fingerprint matched); still read defensively.
    try {
      for (const auto& b : packing.value("bad", nlohmann::json::array())) {
        bad_.push_back({b.at(0).get<std::string>(), b.at(1).get<std::string>()});
      }
      total.converted += packing.value("converted", int64_t{0});
      total.reencoded += packing.value("reencoded", int64_t{0});
      total.reoriented += packing.value("reoriented", int64_t{0});
    } catch (const nlohmann::json::exception& e) {
      return CorruptError(fmt::format("pack: {}: manifest: {}", job_.output.string(), e.what()));
    }
    summary.records = ds.size();
    summary.payload_bytes = ds.manifest().payload_bytes;
    summary.already_complete = true;
    return summary;
  }

  dataset::Manifest MakeManifest() const {
    dataset::Manifest m;
    m.format_version = dataset::kFormatVersion;
    m.records = writer_->records();
    m.classes = classes_;
    m.class_counts = state_.class_counts;
    m.payload_bytes = state_.payload_bytes;
    m.has_paths = o_.store_paths;
    nlohmann::json bad = nlohmann::json::array();
    for (const auto& b : state_.bad) bad.push_back({b.path, b.reason});
    m.packing = {{"tool", "stoke pack"},
                 {"tool_version", STOKE_VERSION},
                 {"git_sha", GitSha()},
                 {"created", state_.created},
                 {"source", fs::absolute(o_.source).lexically_normal().string()},
                 {"list_file", o_.list_file.empty() ? "" : fs::absolute(o_.list_file).string()},
                 {"split", job_.name},
                 {"options", OptionsJson(o_)},
                 {"fingerprint", fingerprint_},
                 {"inputs", job_.inputs.size()},
                 {"bad", bad},
                 {"converted", state_.converted},
                 {"reencoded", state_.reencoded},
                 {"reoriented", state_.reoriented}};
    return m;
  }

  void Accumulate(PackSummary& total) {
    bad_.insert(bad_.end(), state_.bad.begin(), state_.bad.end());
    total.converted += state_.converted;
    total.reencoded += state_.reencoded;
    total.reoriented += state_.reoriented;
  }

  Status Commit() {
    Status s = writer_->Commit(state_.ToJson(fingerprint_, OptionsJson(o_)));
    // A count once: the last commit of a stopped pack (its state, no new records) is not reported again.
    const int64_t records = records_before_ + writer_->committed_records();
    if (s.ok() && o_.after_commit && records != reported_) o_.after_commit(records);
    if (s.ok()) reported_ = records;
    return s;
  }

  // Three pipeline stages (in-order input, parallel read+validate+transform, in-order hand-off)
  // feed a writer thread through a bounded queue. The writer thread appends and commits; an
  // LMDB commit (a write plus fsync of up to commit_bytes) then overlaps with decoding instead of
  // stalling the pipeline.
  Status RunPipeline() {
    const size_t end = job_.inputs.size();
    size_t next = static_cast<size_t>(state_.next_input);
    std::unique_ptr<ProgressReporter> progress;
    if (o_.progress) {
      progress = std::make_unique<ProgressReporter>(fmt::format("pack {}", job_.name),
                                                    static_cast<int64_t>(end - next));
    }
    tbb::enumerable_thread_specific<Worker> workers(std::cref(o_));
    Status error;  // written by the writer thread only; read after it is joined
    // Set by the writer thread on failure, read by the input stage.
    std::atomic<bool> cancel{false};
    // concurrent_bounded_queue: one producer (the in-order stage) and one consumer (the writer
    // thread); push blocks when full, which bounds memory to kQueueCapacity processed images.
    tbb::concurrent_bounded_queue<Slot*> ready;
    // Raw payloads are ~10x larger than JPEGs: hold fewer of them.
    ready.set_capacity(o_.encoding == PayloadEncoding::kRaw ? kQueueCapacity / 8 : kQueueCapacity);
    std::thread writer_thread([&] {
      for (;;) {
        Slot* raw = nullptr;
        ready.pop(raw);
        if (raw == nullptr) break;  // end of input
        STOKE_TSAN_ACQUIRE(raw);
        std::unique_ptr<Slot> slot(raw);
        if (cancel.load()) continue;  // drain so the pipeline never blocks on a full queue
        if (o_.stop && o_.stop->load()) {
          // Stop here, not where the input stage is: everything before this slot is written.
          stopped_ = true;
          cancel = true;
          continue;
        }
        Write(job_.inputs[slot->index], slot->index, slot->result, error, cancel);
        if (progress) progress->Advance();
      }
    });
    tbb::task_arena arena(threads_);
    // `start` and `done` restate for TSan what task_arena::execute guarantees (see common/tsan.h):
    // everything before it happens before any stage runs; every stage call happens before it
    // returns. Each slot carries the same guarantee from stage to stage.
    int done = 0;
    auto chain = tbb::make_filter<void, Slot*>(
                     tbb::filter_mode::serial_in_order,
                     [&](tbb::flow_control& fc) -> Slot* {
                       STOKE_TSAN_ACQUIRE(&stoke_tsan_sync_anchor);
                       STOKE_TSAN_ACQUIRE(&next);  // serial stage: calls are ordered, threads vary
                       Slot* slot = nullptr;
                       if (next >= end || cancel.load() || (o_.stop && o_.stop->load())) {
                         if (next < end && !cancel.load()) stopped_ = true;
                         fc.stop();
                       } else {
                         slot = new Slot{next++, {}};
                         STOKE_TSAN_RELEASE(slot);
                       }
                       STOKE_TSAN_RELEASE(&next);
                       STOKE_TSAN_RELEASE(&done);
                       return slot;
                     }) &
                 tbb::make_filter<Slot*, Slot*>(
                     tbb::filter_mode::parallel,
                     [&](Slot* slot) {
                       STOKE_TSAN_ACQUIRE(&stoke_tsan_sync_anchor);
                       STOKE_TSAN_ACQUIRE(slot);
                       slot->result = ProcessInput(job_.inputs[slot->index], o_, workers.local());
                       STOKE_TSAN_RELEASE(slot);
                       STOKE_TSAN_RELEASE(&done);
                       return slot;
                     }) &
                 tbb::make_filter<Slot*, void>(tbb::filter_mode::serial_in_order, [&](Slot* slot) {
                   STOKE_TSAN_ACQUIRE(slot);
                   STOKE_TSAN_RELEASE(slot);
                   ready.push(slot);
                   STOKE_TSAN_RELEASE(&done);
                 });
    STOKE_TSAN_RELEASE(&stoke_tsan_sync_anchor);
    Status pipeline_error;
    try {
      arena.execute([&] { tbb::parallel_pipeline(static_cast<size_t>(threads_) * 4, chain); });
    } catch (const std::exception& e) {  // bad_alloc and the like: stop cleanly and report
      pipeline_error = InternalError(fmt::format("pack: {}", e.what()));
      cancel = true;
    }
    STOKE_TSAN_ACQUIRE(&done);
    ready.push(nullptr);
    writer_thread.join();
    if (progress) progress->Finish();
    if (!error.ok()) return error;
    if (!pipeline_error.ok()) return pipeline_error;
    // A stopped pack keeps what is done, to resume from here. A finished one commits its last
    // records together with the manifest in Finish(): one fsync fewer on the unoverlapped tail.
    if (stopped_) return Commit();
    return OkStatus();
  }

  void Write(const Input& input, size_t index, Processed& r, Status& error,
             std::atomic<bool>& cancel) {
    if (!r.ok) {
      if (o_.on_error == OnError::kFail) {
        error = CorruptError(
            fmt::format("pack: {}: {} (--on-error fail)", input.path.string(), r.reason));
        cancel = true;
        return;
      }
      state_.bad.push_back({input.key, r.reason});
    } else {
      state_.class_counts[static_cast<size_t>(r.header.label)]++;
      state_.payload_bytes += static_cast<int64_t>(r.payload.size());
      state_.converted += r.converted;
      state_.reencoded += r.reencoded;
      state_.reoriented += r.reoriented;
      writer_->Append(r.header, std::move(r.payload), input.key);
    }
    if (state_.inputs_stamp != 0) state_.inputs_stamp = FoldStamp(state_.inputs_stamp, r.stamp);
    state_.next_input = static_cast<int64_t>(index) + 1;
    if (writer_->ShouldCommit()) {
      Status s = Commit();
      if (!s.ok()) {
        error = s;
        cancel = true;
      }
    }
  }

  const PackOptions& o_;
  const std::vector<std::string>& classes_;
  SplitJob job_;
  int threads_;
  int64_t records_before_;
  int64_t reported_;  // the count after_commit was last given
  std::string fingerprint_;
  SplitState state_;
  std::vector<BadInput> bad_;  // what Accumulate or AlreadyComplete found
  dataset::DatasetWriter* writer_ = nullptr;
  std::atomic<bool> stopped_{false};  // set by the input stage or the writer thread
  std::optional<FileLock> lock_;      // the output's, from Run to Publish
  bool to_publish_ = false;           // Run finished the partial dataset
  bool finished_before_ = false;      // ... an earlier pack had (this one resumed and packed nothing)
};

Status ValidateOptions(const PackOptions& o) {
  if (o.output.empty()) return InvalidArgumentError("pack: no output path");
  if (o.threads < 0 || o.threads > kMaxThreads) {
    return InvalidArgumentError(
        fmt::format("pack: --threads {} (expected 0 to {}; 0 = every core)", o.threads, kMaxThreads));
  }
  if (o.max_side < 0) return InvalidArgumentError("pack: --max-side must be >= 0");
  // Readers refuse a raw record larger than kMaxImagePixels: none may be written.
  if (o.max_pixels <= 0 || o.max_pixels > kMaxImagePixels) {
    return InvalidArgumentError(
        fmt::format("pack: max_pixels {} (expected 1 to {})", o.max_pixels, kMaxImagePixels));
  }
  if (o.quality < 0 || o.quality > 100)
    return InvalidArgumentError("pack: --quality must be in 1..100");
  if (o.reencode_quality < 1 || o.reencode_quality > 100) {
    return InvalidArgumentError("pack: re-encode quality must be in 1..100");
  }
  if (!(o.val_fraction >= 0 && o.val_fraction < 1)) {
    return InvalidArgumentError("pack: --val-fraction must be in [0, 1)");
  }
  if (o.commit_every <= 0) return InvalidArgumentError("pack: commit interval must be > 0");
  if (o.index_intervals_per_row < 1 || o.index_intervals_per_row > 64) {
    return InvalidArgumentError(
        fmt::format("pack: --index-intervals {} must be in 1..64", o.index_intervals_per_row));
  }
  if (o.resume && o.overwrite) {
    return InvalidArgumentError("pack: --resume and --overwrite contradict each other");
  }
  return OkStatus();
}

Status WriteReport(const fs::path& file, const PackSummary& s) {
  nlohmann::json splits = nlohmann::json::array();
  for (const auto& sp : s.splits) {
    splits.push_back({{"name", sp.name},
                      {"output", sp.output.string()},
                      {"inputs", sp.inputs},
                      {"records", sp.records},
                      {"payload_bytes", sp.payload_bytes}});
  }
  nlohmann::json bad = nlohmann::json::array();
  for (const auto& b : s.bad) bad.push_back({{"path", b.path}, {"reason", b.reason}});
  nlohmann::json j = {{"inputs", s.inputs},         {"classes", s.classes},
                      {"splits", splits},           {"skipped", bad},
                      {"converted", s.converted},   {"reencoded", s.reencoded},
                      {"reoriented", s.reoriented}, {"seconds", s.seconds},
                      {"threads", s.threads}};
  return WriteFileAtomic(file,
                         j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}

}  // namespace

fs::path DefaultValOutput(const fs::path& output) {
  fs::path p = output;
  if (p.has_filename() == false) p = p.parent_path();
  std::string name = p.filename().string();
  if (p.extension() == ".lmdb") {
    name = p.stem().string() + "_val.lmdb";
  } else {
    name += "_val";
  }
  return p.parent_path() / name;
}

namespace {

// Outputs that would destroy or swallow the inputs are refused before any work: an output that
// holds the source (replacing it deletes the images), the validation output on the training
// output, and (a folder tree) an output inside the source, which the next pack would list as a
// class of images.
Status CheckOutputsAgainstSource(const PackOptions& o) {
  std::vector<fs::path> outputs{o.output};
  if (!o.val_output.empty()) outputs.push_back(o.val_output);
  if (outputs.size() == 2 && PathWithin(outputs[0], outputs[1]) && PathWithin(outputs[1], outputs[0])) {
    return InvalidArgumentError(fmt::format("pack: --val-output {} is the training output; give another path",
                                            o.val_output.string()));
  }
  if (outputs.size() == 2) {
    // One inside the other: publishing the outer one would delete the inner.
    for (int i = 0; i < 2; ++i) {
      const fs::path& inner = outputs[static_cast<size_t>(i)];
      const fs::path& outer = outputs[static_cast<size_t>(1 - i)];
      for (const fs::path& p : {inner, fs::path(inner.string() + ".partial")}) {
        for (const fs::path& q : {outer, fs::path(outer.string() + ".partial")}) {
          if (PathWithin(p, q)) {
            return InvalidArgumentError(fmt::format(
                "pack: the output {} is inside the other output {}: writing that one would delete it; give the "
                "training and validation outputs separate folders", p.string(), q.string()));
          }
        }
      }
    }
  }
  if (!o.report_file.empty()) {
    const fs::path files[] = {o.list_file};
    // A folder tree's images are all under the source; a list file's are the lines it names, and
    // its root may be any folder ("/" for absolute paths), so only the list itself is checked.
    std::vector<fs::path> folders;
    if (o.list_file.empty()) folders.push_back(o.source);
    for (const fs::path& out : outputs) {
      folders.push_back(out);
      folders.push_back(out.string() + ".partial");
    }
    STOKE_RETURN_IF_ERROR(CheckOutputClear("pack: --report", o.report_file, files, folders));
    // Before the pack, not after it (an hour of packing, then "cannot write the report").
    STOKE_RETURN_IF_ERROR(CheckFileWritable("pack: --report", o.report_file));
  }
  for (const fs::path& out : outputs) {
    for (const fs::path& p : {out, fs::path(out.string() + ".partial")}) {
      if (PathWithin(o.source, p)) {
        return InvalidArgumentError(fmt::format(
            "pack: the output {} holds the source {}: replacing it would delete the images; choose an output "
            "outside the source", p.string(), o.source.string()));
      }
      if (o.list_file.empty() && PathWithin(p, o.source)) {
        return InvalidArgumentError(fmt::format(
            "pack: the output {} is inside the source folder {}: the next pack would read it as a class of "
            "images; choose an output outside the source", p.string(), o.source.string()));
      }
    }
  }
  return OkStatus();
}

}  // namespace

Result<PackSummary> Pack(const PackOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  STOKE_RETURN_IF_ERROR(ValidateOptions(options));
  PackOptions o = options;
  // "out.lmdb/" and "out.lmdb" are the same dataset (the ".partial" sibling must be a sibling).
  auto strip = [](fs::path p) { return p.has_filename() ? p : p.parent_path(); };
  o.output = strip(o.output.lexically_normal());
  if (!o.val_output.empty()) o.val_output = strip(o.val_output.lexically_normal());
  if (o.val_fraction > 0 && o.val_output.empty()) o.val_output = DefaultValOutput(o.output);
  for (fs::path* out : {&o.output, &o.val_output}) {
    if (out->empty()) continue;
    STOKE_ASSIGN_OR_RETURN(*out, FollowOutputLinks(*out));
    STOKE_RETURN_IF_ERROR(CheckOutputNameLength(*out));
  }
  STOKE_RETURN_IF_ERROR(CheckOutputsAgainstSource(o));
  // Non-JPEG inputs are decoded by OpenCV, which reads its pixel cap once from the environment.
  setenv("OPENCV_IO_MAX_IMAGE_PIXELS", std::to_string(o.max_pixels).c_str(), /*overwrite=*/0);

  InputSet set;
  if (!o.list_file.empty()) {
    STOKE_ASSIGN_OR_RETURN(set, ReadListFile(o.list_file, o.source));
  } else {
    STOKE_ASSIGN_OR_RETURN(set, ListFolderTree(o.source));
  }
  STOKE_RETURN_IF_ERROR(CheckReportIsNoInput(o.report_file, set.inputs));
  STOKE_LOG(DEBUG, "pack: listed {} inputs in {} classes in {:.3f} s", set.inputs.size(),
            set.classes.size(),
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  if (set.inputs.empty()) {
    return InvalidArgumentError(fmt::format(
        "pack: {}: no input files found", (o.list_file.empty() ? o.source : o.list_file).string()));
  }

  // Stratified split: in each class, round(fraction * count) inputs chosen by the seed, but never
  // the class's last one: a class with no training image could not be learned at all.
  std::vector<bool> is_val(set.inputs.size(), false);
  if (o.val_fraction > 0) {
    // Drawn among distinct images; a copy follows the first input naming its file.
    std::vector<std::vector<size_t>> by_class(set.classes.size());
    for (size_t i = 0; i < set.inputs.size(); ++i) {
      if (set.inputs[i].first == i) by_class[set.inputs[i].label].push_back(i);
    }
    SplitMix64 rng(MixSeed(o.seed, 0x76616c));  // "val"
    std::vector<std::string> kept;
    int64_t kept_classes = 0;
    for (size_t c = 0; c < by_class.size(); ++c) {
      auto& members = by_class[c];
      Shuffle(std::span(members), rng);
      auto n_val = static_cast<size_t>(std::lround(o.val_fraction * static_cast<double>(members.size())));
      if (!members.empty() && n_val >= members.size()) {
        n_val = members.size() - 1;
        if (kept_classes++ < 10) kept.push_back(fmt::format("'{}' ({})", set.classes[c], members.size()));
      }
      for (size_t k = 0; k < n_val; ++k) is_val[members[k]] = true;
    }
    for (size_t i = 0; i < set.inputs.size(); ++i) is_val[i] = is_val[set.inputs[i].first];
    // A class whose images are all copies of another class's files followed them: if they went to
    // validation, one of its copies' groups comes back to training (it only adds training images,
    // so one pass holds for every class).
    std::vector<int64_t> training(set.classes.size(), 0);
    std::vector<size_t> some_input(set.classes.size(), set.inputs.size());
    for (size_t i = 0; i < set.inputs.size(); ++i) {
      const auto c = static_cast<size_t>(set.inputs[i].label);
      if (!is_val[i]) training[c]++;
      if (some_input[c] == set.inputs.size()) some_input[c] = i;
    }
    for (size_t c = 0; c < set.classes.size(); ++c) {
      if (training[c] > 0 || some_input[c] == set.inputs.size()) continue;
      const size_t group = set.inputs[some_input[c]].first;
      for (size_t i = 0; i < set.inputs.size(); ++i) {
        if (set.inputs[i].first == group) is_val[i] = false;
      }
    }
    if (std::none_of(is_val.begin(), is_val.end(), [](bool v) { return v; })) {
      STOKE_LOG(WARN,
                "pack: --val-fraction {} rounds to no validation image in any class (the split is per class: "
                "round(fraction x class size)); the validation dataset will be empty",
                o.val_fraction);
    }
    if (!kept.empty()) {
      STOKE_LOG(WARN,
                "pack: --val-fraction {} would leave no training image in class(es) {}{}: one image of each "
                "stays in training",
                o.val_fraction, fmt::join(kept, ", "),
                kept_classes > 10 ? fmt::format(" and {} more", kept_classes - 10) : std::string());
    }
  }
  std::vector<SplitJob> jobs;
  jobs.push_back({"train", o.output, {}});
  if (o.val_fraction > 0) jobs.push_back({"val", o.val_output, {}});
  for (size_t i = 0; i < set.inputs.size(); ++i) {
    jobs[is_val[i] ? 1 : 0].inputs.push_back(set.inputs[i]);
  }
  if (o.shuffle) {
    for (size_t j = 0; j < jobs.size(); ++j) {
      SplitMix64 rng(MixSeed(o.seed, 0x73687566, j));  // "shuf"
      Shuffle(std::span(jobs[j].inputs), rng);
    }
  }

  // Parallelism is across images; OpenCV's own threads inside a worker would only oversubscribe.
  cv::setNumThreads(0);
  PackSummary summary;
  summary.inputs = static_cast<int64_t>(set.inputs.size());
  summary.classes = static_cast<int64_t>(set.classes.size());
  summary.threads = ThreadsOrCores(o.threads);
  Status failure;
  int64_t records = 0;
  // Every split is packed before any is published: a pack stopped part-way leaves every old
  // output as it was, never a new training set beside an old validation set.
  std::vector<std::unique_ptr<SplitPacker>> packers;
  std::vector<SplitSummary> packed;
  for (auto& job : jobs) {
    packers.push_back(std::make_unique<SplitPacker>(o, set, std::move(job), summary.threads, records));
    auto split = packers.back()->Run(summary);
    if (!split.ok()) {
      failure = split.status();
      break;
    }
    records += split->records;
    packed.push_back(*split);
  }
  for (size_t i = 0; failure.ok() && i < packed.size(); ++i) {
    auto split = packers[i]->Publish(packed[i], summary);
    if (!split.ok()) {
      failure = split.status();
      break;
    }
    summary.splits.push_back(*split);
  }
  for (const auto& p : packers) summary.bad.insert(summary.bad.end(), p->bad().begin(), p->bad().end());
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!o.report_file.empty()) {
    Status s = WriteReport(o.report_file, summary);
    if (!s.ok() && failure.ok()) {
      failure = Status(s.code(), fmt::format("pack: --report {}: {} (the datasets themselves are complete)",
                                             o.report_file.string(), s.message()));
    } else if (!s.ok()) {
      STOKE_LOG(ERROR, "pack: report: {}", s.ToString());
    }
  }
  if (!failure.ok()) return failure;
  return summary;
}

std::string FormatSummary(const PackSummary& s, size_t max_bad) {
  std::string out;
  int64_t records = 0;
  for (const auto& sp : s.splits) {
    records += sp.records;
    out += fmt::format("{}: {} records, {} classes, {} payload -> {}{}\n", sp.name, sp.records,
                       s.classes, HumanBytes(static_cast<double>(sp.payload_bytes)),
                       sp.output.string(), sp.already_complete ? " (already complete)" : "");
  }
  out += fmt::format(
      "packed {} of {} inputs in {:.1f} s ({:.0f} images/s, {} threads); "
      "skipped {}, converted {}, re-encoded {} ({} for EXIF orientation)\n",
      records, s.inputs, s.seconds, s.seconds > 0 ? records / s.seconds : 0.0, s.threads,
      s.bad.size(), s.converted, s.reencoded, s.reoriented);
  for (size_t i = 0; i < s.bad.size() && i < max_bad; ++i) {
    out += fmt::format("  skipped {}: {}\n", s.bad[i].path, s.bad[i].reason);
  }
  if (s.bad.size() > max_bad) {
    out += fmt::format("  ... and {} more (see --report)\n", s.bad.size() - max_bad);
  }
  return out;
}

}  // namespace stoke::pack
