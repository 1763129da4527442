#include "dataset/sampler.h"

#include <algorithm>
#include <numeric>
#include <span>

#include <fmt/format.h>

#include "common/random.h"

namespace stoke::dataset {

Result<ShuffleMode> ParseShuffleMode(std::string_view name) {
  if (name == "sequential" || name == "none") return ShuffleMode::kSequential;
  if (name == "full") return ShuffleMode::kFull;
  if (name == "block") return ShuffleMode::kBlock;
  return InvalidArgumentError(
      fmt::format("sampler: shuffle mode '{}' (expected sequential, full or block)", name));
}

Result<Sampler> Sampler::Create(int64_t num_records, SamplerOptions o) {
  if (num_records < 0) return InvalidArgumentError("sampler: negative record count");
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
  const int64_t world = o.world_size;
  int64_t per_rank = o.drop_last ? num_records / world : (num_records + world - 1) / world;
  if (num_records > 0 && per_rank == 0) {
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

std::vector<int64_t> Sampler::Epoch(int64_t epoch) const {
  std::vector<int64_t> order = GlobalOrder(epoch);
  const int64_t total = per_rank_ * options_.world_size;
  // Pad by wrapping around (drop_last=false) or truncate (drop_last=true) to world * per_rank.
  for (int64_t i = n_; i < total; ++i) order.push_back(order[static_cast<size_t>(i % n_)]);
  const int64_t begin = per_rank_ * options_.rank;
  return std::vector<int64_t>(order.begin() + begin, order.begin() + begin + per_rank_);
}

}  // namespace stoke::dataset
