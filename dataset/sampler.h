// Sampler: the record indices one rank visits in one epoch.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace stoke::dataset {

enum class ShuffleMode {
  kSequential,  // 0, 1, 2, ... (evaluation; fastest reads)
  kFull,        // a fresh uniform permutation every epoch (the usual choice when data fits in RAM)
  kBlock,       // shuffle contiguous blocks, then samples within a window of blocks: near-random
                // order with long sequential reads, for data larger than the page cache
};
Result<ShuffleMode> ParseShuffleMode(std::string_view name);  // "sequential" | "full" | "block"

// How an epoch's order is divided among the ranks of a data-parallel run.
enum class Sharding {
  kContiguous,   // rank r takes the r-th contiguous 1/world of the epoch (padded or cut to equal)
  kGlobalBatch,  // the epoch is cut into global batches; rank r takes samples [rB, (r+1)B) of each
                 // (B = global_batch / world): global batch k holds the same samples, with the same
                 // crops, whatever the world size
  kExact,        // contiguous shards of floor or ceil(n / world), every record exactly once across
                 // the ranks (evaluation: no record counted twice, none left out)
};

struct SamplerOptions {
  ShuffleMode mode = ShuffleMode::kFull;
  uint64_t seed = 0;
  int64_t block_size = 64;    // kBlock: records per contiguous block; > 0
  int64_t window_blocks = 8;  // kBlock: blocks whose samples are mixed together; > 0
  int rank = 0;               // this process's shard; 0 <= rank < world_size
  int world_size = 1;         // number of shards; > 0
  // When the record count is not a multiple of world_size: false pads the epoch with its first
  // records so every rank gets ceil(n/world) (each record at least once, a few twice); true drops
  // the last n % world records of the epoch order so ranks stay disjoint, at floor(n/world).
  bool drop_last = false;
  Sharding sharding = Sharding::kContiguous;
  // kGlobalBatch: samples per global batch, a positive multiple of world_size. The epoch's tail
  // (n % global_batch samples) is split evenly too, padded (drop_last false) or cut.
  int64_t global_batch = 0;
};

// Deterministic: Epoch(e) depends only on (n, options, e), never on threads or history, so every
// rank computes the same global order and takes its own slice of it (contiguous, or its slice of
// every global batch). Thread-safe (immutable).
class Sampler {
 public:
  // kInvalidArgument naming the bad option.
  static Result<Sampler> Create(int64_t num_records, SamplerOptions options);

  // This rank's records per epoch (equal on every rank, except with Sharding::kExact).
  int64_t samples_per_rank() const { return per_rank_; }
  // The options in effect: block_size and window_blocks clamped to the record count (the same
  // order as the unclamped values, which could overflow).
  const SamplerOptions& options() const { return options_; }
  // This rank's record indices for `epoch`, in visiting order.
  std::vector<int64_t> Epoch(int64_t epoch) const;
  // Where each of this rank's samples sits in the global order, for every epoch:
  // Epoch(e)[i] == GlobalOrder(e)[ShardPositions()[i]]. With Sharding::kGlobalBatch a sample has
  // the same position at any world size (so a bad record's stand-in can be too).
  std::vector<int64_t> ShardPositions() const;
  // The whole epoch order before sharding (n records, a permutation of [0, n)).
  std::vector<int64_t> GlobalOrder(int64_t epoch) const;

 private:
  Sampler(int64_t n, SamplerOptions o, int64_t per_rank) : n_(n), options_(o), per_rank_(per_rank) {}
  int64_t n_;
  SamplerOptions options_;
  int64_t per_rank_;
};

}  // namespace stoke::dataset
