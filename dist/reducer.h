// Gradient averaging in buckets that overlap the backward pass. The gradients are slices of one
// flat float32 buffer; slices are grouped, in the order backward finishes them, into buckets of
// about `bucket_bytes` (a small first one so communication starts early). A bucket is averaged
// across the ranks as soon as every slice in it is ready, strictly in bucket order, so every rank
// runs the same collectives in the same order whatever order its backward marks them in.
//
//   Reducer r = *Reducer::Create(comm, flat, slices, {});
//   per step:  backward ... r.Ready(i) ...;  STOKE_RETURN_IF_ERROR(r.Finish());
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "dist/communicator.h"

namespace stoke::dist {

struct ReducerOptions {
  size_t bucket_bytes = size_t{25} << 20;
  size_t first_bucket_bytes = size_t{1} << 20;
};

// A gradient: `count` floats at `offset` in the flat buffer.
struct Slice {
  size_t offset = 0;
  size_t count = 0;
};

// What the last step's communication cost: the communicator's busy time, and how much of it ran
// before Finish() was called (while backward was still computing).
struct ReducerStepStats {
  double comm_s = 0;
  double overlapped_s = 0;
  double wait_s = 0;  // time Finish() blocked
};

class Reducer {
 public:
  // `slices` in the order backward finishes them. Consecutive slices that are adjacent in the
  // buffer share a bucket; kInvalidArgument for a slice outside the buffer or overlapping another.
  static Result<Reducer> Create(Communicator& comm, std::span<float> buffer, std::vector<Slice> slices,
                                ReducerOptions options = {});

  // Slice `index` (into the `slices` given to Create) holds its final local gradient. Launches
  // every bucket that is complete and whose predecessors are launched. Each slice once per step.
  void Ready(int index);
  // Launches what is left (slices never marked ready are averaged as they are) and waits for every
  // bucket: the whole buffer then holds the average over the ranks. The first error of a bucket
  // (kUnavailable: timed out) comes back; resets for the next step.
  Status Finish();

  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  // Bucket sizes in floats, in launch order.
  std::vector<size_t> bucket_sizes() const;
  const ReducerStepStats& last_step() const { return last_; }

 private:
  struct Bucket {
    size_t offset = 0, count = 0;
    int slices = 0;
  };
  Reducer(Communicator* comm, std::span<float> buffer) : comm_(comm), buffer_(buffer) {}
  void Launch();
  Communicator* comm_;
  std::span<float> buffer_;
  std::vector<int> bucket_of_;    // per slice
  std::vector<Bucket> buckets_;
  std::vector<int> pending_;      // per bucket: slices not yet ready this step
  std::vector<bool> marked_;      // per slice: ready this step
  int next_ = 0;                  // the next bucket to launch
  std::vector<Work> works_;
  ReducerStepStats last_;
};

}  // namespace stoke::dist
