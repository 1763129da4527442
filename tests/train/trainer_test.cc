// Config parsing and its errors, schedules, checkpoints, and the training loop end to end:
// learning, resume equivalence, refusing damaged checkpoints.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <gtest/gtest.h>

#include "tests/testing/test_util.h"
#include "tests/train/train_test_util.h"
#include "tools/pack/packer.h"
#include "tools/synth/synth.h"
#include "tests/prefetch/loader_test_util.h"
#include "common/sys_memory.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/schedule.h"
#include "train/tensorboard.h"
#include "train/trainer.h"

namespace stoke::train {
namespace {

constexpr const char* kMinimal = R"(data:
  train: /nonexistent/train.lmdb
  image_size: 32
model:
  preset: lenet
  classes: 4
)";

std::string ErrorOf(const std::string& yaml) {
  auto r = ParseConfig(yaml, "run.yaml");
  return r.ok() ? std::string("(parsed)") : r.status().message();
}


// The curves of a diverged run: points of 1e16 and two almost equal large values made the tick
// loop spin for ever (the run never exited after its last checkpoint), and a flat series divided
// by zero. Each plot is written, with no NaN in it.
TEST(Plot, DivergedAndFlatCurvesAreDrawn) {
  testing::TempDir dir;
  const std::vector<std::string> cases = {
      R"({"type":"train","step":5,"loss":1e16,"top1":0.5})",
      "{\"type\":\"train\",\"step\":5,\"loss\":10000000.0,\"top1\":0.5}\n"
      "{\"type\":\"val\",\"step\":5,\"loss\":10000000.000000002,\"top1\":0.5,\"top5\":1}",
      R"({"type":"train","step":3,"loss":4.3984726698827745e+15,"top1":0.25})",
      R"({"type":"train","step":1,"loss":2.5,"top1":0.25})"};
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto metrics = (dir / fmt::format("m{}.jsonl", i)).string(), svg = (dir / fmt::format("m{}.svg", i)).string();
    std::ofstream(metrics) << cases[i] << "\n";
    SCOPED_TRACE(cases[i]);
    ASSERT_OK_AND_ASSIGN(const bool drawn, WritePlot(metrics, svg));
    EXPECT_TRUE(drawn);
    std::ifstream in(svg);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("<path d=\"M"), std::string::npos) << cases[i];
    EXPECT_EQ(text.find("nan"), std::string::npos) << cases[i];
    EXPECT_EQ(text.find("inf"), std::string::npos) << cases[i];
  }
  // A run that stopped before its first log line has nothing to draw: no file, and no error.
  const auto metrics = (dir / "early.jsonl").string(), svg = (dir / "early.svg").string();
  std::ofstream(metrics) << R"({"type":"start","step":0})" << "\n" << R"({"type":"end","step":0,"stopped":true})" << "\n";
  ASSERT_OK_AND_ASSIGN(const bool drawn, WritePlot(metrics, svg));
  EXPECT_FALSE(drawn);
  EXPECT_FALSE(std::filesystem::exists(svg));
  EXPECT_EQ(WritePlot((dir / "missing.jsonl").string(), svg).status().code(), StatusCode::kIoError);
}

// A value written as null (not finite when it was measured) is no point of its curve: drawn at 0 it
// would read as a perfect loss. The plot is the one drawn without that line.
TEST(Plot, ValuesThatAreNullAreNotDrawnAsZero) {
  testing::TempDir dir;
  const std::string train = "{\"type\":\"train\",\"step\":1,\"loss\":2.5,\"top1\":0.25}\n"
                            "{\"type\":\"train\",\"step\":2,\"loss\":2.0,\"top1\":0.5}\n";
  const std::string null_val = R"({"type":"val","step":2,"loss":null,"top1":null,"top5":null})"
                               "\n";
  std::ofstream(dir / "with.jsonl") << train << null_val;
  std::ofstream(dir / "without.jsonl") << train;
  ASSERT_OK_AND_ASSIGN(const bool with, WritePlot((dir / "with.jsonl").string(), (dir / "with.svg").string()));
  ASSERT_OK_AND_ASSIGN(const bool without, WritePlot((dir / "without.jsonl").string(), (dir / "without.svg").string()));
  ASSERT_TRUE(with && without);
  auto text = [&](const char* name) {
    std::ifstream in(dir / name);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  EXPECT_EQ(text("with.svg"), text("without.svg"));
}

// The CPU backend's threads: compute_threads, else OMP_NUM_THREADS as libgomp reads it, else the
// usable cores (OpenMP's own default ignores a cgroup's CPU quota; bench train gave its PyTorch
// peer every core while stoke ran on OMP_NUM_THREADS of them).
TEST(Trainer, ComputeThreadsAreResolvedOnce) {
  const char* was = std::getenv("OMP_NUM_THREADS");
  const std::string saved = was != nullptr ? was : "";
  TrainConfig c;
  c.compute_threads = 3;
  ::setenv("OMP_NUM_THREADS", "5", 1);
  EXPECT_EQ(ComputeThreads(c), 3);
  c.compute_threads = 0;
  EXPECT_EQ(ComputeThreads(c), 5);
  ::setenv("OMP_NUM_THREADS", "4,2", 1);
  EXPECT_EQ(ComputeThreads(c), 4);
  for (const char* ignored : {"4abc", "0", "", "x", "-2"}) {
    ::setenv("OMP_NUM_THREADS", ignored, 1);
    EXPECT_EQ(ComputeThreads(c), UsableCores()) << ignored;
  }
  ::unsetenv("OMP_NUM_THREADS");
  EXPECT_EQ(ComputeThreads(c), UsableCores());
  if (was != nullptr) ::setenv("OMP_NUM_THREADS", saved.c_str(), 1);
}

TEST(Config, DefaultsAndRoundTrip) {
  ASSERT_OK_AND_ASSIGN(TrainConfig c, ParseConfig(kMinimal, "run.yaml"));
  EXPECT_EQ(c.data.batch_size, 128);
  EXPECT_EQ(c.model.preset, "lenet");
  EXPECT_EQ(c.schedule.type, "cosine");
  const std::string yaml = ConfigToYaml(c);
  ASSERT_OK_AND_ASSIGN(TrainConfig back, ParseConfig(yaml, "resolved.yaml"));
  EXPECT_EQ(ConfigToYaml(back), yaml);
  EXPECT_NE(yaml.find("scale: [0.08, 1]"), std::string::npos) << yaml;
  EXPECT_EQ(c.cuda.input_channels, 3);
  // Left out, val_resize follows image_size (x 256 / 224, rounded up, as stoke.torch.Loader's
  // default), and the resolved config shows it.
  EXPECT_NE(yaml.find("val_resize: 37"), std::string::npos) << yaml;
  EXPECT_EQ(ValLoaderOptions(c, 0, 1).augment.resize, 37);
  ASSERT_OK_AND_ASSIGN(TrainConfig usual, ParseConfig("data: {train: t}\nmodel: {preset: lenet, classes: 4}\n", "u.yaml"));
  EXPECT_EQ(ValResize(usual.data), 256);
  ASSERT_OK_AND_ASSIGN(TrainConfig padded, ParseConfig(std::string(kMinimal) + "cuda: {input_channels: 4}\n", "p.yaml"));
  EXPECT_EQ(padded.cuda.input_channels, 4);
  EXPECT_NE(ConfigToYaml(padded).find("input_channels: 4"), std::string::npos);
  EXPECT_EQ(c.dist.device_comm, "auto");
  ASSERT_OK_AND_ASSIGN(TrainConfig staged, ParseConfig(std::string(kMinimal) + "dist: {device_comm: host}\n", "h.yaml"));
  EXPECT_EQ(staged.dist.device_comm, "host");
  EXPECT_NE(ConfigToYaml(staged).find("device_comm: host"), std::string::npos);

  // An explicit layer list survives the round trip too.
  const std::string layers = R"(data: {train: t.lmdb, image_size: 16}
model:
  classes: 3
  layers:
    - {name: c, type: conv, out: 4, kernel: 3, pad: 1}
    - {type: maxpool, kernel: 2}
    - {name: skip, type: conv, out: 4, kernel: 1, inputs: input, stride: 2}
    - {type: add, inputs: [maxpool1, skip]}
    - {type: flatten}
    - {type: dropout, p: 0.25}
    - {type: linear, out: 3}
)";
  ASSERT_OK_AND_ASSIGN(TrainConfig l, ParseConfig(layers, "l.yaml"));
  ASSERT_EQ(l.model.layers.size(), 7u);
  EXPECT_EQ(l.model.layers[1].stride, 0);  // pools default to their kernel
  ASSERT_OK_AND_ASSIGN(TrainConfig l2, ParseConfig(ConfigToYaml(l), "l2.yaml"));
  EXPECT_EQ(ConfigToYaml(l2), ConfigToYaml(l));
}

