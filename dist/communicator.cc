#include "dist/communicator.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "common/logging.h"
#include "common/thread_name.h"

#if STOKE_WITH_MPI
#include <mpi.h>
#endif

namespace stoke::dist {

using Clock = std::chrono::steady_clock;

size_t SizeOf(DataType type) {
  switch (type) {
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kUInt8:
      return 1;
  }
  return 1;
}

std::string_view DataTypeName(DataType type) {
  switch (type) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kUInt8: return "uint8";
  }
  return "?";
}

namespace {

// An environment variable as a non-negative integer; -1 when absent or not a number.
int EnvInt(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return -1;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > INT_MAX) return -1;
  return static_cast<int>(x);
}

// An allgather's per-rank size is an MPI count (an int).
constexpr size_t kMaxGather = INT_MAX;

std::string Bytes(size_t n) {
  if (n >= (size_t{1} << 20)) return fmt::format("{:.1f} MiB", static_cast<double>(n) / (1 << 20));
  if (n >= 1024) return fmt::format("{:.1f} KiB", static_cast<double>(n) / 1024);
  return fmt::format("{} B", n);
}

// Whether srun's task environment carries PMIx or PMI-2 (srun --mpi=pmi2 gives PMI_FD).
bool SrunGavePmix() { return std::getenv("PMIX_RANK") != nullptr; }
bool SrunGavePmi2() { return std::getenv("PMI_FD") != nullptr || std::getenv("PMI_RANK") != nullptr; }
// Open MPI as Debian builds it has PMIx clients only: MPI_Init under PMI-2 aborts the process. Other
// MPIs (MPICH, Intel MPI) connect through PMI-2.
#if defined(OPEN_MPI)
constexpr bool kMpiNeedsPmix = true;
#else
constexpr bool kMpiNeedsPmix = false;
#endif
bool SrunGaveUsablePmi() { return SrunGavePmix() || (!kMpiNeedsPmix && SrunGavePmi2()); }

}  // namespace

LaunchInfo DetectLaunch() {
  LaunchInfo info;
  struct Source {
    const char* launcher;
    const char *rank, *size, *local;
    const char* only_with = nullptr;  // a variable that must be set too
  };
  // Open MPI's own launcher first: under `srun` inside an mpirun job both sets may be present.
  // Slurm's batch script has SLURM_PROCID 0 and the job's SLURM_NTASKS as well, but it is not a
  // task of a step: only srun's tasks have SLURM_STEP_ID, and the step's own task count.
  static constexpr Source kSources[] = {
      {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
      {"pmix", "PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"},
      {"srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_ID"},
      {"pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
  };
  for (const Source& s : kSources) {
    if (s.only_with != nullptr && std::getenv(s.only_with) == nullptr) continue;
    const int rank = EnvInt(s.rank), size = EnvInt(s.size);
    if (rank < 0 || size < 1 || rank >= size) continue;
    // srun sets SLURM_PROCID for any job step, including a plain `srun stoke` of one task: that is a
    // launch too (MPI starts through PMI), and a world of one.
    info.launcher = s.launcher;
    info.rank = rank;
    info.size = size;
    info.local_rank = std::max(0, EnvInt(s.local));
    return info;
  }
  return info;
}

namespace detail {
struct WorkState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
  std::string what;  // "allreduce of 4.0 MiB float32 (#12)"
  double started = 0, finished = 0;
  void Finish(Status s, double t) {
    {
      std::lock_guard lock(mu);
      status = std::move(s);
      finished = t;
      done = true;
    }
    cv.notify_all();
  }
};
}  // namespace detail

Work::~Work() = default;
Work::Work(Work&&) noexcept = default;
Work& Work::operator=(Work&&) noexcept = default;

bool Work::done() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mu);
  return state_->done;
}

double Work::started_s() const {
  if (!state_) return 0;
  std::lock_guard lock(state_->mu);
  return state_->started;
}

double Work::finished_s() const {
  if (!state_) return 0;
  std::lock_guard lock(state_->mu);
  return state_->finished;
}

struct Communicator::Impl {
  struct Task {
    std::shared_ptr<detail::WorkState> state;
    std::function<Status()> run;
  };
  Clock::time_point t0 = Clock::now();
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> queue;
  bool closing = false;
  bool exited = false;  // under mu: the thread is done with MPI (finalised or given up)
  std::condition_variable exited_cv;
  std::atomic<bool> broken{false};
  std::string broken_reason;  // under mu

