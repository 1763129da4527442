#include "tools/demo/demo.h"

#include <chrono>
#include <cstdio>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "common/file_util.h"
#include "common/json_util.h"
#include "tools/pack/packer.h"
#include "tools/synth/synth.h"
#include "train/trainer.h"

namespace stoke::demo {
namespace {

// What the demo writes in its folder (with what a pack of its two datasets may leave while it
// runs); only these are replaced by the next demo there.
constexpr const char* kMarker = ".stoke-demo";
constexpr const char* kOwnEntries[] = {
    "images", "train.lmdb", "train_val.lmdb", "run", "demo.yaml", "train.lmdb.partial", "train_val.lmdb.partial",
    "train.lmdb.lock", "train_val.lmdb.lock", "train.lmdb.publishing", "train_val.lmdb.publishing",
    "train.lmdb.replaced", "train_val.lmdb.replaced"};
// Where an earlier demo's outputs wait while a new one runs: put back if it fails or is stopped,
// removed once it has finished.
constexpr const char* kPrevious = ".stoke-demo-previous";

// `text` as a YAML double-quoted scalar (yaml-cpp's emitter escapes it): any folder name (spaces,
// '#', ': ', brackets) stays one string.
std::string YamlQuoted(const std::string& text) {
  YAML::Emitter e;
  e << YAML::DoubleQuoted << text;
  return e.c_str();
}

// Moves each of the demo's entries present in `from` to `to` (created), after removing what `to`
// holds of them.
Status MoveEntries(const std::filesystem::path& from, const std::filesystem::path& to) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(to, ec);
  if (ec) return IoError(fmt::format("demo: {}: {}", to.string(), ec.message()));
  for (const char* entry : kOwnEntries) {
    if (!fs::exists(fs::symlink_status(from / entry, ec))) continue;
    fs::remove_all(to / entry, ec);
    if (!ec) fs::rename(from / entry, to / entry, ec);
    if (ec) return IoError(fmt::format("demo: move {} to {}: {}", (from / entry).string(), to.string(), ec.message()));
  }
  return OkStatus();
}

// Puts an earlier demo's outputs set aside in `dir` back in place of whatever a later demo left
// (stopped, failed, or killed before it could do it itself).
Status RestorePrevious(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path previous = dir / kPrevious;
  if (!fs::is_directory(previous, ec)) return OkStatus();
  for (const char* entry : kOwnEntries) {
    fs::remove_all(dir / entry, ec);
    if (ec) return IoError(fmt::format("demo: {}: {}", (dir / entry).string(), ec.message()));
  }
  STOKE_RETURN_IF_ERROR(MoveEntries(previous, dir));
  fs::remove_all(previous, ec);
  if (ec) return IoError(fmt::format("demo: {}: {}", previous.string(), ec.message()));
  return SyncDirectory(dir);
}

// Makes `dir` ready for a demo: created when missing; a previous demo's outputs set aside (see
// kPrevious); any other non-empty folder refused, so that `--dir .` or `--dir ~` can never touch
// what is there.
Status PrepareFolder(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    if (!fs::is_directory(dir, ec)) return InvalidArgumentError(fmt::format("demo: --dir {}: not a folder", dir.string()));
    // The names the demo writes are common ones (images, train.lmdb, run): without the marker a
    // folder holding them is the user's, not a demo's.
    const bool empty = fs::directory_iterator(dir, ec) == fs::directory_iterator();
    if (ec) return IoError(fmt::format("demo: --dir {}: {}", dir.string(), ec.message()));
    if (!empty && !fs::exists(dir / kMarker, ec)) {
      return InvalidArgumentError(fmt::format(
          "demo: --dir {}: the folder exists, is not empty and is not a demo's (no {} in it); the demo replaces "
          "its folder's contents, so give a new or empty folder",
          dir.string(), kMarker));
    }
    STOKE_RETURN_IF_ERROR(RestorePrevious(dir));  // a demo killed while it ran
    STOKE_RETURN_IF_ERROR(MoveEntries(dir, dir / kPrevious));
  }
  fs::create_directories(dir, ec);
  if (ec) return IoError(fmt::format("demo: {}: {}", dir.string(), ec.message()));
  return WriteFileAtomic(dir / kMarker, std::string("written by stoke demo: the demo may replace this folder's "
                                                    "images, datasets, config and run\n"));
}

