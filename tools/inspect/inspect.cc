#include "tools/inspect/inspect.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <oneapi/tbb/concurrent_vector.h>
#include <oneapi/tbb/enumerable_thread_specific.h>
#include <oneapi/tbb/parallel_pipeline.h>
#include <oneapi/tbb/task_arena.h>

#include "common/file_util.h"
#include "common/limits.h"
#include "common/progress.h"
#include "common/sys_memory.h"
#include "common/tsan.h"
#include "dataset/dataset.h"
#include "decode/jpeg_decoder.h"
#include "decode/jpeg_transcode.h"

namespace stoke::inspect {
namespace {

// Running min / mean / max of one quantity.
struct Stat {
  int64_t n = 0;
  double sum = 0;
  double min = std::numeric_limits<double>::infinity();
  double max = -std::numeric_limits<double>::infinity();
  void Add(double v) {
    ++n;
    sum += v;
    min = std::min(min, v);
    max = std::max(max, v);
  }
  nlohmann::json Json() const {
    if (n == 0) return {{"min", 0}, {"mean", 0}, {"max", 0}};
    return {{"min", min}, {"mean", sum / static_cast<double>(n)}, {"max", max}};
  }
};

// The decoder's view of a record's restart index.
decode::RestartIndex IndexOf(const dataset::RecordView& r) {
  const dataset::JpegIndexView& x = r.jpeg_index;
  return {x.restart_mcus, x.mcus_per_row, x.mcu_rows, x.entry_bytes, x.intervals, x.entries};
}

// Checks one record completely: CRC, a strict decode whose size must match the header, and the
// restart index against the bytes it indexes.
Status VerifyRecord(const dataset::RecordView& r, decode::JpegDecoder& decoder, Image& scratch) {
  STOKE_RETURN_IF_ERROR(dataset::CheckCrc(r));
  const bool indexed = r.header.encoding == dataset::PayloadEncoding::kJpegIndexed;
  if (r.header.encoding != dataset::PayloadEncoding::kJpeg && !indexed) return OkStatus();  // size checked
  if (indexed) {
    Status s = decode::CheckRestartIndex(r.image, IndexOf(r));
    if (!s.ok()) return s.Prepend(fmt::format("record {}", r.index));
  }
  Status s = decoder.Decode(r.image, &scratch);
  if (!s.ok()) return s.Prepend(fmt::format("record {}: JPEG", r.index));
  if (static_cast<uint32_t>(scratch.width) != r.header.width ||
      static_cast<uint32_t>(scratch.height) != r.header.height ||
      scratch.channels != r.header.channels) {
    return CorruptError(fmt::format("record {}: decodes to {}x{}x{}, header says {}x{}x{}", r.index,
                                    scratch.width, scratch.height, scratch.channels, r.header.width,
                                    r.header.height, r.header.channels));
  }
  return OkStatus();
}

// Text from the dataset (class names, source paths) as one line a terminal shows as written:
// control characters as \xNN (C1 ones, U+0080 to U+009F, as \u00NN: U+009B starts an escape
// sequence in some terminals). A name holding a newline split the "per class" line, and an escape
// sequence in a stored path reached the terminal.
std::string Shown(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const auto b = static_cast<unsigned char>(text[i]);
    const auto next = i + 1 < text.size() ? static_cast<unsigned char>(text[i + 1]) : 0;
    if (b < 0x20 || b == 0x7f) {
      out += fmt::format("\\x{:02x}", b);
    } else if (b == 0xc2 && next >= 0x80 && next <= 0x9f) {
      out += fmt::format("\\u{:04x}", next);
      ++i;
    } else {
      out += text[i];
    }
  }
  return out;
}

}  // namespace