  double Now() const { return std::chrono::duration<double>(Clock::now() - t0).count(); }

  // The communicator's thread: runs the queue in order until closed.
  void Loop() {
    while (true) {
      Task task;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return closing || !queue.empty(); });
        if (queue.empty()) return;
        task = std::move(queue.front());
        queue.pop_front();
      }
      {
        std::lock_guard lock(task.state->mu);
        task.state->started = Now();
      }
      Status s = task.run();
      task.state->Finish(std::move(s), Now());
    }
  }
};

Status Work::Wait(int timeout_ms) {
  if (!state_) return OkStatus();
  std::unique_lock lock(state_->mu);
  const double limit_s = timeout_ms >= 0 ? timeout_ms / 1000.0 : timeout_s_;
  if (limit_s <= 0) {
    state_->cv.wait(lock, [&] { return state_->done; });
  } else if (!state_->cv.wait_for(lock, std::chrono::duration<double>(limit_s), [&] { return state_->done; })) {
    return UnavailableError(fmt::format(
        "dist: {} has not finished after {:.0f} s: another rank has stopped, crashed or is stuck", state_->what,
        limit_s));
  }
  return state_->status;
}

#if STOKE_WITH_MPI
namespace {

Status MpiError(int code, std::string_view what) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  return InternalError(fmt::format("dist: MPI {} failed: {}", what, std::string_view(text, static_cast<size_t>(len))));
}

#define STOKE_MPI_OK(call, what)                        \
  do {                                                  \
    const int stoke_mpi_rc = (call);                    \
    if (stoke_mpi_rc != MPI_SUCCESS) return MpiError(stoke_mpi_rc, what); \
  } while (0)

MPI_Datatype MpiType(DataType t) {
  switch (t) {
    case DataType::kFloat32: return MPI_FLOAT;
    case DataType::kFloat64: return MPI_DOUBLE;
    case DataType::kInt32: return MPI_INT32_T;
    case DataType::kInt64: return MPI_INT64_T;
    case DataType::kUInt8: return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

MPI_Op MpiOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return MPI_SUM;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kMin: return MPI_MIN;
  }
  return MPI_SUM;
}

// MPI counts are ints: large buffers go in pieces of at most 2^30 elements.
constexpr size_t kMaxPiece = size_t{1} << 30;

}  // namespace
#endif

std::unique_ptr<Communicator> Communicator::Single() {
  std::unique_ptr<Communicator> c(new Communicator());
  c->impl_ = std::make_unique<Impl>();
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) == 0) c->host_ = host;
  return c;
}

