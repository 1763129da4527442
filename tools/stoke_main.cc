// The stoke command line: one binary, one subcommand per job. Each subcommand only parses flags,
// calls one library function and prints its result.
#include <malloc.h>

#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "common/file_util.h"
#include "common/limits.h"
#include "common/logging.h"
#include "common/version.h"
#include "tools/bench/bench_commands.h"
#include "tools/inspect/inspect.h"
#include "tools/pack/packer.h"
#include "tools/demo/demo.h"
#include "tools/eval/eval.h"
#include "tools/synth/synth.h"
#include "dist/communicator.h"
#include "train/config.h"
#include "train/trainer.h"
#if STOKE_WITH_ONNX
#include "train/export.h"
#endif
#if STOKE_WITH_MONITOR
#include "tools/monitor/monitor.h"
#endif

namespace {

std::atomic<bool> g_stop{false};
std::atomic<int> g_stop_signal{0};  // the signal that set g_stop

// First Ctrl-C: finish the current transaction (pack) or step (train) and leave resumable state.
// Second: die.
void OnInterrupt(int sig) {
  g_stop_signal.store(sig);
  g_stop.store(true);
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
}

#if STOKE_WITH_ONNX
// A file that Ctrl-C or SIGTERM removes before the process ends (export's temporary file: the
// output itself is only ever renamed into place whole). Set before the handler is installed.
char g_remove_on_signal[4096] = {0};

void RemoveAndDie(int sig) {
  if (g_remove_on_signal[0] != '\0') ::unlink(g_remove_on_signal);  // async-signal-safe
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}
#endif

#if !STOKE_WITH_MONITOR
constexpr const char* kNoMonitor =
    "this build has no monitor (cpp-httplib or Chart.js was not found at build time: apt-get install "
    "libcpp-httplib-dev libjs-chart.js, then rebuild)";
#endif

// CLI11's PositiveNumber and NonNegativeNumber say "Value 0 not in range 0.000000 to 1.797...e+308"
// when refusing 0 or -1: these say what is expected.
CLI::Validator NumberAtLeast(double least, bool inclusive) {
  const std::string want = fmt::format("{} {}", inclusive ? ">=" : ">", least);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (end == text.c_str() || *end != '\0') return fmt::format("expected a number {}, not '{}'", want, text);
        if (!(inclusive ? v >= least : v > least)) return fmt::format("must be {}, not {}", want, text);
        return std::string();
      },
      "NUMBER " + want, "");
}
// A 64-bit integer option: CLI11 reads it as strtoll / strtoull do (base 0: hex and octal too,
// leading blanks skipped), and a number past the type's range came out as its largest value
// (`--extract 99999999999999999999` named record 9223372036854775807). Checked the same way.
CLI::Validator FitsIn64Bits(bool is_signed) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        errno = 0;
        if (is_signed) {
          (void)std::strtoll(text.c_str(), nullptr, 0);
        } else {
          (void)std::strtoull(text.c_str(), nullptr, 0);
        }
        if (errno != ERANGE) return std::string();
        return is_signed ? fmt::format("{} is too large (at most {})", text, std::numeric_limits<int64_t>::max())
                         : fmt::format("{} is too large (at most {})", text, std::numeric_limits<uint64_t>::max());
      },
      "", "");
}
const CLI::Validator kInt64 = FitsIn64Bits(true);
const CLI::Validator kUint64 = FitsIn64Bits(false);
const CLI::Validator kPositive = NumberAtLeast(0, false);
const CLI::Validator kNonNegative = NumberAtLeast(0, true);
CLI::Validator NumberAtMost(double most, const std::string& note) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        return std::strtod(text.c_str(), nullptr) <= most ? std::string()
                                                          : fmt::format("must be at most {}{}, not {}", most, note, text);
      },
      "", "");
}
// A thread count: 0 (every core) up to the bound every stage holds (a count past it once reached
// OpenMP before any check and ended `stoke eval` with SIGSEGV).
const CLI::Validator kThreads = NumberAtLeast(0, true) & NumberAtMost(stoke::kMaxThreads, " (0 = every core)");
// A bench run's duration: `inf` and the like ran for ever.
const CLI::Validator kBenchSeconds = NumberAtLeast(0, false) & NumberAtMost(3600, " seconds per run");
const CLI::Validator kBenchRepeats = kPositive & NumberAtMost(1000, " runs per figure");
// A path: an empty one (`--json ""`, a shell variable that was not set) read as "not given" and the
// output was silently not written.
CLI::Validator PathName(const char* what, const char* name) {
  return CLI::Validator(
      [=](std::string& v) { return v.empty() ? fmt::format("expected {}, got an empty string", what) : std::string(); },
      name, "");
}
const CLI::Validator kFileName = PathName("a file name", "FILE");
const CLI::Validator kFolderName = PathName("a folder name", "DIR");

int Fail(const stoke::Status& s) {
  std::fprintf(stderr, "stoke: %s\n", s.ToString().c_str());
  return 1;
}

