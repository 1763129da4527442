// Data-parallel training over dist/: the StepSync the backends call during a step (gradient
// buckets that overlap backward, synchronised batch norm) and the trainer's collective steps
// (one model on every rank at start, a check that the ranks still agree).
//
//   auto comm = *dist::Communicator::Create();
//   DataParallel dp(*comm);
//   STOKE_RETURN_IF_ERROR(net->SetStepSync(&dp));
//   STOKE_RETURN_IF_ERROR(BroadcastState(*comm, *net));    // rank 0's parameters everywhere
//   per step: net->TrainStep(...)                           // averages inside
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "dist/communicator.h"
#include "dist/reducer.h"
#include "train/network.h"

namespace stoke::train {

// Communication totals of a run, for the trainer's summary and `stoke bench train`.
struct DataParallelStats {
  int64_t steps = 0;
  double comm_s = 0;        // time the communicator spent averaging gradients
  double overlapped_s = 0;  // ... of it while backward was still computing
  double wait_s = 0;        // time the step blocked for the averaging after backward
  int buckets = 0;
  double bucket_mb = 0;     // the largest bucket
};

class DataParallel final : public StepSync {
 public:
  explicit DataParallel(dist::Communicator& comm, dist::ReducerOptions options = {})
      : comm_(comm), options_(options) {}

  int world() const override { return comm_.size(); }
  int rank() const override { return comm_.rank(); }
  Status AttachGradients(std::span<float> flat, std::vector<GradientSlice> slices) override;
  void GradientReady(int index) override;
  Status FinishGradients() override;
  Status CombineMoments(std::span<float> mean, std::span<float> var) override;
  Status SumOverRanks(std::span<float> values) override;
  Status SumOverRanks(std::span<double> values) override;
  Status AverageOverRanks(std::span<float> values) override;
  Status BroadcastBytes(std::span<std::byte> data, int root) override;
  Status GatherBytes(std::span<const std::byte> mine, std::span<std::byte> all) override;
  int local_rank() const override { return comm_.local_rank(); }
  double timeout_s() const override { return comm_.timeout_s(); }
  // One step's communication, from the host reducer (FinishGradients) or a device backend.
  void AddDeviceCommTime(double comm_s, double overlapped_s, double wait_s) override;
  void DescribeDeviceBuckets(int buckets, double largest_mb) override {
    stats_.buckets = buckets;
    stats_.bucket_mb = largest_mb;
  }
  size_t bucket_bytes() const override { return options_.bucket_bytes; }
  size_t first_bucket_bytes() const override { return options_.first_bucket_bytes; }

  // Fault injection for tests: this rank's next gradient (and statistics) are replaced by NaN as
  // they become ready, before averaging.
  void PoisonNextStep() { poison_ = true; }
  const DataParallelStats& stats() const { return stats_; }
  dist::Communicator& comm() { return comm_; }

 private:
  dist::Communicator& comm_;
  dist::ReducerOptions options_;
  std::span<float> flat_;
  std::vector<GradientSlice> slices_;
  std::optional<dist::Reducer> reducer_;
  DataParallelStats stats_;
  bool poison_ = false;
};

// Rank 0's parameters, running statistics and optimizer state, loaded on every other rank. Checks
// first that every rank built the same tensors (names and shapes); kInvalidArgument naming the
// first rank that differs.
Status BroadcastState(dist::Communicator& comm, Network& net);

// A digest of every tensor of the state (the bits of every float, names and shapes); without
// `running_stats`, batch norm's running statistics are left out.
Result<uint64_t> StateDigest(const Network& net, bool running_stats = true);

// Every rank's StateDigest compared: kInternal naming the ranks whose model differs from rank 0's.
// Batch norm's running statistics are compared only with model.sync_batchnorm: otherwise each rank
// keeps its own until they are averaged (before evaluations and checkpoints).
Status CheckSameState(dist::Communicator& comm, const Network& net);

// The GPU a rank trains on. Its local rank when the machine shows a GPU per rank of the machine;
// GPU 0 when the launcher shows each rank a single GPU of its own (srun --gpus-per-task=1, or
// CUDA_VISIBLE_DEVICES set per rank); with `share` (dist.device_comm: host), ranks beyond the GPUs
// take them in turn (local rank modulo the count); otherwise kInvalidArgument naming the rank and the
// counts.
Result<int> DeviceForRank(int rank, int local_rank, int local_size, int visible_devices, bool share = false);

// Every rank's machine (its processor name), in rank order. Collective.
Result<std::vector<std::string>> RankHosts(dist::Communicator& comm);

// FNV-1a (64 bits) of `text`: a digest every rank computes alike (StateDigest's hash).
uint64_t TextDigest(std::string_view text);

// Sums over the ranks, in place (blocking); a no-op on a world of one.
Status SumStats(dist::Communicator& comm, BatchStats& stats);

}  // namespace stoke::train