Result<std::unique_ptr<Communicator>> Communicator::Create(CommunicatorOptions options) {
  if (!(options.timeout_s > 0)) {
    return InvalidArgumentError(fmt::format("dist: timeout {} s must be > 0", options.timeout_s));
  }
  const LaunchInfo launch = DetectLaunch();
  std::unique_ptr<Communicator> c = Single();
  c->options_ = options;
  if (launch.launcher.empty()) return c;
  // srun starts tasks with a process-management interface only when asked (--mpi=pmix, or
  // MpiDefault in slurm.conf). Without one, MPI_Init cannot find the other tasks and aborts the
  // process with a message about PMI: say what to do instead.
  if (launch.launcher == "srun" && !SrunGaveUsablePmi()) {
    if (launch.size == 1) return c;  // one task: a world of one, MPI not needed
    return UnavailableError(fmt::format(
        "dist: started by srun as rank {} of {}, but srun gave the tasks {}, so MPI cannot connect them; launch "
        "with `srun --mpi=pmix ...` (or set MpiDefault=pmix in slurm.conf)",
        launch.rank, launch.size,
        SrunGavePmi2() ? "PMI-2 (--mpi=pmi2 or MpiDefault=pmi2), which this build's Open MPI cannot use (it speaks PMIx)"
                       : "no process-management interface"));
  }
#if !STOKE_WITH_MPI
  if (launch.size == 1) return c;  // srun of one task: nothing to talk to
  return UnavailableError(fmt::format(
      "dist: started by {} as rank {} of {}, but this build has no MPI (libopenmpi-dev was not found at build "
      "time); rebuild with it, or run a single process",
      launch.launcher, launch.rank, launch.size));
#else
  struct Started {
    Status status;
    int rank = 0, size = 1, local_rank = 0, local_size = 1;
    std::string host;
  };
  std::promise<Started> started;
  auto future = started.get_future();
  Impl* impl = c->impl_.get();
  impl->thread = std::thread([impl, &started] {
    SetThreadName("stoke-comm");
    Started s;
    int provided = 0;
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS) {
      s.status = UnavailableError("dist: MPI_Init_thread failed");
      started.set_value(s);
      return;
    }
    auto init = [&]() -> Status {
      if (provided < MPI_THREAD_SERIALIZED) {
        return UnavailableError(fmt::format(
            "dist: this MPI library gives thread level {} (MPI_THREAD_SERIALIZED is needed)", provided));
      }
      // Errors come back as codes, so a failing call becomes a Status naming it.
      STOKE_MPI_OK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "set error handler");
      STOKE_MPI_OK(MPI_Comm_rank(MPI_COMM_WORLD, &s.rank), "comm rank");
      STOKE_MPI_OK(MPI_Comm_size(MPI_COMM_WORLD, &s.size), "comm size");
      MPI_Comm node;
      STOKE_MPI_OK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, s.rank, MPI_INFO_NULL, &node),
                   "split by node");
      STOKE_MPI_OK(MPI_Comm_rank(node, &s.local_rank), "node rank");
      STOKE_MPI_OK(MPI_Comm_size(node, &s.local_size), "node size");
      MPI_Comm_free(&node);
      char name[MPI_MAX_PROCESSOR_NAME] = {};
      int len = 0;
      STOKE_MPI_OK(MPI_Get_processor_name(name, &len), "processor name");
      s.host.assign(name, static_cast<size_t>(len));
      return OkStatus();
    };
    s.status = init();
    const bool ok = s.status.ok();
    started.set_value(s);
    if (!ok) {
      MPI_Finalize();
      return;
    }
    impl->Loop();
    // A broken world (a collective timed out) cannot finalise: the process is ending anyway.
    if (!impl->broken.load()) MPI_Finalize();
    {
      std::lock_guard lock(impl->mu);
      impl->exited = true;
    }
    impl->exited_cv.notify_all();
  });
  // MPI_Init waits for every rank of the launch to reach it, with no limit of its own: a rank that
  // exited before it (a wrapper script's failed step, a crash at start-up) left the others waiting
  // for good, silently. MPI cannot be aborted before it has started: the process ends, and the
  // launcher ends the rest.
  const int init_env = EnvInt("STOKE_DIST_INIT_TIMEOUT_S");
  const double init_s = init_env > 0 ? init_env : options.init_timeout_s;
  if (future.wait_for(std::chrono::duration<double>(init_s)) != std::future_status::ready) {
    std::fprintf(stderr,
                 "stoke: dist: started by %s as rank %d of %d, MPI_Init has not finished after %.0f s: another rank "
                 "never reached it (exited or crashed at start-up, or is not stoke); ending this one (a launch "
                 "whose processes start further apart: set STOKE_DIST_INIT_TIMEOUT_S)\n",
                 launch.launcher.c_str(), launch.rank, launch.size, init_s);
    std::fflush(stderr);
    std::_Exit(1);
  }
  Started s = future.get();
  if (!s.status.ok()) {
    impl->thread.join();
    return s.status;
  }
  c->mpi_ = true;
  c->rank_ = s.rank;
  c->size_ = s.size;
  c->local_rank_ = s.local_rank;
  c->local_size_ = s.local_size;
  c->host_ = s.host;
  return c;
#endif
}

Communicator::~Communicator() {
  if (!impl_ || !impl_->thread.joinable()) return;
  {
    std::unique_lock lock(impl_->mu);
    impl_->closing = true;
    impl_->cv.notify_all();
    // The thread runs what is still queued, then MPI_Finalize, which waits for every rank. A rank
    // leaving on its own error (the others still in a collective) would wait here for good: after
    // the collective timeout the world is ended instead, saying why.
    const double limit_s = options_.timeout_s > 0 ? options_.timeout_s : 300;
    if (!impl_->broken.load() &&
        !impl_->exited_cv.wait_for(lock, std::chrono::duration<double>(limit_s), [&] { return impl_->exited; })) {
      lock.unlock();
      Abort(UnavailableError(fmt::format(
          "dist: shutting down, MPI has not finished after {:.0f} s (collectives still queued, or MPI_Finalize "
          "waiting): another rank has stopped, failed or is stuck",
          limit_s)));
    }
  }
  if (impl_->broken.load()) {
    impl_->thread.detach();  // it may be blocked in MPI for good
  } else {
    impl_->thread.join();
  }
}

