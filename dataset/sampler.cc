#include "dataset/sampler.h"

#include <algorithm>
#include <numeric>
#include <span>

#include <fmt/format.h>

#include "common/random.h"
#include "dataset/record.h"

namespace stoke::dataset {

Result<ShuffleMode> ParseShuffleMode(std::string_view name) {
  if (name == "sequential" || name == "none") return ShuffleMode::kSequential;
  if (name == "full") return ShuffleMode::kFull;
  if (name == "block") return ShuffleMode::kBlock;
  return InvalidArgumentError(
      fmt::format("sampler: shuffle mode '{}' (expected sequential, full or block)", name));
}

namespace {

// floor(rank * n / world) without the product, which overflows for n near kMaxRecords and a world
// of millions: rank * (n / world) + rank * (n % world) / world, the second product below world^2.
int64_t ShareStart(int64_t rank, int64_t n, int64_t world) {
  return rank * (n / world) + rank * (n % world) / world;
}

}  // namespace

Result<Sampler> Sampler::Create(int64_t num_records, SamplerOptions o) {
  if (num_records < 0) return InvalidArgumentError("sampler: negative record count");
  if (num_records > kMaxRecords) {
    return InvalidArgumentError(fmt::format(
        "sampler: {} records, more than a dataset may hold ({})", num_records, kMaxRecords));
  }
  if (o.world_size <= 0) {
    return InvalidArgumentError(fmt::format("sampler: world_size {} must be > 0", o.world_size));
  }
  if (o.rank < 0 || o.rank >= o.world_size) {
    return InvalidArgumentError(
        fmt::format("sampler: rank {} not in [0, {})", o.rank, o.world_size));
  }
  if (o.block_size <= 0 || o.window_blocks <= 0) {
    return InvalidArgumentError("sampler: block_size and window_blocks must be > 0");
  }
  // A block larger than the dataset is the whole dataset, and a window of more blocks than there
  // are is all of them: clamped, the order is the same and block_size * window_blocks fits.
  const int64_t all = std::max<int64_t>(1, num_records);
  o.block_size = std::min(o.block_size, all);
  o.window_blocks = std::min(o.window_blocks, (all + o.block_size - 1) / o.block_size);
  const int64_t world = o.world_size;
  int64_t per_rank = 0;
  switch (o.sharding) {
    case Sharding::kContiguous:
      per_rank = o.drop_last ? num_records / world : (num_records + world - 1) / world;
      break;
    case Sharding::kGlobalBatch: {
      if (o.global_batch <= 0 || o.global_batch % world != 0) {
        return InvalidArgumentError(fmt::format(
            "sampler: the global batch {} must be a positive multiple of the world size {}", o.global_batch, world));
      }
      const int64_t full = num_records / o.global_batch, rem = num_records % o.global_batch;
      per_rank = full * (o.global_batch / world) + (o.drop_last ? rem / world : (rem + world - 1) / world);
      break;
    }
    case Sharding::kExact:
      per_rank =
          ShareStart(o.rank + 1, num_records, world) - ShareStart(o.rank, num_records, world);
      break;
  }
  if (num_records > 0 && per_rank == 0 && o.sharding != Sharding::kExact) {
    return InvalidArgumentError(fmt::format(
        "sampler: {} records cannot give each of {} ranks one with drop_last", num_records, world));
  }
  return Sampler(num_records, o, per_rank);
}

std::vector<int64_t> Sampler::GlobalOrder(int64_t epoch) const {
  std::vector<int64_t> order(static_cast<size_t>(n_));
  std::iota(order.begin(), order.end(), int64_t{0});
  SplitMix64 rng(MixSeed(options_.seed, static_cast<uint64_t>(epoch)));
  switch (options_.mode) {
    case ShuffleMode::kSequential:
      break;
    case ShuffleMode::kFull:
      Shuffle(std::span(order), rng);
      break;
    case ShuffleMode::kBlock: {
      const int64_t bs = options_.block_size;
      const int64_t num_blocks = (n_ + bs - 1) / bs;
      std::vector<int64_t> blocks(static_cast<size_t>(num_blocks));
      std::iota(blocks.begin(), blocks.end(), int64_t{0});
      Shuffle(std::span(blocks), rng);
      size_t out = 0;
      for (int64_t b : blocks) {
        for (int64_t i = b * bs; i < std::min(n_, (b + 1) * bs); ++i) order[out++] = i;
      }
      // Mix samples inside each window of consecutive (shuffled) blocks: a reader touches at most
      // window_blocks blocks at a time, each read sequentially.
      const int64_t window = bs * options_.window_blocks;
      for (int64_t start = 0; start < n_; start += window) {
        const int64_t len = std::min(window, n_ - start);
        Shuffle(std::span(order).subspan(static_cast<size_t>(start), static_cast<size_t>(len)),
                rng);
      }
      break;
    }
  }
  return order;
}

std::vector<int64_t> Sampler::ShardPositions() const {
  const int64_t world = options_.world_size, rank = options_.rank;
  if (n_ == 0) return {};
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(per_rank_));
  auto take = [&](int64_t begin, int64_t count) {
    // Past the end wraps around to the epoch's first records (padding).
    for (int64_t i = begin; i < begin + count; ++i) mine.push_back(i % n_);
  };
  switch (options_.sharding) {
    case Sharding::kContiguous:
      take(per_rank_ * rank, per_rank_);
      break;
    case Sharding::kGlobalBatch: {
      const int64_t g = options_.global_batch, b = g / world, full = n_ / g;
      for (int64_t k = 0; k < full; ++k) take(k * g + rank * b, b);
      const int64_t tail = per_rank_ - full * b;
      take(full * g + rank * tail, tail);
      break;
    }
    case Sharding::kExact:
      take(ShareStart(rank, n_, world), per_rank_);
      break;
  }
  return mine;
}

std::vector<int64_t> Sampler::Epoch(int64_t epoch) const {
  const std::vector<int64_t> order = GlobalOrder(epoch);
  std::vector<int64_t> mine = ShardPositions();
  for (int64_t& p : mine) p = order[static_cast<size_t>(p)];
  return mine;
}

}  // namespace stoke::dataset
