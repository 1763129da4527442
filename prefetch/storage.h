// The loader's storage stage: reads the records the decoders will need, in the order the sampler
// will visit them, ahead of the decoders and within a memory budget. A dataset larger than the
// page cache then streams at the storage's speed (block shuffle: each block in one long
// sequential read; full shuffle: dozens of record reads in flight) instead of faulting records
// in one at a time inside the decode threads. Records already in the page cache are not copied:
// they are served from the map, as without the stage.
//
// The sampler's positions of each epoch are cut into segments (block shuffle: one window of
// blocks; otherwise `segment_positions` samples). A segment's records are sorted by their place in
// the data file, merged into ranges and read by a small pool of I/O threads with pread; the next
// segments are read while the decoders work on the current one, as far ahead as the budget allows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "common/status.h"
#include "dataset/dataset.h"
#include "dataset/sampler.h"

namespace stoke::prefetch {

struct StorageOptions {
  bool enabled = true;        // false: decoders read every record through the map (page faults)
  // Read-ahead budget; 0: block shuffle three windows (one decoding, one read, one being read),
  // else the larger of four segments and the ring's batches plus one, of mean-sized records; in
  // both cases at most half the memory the process may use.
  int64_t memory_bytes = 0;
  int io_threads = 0;         // reads in flight; 0: 32 for full shuffle, 4 otherwise
  int64_t segment_positions = 0;  // samples per segment; 0: the block window, else 256
  // Records whose pages are all in the page cache already are served from the map (no copy, no
  // read). Off only in tests, to make every record take the read path.
  bool use_map_when_resident = true;
  // After a range is read, drop it from the page cache (the stage holds its own copy): kAuto does
  // so when the data file is larger than half the memory available to the process, so that a
  // dataset which fits stays cached for the next epoch and one that does not cannot crowd out
  // everything else.
  enum class Cache { kAuto, kKeep, kDrop } cache = Cache::kAuto;
  // The memory this process may ever use, which caps the default budget at half of it; 0: the
  // machine's, or its cgroup's limit (tests set it to play a small machine).
  uint64_t physical_memory_bytes = 0;
};

// Where the stage's plan starts and ends, in the sampler's per-rank positions.
struct StoragePlan {
  int64_t start_epoch = 0;
  int64_t start_position = 0;       // in the first epoch
  int64_t epochs = 1;               // 0: until stopped
  int64_t positions_per_epoch = 0;  // the samples the loader takes from each epoch
  int decode_threads = 1;           // for the advice when decoders starve
  int64_t batch_size = 1;           // with ring_batches, the samples the loader works on at once
  int ring_batches = 1;
};

struct StorageStats {
  int64_t bytes_read = 0;        // read from the data file by the stage's I/O threads
  int64_t read_calls = 0;        // pread calls
  int64_t records_buffered = 0;  // served from read-ahead buffers
  int64_t records_mapped = 0;    // already in the page cache: served from the map
  int64_t records_direct = 0;    // not held by the stage (bad-record stand-ins, failed reads)
  double wait_s = 0;             // decoder time spent waiting for reads, summed over threads
  int64_t held_bytes = 0;        // read-ahead buffers held now
  int64_t peak_held_bytes = 0;
  int64_t budget_bytes = 0;
  int64_t segment_positions = 0;
  int io_threads = 0;
  bool drops_cache = false;
};

class StorageStage {
 public:
  // Takes every record's extent from the dataset (one pass over the records table), opens the
  // data file and starts the I/O threads. kInvalidArgument when a block-shuffle window cannot fit
  // in the budget (naming data.io.memory_mb and the window's size); kIoError when the data file
  // cannot be opened. The sampler must outlive the stage; the stage holds a share of the dataset.
  static Result<std::unique_ptr<StorageStage>> Create(const dataset::Dataset& dataset,
                                                      const dataset::Sampler& sampler,
                                                      const dataset::SamplerOptions& sampler_options,
                                                      const StoragePlan& plan, const StorageOptions& options);
  ~StorageStage();  // Stop() and join
  StorageStage(const StorageStage&) = delete;
  StorageStage& operator=(const StorageStage&) = delete;

  // The stored value of record `index`, which the sampler puts at `position` of `epoch`: a view
  // into a read-ahead buffer or into the map, valid until Release(epoch, position). Waits until
  // its segment has been read. An empty span when the stage does not hold that record there (a
  // stand-in for a bad record, a range whose read failed, a position outside the plan): the
  // caller then reads it through a dataset::Reader. kUnavailable once stopped. Thread-safe.
  Result<std::span<const std::byte>> Acquire(int64_t epoch, int64_t position, int64_t index);
  // The sample at (epoch, position) is done; a segment's buffer is freed when all of its samples
  // are. Call once for each position Acquire was called for. Thread-safe.
  void Release(int64_t epoch, int64_t position);
  // Stops reading; waiting and later Acquire calls return kUnavailable. Safe from any thread.
  void Stop();

  StorageStats stats() const;

  struct State;

 private:
  explicit StorageStage(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace stoke::prefetch