double Communicator::Now() const { return impl_->Now(); }

Work Communicator::Enqueue(std::string what, size_t bytes, std::function<Status()> run) {
  auto state = std::make_shared<detail::WorkState>();
  const uint64_t seq = next_seq_++;
  state->what = fmt::format("{} of {} (collective #{})", what, Bytes(bytes), seq);
  Work work(state, seq, options_.timeout_s);
  if (!mpi_) {
    const double now = Now();
    state->started = now;
    state->Finish(run(), now);
    return work;
  }
  std::lock_guard lock(impl_->mu);
  if (impl_->broken.load()) {
    state->Finish(UnavailableError(fmt::format("dist: {} not started: {}", state->what, impl_->broken_reason)), Now());
    return work;
  }
  impl_->queue.push_back({state, std::move(run)});
  impl_->cv.notify_one();
  return work;
}

Work Communicator::AllReduce(void* data, size_t count, DataType type, ReduceOp op) {
  const bool floating = type == DataType::kFloat32 || type == DataType::kFloat64;
  const std::string what = fmt::format("allreduce ({})", DataTypeName(type));
  const size_t bytes = count * SizeOf(type);
  if (op == ReduceOp::kAvg && !floating) {
    return Enqueue(what, bytes, [] { return InvalidArgumentError("dist: averaging needs a floating-point type"); });
  }
  if (!mpi_) return Enqueue(what, bytes, [] { return OkStatus(); });
#if STOKE_WITH_MPI
  const int world = size_;
  return Enqueue(what, bytes, [data, count, type, op, world]() -> Status {
    auto* p = static_cast<std::byte*>(data);
    for (size_t done = 0; done < count;) {
      const size_t n = std::min(kMaxPiece, count - done);
      STOKE_MPI_OK(MPI_Allreduce(MPI_IN_PLACE, p + done * SizeOf(type), static_cast<int>(n), MpiType(type),
                                 MpiOp(op), MPI_COMM_WORLD),
                   "allreduce");
      done += n;
    }
    if (op == ReduceOp::kAvg) {
      if (type == DataType::kFloat32) {
        const float k = 1.f / static_cast<float>(world);
        float* f = static_cast<float*>(data);
        for (size_t i = 0; i < count; ++i) f[i] *= k;
      } else {
        const double k = 1.0 / world;
        double* f = static_cast<double*>(data);
        for (size_t i = 0; i < count; ++i) f[i] *= k;
      }
    }
    return OkStatus();
  });
#else
  (void)data;  // nothing to move without MPI (a world of one returned above)
  return Work();
#endif
}

Work Communicator::Broadcast(void* data, size_t bytes, int root) {
  if (root < 0 || root >= size_) {
    return Enqueue("broadcast", bytes, [root, this] {
      return InvalidArgumentError(fmt::format("dist: broadcast root {} not in [0, {})", root, size_));
    });
  }
  if (!mpi_) return Enqueue("broadcast", bytes, [] { return OkStatus(); });
#if STOKE_WITH_MPI
  return Enqueue(fmt::format("broadcast from rank {}", root), bytes, [data, bytes, root]() -> Status {
    auto* p = static_cast<std::byte*>(data);
    for (size_t done = 0; done < bytes;) {
      const size_t n = std::min(kMaxPiece, bytes - done);
      STOKE_MPI_OK(MPI_Bcast(p + done, static_cast<int>(n), MPI_BYTE, root, MPI_COMM_WORLD), "broadcast");
      done += n;
    }
    return OkStatus();
  });
#else
  (void)data;  // nothing to move without MPI (a world of one returned above)
  return Work();
#endif
}

Work Communicator::AllGather(const void* send, size_t bytes, void* recv) {
  if (bytes > kMaxGather) {
    return Enqueue("allgather", bytes, [bytes] {
      return InvalidArgumentError(fmt::format("dist: allgather of {} bytes per rank (at most {})", bytes, kMaxGather));
    });
  }
  if (!mpi_) {
    return Enqueue("allgather", bytes, [send, bytes, recv] {
      if (bytes > 0 && send != recv) std::memmove(recv, send, bytes);
      return OkStatus();
    });
  }
#if STOKE_WITH_MPI
  return Enqueue("allgather", bytes * static_cast<size_t>(size_), [send, bytes, recv]() -> Status {
    STOKE_MPI_OK(MPI_Allgather(send, static_cast<int>(bytes), MPI_BYTE, recv, static_cast<int>(bytes), MPI_BYTE,
                               MPI_COMM_WORLD),
                 "allgather");
    return OkStatus();
  });
#else
  return Work();
#endif
}

