#include "train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <climits>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/file_util.h"
#include "common/json_util.h"
#include "common/limits.h"
#include "common/logging.h"
#include "common/sys_memory.h"
#include "dataset/dataset.h"
#include "prefetch/batch_memory.h"
#include "train/checkpoint.h"
#include "train/cpu_network.h"
#include "train/data_parallel.h"
#if STOKE_WITH_CUDA
#include "train/cuda_network.h"
#endif
#include "train/schedule.h"
#include "train/tensorboard.h"

namespace stoke::train {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

bool SelectsCudaBackend(const TrainConfig& c) {
#if STOKE_WITH_CUDA
  return c.backend == "cuda" || (c.backend == "auto" && CudaAvailable().ok());
#else
  (void)c;
  return false;
#endif
}

int ComputeThreads(const TrainConfig& c, const dist::Communicator* comm) {
  if (c.compute_threads > 0) return c.compute_threads;
  // Ranks sharing a machine share its cores.
  if (comm && comm->local_size() > 1) return CoreShare(comm->local_size());
  // OpenMP's own count, when asked for, as libgomp reads it: a whole number, or the first of a
  // list such as "4,2" ("4abc" it ignores, and so does this).
  if (const char* env = std::getenv("OMP_NUM_THREADS"); env != nullptr) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    while (end != env && (*end == ' ' || *end == '\t')) ++end;
    if (end != env && (*end == '\0' || *end == ',') && n > 0 && n <= kMaxThreads) return static_cast<int>(n);
  }
  return UsableCores();
}

int LoaderThreads(const TrainConfig& c, const dist::Communicator* comm) {
  if (c.data.threads > 0) return c.data.threads;
  return CoreShare(comm ? comm->local_size() : 1);
}

Result<std::unique_ptr<Network>> CreateNetwork(const TrainConfig& c, const dist::Communicator* comm) {
  const int world = comm ? comm->size() : 1;
  if (c.data.batch_size % world != 0) {
    return InvalidArgumentError(fmt::format(
        "{}: data.batch_size {} is the global batch and must divide evenly among the {} ranks (each takes "
        "batch_size / ranks); use a multiple of {}",
        c.Where("data.batch_size"), c.data.batch_size, world, world));
  }
  NetworkOptions o;
  o.model = ModelFromConfig(c.model);
  o.image_size = c.data.image_size;
  o.batch = c.data.batch_size / world;
  o.first_sample = comm ? int64_t{comm->rank()} * o.batch : 0;
  o.sync_batchnorm = c.model.sync_batchnorm;
  o.normalize = NormalizeFromConfig(c.data);
  o.label_smoothing = c.model.label_smoothing;
  o.bn_momentum = c.model.bn_momentum;
  o.bn_epsilon = c.model.bn_epsilon;
  o.seed = c.seed;
  o.autotune = c.cuda.autotune;
  o.fuse_bn_relu = c.cuda.fuse_bn_relu;
  o.input_channels = c.cuda.input_channels;
  o.device_comm = c.dist.device_comm == "nccl"   ? DeviceComm::kNccl
                  : c.dist.device_comm == "host" ? DeviceComm::kHost
                                                 : DeviceComm::kAuto;
  if (const int cores = UsableCores(); c.compute_threads > 4 * cores) {
    // Allowed (up to kMaxThreads), but a team this much larger than the machine makes every step
    // many times slower, which looks like a hang.
    STOKE_LOG(WARN, "{}: compute_threads {} on {} cores: every step waits on {} threads taking turns (0 uses "
              "every core once)", c.Where("compute_threads"), c.compute_threads, cores, c.compute_threads);
  }
  o.threads = ComputeThreads(c, comm);
  o.precision = c.data.dtype == "bfloat16" ? Precision::kBFloat16
                : c.data.dtype == "float16" ? Precision::kFloat16
                                            : Precision::kFloat32;
#if STOKE_WITH_CUDA
  if (SelectsCudaBackend(c)) {
    if (const Status gpu = CudaAvailable(); !gpu.ok()) {
      return UnavailableError(fmt::format("backend 'cuda' was requested: {}", gpu.message()));
    }
    if (comm) {
      const bool share = o.device_comm == DeviceComm::kHost;
      STOKE_ASSIGN_OR_RETURN(o.device, DeviceForRank(comm->rank(), comm->local_rank(), comm->local_size(),
                                                     prefetch::ProbeCuda().devices, share));
    }
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
    return InvalidArgumentError(fmt::format(
        "{}: data.normalize.dtype: the CPU backend trains in float32, not {} (use backend: cuda, or dtype: float32)",
        c.Where("data.normalize.dtype"), c.data.dtype));
  }
  STOKE_ASSIGN_OR_RETURN(auto net, CpuNetwork::Create(std::move(o)));
  return std::unique_ptr<Network>(std::move(net));
}

namespace {

// What a resumed run keeps of its metrics.jsonl.
struct KeptMetrics {
  int64_t torn = 0;                // lines that were not whole JSON objects (a crash or a full disk cut them)
  bool val_at_step = false;        // the checkpoint's step was evaluated already (before it was saved)
  std::vector<prefetch::BadRecord> bad_records;  // records already reported as bad_record lines
  bool checkpoint_here = false;    // the checkpoint resumed from is one of run_dir's own (set by the caller)
};

// Keeps the metrics of steps up to `step` (a resumed run rewrites what followed its checkpoint).
// A line that is not a whole JSON object is dropped: readers of one object per line fail on it.
Result<KeptMetrics> TrimMetrics(const std::filesystem::path& path, int64_t step) {
  KeptMetrics out;
  std::ifstream in(path);
  if (!in) return out;
  std::string line, kept;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    auto line_step = j.is_object() ? JsonInt(j, "step", 0, INT64_MAX, "metrics") : Result<int64_t>(-1);
    if (!line_step.ok() || *line_step < 0) {
      out.torn++;
      continue;
    }
    if (*line_step > step) continue;
    const auto type = j.find("type");
    const std::string kind = type != j.end() && type->is_string() ? type->get<std::string>() : std::string();
    if (kind == "val" && *line_step == step) out.val_at_step = true;
    if (kind == "bad_record") {
      auto index = JsonInt(j, "index", 0, INT64_MAX, "metrics");
      const auto reason = j.find("reason");
      if (index.ok()) {
        out.bad_records.push_back({*index, reason != j.end() && reason->is_string() ? reason->get<std::string>()
                                                                                   : fmt::format("record {}", *index)});
      }
    }
    kept += line + "\n";
  }
  STOKE_RETURN_IF_ERROR(WriteFileAtomic(path, kept));
  return out;
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
  std::unique_ptr<dist::Communicator> single;
  dist::Communicator* comm = run.comm;
  if (comm == nullptr) {
    single = dist::Communicator::Single();
    comm = single.get();
  }
  const int world = comm->size(), rank = comm->rank();
  const bool lead = rank == 0;  // the rank that reads checkpoints and writes run_dir
  // A decision every rank takes together: a failure on any rank ends every rank with its error.
  auto agree = [&](const Status& local) -> Status { return world == 1 ? local : comm->Agree(local); };
  // The same after rank 0's checkpoint I/O, which the others wait for: a large model on a slow
  // disk takes longer than a collective should, so they wait up to half an hour (or
  // dist.timeout_s when longer) before taking rank 0 for stuck.
  auto agree_after_io = [&](const Status& local) -> Status {
    constexpr double kIoWaitS = 1800;
    if (world == 1) return local;
    return comm->timeout_s() >= kIoWaitS ? comm->Agree(local) : comm->Agree(local, static_cast<int>(kIoWaitS * 1000));
  };
  // A collective that failed (timed out: a rank is gone) leaves nothing to agree with: end the world.
  auto must = [&](const Status& s) {
    if (!s.ok() && world > 1) comm->Abort(s);
    return s;
  };

