#include <cctype>
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <cmath>
#include <cstdio>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/file_util.h"
#include "common/sys_memory.h"
#include "dataset/dataset.h"
#include "dist/communicator.h"
#include "prefetch/loader.h"
#include "tools/bench/bench_commands.h"
#include "tools/bench/bench_stats.h"
#include "tools/bench/timeline.h"
#include "train/config.h"
#include "train/cuda_network.h"
#include "train/data_parallel.h"
#include "train/trainer.h"

namespace stoke::bench {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The model as the PyTorch peer builds it: layers with their input channel counts.
nlohmann::json ModelJson(const train::TrainConfig& c) {
  train::ModelSpec m = train::ModelFromConfig(c.model);
  const train::Shape input{3, c.data.image_size, c.data.image_size};
  auto shapes = train::ResolveModel(m, input);
  std::map<std::string, train::Shape> by_name{{"input", input}};
  nlohmann::json layers = nlohmann::json::array();
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const auto& l = m.layers[i];
    const train::Shape in = by_name[l.inputs[0]];
    layers.push_back({{"name", l.name}, {"type", std::string(train::LayerTypeName(l.type))}, {"inputs", l.inputs},
                      {"out", l.out}, {"kernel", l.kernel}, {"stride", l.stride}, {"pad", l.pad}, {"bias", l.bias},
                      {"p", l.p}, {"zero_init", l.zero_init}, {"in_c", in.c}, {"in_h", in.h}, {"in_w", in.w},
                      {"in_vector", in.vector}});
    by_name[l.name] = (*shapes)[i];
  }
  return {{"params", train::CountParameters(m, *shapes, input)},
          {"image_size", c.data.image_size}, {"classes", c.model.classes}, {"batch", c.data.batch_size},
          {"threads", c.compute_threads}, {"label_smoothing", c.model.label_smoothing},
          {"momentum", c.optimizer.sgd.momentum}, {"nesterov", c.optimizer.sgd.nesterov},
          {"weight_decay", c.optimizer.sgd.weight_decay}, {"bn_momentum", c.model.bn_momentum},
          {"bn_epsilon", c.model.bn_epsilon}, {"layers", layers}};
}

struct PeerRun {
  double img_s = 0;
  std::string version;
  int64_t params = 0;
};

// Runs the PyTorch peer once (no shell: any path works) and reads the JSON line it prints.
Result<PeerRun> RunPeer(const TrainBenchOptions& t, const std::filesystem::path& model, int threads,
                        bool channels_last) {
  std::vector<std::string> args = {t.python, t.peer_script.string(), model.string(), "--threads", std::to_string(threads),
                                   "--steps", std::to_string(t.steps), "--warmup", std::to_string(t.warmup),
                                   "--repeats", "1"};
  if (channels_last) args.push_back("--channels-last");
  const std::string shown = fmt::format("{}", fmt::join(args, " "));
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return IoError(fmt::format("bench train: pipe: {}", std::strerror(errno)));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (spawned != 0) {
    ::close(fds[0]);
    return UnavailableError(fmt::format("bench train: the PyTorch peer did not start ({}): {}", std::strerror(spawned),
                                        shown));
  }
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  const std::string how = WIFEXITED(status)     ? fmt::format("exit {}", WEXITSTATUS(status))
                          : WIFSIGNALED(status) ? fmt::format("signal {}", WTERMSIG(status))
                                                : std::string("status unknown");
  const size_t brace = out.rfind("{\"img_s\"");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || brace == std::string::npos) {
    // Its last words (a traceback ends there).
    return UnavailableError(fmt::format("bench train: the PyTorch peer failed ({}): {}\n{}", how, shown,
                                        out.size() > 2000 ? "..." + out.substr(out.size() - 2000) : out));
  }
  auto j = nlohmann::json::parse(out.substr(brace), nullptr, false);
  if (j.is_discarded()) return InternalError(fmt::format("bench train: unreadable peer output: {}", out));
  return PeerRun{j.value("img_s", 0.0), j.value("torch", std::string("?")), j.value("params", int64_t{0})};
}