TEST(Config, ErrorsNameFileLineKeyAndExpectation) {
  const std::string base = kMinimal;
  // Normalised values must fit the chosen dtype (a float16 batch of inf trains nothing).
  const std::string tiny_std = "data:\n  train: t.lmdb\n  image_size: 32\n  normalize:\n    std: [5.0e-6, 1, 1]\n"
                               "    dtype: float16\nmodel:\n  preset: lenet\n  classes: 4\n";
  EXPECT_EQ(ErrorOf(tiny_std),
            "run.yaml:5: data.normalize: channel 0: (x - mean 0.485) / std 5e-06 reaches 1.03e+05, beyond "
            "the output type's largest value 65504 (a larger std, or a wider output type) (dtype float16)");
  EXPECT_EQ(ErrorOf(base + "optimizer:\n  momentum: 1.5\n"),
            "run.yaml:8: optimizer.momentum: 1.5 is out of range; expected a number in [0, 1)");
  EXPECT_EQ(ErrorOf(base + "optimizer:\n  lr: fast\n"),
            "run.yaml:8: optimizer.lr: 'fast' is not a number; expected a number in [0, 100]");
  EXPECT_EQ(ErrorOf(base + "epochs: 2.5\n"), "run.yaml:7: epochs: '2.5' is not an integer; expected an integer in [1, 16777216]");
  const std::string unknown = ErrorOf(base + "optimizer:\n  momentun: 0.9\n");
  EXPECT_EQ(unknown.rfind("run.yaml:8: optimizer.momentun: unknown key; expected one of: ", 0), 0u) << unknown;
  EXPECT_NE(unknown.find("momentum"), std::string::npos);
  EXPECT_EQ(ErrorOf(base + "backend: tpu\n"), "run.yaml:7: backend: 'tpu' is not allowed; expected one of: auto, cpu, cuda");
  // Against the run's length: a warm-up longer than the run trained it all at a fraction of lr.
  EXPECT_EQ(ErrorOf(base + "epochs: 2\nschedule: {type: cosine, warmup_epochs: 50}\n"),
            "run.yaml:8: schedule.warmup_epochs: 50 is past the last epoch (2): the learning rate would never "
            "reach optimizer.lr; expected at most epochs");
  EXPECT_EQ(ErrorOf(base + "epochs: 2\nschedule: {type: cosine, warmup_epochs: 2}\n"), "(parsed)");
  EXPECT_EQ(ErrorOf(base + "epochs: 8\nschedule: {type: multistep, milestones: [4, 9]}\n"),
            "run.yaml:8: schedule.milestones: epoch 9 is not before the end of the run (epochs: 8), so the rate "
            "would never change there");
  EXPECT_EQ(ErrorOf(base + "schedule: {type: cosine, gamma: 0}\n"),
            "run.yaml:7: schedule.gamma: 0 is out of range; expected a number in [1e-09, 1]");
  const std::string bad_list = ErrorOf(base + "data2: 1\n");
  EXPECT_EQ(bad_list.rfind("run.yaml:7: data2: unknown key", 0), 0u) << bad_list;
  EXPECT_EQ(ErrorOf("data: {train: t}\nmodel: {classes: 3}\n"),
            "run.yaml:2: model.preset: give either a preset (lenet, resnet20, resnet18, resnet34, resnet50) or a "
            "layers list, not neither");
  EXPECT_EQ(ErrorOf("model: {preset: lenet, classes: 3}\n"),
            "run.yaml:1: data.train: missing; expected the path of a packed training dataset");
  EXPECT_EQ(ErrorOf("data: {train: t, image_size: 32}\nmodel:\n  classes: 3\n  layers:\n"
                    "    - {type: conv, out: 4, kernel: 1}\n    - {type: pooling}\n"),
            "run.yaml:6: model.layers[1].type: unknown layer type 'pooling'; expected one of: conv, batchnorm, relu, "
            "maxpool, avgpool, global_avgpool, linear, add, flatten, dropout");
  const std::string shape = ErrorOf("data: {train: t, image_size: 32}\nmodel:\n  classes: 3\n  layers:\n"
                                    "    - {type: conv, out: 4, kernel: 3}\n");
  EXPECT_NE(shape.find("run.yaml:2: model: the last layer ('conv0') gives an image of 4x30x30"), std::string::npos)
      << shape << "\n";
  // A key of another layer type (a pool's kernel on a relu) is refused, not ignored.
  EXPECT_EQ(ErrorOf("data: {train: t, image_size: 32}\nmodel:\n  classes: 3\n  layers:\n    - {type: relu, kernel: 2}\n"
                    "    - {type: linear, out: 3}\n"),
            "run.yaml:5: model.layers[0].kernel: does not apply to a relu layer; its keys are: name, type, inputs");
  EXPECT_EQ(ErrorOf("data: {train: t}\nmodel: {preset: lenet, classes: 1}\n"),
            "run.yaml:2: model.classes: 1 is out of range; expected an integer in [2, 16777216]");
  // Checked before it is narrowed to an int: 2^32 + 8 is not a batch of 8.
  EXPECT_EQ(ErrorOf("data: {train: t, batch_size: 4294967304}\nmodel: {preset: lenet, classes: 4}\n"),
            "run.yaml:1: data.batch_size: 4294967304 is out of range; expected an integer in [1, 65536]");
  EXPECT_NE(ErrorOf("data: [1, 2]\n").find("run.yaml:1: data: expected a mapping"), std::string::npos);
  EXPECT_NE(ErrorOf("data: {train: t\n").find("run.yaml:2: not valid YAML"), std::string::npos) << ErrorOf("data: {train: t\n");
  EXPECT_EQ(ErrorOf(base + "data2: 1\n").find("(parsed)"), std::string::npos);
  // A key given twice (an override appended to a config) is refused, not silently resolved.
  EXPECT_EQ(ErrorOf(base + "epochs: 3\nepochs: 4\n"), "run.yaml:8: epochs: given twice (first on line 7); keep one");
  EXPECT_EQ(ErrorOf(base + "optimizer:\n  lr: 0.1\n  momentum: 0.9\n  lr: 0.2\n"),
            "run.yaml:10: optimizer.lr: given twice (first on line 8); keep one");
  EXPECT_EQ(ErrorOf(base + "cuda: {autotune: maybe}\n"),
            "run.yaml:7: cuda.autotune: 'maybe' is not a boolean; expected true or false");
  EXPECT_EQ(ErrorOf(base + "cuda: {input_channels: 5}\n"),
            "run.yaml:7: cuda.input_channels: '5' is not allowed; expected one of: 3, 4, 8");
  // Sizes that would overflow the kernels' 32-bit indices are refused by name, never wrapped.
  EXPECT_EQ(ErrorOf("data: {train: t, image_size: 4096}\nmodel:\n  classes: 3\n  layers:\n"
                    "    - {type: conv, out: 1048576, kernel: 1}\n    - {type: global_avgpool}\n"
                    "    - {type: linear, out: 3}\n"),
            "run.yaml:2: model: layer 0 ('conv0', conv): its output is 1048576x4096x4096 = 17592186044416 values per "
            "image; at most 2147483647 are supported (input 3x4096x4096)");
  EXPECT_EQ(ErrorOf("data: {train: t, image_size: 256}\nmodel:\n  classes: 3\n  layers:\n"
                    "    - {type: conv, out: 64, kernel: 1}\n    - {type: flatten}\n    - {type: linear, out: 1024}\n"
                    "    - {type: linear, out: 3}\n"),
            "run.yaml:2: model: layer 2 ('linear2', linear): it has 4294967296 weights; at most 2147483647 are "
            "supported per layer (input 3x256x256)");
  EXPECT_EQ(ErrorOf(base + "run_dir: \"\"\n"),
            "run.yaml:7: run_dir: expected the directory for checkpoints and metrics, got an empty string");
  EXPECT_EQ(ErrorOf(base + "dist: {device_comm: gloo}\n"),
            "run.yaml:7: dist.device_comm: 'gloo' is not allowed; expected one of: auto, nccl, host");
  // Integers are decimal: yaml-cpp read 010 as 8 and 0x10 as 16.
  EXPECT_EQ(ErrorOf(base + "epochs: 010\n"),
            "run.yaml:7: epochs: '010' is not an integer; expected an integer in [1, 16777216]");
  EXPECT_EQ(ErrorOf(base + "epochs: 0x10\n"),
            "run.yaml:7: epochs: '0x10' is not an integer; expected an integer in [1, 16777216]");
  // One document: an override appended after `---` was ignored, even when it was not valid YAML.
  // The error names the line of the `---`.
  EXPECT_EQ(ErrorOf(base + "---\nepochs: 50\n"),
            "run.yaml:7: a second YAML document; a config is one document (merge it into the first)");
  EXPECT_NE(ErrorOf(base + "---\noptimizer: {lr: 0.5\n").find("not valid YAML"), std::string::npos);
  // A stray ',' where a document could start: yaml-cpp's LoadAll looped for ever on it, allocating
  // (found by fuzz_config: a minute and 2 GB, then the fuzzer's timeout).
  EXPECT_EQ(ErrorOf(","), "run.yaml:1: not valid YAML: unexpected ','");
  EXPECT_EQ(ErrorOf("---\n,\n---\na: 1\n"), "run.yaml:2: not valid YAML: unexpected ','");
  // A document after an end marker is a second document, not a stray token.
  EXPECT_EQ(ErrorOf(base + "...\nepochs: 2\n"),
            "run.yaml:8: a second YAML document; a config is one document (merge it into the first)");
  // A key without a value is refused, not read as its default; so is a number past a double's
  // range (yaml-cpp read 1e-400 as 0).
  EXPECT_EQ(ErrorOf(base + "optimizer:\n  lr: ~\n"),
            "run.yaml:8: optimizer.lr: no value; give one, or remove the key for its default");
  EXPECT_EQ(ErrorOf(base + "optimizer:\n  lr:\n  momentum: 0.9\n"),
            "run.yaml:8: optimizer.lr: no value; give one, or remove the key for its default");
  EXPECT_EQ(ErrorOf(base + "optimizer:\n  lr: 1e-400\n"),
            "run.yaml:8: optimizer.lr: 1e-400 is beyond what a double holds; expected a number in [0, 100]");
  EXPECT_EQ(ErrorOf(base + "optimizer:\n  <<: {lr: 0.5}\n"),
            "run.yaml:8: optimizer.<<: a YAML merge key, which configs do not expand; write its keys out here");
  // Validation centre-crops image_size from an image resized to val_resize: a smaller one is refused
  // (it was raised to image_size without a word).
  EXPECT_EQ(ErrorOf("data: {train: t, image_size: 32, val_resize: 24}\nmodel: {preset: lenet, classes: 4}\n"),
            "run.yaml:1: data.val_resize: expected >= data.image_size (32): validation resizes the shorter side "
            "to val_resize, then centre-crops image_size");
  // Config strings go into checkpoints as JSON: bytes that are not UTF-8 are refused by line
  // (the run failed at its first checkpoint).
  EXPECT_EQ(ErrorOf(base + "run_dir: /tmp/runs/bad\xff\n"),
            "run.yaml:7: byte 0xFF is not UTF-8 text; a config is UTF-8 (a path in another encoding: rename it, or "
            "reach it through a link)");
}

