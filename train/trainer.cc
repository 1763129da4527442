#include "train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <chrono>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/file_util.h"
#include "common/json_util.h"
#include "common/logging.h"
#include "dataset/dataset.h"
#include "train/checkpoint.h"
#include "train/cpu_network.h"
#if STOKE_WITH_CUDA
#include "train/cuda_network.h"
#endif
#include "train/schedule.h"

namespace stoke::train {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

Result<std::unique_ptr<Network>> CreateNetwork(const TrainConfig& c) {
  NetworkOptions o;
  o.model = ModelFromConfig(c.model);
  o.image_size = c.data.image_size;
  o.batch = c.data.batch_size;
  o.normalize = NormalizeFromConfig(c.data);
  o.label_smoothing = c.model.label_smoothing;
  o.bn_momentum = c.model.bn_momentum;
  o.bn_epsilon = c.model.bn_epsilon;
  o.seed = c.seed;
  o.threads = c.compute_threads;
  o.precision = c.data.dtype == "bfloat16" ? Precision::kBFloat16
                : c.data.dtype == "float16" ? Precision::kFloat16
                                            : Precision::kFloat32;
#if STOKE_WITH_CUDA
  const Status gpu = CudaAvailable();
  if (c.backend == "cuda" || (c.backend == "auto" && gpu.ok())) {
    if (!gpu.ok()) return UnavailableError(fmt::format("backend 'cuda' was requested: {}", gpu.message()));
    o.normalize.dtype = augment::DType::kFloat32;  // the device normalises; the host never does
    STOKE_ASSIGN_OR_RETURN(auto net, CudaNetwork::Create(std::move(o)));
    return std::unique_ptr<Network>(std::move(net));
  }
#else
  if (c.backend == "cuda") {
    return UnavailableError(
        "backend 'cuda' was requested, but this build has no CUDA training backend (the CUDA toolkit was not found "
        "at build time); use backend: cpu or auto");
  }
#endif
  if (o.precision != Precision::kFloat32) {
    return InvalidArgumentError(fmt::format("{}: data.dtype: the CPU backend trains in float32, not {}", c.source,
                                            c.data.dtype));
  }
  STOKE_ASSIGN_OR_RETURN(auto net, CpuNetwork::Create(std::move(o)));
  return std::unique_ptr<Network>(std::move(net));
}

namespace {

// Keeps the metrics of steps up to `step` (a resumed run rewrites what followed its checkpoint).
Status TrimMetrics(const std::filesystem::path& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return OkStatus();
  std::string line, kept;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    auto line_step = j.is_object() ? JsonInt(j, "step", 0, INT64_MAX, "metrics") : Result<int64_t>(-1);
    if (!line_step.ok() || *line_step <= step) kept += line + "\n";
  }
  return WriteFileAtomic(path, kept);
}

class Progress {
 public:
  explicit Progress(bool enabled) : enabled_(enabled), tty_(enabled && isatty(STDERR_FILENO) != 0) {}
  void Line(const std::string& text) {
    if (!enabled_) return;
    if (tty_) {
      std::fprintf(stderr, "\r%s\033[K", text.c_str());
    } else {
      std::fprintf(stderr, "%s\n", text.c_str());
    }
    std::fflush(stderr);
    open_ = tty_;
  }
  void Message(const std::string& text) {
    if (!enabled_) return;
    if (open_) std::fputc('\n', stderr);
    std::fprintf(stderr, "%s\n", text.c_str());
    open_ = false;
  }
  ~Progress() {
    if (open_) std::fputc('\n', stderr);
  }