// The bench itself, on one rank of `comm`'s world. `agree` decides a status with every rank.
Result<TrainBenchReport> RunTrainBench(const BenchOptions& o, const TrainBenchOptions& t, train::TrainConfig& c,
                                  const std::unique_ptr<dist::Communicator>& comm,
                                  const std::function<Status(const Status&)>& agree) {
  const int world = comm->size(), rank = comm->rank();
  auto db = train::OpenConfigDataset(c, "data.train");
  STOKE_RETURN_IF_ERROR(agree(db.status()));
  STOKE_RETURN_IF_ERROR(agree(train::CheckTrainSet(c, *db)));  // as `stoke train` checks it
  auto created = train::CreateNetwork(c, comm.get());
  STOKE_RETURN_IF_ERROR(agree(created.status()));
  auto net = std::move(*created);
  // Agreed, so that under a launcher a rank whose backend fell back to the CPU stops every rank.
  Status timeline_backend = OkStatus();
  if (t.timeline > 0 && net->stream() == nullptr) {
    timeline_backend = InvalidArgumentError(fmt::format(
        "bench train: --timeline times copies and steps on a GPU; this run's backend is {} (backend: cuda)",
        net->backend()));
  }
  STOKE_RETURN_IF_ERROR(agree(timeline_backend));
  train::DataParallel dp(*comm, train::ReducerOptionsFromConfig(c));
  STOKE_RETURN_IF_ERROR(agree(net->SetStepSync(&dp)));
  STOKE_RETURN_IF_ERROR(train::BroadcastState(*comm, *net));
  nlohmann::json model_json = ModelJson(c);
  // The peer runs where stoke's backend does, in the same precision (autocast on a GPU).
  model_json["device"] = net->stream() != nullptr ? "cuda" : "cpu";
  model_json["precision"] = c.data.dtype;
  model_json["preset"] = c.model.preset;
  // Rank 0 writes it, as it writes --json (every rank wrote it, each over the others' file).
  STOKE_RETURN_IF_ERROR(agree(rank == 0 && !t.model_json.empty() ? WriteFileAtomic(t.model_json, model_json.dump(1) + "\n")
                                                                  : OkStatus()));
  TrainBenchOptions peer_opts = t;
  std::filesystem::path peer_model;
  if (t.peer) {
#ifdef STOKE_SOURCE_DIR
    if (peer_opts.peer_script.empty()) peer_opts.peer_script = std::filesystem::path(STOKE_SOURCE_DIR) / "bench/peers/torch_train.py";
#endif
    peer_model = t.model_json;
    if (peer_model.empty()) {
      STOKE_ASSIGN_OR_RETURN(const auto tmp, TemporaryFolder("the peer's model file"));
      peer_model = tmp / fmt::format("stoke-model-{}.json", getpid());
    }
    STOKE_RETURN_IF_ERROR(WriteFileAtomic(peer_model, model_json.dump(1) + "\n"));
  }
  // The temporary model file goes however this function returns (an error below left it in /tmp).
  struct RemoveTemporary {
    std::filesystem::path path;
    ~RemoveTemporary() {
      std::error_code ec;
      if (!path.empty()) std::filesystem::remove(path, ec);
    }
  } remove_temporary{t.peer && t.model_json.empty() ? peer_model : std::filesystem::path()};
  prefetch::LoaderOptions lo = train::TrainLoaderOptions(c, rank, world);
  lo.threads = train::LoaderThreads(c, comm.get());
  lo.epochs = 0;  // endless
  train::FeedNetwork(*net, lo);
  auto loader_or = prefetch::Loader::Create(*db, lo);
  STOKE_RETURN_IF_ERROR(agree(loader_or.status()));
  auto loader = std::move(*loader_or);
  const auto lr = static_cast<float>(std::min(0.01, train::ScaledLr(c)));
  int64_t step = 0;

  std::vector<double> compute_rates, e2e_rates, waits, torch_nchw, torch_cl;
  std::vector<double> comm_ms, overlap_fraction, blocked_ms;  // data-parallel, per timed compute run
  PeerRun peer_info;
  std::string peer_error;  // the first failure of the PyTorch peer ("" while it works)
  const double seconds = o.seconds > 0 ? o.seconds : 2.0;
  int steps = t.steps;  // 0 until the first warm-up has timed a step
  BenchProgress progress("bench train", (t.peer ? 4 : 2) * o.repeats, rank == 0 ? stderr : nullptr);
  for (int r = 1; r <= o.repeats; ++r) {
    {
      // Compute alone: one batch held out of the ring (on the device for a device backend) and
      // used for every step.
      progress.Run("compute only", r, o.repeats);
      STOKE_ASSIGN_OR_RETURN(auto held, loader->Next());
      if (!held) return InternalError("bench train: the loader gave no batch");
      const prefetch::Batch& fixed = *held;
      double last_warm_s = 0;
      for (int i = 0; i < t.warmup; ++i) {
        const auto warm = Clock::now();
        STOKE_RETURN_IF_ERROR(net->TrainStep(fixed, lr, c.optimizer.sgd, step++).status());
        last_warm_s = Since(warm);
      }
      if (steps == 0) {
        // As many steps as fit in `seconds` at the pace of the last warm-up step (the first ones
        // build kernels), at least 3.
        steps = static_cast<int>(std::min<int64_t>(ItemsForSeconds(1 / last_warm_s, seconds, 3), 1 << 20));
        // Every rank runs rank 0's count (the ranks step together).
        if (world > 1) STOKE_RETURN_IF_ERROR(comm->Broadcast(&steps, sizeof steps, 0).Wait());
      }
      const train::DataParallelStats before = dp.stats();
      const auto start = Clock::now();
      for (int i = 0; i < steps; ++i) STOKE_RETURN_IF_ERROR(net->TrainStep(fixed, lr, c.optimizer.sgd, step++).status());
      compute_rates.push_back(steps * c.data.batch_size / Since(start));
      if (world > 1 || dp.stats().steps > 0) {  // ranks, or NCCL at a world of one (STOKE_NCCL_ALWAYS=1)
        const train::DataParallelStats& after = dp.stats();
        const double comm_s = after.comm_s - before.comm_s;
        comm_ms.push_back(1e3 * comm_s / steps);
        overlap_fraction.push_back(comm_s > 0 ? (after.overlapped_s - before.overlapped_s) / comm_s : 0);
        blocked_ms.push_back(1e3 * (after.wait_s - before.wait_s) / steps);
      }
      held.Release(net->stream());
    }
    peer_opts.steps = steps;
    if (t.peer && peer_error.empty()) {
      // A peer that fails (no torch, out of memory beside stoke, a crash) costs its own figures
      // only: stoke's, measured already, are still reported, with the peer's error.
      progress.Run("PyTorch, NCHW", r, o.repeats);
      // The threads stoke's backend runs on (ComputeThreads): the peer was given every usable core
      // while stoke ran on OMP_NUM_THREADS of them.
      const int threads = train::ComputeThreads(c, comm.get());
      // A peer that timed some other model (a script of its own, a torchvision that builds other
      // layers) gives no ratio: its parameter count must be stoke's, its rate positive.
      const int64_t params = model_json["params"].get<int64_t>();
      auto run_peer = [&](bool channels_last) -> Result<PeerRun> {
        STOKE_ASSIGN_OR_RETURN(PeerRun p, RunPeer(peer_opts, peer_model, threads, channels_last));
        if (p.params != params || !(p.img_s > 0)) {
          return UnavailableError(fmt::format(
              "bench train: the peer ({}) reported {} parameters at {} img/s; stoke's model has {}: it did not time "
              "the same model",
              peer_opts.peer_script.string(), p.params, p.img_s, params));
        }
        return p;
      };
      auto nchw = run_peer(false);
      if (nchw.ok()) {
        peer_info = *nchw;
        torch_nchw.push_back(peer_info.img_s);
        progress.Run("PyTorch, channels-last", r, o.repeats);
        auto cl = run_peer(true);
        if (cl.ok()) {
          torch_cl.push_back(cl->img_s);
        } else {
          peer_error = cl.status().ToString();
        }
      } else {
        peer_error = nchw.status().ToString();
      }
    }

    // End to end: batches from the loader, as `stoke train` takes them.
    auto run_steps = [&](int n, double* wait) -> Status {
      for (int i = 0; i < n; ++i) {
        const auto w0 = Clock::now();
        STOKE_ASSIGN_OR_RETURN(auto lease, loader->Next());
        const double host_wait = Since(w0);
        if (!lease) return InternalError("bench train: the loader stopped");
        STOKE_RETURN_IF_ERROR(net->TrainStep(*lease, lr, c.optimizer.sgd, step++).status());
        lease.Release(net->stream());
        // A device backend measures, with events on its stream, how long the device sat idle.
        if (wait) *wait += net->LastInputWaitSeconds() >= 0 ? net->LastInputWaitSeconds() : host_wait;
      }
      return OkStatus();
    };
    progress.Run("end to end", r, o.repeats);
    STOKE_RETURN_IF_ERROR(run_steps(t.warmup, nullptr));
    double wait = 0;
    const auto e2e = Clock::now();
    STOKE_RETURN_IF_ERROR(run_steps(steps, &wait));
    const double secs = Since(e2e);
    e2e_rates.push_back(steps * c.data.batch_size / secs);
    waits.push_back(wait / secs);
  }
  std::vector<TimelineRow> timeline;
  std::string timeline_error;
#if STOKE_WITH_CUDA
  if (auto* gpu = dynamic_cast<train::CudaNetwork*>(net.get()); gpu != nullptr && t.timeline > 0) {
    // A failure here costs the timeline only: the figures above are reported. Under a launcher the
    // ranks agree once between steps (on the last step's outcome and the next batch), so a failure
    // stops every rank at the same point and the idle time between steps holds one small
    // all-reduce, not two.
    Status s = agree(gpu->StartTimeline());
    Status last = OkStatus();  // the previous step's, agreed on before the next one
    for (int i = 0; s.ok() && i < t.timeline; ++i) {
      auto lease = loader->Next();
      s = agree(!last.ok()     ? last
                : !lease.ok() ? lease.status()
                : *lease      ? OkStatus()
                              : InternalError("the loader stopped"));
      if (!s.ok()) break;
      auto stats = net->TrainStep(**lease, lr, c.optimizer.sgd, step++);
      auto row = stats.ok() ? gpu->LastStepTimeline(**lease) : Result<train::StepTimeline>(stats.status());
      lease->Release(net->stream());
      last = row.status();
      if (row.ok()) timeline.push_back(*row);
    }
    if (s.ok()) s = agree(last);
    if (!s.ok()) timeline_error = s.ToString();
  }
#endif
  loader->Stop();
  if (rank != 0) return TrainBenchReport{};  // rank 0 reports
  const double compute = Median(compute_rates), end_to_end = Median(e2e_rates), wait = Median(waits);
  const std::string model = c.model.preset.empty() ? fmt::format("{}-layer list", c.model.layers.size()) : c.model.preset;
  const bool on_host = net->stream() == nullptr;  // compute threads are the CPU backend's
  std::string out = fmt::format(
      "train bench: {} ({} classes) at {}x{}, batch {}, backend {}{}, loader threads {}\n"
      "  {} timed steps per run after {} warm-up, median of {} runs\n"
      "  compute only (one batch repeated)  {:8.1f} img/s  {:6.2f} steps/s   runs: {}\n"
      "  end to end (loader -> backend)     {:8.1f} img/s  {:6.2f} steps/s   data-wait {:.1f}% of step time\n",
      model, c.model.classes, c.data.image_size, c.data.image_size, c.data.batch_size, net->backend(),
      on_host ? fmt::format(", compute threads {}", train::ComputeThreads(c, comm.get())) : std::string(),
      lo.threads, steps, t.warmup, o.repeats, compute, compute / c.data.batch_size,
      fmt::format("{:.0f}", fmt::join(compute_rates, ", ")), end_to_end, end_to_end / c.data.batch_size, 100 * wait);
#if STOKE_WITH_CUDA
  if (const auto* gpu = dynamic_cast<const train::CudaNetwork*>(net.get()); gpu != nullptr) {
    if (!gpu->AutotuneSummary().empty()) out += fmt::format("  {}\n", gpu->AutotuneSummary());
    if (gpu->FusedBatchNormRelu() > 0) {
      out += fmt::format("  batch norm + ReLU fused (stoke's kernels): {} pairs\n", gpu->FusedBatchNormRelu());
    }
    if (gpu->InputChannels() != 3) {
      out += fmt::format("  input padded to {} channels for the first convolution\n", gpu->InputChannels());
    }
    if (!gpu->FallbackKernels().empty()) {
      out += fmt::format("  on stoke's kernels (cuDNN had no engine): {}\n", fmt::join(gpu->FallbackKernels(), "; "));
    }
    if (!gpu->NondeterministicSteps().empty()) {
      out += fmt::format("  non-deterministic cuDNN engines (no deterministic one ran): {}\n",
                         fmt::join(gpu->NondeterministicSteps(), "; "));
    }
  }
#endif
  if (!comm_ms.empty()) {
    out += fmt::format(
        "  data-parallel: {} ranks x batch {}: compute only {:.1f} img/s per rank\n"
        "    gradient averaging (rank 0): {:.2f} ms per step in {} buckets of up to {:.1f} MB, {:.0f}% of it overlapped "
        "with backward; the step blocked {:.2f} ms on it\n",
        world, c.data.batch_size / world, compute / world, Median(comm_ms), dp.stats().buckets, dp.stats().bucket_mb,
        100 * Median(overlap_fraction), Median(blocked_ms));
  }
  if (!timeline.empty()) out += DescribeTimeline(timeline);
  if (!timeline_error.empty()) out += fmt::format("  timeline: FAILED after {} steps ({})\n", timeline.size(), timeline_error);
  double ratio = 0;
  if (!peer_error.empty()) {
    while (!peer_error.empty() && std::isspace(static_cast<unsigned char>(peer_error.back()))) peer_error.pop_back();
    out += fmt::format("  PyTorch peer: FAILED, no ratio ({}); stoke's figures above were measured before it\n",
                       peer_error);
  }
  if (t.peer && peer_error.empty()) {
    const double nchw = Median(torch_nchw), cl = Median(torch_cl), best = std::max(nchw, cl);
    ratio = best > 0 ? compute / best : 0;
    out += fmt::format(
        "  PyTorch {} NCHW, same step    {:8.1f} img/s                   runs: {:.0f}\n"
        "  PyTorch channels-last              {:8.1f} img/s                   runs: {:.0f}\n"
        "  ratio, compute only, vs the faster PyTorch: {:.2f}x (target >= 1.0x: {}); parameters: stoke {}, "
        "PyTorch {}\n",
        peer_info.version, nchw, fmt::join(torch_nchw, ", "), cl, fmt::join(torch_cl, ", "), ratio,
        ratio >= 1.0 ? "met" : "NOT met", model_json["params"].get<int64_t>(), peer_info.params);
  }
  if (!o.json_out.empty()) {
    nlohmann::json j{{"config", t.config.string()}, {"batch", c.data.batch_size}, {"backend", net->backend()},
                     {"world", world}, {"loader_threads", lo.threads},
                     {"allreduce_ms_per_step", comm_ms}, {"overlap_fraction", overlap_fraction},
                     {"blocked_ms_per_step", blocked_ms},
                     {"compute_img_s", compute}, {"compute_runs", compute_rates}, {"e2e_img_s", end_to_end},
                     {"e2e_runs", e2e_rates}, {"data_wait_fraction", wait}};
    if (on_host) j["compute_threads"] = train::ComputeThreads(c, comm.get());
    if (!peer_error.empty()) j["peer_error"] = peer_error;
    if (!timeline_error.empty()) j["timeline_error"] = timeline_error;
    if (!timeline.empty()) {
      const TimelineSummary ts = SummarizeTimeline(timeline);
      j["timeline_summary"] = {{"copies", ts.copies},          {"during_compute", ts.during_compute},
                               {"partly", ts.partly},          {"before", ts.before},
                               {"idle", ts.idle},              {"where", ts.where},
                               {"median_idle_ms", ts.median_idle_ms}, {"max_idle_ms", ts.max_idle_ms},
                               {"median_step_ms", ts.median_step_ms}};
      nlohmann::json rows = nlohmann::json::array();
      for (const TimelineRow& r : timeline) {
        rows.push_back({{"compute_ms", {r.compute_begin_ms, r.compute_end_ms}},
                        {"copy_ms", std::isnan(r.copy_begin_ms) ? nlohmann::json(nullptr)
                                                                : nlohmann::json{r.copy_begin_ms, r.copy_end_ms}}});
      }
      j["timeline"] = rows;
    }
    if (t.peer && peer_error.empty()) {
      j["torch_nchw_img_s"] = torch_nchw;
      j["torch_channels_last_img_s"] = torch_cl;
      j["ratio"] = ratio;
    }
    STOKE_RETURN_IF_ERROR(WriteFileAtomic(o.json_out, j.dump(2) + "\n"));
  }
  return TrainBenchReport{std::move(out), t.peer && !peer_error.empty()};
}

}  // namespace