// What a setting does not read is refused, not ignored: the milestones of a cosine schedule, a
// multistep schedule without milestones, a step that never comes, LARS keys on plain SGD, block
// sizes of a full shuffle, a pool without its window. ConfigToYaml writes only what is read, so
// its text parses again; a checkpoint's stored config (kStored) may hold the rest, as it did.
TEST(Config, WhatASettingDoesNotReadIsRefused) {
  const std::string base = kMinimal;  // 7 lines
  EXPECT_EQ(ErrorOf(base + "schedule: {type: cosine, milestones: [1, 2]}\n"),
            "run.yaml:7: schedule.milestones: does not apply to a cosine schedule; it reads warmup_epochs, "
            "warmup_start, min_lr");
  EXPECT_EQ(ErrorOf(base + "schedule: {milestones: [1, 2]}\n"),  // the default type, cosine
            "run.yaml:7: schedule.milestones: does not apply to a cosine schedule; it reads warmup_epochs, "
            "warmup_start, min_lr");
  EXPECT_EQ(ErrorOf(base + "schedule: {type: step, step_epochs: 2, min_lr: 0.5}\n"),
            "run.yaml:7: schedule.min_lr: does not apply to a step schedule; it reads warmup_epochs, warmup_start, "
            "step_epochs, gamma");
  EXPECT_EQ(ErrorOf(base + "schedule: {type: constant, gamma: 0.5}\n"),
            "run.yaml:7: schedule.gamma: does not apply to a constant schedule; it reads warmup_epochs, warmup_start");
  EXPECT_EQ(ErrorOf(base + "schedule: {type: multistep}\n"),
            "run.yaml:7: schedule.milestones: missing; a multistep schedule needs the epochs at which to multiply "
            "the rate by gamma");
  EXPECT_EQ(ErrorOf(base + "schedule: {type: multistep, milestones: [2, 2]}\n"),
            "run.yaml:7: schedule.milestones: expected epochs in increasing order, each once");
  EXPECT_EQ(ErrorOf(base + "epochs: 5\nschedule: {type: multistep, milestones: [2, 5]}\n"),
            "run.yaml:8: schedule.milestones: epoch 5 is not before the end of the run (epochs: 5), so the rate "
            "would never change there");
  EXPECT_EQ(ErrorOf(base + "epochs: 3\nschedule: {type: step}\n"),
            "run.yaml:8: schedule.step_epochs: 30 (the default) is not below epochs (3), so the rate would never "
            "step; expected step_epochs below epochs, or type constant");
  EXPECT_EQ(ErrorOf(base + "epochs: 3\nschedule: {type: step, step_epochs: 3}\n"),
            "run.yaml:8: schedule.step_epochs: 3 is not below epochs (3), so the rate would never step; expected "
            "step_epochs below epochs, or type constant");
  EXPECT_EQ(ErrorOf(base + "epochs: 3\nschedule: {type: step, step_epochs: 2}\n"), "(parsed)");
  EXPECT_EQ(ErrorOf(base + "optimizer: {type: sgd, trust_coefficient: 0.02}\n"),
            "run.yaml:7: optimizer.trust_coefficient: does not apply to type: sgd; trust_coefficient and eps are "
            "read by lars and larc, clip by larc");
  EXPECT_EQ(ErrorOf(base + "optimizer: {type: lars, clip: false}\n"),
            "run.yaml:7: optimizer.clip: does not apply to type: lars; it reads trust_coefficient, eps");
  EXPECT_EQ(ErrorOf(base + "optimizer: {type: larc, clip: false, eps: 1e-9}\n"), "(parsed)");
  EXPECT_EQ(ErrorOf("data: {train: t, image_size: 32, block_size: 16}\nmodel: {preset: lenet, classes: 4}\n"),
            "run.yaml:1: data.block_size: does not apply to shuffle: full; block_size and window_blocks are read by "
            "shuffle: block");
  EXPECT_EQ(ErrorOf("data: {train: t, image_size: 32, shuffle: block, block_size: 16}\nmodel: {preset: lenet, "
                    "classes: 4}\n"),
            "(parsed)");
  EXPECT_EQ(ErrorOf("data: {train: t, image_size: 32}\nmodel:\n  classes: 3\n  layers:\n    - {type: maxpool}\n"
                    "    - {type: flatten}\n    - {type: linear, out: 3}\n"),
            "run.yaml:5: model.layers[0].kernel: missing; a maxpool layer needs the size of its window");

  // What ConfigToYaml writes is what its settings read, and it parses again to the same text.
  for (const std::string extra : {"schedule: {type: multistep, milestones: [3, 6], gamma: 0.5}\n",
                                  "schedule: {type: step, step_epochs: 4}\noptimizer: {type: larc, clip: false}\n",
                                  "schedule: {type: constant}\noptimizer: {type: lars}\n"}) {
    ASSERT_OK_AND_ASSIGN(TrainConfig c, ParseConfig(base + extra, "run.yaml"));
    const std::string yaml = ConfigToYaml(c);
    ASSERT_OK_AND_ASSIGN(TrainConfig again, ParseConfig(yaml, "again.yaml"));
    EXPECT_EQ(ConfigToYaml(again), yaml) << extra;
  }
  ASSERT_OK_AND_ASSIGN(TrainConfig cosine, ParseConfig(base, "run.yaml"));
  const std::string printed = ConfigToYaml(cosine);
  for (const char* absent : {"milestones", "step_epochs", "gamma", "trust_coefficient", "clip", "block_size"}) {
    EXPECT_EQ(printed.find(absent), std::string::npos) << absent << " in\n" << printed;
  }

  // What an earlier stoke printed (run_dir/config.yaml, --print-config) held every key: those at
  // their defaults are warned of and read.
  EXPECT_EQ(ErrorOf(base + "data2: 0\n").substr(0, 24), "run.yaml:7: data2: unkno");
  EXPECT_EQ(ErrorOf("data: {train: t, image_size: 32, shuffle: full, block_size: 64, window_blocks: 8}\nmodel: "
                    "{preset: lenet, classes: 4}\noptimizer: {type: sgd, trust_coefficient: 0, clip: true, eps: "
                    "1.0e-08}\nschedule: {type: cosine, step_epochs: 30, milestones: [], gamma: 0.1, min_lr: 0}\n"),
            "(parsed)");
  EXPECT_EQ(ErrorOf("data: {train: t, image_size: 32, shuffle: full, block_size: 65}\nmodel: "
                    "{preset: lenet, classes: 4}\n"),
            "run.yaml:1: data.block_size: does not apply to shuffle: full; block_size and window_blocks are read by "
            "shuffle: block");

  // A config stored by an earlier stoke held every key; it still reads, as it was meant.
  const std::string stored = base + "epochs: 4\nschedule: {type: cosine, step_epochs: 30, milestones: [], gamma: 0.5, "
                                    "min_lr: 0.01}\noptimizer: {type: sgd, trust_coefficient: 0, clip: true, eps: "
                                    "1e-8}\n";
  EXPECT_NE(ErrorOf(stored), "(parsed)");
  ASSERT_OK_AND_ASSIGN(TrainConfig old, ParseConfig(stored, "ck (its stored config)", ConfigOrigin::kStored));
  EXPECT_EQ(old.schedule.min_lr, 0.01);
  EXPECT_EQ(old.schedule.type, "cosine");
  // The earlier rules hold for it: a milestone given twice was allowed.
  ASSERT_OK(ParseConfig(base + "epochs: 8\nschedule: {type: multistep, milestones: [3, 3]}\n", "ck",
                        ConfigOrigin::kStored)
                .status());
}

// Values checked later, against a dataset or the machine, are named with the line of their key.
TEST(Config, WhereNamesTheLineOfAKey) {
  ASSERT_OK_AND_ASSIGN(TrainConfig c,
                       ParseConfig(std::string(kMinimal) + "schedule:\n  warmup_epochs: 1\n", "run.yaml"));
  EXPECT_EQ(c.Where("data.train"), "run.yaml:2");
  EXPECT_EQ(c.Where("model.classes"), "run.yaml:6");
  EXPECT_EQ(c.Where("schedule.warmup_epochs"), "run.yaml:8");
  EXPECT_EQ(c.Where("data.batch_size"), "run.yaml");  // left to its default
  ASSERT_OK_AND_ASSIGN(TrainConfig flow, ParseConfig("data: {train: t, image_size: 32, batch_size: 8}\nmodel: "
                                                     "{preset: lenet, classes: 4}\n", "f.yaml"));
  EXPECT_EQ(flow.Where("data.batch_size"), "f.yaml:1");
  EXPECT_EQ(flow.Where("model.classes"), "f.yaml:2");
}