 private:
  bool enabled_, tty_, open_ = false;
};

Result<TrainSummary> TrainUnguarded(const TrainConfig& config, const TrainRunOptions& run) {
  const std::filesystem::path run_dir = config.run_dir;
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  if (ec) return IoError(fmt::format("run_dir {}: {}", run_dir.string(), ec.message()));
  const auto metrics_path = run_dir / "metrics.jsonl";

  STOKE_ASSIGN_OR_RETURN(auto train_set, dataset::Dataset::Open(config.data.train));
  std::optional<dataset::Dataset> val_set;
  if (!config.data.val.empty()) {
    STOKE_ASSIGN_OR_RETURN(auto v, dataset::Dataset::Open(config.data.val));
    val_set.emplace(std::move(v));
  }
  const auto dataset_classes = static_cast<int64_t>(train_set.manifest().classes.size());
  if (dataset_classes > config.model.classes) {
    return InvalidArgumentError(fmt::format("{}: model.classes is {}, but {} has {} classes", config.source,
                                            config.model.classes, config.data.train, dataset_classes));
  }
  const int64_t steps_per_epoch = train_set.size() / config.data.batch_size;
  if (steps_per_epoch < 1) {
    return InvalidArgumentError(fmt::format("{}: data.batch_size {} is larger than the {} records of {}",
                                            config.source, config.data.batch_size, train_set.size(),
                                            config.data.train));
  }
  STOKE_ASSIGN_OR_RETURN(auto net, CreateNetwork(config));

  TrainSummary summary;
  summary.backend = std::string(net->backend());
  summary.steps_per_epoch = steps_per_epoch;
  summary.total_steps = steps_per_epoch * config.epochs;
  const std::string config_yaml = ConfigToYaml(config);

  // ---- where the run starts
  int64_t step = 0;
  if (run.resume.empty()) {
    if (!ListCheckpoints(run_dir).empty()) {
      return InvalidArgumentError(fmt::format(
          "{} already holds checkpoints of a run; continue it with --resume, or choose another run_dir",
          run_dir.string()));
    }
    STOKE_RETURN_IF_ERROR(WriteFileAtomic(metrics_path, std::string()));
  } else {
    std::filesystem::path path = run.resume;
    if (run.resume == "latest") {
      auto all = ListCheckpoints(run_dir);
      if (all.empty()) return NotFoundError(fmt::format("--resume: no checkpoints in {}/checkpoints", run_dir.string()));
      path = all.back();
    }
    STOKE_ASSIGN_OR_RETURN(Checkpoint ck, LoadCheckpoint(path));
    if (ck.steps_per_epoch != steps_per_epoch || ck.seed != config.seed) {
      return InvalidArgumentError(fmt::format(
          "checkpoint {} was taken with {} steps per epoch and seed {}; this config gives {} and seed {}",
          path.string(), ck.steps_per_epoch, ck.seed, steps_per_epoch, config.seed));
    }
    Status loaded = net->LoadState(ck.tensors);
    if (!loaded.ok()) {
      return InvalidArgumentError(fmt::format("checkpoint {} does not fit this model: {}", path.string(),
                                              loaded.message()));
    }
    step = ck.step;
    STOKE_RETURN_IF_ERROR(TrimMetrics(metrics_path, step));
    STOKE_LOG(INFO, "resuming from {} at step {} (epoch {}, batch {})", path.string(), step, step / steps_per_epoch,
              step % steps_per_epoch);
  }
  summary.start_step = step;
  STOKE_RETURN_IF_ERROR(WriteFileAtomic(run_dir / "config.yaml", config_yaml));

  std::ofstream metrics(metrics_path, std::ios::app);
  if (!metrics) return IoError(fmt::format("cannot append to {}", metrics_path.string()));
  // A metrics line that cannot be written (disk full) ends the run rather than losing data.
  auto record = [&](nlohmann::json j) -> Status {
    metrics << j.dump() << "\n";
    metrics.flush();
    if (!metrics) return IoError(fmt::format("{}: write failed (is the disk full?)", metrics_path.string()));
    return OkStatus();
  };

  const double peak_lr = ScaledLr(config);
  Progress progress(run.progress);

  auto evaluate = [&]() -> Result<BatchStats> {
    prefetch::LoaderOptions o = ValLoaderOptions(config);
    if (net->stream() != nullptr) o.device = prefetch::DeviceMode::kCuda;
    STOKE_ASSIGN_OR_RETURN(auto loader, prefetch::Loader::Create(*val_set, o));
    BatchStats total;
    while (true) {
      STOKE_ASSIGN_OR_RETURN(auto lease, loader->Next());
      if (!lease) break;
      STOKE_ASSIGN_OR_RETURN(BatchStats s, net->Evaluate(*lease));
      total += s;
    }
    return total;
  };
  int64_t eval_step = -1;
  auto run_eval = [&]() -> Status {
    if (!val_set) return OkStatus();
    eval_step = step;
    STOKE_ASSIGN_OR_RETURN(summary.val, evaluate());
    summary.has_val = true;
    STOKE_RETURN_IF_ERROR(record({{"type", "val"}, {"step", step}, {"epoch", static_cast<double>(step) / steps_per_epoch},
            {"loss", summary.val.loss()}, {"top1", summary.val.top1_rate()}, {"top5", summary.val.top5_rate()},
            {"samples", summary.val.count}}));
    progress.Message(fmt::format("eval  step {:>7}  loss {:.4f}  top-1 {:.2f}%  top-5 {:.2f}%  ({} samples)", step,
                                 summary.val.loss(), 100 * summary.val.top1_rate(), 100 * summary.val.top5_rate(),
                                 summary.val.count));
    return OkStatus();
  };
  int64_t saved_step = -1;
  auto save = [&]() -> Status {
    STOKE_ASSIGN_OR_RETURN(auto tensors, net->State());
    Checkpoint ck{.step = step, .steps_per_epoch = steps_per_epoch, .seed = config.seed,
                  .backend = summary.backend, .config_yaml = config_yaml, .tensors = std::move(tensors)};
    const auto path = CheckpointPath(run_dir, step);
    STOKE_RETURN_IF_ERROR(SaveCheckpoint(path, ck));
    PruneCheckpoints(run_dir, config.checkpoint.keep);
    summary.checkpoint = path.string();
    saved_step = step;
    return OkStatus();
  };

  // ---- the loop
  if (step < summary.total_steps) {
    prefetch::LoaderOptions lo = TrainLoaderOptions(config);
    if (net->stream() != nullptr) lo.device = prefetch::DeviceMode::kCuda;  // batches copied by the ring
    lo.start_epoch = step / steps_per_epoch;
    lo.start_batch = step % steps_per_epoch;
    lo.epochs = config.epochs - lo.start_epoch;
    STOKE_ASSIGN_OR_RETURN(auto loader, prefetch::Loader::Create(train_set, lo));

    const auto loop_start = Clock::now();
    double wait_total = 0;
    int64_t samples_total = 0;
    BatchStats interval, epoch_stats;
    double interval_wait = 0;
    auto interval_start = Clock::now();
    Status failure = OkStatus();
    while (step < summary.total_steps) {
      if ((run.stop && run.stop->load()) || (run.max_steps > 0 && step >= run.max_steps)) {
        summary.stopped = true;
        loader->Stop();
        break;
      }
      const auto t0 = Clock::now();
      auto next = loader->Next();
      double wait = Seconds(Clock::now() - t0);
      if (!next.ok()) {
        failure = next.status();
        break;
      }
      prefetch::BatchLease lease = std::move(*next);
      if (!lease) break;
      const auto lr = static_cast<float>(LearningRate(config.schedule, peak_lr, step, steps_per_epoch, config.epochs));
      auto stats = net->TrainStep(*lease, lr, config.optimizer.sgd, step);
      const int size = lease->size;
      lease.Release(net->stream());
      // A device backend measures on its stream how long the device sat idle before the batch.
      if (net->LastInputWaitSeconds() >= 0) wait = net->LastInputWaitSeconds();
      if (!stats.ok()) {
        failure = stats.status();
        break;
      }
      ++step;
      wait_total += wait;
      interval_wait += wait;
      samples_total += size;
      interval += *stats;
      epoch_stats += *stats;

      const bool epoch_end = step % steps_per_epoch == 0;
      if (step % config.log_every_steps == 0 || epoch_end) {
        const double secs = Seconds(Clock::now() - interval_start);
        const double ips = secs > 0 ? static_cast<double>(interval.count) / secs : 0;
        const double wait_frac = secs > 0 ? interval_wait / secs : 0;
        failure = record({{"type", "train"}, {"step", step}, {"epoch", static_cast<double>(step) / steps_per_epoch},
                {"loss", interval.loss()}, {"top1", interval.top1_rate()}, {"lr", lr}, {"images_per_s", ips},
                {"data_wait", wait_frac}});
        if (!failure.ok()) break;
        progress.Line(fmt::format("epoch {}/{}  step {}/{}  loss {:.4f}  lr {:.4g}  {:.0f} img/s  data-wait {:.1f}%",
                                  (step - 1) / steps_per_epoch + 1, config.epochs, step, summary.total_steps,
                                  interval.loss(), lr, ips, 100 * wait_frac));
        interval = {};
        interval_wait = 0;
        interval_start = Clock::now();
      }
      if (epoch_end) {
        const int64_t epoch = step / steps_per_epoch;
        failure = record({{"type", "epoch"}, {"step", step}, {"epoch", epoch}, {"loss", epoch_stats.loss()},
                          {"top1", epoch_stats.top1_rate()}});
        if (!failure.ok()) break;
        summary.last_epoch = epoch_stats;
        epoch_stats = {};
        if (config.eval.every_epochs > 0 && epoch % config.eval.every_epochs == 0) {
          failure = run_eval();
          if (!failure.ok()) break;
        }
        if (config.checkpoint.every_epochs > 0 && epoch % config.checkpoint.every_epochs == 0) {
          failure = save();
          if (!failure.ok()) break;
        }
      }
      if (config.eval.every_steps > 0 && step % config.eval.every_steps == 0 && !epoch_end) {
        failure = run_eval();
        if (!failure.ok()) break;
      }
      if (config.checkpoint.every_steps > 0 && step % config.checkpoint.every_steps == 0 && saved_step != step) {
        failure = save();
        if (!failure.ok()) break;
      }
    }
    if (epoch_stats.count > 0) summary.last_epoch = epoch_stats;
    summary.seconds = Seconds(Clock::now() - loop_start);
    summary.images_per_s = summary.seconds > 0 ? static_cast<double>(samples_total) / summary.seconds : 0;
    summary.data_wait = summary.seconds > 0 ? wait_total / summary.seconds : 0;
    summary.bad_records = loader->stats().bad_records;
    if (!failure.ok()) {
      // Keep what was learnt: the state after the last good step.
      if (saved_step != step && step > summary.start_step) {
        Status s = save();
        if (s.ok()) progress.Message(fmt::format("saved {} before stopping on the error", summary.checkpoint));
      }
      return failure;
    }
    loader.reset();
  }
  summary.steps = step;
  if (!summary.stopped && eval_step != step) STOKE_RETURN_IF_ERROR(run_eval());
  if (saved_step != step) STOKE_RETURN_IF_ERROR(save());
  metrics.close();
  if (run.plot) {
    const auto svg = run_dir / "curves.svg";
    Status s = WritePlot(metrics_path.string(), svg.string());
    if (s.ok()) {
      summary.plot = svg.string();
    } else {
      STOKE_LOG(WARN, "no plot: {}", s.ToString());
    }
  }
  return summary;
}

}  // namespace