Result<DemoResult> RunSteps(const DemoOptions& o, std::chrono::steady_clock::time_point start) {
  auto stopped = [&] { return o.stop && o.stop->load(); };
  std::printf("== 1. %d classes x %d synthetic JPEGs (each class a shape, in random colours, places and sizes)\n",
              o.classes, o.per_class);
  std::fflush(stdout);
  synth::SynthOptions so{.style = synth::SynthStyle::kShapes,
                         .classes = o.classes, .per_class = o.per_class, .min_side = 48, .max_side = 96, .seed = 7,
                         .stop = o.stop};
  const Status written = synth::WriteSyntheticTree(o.dir / "images", so);
  if (stopped()) return UnavailableError("demo: interrupted while generating the images");
  STOKE_RETURN_IF_ERROR(written);

  std::printf("== 2. stoke pack: validate, hold out 10%% per class for validation\n");
  std::fflush(stdout);
  pack::PackOptions po;
  po.source = o.dir / "images";
  po.output = o.dir / "train.lmdb";
  po.shuffle = true;
  po.seed = 1;
  po.val_fraction = 0.1;
  po.threads = o.threads;
  po.progress = false;
  po.stop = o.stop;
  auto packed = pack::Pack(po);
  if (stopped()) return UnavailableError("demo: interrupted while packing");  // (the demo has no --resume)
  if (!packed.ok()) return packed.status();
  std::fputs(pack::FormatSummary(*packed).c_str(), stdout);

  std::printf("== 3. stoke train --config %s/demo.yaml\n", o.dir.c_str());
  std::fflush(stdout);
  const std::string yaml = DemoConfigYaml(o.dir, o.classes, o.epochs, o.threads);
  STOKE_RETURN_IF_ERROR(WriteFileAtomic(o.dir / "demo.yaml", yaml));
  STOKE_ASSIGN_OR_RETURN(auto config, train::ParseConfig(yaml, (o.dir / "demo.yaml").string()));
  train::TrainRunOptions run;
  run.stop = o.stop;
  STOKE_ASSIGN_OR_RETURN(auto summary, train::Train(config, run));
  if (summary.stopped) {
    std::fputs(train::FormatSummary(summary).c_str(), stdout);
    return UnavailableError(fmt::format("demo: interrupted while training, at step {} of {}", summary.steps,
                                        summary.total_steps));
  }

  DemoResult r;
  r.val_top1 = summary.val.top1_rate();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.report = train::FormatSummary(summary);
  r.report += fmt::format("demo: validation top-1 {:.2f}% after {} epochs; {:.1f} s in all (generate + pack + "
                          "train + evaluate)\n",
                          100 * r.val_top1, o.epochs, r.seconds);
  return r;
}

}  // namespace

std::string DemoConfigYaml(const std::filesystem::path& dir, int classes, int epochs, int threads) {
  return fmt::format(R"(# stoke demo: a small CNN on synthetic 32x32 images of {classes} shapes.
data:
  train: {train}
  val: {val}
  batch_size: 64
  threads: {threads}
  image_size: 32
  val_resize: 36
  augment: {{scale: [0.35, 1.0], ratio: [0.75, 1.333], flip: 0.5}}
  normalize: {{mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}}
model:
  classes: {classes}
  layers:
    - {{name: conv1, type: conv, out: 16, kernel: 3, pad: 1, bias: false}}
    - {{type: batchnorm}}
    - {{type: relu}}
    - {{type: maxpool, kernel: 2}}
    - {{name: conv2, type: conv, out: 32, kernel: 3, pad: 1, bias: false}}
    - {{type: batchnorm}}
    - {{type: relu}}
    - {{type: maxpool, kernel: 2}}
    - {{name: conv3, type: conv, out: 64, kernel: 3, pad: 1, bias: false}}
    - {{type: batchnorm}}
    - {{type: relu}}
    - {{type: global_avgpool}}
    - {{name: fc, type: linear, out: {classes}}}
optimizer: {{lr: 0.2, base_batch: 256, momentum: 0.9, nesterov: true, weight_decay: 0.0005}}
schedule: {{type: cosine, warmup_epochs: 1}}
epochs: {epochs}
seed: 1
backend: auto
compute_threads: {threads}
run_dir: {run}
log_every_steps: 10
)",
                     fmt::arg("train", YamlQuoted((dir / "train.lmdb").string())),
                     fmt::arg("val", YamlQuoted((dir / "train_val.lmdb").string())),
                     fmt::arg("run", YamlQuoted((dir / "run").string())), fmt::arg("classes", classes), fmt::arg("epochs", epochs),
                     fmt::arg("threads", threads));
}

Result<DemoResult> RunDemo(const DemoOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  // The folder is written into the run's YAML config, which yaml-cpp reads as UTF-8: another name
  // came back with U+FFFD in it, naming no folder.
  if (!IsUtf8(o.dir.string())) {
    return InvalidArgumentError(fmt::format("demo: --dir {}: the name is not UTF-8 (a YAML config cannot name it); "
                                            "give a folder whose path is",
                                            o.dir.string()));
  }
  STOKE_RETURN_IF_ERROR(PrepareFolder(o.dir));
  auto r = RunSteps(o, start);
  const bool had_previous = std::filesystem::is_directory(o.dir / kPrevious);
  if (!r.ok()) {
    // Stopped or failed: the earlier demo's outputs come back (a first demo's own are left for the
    // next one to replace).
    if (Status restored = RestorePrevious(o.dir); !restored.ok()) {
      return Status(r.status().code(), fmt::format("{} (and the earlier demo's outputs could not be put back from "
                                                   "{}: {})",
                                                   r.status().message(), (o.dir / kPrevious).string(),
                                                   restored.message()));
    }
    if (had_previous) {
      return Status(r.status().code(),
                    fmt::format("{}; the earlier demo's outputs in {} are as they were", r.status().message(),
                                o.dir.string()));
    }
    return r.status();
  }
  std::error_code ec;
  std::filesystem::remove_all(o.dir / kPrevious, ec);
  return r;
}

}  // namespace stoke::demo
