// Ranks and collectives for data-parallel training. One process per GPU (or per CPU trainer),
// launched by mpirun or srun; this module wraps MPI (launch, rank discovery, the CPU backend's
// collectives) and knows nothing of models or datasets.
//
//   auto comm = dist::Communicator::Create();     // a world of one when no launcher started us
//   dist::Work w = comm->AllReduce(grad, n, dist::DataType::kFloat32, dist::ReduceOp::kAvg);
//   ... compute ...
//   STOKE_RETURN_IF_ERROR(w.Wait());               // kUnavailable: timed out (a rank is gone or stuck)
//
// Every MPI call runs on one thread the communicator owns (MPI_THREAD_SERIALIZED): it initialises
// MPI, runs the queued collectives strictly in the order they were enqueued, and finalises MPI.
// Every rank must enqueue the same collectives in the same order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace stoke::dist {

enum class DataType { kFloat32, kFloat64, kInt32, kInt64, kUInt8 };
size_t SizeOf(DataType type);
std::string_view DataTypeName(DataType type);

enum class ReduceOp { kSum, kAvg, kMax, kMin };  // kAvg: the sum divided by the world size (floats)

// What the launcher told this process through its environment (nothing of MPI is touched):
// Open MPI's mpirun (OMPI_COMM_WORLD_*), Slurm's srun (SLURM_PROCID, ...), PMIx or PMI.
struct LaunchInfo {
  std::string launcher;  // "" when the process was started by hand
  int rank = 0;
  int size = 1;
  int local_rank = 0;
};
LaunchInfo DetectLaunch();

namespace detail {
struct WorkState;
}

// One collective in flight. Move-only. Enqueue errors are already in it; run errors come out of
// Wait(). A default-constructed Work is finished and ok.
class Work {
 public:
  Work() = default;
  ~Work();
  Work(Work&&) noexcept;
  Work& operator=(Work&&) noexcept;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  // Blocks until the collective has finished. timeout_ms < 0: the communicator's timeout. A timeout
  // is kUnavailable naming the collective, which stays queued or running and uses its buffers when
  // the other ranks arrive: a caller whose buffers do not outlive it ends the run
  // (Communicator::Abort) rather than return over them. (A late rank that does arrive finds the
  // world as it was.)
  [[nodiscard]] Status Wait(int timeout_ms = -1);
  bool done() const;
  uint64_t seq() const { return seq_; }
  // Steady-clock seconds (since the communicator was created) when the communicator's thread
  // started and finished the collective; 0 until then.
  double started_s() const;
  double finished_s() const;

 private:
  friend class Communicator;
  Work(std::shared_ptr<detail::WorkState> state, uint64_t seq, double timeout_s)
      : state_(std::move(state)), seq_(seq), timeout_s_(timeout_s) {}
  std::shared_ptr<detail::WorkState> state_;
  uint64_t seq_ = 0;
  double timeout_s_ = 0;
};

struct CommunicatorOptions {
  // A collective that has not finished after this long means a rank is gone or stuck.
  double timeout_s = 300;
  // MPI_Init not finished after this long means a rank of the launch never reached it (exited or
  // crashed at start-up): the process ends, saying so. STOKE_DIST_INIT_TIMEOUT_S (whole seconds,
  // > 0) sets it instead, for launches whose processes start minutes apart.
  double init_timeout_s = 600;
};

class Communicator {
 public:
  // Under a launcher: initialises MPI on the communicator's thread and reads rank, world size and
  // local rank (ranks sharing a node, by MPI_Comm_split_type). Without one: a world of one that
  // never touches MPI. kUnavailable when launched but this build has no MPI, or MPI fails to start.
  static Result<std::unique_ptr<Communicator>> Create(CommunicatorOptions options = {});
  // A world of one, whatever the environment (tests, tools that run on one rank).
  static std::unique_ptr<Communicator> Single();
  // Joins the thread and finalises MPI (a healthy world waits for the queue to drain first).
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  bool uses_mpi() const { return mpi_; }
  const std::string& host() const { return host_; }
  double timeout_s() const { return options_.timeout_s; }
  // Changes the timeout of the collectives started from now on (> 0): a run creates its
  // communicator before it has read the config that sets it.
  void set_timeout_s(double seconds) {
    if (seconds > 0) options_.timeout_s = seconds;
  }
  // Seconds since Create on the steady clock (the time base of Work::started_s()).
  double Now() const;

  // In place, asynchronous. `data` must stay valid and untouched until the Work has finished.
  Work AllReduce(void* data, size_t count, DataType type, ReduceOp op);
  Work Broadcast(void* data, size_t bytes, int root);
  // recv holds size() * bytes: rank r's `send` lands at recv + r * bytes.
  Work AllGather(const void* send, size_t bytes, void* recv);
  // Every rank's `mine`, in rank order, whatever their lengths. Blocking, and collective like the
  // others: one gather of the lengths, and a second only when some rank has bytes to send.
  Result<std::vector<std::string>> AllGatherStrings(std::string_view mine);
  Work Barrier();

  // A collective decision on an outcome: every rank passes its own; every rank gets the same
  // answer. Ok when all are ok; otherwise the error of the lowest failing rank, its message
  // prefixed "rank R (host) failed: " on the other ranks. When its collectives fail or time out (a
  // rank is gone or stuck), there is nothing left to agree with: it ends every rank (Abort).
  // `timeout_ms` >= 0: how long to wait for the slowest rank instead of the communicator's timeout
  // (for a decision that follows one rank's file I/O, which may take longer than a collective).
  Status Agree(const Status& local, int timeout_ms = -1);

  // Ends every rank of the world now (MPI_Abort) after logging `why`, and this process within 5 s
  // should MPI_Abort not return; a world of one exits.
  [[noreturn]] void Abort(const Status& why, int exit_code = 1);

  struct Impl;

 private:
  Communicator() = default;
  Work Enqueue(std::string what, size_t bytes, std::function<Status()> run);
  CommunicatorOptions options_;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  bool mpi_ = false;
  std::string host_;
  uint64_t next_seq_ = 0;
  std::unique_ptr<Impl> impl_;
};

}  // namespace stoke::dist