// Fail, for a command a signal can stop: 128 + the signal (130 for Ctrl-C, 143 for SIGTERM), as
// shells report a command a signal ended, when one did: a script can tell "resume me" from a failure.
int FailOrStopped(const stoke::Status& s) {
  Fail(s);
  return g_stop.load() ? 128 + g_stop_signal.load() : 1;
}

int Run(int argc, char** argv) {
  // Image-sized buffers (100 KB - 10 MB) are allocated and freed per image on several threads.
  // glibc would serve each from a fresh mmap and trim freed heap back to the kernel, and the page
  // faults to map it in again cost ~5% of a pack. Keep such memory in the process instead.
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  CLI::App app{"stoke: pack image datasets into LMDB and feed them to GPUs fast"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("stoke ") + STOKE_VERSION + " (" + stoke::GitSha() + ")");
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Debug logging");

  // ---- pack
  stoke::pack::PackOptions pack;
  std::string encoding = "jpeg", on_error = "skip";
  bool no_paths = false, quiet = false;
  auto* pack_cmd = app.add_subcommand("pack", "Validate images and pack them into an LMDB dataset");
  pack_cmd->add_option("SRC", pack.source,
                       "Image folder tree (one sub-folder per class), or the root that --list "
                       "paths are relative to")
      ->required();
  pack_cmd->add_option("OUT", pack.output, "Output dataset directory (e.g. train.lmdb)")->required()->check(kFolderName);
  pack_cmd->add_option("--list", pack.list_file, "List file of 'relative/path label' lines")
      ->check(CLI::ExistingFile);
  pack_cmd->add_option("--threads", pack.threads, "Worker threads (0 = all cores)")
      ->check(kThreads);
  pack_cmd->add_option("--max-side", pack.max_side,
                       "Shrink images whose longer side exceeds N pixels (0 = keep)")
      ->check(kNonNegative);
  pack_cmd->add_option("--quality", pack.quality, "Re-encode every image at JPEG quality Q")
      ->check(CLI::Range(1, 100));
  pack_cmd->add_option("--encoding", encoding, "Payload: jpeg (compact) or raw (decoded pixels)")
      ->check(CLI::IsMember({"jpeg", "raw"}));
  pack_cmd->add_flag("--shuffle", pack.shuffle, "Write records in a seeded random order");
  pack_cmd->add_option("--seed", pack.seed, "Seed for --shuffle and --val-fraction")->check(kNonNegative & kUint64);
  auto* val_fraction_opt = pack_cmd->add_option("--val-fraction", pack.val_fraction,
                                                 "Hold out this fraction of each class as a validation dataset")
                               ->check(CLI::Range(0.0, 0.999999));
  pack_cmd->add_option("--val-output", pack.val_output,
                       "Validation dataset directory (default: OUT with _val)")
      ->check(kFolderName)
      ->needs(val_fraction_opt);
  pack_cmd->add_option("--on-error", on_error, "Bad inputs: skip (and report) or fail")
      ->check(CLI::IsMember({"skip", "fail"}));
  std::string validate = "coefficients";
  pack_cmd->add_option("--validate", validate,
                       "JPEGs stored as they are: 'coefficients' (every coefficient decoded "
                       "strictly, output at 1/8 scale; ~1.5x faster) or 'pixels' (a full-size "
                       "strict decode)")
      ->check(CLI::IsMember({"coefficients", "pixels"}));
  std::string index_mode = "restart";
  pack_cmd->add_option("--index", index_mode,
                       "JPEG records: 'restart' (transcoded losslessly with restart markers and an index of "
                       "them, so a crop decodes only its own rows and columns) or 'none' (the bytes as they are)")
      ->check(CLI::IsMember({"restart", "none"}));
  pack_cmd->add_option("--index-intervals", pack.index_intervals_per_row,
                       "Restart intervals per MCU row with --index restart (at least; a divisor of the row)")
      ->check(CLI::Range(1, 64));
  pack_cmd->add_option("--report", pack.report_file, "Write a JSON report of skipped inputs")->check(kFileName);
  pack_cmd->add_flag("--resume", pack.resume, "Continue an interrupted pack of the same inputs");
  pack_cmd->add_flag("--overwrite", pack.overwrite, "Replace existing outputs");
  pack_cmd->add_flag("--no-paths", no_paths, "Do not store source paths");
  pack_cmd->add_option("--commit-every", pack.commit_every, "Records per transaction")
      ->check(kPositive);
  pack_cmd->add_flag("-q,--quiet", quiet, "No progress line");

  // ---- inspect
  std::string inspect_path, extract_output;
  int64_t extract_index = -1;
  bool as_json = false;
  stoke::inspect::InspectOptions inspect;
  auto* inspect_cmd = app.add_subcommand("inspect", "Summarise, verify or extract from a dataset");
  inspect_cmd->add_option("DB", inspect_path, "Dataset directory")->required();
  inspect_cmd->add_flag("--verify", inspect.verify, "Check every CRC and decode every record");
  inspect_cmd->add_option("--threads", inspect.threads, "Verify threads (0 = all cores)")
      ->check(kThreads);
  inspect_cmd->add_flag("--json", as_json, "Machine-readable output");
  auto* extract_opt = inspect_cmd->add_option("--extract", extract_index,
                                              "Write record INDEX's image to --output: its JPEG (without the restart index), or a PGM/PPM for raw pixels")
                          ->check(kNonNegative & kInt64);
  inspect_cmd->add_option("--output", extract_output, "File for --extract")->check(kFileName)->needs(extract_opt);
  extract_opt->needs(inspect_cmd->get_option("--output"));
  // An extract writes one record and prints nothing to verify or as JSON: those flags would do nothing.
  extract_opt->excludes(inspect_cmd->get_option("--verify"))->excludes(inspect_cmd->get_option("--json"));

  // ---- bench
  auto* bench_cmd = app.add_subcommand("bench", "Measure throughput of each stage");
  bench_cmd->require_subcommand(1);
  stoke::bench::BenchOptions bench;
  auto add_common = [&](CLI::App* cmd, bool threads) {
    auto* data = cmd->add_option("--data", bench.data, "Image folder tree to measure on")
                     ->default_str("../shared/data/imagenet_like");
    if (threads) {
      cmd->add_option("--threads", bench.threads, "Threads for the N-thread runs (0 = all cores)")->check(kThreads);
    }
    cmd->add_option("--repeats", bench.repeats, "Timed runs per figure (median reported)")
        ->check(kBenchRepeats);
    cmd->add_option("--seconds", bench.seconds,
                    "Duration of each timed run (default: pack 1, read 0.5, decode 0.5, pipeline 2)")
        ->check(kBenchSeconds);
    auto* work = cmd->add_option("--work-dir", bench.work_dir,
                                 "Where the scratch folder for packed datasets goes (removed at the end)")
                     ->check(kFolderName);
    cmd->add_option("--json", bench.json_out, "Also write the results as JSON here")->check(kFileName);
    // A given dataset is measured as it is: nothing is packed from --data, nothing made in --work-dir.
    if (auto* db = cmd->get_option_no_throw("DB")) db->excludes(data)->excludes(work);
  };
  auto* bench_pack = bench_cmd->add_subcommand("pack", "Pack with full validation, 1 and N threads");
  add_common(bench_pack, true);
  auto* bench_read = bench_cmd->add_subcommand("read", "Read packed records: sequential and random");
  add_common(bench_read, true);
  std::string bench_db;
  auto* bench_decode = bench_cmd->add_subcommand(
      "decode", "Full, scaled and region decode, and the whole training sample, on one core");
  bench_decode->add_option("DB", bench_db, "Packed dataset (default: pack --data first)");
  add_common(bench_decode, false);  // one core
  stoke::bench::PipelineBenchOptions pipeline;
  auto* bench_pipeline = bench_cmd->add_subcommand(
      "pipeline", "The loader end to end on N threads, beside TurboJPEG full decode");
  bench_pipeline->add_option("DB", bench_db, "Packed dataset (default: pack --data first)");
  bench_pipeline->add_option("--batch", pipeline.batch, "Samples per batch")->check(kPositive);
  bench_pipeline->add_option("--epochs", pipeline.epochs,
                             "Epochs per loader run, the first untimed (default: runs sized by --seconds); "
                             "storage runs (--shuffle): epochs per run, all timed (default 1)")
      ->check(CLI::Range(0, 1000000));
  bench_pipeline->add_option("--ring", pipeline.ring, "Batch buffers in the ring")->check(CLI::Range(2, 1024));
  bench_pipeline->add_option("--shuffle", pipeline.shuffle,
                             "Measure storage instead: the loader alone in this order, with bytes read per image")
      ->check(CLI::IsMember({"full", "block", "sequential"}));
  bench_pipeline->add_option("--memory-mb", pipeline.memory_mb,
                             "Storage run: read-ahead budget in MB (0: no read-ahead, as data.io.read_ahead: false; "
                             "default: sized from the order)")
      ->check(kNonNegative & NumberAtMost(double(int64_t{1} << 30), " MB"));
  bench_pipeline->add_option("--block-size", pipeline.block_size, "Storage run, block shuffle: records per block")
      ->check(kPositive);
  bench_pipeline->add_option("--window-blocks", pipeline.window_blocks, "Storage run, block shuffle: blocks per window")
      ->check(kPositive);
  bench_pipeline->add_option("--io-threads", pipeline.io_threads, "Storage run: reads in flight")
      ->check(kPositive & NumberAtMost(1024, " (data.io.threads' limit)"));
  bench_pipeline->add_flag("--cold", pipeline.cold, "Storage run: evict the dataset from the page cache before each run");
  add_common(bench_pipeline, true);

  stoke::bench::TrainBenchOptions train_bench;
  std::string train_bench_config;
  auto* bench_train = bench_cmd->add_subcommand(
      "train", "Training throughput of a config's model: compute alone and fed by the loader");
  bench_train->add_option("--config", train_bench_config, "Run config (YAML)")->required();
  bench_train->add_option("--steps", train_bench.steps, "Timed steps per run (default: as many as fit in --seconds)")
      ->check(kPositive);
  bench_train->add_option("--seconds", bench.seconds, "Duration of each timed run when --steps is not given (default 2)")
      ->check(kBenchSeconds);
  bench_train->add_option("--warmup", train_bench.warmup,
                          "Untimed steps before each run (at least 1: the first steps build kernels)")
      ->check(kPositive & NumberAtMost(100000, " untimed steps per run"));
  std::string model_json;
  bench_train->add_option("--model-json", model_json, "Write the resolved model as JSON (for the PyTorch peer)")
      ->check(kFileName);
  bench_train->add_flag("--peer", train_bench.peer,
                        "Also run PyTorch's training step on the same model, batch and threads (on the GPU with autocast for the CUDA backend), and the ratio");
  bench_train->add_option("--python", train_bench.python, "Python with torch for --peer")
      ->default_str("/usr/bin/python3")
      ->check(kFileName);
  std::string peer_script;
  bench_train->add_option("--peer-script", peer_script, "The peer (default: bench/peers/torch_train.py of the source tree)")
      ->check(kFileName);
  bench_train->add_option("--threads", bench.threads, "Compute and loader threads (0 or unset: the config's)")
      ->check(NumberAtLeast(0, true) & NumberAtMost(stoke::kMaxThreads, " (0 = the config's)"));
  bench_train->add_option("--repeats", bench.repeats, "Timed runs (median reported)")->check(kBenchRepeats);
  bench_train->add_option("--timeline", train_bench.timeline,
                          "After the runs, time N more end-to-end steps and their batches' copies on the GPU's clock "
                          "(CUDA backend): which step each copy overlapped, and the device's idle time between steps")
      ->check(kNonNegative);
  bench_train->add_option("--json", bench.json_out, "Also write the results as JSON here")->check(kFileName);

  // ---- synth
  std::string synth_dir;
  stoke::synth::SynthOptions synth;
  auto* synth_cmd = app.add_subcommand(
      "synth", "Write a labelled folder tree of synthetic JPEGs (the built-in example)");
  synth_cmd->add_option("OUT_DIR", synth_dir, "Folder to create")->required();
  synth_cmd->add_option("--classes", synth.classes, "Number of classes")->check(kPositive);
  synth_cmd->add_option("--per-class", synth.per_class, "Images per class")
      ->check(kPositive);
  synth_cmd->add_option("--seed", synth.seed, "Seed")->check(kNonNegative & kUint64);
  std::string synth_style = "stripes";
  synth_cmd->add_option("--style", synth_style, "stripes (colour + stripe angle per class) or shapes (a shape per class)")
      ->check(CLI::IsMember({"stripes", "shapes"}));

  // ---- train
  std::string train_config, resume;
  bool print_config = false, train_quiet = false;
  stoke::train::TrainRunOptions train_run;
  auto* train_cmd = app.add_subcommand("train", "Train a model from a YAML config, fed by the loader");
  train_cmd->add_option("--config", train_config, "Run config (YAML); see configs/")->required();
  train_cmd->add_flag("--print-config", print_config, "Print the resolved config (every default filled in) and exit");
  train_cmd->add_option("--resume", resume, "Continue a run: 'latest' (newest checkpoint in run_dir) or a checkpoint file")
      ->expected(0, 1)
      ->default_str("latest");
  train_cmd->add_option("--max-steps", train_run.max_steps, "Stop (with a checkpoint) at step N, counted from the run's start (a resumed run too: N past its checkpoint's step)")
      ->check(kPositive);
  train_cmd->add_flag("-q,--quiet", train_quiet, "No progress line");
  std::string train_monitor;
  train_cmd->add_option("--monitor", train_monitor,
                        "Serve the live monitor page of this run on [HOST:]PORT while it trains (HOST: 127.0.0.1)");
  // --print-config only prints: the flags of a run would be accepted unchecked and unused.
  for (const char* run_flag : {"--resume", "--max-steps", "--monitor"}) {
    train_cmd->get_option("--print-config")->excludes(train_cmd->get_option(run_flag));
  }

  // ---- monitor
  std::vector<std::string> monitor_runs;
  std::string monitor_host = "127.0.0.1";
  int monitor_port = 8080, monitor_poll_ms = 1000;
  auto* monitor_cmd = app.add_subcommand(
      "monitor", "Serve a live page of one or more runs: curves, epoch/step/ETA, config, dataset, skipped records");
  monitor_cmd->add_option("RUN_DIR", monitor_runs, "Run directories (run_dir of their configs)")->required();
  monitor_cmd->add_option("--port", monitor_port, "Port (0: any free port)")->check(CLI::Range(0, 65535))->default_str("8080");
  monitor_cmd->add_option("--host", monitor_host,
                          "Address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the network)")
      ->default_str("127.0.0.1");
  monitor_cmd->add_option("--poll-ms", monitor_poll_ms, "How often the page asks for new metrics")
      ->check(CLI::Range(100, 600000));

  // ---- demo
  stoke::demo::DemoOptions demo;
  std::string demo_dir = demo.dir.string();
  auto* demo_cmd = app.add_subcommand(
      "demo", "Generate a labelled image set, pack it, train a small CNN on it and report accuracy");
  demo_cmd->add_option("--dir", demo_dir, "Working folder: new, empty, or an earlier demo's (its outputs are replaced)")->default_str(demo_dir);
  demo_cmd->add_option("--epochs", demo.epochs, "Training epochs")->check(kPositive);
  demo_cmd->add_option("--per-class", demo.per_class, "Images per class")->check(CLI::Range(20, 100000));
  demo_cmd->add_option("--threads", demo.threads, "Threads (0 = all cores)")->check(kThreads);

  // ---- export, eval, predict: a trained model, from its run directory or a checkpoint file
  stoke::train::TrainedModelSource trained;
  std::string trained_run, trained_checkpoint, trained_config;
  auto add_model = [&](CLI::App* cmd) {
    auto* run = cmd->add_option("--run", trained_run, "Run directory (its newest checkpoint)");
    auto* ck = cmd->add_option("--checkpoint", trained_checkpoint, "Checkpoint file")->check(CLI::ExistingFile);
    run->excludes(ck);
    cmd->add_option("--config", trained_config,
                    "Config (YAML) describing the model instead of the one stored in the checkpoint")
        ->check(CLI::ExistingFile);
  };
  std::string export_output;
  bool export_uint8 = false, export_no_fold = false;
  auto* export_cmd = app.add_subcommand("export", "Write a trained model as ONNX (opset 17) for inference engines");
  add_model(export_cmd);
  export_cmd->add_option("-o,--output", export_output, "ONNX file to write")
      ->required()
      ->check(kFileName);
  export_cmd->add_flag("--uint8-input", export_uint8,
                       "Take uint8 N x H x W x 3 RGB pixels and normalise inside the graph (default: float32 "
                       "N x 3 x H x W, already normalised)");
  export_cmd->add_flag("--no-fold", export_no_fold, "Keep batch norm as BatchNormalization nodes");

  stoke::evaluate::EvalOptions eval;
  bool eval_json = false;
  size_t eval_max_classes = 20;
  auto* eval_cmd = app.add_subcommand("eval", "Top-1, top-5, loss and per-class confusion of a trained model on a dataset");
  add_model(eval_cmd);
  eval_cmd->add_option("--data", eval.data, "Packed dataset to evaluate on")->required();
  eval_cmd->add_option("--batch", eval.batch, "Samples per batch (default: the config's, at most 64 on the CPU)")->check(kPositive);
  eval_cmd->add_option("--threads", eval.threads, "Threads (0 = all cores)")->check(kThreads);
  eval_cmd->add_option("--backend", eval.backend, "Backend")->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  eval_cmd->add_option("--classes", eval_max_classes, "Classes listed, least accurate first (0 = all)")
      ->check(kNonNegative);
  eval_cmd->add_option("--max-skip-fraction", eval.max_skip_fraction,
                       "Fraction of the records that may be bad, each left out (default: the config's "
                       "data.max_skip_fraction)")
      ->check(CLI::Range(0.0, 1.0));
  eval_cmd->add_flag("--json", eval_json, "Machine-readable output");

  stoke::evaluate::PredictOptions predict;
  bool predict_json = false;
  auto* predict_cmd = app.add_subcommand("predict", "Top classes of image files, through the validation crop");
  add_model(predict_cmd);
  predict_cmd->add_option("IMAGES", predict.inputs, "Image files or folders")->required();
  predict_cmd->add_option("-k,--top", predict.top_k, "Classes per image")->check(kPositive);
  predict_cmd->add_option("--batch", predict.batch, "Images per batch")->check(kPositive);
  predict_cmd->add_option("--threads", predict.threads, "Threads (0 = all cores)")->check(kThreads);
  predict_cmd->add_option("--backend", predict.backend, "Backend")->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  predict_cmd->add_flag("--json", predict_json, "Machine-readable output");

  CLI11_PARSE(app, argc, argv);
  stoke::InitLogging(verbose ? stoke::LogLevel::kDebug : stoke::LogLevel::kInfo);

  if (pack_cmd->parsed()) {
    pack.encoding = encoding == "raw" ? stoke::dataset::PayloadEncoding::kRaw
                                      : stoke::dataset::PayloadEncoding::kJpeg;
    pack.on_error = on_error == "fail" ? stoke::pack::OnError::kFail : stoke::pack::OnError::kSkip;
    pack.store_paths = !no_paths;
    pack.validate = validate == "pixels" ? stoke::pack::ValidateMode::kPixels
                                         : stoke::pack::ValidateMode::kCoefficients;
    pack.progress = !quiet;
    pack.index = index_mode == "none" ? stoke::pack::IndexMode::kNone : stoke::pack::IndexMode::kRestart;
    pack.stop = &g_stop;
    std::signal(SIGINT, OnInterrupt);
    std::signal(SIGTERM, OnInterrupt);
    auto summary = stoke::pack::Pack(pack);
    if (!summary.ok()) return FailOrStopped(summary.status());
    std::fputs(stoke::pack::FormatSummary(*summary).c_str(), stdout);
    int64_t records = 0;
    for (const auto& split : summary->splits) records += split.records;
    if (summary->inputs > 0 && records == 0) {
      STOKE_LOG(WARN, "pack: none of the {} inputs could be packed (each is listed as skipped); {} holds no record",
                summary->inputs, pack.output.string());
    }
    return 0;
  }
  if (inspect_cmd->parsed()) {
    if (extract_index >= 0) {
      stoke::Status s = stoke::inspect::ExtractRecord(inspect_path, extract_index, extract_output);
      if (!s.ok()) return Fail(s);
      std::printf("record %lld -> %s\n", static_cast<long long>(extract_index),
                  extract_output.c_str());
      return 0;
    }
    inspect.progress = !as_json;
    auto report = stoke::inspect::Inspect(inspect_path, inspect);
    if (!report.ok()) return Fail(report.status());
    if (as_json) {
      std::cout << stoke::inspect::ReportJson(*report).dump(
                       2, ' ', false, nlohmann::json::error_handler_t::replace)
                << "\n";
    } else {
      std::cout << stoke::inspect::FormatReport(*report);
    }
    return report->intact() ? 0 : 3;  // 3: bad records, or a manifest that disagrees with them
  }
  if (train_cmd->parsed()) {
    if (print_config) {
      auto config = stoke::train::LoadConfig(train_config);
      if (!config.ok()) return Fail(config.status());
      std::fputs(stoke::train::ConfigToYaml(*config).c_str(), stdout);
      return 0;
    }
    // mpirun forwards SIGUSR1 to every rank (and kills on SIGINT): `kill -USR1 <mpirun>` stops a
    // data-parallel run with a checkpoint, like Ctrl-C on one process. Caught from the start, not
    // from after MPI_Init (which can take seconds on many hosts): until then its default action
    // would kill the rank, and with it the job. The flag is read before every step.
    std::signal(SIGINT, OnInterrupt);
    std::signal(SIGTERM, OnInterrupt);
    std::signal(SIGUSR1, OnInterrupt);
    // Under mpirun or srun: one rank of a data-parallel run (a world of one otherwise). Made before
    // the config is read, so that an error only some ranks meet (a file missing on one machine) is
    // agreed on and reported by rank 0, naming the rank; its timeout comes from the config after.
    auto comm = stoke::dist::Communicator::Create({});
    if (!comm.ok()) return Fail(comm.status());
    const int rank = (*comm)->rank(), world = (*comm)->size();
    // An error every rank holds (agreed on) is reported by rank 0, naming the rank it came from.
    auto fail_once = [&](const stoke::Status& s) {
      if (rank != 0) return 1;
      const bool named = world == 1 || s.message().rfind("rank ", 0) == 0;
      return Fail(named ? s : stoke::Status(s.code(), fmt::format("rank 0 ({}): {}", (*comm)->host(), s.message())));
    };
    // Every failure before training is agreed on: each rank learns it, rank 0 reports it once.
    auto agreed_or_fail = [&](const stoke::Status& local) -> stoke::Status {
      stoke::Status s = world > 1 ? (*comm)->Agree(local) : local;
      if (!s.ok()) fail_once(s);
      return s;
    };
    auto config = stoke::train::LoadConfig(train_config);
    if (!agreed_or_fail(config.status()).ok()) return 1;
    (*comm)->set_timeout_s(config->dist.timeout_s);
    if (train_cmd->get_option("--resume")->count() > 0) train_run.resume = resume.empty() ? "latest" : resume;
    train_run.progress = !train_quiet;
    train_run.stop = &g_stop;
    train_run.comm = comm->get();
    if (const char* p = std::getenv("STOKE_TEST_POISON"); p != nullptr) {
      // Tests: "RANK:STEP" feeds NaN gradients into one rank at one step.
      long long r = -1, st = -1;
      if (std::sscanf(p, "%lld:%lld", &r, &st) == 2) {
        train_run.poison_rank = static_cast<int>(r);
        train_run.poison_step = st;
      }
    }
#if STOKE_WITH_MONITOR
    // Rank 0 serves the monitor; its failure to start ends every rank, not rank 0 alone.
    std::unique_ptr<stoke::monitor::Monitor> monitor;
    stoke::Status monitor_started = stoke::OkStatus();
    // The run_dir the monitor watches is made first; a run that then fails to start takes the
    // folders away again (as the trainer does its own), not leaving an empty run behind.
    std::vector<std::filesystem::path> monitor_folders;
    if (!train_monitor.empty() && rank == 0) {
      monitor_started = [&]() -> stoke::Status {
        auto address = stoke::monitor::ParseListenAddress(train_monitor, "127.0.0.1");
        if (!address.ok()) return stoke::Status(address.status().code(), "--monitor " + address.status().message());
        auto made = stoke::MakeFolders(config->run_dir);
        if (!made.ok()) return made.status().Prepend(fmt::format("run_dir {}", config->run_dir));
        monitor_folders = std::move(*made);
        auto started = stoke::monitor::Monitor::Start(
            {.run_dirs = {config->run_dir}, .host = address->first, .port = address->second, .warn_empty_runs = false});
        if (!started.ok()) return started.status();
        monitor = std::move(*started);
        std::fprintf(stderr, "monitor: %s\n", monitor->url().c_str());
        return stoke::OkStatus();
      }();
    }
    if (!agreed_or_fail(monitor_started).ok()) {
      stoke::RemoveEmptyFolders(monitor_folders);
      return 1;
    }
#else
    if (!train_monitor.empty()) {
      return Fail(stoke::UnavailableError(std::string("--monitor: ") + kNoMonitor));
    }
    const std::vector<std::filesystem::path> monitor_folders;
#endif
    auto summary = stoke::train::Train(*config, train_run);
    if (!summary.ok()) {
#if STOKE_WITH_MONITOR
      monitor.reset();
#endif
      stoke::RemoveEmptyFolders(monitor_folders);  // (a run that got going has written into them)
      return fail_once(summary.status());  // every rank holds the same agreed error
    }
    if (rank != 0) return 0;
    std::fputs(stoke::train::FormatSummary(*summary).c_str(), stdout);
    if (summary->stopped && summary->steps < summary->total_steps) {
      std::printf("stopped at step %lld; continue with: stoke train --config %s --resume\n",
                  static_cast<long long>(summary->steps), train_config.c_str());
    }
    return 0;
  }
  if (monitor_cmd->parsed()) {
#if STOKE_WITH_MONITOR
    auto monitor = stoke::monitor::Monitor::Start(
        {.run_dirs = monitor_runs, .host = monitor_host, .port = monitor_port, .poll_ms = monitor_poll_ms});
    if (!monitor.ok()) return Fail(monitor.status());
    std::signal(SIGINT, OnInterrupt);
    std::signal(SIGTERM, OnInterrupt);
    std::printf("stoke monitor: %zu run%s at %s (Ctrl-C stops)\n", monitor_runs.size(),
                monitor_runs.size() == 1 ? "" : "s", (*monitor)->url().c_str());
    std::fflush(stdout);
    while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    (*monitor)->Stop();
    const auto st = (*monitor)->stats();
    std::printf("stoke monitor: stopped after %lld requests (%lld not found, %lld refused)\n",
                static_cast<long long>(st.requests), static_cast<long long>(st.not_found),
                static_cast<long long>(st.refused));
    return 0;
#else
    return Fail(stoke::UnavailableError(std::string("monitor: ") + kNoMonitor));
#endif
  }
  if (export_cmd->parsed() || eval_cmd->parsed() || predict_cmd->parsed()) {
    if (trained_run.empty() && trained_checkpoint.empty()) {
      return Fail(stoke::InvalidArgumentError("give the model with --run RUN_DIR or --checkpoint FILE"));
    }
    trained = {.run_dir = trained_run, .checkpoint = trained_checkpoint, .config = trained_config};
  }
  if (export_cmd->parsed()) {
#if STOKE_WITH_ONNX
    auto model = stoke::train::LoadTrainedModel(trained);
    if (!model.ok()) return Fail(model.status());
    const stoke::train::TrainConfig& c = model->config;
    stoke::train::ExportSource source{.model = stoke::train::ModelFromConfig(c.model),
                                      .image_width = c.data.image_size,
                                      .image_height = c.data.image_size,
                                      .normalize = stoke::train::NormalizeFromConfig(c.data),
                                      .bn_epsilon = c.model.bn_epsilon,
                                      .classes = model->classes,
                                      .state = model->checkpoint.tensors,
                                      .val_resize = stoke::train::ValResize(c.data),
                                      .step = model->checkpoint.step,
                                      .origin = stoke::train::Describe(*model)};
    {
      // Not over what it was exported from: the checkpoint, the config, the run's checkpoints.
      namespace fs = std::filesystem;
      const fs::path run = trained_run;
      const fs::path files[] = {model->checkpoint_path, model->config_path,
                                run.empty() ? fs::path() : run / "config.yaml"};
      const fs::path folders[] = {run.empty() ? fs::path() : run / "checkpoints"};
      if (stoke::Status s = stoke::CheckOutputClear("export: --output", export_output, files, folders); !s.ok()) {
        return Fail(s);
      }
    }
    stoke::RemoveStaleAtomicTemporariesOf(export_output);  // an earlier export's, killed mid-write
    const std::string temporary = stoke::AtomicWriteTemporary(export_output).string();
    if (temporary.size() < sizeof g_remove_on_signal) {
      std::memcpy(g_remove_on_signal, temporary.c_str(), temporary.size() + 1);
      std::signal(SIGINT, RemoveAndDie);
      std::signal(SIGTERM, RemoveAndDie);
    }
    auto report = stoke::train::WriteOnnx(
        source, {.uint8_input = export_uint8, .fold_batchnorm = !export_no_fold}, export_output);
    if (!report.ok()) return Fail(report.status());
    std::printf("%s -> %s\n  %d nodes, %lld parameters, input '%s' %s, output '%s' N x %d\n"
                "  batch norm: %d folded into the layer before, %d kept; %d dropout removed\n",
                source.origin.c_str(), export_output.c_str(), report->nodes,
                static_cast<long long>(report->parameters), report->input_name.c_str(),
                export_uint8 ? "uint8 N x H x W x 3" : "float32 N x 3 x H x W", report->output_name.c_str(),
                c.model.classes, report->folded_batchnorms, report->kept_batchnorms, report->removed_dropouts);
    return 0;
#else
    return Fail(stoke::UnavailableError("this build of stoke has no ONNX export (install libonnx-dev and "
                                        "libprotobuf-dev, then rebuild)"));
#endif
  }
  if (eval_cmd->parsed()) {
    eval.model = trained;
    eval.progress = !eval_json;
    eval.stop = &g_stop;
    std::signal(SIGINT, OnInterrupt);
    std::signal(SIGTERM, OnInterrupt);
    auto report = stoke::evaluate::Evaluate(eval);
    if (!report.ok()) return Fail(report.status());
    if (eval_json) {
      std::cout << stoke::evaluate::EvalReportJson(*report).dump(2, ' ', false, nlohmann::json::error_handler_t::replace)
                << "\n";
    } else {
      std::cout << stoke::evaluate::FormatEvalReport(*report, eval_max_classes);
    }
    return 0;
  }
  if (predict_cmd->parsed()) {
    predict.model = trained;
    predict.stop = &g_stop;  // Ctrl-C ends it with its scratch files removed
    std::signal(SIGINT, OnInterrupt);
    std::signal(SIGTERM, OnInterrupt);
    auto predictions = stoke::evaluate::Predict(predict);
    if (!predictions.ok()) return Fail(predictions.status());
    if (predict_json) {
      std::cout << stoke::evaluate::PredictionsJson(*predictions).dump(2, ' ', false,
                                                                       nlohmann::json::error_handler_t::replace)
                << "\n";
    } else {
      std::cout << stoke::evaluate::FormatPredictions(*predictions);
    }
    for (const auto& p : *predictions) {
      if (!p.error.empty()) return 3;  // 3: some inputs could not be read (the others ran)
    }
    return 0;
  }
  if (demo_cmd->parsed()) {
    demo.dir = demo_dir;
    demo.stop = &g_stop;
    std::signal(SIGINT, OnInterrupt);
    std::signal(SIGTERM, OnInterrupt);
    auto result = stoke::demo::RunDemo(demo);
    if (!result.ok()) return FailOrStopped(result.status());
    std::fputs(result->report.c_str(), stdout);
    return 0;
  }
  if (synth_cmd->parsed()) {
    synth.stop = &g_stop;
    std::signal(SIGINT, OnInterrupt);
    std::signal(SIGTERM, OnInterrupt);
    synth.style = synth_style == "shapes" ? stoke::synth::SynthStyle::kShapes : stoke::synth::SynthStyle::kStripes;
    stoke::Status s = stoke::synth::WriteSyntheticTree(synth_dir, synth);
    if (!s.ok()) return FailOrStopped(s);
    std::printf("wrote %d classes x %d images to %s\n", synth.classes, synth.per_class,
                synth_dir.c_str());
    return 0;
  }
  if (bench_train->parsed()) {
    train_bench.config = train_bench_config;
    train_bench.model_json = model_json;
    train_bench.peer_script = peer_script;
    auto result = stoke::bench::BenchTrain(bench, train_bench);
    // Under a launcher the ranks agree on errors; rank 0 reports them.
    if (!result.ok()) return stoke::dist::DetectLaunch().rank == 0 ? Fail(result.status()) : 1;
    std::cout << result->text;
    // Asked for a ratio and got none: the figures are printed, the run did not do its job.
    return result->peer_failed ? 1 : 0;
  }
  if (bench_pack->parsed() || bench_read->parsed() || bench_decode->parsed() ||
      bench_pipeline->parsed()) {
    auto result = bench_pack->parsed()     ? stoke::bench::BenchPack(bench)
                  : bench_read->parsed()   ? stoke::bench::BenchRead(bench)
                  : bench_decode->parsed() ? stoke::bench::BenchDecode(bench, bench_db)
                                           : stoke::bench::BenchPipeline(bench, bench_db, pipeline);
    if (!result.ok()) return Fail(result.status());
    std::cout << *result;
    return 0;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Every library call that can throw is wrapped where it is made; anything that still escapes is
  // a bug in stoke. Report it in one line and exit non-zero rather than abort with a core dump.
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "stoke: internal error: uncaught exception: %s (please report this)\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "stoke: internal error: uncaught exception of unknown type (please report this)\n");
  }
  return 70;  // EX_SOFTWARE
}
