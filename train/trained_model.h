// A trained model as the tools after training see it (export, eval, predict): a checkpoint, the
// resolved config it was trained with (stored in the checkpoint) or one given instead, and the
// class names.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/network.h"

namespace stoke::train {

struct TrainedModelSource {
  std::filesystem::path run_dir;     // its newest checkpoint, when `checkpoint` is empty
  std::filesystem::path checkpoint;  // a checkpoint file
  std::filesystem::path config;      // optional: a YAML config instead of the checkpoint's own
};

struct TrainedModel {
  TrainConfig config;
  Checkpoint checkpoint;
  std::filesystem::path checkpoint_path;
  std::filesystem::path config_path;    // "" when the checkpoint's own config is used
  std::vector<std::string> classes;     // model.classes names: the checkpoint's, else the training
                                        // dataset's, numbered for the rest
};

// Reads the checkpoint (kCorrupt naming the file when it is truncated or damaged; kNotFound for a
// run dir without checkpoints) and its config (a config that does not parse names its file). The
// model of the config must fit the checkpoint's tensors: kInvalidArgument naming both files and
// the first tensor that differs otherwise.
Result<TrainedModel> LoadTrainedModel(const TrainedModelSource& source);

// The CPU (or, with backend "cuda"/"auto", the configured) backend for up to `batch` samples at a
// time, holding the checkpoint's state. threads 0: the config's compute_threads.
Result<std::unique_ptr<Network>> CreateTrainedNetwork(const TrainedModel& model, const std::string& backend,
                                                      int batch, int threads);

// "checkpoint F" or "checkpoint F with config C", for messages.
std::string Describe(const TrainedModel& model);

}  // namespace stoke::train
