#include "train/device_buckets.h"

#include <algorithm>
#include <numeric>

namespace stoke::train {

std::vector<DeviceBucket> PlanDeviceBuckets(const std::vector<DeviceParam>& params,
                                            const std::vector<int64_t>& group_size,
                                            const std::vector<size_t>& element_bytes, size_t bucket_bytes,
                                            size_t first_bucket_bytes) {
  std::vector<DeviceBucket> buckets;
  for (int g = 0; g < static_cast<int>(group_size.size()); ++g) {
    // The group's parameters from the end of its buffer backwards: later layers sit later in the
    // buffer, so this is close to the order backward writes them.
    std::vector<const DeviceParam*> in;
    for (const DeviceParam& p : params) {
      if (p.group == g && p.count > 0) in.push_back(&p);
    }
    std::sort(in.begin(), in.end(), [](const DeviceParam* a, const DeviceParam* b) { return a->offset > b->offset; });
    const size_t elem = element_bytes[static_cast<size_t>(g)];
    int64_t end = group_size[static_cast<size_t>(g)];
    DeviceBucket cur{.group = g, .begin = end, .end = end, .params = 0, .ready_after_layer = 1 << 30};
    size_t cap = first_bucket_bytes;  // each group's last parameters are among the first written
    for (const DeviceParam* p : in) {
      // Close the bucket before a parameter that would take it past its size (a parameter larger
      // than a bucket gets one of its own).
      if (cur.params > 0 && static_cast<size_t>(cur.end - p->offset) * elem > cap) {
        buckets.push_back(cur);
        cur = DeviceBucket{.group = g, .begin = cur.begin, .end = cur.begin, .params = 0, .ready_after_layer = 1 << 30};
        cap = bucket_bytes;
      }
      cur.begin = p->offset;
      cur.params++;
      cur.ready_after_layer = std::min(cur.ready_after_layer, p->layer);
    }
    if (cur.params > 0) {
      cur.begin = 0;  // leading padding, if any, rides along
      buckets.push_back(cur);
    }
  }
  // Launch order: the bucket completed earliest in backward (highest layer) first.
  std::stable_sort(buckets.begin(), buckets.end(), [](const DeviceBucket& a, const DeviceBucket& b) {
    if (a.ready_after_layer != b.ready_after_layer) return a.ready_after_layer > b.ready_after_layer;
    if (a.group != b.group) return a.group < b.group;
    return a.begin > b.begin;
  });
  return buckets;
}

}  // namespace stoke::train
