// How a device backend groups its gradients for averaging across ranks while backward runs: each
// bucket is one contiguous range of one flat gradient buffer (a single collective call), about
// `bucket_bytes` long, and buckets are launched in a fixed order that every rank computes the same
// way from the model: the order in which backward completes them. Pure bookkeeping, no CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace stoke::train {

struct DeviceParam {
  int group = 0;        // which flat buffer
  int64_t offset = 0;   // elements into it
  int64_t count = 0;
  int layer = 0;        // whose backward writes its gradient (once, final)
};

struct DeviceBucket {
  int group = 0;
  int64_t begin = 0, end = 0;   // elements [begin, end) of the group's buffer (padding included)
  int params = 0;               // parameters inside: the bucket is ready when all have been written
  int ready_after_layer = 0;    // the layer whose backward completes it (backward runs last to first)
};

// Buckets covering every parameter, in launch order (by the layer that completes them, last layer
// first; ties by group, then by offset, descending). `element_bytes[g]` is group g's element size;
// `group_size[g]` its length in elements (the tail padding joins the last bucket). A bucket is
// closed once it reaches `bucket_bytes`; each group's first bucket (its last parameters, written
// early in backward) is closed at `first_bucket_bytes` so communication starts early.
std::vector<DeviceBucket> PlanDeviceBuckets(const std::vector<DeviceParam>& params,
                                            const std::vector<int64_t>& group_size,
                                            const std::vector<size_t>& element_bytes, size_t bucket_bytes,
                                            size_t first_bucket_bytes);

}  // namespace stoke::train
