#include "tools/bench/bench_commands.h"
#include "tools/bench/bench_stats.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <ctime>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <turbojpeg.h>
// clang-format off
#include <cstdio>
#include <jpeglib.h>  // LIBJPEG_TURBO_VERSION_NUMBER
// clang-format on

#include "augment/crop_plan.h"
#include "augment/transform.h"
#include "common/c_handles.h"
#include "common/crc32c.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/random.h"
#include "common/sys_memory.h"
#include "common/version.h"
#include "dataset/dataset.h"
#include "decode/jpeg_decoder.h"
#include "prefetch/loader.h"
#include "tools/pack/packer.h"

namespace stoke::bench {
namespace fs = std::filesystem;
namespace {


// Seconds taken by fn().
double Time(const std::function<void()>& fn) {
  auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

std::string Today() {
  std::time_t t = std::time(nullptr);
  char buf[16];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&t));
  return buf;
}

// A bench's own scratch folder (packed copies of its images) holds `.lock` under flock(2) while the
// bench runs: a folder whose lock can be taken belongs to no running bench, whatever its PID says
// (another PID namespace or container sharing the folder sees other PIDs).
constexpr const char* kScratchLock = ".lock";

struct Scratch {
  fs::path dir;
  bool owned = false;
  std::optional<FileLock> lock;  // released after the folder is gone
  ~Scratch() {
    std::error_code ec;
    if (owned) fs::remove_all(dir, ec);
  }
};

// Scratch folders of benches that were killed (Ctrl-C, SIGTERM: no destructor ran), 100 MB and more
// each, are removed by the next bench: only folders named as a bench names them, owned by this user,
// whose lock is free (or, a folder without a lock, whose process is gone from this PID namespace).
void RemoveOrphanScratch(const fs::path& tmp) {
  std::error_code ec;
  for (auto it = fs::directory_iterator(tmp, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    constexpr std::string_view kPrefix = "stoke-bench-";
    if (name.rfind(kPrefix, 0) != 0) continue;
    const std::string digits = name.substr(kPrefix.size());
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const auto pid = static_cast<pid_t>(std::stol(digits));
    if (std::to_string(pid) != digits || pid == ::getpid()) continue;
    struct stat st{};
    if (::lstat(it->path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid()) continue;
    const fs::path lock_path = it->path() / kScratchLock;
    std::optional<FileLock> probe;  // held while the folder is removed
    bool orphan = false;
    if (std::error_code lock_ec; fs::exists(fs::symlink_status(lock_path, lock_ec))) {
      auto taken = FileLock::TryAcquire(lock_path, "bench");
      if (taken.ok()) probe.emplace(std::move(*taken));
      orphan = probe.has_value();
    } else {
      orphan = ::kill(pid, 0) != 0 && errno == ESRCH;
    }
    std::error_code remove_ec;
    if (orphan) fs::remove_all(it->path(), remove_ec);
  }
}

// `needed`: false when the bench reads a given dataset and writes nothing of its own; the folder is
// then not made.
Result<std::unique_ptr<Scratch>> MakeScratch(const BenchOptions& o, bool needed = true) {
  auto s = std::make_unique<Scratch>();
  std::error_code ec;
  // A folder of this bench's own, inside --work-dir when given (what else is there is not
  // touched), and removed at the end: a bench leaves nothing behind.
  fs::path parent = o.work_dir;
  if (parent.empty()) {
    STOKE_ASSIGN_OR_RETURN(parent, TemporaryFolder("the bench's scratch datasets"));
  }
  // Not inside the images measured: its scratch files would be packed with them.
  const fs::path measured[] = {o.data};
  STOKE_RETURN_IF_ERROR(CheckOutputClear("bench: --work-dir", o.work_dir, {}, measured));
  RemoveOrphanScratch(parent);  // a killed bench's (also by a bench that needs no folder itself)
  if (!needed) return s;
  if (!o.work_dir.empty()) {
    fs::create_directories(parent, ec);
    if (ec) return IoError(fmt::format("bench: --work-dir {}: {}", parent.string(), ec.message()));
  }
  s->dir = parent / fmt::format("stoke-bench-{}", ::getpid());
  s->owned = true;
  fs::create_directories(s->dir, ec);
  if (ec) return IoError(fmt::format("bench: {}: {}", s->dir.string(), ec.message()));
  if (s->owned) {
    STOKE_ASSIGN_OR_RETURN(FileLock lock, FileLock::TryAcquire(s->dir / kScratchLock, "bench"));
    s->lock.emplace(std::move(lock));
  }
  return s;
}

// Every regular file under `root`, sorted (the pack tool's own order).
std::vector<fs::path> ListFiles(const fs::path& root) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(root, ec); it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (ec) break;
    std::error_code file_ec;  // a link loop or a dangling link is not a file (pack skips it too)
    if (it->is_regular_file(file_ec)) files.push_back(it->path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

Status CheckData(const BenchOptions& o) {
  std::error_code ec;
  const bool folder = fs::is_directory(o.data, ec);
  const bool dataset = folder && fs::exists(o.data / "data.mdb", ec);
  if (!folder || dataset) {
    if (fs::exists(o.data, ec)) {
      return InvalidArgumentError(fmt::format(
          "bench: {}: {}; --data takes an image folder tree (one sub-folder per class), a packed dataset goes as "
          "the DB argument of bench decode and pipeline",
          o.data.string(), dataset ? "a packed dataset" : "not a folder"));
    }
    return NotFoundError(fmt::format(
        "bench: {}: no such image folder (pass --data, e.g. ../shared/data/imagenet_like)",
        o.data.string()));
  }
  if (o.repeats < 1) return InvalidArgumentError("bench: --repeats must be >= 1");
  return OkStatus();
}

}  // namespace

Status CheckJsonOut(const BenchOptions& o, const fs::path& dataset) {
  if (o.json_out.empty()) return OkStatus();
  // Not into what is measured: the image folder (--data) or the dataset.
  const fs::path read[] = {o.data, dataset};
  STOKE_RETURN_IF_ERROR(CheckOutputClear("bench: --json", o.json_out, {}, read));
  return CheckFileWritable("bench: --json", o.json_out);
}

namespace {

// The table, once the JSON copy is written; when it cannot be, the table is printed all the same
// (the figures cost the run) before the error.
Result<std::string> WithJson(const BenchOptions& o, const nlohmann::json& j, std::string table) {
  if (o.json_out.empty()) return table;
  Status written = WriteFileAtomic(o.json_out,
                                   j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  if (written.ok()) return table;
  std::fputs(table.c_str(), stdout);
  std::fflush(stdout);
  return Status(written.code(), fmt::format("bench: --json {}: {} (the figures are printed above)",
                                            o.json_out.string(), written.message()));
}

nlohmann::json MachineJson(int threads) {
  return {{"cpu", CpuModel()},
          {"cores", static_cast<int>(std::thread::hardware_concurrency())},
          {"threads", threads},
          {"date", Today()},
          {"stoke", STOKE_VERSION},
          {"git_sha", GitSha()},
          {"libjpeg_turbo", fmt::format("{}.{}.{}", LIBJPEG_TURBO_VERSION_NUMBER / 1000000,
                                         LIBJPEG_TURBO_VERSION_NUMBER / 1000 % 1000,
                                         LIBJPEG_TURBO_VERSION_NUMBER % 1000)}};
}

// One plain TurboJPEG full decode to RGB (the yardstick every target is expressed in).
bool TurboJpegFullDecode(tjhandle tj, std::span<const std::byte> jpeg, std::vector<unsigned char>& rgb) {
  int w = 0, h = 0, sub = 0, cs = 0;
  const auto* p = reinterpret_cast<const unsigned char*>(jpeg.data());
  if (tjDecompressHeader3(tj, p, jpeg.size(), &w, &h, &sub, &cs) != 0) return false;
  rgb.resize(static_cast<size_t>(w) * h * 3);
  return tjDecompress2(tj, p, jpeg.size(), rgb.data(), w, 0, h, TJPF_RGB, 0) == 0;
}

// Views into the map of every JPEG record of `ds`, valid while `reader` lives.
// The JPEG records of a dataset whose CRC holds, as views into its map, with their record indices.
// A damaged record is left out with a warning naming it (the loader skips it in the same way), so
// that a yardstick does not time or count it.
struct JpegRecords {
  std::vector<std::span<const std::byte>> views;
  std::vector<int64_t> index;  // the record of each view
  std::vector<decode::RestartIndex> restart;  // each view's restart index (entry_bytes 0: none)
  int64_t damaged = 0;
};
Result<JpegRecords> JpegViews(const dataset::Dataset& ds, dataset::Reader& reader) {
  JpegRecords out;
  int64_t not_jpeg = 0;
  // One record at a time: a record whose header cannot be parsed ended a scan of them all (and
  // the bench with it), where the loader skips it.
  for (int64_t i = 0; i < ds.size(); ++i) {
    Result<dataset::RecordView> got = reader.Get(i);
    Status bad = got.status();
    if (got.ok()) {
      const dataset::RecordView& r = *got;
      if (r.header.encoding != dataset::PayloadEncoding::kJpeg &&
          r.header.encoding != dataset::PayloadEncoding::kJpegIndexed) {
        ++not_jpeg;
        continue;
      }
      bad = dataset::CheckCrc(r);
      if (!bad.ok()) bad = CorruptError(fmt::format("dataset: {}: {}", ds.path().string(), bad.message()));
      if (bad.ok()) {
        out.views.push_back(r.image);
        out.index.push_back(r.index);
        const dataset::JpegIndexView& x = r.jpeg_index;
        out.restart.push_back({x.restart_mcus, x.mcus_per_row, x.mcu_rows, x.entry_bytes, x.intervals, x.entries});
        continue;
      }
    }
    if (bad.code() != StatusCode::kCorrupt) return bad;  // I/O: the figures would mean nothing
    if (out.damaged++ == 0) STOKE_LOG(WARN, "bench: {}; left out of the figures", bad.message());
  }
  if (out.damaged > 1) STOKE_LOG(WARN, "bench: {}: {} damaged records left out", ds.path().string(), out.damaged);
  if (out.views.empty() && not_jpeg > 0 && out.damaged == 0) {
    return InvalidArgumentError(fmt::format(
        "bench: {}: its {} records hold decoded pixels (packed with --encoding raw), and this benchmark decodes "
        "JPEG; give a dataset packed with the default --encoding jpeg",
        ds.path().string(), not_jpeg));
  }
  if (out.views.empty()) {
    return InvalidArgumentError(fmt::format("bench: {}: no intact JPEG records ({} damaged, {} of decoded pixels)",
                                            ds.path().string(), out.damaged, not_jpeg));
  }
  return out;
}

// Packs `o.data` (or the inputs of `list`, a list file) into `out`; returns images/s.
Result<double> PackOnce(const BenchOptions& o, const fs::path& out, int threads,
                        pack::ValidateMode validate = pack::ValidateMode::kCoefficients, const fs::path& list = {},
                        pack::IndexMode index = pack::IndexMode::kRestart) {
  pack::PackOptions p;
  p.validate = validate;
  p.index = index;
  p.source = o.data;
  p.list_file = list;
  p.output = out;
  p.threads = threads;
  p.progress = false;
  // Deleting the previous run's output is not part of packing: do it before the clock starts.
  std::error_code ec;
  fs::remove_all(out, ec);
  Result<pack::PackSummary> summary = InternalError("not run");
  double s = Time([&] { summary = pack::Pack(p); });
  if (!summary.ok()) return summary.status();
  int64_t records = 0;
  for (const auto& sp : summary->splits) records += sp.records;
  return static_cast<double>(records) / s;
}

// `dataset` when one is given; otherwise options.data packed (once) into `scratch`.
Result<fs::path> DatasetOrPack(const BenchOptions& o, const fs::path& dataset, const fs::path& scratch) {
  if (!dataset.empty()) return dataset;
  STOKE_RETURN_IF_ERROR(CheckData(o));
  STOKE_RETURN_IF_ERROR(PackOnce(o, scratch, 0).status());
  return scratch;
}

// The per-run duration: --seconds, or the subcommand's default.
double SecondsOr(const BenchOptions& o, double fallback) { return o.seconds > 0 ? o.seconds : fallback; }

// A list file of `count` of `files` spread evenly over them (so every class is represented),
// labelled by their folder; for packing a time-sized share of the data.
Result<fs::path> WriteSubsetList(const std::vector<fs::path>& files, int64_t count, const fs::path& path) {
  std::map<fs::path, int> labels;
  for (const auto& f : files) labels.emplace(f.parent_path(), 0);
  int next = 0;
  for (auto& [dir, label] : labels) label = next++;
  std::string text;
  const auto n = static_cast<int64_t>(files.size());
  for (int64_t k = 0; k < count; ++k) {
    const fs::path& f = files[static_cast<size_t>(k * n / count)];
    text += fmt::format("{} {}\n", fs::absolute(f).string(), labels.at(f.parent_path()));
  }
  STOKE_RETURN_IF_ERROR(WriteFileAtomic(path, text));
  return path;
}

}  // namespace

Result<std::string> BenchPack(const BenchOptions& o) {
  STOKE_RETURN_IF_ERROR(CheckJsonOut(o));  // before the runs, not after them
  STOKE_RETURN_IF_ERROR(CheckData(o));
  const int n = ThreadsOrCores(o.threads);
  const double seconds = SecondsOr(o, 1.0);
  STOKE_ASSIGN_OR_RETURN(auto scratch, MakeScratch(o));
  // With N = 1 the 1-thread rows are the N-thread ones (they were printed twice, and the JSON kept
  // one of each pair under their shared label).
  const int one_thread_rows = n > 1 ? 2 : 0;
  BenchProgress progress("bench pack", (5 + one_thread_rows) * o.repeats);

  // Yardstick: TurboJPEG full decode to RGB, one core, JPEGs already in memory.
  progress.Note("reading the images");
  std::vector<std::vector<std::byte>> jpegs;
  std::vector<fs::path> files;  // the packable inputs, for the time-sized subsets
  int64_t input_bytes = 0;
  for (const auto& f : ListFiles(o.data)) {
    if (f.string().find('\n') != std::string::npos) continue;  // cannot go in a list file
    STOKE_ASSIGN_OR_RETURN(auto bytes, ReadFileBytes(f));
    input_bytes += static_cast<int64_t>(bytes.size());
    files.push_back(f);
    if (decode::LooksLikeJpeg(bytes)) jpegs.push_back(std::move(bytes));
  }
  if (jpegs.empty()) return InvalidArgumentError("bench: " + o.data.string() + ": no JPEGs");
  TjHandle tj(tjInitDecompress());
  std::vector<unsigned char> rgb;
  int failures = 0;
  auto decode_n = [&](int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
      if (!TurboJpegFullDecode(tj.get(), jpegs[static_cast<size_t>(i) % jpegs.size()], rgb)) ++failures;
    }
  };
  const auto all = static_cast<int64_t>(jpegs.size());
  progress.Run("TurboJPEG full decode, 1 core", 0, o.repeats);
  const int64_t warm = std::min<int64_t>(all, 32);
  const int64_t tj_count = ItemsForSeconds(static_cast<double>(warm) / Time([&] { decode_n(warm); }), seconds, 20);
  failures = 0;

  // stoke pack with each validation mode, 1 and N threads, interleaved so that drift on a shared
  // machine hits every figure alike. Each row packs an evenly spread share of the images sized
  // from its own warm-up pack, so that a run takes about `seconds`.
  const fs::path out = scratch->dir / "bench_pack.lmdb";
  using pack::ValidateMode;
  using pack::IndexMode;
  struct Row {
    const char* name;
    ValidateMode mode;
    IndexMode index;
    int threads;
    double target;  // x threads x TurboJPEG; 0: none
    fs::path list;
    int64_t images = 0;
    std::vector<double> rates;
    std::string Label() const {
      return fmt::format("pack --validate {} --index {}, {} thread{}", name, index == IndexMode::kRestart ? "restart" : "none",
                         threads, threads > 1 ? "s" : "");
    }
  };
  // The restart index transcodes every JPEG (paid once, saved every epoch): its target is half a
  // decode's rate per thread; without it, 0.9.
  std::vector<Row> rows;
  for (const auto& [index, target] : {std::pair{IndexMode::kRestart, 0.5}, std::pair{IndexMode::kNone, 0.9}}) {
    if (one_thread_rows > 0) rows.push_back({"coefficients", ValidateMode::kCoefficients, index, 1, 0, {}});
    rows.push_back({"coefficients", ValidateMode::kCoefficients, index, n, target, {}});
  }
  rows.push_back({"pixels", ValidateMode::kPixels, IndexMode::kRestart, n, 0, {}});
  rows.push_back({"pixels", ValidateMode::kPixels, IndexMode::kNone, n, 0, {}});
  const int64_t total_files = static_cast<int64_t>(files.size());
  const int64_t warm_files = std::min<int64_t>(total_files, 16 * n);
  STOKE_ASSIGN_OR_RETURN(const fs::path warm_list, WriteSubsetList(files, warm_files, scratch->dir / "warm.list"));
  for (size_t k = 0; k < rows.size(); ++k) {
    Row& row = rows[k];
    progress.Run(row.Label(), 0, o.repeats);
    STOKE_ASSIGN_OR_RETURN(double rate, PackOnce(o, out, row.threads, row.mode, warm_list, row.index));
    row.images = ItemsForSeconds(rate, seconds, std::min<int64_t>(total_files, 8 * row.threads), total_files);
    STOKE_ASSIGN_OR_RETURN(row.list, WriteSubsetList(files, row.images, scratch->dir / fmt::format("row{}.list", k)));
  }
  std::vector<double> tj_rates;
  for (int r = 1; r <= o.repeats; ++r) {
    progress.Run("TurboJPEG full decode, 1 core", r, o.repeats);
    const int failed_before = failures;  // a file TurboJPEG refuses is timed, not counted
    const double secs = Time([&] { decode_n(tj_count); });
    tj_rates.push_back(static_cast<double>(tj_count - (failures - failed_before)) / secs);
    for (auto& row : rows) {
      progress.Run(row.Label(), r, o.repeats);
      STOKE_ASSIGN_OR_RETURN(double rate, PackOnce(o, out, row.threads, row.mode, row.list, row.index));
      row.rates.push_back(rate);
    }
  }
  const double tj_rate = Median(tj_rates);
  nlohmann::json j = {{"machine", MachineJson(n)},
                      {"data", o.data.string()},
                      {"images", jpegs.size()},
                      {"input_bytes", input_bytes},
                      {"repeats", o.repeats},
                      {"seconds_per_run", seconds},
                      {"turbojpeg_decode_1core_img_s", tj_rate}};
  std::string t;
  t += fmt::format("stoke bench pack: {} ({} JPEGs, {}), N = {} threads, median of {} runs of ~{:g} s\n",
                   o.data.string(), jpegs.size(), HumanBytes(static_cast<double>(input_bytes)), n, o.repeats,
                   seconds);
  t += fmt::format("machine: {}, {} cores, {}\n", CpuModel(), std::thread::hardware_concurrency(), Today());
  t += fmt::format("  TurboJPEG full decode, 1 core                {:8.1f} img/s  ({} images per run){}\n", tj_rate,
                   tj_count, failures ? fmt::format(" ({} failed, not counted)", failures / o.repeats) : "");
  t += "  targets at N threads: --index restart >= 0.5 x N x TurboJPEG, --index none >= 0.9 x N x TurboJPEG\n";
  for (const auto& row : rows) {
    const double rate = Median(row.rates);
    const double ratio = rate / (row.threads * tj_rate);
    t += fmt::format("  {:<58} {:8.1f} img/s  {:.2f} x {} x TurboJPEG  ({} images per run){}\n", row.Label(), rate,
                     ratio, row.threads, row.images,
                     row.target > 0 ? (ratio >= row.target ? "  (target met)" : "  (target NOT met)") : "");
    j["results"][row.Label()] = {{"img_s", rate}, {"ratio_vs_threads_x_turbojpeg", ratio}, {"images_per_run", row.images}};
  }
  return WithJson(o, j, std::move(t));
}

Result<std::string> BenchRead(const BenchOptions& o) {
  STOKE_RETURN_IF_ERROR(CheckJsonOut(o));  // before the runs, not after them
  STOKE_RETURN_IF_ERROR(CheckData(o));
  const int n = ThreadsOrCores(o.threads);
  const double seconds = SecondsOr(o, 0.5);
  STOKE_ASSIGN_OR_RETURN(auto scratch, MakeScratch(o));
  const fs::path out = scratch->dir / "bench_read.lmdb";
  const int figures = 4 * (n > 1 ? 2 : 1);
  BenchProgress progress("bench read", figures * o.repeats);
  progress.Note("packing the images");
  STOKE_RETURN_IF_ERROR(PackOnce(o, out, n).status());
  STOKE_ASSIGN_OR_RETURN(dataset::Dataset ds, dataset::Dataset::Open(out));
  const int64_t records = ds.size();
  if (records == 0) return InvalidArgumentError("bench: no records packed");
  const double bytes_per_pass = static_cast<double>(ds.manifest().payload_bytes);

  // Random order: a fixed sequence each thread walks from its own offset, as long as the run lasts.
  std::vector<int64_t> order(static_cast<size_t>(std::max<int64_t>(records, 1 << 16)));
  SplitMix64 rng(42);
  for (auto& i : order) i = static_cast<int64_t>(rng.Below(static_cast<uint64_t>(records)));
  // Scan's callback stops a pass early with this marker when the run's time is up.
  const Status time_up = UnavailableError("bench read: the run's time is up");
  constexpr int64_t kCheckEvery = 64;   // items between clock reads
  constexpr int64_t kMinPerThread = 256;

  struct Figure {
    double rec_s;
    double mb_s;
  };
  // One figure: median over the runs of `threads` threads reading until the run's time is up.
  auto measure = [&](const std::string& name, int threads, bool crc, bool random) -> Result<Figure> {
    std::vector<double> rates, mbs;
    for (int r = 0; r <= o.repeats; ++r) {  // r == 0 is a short warm-up
      progress.Run(name, r, o.repeats);
      std::vector<std::thread> pool;
      std::vector<Status> status(static_cast<size_t>(threads));
      std::vector<int64_t> done(static_cast<size_t>(threads), 0);
      std::vector<double> touched(static_cast<size_t>(threads), 0);
      const Deadline deadline(r == 0 ? seconds / 4 : seconds);
      double secs = Time([&] {
        for (int t = 0; t < threads; ++t) {
          pool.emplace_back([&, t] {
            auto reader = ds.NewReader({.verify_crc = crc});
            if (!reader.ok()) {
              status[t] = reader.status();
              return;
            }
            uint64_t sink = 0;
            double bytes = 0;
            int64_t count = 0;
            auto time_to_stop = [&] { return count % kCheckEvery == 0 && count >= kMinPerThread && deadline.Passed(); };
            if (random) {
              size_t k = order.size() * static_cast<size_t>(t) / static_cast<size_t>(threads);
              while (!time_to_stop()) {
                auto rec = reader->Get(order[k]);
                if (!rec.ok()) {
                  status[t] = rec.status();
                  return;
                }
                sink += static_cast<uint8_t>(rec->payload[0]);
                bytes += static_cast<double>(rec->payload.size());
                ++count;
                if (++k == order.size()) k = 0;
              }
            } else {
              // Passes over this thread's contiguous share until the time is up.
              const int64_t begin = records * t / threads, end = records * (t + 1) / threads;
              while (status[t].ok() && begin < end) {
                Status s = reader->Scan(begin, end, [&](const dataset::RecordView& rec) {
                  sink += static_cast<uint8_t>(rec.payload[0]);
                  bytes += static_cast<double>(rec.payload.size());
                  ++count;
                  return time_to_stop() ? time_up : OkStatus();
                });
                if (s == time_up) break;
                status[t] = s;
              }
            }
            done[t] = count;
            touched[t] = bytes + static_cast<double>(sink & 1);
          });
        }
        for (auto& th : pool) th.join();
      });
      for (const auto& s : status) STOKE_RETURN_IF_ERROR(s);
      int64_t total = 0;
      double total_bytes = 0;
      for (int t = 0; t < threads; ++t) {
        total += done[t];
        total_bytes += touched[t];
      }
      if (r > 0) {
        rates.push_back(static_cast<double>(total) / secs);
        mbs.push_back(total_bytes / secs / 1e6);
      }
    }
    return Figure{Median(rates), Median(mbs)};
  };

  nlohmann::json j = {{"machine", MachineJson(n)},
                      {"data", o.data.string()},
                      {"records", records},
                      {"payload_bytes", bytes_per_pass},
                      {"repeats", o.repeats},
                      {"seconds_per_run", seconds}};
  std::string t = fmt::format(
      "stoke bench read: {} records ({}) from {}, median of {} runs of ~{:g} s, records cached in memory\n"
      "machine: {}, {} cores, {}\n"
      "  view: the record found by key, its header parsed and one byte of each of its 4 KiB pages touched\n"
      "        (the fault guard); the payload is handed out as a zero-copy view into the map, not read\n"
      "        (MB/s counts the payload bytes handed out)\n"
      "  +CRC: the same, and every payload byte read and checked against the record's CRC-32C\n"
      "  {:<34} {:>14} {:>12}\n",
      records, HumanBytes(bytes_per_pass), o.data.string(), o.repeats, seconds, CpuModel(),
      std::thread::hardware_concurrency(), Today(), "access", "records/s", "MB/s");
  for (bool random : {false, true}) {
    for (bool crc : {false, true}) {
      for (int threads : n > 1 ? std::vector<int>{1, n} : std::vector<int>{1}) {
        const std::string name = fmt::format("{} {}, {} thread{}", random ? "random" : "sequential",
                                             crc ? "+CRC" : "view", threads, threads > 1 ? "s" : "");
        STOKE_ASSIGN_OR_RETURN(Figure f, measure(name, threads, crc, random));
        t += fmt::format("  {:<34} {:>14.0f} {:>12.1f}\n", name, f.rec_s, f.mb_s);
        j["results"][name] = {{"records_s", f.rec_s}, {"mb_s", f.mb_s}};
      }
    }
  }
  return WithJson(o, j, std::move(t));
}

Result<std::string> BenchDecode(const BenchOptions& o, const fs::path& dataset_path) {
  STOKE_RETURN_IF_ERROR(CheckJsonOut(o, dataset_path));  // before the runs, not after them
  if (o.repeats < 1) return InvalidArgumentError("bench: --repeats must be >= 1");
  STOKE_ASSIGN_OR_RETURN(auto scratch, MakeScratch(o, dataset_path.empty()));
  STOKE_ASSIGN_OR_RETURN(const fs::path db, DatasetOrPack(o, dataset_path, scratch->dir / "bench_decode.lmdb"));
  STOKE_ASSIGN_OR_RETURN(dataset::Dataset ds, dataset::Dataset::Open(db));
  STOKE_ASSIGN_OR_RETURN(auto reader, ds.NewReader({.verify_crc = false}));
  STOKE_ASSIGN_OR_RETURN(const JpegRecords records, JpegViews(ds, reader));
  const auto& jpegs = records.views;  // views into the map
  // The restart index of each JPEG record, when it has one: region decodes use it as the loader does.
  const auto& indexes = records.restart;
  auto IndexOf = [&](size_t i) -> const decode::RestartIndex* {
    return indexes[i].entry_bytes != 0 ? &indexes[i] : nullptr;
  };
  const bool indexed = std::any_of(indexes.begin(), indexes.end(), [](const auto& x) { return x.entry_bytes != 0; });

  augment::UseCallerThreadsOnly();  // as the training pipeline runs it
  constexpr int kOut = 224;
  decode::JpegDecoder decoder;
  Image image;
  std::vector<uint8_t> slot(kOut * kOut * 3);  // one batch slot
  augment::RandomResizedCropOptions rrc;  // torchvision defaults, size 224, flip p=0.5
  Status failure;  // the first, naming its record
  auto note = [&](size_t i, const Status& s) {
    if (!s.ok() && failure.ok()) {
      failure = Status(s.code(), fmt::format("bench decode: {}: record {}: {}", db.string(), records.index[i], s.message()));
    }
  };
  // Plans are made from the header (as prefetch will), keyed by (seed, epoch, index), and snapped
  // to the DCT scale the region will be decoded at.
  struct Planned {
    augment::CropPlan plan;
    int scale;
  };
  auto plan_for = [&](size_t i, int64_t epoch) -> Result<Planned> {
    STOKE_ASSIGN_OR_RETURN(decode::JpegInfo info, decoder.ReadHeader(jpegs[i]));
    SplitMix64 rng = SampleRng(1, epoch, static_cast<int64_t>(i));
    augment::CropPlan plan = augment::PlanRandomResizedCrop(info.width, info.height, rrc, rng);
    const int d = prefetch::SnapToBestScale(plan, info.width, info.height, kOut, kOut);  // as the loader does
    return Planned{plan, d};
  };
  auto region_of = [](const augment::CropPlan& p) {
    return decode::Region{static_cast<int>(p.region.x), static_cast<int>(p.region.y),
                          static_cast<int>(p.region.width), static_cast<int>(p.region.height)};
  };
  struct Stage {
    const char* name;
    std::function<void(size_t, int64_t)> run;  // one image, one epoch
    std::vector<double> rates;
  };
  std::vector<Stage> stages = {
      {"full decode (strict, RGB)", [&](size_t i, int64_t) { note(i, decoder.Decode(jpegs[i], &image)); }, {}},
      {"scaled decode (whole image, >= 224)",
       [&](size_t i, int64_t) {
         auto info = decoder.ReadHeader(jpegs[i]);
         if (!info.ok()) return note(i, info.status());
         note(i, decoder.DecodeRegion(jpegs[i], {0, 0, info->width, info->height}, kOut, kOut, &image).status());
       }, {}},
      {"region decode (RandomResizedCrop)",
       [&](size_t i, int64_t epoch) {
         auto p = plan_for(i, epoch);
         if (!p.ok()) return note(i, p.status());
         note(i, decoder.DecodeRegion(jpegs[i], region_of(p->plan), kOut, kOut, &image, p->scale, IndexOf(i)).status());
       }, {}},
      {"whole sample (plan+region+resize+flip)",
       [&](size_t i, int64_t epoch) {
         auto p = plan_for(i, epoch);
         if (!p.ok()) return note(i, p.status());
         auto where = decoder.DecodeRegion(jpegs[i], region_of(p->plan), kOut, kOut, &image, p->scale, IndexOf(i));
         if (!where.ok()) return note(i, where.status());
         augment::ImageView view{image.pixels.data(), image.width, image.height, image.channels,
                                 image.row_bytes()};
         note(i, augment::ApplyPlan(view, {where->x, where->y, where->width, where->height}, p->plan, slot));
       }, {}},
  };
  // Every stage runs over the same images, as many as a full decode gets through in `seconds`
  // (cycling through the dataset when it is smaller; each pass is another epoch of crops).
  const double seconds = SecondsOr(o, 0.5);
  const auto all = static_cast<int64_t>(jpegs.size());
  BenchProgress progress("bench decode", static_cast<int>(stages.size()) * o.repeats);
  auto run_stage = [&](Stage& stage, int64_t count, int64_t run) {
    for (int64_t k = 0; k < count; ++k) stage.run(static_cast<size_t>(k % all), run * 1000 + k / all);
  };
  progress.Run(stages[0].name, 0, o.repeats);
  const int64_t warm = std::min<int64_t>(all, 32);
  const int64_t images =
      ItemsForSeconds(static_cast<double>(warm) / Time([&] { run_stage(stages[0], warm, 0); }), seconds, 20);
  for (int r = 0; r <= o.repeats; ++r) {  // r == 0 is a short warm-up
    for (auto& stage : stages) {
      progress.Run(stage.name, r, o.repeats);
      const int64_t count = r == 0 ? std::max<int64_t>(1, images / 4) : images;
      const double secs = Time([&] { run_stage(stage, count, r); });
      if (r > 0) stage.rates.push_back(static_cast<double>(count) / secs);
    }
    STOKE_RETURN_IF_ERROR(failure);
  }
  const double full = Median(stages[0].rates);
  nlohmann::json j = {{"machine", MachineJson(1)}, {"dataset", db.string()}, {"images", jpegs.size()},
                      {"images_per_run", images}, {"repeats", o.repeats}, {"seconds_per_run", seconds}};
  std::string t = fmt::format(
      "stoke bench decode: {} JPEG records{} of {}, 1 thread, median of {} runs of {} images (~{:g} s of full decode)\n"
      "machine: {}, {} cores, {}\n",
      jpegs.size(), indexed ? " (with restart indexes)" : "", dataset_path.empty() ? o.data.string() : db.string(), o.repeats, images, seconds, CpuModel(),
      std::thread::hardware_concurrency(), Today());
  for (const auto& stage : stages) {
    const double rate = Median(stage.rates);
    t += fmt::format("  {:<42} {:8.1f} img/s  {:.2f}x full decode\n", stage.name, rate, rate / full);
    j["results"][stage.name] = {{"img_s", rate}, {"vs_full_decode", rate / full}};
  }
  const double whole = Median(stages.back().rates) / full;
  t += fmt::format("  target: whole sample >= 1.15x full decode: {}\n", whole >= 1.15 ? "met" : "NOT met");
  return WithJson(o, j, std::move(t));
}

namespace {

double g_largest_rss_mib = 0;  // of the RssMiB() samples

// Resident set size now, from /proc/self/statm.
double RssMiB() {
  std::ifstream in("/proc/self/statm");
  long pages = 0, resident = 0;
  in >> pages >> resident;
  const double mib = static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1 << 20);
  g_largest_rss_mib = std::max(g_largest_rss_mib, mib);
  return mib;
}

// The kernel's high-water mark, which it updates only now and then: it read below the samples
// printed beside it. The larger of the two.
double PeakRssMiB() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return std::max(static_cast<double>(u.ru_maxrss) / 1024, g_largest_rss_mib);  // ru_maxrss: KiB on Linux
}

struct LoaderRun {
  double img_s = 0;           // over the timed part
  double wait_fraction = 0;   // consumer wait / elapsed, timed part
  std::vector<double> rss_mib;  // at the start of the timed part, then at each epoch end or quarter
  prefetch::LoaderStats stats;
};

// One loader run over `ds` on `threads` threads. With `epochs` > 1: that many epochs, the first
// untimed, RSS read at each epoch's end. With `epochs` 0: sized by time, a warm-up of
// seconds / 2 (at least one batch) and a timed part of `seconds`, RSS read at each quarter.
Result<LoaderRun> RunLoader(const dataset::Dataset& ds, int threads, const PipelineBenchOptions& p, int epochs,
                            double seconds) {
  prefetch::LoaderOptions o;
  o.sampler.seed = 1;
  o.batch_size = p.batch;
  o.ring_size = p.ring;
  o.threads = threads;
  o.epochs = epochs;  // 0: endless, stopped below
  o.device = prefetch::DeviceMode::kHost;
  STOKE_ASSIGN_OR_RETURN(auto loader, prefetch::Loader::Create(ds, o));
  LoaderRun run;
  // Rates are samples received over the time between receipts: with a consumer that takes no
  // time, consecutive receipts are one production period apart. The timed part starts at the
  // receipt that ends the warm-up.
  using Clock = std::chrono::steady_clock;
  auto secs_between = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  const Clock::time_point begin = Clock::now();
  Clock::time_point timed_from{}, last_receipt = begin;
  bool timing = false;
  // The consumer's wait is counted over the same receipts as the samples: from the wait of the
  // first timed receipt (taken before its Next(), which the timed span holds) to that of the last
  // (the wait for the end of the run comes after it).
  double wait_at_timed = 0, wait_before_next = 0, wait_at_receipt = 0;
  int64_t timed_samples = 0, epoch = 0;
  int quarter = 0;
  auto start_timing = [&] {
    timing = true;
    timed_from = last_receipt;
    wait_at_timed = wait_before_next;
    run.rss_mib.push_back(RssMiB());
  };
  for (;;) {
    wait_before_next = loader->stats().consumer_wait_s;
    STOKE_ASSIGN_OR_RETURN(prefetch::BatchLease lease, loader->Next());
    const auto now = Clock::now();
    const double wait_now = loader->stats().consumer_wait_s;
    if (epochs > 0) {
      if (!lease || lease->epoch != epoch) {  // `epoch` ended with the previous receipt
        if (timing) run.rss_mib.push_back(RssMiB());
        if (!timing) start_timing();
        if (!lease) break;
        epoch = lease->epoch;
      }
    } else {
      if (!lease) break;
      if (!timing && secs_between(begin, now) >= seconds / 2 && last_receipt != begin) start_timing();
      if (timing) {
        const double t = secs_between(timed_from, now);
        if (t >= seconds * (quarter + 1) / 4) {
          ++quarter;
          run.rss_mib.push_back(RssMiB());
        }
        if (quarter >= 4) {
          timed_samples += lease->size;
          last_receipt = now;
          wait_at_receipt = wait_now;
          break;
        }
      }
    }
    if (timing) timed_samples += lease->size;
    last_receipt = now;
    wait_at_receipt = wait_now;
  }
  loader->Stop();
  run.stats = loader->stats();
  const double secs = secs_between(timed_from, last_receipt);
  if (timing && secs > 0) {
    run.img_s = static_cast<double>(timed_samples) / secs;
    run.wait_fraction = std::min(1.0, (wait_at_receipt - wait_at_timed) / secs);
  } else {
    run.img_s = run.stats.images_per_s;
    run.wait_fraction = run.stats.elapsed_s > 0 ? run.stats.consumer_wait_s / run.stats.elapsed_s : 0;
  }
  return run;
}

// Plain TurboJPEG full decode of `count` JPEGs (cycling through them) on `threads` threads: the
// images decoded per second (a JPEG TurboJPEG refuses is timed but not counted) and how many failed.
struct DecodeRate {
  double img_s = 0;
  int64_t failed = 0;
};
DecodeRate TurboJpegRate(const std::vector<std::span<const std::byte>>& jpegs, int threads, int64_t count) {
  std::vector<std::thread> pool;
  std::atomic<int64_t> next{0}, failed{0};
  const double secs = Time([&] {
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&] {
        TjHandle tj(tjInitDecompress());
        std::vector<unsigned char> rgb;
        for (int64_t i; (i = next.fetch_add(1)) < count;) {
          if (!TurboJpegFullDecode(tj.get(), jpegs[static_cast<size_t>(i) % jpegs.size()], rgb)) {
            failed.fetch_add(1, std::memory_order_relaxed);
          }
        }
      });
    }
    for (auto& th : pool) th.join();
  });
  return {static_cast<double>(count - failed.load()) / secs, failed.load()};
}

}  // namespace