Result<InspectReport> Inspect(const std::filesystem::path& path, const InspectOptions& options) {
  if (options.threads < 0 || options.threads > kMaxThreads) {
    return InvalidArgumentError(
        fmt::format("inspect: threads {} (expected 0 to {}; 0 = every core)", options.threads, kMaxThreads));
  }
  STOKE_ASSIGN_OR_RETURN(dataset::Dataset ds, dataset::Dataset::Open(path));
  const auto& m = ds.manifest();
  InspectReport report;

  // Header statistics: one sequential pass without CRC checks (headers only, fast).
  Stat payload, width, height;
  int64_t indexed = 0, intervals = 0, index_bytes = 0, indexed_payload = 0;
  std::map<std::string, int64_t> encodings;
  std::map<int, int64_t> channels;
  // What the records say, to hold against the manifest's own totals.
  std::vector<int64_t> counted(m.classes.size(), 0);
  int64_t counted_bytes = 0;
  {
    STOKE_ASSIGN_OR_RETURN(auto reader, ds.NewReader({.verify_crc = false}));
    for (int64_t i = 0; i < ds.size(); ++i) {
      auto r = reader.Get(i);
      if (!r.ok()) {
        // A malformed header is a finding to list, not a reason to refuse the summary.
        auto source = reader.SourcePath(i);
        report.bad.push_back({i, source.ok() ? *source : "", r.status().message()});
        continue;
      }
      payload.Add(static_cast<double>(r->header.payload_size));
      width.Add(r->header.width);
      height.Add(r->header.height);
      counted[static_cast<size_t>(r->header.label)]++;  // the reader checked the label's range
      counted_bytes += static_cast<int64_t>(r->payload.size());
      encodings[std::string(dataset::EncodingName(r->header.encoding))]++;
      channels[r->header.channels]++;
      if (r->jpeg_index.entry_bytes != 0) {
        ++indexed;
        intervals += r->jpeg_index.intervals;
        index_bytes += static_cast<int64_t>(r->payload.size() - r->image.size());
        indexed_payload += static_cast<int64_t>(r->payload.size());
      }
    }
  }
  // Unreadable headers are listed already; the totals are compared only when every one was read.
  if (report.bad.empty()) {
    for (size_t c = 0; c < counted.size(); ++c) {
      if (counted[c] != m.class_counts[c]) {
        report.manifest_problems.push_back(fmt::format(
            "class_counts[{}] ('{}') is {}, the records hold {}", c, m.classes[c], m.class_counts[c], counted[c]));
      }
    }
    // payload_bytes is optional (an older writer left it out).
    if (m.payload_bytes_stored && m.payload_bytes != counted_bytes) {
      report.manifest_problems.push_back(
          fmt::format("payload_bytes is {}, the records hold {}", m.payload_bytes, counted_bytes));
    }
  }
  if (!ds.paths_status().ok()) report.manifest_problems.push_back(std::string(ds.paths_status().message()));
  nlohmann::json enc_json = nlohmann::json::object(), ch_json = nlohmann::json::object();
  for (auto& [k, v] : encodings) enc_json[k] = v;
  for (auto& [k, v] : channels) ch_json[std::to_string(k)] = v;
  report.summary = {{"path", path.string()},
                    {"format_version", m.format_version},
                    {"records", m.records},
                    {"classes", m.classes.size()},
                    {"class_names", m.classes},
                    {"class_counts", m.class_counts},
                    // What the records hold when every header was read (a wrong manifest total is
                    // a manifest problem above), else what the manifest says.
                    {"payload_bytes", report.bad.empty() ? counted_bytes : m.payload_bytes},
                    {"payload_size", payload.Json()},
                    {"width", width.Json()},
                    {"height", height.Json()},
                    {"encodings", enc_json},
                    {"channels", ch_json},
                    {"restart_index",
                     {{"records", indexed},
                      {"intervals", intervals},
                      {"intervals_per_record", indexed > 0 ? static_cast<double>(intervals) / indexed : 0.0},
                      {"bytes", index_bytes},
                      {"share_of_payload", indexed_payload > 0 ? static_cast<double>(index_bytes) / indexed_payload
                                                               : 0.0}}},
                    {"packing", m.packing},
                    {"manifest_problems", report.manifest_problems}};
  if (!options.verify) return report;

  // Verify: every CRC and a strict decode, in parallel; one reader (read transaction) and one
  // decoder per thread.
  const int threads = ThreadsOrCores(options.threads);
  struct PerThread {
    std::optional<dataset::Reader> reader;
    decode::JpegDecoder decoder;
    Image scratch;
  };
  tbb::enumerable_thread_specific<PerThread> locals;
  // concurrent_vector: workers only append (push_back is safe concurrently); read after the join.
  tbb::concurrent_vector<BadRecord> bad;
  std::optional<ProgressReporter> progress;
  if (options.progress) progress.emplace("verify", ds.size());
  // A parallel_pipeline rather than parallel_for: its hand-offs can be annotated for TSan
  // (common/tsan.h), the partitioner's cannot. The serial stage deals out chunks of indices.
  constexpr int64_t kChunk = 64;
  int64_t next = 0;
  int done = 0;
  std::atomic<int64_t> checked{0};
  // The source paths table is read too: a damaged page of it lost every path it held while the
  // records read, and verified, as intact.
  const bool read_paths = m.has_paths && ds.paths_status().ok();
  std::atomic<int64_t> lost_paths{0};
  tbb::concurrent_vector<std::string> first_lost;  // the first failure's message (one at most)
  auto stopping = [&] { return options.stop != nullptr && options.stop->load(); };
  auto chain =
      tbb::make_filter<void, int64_t>(tbb::filter_mode::serial_in_order,
                                      [&](tbb::flow_control& fc) -> int64_t {
                                        STOKE_TSAN_ACQUIRE(&stoke_tsan_sync_anchor);
                                        STOKE_TSAN_ACQUIRE(&next);
                                        const int64_t begin = next;
                                        if (begin >= ds.size() || stopping()) fc.stop();
                                        next += kChunk;
                                        STOKE_TSAN_RELEASE(&next);
                                        STOKE_TSAN_RELEASE(&done);
                                        return begin;
                                      }) &
      tbb::make_filter<int64_t, void>(tbb::filter_mode::parallel, [&](int64_t begin) {
        STOKE_TSAN_ACQUIRE(&stoke_tsan_sync_anchor);
        const int64_t end = std::min(begin + kChunk, ds.size());
        PerThread& t = locals.local();
        if (!t.reader) {
          auto r = ds.NewReader({.verify_crc = false});
          if (r.ok()) {
            t.reader.emplace(std::move(r).value());
          } else {
            bad.push_back({begin, "", r.status().message()});
          }
        }
        int64_t i = begin;
        for (; t.reader && i < end && !stopping(); ++i) {
          auto rec = t.reader->Get(i);
          Status s = rec.ok() ? VerifyRecord(*rec, t.decoder, t.scratch) : rec.status();
          auto source = !s.ok() || read_paths ? t.reader->SourcePath(i) : Result<std::string>(std::string());
          if (!source.ok() && read_paths && lost_paths.fetch_add(1) == 0) {
            first_lost.push_back(std::string(source.status().message()));
          }
          if (!s.ok()) bad.push_back({i, source.ok() ? *source : "", s.message()});
        }
        checked.fetch_add(i - begin);
        if (progress) progress->Advance(end - begin);
        STOKE_TSAN_RELEASE(&done);
      });
  tbb::task_arena arena(threads);
  STOKE_TSAN_RELEASE(&stoke_tsan_sync_anchor);
  arena.execute([&] { tbb::parallel_pipeline(static_cast<size_t>(threads) * 2, chain); });
  STOKE_TSAN_ACQUIRE(&done);
  if (progress) progress->Finish();
  if (stopping() && checked.load() < ds.size()) {
    return UnavailableError(fmt::format("inspect: {}: verify stopped after {} of {} records", path.string(),
                                        checked.load(), ds.size()));
  }
  report.verified = true;
  if (lost_paths.load() > 0) {
    report.manifest_problems.push_back(fmt::format(
        "the source paths table: {} of {} records' paths cannot be read (the images are not affected); one of them: {}",
        lost_paths.load(), ds.size(), first_lost.empty() ? std::string("?") : first_lost[0]));
    report.summary["manifest_problems"] = report.manifest_problems;
  }
  // Verify re-checks every record, including any the summary pass already listed.
  report.bad.assign(bad.begin(), bad.end());
  std::sort(report.bad.begin(), report.bad.end(),
            [](const BadRecord& a, const BadRecord& b) { return a.index < b.index; });
  return report;
}