  const std::filesystem::path run_dir = config.run_dir;
  const auto metrics_path = run_dir / "metrics.jsonl";

  // Every rank must train the same config (its paths aside: each machine may keep its own copy of
  // the data). Ranks that read different files fail in step mismatches or collectives of
  // different sizes much later and far less clearly.
  if (world > 1) {
    TrainConfig shared = config;
    shared.data.train.clear();
    shared.data.val = config.data.val.empty() ? "" : "given";  // the path may differ, not whether there is one
    shared.run_dir.clear();
    shared.source.clear();
    // Rank 0's resolved config itself, so that a difference is named (a digest said only that there was one).
    const std::string mine = ConfigToYaml(shared);
    auto all = comm->AllGatherStrings(mine);
    STOKE_RETURN_IF_ERROR(must(all.status()));
    Status same = OkStatus();
    if (mine != (*all)[0]) {
      const bool val_here = !config.data.val.empty();
      const std::string differs = ConfigYamlDifference(mine, (*all)[0], "rank 0");
      same = InvalidArgumentError(
          differs.starts_with("data.val:")
              ? fmt::format("{}: data.val is {} here and {} on rank 0; give a validation dataset on every rank or on none "
                            "(its path may differ)",
                            config.source, val_here ? "given" : "not given", val_here ? "not given" : "given")
              : fmt::format("{}: this rank's config differs from rank 0's: {}; every rank must train the same config "
                            "(only the paths data.train, data.val and run_dir may differ)",
                            config.source, differs.empty() ? std::string("(in its text)") : differs));
    }
    STOKE_RETURN_IF_ERROR(agree(same));
  }

  // ---- every rank: datasets and network
  std::optional<dataset::Dataset> train_set, val_set;
  std::unique_ptr<Network> net;
  int64_t steps_per_epoch = 0;
  DataParallel dp(*comm, ReducerOptionsFromConfig(config));
  Status setup = [&]() -> Status {
    STOKE_ASSIGN_OR_RETURN(auto t, OpenConfigDataset(config, "data.train"));
    train_set.emplace(std::move(t));
    // Checkpoints, metrics and event files written into a dataset's folder would sit beside its
    // data.mdb (and inside a source tree, a later pack would read them as classes).
    for (const auto& [key, path] : {std::pair{"data.train", config.data.train}, std::pair{"data.val", config.data.val}}) {
      if (!path.empty() && PathWithin(run_dir, path)) {
        return InvalidArgumentError(fmt::format("{}: run_dir {} is inside {} {}: choose a folder outside the datasets",
                                                config.Where("run_dir"), run_dir.string(), key, path));
      }
    }
    if (std::error_code same_ec; !config.data.val.empty() && lead &&
                                 std::filesystem::equivalent(config.data.train, config.data.val, same_ec)) {
      STOKE_LOG(WARN, "{}: data.val is the training dataset {}: validation figures are on training records",
                config.source, config.data.train);
    }
    if (!config.data.val.empty()) {
      STOKE_ASSIGN_OR_RETURN(auto v, OpenConfigDataset(config, "data.val"));
      if (v.size() == 0) {
        return InvalidArgumentError(fmt::format(
            "{}: data.val {} has no records (a --val-fraction too small for its classes gives an empty "
            "validation set): leave data.val out, or pack a validation set with images in it",
            config.Where("data.val"), config.data.val));
      }
      if (v.size() < world) {
        return InvalidArgumentError(fmt::format("{}: data.val {} has {} records, fewer than the {} ranks",
                                                config.Where("data.val"), config.data.val, v.size(), world));
      }
      val_set.emplace(std::move(v));
    }
    if (val_set) {
      // Labels are indices into each dataset's own class list: the lists must agree where the
      // validation set has labels (it may lack trailing classes).
      const auto& train_classes = train_set->manifest().classes;
      const auto& val_classes = val_set->manifest().classes;
      if (val_classes.size() > train_classes.size()) {
        return InvalidArgumentError(fmt::format("{}: data.val {} has {} classes, data.train {} only {}",
                                                config.Where("data.val"),
                                                config.data.val, val_classes.size(), config.data.train,
                                                train_classes.size()));
      }
      for (size_t i = 0; i < val_classes.size(); ++i) {
        if (val_classes[i] != train_classes[i]) {
          return InvalidArgumentError(fmt::format(
              "{}: data.val {}: class {} is '{}', but data.train {} calls class {} '{}' (expected the same class "
              "names in the same order)",
              config.Where("data.val"), config.data.val, i, val_classes[i], config.data.train, i, train_classes[i]));
        }
      }
    }
    STOKE_RETURN_IF_ERROR(CheckTrainSet(config, *train_set));
    steps_per_epoch = train_set->size() / config.data.batch_size;
    STOKE_ASSIGN_OR_RETURN(net, CreateNetwork(config, comm));
    return OkStatus();
  }();
  STOKE_RETURN_IF_ERROR(agree(setup));
  if (world > 1) {
    // The same config is not the same data: each rank opens its own copy, and a copy with other
    // records (or the classes' folders swapped) would train silently on other labels, or fail
    // later in a collective of another size.
    struct Print {
      uint64_t train = 0, val = 0;
      int64_t train_records = 0, val_records = 0;
    } mine{train_set->Fingerprint(), val_set ? val_set->Fingerprint() : 0, train_set->size(),
           val_set ? val_set->size() : 0};
    std::vector<Print> all(static_cast<size_t>(world));
    STOKE_RETURN_IF_ERROR(must(comm->AllGather(&mine, sizeof mine, all.data()).Wait()));
    Status same = OkStatus();
    auto differs = [&](const char* key, const std::string& path, int64_t records, int64_t first_records) {
      same = InvalidArgumentError(fmt::format(
          "{}: data.{} {} ({} records) differs from rank 0's ({} records): every rank must read a copy of the same "
          "dataset{}",
          config.source, key, path, records, first_records,
          records == first_records ? " (the same count: other images or labels, or packed by another stoke version)"
                                   : ""));
    };
    if (mine.train != all[0].train) {
      differs("train", config.data.train, mine.train_records, all[0].train_records);
    } else if (mine.val != all[0].val) {
      differs("val", config.data.val, mine.val_records, all[0].val_records);
    }
    STOKE_RETURN_IF_ERROR(agree(same));
  }
  // Only once every rank has its network: attaching may itself be collective (NCCL's set-up).
  STOKE_RETURN_IF_ERROR(agree(net->SetStepSync(&dp)));