// Text yaml-cpp takes without a word that is not what was meant: a quote never closed (it ran to
// the end of the file, taking the keys after it into the string), a control character in a path.
TEST(Config, UnclosedQuotesAndControlCharactersAreRefused) {
  const std::string base = kMinimal;  // 7 lines
  EXPECT_EQ(ErrorOf(base + "run_dir: \"runs/abc\nepochs: 5\n"),
            "run.yaml:7: not valid YAML: the string quoted here has no closing \"");
  EXPECT_EQ(ErrorOf(base + "epochs: 5\nrun_dir: 'runs/abc\n"),
            "run.yaml:8: not valid YAML: the string quoted here has no closing '");
  // After a byte-order mark too (yaml-cpp's positions count from after it).
  EXPECT_EQ(ErrorOf("\xEF\xBB\xBF" + base + "run_dir: \"runs/abc\nepochs: 5\n"),
            "run.yaml:7: not valid YAML: the string quoted here has no closing \"");
  EXPECT_EQ(ErrorOf("\xEF\xBB\xBF" + base + "'run_dir': \"x\"\n"), "(parsed)");
  // Closed quotes with escapes inside them still read.
  EXPECT_EQ(ErrorOf(base + "run_dir: \"runs/a\\\"b\"\nseed: 1\n"), "(parsed)");
  EXPECT_EQ(ErrorOf(base + "run_dir: 'it''s'\nseed: 1\n"), "(parsed)");
  EXPECT_EQ(ErrorOf(base + "run_dir: |-\n  runs/literal\nseed: 1\n"), "(parsed)");  // a block scalar, not quoted
  EXPECT_EQ(ErrorOf(base + "run_dir: |\n  runs/literal\n"),  // its kept newline would end the path
            "run.yaml:7: run_dir: holds the control character 0x0A; expected printable text");
  EXPECT_EQ(ErrorOf(base + "run_dir: \"runs/nul\\0junk\"\n"),
            "run.yaml:7: run_dir: holds the control character 0x00; expected printable text");
  EXPECT_EQ(ErrorOf(base + "run_dir: \"runs\\tab\"\n"),
            "run.yaml:7: run_dir: holds the control character 0x09; expected printable text");
  // Messages about lists and unbounded ranges say what was there and what is expected.
  EXPECT_EQ(ErrorOf(base + "epochs: 8\nschedule: {type: multistep, milestones: [1, ~]}\n"),
            "run.yaml:8: schedule.milestones[1]: no value; expected an integer in [1, 16777216]");
  EXPECT_EQ(ErrorOf("data:\n  train: t\n  image_size: 32\n  normalize: {std: [1, 1, .inf]}\nmodel: {preset: lenet, "
                    "classes: 4}\n"),
            "run.yaml:4: data.normalize.std[2]: .inf is out of range; expected a number >= 1e-06 (finite)");
  EXPECT_EQ(ErrorOf("data:\n  train: t\n  image_size: 32\n  normalize: {mean: [1, x, 0]}\nmodel: {preset: lenet, "
                    "classes: 4}\n"),
            "run.yaml:4: data.normalize.mean[1]: 'x' is not a number; expected any finite number");
}

// Numbers are written back exactly: the shortest text that reads back as the same double.
TEST(Config, NumbersRoundTripExactly) {
  ASSERT_OK_AND_ASSIGN(TrainConfig c, ParseConfig(std::string(kMinimal) + "optimizer: {lr: 0.12345678901234567, "
                                                  "momentum: 0.35}\n", "run.yaml"));
  const std::string yaml = ConfigToYaml(c);
  EXPECT_NE(yaml.find("lr: 0.12345678901234566"), std::string::npos) << yaml;  // the double's own shortest text
  EXPECT_NE(yaml.find("momentum: 0.35"), std::string::npos) << yaml;
  ASSERT_OK_AND_ASSIGN(TrainConfig again, ParseConfig(yaml, "again.yaml"));
  EXPECT_EQ(again.optimizer.lr, c.optimizer.lr);
  EXPECT_EQ(ConfigToYaml(again), yaml);
}

// dist.device_comm: NCCL where every rank has a GPU of its own and NCCL loads everywhere; through
// the host where ranks share a GPU or NCCL is missing, unless NCCL was asked for by name.
TEST(DeviceComm, NcclWhereItCanRunElseTheHostUnlessNcclWasAskedFor) {
  std::string why;
  const Status missing = UnavailableError("NCCL could not be loaded (libnccl.so.2: not found)");
  ASSERT_OK_AND_ASSIGN(DeviceComm a, ChooseDeviceComm(DeviceComm::kAuto, 0, OkStatus(), &why));
  EXPECT_EQ(a, DeviceComm::kNccl);
  EXPECT_EQ(why, "every rank has a GPU of its own");
  ASSERT_OK_AND_ASSIGN(a, ChooseDeviceComm(DeviceComm::kAuto, 2, OkStatus(), &why));
  EXPECT_EQ(a, DeviceComm::kHost);
  EXPECT_EQ(why, "2 ranks share their GPU with another rank (NCCL refuses that)");
  ASSERT_OK_AND_ASSIGN(a, ChooseDeviceComm(DeviceComm::kAuto, 0, missing, &why));
  EXPECT_EQ(a, DeviceComm::kHost);
  EXPECT_EQ(why, missing.message());
  ASSERT_OK_AND_ASSIGN(a, ChooseDeviceComm(DeviceComm::kHost, 0, OkStatus(), &why));
  EXPECT_EQ(a, DeviceComm::kHost);
  ASSERT_OK_AND_ASSIGN(a, ChooseDeviceComm(DeviceComm::kNccl, 0, OkStatus(), &why));
  EXPECT_EQ(a, DeviceComm::kNccl);

  auto shared = ChooseDeviceComm(DeviceComm::kNccl, 2, OkStatus(), &why);
  EXPECT_EQ(shared.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(shared.status().message().find("dist.device_comm: nccl, but 2 ranks share their GPU"), std::string::npos)
      << shared.status().message();
  auto absent = ChooseDeviceComm(DeviceComm::kNccl, 0, missing, &why);
  EXPECT_EQ(absent.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(absent.status().message(), "dist.device_comm: nccl: " + missing.message());
}

// The training loader of every world size cuts the same global batches: rank r's batch k is
// samples [kG + rB, kG + (r+1)B) of the 1-rank order, and an epoch is records / G steps on every
// rank, even where the records past the last whole global batch would give each rank a share.
TEST(TrainSharding, EveryWorldSizeSeesTheSameGlobalBatchesAndEpochLength) {
  testing::TempDir dir;
  const auto path = prefetch::WriteDataset(dir / "d23", {.records = 23});  // 23 = 12 + 11
  ASSERT_OK_AND_ASSIGN(dataset::Dataset ds, dataset::Dataset::Open(path));
  ASSERT_OK_AND_ASSIGN(TrainConfig c, ParseConfig(fmt::format("data: {{train: {}, batch_size: 12, threads: 1, "
                                                              "image_size: 32}}\nmodel: {{preset: lenet, classes: 4}}\n",
                                                              path.string()),
                                                  "sharding.yaml"));
  auto batches = [&](int world) {
    std::vector<std::vector<int64_t>> global;  // per (epoch, batch): the ranks' indices in rank order
    for (int rank = 0; rank < world; ++rank) {
      prefetch::LoaderOptions o = TrainLoaderOptions(c, rank, world);
      o.device = prefetch::DeviceMode::kHost;
      o.epochs = 3;
      auto loader = prefetch::Loader::Create(ds, o);
      EXPECT_TRUE(loader.ok()) << loader.status().ToString();
      if (!loader.ok()) return global;
      EXPECT_EQ((*loader)->batches_per_epoch(), 1) << world << " ranks, rank " << rank;
      const auto seen = prefetch::Drain(**loader);
      if (global.size() < seen.size()) global.resize(seen.size());
      for (size_t k = 0; k < seen.size(); ++k) {
        global[k].insert(global[k].end(), seen[k].indices.begin(), seen[k].indices.end());
      }
    }
    return global;
  };
  const auto one = batches(1);
  ASSERT_EQ(one.size(), 3u);
  for (int world : {2, 3, 4, 6}) EXPECT_EQ(batches(world), one) << world << " ranks";
}

TEST(Schedule, ShapesAtKnownPoints) {
  ScheduleConfig s;
  s.type = "step";
  s.step_epochs = 2;
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 0, 10, 6), 1.0);
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 19, 10, 6), 1.0);
  EXPECT_NEAR(LearningRate(s, 1.0, 20, 10, 6), 0.1, 1e-12);
  EXPECT_NEAR(LearningRate(s, 1.0, 45, 10, 6), 0.01, 1e-12);
  s.type = "multistep";
  s.milestones = {1, 4};
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 9, 10, 6), 1.0);
  EXPECT_NEAR(LearningRate(s, 1.0, 10, 10, 6), 0.1, 1e-12);
  EXPECT_NEAR(LearningRate(s, 1.0, 40, 10, 6), 0.01, 1e-12);
  s.type = "cosine";
  s.warmup_epochs = 1;
  s.warmup_start = 0;
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 0, 10, 5), 0.0);
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 5, 10, 5), 0.5);
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 10, 10, 5), 1.0);
  EXPECT_NEAR(LearningRate(s, 1.0, 30, 10, 5), 0.5, 1e-12);  // half-way through the cosine
  EXPECT_NEAR(LearningRate(s, 1.0, 50, 10, 5), 0.0, 1e-12);
  s.type = "constant";
  s.warmup_epochs = 0;
  EXPECT_DOUBLE_EQ(LearningRate(s, 0.3, 123, 10, 5), 0.3);
}