nlohmann::json ReportJson(const InspectReport& report) {
  nlohmann::json j = report.summary;
  nlohmann::json bad = nlohmann::json::array();
  for (const auto& b : report.bad) {
    bad.push_back({{"index", b.index}, {"path", b.source_path}, {"reason", b.reason}});
  }
  if (report.verified) {
    j["verify"] = {{"checked", report.summary["records"]}, {"bad", bad}};
  } else {
    j["unreadable"] = bad;  // records whose header could not be read (the text lists them too)
  }
  return j;
}

std::string FormatReport(const InspectReport& report, size_t max_classes) {
  const auto& s = report.summary;
  auto stat = [](const nlohmann::json& st, bool bytes) {
    if (bytes) {
      return fmt::format("min {} / mean {} / max {}", HumanBytes(st["min"].get<double>()),
                         HumanBytes(st["mean"].get<double>()), HumanBytes(st["max"].get<double>()));
    }
    return fmt::format("min {:.0f} / mean {:.1f} / max {:.0f}", st["min"].get<double>(),
                       st["mean"].get<double>(), st["max"].get<double>());
  };
  std::string out;
  out += fmt::format("dataset        {}\n", Shown(s["path"].get<std::string>()));
  out += fmt::format("format         v{}\n", s["format_version"].get<int>());
  out += fmt::format("records        {}\n", s["records"].get<int64_t>());
  out += fmt::format("classes        {}\n", s["classes"].get<int64_t>());
  out += fmt::format("payload        {} total; {}\n",
                     HumanBytes(s["payload_bytes"].get<double>()), stat(s["payload_size"], true));
  out += fmt::format("width          {}\n", stat(s["width"], false));
  out += fmt::format("height         {}\n", stat(s["height"], false));
  out += fmt::format("encodings      {}\n", s["encodings"].dump());
  out += fmt::format("channels       {}\n", s["channels"].dump());
  if (const auto& x = s["restart_index"]; x["records"].get<int64_t>() > 0) {
    out += fmt::format("restart index  {} records, {:.1f} intervals each ({} in all), {} = {:.2f}% of their payload\n",
                       x["records"].get<int64_t>(), x["intervals_per_record"].get<double>(),
                       x["intervals"].get<int64_t>(), HumanBytes(x["bytes"].get<double>()),
                       100 * x["share_of_payload"].get<double>());
  }
  // `packing` is informational and free-form: print what has the expected types.
  const auto& p = s["packing"];
  auto text = [&](const char* key) {
    auto it = p.find(key);
    return it != p.end() && it->is_string() ? it->get<std::string>() : std::string("?");
  };
  if (p.contains("tool")) {
    out += fmt::format("packed         {} by {} {} from {} (split {})\n", Shown(text("created")),
                       Shown(text("tool")), Shown(text("tool_version")), Shown(text("source")), Shown(text("split")));
    if (p.contains("options")) {
      out += fmt::format("options        {}\n",
                         p["options"].dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    }
    if (auto bad = p.find("bad"); bad != p.end() && bad->is_array()) {
      out += fmt::format("skipped inputs {}\n", bad->size());
    }
  }
  const auto names = s["class_names"].get<std::vector<std::string>>();
  const auto counts = s["class_counts"].get<std::vector<int64_t>>();
  out += "per class     ";
  for (size_t i = 0; i < names.size() && i < max_classes; ++i) {
    out += fmt::format(" {}:{}", Shown(names[i]), counts[i]);
  }
  if (names.size() > max_classes) out += fmt::format(" ... ({} more)", names.size() - max_classes);
  out += "\n";
  if (report.verified) {
    out += fmt::format("verify         {} records checked, {} bad\n", s["records"].get<int64_t>(),
                       report.bad.size());
  } else if (!report.bad.empty()) {
    out += fmt::format("unreadable     {} records (run --verify for a full check)\n",
                       report.bad.size());
  }
  for (const auto& p : report.manifest_problems) out += fmt::format("manifest       {}\n", Shown(p));
  for (const auto& b : report.bad) {
    out += fmt::format("  bad record {}{}: {}\n", b.index,
                       b.source_path.empty() ? "" : " (" + Shown(b.source_path) + ")", Shown(b.reason));
  }
  return out;
}

Status ExtractRecord(const std::filesystem::path& path, int64_t index,
                     const std::filesystem::path& output) {
  const std::filesystem::path dataset_dir[] = {path};
  STOKE_RETURN_IF_ERROR(CheckOutputClear("inspect: --output", output, {}, dataset_dir));
  STOKE_ASSIGN_OR_RETURN(dataset::Dataset ds, dataset::Dataset::Open(path));
  STOKE_ASSIGN_OR_RETURN(auto reader, ds.NewReader());
  STOKE_ASSIGN_OR_RETURN(dataset::RecordView r, reader.Get(index));
  if (r.header.encoding == dataset::PayloadEncoding::kJpeg ||
      r.header.encoding == dataset::PayloadEncoding::kJpegIndexed) {
    return WriteFileAtomic(output, r.image);  // the JPEG alone, a file any viewer opens
  }
  std::string pnm = fmt::format("P{}\n{} {}\n255\n", r.header.channels == 1 ? 5 : 6,
                                r.header.width, r.header.height);
  std::vector<std::byte> bytes(pnm.size() + r.payload.size());
  std::memcpy(bytes.data(), pnm.data(), pnm.size());
  std::memcpy(bytes.data() + pnm.size(), r.payload.data(), r.payload.size());
  return WriteFileAtomic(output, bytes);
}

}  // namespace stoke::inspect