Work Communicator::Barrier() {
  if (!mpi_) return Enqueue("barrier", 0, [] { return OkStatus(); });
#if STOKE_WITH_MPI
  return Enqueue("barrier", 0, []() -> Status {
    STOKE_MPI_OK(MPI_Barrier(MPI_COMM_WORLD), "barrier");
    return OkStatus();
  });
#else
  return Work();
#endif
}

Result<std::vector<std::string>> Communicator::AllGatherStrings(std::string_view mine) {
  const auto world = static_cast<size_t>(size_);
  const uint64_t length = mine.size();
  std::vector<uint64_t> lengths(world);
  // Into buffers of this function: a collective that does not finish (kUnavailable) would write
  // into them once freed, so the world ends instead.
  auto collected = [&](Work w) {
    Status s = w.Wait();
    if (s.code() == StatusCode::kUnavailable && size_ > 1) Abort(s);
    return s;
  };
  STOKE_RETURN_IF_ERROR(collected(AllGather(&length, sizeof length, lengths.data())));
  const uint64_t longest = *std::max_element(lengths.begin(), lengths.end());
  std::vector<std::string> out(world);
  if (longest == 0) return out;
  // Every rank sends the longest length, padded; each string is cut back to its own.
  std::string padded(mine);
  padded.resize(longest, '\0');
  std::string all(longest * world, '\0');
  STOKE_RETURN_IF_ERROR(collected(AllGather(padded.data(), longest, all.data())));
  for (size_t r = 0; r < world; ++r) out[r] = all.substr(r * longest, lengths[r]);
  return out;
}

Status Communicator::Agree(const Status& local, int timeout_ms) {
  if (size_ == 1) return local;
  int32_t failed = local.ok() ? 0 : 1;
  Work w = AllReduce(&failed, 1, DataType::kInt32, ReduceOp::kMax);
  // A decision that cannot be taken (a rank is gone or stuck) leaves nothing to agree with: the
  // world ends here rather than each rank going its own way (and waiting for the others for good).
  if (Status s = w.Wait(timeout_ms); !s.ok()) Abort(s);
  if (failed == 0) return OkStatus();
  // Someone failed: everyone learns who, where and why: the code's byte, the host, NUL, the message.
  std::string mine;
  if (!local.ok()) mine = std::string(1, static_cast<char>(local.code())) + host_ + '\0' + local.message();
  auto all = AllGatherStrings(mine);
  if (!all.ok()) Abort(all.status());
  if (!local.ok()) return local;
  for (int r = 0; r < size_; ++r) {
    const std::string& rec = (*all)[static_cast<size_t>(r)];
    if (rec.empty()) continue;
    const size_t nul = rec.find('\0', 1);
    return Status(static_cast<StatusCode>(rec[0]),
                  fmt::format("rank {} ({}) failed: {}", r, rec.substr(1, nul - 1), rec.substr(nul + 1)));
  }
  return InternalError("dist: a rank reported a failure but none sent one");
}

void Communicator::Abort(const Status& why, int exit_code) {
  std::fprintf(stderr, "stoke: rank %d of %d (%s): %s; ending every rank\n", rank_, size_, host_.c_str(),
               why.ToString().c_str());
  std::fflush(stderr);
  if (impl_) {
    std::lock_guard lock(impl_->mu);
    impl_->broken_reason = why.message();
    impl_->broken.store(true);
  }
#if STOKE_WITH_MPI
  // The communicator's thread may be blocked inside MPI: MPI_Abort is the one call made from here.
  // (The standard allows that only under MPI_THREAD_MULTIPLE, but with MULTIPLE asked for, Open
  // MPI 4.1.4's MPI_Abort hung in a futex in CI's stuck-rank test, so SERIALIZED is kept.) Whatever
  // the library does, this process ends within 5 s: exiting without MPI_Finalize, it has the
  // launcher end the others.
  if (mpi_) {
    std::thread([exit_code] {
      std::this_thread::sleep_for(std::chrono::seconds(5));
      std::fprintf(stderr, "stoke: MPI_Abort has not returned after 5 s; exiting\n");
      std::_Exit(exit_code);
    }).detach();
    MPI_Abort(MPI_COMM_WORLD, exit_code);
  }
#endif
  std::_Exit(exit_code);
}

}  // namespace stoke::dist