Checkpoint SmallCheckpoint() {
  Checkpoint c;
  c.step = 42;
  c.steps_per_epoch = 10;
  c.seed = 7;
  c.backend = "cpu";
  c.config_yaml = "epochs: 3\n";
  c.tensors = {{"a.weight", {2, 3}, {1, 2, 3, 4, 5, 6}}, {"a.bias", {2}, {-1, 0.5}}};
  return c;
}

// A temporary file that a killed writer left is removed by the next pruning; one of a live
// process (a write in progress) is not.
TEST(Checkpoint, PruningRemovesTheTemporaryFilesOfDeadWriters) {
  testing::TempDir dir;
  std::filesystem::create_directories(dir / "checkpoints");
  const auto dead = dir / "checkpoints" / "step-0000000004.ckpt.tmp.2147483646";
  const auto live = dir / "checkpoints" / fmt::format("step-0000000005.ckpt.tmp.{}", ::getppid());
  const auto other = dir / "checkpoints" / "notes.tmp.2147483646";
  for (const auto& p : {dead, live, other}) std::ofstream(p) << "x";
  PruneCheckpoints(dir.path(), 3);
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_TRUE(std::filesystem::exists(live));
  EXPECT_TRUE(std::filesystem::exists(other));
}

TEST(Checkpoint, RoundTripAndDamageIsRefused) {
  const Checkpoint c = SmallCheckpoint();
  const auto bytes = SerializeCheckpoint(c);
  ASSERT_OK_AND_ASSIGN(Checkpoint back, ParseCheckpoint(bytes, "x.ckpt"));
  EXPECT_EQ(back.step, 42);
  EXPECT_EQ(back.config_yaml, c.config_yaml);
  ASSERT_EQ(back.tensors.size(), 2u);
  EXPECT_EQ(back.tensors[0].values, c.tensors[0].values);
  EXPECT_EQ(back.tensors[1].dims, c.tensors[1].dims);

  for (size_t cut : {size_t{0}, size_t{5}, bytes.size() / 2, bytes.size() - 1}) {
    auto r = ParseCheckpoint(std::span(bytes).first(cut), "x.ckpt");
    ASSERT_FALSE(r.ok()) << cut;
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
    EXPECT_NE(r.status().message().find("checkpoint x.ckpt: "), std::string::npos);
  }
  for (size_t pos : {size_t{3}, size_t{30}, bytes.size() - 10}) {
    auto flipped = bytes;
    flipped[pos] ^= std::byte{0x10};
    auto r = ParseCheckpoint(flipped, "x.ckpt");
    ASSERT_FALSE(r.ok()) << pos;
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
  }
  auto r = ParseCheckpoint(std::span(bytes).first(bytes.size() - 8), "x.ckpt");
  EXPECT_NE(r.status().message().find("checksum mismatch"), std::string::npos) << r.status().ToString();
  // Cut inside the fixed header: the magic is there, so "truncated", not "no STOKECKP header".
  r = ParseCheckpoint(std::span(bytes).first(12), "x.ckpt");
  EXPECT_NE(r.status().message().find("truncated: 12 bytes"), std::string::npos) << r.status().ToString();
  r = ParseCheckpoint(std::span(bytes).first(5), "x.ckpt");
  EXPECT_NE(r.status().message().find("no STOKECKP header"), std::string::npos) << r.status().ToString();
}

// ------------------------------------------------------------------ the training loop

class TrainLoop : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    PackSmallSyntheticSet(*dir_);
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }

  // A run that prints nothing and draws no plot, stopping at step `max_steps` (0: at its end).
  static TrainRunOptions Quiet(int64_t max_steps = 0) {
    TrainRunOptions o;
    o.progress = false;
    o.plot = false;
    o.max_steps = max_steps;
    return o;
  }

  static TrainConfig Config(const std::string& run, int epochs, const std::string& extra = "") {
    const std::string yaml = fmt::format(R"(data:
  train: {0}/train.lmdb
  val: {0}/train_val.lmdb
  batch_size: 16
  threads: 2
  image_size: 16
  val_resize: 18
  augment: {{scale: [0.5, 1.0]}}
model:
  classes: 4
  layers:
{4}    - {{type: dropout, p: 0.2}}
    - {{type: linear, out: 4}}
optimizer: {{lr: 0.4, momentum: 0.9, nesterov: true, weight_decay: 0.0005}}
schedule: {{type: cosine, warmup_epochs: 1}}
epochs: {1}
seed: 5
compute_threads: 2
backend: cpu
run_dir: {0}/{2}
log_every_steps: 3
{3})",
                                         dir_->path().string(), epochs, run, extra, kSmallConvBnLayers);
    auto c = ParseConfig(yaml, run + ".yaml");
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return *c;
  }

  static std::vector<NamedTensor> FinalState(const TrainSummary& s) {
    auto ck = LoadCheckpoint(s.checkpoint);
    EXPECT_TRUE(ck.ok()) << ck.status().ToString();
    return ck.ok() ? ck->tensors : std::vector<NamedTensor>{};
  }

  // (type, step, loss, top-1) of every train, epoch and val line of a metrics file.
  static std::vector<std::tuple<std::string, int64_t, double, double>> LossLines(const std::filesystem::path& path) {
    std::vector<std::tuple<std::string, int64_t, double, double>> out;
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      const std::string type = j.value("type", "");
      if (type != "train" && type != "epoch" && type != "val") continue;
      out.emplace_back(type, j.value("step", int64_t{-1}), j.value("loss", -1.0), j.value("top1", -1.0));
    }
    return out;
  }

  static testing::TempDir* dir_;
};
testing::TempDir* TrainLoop::dir_ = nullptr;

TEST_F(TrainLoop, LearnsAndWritesMetricsConfigAndPlot) {
  TrainConfig c = Config("learn", 6);
  TrainRunOptions run;
  run.progress = false;
  ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(c, run));
  EXPECT_EQ(s.steps_per_epoch, 128 / 16);
  EXPECT_EQ(s.steps, 6 * 8);
  EXPECT_FALSE(s.stopped);
  ASSERT_TRUE(s.has_val);
  EXPECT_EQ(s.val.count, 32);
  EXPECT_GE(s.val.top1_rate(), 0.75) << FormatSummary(s);  // 4 classes: chance is 0.25
  EXPECT_GT(s.images_per_s, 0);
  // The evaluations and checkpoints inside the loop are counted apart: the throughput and the
  // data-wait are the steps' (an interval holding an evaluation read a tenth of its rate).
  EXPECT_GT(s.paused_seconds, 0);
  EXPECT_LT(s.paused_seconds, s.seconds);
  EXPECT_NE(FormatSummary(s).find(" s of it evaluating and checkpointing)"), std::string::npos) << FormatSummary(s);

  // The first logged training loss is well above the last.
  std::ifstream in(dir_->path() / "learn/metrics.jsonl");
  std::string line;
  std::vector<double> losses;
  int vals = 0;
  while (std::getline(in, line)) {
    if (line.find(R"("type":"train")") != std::string::npos) {
      losses.push_back(std::stod(line.substr(line.find(R"("loss":)") + 7)));
    }
    vals += line.find(R"("type":"val")") != std::string::npos ? 1 : 0;
  }
  ASSERT_GE(losses.size(), 10u);
  EXPECT_LT(losses.back(), 0.5 * losses.front());
  EXPECT_EQ(vals, 6);  // every epoch
  EXPECT_TRUE(std::filesystem::exists(dir_->path() / "learn/config.yaml"));
  EXPECT_TRUE(std::filesystem::exists(dir_->path() / "learn/curves.svg"));
  EXPECT_EQ(ListCheckpoints(dir_->path() / "learn").size(), 2u);  // keep: 2

  // A second fresh run into the same directory is refused rather than mixing two runs.
  auto again = Train(c, run);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("--resume"), std::string::npos);
}

TEST_F(TrainLoop, ResumeGivesIdenticalWeights) {
  // 3 epochs of 8 steps. Uninterrupted, versus stopped at step 11 (mid-epoch, between
  // checkpoints) and resumed, versus stopped at 16 (an epoch boundary) and resumed.
  TrainRunOptions quiet = Quiet();
  ASSERT_OK_AND_ASSIGN(TrainSummary full, Train(Config("full", 3), quiet));
  ASSERT_EQ(full.steps, 24);
  const auto want = FinalState(full);
  for (int64_t stop_at : {11, 16}) {
    const std::string name = fmt::format("half{}", stop_at);
    TrainRunOptions first = quiet;
    first.max_steps = stop_at;
    ASSERT_OK_AND_ASSIGN(TrainSummary a, Train(Config(name, 3), first));
    EXPECT_TRUE(a.stopped);
    EXPECT_EQ(a.steps, stop_at);
    TrainRunOptions second = quiet;
    second.resume = "latest";
    ASSERT_OK_AND_ASSIGN(TrainSummary b, Train(Config(name, 3), second));
    EXPECT_EQ(b.start_step, stop_at);
    EXPECT_EQ(b.steps, 24);
    const auto got = FinalState(b);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].name, want[i].name);
      EXPECT_EQ(got[i].values, want[i].values) << name << ": " << want[i].name << " differs";
    }
    EXPECT_NEAR(b.val.loss(), full.val.loss(), 1e-12);
    // The metrics too: the lines after the resume average the steps before it as well (the
    // interval's and the epoch's sums travel in the checkpoint).
    EXPECT_EQ(LossLines(dir_->path() / name / "metrics.jsonl"), LossLines(dir_->path() / "full/metrics.jsonl"))
        << name;
  }
}