Result<TrainBenchReport> BenchTrain(const BenchOptions& o, const TrainBenchOptions& options) {
  // Under mpirun or srun: one rank of a data-parallel step (the same as `stoke train` takes). Made
  // before anything is checked, so that a check only some ranks fail (a config missing on one
  // machine) is agreed on and reported by rank 0, naming the rank, rather than ending that rank
  // silently; its timeout comes from the config after.
  STOKE_ASSIGN_OR_RETURN(auto comm, dist::Communicator::Create({}));
  const int world = comm->size();
  bool agreed_failure = false;
  auto agree = [&](const Status& s) {
    Status decided = world > 1 ? comm->Agree(s) : s;
    if (!decided.ok()) agreed_failure = true;
    return decided;
  };
  // At least one warm-up step (the first builds kernels), the same for stoke's runs and the peer's.
  TrainBenchOptions t = options;
  t.warmup = std::max(1, t.warmup);
  Result<train::TrainConfig> config = [&]() -> Result<train::TrainConfig> {
    STOKE_ASSIGN_OR_RETURN(train::TrainConfig c, train::LoadConfig(t.config.string()));
    if (t.peer && world > 1) return InvalidArgumentError("bench train: --peer measures one process; run it without mpirun");
    if (comm->rank() != 0) return c;  // only rank 0 writes the outputs: their folders may exist only on its machine
    STOKE_RETURN_IF_ERROR(CheckJsonOut(o));  // before the runs, not after them
    // Neither output over what the bench reads (the config, the datasets) or over the other one.
    const std::filesystem::path read[] = {c.data.train, c.data.val};
    const std::filesystem::path besides_json[] = {t.config, t.model_json}, besides_model[] = {t.config};
    if (!o.json_out.empty()) {
      STOKE_RETURN_IF_ERROR(CheckOutputClear("bench train: --json", o.json_out, besides_json, read));
    }
    if (!t.model_json.empty()) {
      STOKE_RETURN_IF_ERROR(CheckOutputClear("bench train: --model-json", t.model_json, besides_model, read));
      STOKE_RETURN_IF_ERROR(CheckFileWritable("bench train: --model-json", t.model_json));
    }
    return c;
  }();
  STOKE_RETURN_IF_ERROR(agree(config.status()));
  train::TrainConfig c = std::move(config).value();
  comm->set_timeout_s(c.dist.timeout_s);
  if (o.threads > 0) c.compute_threads = o.threads, c.data.threads = o.threads;
  Result<TrainBenchReport> out = RunTrainBench(o, t, c, comm, agree);
  // A failure on this rank alone (its loader, its step, a collective that timed out) leaves the
  // other ranks waiting in a collective, and this one in MPI_Finalize: every rank ends now, told
  // why. Failures the ranks agreed on end every rank already.
  if (!out.ok() && world > 1 && !agreed_failure) comm->Abort(out.status());
  return out;
}

}  // namespace stoke::bench
