#include "train/data_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "common/digest.h"

namespace stoke::train {

Status DataParallel::AttachGradients(std::span<float> flat, std::vector<GradientSlice> slices) {
  std::vector<dist::Slice> s;
  s.reserve(slices.size());
  for (const GradientSlice& g : slices) s.push_back({g.offset, g.count});
  STOKE_ASSIGN_OR_RETURN(auto r, dist::Reducer::Create(comm_, flat, std::move(s), options_));
  flat_ = flat;
  slices_ = std::move(slices);
  reducer_.emplace(std::move(r));
  stats_.buckets = reducer_->num_buckets();
  size_t largest = 0;
  for (size_t b : reducer_->bucket_sizes()) largest = std::max(largest, b);
  stats_.bucket_mb = static_cast<double>(largest * sizeof(float)) / (1 << 20);
  return OkStatus();
}

void DataParallel::GradientReady(int index) {
  if (!reducer_) return;
  if (poison_ && index >= 0 && static_cast<size_t>(index) < slices_.size()) {
    const GradientSlice& g = slices_[static_cast<size_t>(index)];
    std::fill_n(flat_.begin() + static_cast<ptrdiff_t>(g.offset), g.count, std::numeric_limits<float>::quiet_NaN());
  }
  reducer_->Ready(index);
}

Status DataParallel::FinishGradients() {
  if (!reducer_) return InternalError("data-parallel: no gradients attached");
  poison_ = false;
  Status s = reducer_->Finish();
  const dist::ReducerStepStats& st = reducer_->last_step();
  AddDeviceCommTime(st.comm_s, st.overlapped_s, st.wait_s);
  return s;
}

namespace {
// Waits for a collective into buffers of the caller's (locals, mostly). One that does not finish
// (a rank gone or stuck: kUnavailable) is still queued or running, and would write into them
// after they are freed: the world ends here rather than return over buffers still in use.
Status Collected(dist::Communicator& comm, dist::Work work) {
  Status s = work.Wait();
  if (s.code() == StatusCode::kUnavailable && comm.size() > 1) comm.Abort(s);
  return s;
}
}  // namespace

Status DataParallel::CombineMoments(std::span<float> mean, std::span<float> var) {
  if (mean.size() != var.size()) return InvalidArgumentError("data-parallel: mean and variance sizes differ");
  const size_t c = mean.size();
  const int w = comm_.size();
  // Gather every rank's (mean, var) and combine in rank order: the same answer on every rank.
  // With equal counts: mu = mean of means; var = mean of variances + variance of the means.
  std::vector<float> mine(2 * c), all(2 * c * static_cast<size_t>(w));
  std::copy(mean.begin(), mean.end(), mine.begin());
  std::copy(var.begin(), var.end(), mine.begin() + static_cast<ptrdiff_t>(c));
  STOKE_RETURN_IF_ERROR(Collected(comm_, comm_.AllGather(mine.data(), mine.size() * sizeof(float), all.data())));
  for (size_t i = 0; i < c; ++i) {
    double mu = 0, v = 0;
    for (int r = 0; r < w; ++r) mu += all[static_cast<size_t>(r) * 2 * c + i];
    mu /= w;
    for (int r = 0; r < w; ++r) {
      const double d = all[static_cast<size_t>(r) * 2 * c + i] - mu;
      v += all[static_cast<size_t>(r) * 2 * c + c + i] + d * d;
    }
    mean[i] = static_cast<float>(mu);
    var[i] = static_cast<float>(v / w);
  }
  return OkStatus();
}

Status DataParallel::SumOverRanks(std::span<float> values) {
  return Collected(comm_, comm_.AllReduce(values.data(), values.size(), dist::DataType::kFloat32, dist::ReduceOp::kSum));
}

Status DataParallel::SumOverRanks(std::span<double> values) {
  return Collected(comm_, comm_.AllReduce(values.data(), values.size(), dist::DataType::kFloat64, dist::ReduceOp::kSum));
}

Status DataParallel::AverageOverRanks(std::span<float> values) {
  return Collected(comm_, comm_.AllReduce(values.data(), values.size(), dist::DataType::kFloat32, dist::ReduceOp::kAvg));
}

uint64_t TextDigest(std::string_view text) { return Fnv1a(text); }

namespace {

// Names and shapes of a state, as one digest.
uint64_t LayoutDigest(const std::vector<NamedTensor>& state) {
  uint64_t h = kFnvBasis;
  for (const NamedTensor& t : state) {
    h = Fnv1a(t.name.data(), t.name.size() + 1, h);
    h = Fnv1a(t.dims.data(), t.dims.size() * sizeof(int64_t), h);
    const uint64_t n = t.values.size();
    h = Fnv1a(&n, sizeof n, h);
  }
  return h;
}

}  // namespace

Result<uint64_t> StateDigest(const Network& net, bool running_stats) {
  STOKE_ASSIGN_OR_RETURN(auto state, net.State());
  if (!running_stats) {
    std::erase_if(state, [](const NamedTensor& t) {
      return t.name.ends_with(".running_mean") || t.name.ends_with(".running_var");
    });
  }
  uint64_t h = LayoutDigest(state);
  for (const NamedTensor& t : state) h = Fnv1a(t.values.data(), t.values.size() * sizeof(float), h);
  return h;
}

namespace {

// Every rank's 64-bit value, in rank order.
Result<std::vector<uint64_t>> GatherU64(dist::Communicator& comm, uint64_t mine) {
  std::vector<uint64_t> all(static_cast<size_t>(comm.size()));
  STOKE_RETURN_IF_ERROR(Collected(comm, comm.AllGather(&mine, sizeof mine, all.data())));
  return all;
}

}  // namespace

Status BroadcastState(dist::Communicator& comm, Network& net) {
  if (comm.size() == 1) return OkStatus();
  Result<std::vector<NamedTensor>> state = net.State();
  // Whether every rank could read its state, and built the same tensors as rank 0.
  STOKE_RETURN_IF_ERROR(comm.Agree(state.status()));
  STOKE_ASSIGN_OR_RETURN(auto layouts, GatherU64(comm, LayoutDigest(*state)));
  for (int r = 1; r < comm.size(); ++r) {
    if (layouts[static_cast<size_t>(r)] != layouts[0]) {
      return InvalidArgumentError(fmt::format(
          "data-parallel: rank {} built a different model from rank 0 (tensor names or shapes differ); every rank "
          "must run the same config and stoke version",
          r));
    }
  }
  for (NamedTensor& t : *state) {
    STOKE_RETURN_IF_ERROR(Collected(comm, comm.Broadcast(t.values.data(), t.values.size() * sizeof(float), 0)));
  }
  Status loaded = comm.rank() == 0 ? OkStatus() : net.LoadState(*state);
  return comm.Agree(loaded);
}

Status CheckSameState(dist::Communicator& comm, const Network& net) {
  Result<uint64_t> mine = StateDigest(net, net.options().sync_batchnorm);
  STOKE_RETURN_IF_ERROR(comm.Agree(mine.status()));
  STOKE_ASSIGN_OR_RETURN(auto all, GatherU64(comm, *mine));
  std::vector<int> differ;
  for (int r = 1; r < comm.size(); ++r) {
    if (all[static_cast<size_t>(r)] != all[0]) differ.push_back(r);
  }
  if (differ.empty()) return OkStatus();
  return InternalError(fmt::format("data-parallel: the model on rank(s) {} differs from rank 0's", fmt::join(differ, ", ")));
}

Result<std::vector<std::string>> RankHosts(dist::Communicator& comm) { return comm.AllGatherStrings(comm.host()); }

Result<int> DeviceForRank(int rank, int local_rank, int local_size, int visible_devices, bool share) {
  if (visible_devices >= local_size && local_rank < visible_devices) return local_rank;
  if (visible_devices == 1) return 0;
  if (share && visible_devices > 1) return local_rank % visible_devices;
  return InvalidArgumentError(fmt::format(
      "rank {}: {} ranks share this machine but it shows {} GPUs: start one rank per GPU (mpirun -np, or srun "
      "--ntasks-per-node with --gpus-per-task=1), show each rank one GPU through CUDA_VISIBLE_DEVICES, or let ranks "
      "share GPUs with dist.device_comm: host",
      rank, local_size, visible_devices));
}

Status SumStats(dist::Communicator& comm, BatchStats& stats) {
  if (comm.size() == 1) return OkStatus();
  double v[5] = {stats.loss_sum, static_cast<double>(stats.top1), static_cast<double>(stats.top5),
                 static_cast<double>(stats.count), static_cast<double>(stats.skipped)};
  STOKE_RETURN_IF_ERROR(Collected(comm, comm.AllReduce(v, 5, dist::DataType::kFloat64, dist::ReduceOp::kSum)));
  stats.loss_sum = v[0];
  stats.top1 = std::llround(v[1]);
  stats.top5 = std::llround(v[2]);
  stats.count = std::llround(v[3]);
  stats.skipped = std::llround(v[4]);
  return OkStatus();
}

Status DataParallel::BroadcastBytes(std::span<std::byte> data, int root) {
  if (comm_.size() == 1) return OkStatus();
  return Collected(comm_, comm_.Broadcast(data.data(), data.size(), root));
}

Status DataParallel::GatherBytes(std::span<const std::byte> mine, std::span<std::byte> all) {
  if (all.size() != mine.size() * static_cast<size_t>(comm_.size())) {
    return InvalidArgumentError(fmt::format("data-parallel: gathering {} bytes from {} ranks into {}", mine.size(),
                                            comm_.size(), all.size()));
  }
  return Collected(comm_, comm_.AllGather(mine.data(), mine.size(), all.data()));
}

void DataParallel::AddDeviceCommTime(double comm_s, double overlapped_s, double wait_s) {
  stats_.steps++;
  stats_.comm_s += comm_s;
  stats_.overlapped_s += overlapped_s;
  stats_.wait_s += wait_s;
}

}  // namespace stoke::train
