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
// An earlier demo's outputs are replaced in steps that a stop, a failure or a kill at any point is
// recovered from (by this demo, or by the next one in the folder). The earlier outputs wait in
// kPrevious; the step under way is kept in kState:
//   aside:      moving the earlier outputs into kPrevious (some may still be in the folder);
//   running:    all of them are in kPrevious; the new demo writes its own;
//   cleaning:   removing what the new demo wrote (it failed or was stopped);
//   restoring:  moving the earlier outputs back (the folder holds none of the new ones);
//   discarding: the new demo finished; kPrevious goes.
// No state file: no replacement under way.
constexpr const char* kPrevious = ".stoke-demo-previous";
constexpr const char* kState = ".stoke-demo-state";

// `text` as a YAML double-quoted scalar (yaml-cpp's emitter escapes it): any folder name (spaces,
// '#', ': ', brackets) stays one string.
std::string YamlQuoted(const std::string& text) {
  YAML::Emitter e;
  e << YAML::DoubleQuoted << text;
  return e.c_str();
}

Status SetState(const std::filesystem::path& dir, const char* state) {
  return WriteFileAtomic(dir / kState, std::string(state) + "\n");
}

// Moves each of the demo's entries that is in `from` and not in `to` (renames: a stop between two
// leaves each entry whole on one side). Returns how many it moved.
Result<int> MoveAbsent(const std::filesystem::path& from, const std::filesystem::path& to) {
  namespace fs = std::filesystem;
  std::error_code ec;
  int moved = 0;
  for (const char* entry : kOwnEntries) {
    if (!fs::exists(fs::symlink_status(from / entry, ec)) || fs::exists(fs::symlink_status(to / entry, ec))) continue;
    fs::rename(from / entry, to / entry, ec);
    if (ec) return IoError(fmt::format("demo: move {} to {}: {}", (from / entry).string(), to.string(), ec.message()));
    ++moved;
  }
  STOKE_RETURN_IF_ERROR(SyncDirectory(to));
  STOKE_RETURN_IF_ERROR(SyncDirectory(from));
  return moved;
}

Status RemoveTree(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return IoError(fmt::format("demo: remove {}: {}", path.string(), ec.message()));
  return OkStatus();
}

// Ends whatever replacement the state file says is under way in `dir`: a finished demo's earlier
// outputs are removed; otherwise the earlier outputs are put back whole and the new ones removed.
Status Recover(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  const fs::path previous = dir / kPrevious;
  std::error_code ec;
  std::string state;
  if (fs::exists(fs::symlink_status(dir / kState, ec))) {
    STOKE_ASSIGN_OR_RETURN(const auto bytes, ReadFileBytes(dir / kState, 64));
    state.assign(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    while (!state.empty() && state.back() == '\n') state.pop_back();
  }
  if (state.empty() || state == "discarding") {
    STOKE_RETURN_IF_ERROR(RemoveTree(previous));
  } else if (state == "aside") {  // the new demo had not begun: what was moved goes back
    STOKE_RETURN_IF_ERROR(MoveAbsent(previous, dir).status());
    STOKE_RETURN_IF_ERROR(RemoveTree(previous));
  } else if (state == "running" || state == "cleaning" || state == "restoring") {
    if (state != "restoring") {
      STOKE_RETURN_IF_ERROR(SetState(dir, "cleaning"));
      for (const char* entry : kOwnEntries) STOKE_RETURN_IF_ERROR(RemoveTree(dir / entry));
      STOKE_RETURN_IF_ERROR(SetState(dir, "restoring"));
    }
    STOKE_RETURN_IF_ERROR(MoveAbsent(previous, dir).status());
    STOKE_RETURN_IF_ERROR(RemoveTree(previous));
  } else {
    return CorruptError(fmt::format("demo: {}: not a state this demo writes ('{}'); move it away",
                                    (dir / kState).string(), state));
  }
  fs::remove(dir / kState, ec);
  if (ec) return IoError(fmt::format("demo: remove {}: {}", (dir / kState).string(), ec.message()));
  return SyncDirectory(dir);
}

// Makes `dir` ready for a demo: created when missing; an interrupted replacement ended (Recover);
// a previous demo's outputs set aside in kPrevious. Any other non-empty folder is refused, so that
// `--dir .` or `--dir ~` can never touch what is there. True when there were earlier outputs.
Result<bool> PrepareFolder(const std::filesystem::path& dir) {
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
    STOKE_RETURN_IF_ERROR(Recover(dir));  // a demo killed while it replaced another
  }
  fs::create_directories(dir / kPrevious, ec);
  if (ec) return IoError(fmt::format("demo: {}: {}", dir.string(), ec.message()));
  STOKE_RETURN_IF_ERROR(WriteFileAtomic(dir / kMarker, std::string("written by stoke demo: the demo may replace this "
                                                                    "folder's images, datasets, config and run\n")));
  STOKE_RETURN_IF_ERROR(SetState(dir, "aside"));
  STOKE_ASSIGN_OR_RETURN(const int earlier, MoveAbsent(dir, dir / kPrevious));
  STOKE_RETURN_IF_ERROR(SetState(dir, "running"));
  return earlier > 0;
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
    // (Not the run's summary: it names the checkpoint and plot, which the demo now removes.)
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
  STOKE_ASSIGN_OR_RETURN(const bool had_previous, PrepareFolder(o.dir));
  auto r = RunSteps(o, start);
  if (!r.ok()) {
    // Stopped or failed: what it wrote goes, and the earlier demo's outputs come back.
    if (Status restored = Recover(o.dir); !restored.ok()) {
      return Status(r.status().code(), fmt::format("{} (and the folder could not be put back as it was: {}; the next "
                                                   "demo there finishes it)",
                                                   r.status().message(), restored.message()));
    }
    if (had_previous) {
      return Status(r.status().code(),
                    fmt::format("{}; the earlier demo's outputs in {} are as they were", r.status().message(),
                                o.dir.string()));
    }
    return Status(r.status().code(), fmt::format("{}; what it wrote in {} is removed", r.status().message(),
                                                 o.dir.string()));
  }
  STOKE_RETURN_IF_ERROR(SetState(o.dir, "discarding"));
  STOKE_RETURN_IF_ERROR(Recover(o.dir));
  return r;
}

}  // namespace stoke::demo