// --max-steps counts from the run's start: a resume whose checkpoint is at or past it would take no
// step, so it is refused, naming the checkpoint's step, before anything in the run folder moves.
TEST_F(TrainLoop, AResumeAtOrPastMaxStepsIsRefused) {
  TrainRunOptions first = Quiet(6);
  const auto run_dir = dir_->path() / "short";
  ASSERT_OK(Train(Config("short", 2), first).status());
  const auto metrics_before = LossLines(run_dir / "metrics.jsonl");
  for (int64_t n : {6, 3}) {
    TrainRunOptions again = first;
    again.resume = "latest";
    again.max_steps = n;
    auto r = Train(Config("short", 2), again);
    ASSERT_FALSE(r.ok()) << "--max-steps " << n;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(fmt::format("--max-steps {}: checkpoint ", n)), std::string::npos)
        << r.status().message();
    EXPECT_NE(r.status().message().find("is at step 6 already"), std::string::npos) << r.status().message();
  }
  EXPECT_EQ(ListCheckpoints(run_dir).back(), CheckpointPath(run_dir, 6));
  // A resume into a run_dir that holds nothing to resume from fails without making the folder.
  TrainConfig elsewhere = Config("new/parent/run", 2);
  TrainRunOptions nothing = first;
  nothing.resume = "latest";
  auto none = Train(elsewhere, nothing);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("no checkpoints in"), std::string::npos) << none.status().message();
  EXPECT_FALSE(std::filesystem::exists(dir_->path() / "new")) << "a failed resume left an empty run_dir";
  EXPECT_EQ(LossLines(run_dir / "metrics.jsonl"), metrics_before);
  // Past the checkpoint, the resume trains on to it.
  TrainRunOptions on = first;
  on.resume = "latest";
  on.max_steps = 9;
  ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(Config("short", 2), on));
  EXPECT_EQ(s.start_step, 6);
  EXPECT_EQ(s.steps, 9);
}

TEST_F(TrainLoop, ResumingFromAnOlderCheckpointSetsTheLaterOnesAside) {
  // The run's checkpoints at steps 16 and 24 (keep: 2); resumed from 16 and stopped at 20, the run
  // goes on from 20: step 24 of the first run moves aside instead of staying the "latest" (or
  // the new checkpoint being pruned at once as the oldest).
  TrainRunOptions quiet = Quiet();
  const auto run_dir = dir_->path() / "branch";
  ASSERT_OK(Train(Config("branch", 3), quiet).status());
  ASSERT_EQ(ListCheckpoints(run_dir).size(), 2u);
  TrainRunOptions branch = quiet;
  branch.resume = CheckpointPath(run_dir, 16).string();
  branch.max_steps = 20;
  ASSERT_OK_AND_ASSIGN(TrainSummary b, Train(Config("branch", 3), branch));
  EXPECT_EQ(b.checkpoint, CheckpointPath(run_dir, 20).string());
  const auto kept = ListCheckpoints(run_dir);
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_EQ(kept.back(), CheckpointPath(run_dir, 20));
  EXPECT_TRUE(std::filesystem::exists(run_dir / "checkpoints/after-step-0000000016/step-0000000024.ckpt"));
  TrainRunOptions latest = quiet;
  latest.resume = "latest";
  ASSERT_OK_AND_ASSIGN(TrainSummary c, Train(Config("branch", 3), latest));
  EXPECT_EQ(c.start_step, 20);
  EXPECT_EQ(c.steps, 24);
  // From step 20 twice: the second set of later checkpoints gets a folder of its own.
  TrainRunOptions again = quiet;
  again.resume = CheckpointPath(run_dir, 20).string();
  ASSERT_OK(Train(Config("branch", 3), again).status());
  ASSERT_OK(Train(Config("branch", 3), again).status());
  EXPECT_TRUE(std::filesystem::exists(run_dir / "checkpoints/after-step-0000000020/step-0000000024.ckpt"));
  EXPECT_TRUE(std::filesystem::exists(run_dir / "checkpoints/after-step-0000000020.2/step-0000000024.ckpt"));
}

// A model whose running statistics went to infinity while its loss stayed finite (batch norm
// trains on the batch's statistics) is a diverged run: it ends with an error naming the tensor, and
// its checkpoint is not written (it pruned the last good one, and eval, predict and export refuse
// it). The infinity is put into a checkpoint, and the run resumed from it.
TEST_F(TrainLoop, ADivergedModelEndsTheRunAndKeepsTheLastGoodCheckpoint) {
  TrainRunOptions quiet = Quiet();
  const auto run_dir = dir_->path() / "diverge";
  ASSERT_OK(Train(Config("diverge", 1), quiet).status());
  const auto first = ListCheckpoints(run_dir);
  ASSERT_EQ(first.size(), 1u);
  ASSERT_OK_AND_ASSIGN(Checkpoint ck, LoadCheckpoint(first.back()));
  std::string damaged;
  for (NamedTensor& t : ck.tensors) {
    if (damaged.empty() && t.name.ends_with(".running_var")) {
      t.values[0] = std::numeric_limits<float>::infinity();
      damaged = t.name;
    }
  }
  ASSERT_FALSE(damaged.empty());
  ASSERT_OK(SaveCheckpoint(first.back(), ck));
  TrainRunOptions resume = quiet;
  resume.resume = "latest";
  auto r = Train(Config("diverge", 2), resume);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(fmt::format("the run diverged: tensor '{}' holds 1 of", damaged)),
            std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find(first.back().string()), std::string::npos) << r.status().message();
  EXPECT_EQ(ListCheckpoints(run_dir), first);
}

// What ModelDifference compares: the layers' kinds, settings and inputs, not a dropout's p (it does
// nothing in evaluation, export removes it, and a resumed run may change it like the learning rate).
TEST(ModelDifference, ComparesWhatTheLayersComputeNotDropoutsP) {
  ModelSpec a;
  a.layers = {{.name = "c", .type = LayerType::kConv, .out = 4, .kernel = 3, .pad = 1},
              {.name = "d", .type = LayerType::kDropout, .p = 0.5},
              {.name = "fc", .type = LayerType::kLinear, .out = 3}};
  ModelSpec b = a;
  b.layers[1].p = 0.2;
  EXPECT_EQ(ModelDifference(a, "a", b, "b"), "");
  b.layers[0].stride = 2;
  EXPECT_EQ(ModelDifference(a, "a", b, "b"),
            "layer 0 is 'c' (conv out 4 kernel 3 stride 1 pad 1) in a, 'c' (conv out 4 kernel 3 stride 2 pad 1) in b");
  b = a;
  b.layers.pop_back();
  EXPECT_EQ(ModelDifference(a, "a", b, "b"), "a has 3 layers, b has 2");
}

// A resume with a config of another model whose tensors are the same (a ReLU given as a max pool
// of one pixel) is refused, naming the layer: it trained on another function of the weights.
TEST_F(TrainLoop, AResumeWithAnotherModelOfTheSameTensorsIsRefused) {
  TrainRunOptions quiet = Quiet(4);
  ASSERT_OK(Train(Config("arch", 2), quiet).status());
  TrainConfig other = Config("arch", 2);
  auto relu = std::find_if(other.model.layers.begin(), other.model.layers.end(),
                           [](const LayerSpec& l) { return l.type == LayerType::kRelu; });
  ASSERT_NE(relu, other.model.layers.end());
  relu->type = LayerType::kMaxPool;
  relu->kernel = 1;
  relu->stride = 1;
  TrainRunOptions resume = quiet;
  resume.resume = "latest";
  resume.max_steps = 0;
  auto r = Train(other, resume);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("is of another model than this config describes: layer 2"), std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("(maxpool kernel 1 stride 1 pad 0 of "), std::string::npos)
      << r.status().message();
  EXPECT_OK(Train(Config("arch", 2), resume).status());
}

TEST_F(TrainLoop, ACheckpointOrValidationSetOfAnotherDatasetIsRefused) {
  TrainRunOptions quiet = Quiet(2);
  const auto run_dir = dir_->path() / "other";
  ASSERT_OK_AND_ASSIGN(TrainSummary a, Train(Config("other", 1), quiet));
  ASSERT_OK_AND_ASSIGN(Checkpoint ck, LoadCheckpoint(a.checkpoint));
  TrainRunOptions resume = quiet;
  resume.resume = "latest";
  resume.max_steps = 3;
  // Another dataset's class names.
  Checkpoint renamed = ck;
  renamed.step = 3;
  renamed.classes[1] = "zebra";
  ASSERT_OK(SaveCheckpoint(CheckpointPath(run_dir, 3), renamed));
  auto r = Train(Config("other", 1), resume);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("is of another dataset: its class 1 is 'zebra'"), std::string::npos)
      << r.status().ToString();
  // A tensor this model has no place for (another model's state).
  Checkpoint extra = ck;
  extra.step = 3;
  extra.tensors.push_back({"head.bias", {4}, std::vector<float>(4, 0.f)});
  ASSERT_OK(SaveCheckpoint(CheckpointPath(run_dir, 3), extra));
  r = Train(Config("other", 1), resume);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'head.bias', which this model has no place for"), std::string::npos)
      << r.status().ToString();
  // A validation set whose labels name other classes.
  const auto images = dir_->path() / "renamed_images";
  std::filesystem::copy(dir_->path() / "images", images, std::filesystem::copy_options::recursive);
  std::vector<std::filesystem::path> folders;
  for (const auto& e : std::filesystem::directory_iterator(images)) folders.push_back(e.path());
  std::sort(folders.begin(), folders.end());
  std::filesystem::rename(folders[1], images / "zebra");
  pack::PackOptions po;
  po.source = images;
  po.output = dir_->path() / "renamed.lmdb";
  po.progress = false;
  ASSERT_OK(pack::Pack(po).status());
  TrainConfig c = Config("renamed_val", 1);
  c.data.val = (dir_->path() / "renamed.lmdb").string();
  r = Train(c, quiet);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("renamed.lmdb: class 1 is"), std::string::npos) << r.status().ToString();
}