  TrainSummary summary;
  summary.backend = std::string(net->backend());
  summary.world = world;
  summary.steps_per_epoch = steps_per_epoch;
  summary.total_steps = steps_per_epoch * config.epochs;
  const std::string config_yaml = ConfigToYaml(config);

  // ---- where the run starts: rank 0 reads the checkpoint, every rank gets its step and state
  int64_t step = 0;
  // What the log lines average: the interval's and the epoch's sums (restored by --resume).
  BatchStats interval, epoch_stats;
  std::ofstream metrics;
  std::unique_ptr<EventWriter> events;
  KeptMetrics kept_metrics;  // rank 0's, of a resumed run
  // The folders this start made: a start that fails (a --resume with nothing to resume from) takes
  // them away again, not leaving an empty run_dir that looks like a run.
  std::vector<std::filesystem::path> made_folders;
  // One run at a time in a run_dir, held by rank 0 to the end: a second one started there (or a
  // --resume of it while it runs) was accepted, and the two replaced each other's metrics and
  // pruned each other's checkpoints.
  std::optional<FileLock> run_lock;
  // An exception on rank 0 alone must be agreed like any error, not leave the others waiting.
  Status start = CatchExceptions("train: starting the run", [&]() -> Status {
    if (!lead) return OkStatus();
    // The checkpoints' folder too: a file in its place is found now, not at the first checkpoint.
    auto made = MakeFolders(run_dir / "checkpoints");
    if (!made.ok()) return made.status().Prepend(fmt::format("run_dir {}", run_dir.string()));
    made_folders = std::move(*made);
    STOKE_ASSIGN_OR_RETURN(FileLock lock, FileLock::TryAcquire(run_dir / "train.lock",
                                                               fmt::format("train: run_dir {}", run_dir.string())));
    run_lock.emplace(std::move(lock));
    // What a run killed while rewriting them left (the metrics' temporary is a whole copy of them).
    for (const char* name : {"metrics.jsonl", "config.yaml"}) RemoveStaleAtomicTemporariesOf(run_dir / name);
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
        if (all.empty()) {
          return NotFoundError(fmt::format("--resume: no checkpoints in {}/checkpoints", run_dir.string()));
        }
        path = all.back();
      }
      STOKE_ASSIGN_OR_RETURN(Checkpoint ck, LoadCheckpoint(path));
      if (ck.step > summary.total_steps) {
        return InvalidArgumentError(fmt::format(
            "checkpoint {} is at step {}, past the {} steps this config trains ({} epochs of {}); raise epochs to go on",
            path.string(), ck.step, summary.total_steps, config.epochs, steps_per_epoch));
      }
      std::optional<TrainConfig> was;  // the checkpoint's stored config, when it holds one
      if (!ck.config_yaml.empty()) {
        STOKE_ASSIGN_OR_RETURN(was, ParseConfig(ck.config_yaml, path.string() + " (its stored config)",
                                                ConfigOrigin::kStored));
      }
      if (was) {
        // What decides which samples a step sees: changed, the resumed epoch would skip or repeat
        // records and mix batch sizes in its figures (the steps per epoch can stay equal).
        const DataConfig &a = was->data, &b = config.data;
        std::vector<std::string> changed;
        auto differs = [&](const char* key, const auto& then, const auto& now) {
          if (then != now) changed.push_back(fmt::format("data.{} {} -> {}", key, then, now));
        };
        differs("batch_size", a.batch_size, b.batch_size);
        differs("shuffle", a.shuffle, b.shuffle);
        if (b.shuffle == "block") {
          differs("block_size", a.block_size, b.block_size);
          differs("window_blocks", a.window_blocks, b.window_blocks);
        }
        differs("image_size", a.image_size, b.image_size);
        if (!changed.empty()) {
          return InvalidArgumentError(fmt::format(
              "checkpoint {} was taken with other batches than this config makes ({}); resume with the config it "
              "was taken with, or start a new run_dir",
              path.string(), fmt::join(changed, ", ")));
        }
      }
      if (ck.steps_per_epoch != steps_per_epoch || ck.seed != config.seed) {
        return InvalidArgumentError(fmt::format(
            "checkpoint {} was taken with {} steps per epoch and seed {}; this config gives {} and seed {}",
            path.string(), ck.steps_per_epoch, ck.seed, steps_per_epoch, config.seed));
      }
      if (const auto& have = train_set->manifest().classes; !ck.classes.empty() && ck.classes != have) {
        size_t i = 0;
        while (i < ck.classes.size() && i < have.size() && ck.classes[i] == have[i]) ++i;
        const std::string differs =
            i < ck.classes.size() && i < have.size()
                ? fmt::format("its class {} is '{}', data.train {} calls it '{}'", i, ck.classes[i], config.data.train,
                              have[i])
                : fmt::format("it has {} classes, data.train {} has {}", ck.classes.size(), config.data.train,
                              have.size());
        return InvalidArgumentError(
            fmt::format("checkpoint {} is of another dataset: {}", path.string(), differs));
      }
      Status loaded = net->LoadState(ck.tensors);
      if (!loaded.ok()) {
        return InvalidArgumentError(fmt::format("checkpoint {} does not fit this model: {}", path.string(),
                                                loaded.message()));
      }
      if (was) {
        // The same tensors do not make the same model (a relu changed to a max pool would train on
        // another function of the resumed weights).
        if (const std::string d =
                ConfigModelDifference(config, "this config", *was, "the checkpoint's stored config");
            !d.empty()) {
          return InvalidArgumentError(fmt::format(
              "checkpoint {} is of another model than this config describes: {}; resume with the config it was "
              "taken with, or start a new run_dir",
              path.string(), d));
        }
      }
      // --max-steps counts from the run's start: at or below the checkpoint's step the resumed run
      // would take no step and only write its figures again.
      if (run.max_steps > 0 && ck.step >= run.max_steps && ck.step < summary.total_steps) {
        return InvalidArgumentError(fmt::format(
            "--max-steps {}: checkpoint {} is at step {} already (--max-steps counts from the run's start, not "
            "from the resume); give a step past {}, or leave --max-steps out to train on to step {}",
            run.max_steps, path.string(), ck.step, ck.step, summary.total_steps));
      }
      step = ck.step;
      interval = ck.interval;
      epoch_stats = ck.epoch;
      STOKE_ASSIGN_OR_RETURN(const auto set_aside, SetAsideCheckpointsAfter(run_dir, step));
      if (!set_aside.empty()) {
        STOKE_LOG(WARN, "resuming at step {}: this run_dir's later checkpoints moved to {}", step, set_aside.string());
      }
      STOKE_ASSIGN_OR_RETURN(kept_metrics, TrimMetrics(metrics_path, step));
      // Resumed from another run's checkpoint (or a set-aside one), this run_dir has none yet.
      std::error_code here_ec, there_ec;
      kept_metrics.checkpoint_here = std::filesystem::weakly_canonical(path, here_ec).parent_path() ==
                                     std::filesystem::weakly_canonical(run_dir / "checkpoints", there_ec);
      if (kept_metrics.torn > 0) {
        STOKE_LOG(WARN, "{}: dropped {} line(s) that were not whole (cut by a crash or a full disk)",
                  metrics_path.string(), kept_metrics.torn);
      }
      STOKE_LOG(INFO, "resuming from {} at step {} (epoch {}, batch {})", path.string(), step,
                step / steps_per_epoch, step % steps_per_epoch);
    }
    // The run's own copy names its datasets and folder absolutely: `--config RUN_DIR/config.yaml`
    // then resumes from any working directory.
    TrainConfig resolved = config;
    for (std::string* path : {&resolved.data.train, &resolved.data.val, &resolved.run_dir}) {
      std::error_code ec;
      if (!path->empty()) {
        const auto absolute = std::filesystem::absolute(*path, ec);
        if (!ec) *path = absolute.lexically_normal().string();
      }
    }
    // Not over the config the run was started from, when its author keeps it in run_dir under
    // that name: its comments and its own spelling of paths stay as they were written.
    const std::filesystem::path copy = run_dir / "config.yaml";
    std::error_code same_ec;
    if (!config.source.empty() && std::filesystem::equivalent(config.source, copy, same_ec)) {
      STOKE_LOG(INFO, "{} is the config this run was started from: left as it is", copy.string());
    } else {
      STOKE_RETURN_IF_ERROR(WriteFileAtomic(copy, ConfigToYaml(resolved)));
    }
    metrics.open(metrics_path, std::ios::app);
    if (!metrics) return IoError(fmt::format("cannot append to {}", metrics_path.string()));
    // The TensorBoard files replay the metrics kept (none on a fresh start), then follow them.
    if (run.tensorboard && EventWriter::Available()) {
      STOKE_ASSIGN_OR_RETURN(events, RebuildEvents(metrics_path, run_dir / "tensorboard", WallTime()));
    }
    return OkStatus();
  });
  if (Status agreed = agree_after_io(start); !agreed.ok()) {
    run_lock.reset();  // its file is in run_dir
    RemoveEmptyFolders(made_folders);
    return agreed;
  }
  if (world > 1) {
    STOKE_RETURN_IF_ERROR(must(comm->Broadcast(&step, sizeof step, 0).Wait()));
    STOKE_RETURN_IF_ERROR(must(BroadcastState(*comm, *net)));
    auto hosts = RankHosts(*comm);
    STOKE_RETURN_IF_ERROR(must(hosts.status()));
    for (const std::string& h : *hosts) {
      auto at = std::find_if(summary.machines.begin(), summary.machines.end(), [&](auto& m) { return m.first == h; });
      if (at == summary.machines.end()) {
        summary.machines.emplace_back(h, 1);
      } else {
        at->second++;
      }
    }
  }
  summary.start_step = step;
  // What rank 0 kept of a resumed run's metrics, for every rank: whether the checkpoint's step was
  // evaluated already (evaluation is collective) and which records were reported bad (each is
  // reported once a run, and every rank holds the run's count against max_skip_fraction).
  if (world > 1) {
    nlohmann::json facts;
    if (lead) {
      nlohmann::json bad = nlohmann::json::array();
      for (const prefetch::BadRecord& b : kept_metrics.bad_records) bad.push_back({b.index, b.reason});
      facts = {{"val", kept_metrics.val_at_step}, {"bad", std::move(bad)},
               {"here", kept_metrics.checkpoint_here}};
    }
    auto all = comm->AllGatherStrings(lead ? facts.dump() : std::string());
    STOKE_RETURN_IF_ERROR(must(all.status()));
    const auto got = nlohmann::json::parse((*all)[0], nullptr, false);
    if (!got.is_object()) return must(InternalError("rank 0 sent no resume facts"));
    kept_metrics.val_at_step = got["val"].get<bool>();
    kept_metrics.bad_records.clear();
    for (const auto& b : got["bad"]) kept_metrics.bad_records.push_back({b[0].get<int64_t>(), b[1].get<std::string>()});
    kept_metrics.checkpoint_here = got["here"].get<bool>();
  }

  // A metrics line that cannot be written (disk full) ends the run rather than losing data. Only
  // rank 0 writes; its failure reaches the other ranks at the next step's agreement.
  Status pending = OkStatus();
  // Every line carries its wall time (seconds since the Unix epoch) for the monitor's time axis.
  auto record = [&](nlohmann::json j) {
    if (!lead || !pending.ok()) return;
    j["time"] = WallTime();
    const std::string line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    metrics << line << "\n";
    metrics.flush();
    if (!metrics) pending = IoError(fmt::format("{}: write failed (is the disk full?)", metrics_path.string()));
    if (events && pending.ok()) {
      MetricsScalars m = ScalarsOfMetrics(j, 0);
      if (!m.scalars.empty()) pending = events->Write(m.step, m.wall_time, m.scalars);
    }
  };
  nlohmann::json start_line = {{"type", "start"}, {"step", step}, {"total_steps", summary.total_steps},
                                {"steps_per_epoch", steps_per_epoch}, {"epochs", config.epochs},
                                {"batch_size", config.data.batch_size}, {"world", world},
                                {"backend", summary.backend}, {"train_records", train_set->size()},
                                {"val_records", val_set ? val_set->size() : 0}};
  if (!summary.machines.empty()) {
    start_line["machines"] = nlohmann::json::object();
    for (const auto& [host, ranks] : summary.machines) start_line["machines"][host] = ranks;
  }
  record(std::move(start_line));
  // Records the loaders skipped (on_error: skip) appear in metrics.jsonl as they happen, once each.
  // With several ranks they are gathered at every log line (a collective: every rank reaches the
  // same log lines), so that rank 0 records every rank's, and every rank holds them against
  // max_skip_fraction of the global epoch as one rank would (each loader's own budget is of the
  // global epoch too: LoaderOptions::skip_budget_samples below).
  // distinct bad records met by any rank (a resumed run's reported ones included)
  std::set<int64_t> bad_seen;
  for (const prefetch::BadRecord& b : kept_metrics.bad_records) bad_seen.insert(b.index);
  std::set<int64_t> bad_shared = bad_seen;  // this rank's, already gathered (a resumed run's: by rank 0)
  const int64_t global_max_bad = static_cast<int64_t>(
      std::floor(config.data.max_skip_fraction * static_cast<double>(steps_per_epoch) * config.data.batch_size));
  auto gather_bad_records = [&](const prefetch::Loader& loader) -> Status {
    std::vector<prefetch::BadRecord> fresh;
    for (prefetch::BadRecord& b : loader.bad_records()) {
      if (bad_shared.insert(b.index).second) fresh.push_back(std::move(b));
    }
    if (world > 1) {
      nlohmann::json mine = nlohmann::json::array();
      for (const prefetch::BadRecord& b : fresh) mine.push_back({b.index, b.reason});
      const std::string text =
          fresh.empty() ? std::string() : mine.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      auto all = comm->AllGatherStrings(text);
      STOKE_RETURN_IF_ERROR(must(all.status()));
      fresh.clear();
      for (const std::string& part : *all) {
        if (part.empty()) continue;
        for (const auto& b : nlohmann::json::parse(part)) fresh.push_back({b[0].get<int64_t>(), b[1].get<std::string>()});
      }
    }
    for (const prefetch::BadRecord& b : fresh) {
      if (bad_seen.insert(b.index).second && lead) {
        record({{"type", "bad_record"}, {"step", step}, {"index", b.index}, {"reason", b.reason}});
      }
    }
    if (world > 1 && static_cast<int64_t>(bad_seen.size()) > global_max_bad) {
      return CorruptError(fmt::format(
          "{} bad records on the {} ranks, more than max_skip_fraction {} of the {} samples of an epoch allows "
          "(latest: {})",
          bad_seen.size(), world, config.data.max_skip_fraction, steps_per_epoch * config.data.batch_size,
          fresh.empty() ? std::string() : fresh.back().reason));
    }
    return OkStatus();
  };

  const double peak_lr = ScaledLr(config);
  Progress progress(run.progress && lead);
  if (!run.resume.empty() && step == summary.total_steps) {
    progress.Message(fmt::format("the run finished at step {} already: nothing to train (raise epochs to go on)", step));
  }

  // Validation is sharded: each rank evaluates its exact share, the sums are added up.
  auto evaluate = [&]() -> Result<BatchStats> {
    STOKE_RETURN_IF_ERROR(must(net->AverageRunningStats()));
    BatchStats total;
    int64_t bad = 0;  // this rank's distinct bad records
    Status local = [&]() -> Status {
      prefetch::LoaderOptions o = ValLoaderOptions(config, rank, world);
      o.threads = LoaderThreads(config, comm);
      // A rank's share is 1 / world of the set: its own budget may take the whole set's bad
      // records; the set's budget is held below, over every rank.
      o.skip_budget_samples = val_set->size();
      FeedNetwork(*net, o);
      STOKE_ASSIGN_OR_RETURN(auto loader, prefetch::Loader::Create(*val_set, o));
      while (true) {
        STOKE_ASSIGN_OR_RETURN(auto lease, loader->Next());
        if (!lease) break;
        STOKE_ASSIGN_OR_RETURN(BatchStats s, net->Evaluate(*lease));
        if (lease->replaced > 0) {
          // Stand-ins for bad records are duplicates of other records: scored again without them.
          const std::vector<float> logits = net->LastLogits();
          if (logits.size() < static_cast<size_t>(lease->size) * static_cast<size_t>(config.model.classes)) {
            return InternalError(fmt::format("{} backend: no logits for validation batch {}", net->backend(),
                                             lease->number));
          }
          s = ScoreLogits(logits, config.model.classes, lease->labels, config.model.label_smoothing, lease->stand_in);
        }
        // A device backend queued its reads of the batch on its stream: the ring's next copy into
        // this slot must wait for them, not for the legacy stream.
        lease.Release(net->stream());
        total += s;
      }
      bad = loader->stats().bad_records;  // (a failed evaluation ends the run: its count is not needed)
      return OkStatus();
    }();
    if (!local.ok()) local = local.Prepend(fmt::format("validation on {} (data.val)", config.data.val));
    STOKE_RETURN_IF_ERROR(agree(local));
    STOKE_RETURN_IF_ERROR(must(SumStats(*comm, total)));
    if (world > 1) {
      // Each rank's records are its own (exact sharding), so the set's bad records are the sum.
      double v = static_cast<double>(bad);
      STOKE_RETURN_IF_ERROR(must(comm->AllReduce(&v, 1, dist::DataType::kFloat64, dist::ReduceOp::kSum).Wait()));
      const auto all_bad = std::llround(v);
      const auto allowed = static_cast<int64_t>(std::floor(config.data.max_skip_fraction * static_cast<double>(val_set->size())));
      if (all_bad > allowed) {
        return CorruptError(fmt::format(
            "validation on {} (data.val): {} bad records on the {} ranks, more than max_skip_fraction {} of its {} "
            "records allows", config.data.val, all_bad, world, config.data.max_skip_fraction, val_set->size()));
      }
    }
    return total;
  };
  // The step whose parameters were evaluated last: a run resumed from its final checkpoint has its
  // evaluation in the metrics already.
  int64_t eval_step = kept_metrics.val_at_step ? step : -1;
  // Whether `s` ends one of every `every_epochs` epochs, or is one of every `every_steps` steps:
  // when config.eval evaluates and config.checkpoint saves.
  auto due = [&](int64_t s, int every_epochs, int64_t every_steps) {
    return (s % steps_per_epoch == 0 && every_epochs > 0 && (s / steps_per_epoch) % every_epochs == 0) ||
           (every_steps > 0 && s % every_steps == 0);
  };
  auto eval_due = [&](int64_t s) { return due(s, config.eval.every_epochs, config.eval.every_steps); };
  auto save_due = [&](int64_t s) { return due(s, config.checkpoint.every_epochs, config.checkpoint.every_steps); };
  auto run_eval = [&]() -> Status {
    if (!val_set) return OkStatus();
    eval_step = step;
    STOKE_ASSIGN_OR_RETURN(summary.val, evaluate());
    summary.has_val = true;
    record({{"type", "val"}, {"step", step}, {"epoch", static_cast<double>(step) / steps_per_epoch},
            {"loss", summary.val.loss()}, {"top1", summary.val.top1_rate()}, {"top5", summary.val.top5_rate()},
            {"samples", summary.val.count}});
    progress.Message(fmt::format("eval  step {:>7}  loss {:.4f}  top-1 {:.2f}%  top-5 {:.2f}%  ({} samples)", step,
                                 summary.val.loss(), 100 * summary.val.top1_rate(), 100 * summary.val.top5_rate(),
                                 summary.val.count));
    return OkStatus();
  };
  int64_t saved_step = kept_metrics.checkpoint_here ? step : -1;  // that step's checkpoint is in run_dir already
  // Every rank averages its running statistics; rank 0 writes; every rank learns whether it did.
  // A save failed on every rank (agreed): it is not tried again before stopping on that failure
  // (the same state, the same outcome: a diverged model, a full disk).
  bool save_failed = false;
  auto save = [&]() -> Status {
    STOKE_RETURN_IF_ERROR(must(net->AverageRunningStats()));
    Status written = CatchExceptions("train: writing a checkpoint", [&]() -> Status {
      if (!lead) return OkStatus();
      STOKE_ASSIGN_OR_RETURN(auto tensors, net->State());
      // A diverged model (running statistics or weights gone to infinity while the loss stayed
      // finite) is not saved: it would prune the last good checkpoint, and no command can use it.
      if (const std::string bad = FirstNonFiniteTensor(tensors); !bad.empty()) {
        const auto kept = ListCheckpoints(run_dir);
        return InvalidArgumentError(fmt::format(
            "step {}: the run diverged: {} (learning rate too high?); its checkpoint is not written, {}", step, bad,
            kept.empty() ? std::string("and no earlier one is kept")
                         : fmt::format("the last one kept is {}", kept.back().string())));
      }
      Checkpoint ck{.step = step, .steps_per_epoch = steps_per_epoch, .seed = config.seed,
                    .backend = summary.backend, .config_yaml = config_yaml,
                    .classes = train_set->manifest().classes, .tensors = std::move(tensors),
                    .interval = interval, .epoch = epoch_stats};
      const auto path = CheckpointPath(run_dir, step);
      STOKE_RETURN_IF_ERROR(SaveCheckpoint(path, ck));
      PruneCheckpoints(run_dir, config.checkpoint.keep);
      summary.checkpoint = path.string();
      return OkStatus();
    });
    if (Status agreed = agree_after_io(written); !agreed.ok()) {
      save_failed = true;
      return agreed;
    }
    saved_step = step;
    return OkStatus();
  };

  // ---- the loop
  if (step < summary.total_steps) {
    prefetch::LoaderOptions lo = TrainLoaderOptions(config, rank, world);
    lo.threads = LoaderThreads(config, comm);
    // A rank's share of the epoch is 1 / world of it: its own budget may take the whole run's bad
    // records (they may all fall on it); the run's budget is held at the log lines, over every rank.
    lo.skip_budget_samples = steps_per_epoch * config.data.batch_size;
    lo.known_bad = kept_metrics.bad_records;  // a resumed run's budget holds what it met before
    FeedNetwork(*net, lo);  // a device backend: batches copied by the ring to its GPU
    lo.start_epoch = step / steps_per_epoch;
    lo.start_batch = step % steps_per_epoch;
    lo.epochs = config.epochs - lo.start_epoch;
    auto created = prefetch::Loader::Create(*train_set, lo);
    if (created.ok() && (*created)->batches_per_epoch() != steps_per_epoch) {
      created = InternalError(fmt::format("rank {}: the loader makes {} batches an epoch, the trainer counts {} steps",
                                          rank, (*created)->batches_per_epoch(), steps_per_epoch));
    }
    STOKE_RETURN_IF_ERROR(agree(created.status()));
    auto loader = std::move(*created);

    const auto loop_start = Clock::now();
    double wait_total = 0;
    int64_t samples_total = 0, consecutive_skips = 0;
    double interval_wait = 0;
    int64_t interval_first_sample = 0;  // samples_total at the last log line: skipped steps count too
    auto interval_start = Clock::now();
    // Evaluations and checkpoints inside the loop: their time is no step's, so the throughput and
    // data-wait of the interval (and of the run) leave it out. Counted in every one of them, an
    // interval with an evaluation read a tenth of its real rate.
    double paused_total = 0, interval_paused = 0;
    auto paused = [&](auto&& work) {
      const auto began = Clock::now();
      Status s = work();
      const double took = Seconds(Clock::now() - began);
      paused_total += took;
      interval_paused += took;
      return s;
    };
    Status failure = OkStatus();
    // A resumed run owes the evaluation due at its first step when its metrics have none there:
    // the run that wrote that checkpoint stopped before evaluating (killed, or failing in between).
    if (step > 0 && eval_step != step && eval_due(step)) failure = paused(run_eval);
    while (failure.ok() && step < summary.total_steps) {
      const bool stop_here = (run.stop && run.stop->load()) || (run.max_steps > 0 && step >= run.max_steps);
      const auto t0 = Clock::now();
      Result<prefetch::BatchLease> next = prefetch::BatchLease();
      if (!stop_here && pending.ok()) next = loader->Next();
      double wait = Seconds(Clock::now() - t0);
      // Every rank learns whether any rank stops here (Ctrl-C, max_steps), failed (a bad record
      // under on_error: fail, I/O, a metrics write), or ran out of batches.
      int32_t flags[3] = {stop_here ? 1 : 0, (!pending.ok() || !next.ok()) ? 1 : 0,
                          (next.ok() && !*next && !stop_here && pending.ok()) ? 1 : 0};
      if (world > 1) {
        STOKE_RETURN_IF_ERROR(must(comm->AllReduce(flags, 3, dist::DataType::kInt32, dist::ReduceOp::kMax).Wait()));
      }
      if (flags[1] != 0) {
        failure = agree(!pending.ok() ? pending : next.status());
        pending = OkStatus();
        break;
      }
      if (flags[0] != 0) {
        summary.stopped = true;
        loader->Stop();
        break;
      }
      if (flags[2] != 0) break;
      prefetch::BatchLease lease = std::move(*next);
      const auto lr = static_cast<float>(LearningRate(config.schedule, peak_lr, step, steps_per_epoch, config.epochs));
      if (rank == run.poison_rank && step == run.poison_step) dp.PoisonNextStep();
      auto stats = net->TrainStep(*lease, lr, config.optimizer.sgd, step);
      const int size = lease->size;
      lease.Release(net->stream());
      // A device backend measures on its stream how long the device sat idle before the batch.
      if (net->LastInputWaitSeconds() >= 0) wait = net->LastInputWaitSeconds();
      if (!stats.ok()) {
        // Mid-step the other ranks are inside this step's collectives: end them all.
        if (world > 1) {
          comm->Abort(Status(stats.status().code(), fmt::format("step {}: {}", step, stats.status().message())));
        }
        failure = stats.status();
        break;
      }
      ++step;
      wait_total += wait;
      interval_wait += wait;
      samples_total += static_cast<int64_t>(size) * world;
      if (stats->skipped > 0) {
        // The loss or the averaged gradient was not finite on some rank: every rank skipped the update.
        summary.skipped_steps++;
        if (++consecutive_skips >= 10) {
          failure = InvalidArgumentError(fmt::format(
              "the loss or gradient has not been finite for {} steps in a row, up to step {} (learning rate {} too "
              "high?)",
              consecutive_skips, step, lr));
          break;
        }
        STOKE_LOG(WARN, "step {}: the loss or gradient is not finite on some rank; every rank skipped the update",
                  step);
      } else if (stats->overflowed > 0) {
        // Float16: the scaled gradients overflowed, the backend halved the loss scale and skipped
        // the update; the step's loss is not a figure to average.
        summary.overflow_steps++;
      } else {
        consecutive_skips = 0;
        interval += *stats;
        epoch_stats += *stats;
      }
      if (config.dist.check_every_steps > 0 && world > 1 && step % config.dist.check_every_steps == 0) {
        failure = CheckSameState(*comm, *net);
        if (!failure.ok()) break;
      }

      const bool epoch_end = step % steps_per_epoch == 0;
      if (step % config.log_every_steps == 0 || epoch_end) {
        failure = gather_bad_records(*loader);
        if (!failure.ok()) break;
        const double secs = std::max(0.0, Seconds(Clock::now() - interval_start) - interval_paused);
        const double ips = secs > 0 ? static_cast<double>(samples_total - interval_first_sample) / secs : 0;
        const double wait_frac = secs > 0 ? interval_wait / secs : 0;
        // Every step of the interval skipped (float16 loss scaling settling, non-finite steps): no
        // loss to report, rather than a zero.
        const bool measured = interval.count > 0;
        nlohmann::json line = {{"type", "train"}, {"step", step}, {"epoch", static_cast<double>(step) / steps_per_epoch},
                               {"lr", lr}, {"images_per_s", ips}, {"data_wait", wait_frac}};
        if (measured) {
          line["loss"] = interval.loss();
          line["top1"] = interval.top1_rate();
        }
        record(std::move(line));
        progress.Line(fmt::format("epoch {}/{}  step {}/{}  loss {}  lr {:.4g}  {:.0f} img/s{}  data-wait {:.1f}%",
                                  (step - 1) / steps_per_epoch + 1, config.epochs, step, summary.total_steps,
                                  measured ? fmt::format("{:.4f}", interval.loss()) : std::string("n/a (skipped)"), lr,
                                  ips, world > 1 ? fmt::format(" on {} ranks", world) : "", 100 * wait_frac));
        interval = {};
        interval_first_sample = samples_total;
        interval_wait = 0;
        interval_paused = 0;
        interval_start = Clock::now();
      }
      if (epoch_end) {
        record({{"type", "epoch"}, {"step", step}, {"epoch", step / steps_per_epoch}, {"loss", epoch_stats.loss()},
                {"top1", epoch_stats.top1_rate()}});
        summary.last_epoch = epoch_stats;
        epoch_stats = {};
      }
      // The evaluation before the checkpoint: a checkpoint at a step tells a resume that the step
      // is done, so a kill between the two lost the evaluation owed there.
      if (eval_due(step) && eval_step != step) {
        failure = paused(run_eval);
        if (!failure.ok()) break;
      }
      if (save_due(step) && saved_step != step) {
        failure = paused(save);
        if (!failure.ok()) break;
      }
    }
    if (failure.ok()) failure = agree(pending);  // a metrics write that failed on the last step
    if (epoch_stats.count > 0) summary.last_epoch = epoch_stats;
    summary.seconds = Seconds(Clock::now() - loop_start);
    summary.paused_seconds = std::min(paused_total, summary.seconds);
    const double stepping = summary.seconds - summary.paused_seconds;
    summary.images_per_s = stepping > 0 ? static_cast<double>(samples_total) / stepping : 0;
    summary.data_wait = stepping > 0 ? wait_total / stepping : 0;
    summary.device_batches = loader->stats().pinned;
    if (Status gathered = gather_bad_records(*loader); failure.ok()) failure = gathered;
    summary.bad_records = static_cast<int64_t>(bad_seen.size());
    summary.comm_s = dp.stats().comm_s;
    summary.overlapped_s = dp.stats().overlapped_s;
    summary.comm_wait_s = dp.stats().wait_s;
    if (!failure.ok()) {
      // Keep what was learnt: the state after the last good step (every rank reached the same one).
      if (saved_step != step && step > summary.start_step && !save_failed) {
        Status s = save();
        if (s.ok()) {
          progress.Message(fmt::format("saved {} before stopping on the error", summary.checkpoint));
        } else {
          STOKE_LOG(WARN, "step {}: could not save a checkpoint before stopping on the error: {}", step, s.ToString());
        }
      }
      return failure;
    }
    loader.reset();
  }
  summary.steps = step;
  if (!summary.stopped && eval_step != step) STOKE_RETURN_IF_ERROR(run_eval());
  if (saved_step != step) STOKE_RETURN_IF_ERROR(save());
  record({{"type", "end"}, {"step", step}, {"stopped", summary.stopped}});
  STOKE_RETURN_IF_ERROR(agree(pending));
  if (metrics.is_open()) metrics.close();
  if (run.plot && lead) {
    const auto svg = run_dir / "curves.svg";
    Result<bool> drawn = WritePlot(metrics_path.string(), svg.string());
    if (!drawn.ok()) {
      STOKE_LOG(WARN, "no plot: {}", drawn.status().ToString());
    } else if (*drawn) {
      summary.plot = svg.string();
    } else {
      STOKE_LOG(INFO, "no plot: the run stopped before its first log line");  // a short run, no fault
    }
  }
  return summary;
}

}  // namespace

