#include "dist/reducer.h"

#include <algorithm>

#include <fmt/format.h>

namespace stoke::dist {

Result<Reducer> Reducer::Create(Communicator& comm, std::span<float> buffer, std::vector<Slice> slices,
                                ReducerOptions options) {
  if (options.bucket_bytes == 0 || options.first_bucket_bytes == 0) {
    return InvalidArgumentError("dist: reducer bucket sizes must be > 0");
  }
  // Every float of the buffer in at most one slice.
  std::vector<std::pair<size_t, size_t>> spans;
  for (size_t i = 0; i < slices.size(); ++i) {
    const Slice& s = slices[i];
    if (s.offset > buffer.size() || s.count > buffer.size() - s.offset) {
      return InvalidArgumentError(fmt::format("dist: gradient slice {} ({} floats at {}) is outside the buffer of {}",
                                              i, s.count, s.offset, buffer.size()));
    }
    spans.emplace_back(s.offset, s.offset + s.count);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return InvalidArgumentError("dist: gradient slices overlap");
  }

  Reducer r(&comm, buffer);
  r.bucket_of_.resize(slices.size());
  for (size_t i = 0; i < slices.size(); ++i) {
    const Slice& s = slices[i];
    bool join = false;
    if (!r.buckets_.empty()) {
      // Only adjacent slices share a bucket (a bucket is one span), up to its size.
      const Bucket& b = r.buckets_.back();
      const size_t limit = (r.buckets_.size() == 1 ? options.first_bucket_bytes : options.bucket_bytes) / sizeof(float);
      join = b.offset + b.count == s.offset && b.count + s.count <= limit;
    }
    if (!join) r.buckets_.push_back({s.offset, 0, 0});
    Bucket& b = r.buckets_.back();
    b.count += s.count;
    b.slices++;
    r.bucket_of_[i] = static_cast<int>(r.buckets_.size()) - 1;
  }
  r.pending_.resize(r.buckets_.size());
  for (size_t b = 0; b < r.buckets_.size(); ++b) r.pending_[b] = r.buckets_[b].slices;
  r.marked_.assign(slices.size(), false);
  return r;
}

std::vector<size_t> Reducer::bucket_sizes() const {
  std::vector<size_t> out;
  for (const Bucket& b : buckets_) out.push_back(b.count);
  return out;
}

void Reducer::Launch() {
  for (; next_ < num_buckets() && pending_[static_cast<size_t>(next_)] == 0; ++next_) {
    const Bucket& b = buckets_[static_cast<size_t>(next_)];
    works_.push_back(comm_->AllReduce(buffer_.data() + b.offset, b.count, DataType::kFloat32, ReduceOp::kAvg));
  }
}

void Reducer::Ready(int index) {
  if (index < 0 || index >= static_cast<int>(marked_.size()) || marked_[static_cast<size_t>(index)]) return;
  marked_[static_cast<size_t>(index)] = true;
  const int b = bucket_of_[static_cast<size_t>(index)];
  if (--pending_[static_cast<size_t>(b)] > 0 || b != next_) return;  // not complete, or not its turn yet
  Launch();
}

Status Reducer::Finish() {
  const double backward_end = comm_->Now();
  for (auto& p : pending_) p = 0;
  Launch();
  // The first bucket that fails ends the wait: one that timed out means a rank is gone or stuck,
  // and the buckets queued behind it would each have waited a full timeout more (a stuck peer
  // held the others for buckets x timeout_s, where timeout_s was promised).
  Status first = OkStatus();
  for (Work& w : works_) {
    first = w.Wait();
    if (!first.ok()) break;
  }
  const double end = comm_->Now();
  last_ = {};
  last_.wait_s = end - backward_end;
  for (const Work& w : works_) {
    if (!w.done()) continue;  // after a failure: not finished, not counted
    const double a = w.started_s(), z = w.finished_s();
    last_.comm_s += z - a;
    last_.overlapped_s += std::max(0.0, std::min(z, backward_end) - a);
  }
  works_.clear();
  next_ = 0;
  for (size_t b = 0; b < buckets_.size(); ++b) pending_[b] = buckets_[b].slices;
  std::fill(marked_.begin(), marked_.end(), false);
  return first;
}

}  // namespace stoke::dist