namespace {

// Bytes this process has caused to be read from storage (page faults included), from /proc/self/io.
int64_t StorageReadBytes() {
  std::ifstream in("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (in >> key >> value) {
    if (key == "read_bytes:") return value;
  }
  return -1;
}

// Drops the data file's pages from the page cache (no root needed; mapped pages stay).
void EvictFile(const fs::path& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

Result<std::string> BenchStorage(const BenchOptions& o, const fs::path& db, const PipelineBenchOptions& p) {
  STOKE_ASSIGN_OR_RETURN(auto mode, dataset::ParseShuffleMode(p.shuffle));
  const int n = ThreadsOrCores(o.threads);
  const int epochs = p.epochs > 0 ? p.epochs : 1;
  BenchProgress progress("bench pipeline (storage)", o.repeats);
  std::vector<double> rates, bytes_per_image, waits, lookups;
  prefetch::LoaderStats last;
  int64_t records = 0;
  double mean_record = 0;
  for (int r = 1; r <= o.repeats; ++r) {
    // Opened afresh each run: the records table's pages count as reads too.
    STOKE_ASSIGN_OR_RETURN(dataset::Dataset ds, dataset::Dataset::Open(db));
    records = ds.size();
    mean_record = static_cast<double>(ds.manifest().payload_bytes) / static_cast<double>(std::max<int64_t>(1, records));
    if (p.cold) EvictFile(ds.data_file());
    progress.Run(fmt::format("{} shuffle", p.shuffle), r, o.repeats);
    prefetch::LoaderOptions lo;
    lo.sampler.mode = mode;
    lo.sampler.seed = static_cast<uint64_t>(r);
    if (p.block_size > 0) lo.sampler.block_size = p.block_size;
    if (p.window_blocks > 0) lo.sampler.window_blocks = p.window_blocks;
    lo.batch_size = p.batch;
    lo.ring_size = p.ring;
    lo.threads = n;
    lo.epochs = epochs;
    lo.device = prefetch::DeviceMode::kHost;
    lo.storage.enabled = p.memory_mb != 0;
    if (p.memory_mb > 0) lo.storage.memory_bytes = p.memory_mb << 20;
    lo.storage.io_threads = p.io_threads;
    const int64_t read0 = StorageReadBytes();
    const auto t0 = std::chrono::steady_clock::now();
    STOKE_ASSIGN_OR_RETURN(auto loader, prefetch::Loader::Create(ds, lo));
    int64_t samples = 0;
    const Deadline cap = o.seconds > 0 ? Deadline(o.seconds) : Deadline::Never();
    for (;;) {
      STOKE_ASSIGN_OR_RETURN(prefetch::BatchLease lease, loader->Next());
      if (!lease) break;
      samples += lease->size;
      if (cap.Passed()) break;  // --seconds caps a run that would take too long (a slow order)
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    last = loader->stats();
    loader.reset();
    const int64_t read = StorageReadBytes() - read0;
    rates.push_back(static_cast<double>(samples) / secs);
    bytes_per_image.push_back(static_cast<double>(read) / static_cast<double>(std::max<int64_t>(1, samples)));
    // read_s: each record's lookup and CRC check, plus (with the read-ahead) the waits for its reads.
    const double wait_s = last.storage_stage ? last.storage.wait_s : 0;
    waits.push_back(wait_s / n / secs);
    lookups.push_back(std::max(0.0, last.read_s - wait_s) / n / secs);
  }
  const double rate = Median(rates), per_image = Median(bytes_per_image), wait = Median(waits),
               lookup = Median(lookups);
  nlohmann::json j = {{"machine", MachineJson(n)}, {"dataset", db.string()},  {"records", records},
                      {"shuffle", p.shuffle},      {"epochs", epochs},         {"batch", p.batch},
                      {"memory_mb", p.memory_mb},  {"cold", p.cold},           {"repeats", o.repeats}};
  j["results"] = {{"img_s", rate},
                  {"img_s_runs", rates},
                  {"storage_bytes_per_image", per_image},
                  {"mean_record_bytes", mean_record},
                  {"read_amplification", mean_record > 0 ? per_image / mean_record : 0},
                  {"read_wait_fraction", wait},
                  {"lookup_crc_fraction", lookup},
                  {"peak_rss_mib", PeakRssMiB()}};
  std::string t = fmt::format(
      "stoke bench pipeline (storage): {} ({} records, {:.0f} KB mean), {} shuffle, {} epoch{} per run timed from "
      "the loader's creation{}{}, {} threads, median of {} runs\n"
      "machine: {}, {} cores, {}\n",
      db.string(), records, mean_record / 1024, p.shuffle, epochs, epochs > 1 ? "s" : "",
      p.cold ? ", page cache evicted before each" : "",
      o.seconds > 0 ? fmt::format(" (at most {:g} s)", o.seconds) : "", n, o.repeats, CpuModel(),
      std::thread::hardware_concurrency(),
      Today());
  t += fmt::format("  loader                              {:9.1f} img/s   runs: {:.0f}\n", rate, fmt::join(rates, ", "));
  t += fmt::format("  read from storage per image         {:9.1f} KB  ({:.2f}x the mean record)\n", per_image / 1024,
                   mean_record > 0 ? per_image / mean_record : 0);
  if (last.storage_stage) {
    t += fmt::format("  decoders waiting for reads          {:9.1f}% of the time\n", 100 * wait);
  }
  t += fmt::format("  record lookup + CRC check{}{:9.1f}% of the time\n",
                   last.storage_stage ? "           " : " (+ faults)", 100 * lookup);
  if (last.storage_stage) {
    const auto& s = last.storage;
    j["results"]["storage"] = {{"bytes_read", s.bytes_read},       {"read_calls", s.read_calls},
                               {"records_buffered", s.records_buffered}, {"records_mapped", s.records_mapped},
                               {"records_direct", s.records_direct},     {"peak_held_bytes", s.peak_held_bytes},
                               {"budget_bytes", s.budget_bytes},         {"segment_positions", s.segment_positions},
                               {"io_threads", s.io_threads},             {"drops_cache", s.drops_cache}};
    t += fmt::format(
        "  read-ahead (last run): {} records from its buffers, {} from the page cache, {} through the map; {} reads, "
        "{:.1f} MB; segments of {} samples, {} I/O threads, peak {:.1f} of {:.1f} MB{}\n",
        s.records_buffered, s.records_mapped, s.records_direct, s.read_calls, static_cast<double>(s.bytes_read) / 1e6,
        s.segment_positions, s.io_threads, static_cast<double>(s.peak_held_bytes) / (1 << 20),
        static_cast<double>(s.budget_bytes) / (1 << 20), s.drops_cache ? ", ranges dropped from the page cache" : "");
  } else {
    t += "  read-ahead: off (decoders read each record through the map)\n";
  }
  t += fmt::format("  peak RSS {:.1f} MiB\n", PeakRssMiB());
  return WithJson(o, j, std::move(t));
}

}  // namespace

Result<std::string> BenchPipeline(const BenchOptions& o, const fs::path& dataset_path,
                                  const PipelineBenchOptions& p) {
  STOKE_RETURN_IF_ERROR(CheckJsonOut(o, dataset_path));  // before the runs, not after them
  if (o.repeats < 1) return InvalidArgumentError("bench: --repeats must be >= 1");
  if (!p.shuffle.empty()) {
    if (p.batch < 1) return InvalidArgumentError("bench pipeline: --batch must be >= 1");
    if (p.shuffle != "block" && (p.block_size > 0 || p.window_blocks > 0)) {
      // Taken and ignored, the run measured another access pattern than the one asked for.
      return InvalidArgumentError(fmt::format(
          "bench pipeline: --block-size and --window-blocks shape block shuffle; with --shuffle {} they would be "
          "ignored (give --shuffle block, or leave them out)", p.shuffle));
    }
    STOKE_ASSIGN_OR_RETURN(auto scratch, MakeScratch(o, dataset_path.empty()));
    STOKE_ASSIGN_OR_RETURN(const fs::path db, DatasetOrPack(o, dataset_path, scratch->dir / "bench_storage.lmdb"));
    return BenchStorage(o, db, p);
  }
  if (p.memory_mb >= 0 || p.block_size > 0 || p.window_blocks > 0 || p.io_threads > 0 || p.cold) {
    return InvalidArgumentError(
        "bench pipeline: --memory-mb, --block-size, --window-blocks, --io-threads and --cold measure storage: "
        "they need --shuffle full|block|sequential");
  }
  if (p.epochs == 1 || p.epochs < 0) {
    return InvalidArgumentError("bench pipeline: --epochs must be 0 (sized by --seconds) or >= 2 (the first is a warm-up)");
  }
  if (p.batch < 1) return InvalidArgumentError("bench pipeline: --batch must be >= 1");
  const int n = ThreadsOrCores(o.threads);
  const double seconds = SecondsOr(o, 2.0);
  STOKE_ASSIGN_OR_RETURN(auto scratch, MakeScratch(o, dataset_path.empty()));
  BenchProgress progress("bench pipeline", (n > 1 ? 3 : 2) * o.repeats);
  if (dataset_path.empty()) progress.Note("packing the images");
  STOKE_ASSIGN_OR_RETURN(const fs::path db, DatasetOrPack(o, dataset_path, scratch->dir / "bench_pipeline.lmdb"));
  STOKE_ASSIGN_OR_RETURN(dataset::Dataset ds, dataset::Dataset::Open(db));
  STOKE_ASSIGN_OR_RETURN(auto reader, ds.NewReader({.verify_crc = false}));
  STOKE_ASSIGN_OR_RETURN(const JpegRecords records, JpegViews(ds, reader));
  const auto& jpegs = records.views;  // for the TurboJPEG runs

  // The TurboJPEG yardstick decodes as many images as it gets through in `seconds`, from a short
  // warm-up's rate (which also pulls the records into the page cache).
  const std::string tj_name = fmt::format("TurboJPEG full decode, {} threads", n);
  progress.Run(tj_name, 0, o.repeats);
  const auto all = static_cast<int64_t>(jpegs.size());
  const double warm_rate = std::max(1.0, TurboJpegRate(jpegs, n, std::min<int64_t>(all, 64 * n)).img_s);
  const int64_t tj_count = ItemsForSeconds(warm_rate, seconds, 8 * n);
  // Interleaved repeats, so that the machine's drift hits every figure alike.
  std::vector<double> tj_n, loader_n, loader_1, wait_n;
  int64_t tj_failed = 0;
  LoaderRun last_n;
  const std::string loader_name = fmt::format("loader, {} threads", n);
  for (int r = 1; r <= o.repeats; ++r) {
    progress.Run(tj_name, r, o.repeats);
    const DecodeRate tj_run = TurboJpegRate(jpegs, n, tj_count);
    tj_n.push_back(tj_run.img_s);
    tj_failed = std::max(tj_failed, tj_run.failed);
    progress.Run(loader_name, r, o.repeats);
    STOKE_ASSIGN_OR_RETURN(LoaderRun run, RunLoader(ds, n, p, p.epochs, seconds));
    loader_n.push_back(run.img_s);
    wait_n.push_back(run.wait_fraction);
    last_n = run;
    if (n > 1) {
      progress.Run("loader, 1 thread", r, o.repeats);
      STOKE_ASSIGN_OR_RETURN(LoaderRun one, RunLoader(ds, 1, p, p.epochs > 0 ? std::min(p.epochs, 3) : 0, seconds));
      loader_1.push_back(one.img_s);
    }
  }
  const double tj = Median(tj_n), ld = Median(loader_n);
  const double ld1 = n > 1 ? Median(loader_1) : ld;
  const double efficiency = ld / (n * ld1);
  // RSS over the timed part of the last N-thread run, relative to its start.
  const auto& rss = last_n.rss_mib;
  double drift = 0;
  for (size_t e = 1; e < rss.size(); ++e) drift = std::max(drift, std::abs(rss[e] / rss[0] - 1));
  const std::string sizing = p.epochs > 0 ? fmt::format("{} epochs per run (first untimed)", p.epochs)
                                          : fmt::format("runs of ~{:g} s after a warm-up of ~{:g} s", seconds, seconds / 2);

  nlohmann::json j = {{"machine", MachineJson(n)}, {"dataset", db.string()}, {"images", jpegs.size()},
                      {"batch", p.batch}, {"epochs", p.epochs}, {"seconds_per_run", seconds}, {"ring", p.ring},
                      {"repeats", o.repeats}};
  j["results"] = {{"loader_img_s", ld},
                  {"loader_img_s_per_thread", ld / n},
                  {"loader_1_thread_img_s", ld1},
                  {"parallel_efficiency", efficiency},
                  {"turbojpeg_full_decode_img_s", tj},
                  {"turbojpeg_failed_per_run", tj_failed},
                  {"loader_bad_records", last_n.stats.bad_records},
                  {"vs_turbojpeg", ld / tj},
                  {"consumer_wait_fraction", Median(wait_n)},
                  {"rss_mib", rss},
                  {"rss_max_drift", drift},
                  {"peak_rss_mib", PeakRssMiB()},
                  {"stage_s", {{"read", last_n.stats.read_s}, {"decode", last_n.stats.decode_s},
                               {"augment", last_n.stats.augment_s}}}};
  std::string t = fmt::format(
      "stoke bench pipeline: {} JPEG records of {}, batch {}, ring {}, {}, median of {} runs\n"
      "machine: {}, {} cores, {}\n"
      "  RandomResizedCrop 224 + flip -> uint8 HWC batches, {} threads\n",
      jpegs.size(), db.string(), p.batch, p.ring, sizing, o.repeats, CpuModel(), std::thread::hardware_concurrency(),
      Today(), n);
  t += fmt::format("  {:<44} {:9.1f} img/s  ({:.1f} per thread)\n", loader_name, ld, ld / n);
  if (n > 1) t += fmt::format("  {:<44} {:9.1f} img/s\n", "loader, 1 thread", ld1);
  t += fmt::format("  {:<44} {:9.1f} img/s  ({} images per run{})\n", tj_name, tj, tj_count,
                   tj_failed > 0 ? fmt::format(", {} failed and not counted", tj_failed) : std::string());
  if (last_n.stats.bad_records > 0) {
    t += fmt::format("  bad records: {} skipped by the loader (each replaced by another record, as in training)\n",
                     last_n.stats.bad_records);
  }
  t += fmt::format("  loader / TurboJPEG full decode: {:.2f}x (target >= 1.15x: {})\n", ld / tj,
                   ld / tj >= 1.15 ? "met" : "NOT met");
  if (n > 1) {
    t += fmt::format("  parallel efficiency 1 -> {} threads: {:.2f} (target >= 0.9: {})\n", n, efficiency,
                     efficiency >= 0.9 ? "met" : "NOT met");
  }
  t += fmt::format("  consumer wait: {:.1f}% of the time (a consumer that does nothing waits for every batch)\n",
                   100 * Median(wait_n));
  const double busy = last_n.stats.read_s + last_n.stats.decode_s + last_n.stats.augment_s;
  if (busy > 0) {
    t += fmt::format("  worker time: read {:.1f}%, plan + decode {:.1f}%, resize + flip {:.1f}%\n",
                     100 * last_n.stats.read_s / busy, 100 * last_n.stats.decode_s / busy,
                     100 * last_n.stats.augment_s / busy);
  }
  t += fmt::format("  RSS over the timed part ({}, MiB):", p.epochs > 0 ? "each epoch's end" : "each quarter");
  for (double r : rss) t += fmt::format(" {:.1f}", r);
  t += fmt::format("\n  RSS drift over the timed part: {:.2f}% (target <= 2%: {}); peak RSS {:.1f} MiB\n",
                   100 * drift, drift <= 0.02 ? "met" : "NOT met", PeakRssMiB());
  return WithJson(o, j, std::move(t));
}

}  // namespace stoke::bench