Result<TrainSummary> Train(const TrainConfig& config, const TrainRunOptions& run) {
  try {
    return TrainUnguarded(config, run);
  } catch (...) {
    const Status s = CatchExceptions("train", []() -> Status { throw; });  // names the exception
    // It comes out on this rank alone, whose peers wait in a collective it will never join: end
    // them now with its cause, not after dist.timeout_s with "another rank has stopped".
    if (run.comm != nullptr && run.comm->size() > 1) run.comm->Abort(s);
    return s;
  }
}

Result<dataset::Dataset> OpenConfigDataset(const TrainConfig& config, std::string_view key) {
  auto opened = dataset::Dataset::Open(key == "data.val" ? config.data.val : config.data.train);
  if (!opened.ok()) {
    return Status(opened.status().code(), fmt::format("{}: {}: {}", config.Where(key), key, opened.status().message()));
  }
  return opened;
}

Status CheckTrainSet(const TrainConfig& config, const dataset::Dataset& train_set) {
  const auto dataset_classes = static_cast<int64_t>(train_set.manifest().classes.size());
  if (dataset_classes > config.model.classes) {
    return InvalidArgumentError(fmt::format("{}: model.classes is {}, but {} has {} classes",
                                            config.Where("model.classes"), config.model.classes, config.data.train,
                                            dataset_classes));
  }
  if (train_set.size() < config.data.batch_size) {
    return InvalidArgumentError(fmt::format("{}: data.batch_size {} is larger than the {} records of {}",
                                            config.Where("data.batch_size"), config.data.batch_size, train_set.size(),
                                            config.data.train));
  }
  return OkStatus();
}