TEST_F(TrainLoop, TensorBoardEventsHoldTheMetricsAcrossAResume) {
  if (!EventWriter::Available()) GTEST_SKIP() << "this build has no TensorBoard event files (no protobuf)";
  TrainRunOptions first = Quiet(11);  // checkpoints at 8 (the epoch's end) and 11 (the stop)
  ASSERT_OK(Train(Config("tb", 2), first).status());
  // Resuming from step 8 (as after a crash past it) replaces what followed: steps 9-11.
  const auto run_dir = dir_->path() / "tb";
  TrainRunOptions second = first;
  second.max_steps = 0;
  second.resume = CheckpointPath(run_dir, 8).string();
  ASSERT_OK(Train(Config("tb", 2), second).status());

  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(run_dir / "tensorboard")) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u) << "a resume replaces the event files";
  ASSERT_OK_AND_ASSIGN(auto events, ReadScalarEvents(files[0]));
  // The same scalars as metrics.jsonl, in the same order, at the same steps and times.
  std::vector<ScalarEvent> want;
  std::ifstream in(run_dir / "metrics.jsonl");
  std::string line;
  int starts = 0, ends = 0;
  while (std::getline(in, line)) {
    starts += line.find(R"("type":"start")") != std::string::npos ? 1 : 0;
    ends += line.find(R"("type":"end")") != std::string::npos ? 1 : 0;
    MetricsScalars m = ScalarsOfMetricsLine(line, -1);
    EXPECT_NE(m.wall_time, -1) << "every line has its time: " << line;
    for (const Scalar& sc : m.scalars) want.push_back({m.step, m.wall_time, sc.tag, sc.value});
  }
  EXPECT_EQ(starts, 2);
  EXPECT_EQ(ends, 1);  // the stop at step 11 came after the checkpoint resumed from: trimmed with steps 9-11
  ASSERT_EQ(events.size(), want.size());
  ASSERT_GT(events.size(), 20u);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(events[i].step, want[i].step) << i;
    EXPECT_EQ(events[i].tag, want[i].tag) << i;
    EXPECT_EQ(events[i].value, want[i].value) << i;
    EXPECT_EQ(events[i].wall_time, want[i].wall_time) << i;
  }
  // Step 9's training line was written twice (before the stop and after the resume): it appears once.
  int64_t last = -1;
  for (const ScalarEvent& e : events) {
    if (e.tag != "train/loss") continue;
    EXPECT_GT(e.step, last) << "steps after the resumed checkpoint appear once";
    last = e.step;
  }
}

// A small conv net over `data` (batch 16, 16x16 images, 10% of bad records allowed), logging every
// step; `validate`: the same dataset as data.val.
Result<TrainConfig> SmallConvConfig(const std::filesystem::path& data, const std::filesystem::path& run_dir,
                                    int epochs, bool validate) {
  return ParseConfig(fmt::format(R"(data:
  train: {0}
{3}  batch_size: 16
  threads: 2
  image_size: 16
  max_skip_fraction: 0.1
model:
  classes: 4
  layers:
    - {{type: conv, out: 4, kernel: 3}}
    - {{type: global_avgpool}}
    - {{type: linear, out: 4}}
epochs: {2}
backend: cpu
compute_threads: 2
run_dir: {1}
log_every_steps: 1
)",
                                 data.string(), run_dir.string(), epochs,
                                 validate ? fmt::format("  val: {}\n", data.string()) : std::string()),
                     run_dir.filename().string() + ".yaml");
}

TEST_F(TrainLoop, SkippedRecordsAreWrittenToTheMetricsAsTheyHappen) {
  const auto data = dir_->path() / "with_bad.lmdb";
  prefetch::WriteDataset(data, {.records = 64, .bad = {5, 17}});
  ASSERT_OK_AND_ASSIGN(TrainConfig c, SmallConvConfig(data, dir_->path() / "bad_run", 2, /*validate=*/true));
  TrainRunOptions run = Quiet();
  ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(c, run));
  EXPECT_EQ(s.bad_records, 2);
  // Validation over the same records scores each good one once: the loader's stand-ins for the two
  // bad ones (duplicates of other records) are left out.
  EXPECT_EQ(s.val.count, 62);
  std::ifstream in(dir_->path() / "bad_run" / "metrics.jsonl");
  std::string line;
  std::vector<int64_t> indices;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] != "bad_record") continue;
    indices.push_back(j["index"]);
    EXPECT_NE(j["reason"].get<std::string>().find(fmt::format("class/{}.jpg", j["index"].get<int64_t>())),
              std::string::npos)
        << line;
    EXPECT_GE(j["step"].get<int64_t>(), 1);
    EXPECT_LE(j["step"].get<int64_t>(), 4) << "reported within the epoch that met it";
  }
  std::sort(indices.begin(), indices.end());
  EXPECT_EQ(indices, (std::vector<int64_t>{5, 17})) << "each once, though both epochs met them";
}

// A run's config.yaml names its datasets and folder absolutely: given as --config, it resumes the
// run from any working directory.
TEST_F(TrainLoop, TheRunsConfigResumesFromAnotherDirectory) {
  TrainConfig c = Config("relative", 2);
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir_->path());
  c.data.train = "train.lmdb";
  c.data.val = "./train_val.lmdb";
  c.run_dir = "relative";
  TrainRunOptions quiet = Quiet(5);
  auto first = Train(c, quiet);
  std::filesystem::current_path(cwd);
  ASSERT_OK(first.status());
  const auto saved = dir_->path() / "relative" / "config.yaml";
  ASSERT_OK_AND_ASSIGN(TrainConfig again, LoadConfig(saved.string()));
  EXPECT_EQ(again.data.train, (dir_->path() / "train.lmdb").string());
  EXPECT_EQ(again.data.val, (dir_->path() / "train_val.lmdb").string());
  EXPECT_EQ(again.run_dir, (dir_->path() / "relative").string());
  quiet.max_steps = 0;
  quiet.resume = "latest";
  ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(again, quiet));
  EXPECT_EQ(s.start_step, 5);
  EXPECT_EQ(s.steps, 16);
}

TEST_F(TrainLoop, AResumeReportsEachBadRecordOnceAndDropsACutLine) {
  const auto data = dir_->path() / "with_bad_resumed.lmdb";
  prefetch::WriteDataset(data, {.records = 64, .bad = {5, 17}});
  const auto run_dir = dir_->path() / "bad_resumed";
  ASSERT_OK_AND_ASSIGN(TrainConfig c, SmallConvConfig(data, run_dir, 3, /*validate=*/false));
  TrainRunOptions run = Quiet(6);  // into the second epoch: both bad records reported in the first
  ASSERT_OK(Train(c, run).status());
  {
    // A crash (or a full disk) cut the last line written after the checkpoint short.
    std::ofstream out(run_dir / "metrics.jsonl", std::ios::app);
    out << R"({"data_wait":0.1,"epoch":1.75,"images_per_s":10,"lr":0.1,"step":7,"ti)";
  }
  run.max_steps = 0;
  run.resume = "latest";
  ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(c, run));
  EXPECT_EQ(s.start_step, 6);
  EXPECT_EQ(s.steps, 12);
  EXPECT_EQ(s.bad_records, 2);
  std::ifstream in(run_dir / "metrics.jsonl");
  std::string line;
  std::vector<int64_t> indices;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_TRUE(j.is_object()) << "every line is whole: " << line;
    if (j["type"] == "bad_record") indices.push_back(j["index"]);
  }
  std::sort(indices.begin(), indices.end());
  EXPECT_EQ(indices, (std::vector<int64_t>{5, 17})) << "each once, though the resumed epochs met them again";
}

// The skip budget is the run's, across a resume: records 5 and 17 (the first two steps) use the
// whole budget of two, so record 40 after the resume ends the run as it would have ended it
// uninterrupted (a fresh count would have allowed it).
TEST_F(TrainLoop, AResumedRunHoldsTheBadRecordsMetBeforeItAgainstTheBudget) {
  const auto data = dir_->path() / "budget_resumed.lmdb";
  prefetch::WriteDataset(data, {.records = 64, .bad = {5, 17, 40}});
  const auto run_dir = dir_->path() / "budget_resumed";
  ASSERT_OK_AND_ASSIGN(TrainConfig c, SmallConvConfig(data, run_dir, 1, /*validate=*/false));
  c.data.shuffle = "sequential";
  c.data.max_skip_fraction = 0.04;  // 2 of 64
  TrainRunOptions run = Quiet(2);
  ASSERT_OK_AND_ASSIGN(TrainSummary first, Train(c, run));
  EXPECT_GE(first.bad_records, 2) << "and record 40 when the ring read its batch ahead";
  run.max_steps = 0;
  run.resume = "latest";
  auto resumed = Train(c, run);
  EXPECT_EQ(resumed.status().code(), StatusCode::kCorrupt) << resumed.status().ToString();
  EXPECT_NE(resumed.status().message().find("3 bad records"), std::string::npos) << resumed.status().ToString();
}