Result<TrainSummary> Train(const TrainConfig& config, const TrainRunOptions& run) {
  return CatchExceptions("train", [&] { return TrainUnguarded(config, run); });
}

std::string FormatSummary(const TrainSummary& s) {
  std::string out = fmt::format("backend {}: steps {} -> {} of {} ({} per epoch){}\n", s.backend, s.start_step, s.steps,
                                s.total_steps, s.steps_per_epoch, s.stopped ? ", stopped early" : "");
  if (s.seconds > 0) {
    out += fmt::format("training: {:.1f} s, {:.1f} images/s, data-wait {:.1f}% of step time\n", s.seconds,
                       s.images_per_s, 100 * s.data_wait);
  }
  if (s.last_epoch.count > 0) {
    out += fmt::format("last epoch: loss {:.4f}, top-1 {:.2f}% (training, augmented)\n", s.last_epoch.loss(),
                       100 * s.last_epoch.top1_rate());
  }
  if (s.has_val) {
    out += fmt::format("validation: loss {:.4f}, top-1 {:.2f}%, top-5 {:.2f}% on {} samples\n", s.val.loss(),
                       100 * s.val.top1_rate(), 100 * s.val.top5_rate(), s.val.count);
  }
  if (s.bad_records > 0) out += fmt::format("bad records skipped: {}\n", s.bad_records);
  if (!s.checkpoint.empty()) out += fmt::format("checkpoint: {}\n", s.checkpoint);
  if (!s.plot.empty()) out += fmt::format("curves: {}\n", s.plot);
  return out;
}

}  // namespace stoke::train
