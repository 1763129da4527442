#include "tools/demo/demo.h"

#include <chrono>
#include <cstdio>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "common/file_util.h"
#include "tools/pack/packer.h"
#include "tools/synth/synth.h"
#include "train/trainer.h"

namespace stoke::demo {
namespace {

// What the demo writes in its folder; only these are replaced by the next demo there.
constexpr const char* kMarker = ".stoke-demo";
constexpr const char* kOwnEntries[] = {"images", "train.lmdb", "train_val.lmdb", "run", "demo.yaml", kMarker};

// `text` as a YAML double-quoted scalar (yaml-cpp's emitter escapes it): any folder name (spaces,
// '#', ': ', brackets) stays one string.
std::string YamlQuoted(const std::string& text) {
  YAML::Emitter e;
  e << YAML::DoubleQuoted << text;
  return e.c_str();
}

// Makes `dir` ready for a demo: created when missing; a previous demo's outputs replaced; any other
// non-empty folder refused, so that `--dir .` or `--dir ~` can never delete what is there.
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
    for (const char* entry : kOwnEntries) {
      fs::remove_all(dir / entry, ec);
      if (ec) return IoError(fmt::format("demo: {}: {}", (dir / entry).string(), ec.message()));
    }
  }
  fs::create_directories(dir, ec);
  if (ec) return IoError(fmt::format("demo: {}: {}", dir.string(), ec.message()));
  return WriteFileAtomic(dir / kMarker, std::string("written by stoke demo: the demo may replace this folder's "
                                                    "images, datasets, config and run\n"));
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
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  STOKE_RETURN_IF_ERROR(PrepareFolder(o.dir));

  std::printf("== 1. %d classes x %d synthetic JPEGs (each class a shape, in random colours, places and sizes)\n",
              o.classes, o.per_class);
  std::fflush(stdout);
  synth::SynthOptions so{.style = synth::SynthStyle::kShapes,
                         .classes = o.classes, .per_class = o.per_class, .min_side = 48, .max_side = 96, .seed = 7};
  STOKE_RETURN_IF_ERROR(synth::WriteSyntheticTree(o.dir / "images", so));

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
  STOKE_ASSIGN_OR_RETURN(auto packed, pack::Pack(po));
  std::fputs(pack::FormatSummary(packed).c_str(), stdout);

  std::printf("== 3. stoke train --config %s/demo.yaml\n", o.dir.c_str());
  std::fflush(stdout);
  const std::string yaml = DemoConfigYaml(o.dir, o.classes, o.epochs, o.threads);
  STOKE_RETURN_IF_ERROR(WriteFileAtomic(o.dir / "demo.yaml", yaml));
  STOKE_ASSIGN_OR_RETURN(auto config, train::ParseConfig(yaml, (o.dir / "demo.yaml").string()));
  train::TrainRunOptions run;
  run.stop = o.stop;
  STOKE_ASSIGN_OR_RETURN(auto summary, train::Train(config, run));

  DemoResult r;
  r.val_top1 = summary.val.top1_rate();
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  r.report = train::FormatSummary(summary);
  r.report += fmt::format("demo: validation top-1 {:.2f}% after {} epochs; {:.1f} s in all (generate + pack + "
                          "train + evaluate)\n",
                          100 * r.val_top1, o.epochs, r.seconds);
  return r;
}

}  // namespace stoke::demo
