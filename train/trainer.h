// The training loop: the prefetch loader feeds a backend; every step records how long it waited
// for its batch. Writes into run_dir: config.yaml (the resolved config), metrics.jsonl (one JSON
// object per line, each with its step and wall time: start, train intervals, epochs, evaluations,
// skipped records, end), tensorboard/ (the same scalars as TensorBoard event files),
// checkpoints/step-N.ckpt and, at the end, curves.svg (loss and accuracy against step).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "common/status.h"
#include "dist/communicator.h"
#include "train/config.h"

namespace stoke::dataset {
class Dataset;
}  // namespace stoke::dataset

namespace stoke::train {

struct TrainRunOptions {
  // "" starts afresh (and refuses a run_dir that already has checkpoints); "latest" continues
  // from the newest checkpoint in run_dir; anything else is a checkpoint file.
  std::string resume;
  const std::atomic<bool>* stop = nullptr;  // set (e.g. by Ctrl-C): checkpoint and return
  int64_t max_steps = 0;  // > 0: stop (with a checkpoint) once the run has taken this many steps
  bool progress = true;   // the live progress line on stderr
  bool plot = true;       // curves.svg at the end
  bool tensorboard = true;  // TensorBoard event files in run_dir/tensorboard/ (when the build has them)
  // Data-parallel: this process is one rank of `comm` (nullptr: a world of one). Every rank calls
  // Train with the same config; data.batch_size is the global batch, each rank takes 1/world of
  // it; only rank 0 writes run_dir. See docs/DISTRIBUTED.md.
  dist::Communicator* comm = nullptr;
  // Tests: rank `poison_rank` feeds NaN gradients into step `poison_step` (-1: never).
  int poison_rank = -1;
  int64_t poison_step = -1;
};

struct TrainSummary {
  std::string backend;
  int64_t start_step = 0;
  int64_t steps = 0;  // the step the run ended at
  int64_t total_steps = 0;
  int64_t steps_per_epoch = 0;
  bool stopped = false;       // ended early (stop flag or max_steps)
  double seconds = 0;         // wall time of the training loop in this invocation
  double paused_seconds = 0;  // ... of it evaluating and checkpointing
  double images_per_s = 0;    // training samples per second of the steps (all ranks; evaluations left out)
  int world = 1;              // ranks
  std::vector<std::pair<std::string, int>> machines;  // data-parallel: each machine and its ranks, by rank 0 first
  double comm_s = 0;          // data-parallel: time spent averaging gradients (this rank)
  double overlapped_s = 0;    // ... of it while backward was still running
  double comm_wait_s = 0;     // time steps blocked on the averaging after backward
  int64_t skipped_steps = 0;  // steps every rank skipped (the loss or gradient not finite)
  int64_t overflow_steps = 0;  // float16 steps skipped by dynamic loss scaling (the scale halved)
  double data_wait = 0;       // fraction of the steps' time spent waiting for batches
  bool device_batches = false;  // the loader's pinned ring copied the batches to the GPU
  BatchStats last_epoch;      // training statistics of the last (partial) epoch
  bool has_val = false;
  BatchStats val;             // the last evaluation
  int64_t bad_records = 0;
  std::string checkpoint;     // the last checkpoint written
  std::string plot;           // curves.svg ("" when not written)
};

Result<TrainSummary> Train(const TrainConfig& config, const TrainRunOptions& run);

// The backend `config.backend` selects (auto: the best available), built for the config's model,
// batch and input. kUnavailable when the requested backend is not in this build. With `comm`, for
// one rank of it: batch_size / world samples, the GPU of its local rank, and (compute_threads 0)
// its share of the machine's cores.
Result<std::unique_ptr<Network>> CreateNetwork(const TrainConfig& config, const dist::Communicator* comm = nullptr);
// The CPU backend's thread count for `config` on one rank of `comm` (or a single process):
// compute_threads when set; else, for ranks sharing a machine, their share of its cores (or the
// cores the launcher bound the rank to); else OMP_NUM_THREADS when set; else UsableCores() (the
// affinity mask within any cgroup CPU quota, which OpenMP's own default does not heed).
int ComputeThreads(const TrainConfig& config, const dist::Communicator* comm = nullptr);
// The train and validation loaders' decoding threads for `config` on one rank of `comm`:
// data.threads when set; else, for ranks sharing a machine, their share of its cores (as for
// ComputeThreads); else UsableCores().
int LoaderThreads(const TrainConfig& config, const dist::Communicator* comm = nullptr);
// Sends a loader's batches where `net` computes: for a device backend, to its GPU through the
// ring's device copies (a lease dropped without Release(stream) returns its slot on the network's
// stream); host memory otherwise.
void FeedNetwork(const Network& net, prefetch::LoaderOptions& o);
// config.data.train (key "data.train") or config.data.val ("data.val") opened; an error names the
// config's file and the key, so a wrong path is found in the file that holds it.
Result<dataset::Dataset> OpenConfigDataset(const TrainConfig& config, std::string_view key);
// Whether the training set `train_set` (config.data.train, opened) fits `config`: the model has an
// output for each of its classes, and it holds at least one batch. Errors name the config's file.
Status CheckTrainSet(const TrainConfig& config, const dataset::Dataset& train_set);
// Whether CreateNetwork would pick the CUDA backend for `config` on this machine.
bool SelectsCudaBackend(const TrainConfig& config);

// One-paragraph human summary of a run.
std::string FormatSummary(const TrainSummary& summary);

// Draws the curves of run_dir/metrics.jsonl into an SVG file. False, with no file written, when
// the metrics hold no training or validation line yet (a run stopped before its first log line).
Result<bool> WritePlot(const std::string& metrics_path, const std::string& svg_path);

}  // namespace stoke::train
