// The training configuration: one struct with every default, read from YAML with strict checks.
// Every error names the file, line, key path and what was expected, e.g.
//   run.yaml:12: optimizer.momentum: 1.5 is out of range; expected a number in [0, 1)
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "augment/transform.h"
#include "common/status.h"
#include "dist/reducer.h"
#include "prefetch/loader.h"
#include "train/model.h"
#include "train/network.h"
#include "train/schedule.h"

namespace stoke::train {

struct DataConfig {
  std::string train;  // packed training dataset (required)
  std::string val;    // packed validation dataset ("" = no evaluation)
  int batch_size = 128;
  int threads = 0;     // decoding threads; 0 = every usable core (affinity mask, cgroup CPU quota)
  int ring = 4;        // batch buffers in the prefetch ring
  std::string shuffle = "full";  // full | block | sequential
  // shuffle: block (datasets larger than memory): blocks of consecutive records are read whole,
  // and samples are mixed within a window of blocks. See docs/LARGE_DATASETS.md.
  int64_t block_size = 64;  // records per block; > 0
  int window_blocks = 8;    // blocks per window; > 0
  // The storage stage: records read ahead in sampler order (prefetch/storage.h).
  bool io_read_ahead = true;  // false: decoders fault records in through the map
  int io_memory_mb = 0;       // read-ahead budget; 0: prefetch/storage.h's default (three block windows, or segments)
  int io_threads = 0;         // reads in flight; 0: 32 for full shuffle, 4 otherwise
  std::string on_error = "skip";  // skip | fail
  double max_skip_fraction = 0.01;
  // Augmentation of training samples (RandomResizedCrop + flip + colour jitter).
  int image_size = 224;
  double scale_min = 0.08, scale_max = 1.0;
  double ratio_min = 3.0 / 4, ratio_max = 4.0 / 3;
  double flip = 0.5;
  double brightness = 0, contrast = 0, saturation = 0;
  // Validation samples: resize the shorter side to val_resize (>= image_size), centre crop
  // image_size. 0: image_size * 256 / 224 rounded up (the usual ratio); ValResize() resolves it.
  int val_resize = 0;
  // The backend's first step.
  std::vector<double> mean = {0.485, 0.456, 0.406};
  std::vector<double> std = {0.229, 0.224, 0.225};
  std::string layout = "nchw";  // nchw | nhwc
  std::string dtype = "float32";  // float32 | float16 | bfloat16 (the CPU backend: float32)
};

struct ModelConfig {
  std::string preset;  // lenet | resnet20 | resnet18 | resnet34 | resnet50; or `layers`
  int classes = 0;     // required (> 0)
  std::vector<LayerSpec> layers;
  double label_smoothing = 0;
  double bn_momentum = 0.1;
  double bn_epsilon = 1e-5;
  bool sync_batchnorm = false;  // data-parallel: batch statistics over the global batch
};

struct OptimizerConfig {
  double lr = 0.1;        // at base_batch
  int base_batch = 256;   // linear scaling: lr * batch_size / base_batch; 0 = no scaling
  SgdOptions sgd;
};

struct EvalConfig {
  int every_epochs = 1;  // 0 = only at the end
  int64_t every_steps = 0;
};

struct CheckpointConfig {
  int every_epochs = 1;
  int64_t every_steps = 0;
  int keep = 2;  // checkpoints kept in run_dir/checkpoints (oldest removed)
};

// The CUDA backend's choices (docs/CUDA.md); no effect on the CPU backend.
struct CudaConfig {
  bool autotune = true;        // time each convolution's cuDNN engines at start, keep the fastest
  bool fuse_bn_relu = false;   // batch norm + the ReLU after it as one kernel each way
  int input_channels = 3;      // 4 or 8: the input padded with zero channels for the first convolutions
};

// Data-parallel runs (under mpirun or srun; see docs/DISTRIBUTED.md).
struct DistConfig {
  double bucket_mb = 25;          // gradients averaged in buckets of about this size
  double timeout_s = 300;         // a collective slower than this ends the run (a rank is gone)
  int64_t check_every_steps = 0;  // > 0: compare a digest of every rank's model this often
  // How the CUDA backend averages over ranks: nccl (on the GPUs), host (through pinned host memory
  // over MPI: ranks sharing a GPU, machines without NCCL) or auto (NCCL when every rank has a GPU of
  // its own and NCCL loads everywhere, else host).
  std::string device_comm = "auto";
};

struct TrainConfig {
  std::string source;  // file the config came from (for messages)
  // The line of each key the file gives ("data.batch_size" -> 3), for messages about a value that
  // is checked later, against a dataset or the machine.
  std::map<std::string, int, std::less<>> lines;
  // "run.yaml:3" for a key the file gives on line 3; the file alone for one it leaves out.
  std::string Where(std::string_view key) const;
  DataConfig data;
  ModelConfig model;
  OptimizerConfig optimizer;
  ScheduleConfig schedule;
  EvalConfig eval;
  CheckpointConfig checkpoint;
  int epochs = 10;
  uint64_t seed = 0;
  std::string backend = "auto";  // auto | cpu | cuda
  int compute_threads = 0;       // CPU backend threads; 0 = every core
  std::string run_dir = "runs/run";
  int64_t log_every_steps = 10;
  DistConfig dist;
  CudaConfig cuda;
};

// Who wrote the YAML. A person's config (kWritten) is held to every rule, keys a setting does not
// read included ({type: cosine, milestones: [30]} is refused). A checkpoint's stored config
// (kStored) is read as it was written: stoke before 2026-12-04 stored every key, the milestones of
// a cosine schedule and the block_size of a full shuffle too, and such runs still resume.
enum class ConfigOrigin { kWritten, kStored };

// Parses YAML text. `source` names it in errors. Relative dataset and run paths stay relative
// (to the working directory).
Result<TrainConfig> ParseConfig(const std::string& yaml, const std::string& source,
                                ConfigOrigin origin = ConfigOrigin::kWritten);
Result<TrainConfig> LoadConfig(const std::string& path);

// The resolved config as YAML (every key its settings read, defaults filled in); ParseConfig reads
// it back.
std::string ConfigToYaml(const TrainConfig& config);

// What the other modules take, derived from a config. For rank `rank` of `world`: batches of
// data.batch_size / world; training takes its slice of every global batch (the same samples and
// crops on any world size), validation its exact share of the records.
prefetch::LoaderOptions TrainLoaderOptions(const TrainConfig& config, int rank = 0, int world = 1);
prefetch::LoaderOptions ValLoaderOptions(const TrainConfig& config, int rank = 0, int world = 1);
// Gradient buckets of dist.bucket_mb (the first one no larger).
dist::ReducerOptions ReducerOptionsFromConfig(const TrainConfig& config);
augment::NormalizeOptions NormalizeFromConfig(const DataConfig& data);
ModelSpec ModelFromConfig(const ModelConfig& model);
// ModelDifference of the two configs' models, each resolved at its own image size: empty when
// they are the same layers, or when either does not resolve (its own checks report that).
std::string ConfigModelDifference(const TrainConfig& here, std::string_view here_is, const TrainConfig& other,
                                  std::string_view other_is);
// How `here` prepares a validation sample differently from `other` (data.image_size, the resolved
// val_resize, mean, std, layout, dtype), as "data.val_resize 292 (the checkpoint's stored config:
// 256); ..."; empty when they prepare it alike.
std::string PreprocessingDifference(const TrainConfig& here, const TrainConfig& other, std::string_view other_is);
// The first setting in which two configs' YAML (ConfigToYaml) differ, as "data.threads: 2 (rank 0:
// 4)", `other_is` naming the second; empty when they agree.
std::string ConfigYamlDifference(std::string_view here, std::string_view other, std::string_view other_is);
// The learning rate after the linear scaling rule.
double ScaledLr(const TrainConfig& config);
// The shorter side validation resizes to: data.val_resize, or image_size * 256 / 224 (rounded up) when 0.
int ValResize(const DataConfig& data);

}  // namespace stoke::train
