// `stoke bench pack|read|decode|pipeline|train`: stage throughput on a real image folder, measured
// side by side with a reference in the same run (medians of repeats, after a warm-up). Every timed
// run is sized by time (BenchOptions::seconds, with a minimum count of items), never by a fixed
// count, so a command takes about repeats x figures x seconds whatever the data; a live line on
// a terminal says which figure and run is going.
#pragma once

#include <filesystem>
#include <string>

#include "common/status.h"

namespace stoke::bench {

struct BenchOptions {
  std::filesystem::path data = "../shared/data/imagenet_like";  // image folder tree
  int threads = 0;        // N for the N-thread runs; 0 = all cores
  int repeats = 5;        // timed runs per figure
  double seconds = 0;     // target duration of each timed run; 0: the subcommand's default
  std::filesystem::path work_dir;   // scratch for packed datasets; default: a temp directory
  std::filesystem::path json_out;   // optional JSON copy of the results
};

// Ok when `options.json_out` is empty or can be written: its folder exists and takes files,
// nothing but a file is there, and it is not inside the image folder (`data`) or the `dataset`
// measured. Each bench checks it before measuring, so that a bad --json path does not cost the run.
Status CheckJsonOut(const BenchOptions& options, const std::filesystem::path& dataset = {});

// Packs `data` with full validation at 1 and N threads, and measures TurboJPEG's single-core full
// decode of the same JPEGs as the yardstick. Returns a printable table.
Result<std::string> BenchPack(const BenchOptions& options);

// Packs `data` once, then measures sequential and random record reads (records/s, MB/s) on one
// core and on N threads, with and without CRC checks. Returns a printable table.
Result<std::string> BenchRead(const BenchOptions& options);

// On one core: full decode, scaled decode, region decode and the whole training sample (plan +
// region decode + resize to 224 + flip into a batch slot) of every JPEG record of `dataset` (a
// packed dataset; empty: pack options.data first). Target: whole sample >= 1.15x full decode.
Result<std::string> BenchDecode(const BenchOptions& options, const std::filesystem::path& dataset);

struct PipelineBenchOptions {
  int batch = 256;   // samples per batch
  int epochs = 0;    // per loader run, the first untimed; 0: runs sized by BenchOptions::seconds
  int ring = 4;      // batch buffers
  // The storage run (when `shuffle` is set): the loader alone in that order, every epoch timed
  // from its creation, with the bytes read from storage per image.
  std::string shuffle;          // "" | full | block | sequential
  int64_t memory_mb = -1;       // read-ahead budget; -1: the default; 0: no read-ahead (map only)
  int64_t block_size = 0;       // 0: the sampler's default
  int64_t window_blocks = 0;    // 0: the sampler's default
  int io_threads = 0;           // 0: the storage stage's default
  bool cold = false;            // evict the dataset from the page cache before each run
};

// The CPU stage end to end: the loader (RandomResizedCrop 224 + flip into uint8 batches) over
// `dataset` (empty: pack options.data first) on N threads for several epochs, beside a plain
// TurboJPEG full decode of the same images on the same N threads, and the loader on one thread
// (parallel efficiency). Images/s, per thread, consumer wait, RSS per epoch and peak RSS.
// With `pipeline.shuffle` set it measures storage instead: the loader alone over `dataset` in that
// order for `epochs` epochs (default 1), timed from its creation (so a cold start counts), with
// the bytes read from storage per image (from /proc/self/io), the storage stage's figures, the
// decoders' wait for reads and peak RSS. `cold` evicts the data file's pages before each run.
Result<std::string> BenchPipeline(const BenchOptions& options, const std::filesystem::path& dataset,
                                  const PipelineBenchOptions& pipeline);

}  // namespace stoke::bench

namespace stoke::bench {

struct TrainBenchOptions {
  std::filesystem::path config;      // the run config (YAML) whose data, model, batch and threads are measured
  int steps = 0;                     // timed steps per run; 0: as many as fit in BenchOptions::seconds
  int warmup = 2;                    // untimed steps before each run
  std::filesystem::path model_json;  // optional: the resolved model as JSON (for the PyTorch peer)
  // Also run the same model, batch, loss, optimizer and threads in PyTorch (on the GPU, with
  // autocast to the config's dtype, when the backend is CUDA)
  // (`peer_script`, bench/peers/torch_train.py, under `python`), interleaved with stoke's runs,
  // in NCHW and channels-last; the faster is the peer of the ratio.
  bool peer = false;
  std::string python = "/usr/bin/python3";
  std::filesystem::path peer_script;  // default: the source tree's bench/peers/torch_train.py
  // After the runs, this many more end-to-end steps with their compute and their batches'
  // host-to-device copies timed on the device's clock (CUDA backend only; timeline.h).
  int timeline = 0;
};

// Training throughput of the config's model on its backend: compute alone (one batch repeated:
// normalise + forward + backward + SGD) and end to end (fed by the loader from the config's
// dataset), as steps/s, images/s and the fraction of step time spent waiting for data; with
// `peer`, PyTorch's CPU training step beside it and the ratio.
struct TrainBenchReport {
  std::string text;          // the figures, as printed
  bool peer_failed = false;  // the peer was asked for and gave no ratio (text says why)
};
Result<TrainBenchReport> BenchTrain(const BenchOptions& options, const TrainBenchOptions& train);

}  // namespace stoke::bench