void FeedNetwork(const Network& net, prefetch::LoaderOptions& o) {
  const bool device = net.stream() != nullptr;
  o.device = device ? prefetch::DeviceMode::kCuda : prefetch::DeviceMode::kHost;
  o.device_id = net.options().device;
  o.consumer_stream = net.stream();
}

std::string FormatSummary(const TrainSummary& s) {
  std::string out = fmt::format("backend {}: steps {} -> {} of {} ({} per epoch){}\n", s.backend, s.start_step, s.steps,
                                s.total_steps, s.steps_per_epoch, s.stopped ? ", stopped early" : "");
  if (s.seconds > 0) {
    out += fmt::format("training: {:.1f} s{}, {:.1f} images/s, data-wait {:.1f}% of step time{}\n", s.seconds,
                       s.paused_seconds > 0 ? fmt::format(" ({:.1f} s of it evaluating and checkpointing)",
                                                          s.paused_seconds)
                                            : std::string(),
                       s.images_per_s, 100 * s.data_wait,
                       s.device_batches ? " (batches copied to the GPU from the pinned ring)" : "");
  }
  if (s.last_epoch.count > 0) {
    out += fmt::format("last epoch: loss {:.4f}, top-1 {:.2f}% (training, augmented)\n", s.last_epoch.loss(),
                       100 * s.last_epoch.top1_rate());
  }
  if (s.has_val) {
    out += fmt::format("validation: loss {:.4f}, top-1 {:.2f}%, top-5 {:.2f}% on {} samples\n", s.val.loss(),
                       100 * s.val.top1_rate(), 100 * s.val.top5_rate(), s.val.count);
  }
  if (s.world > 1 && s.seconds > 0) {
    std::vector<std::string> machines;
    for (const auto& [host, ranks] : s.machines) machines.push_back(fmt::format("{} x{}", host, ranks));
    out += fmt::format("data-parallel: {} ranks ({}), {:.1f} images/s per rank; averaging gradients {:.2f} s on this "
                       "rank, {:.0f}% of it overlapped with backward, steps blocked on it {:.2f} s\n",
                       s.world, fmt::join(machines, ", "), s.images_per_s / s.world, s.comm_s,
                       s.comm_s > 0 ? 100 * s.overlapped_s / s.comm_s : 0.0, s.comm_wait_s);
  }
  if (s.skipped_steps > 0) out += fmt::format("steps skipped (not finite on some rank): {}\n", s.skipped_steps);
  if (s.overflow_steps > 0) {
    out += fmt::format("float16 steps skipped by loss scaling (the scale halved): {}\n", s.overflow_steps);
  }
  if (s.bad_records > 0) out += fmt::format("bad records skipped: {}\n", s.bad_records);
  if (!s.checkpoint.empty()) out += fmt::format("checkpoint: {}\n", s.checkpoint);
  if (!s.plot.empty()) out += fmt::format("curves: {}\n", s.plot);
  return out;
}

}  // namespace stoke::train