// eval.every_steps evaluates every such step, the ones that end an epoch too (they were left out
// when eval.every_epochs did not evaluate them), and none twice.
TEST_F(TrainLoop, EveryStepsEvaluatesAtEpochEndsToo) {
  TrainRunOptions quiet = Quiet();
  ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(Config("every_step", 2, "eval: {every_steps: 1, every_epochs: 0}\n"), quiet));
  std::vector<int64_t> evaluated, expected;
  for (const auto& [type, step, loss, top1] : LossLines(dir_->path() / "every_step" / "metrics.jsonl")) {
    if (type == "val") evaluated.push_back(step);
  }
  for (int64_t step = 1; step <= s.steps; ++step) expected.push_back(step);
  EXPECT_EQ(evaluated, expected);
}

// A checkpoint at a step whose evaluation is not in the metrics (the run was killed between the two,
// or stopped there before evaluating): the resumed run evaluates that step first. The run's stale
// temporaries are removed.
TEST_F(TrainLoop, AResumeEvaluatesTheStepItsCheckpointOwesAnEvaluation) {
  const std::string eval_at_4 = "eval: {every_steps: 4, every_epochs: 0}\n";
  ASSERT_OK_AND_ASSIGN(TrainSummary first, Train(Config("owed", 2, "eval: {every_epochs: 0}\n"), Quiet(4)));
  ASSERT_TRUE(first.stopped);
  // What a run killed while rewriting its metrics or config left (pid 2147483646 is no process) goes
  // when the next run starts there.
  const auto run_dir = dir_->path() / "owed";
  for (const char* name : {"metrics.jsonl.tmp.2147483646", "config.yaml.tmp.2147483646"}) {
    std::ofstream(run_dir / name) << "left by a killed run";
  }
  TrainRunOptions resume = Quiet();
  resume.resume = "latest";
  ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(Config("owed", 2, eval_at_4), resume));
  EXPECT_EQ(s.start_step, 4);
  EXPECT_FALSE(std::filesystem::exists(run_dir / "metrics.jsonl.tmp.2147483646"));
  EXPECT_FALSE(std::filesystem::exists(run_dir / "config.yaml.tmp.2147483646"));
  std::vector<int64_t> evaluated, expected;
  for (const auto& [type, step, loss, top1] : LossLines(run_dir / "metrics.jsonl")) {
    if (type == "val") evaluated.push_back(step);
  }
  for (int64_t step = 4; step <= s.steps; step += 4) expected.push_back(step);
  EXPECT_EQ(evaluated, expected);
}

TEST_F(TrainLoop, ResumingAFinishedRunEvaluatesNothingTwice) {
  TrainRunOptions quiet = Quiet();
  ASSERT_OK_AND_ASSIGN(TrainSummary done, Train(Config("finished", 1), quiet));
  const auto run_dir = dir_->path() / "finished";
  const auto checkpoints = ListCheckpoints(run_dir);
  TrainRunOptions again = quiet;
  again.resume = "latest";
  ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(Config("finished", 1), again));
  EXPECT_EQ(s.start_step, done.steps);
  EXPECT_EQ(s.steps, done.steps);
  EXPECT_EQ(ListCheckpoints(run_dir), checkpoints) << "nothing trained, nothing saved";
  // Into another run_dir, the same checkpoint is saved there: that run can be resumed in turn.
  TrainRunOptions copy = quiet;
  copy.resume = checkpoints.back().string();
  ASSERT_OK(Train(Config("finished_copy", 1), copy).status());
  EXPECT_EQ(ListCheckpoints(dir_->path() / "finished_copy").size(), 1u);
  int vals_at_end = 0;
  for (const auto& [type, step, loss, top1] : LossLines(run_dir / "metrics.jsonl")) {
    if (type == "val" && step == done.steps) vals_at_end++;
  }
  EXPECT_EQ(vals_at_end, 1) << "the final evaluation is in the metrics once";
  if (EventWriter::Available()) {
    std::vector<std::filesystem::path> files;
    for (const auto& e : std::filesystem::directory_iterator(run_dir / "tensorboard")) files.push_back(e.path());
    ASSERT_EQ(files.size(), 1u);
    ASSERT_OK_AND_ASSIGN(auto events, ReadScalarEvents(files[0]));
    EXPECT_EQ(std::count_if(events.begin(), events.end(),
                            [&](const ScalarEvent& e) { return e.tag == "val/loss" && e.step == done.steps; }),
              1);
  }
}

TEST_F(TrainLoop, DamagedCheckpointIsRefusedAndThePreviousOneStillWorks) {
  TrainRunOptions quiet = Quiet(16);  // checkpoints at steps 8 and 16
  ASSERT_OK(Train(Config("damage", 3), quiet).status());
  const auto run_dir = dir_->path() / "damage";
  auto all = ListCheckpoints(run_dir);
  ASSERT_EQ(all.size(), 2u);
  const auto newest = all.back(), previous = all.front();
  const auto before = testing::ReadBytes(previous);

  // Truncated: refused, naming the file; nothing else changes.
  auto bytes = testing::ReadBytes(newest);
  bytes.resize(bytes.size() / 2);
  testing::WriteBytes(newest, bytes);
  TrainRunOptions resume = quiet;
  resume.max_steps = 0;
  resume.resume = "latest";
  auto r = Train(Config("damage", 3), resume);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(r.status().message().find(newest.string()), std::string::npos) << r.status().ToString();
  EXPECT_EQ(testing::ReadBytes(previous), before);

  // Bit-flipped: refused too.
  bytes = testing::ReadBytes(previous);
  bytes[bytes.size() / 2] ^= std::byte{1};
  testing::WriteBytes(newest, bytes);
  r = Train(Config("damage", 3), resume);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("checksum mismatch"), std::string::npos) << r.status().ToString();

  // The previous checkpoint resumes the run to the end.
  resume.resume = previous.string();
  ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(Config("damage", 3), resume));
  EXPECT_EQ(s.start_step, 8);
  EXPECT_EQ(s.steps, 24);

  // A checkpoint of another model is refused by tensor name.
  resume.resume = s.checkpoint;
  TrainConfig other = Config("damage", 3);
  other.model.layers[0].out = 6;
  r = Train(other, resume);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("does not fit this model"), std::string::npos) << r.status().ToString();
}

TEST_F(TrainLoop, DiskFullDuringACheckpointLeavesThePreviousOneUsable) {
  TrainRunOptions quiet = Quiet(8);  // one checkpoint, at step 8
  ASSERT_OK(Train(Config("diskfull", 3), quiet).status());
  const auto run_dir = dir_->path() / "diskfull";
  const auto first = ListCheckpoints(run_dir);
  ASSERT_EQ(first.size(), 1u);
  const auto before = testing::ReadBytes(first[0]);
  TrainRunOptions resume = quiet;
  resume.max_steps = 0;
  resume.resume = "latest";
  {
    // Smaller than a checkpoint of this model: the step-16 checkpoint cannot be written.
    testing::FileSizeLimit full_disk(before.size() / 2);
    auto r = Train(Config("diskfull", 3), resume);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kIoError) << r.status().ToString();
    EXPECT_NE(r.status().message().find("step-0000000016.ckpt"), std::string::npos) << r.status().ToString();
  }
  // Nothing half-written is left, and the previous checkpoint is as it was.
  const auto after = ListCheckpoints(run_dir);
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(testing::ReadBytes(after[0]), before);
  for (const auto& e : std::filesystem::directory_iterator(run_dir / "checkpoints")) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  }
  // With space again the run resumes from it and finishes.
  ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(Config("diskfull", 3), resume));
  EXPECT_EQ(s.start_step, 8);
  EXPECT_EQ(s.steps, 24);
}

TEST_F(TrainLoop, BadDatasetAndBatchErrors) {
  TrainConfig c = Config("bad", 1);
  c.data.train = (dir_->path() / "missing.lmdb").string();
  TrainRunOptions quiet;
  quiet.progress = false;
  auto r = Train(c, quiet);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("missing.lmdb"), std::string::npos) << r.status().ToString();

  c = Config("bad", 1);
  c.data.batch_size = 1000;
  r = Train(c, quiet);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("data.batch_size 1000 is larger than the 128 records"), std::string::npos)
      << r.status().ToString();

  c = Config("bad", 1);
  c.model.classes = 3;
  c.model.layers.back().out = 3;
  r = Train(c, quiet);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("model.classes is 3, but"), std::string::npos) << r.status().ToString();

  // A file where the checkpoints' folder goes is found before the first step, not at the first
  // checkpoint an epoch later.
  c = Config("file-for-checkpoints", 1);
  std::filesystem::create_directories(c.run_dir);
  std::ofstream(std::filesystem::path(c.run_dir) / "checkpoints") << "not a folder";
  r = Train(c, quiet);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cannot make " + (std::filesystem::path(c.run_dir) / "checkpoints").string()),
            std::string::npos)
      << r.status().ToString();
}

}  // namespace
}  // namespace stoke::train
