// The CPU stage: a TBB pipeline that reads records zero-copy from the dataset, plans each
// sample's crop from its JPEG header, decodes only that region at the best DCT scale, resizes
// and flips it straight into a slot of a batch buffer, and hands finished batches to the
// consumer in sampler order through a bounded ring.
//
//   STOKE_ASSIGN_OR_RETURN(auto loader, Loader::Create(dataset, options));  // threads start at once
//   while (true) {
//     STOKE_ASSIGN_OR_RETURN(BatchLease lease, loader->Next());  // an error: a bad record, I/O
//     if (!lease) break;                                           // the end of the run
//     ... use lease->images, lease->labels ...  // the slot returns to the ring when the lease goes
//   }
//
// Determinism: the sample at (seed, epoch, record index) is bit-identical whatever the thread
// count or scheduling, batches come out in sampler order, and a loader started at (epoch, batch)
// produces exactly the batches an uninterrupted one would from there.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "augment/crop_plan.h"
#include "common/limits.h"
#include "common/status.h"
#include "dataset/dataset.h"
#include "dataset/sampler.h"
#include "prefetch/storage.h"

namespace stoke::prefetch {

enum class CropMode {
  kRandomResized,  // training: RandomResizedCrop (+ flip, optional colour jitter)
  kCenter,         // evaluation: resize the shorter side, then a centre crop
};
Result<CropMode> ParseCropMode(std::string_view name);  // "random-resized" | "center"

struct AugmentOptions {
  CropMode mode = CropMode::kRandomResized;
  augment::RandomResizedCropOptions random;  // kRandomResized (size 224 by default)
  int resize = 256;                          // kCenter: shorter side before cropping
  int crop = 224;                            // kCenter: output side
  int out_size() const { return mode == CropMode::kRandomResized ? random.size : crop; }
};

enum class ErrorPolicy {
  kSkip,  // a bad record's slot is refilled from the next records of the epoch, counted, logged once
  kFail,  // the first bad record ends the run with its error
};
Result<ErrorPolicy> ParseErrorPolicy(std::string_view name);  // "skip" | "fail"

enum class DeviceMode {
  kAuto,  // batches go to GPU 0 when the CUDA backend is built and a GPU is present
  kHost,  // host memory only
  kCuda,  // GPU `device_id`; kUnavailable when there is none
};

// The most batches a ring may hold (also the trainer's data.ring): beyond it a request is a
// mistake, not a machine. Threads are bounded by kMaxThreads (common/limits.h).
inline constexpr int kMaxRingSize = 1024;

struct BadRecord {
  int64_t index = 0;
  std::string reason;  // names the record, its source path when known, and what was wrong
  // Met at one of this loader's own sample positions, so counted against its skip budget; false:
  // met only while looking for a stand-in (it may be another rank's sample), listed but not counted.
  bool own = true;
};

struct LoaderOptions {
  dataset::SamplerOptions sampler;  // order, shard and seed (the seed also keys augmentation)
  AugmentOptions augment;
  int batch_size = 256;          // > 0
  bool drop_last_batch = false;  // false: an epoch may end with a short batch
  int threads = 0;               // decoding threads; 0 = every core; at most kMaxThreads
  int ring_size = 4;             // batch buffers in the ring; 2 to kMaxRingSize
  ErrorPolicy on_error = ErrorPolicy::kSkip;
  // kSkip: the run fails once more than this fraction of an epoch's samples are distinct bad
  // records. [0, 1].
  double max_skip_fraction = 0.01;
  // The samples that fraction is of: 0 = this loader's epoch. A data-parallel rank passes the
  // global epoch's, so that its own budget can hold the whole run's bad records.
  int64_t skip_budget_samples = 0;
  // kSkip: the bad records an earlier part of this run met (a resumed run; a pipeline started
  // again after a break). They count against the budget from the start, as in one uninterrupted
  // run: over it, the run ends at the next bad record it meets (one of these, or a new one), and
  // goes on if none is bad any more (repaired). They are not logged again, never chosen as
  // stand-ins, and listed by bad_records(); indices past the dataset's records are left out. Only
  // those marked `own` count at once; the others count when met at one of this loader's samples.
  std::vector<BadRecord> known_bad;
  bool verify_crc = true;     // check every record's CRC-32C (a few % of a decode)
  bool strict_decode = true;  // libjpeg warnings are errors (see decode::DecoderOptions)
  // Where the run starts and how long it lasts: epochs [start_epoch, start_epoch + epochs),
  // beginning at batch `start_batch` of the first. epochs == 0 runs until stopped.
  int64_t start_epoch = 0;
  int64_t start_batch = 0;
  int64_t epochs = 1;
  DeviceMode device = DeviceMode::kAuto;
  int device_id = 0;
  // The consumer's CUDA stream (a cudaStream_t): where a lease returned without naming one (its
  // destructor, on an error path) records that the consumer is done with the slot. nullptr: the
  // legacy default stream, which does not order work on a non-blocking stream.
  void* consumer_stream = nullptr;
  // The storage stage: records read ahead in sampler order within a memory budget (see
  // prefetch/storage.h); off, decoders read each record through the map.
  StorageOptions storage;
};

// One batch, in sampler order. Host pixels are `size` consecutive HWC uint8 RGB images of
// height x width. On a device, device_images holds the same bytes followed by the labels (int32,
// at device_labels_offset) once `copied_event` (a cudaEvent_t) has fired: wait on it with
// cudaStreamWaitEvent before using them.
struct Batch {
  int64_t epoch = 0;
  int64_t number = 0;  // within the epoch
  int size = 0;        // samples; the last batch of an epoch may be short
  int width = 0;
  int height = 0;
  std::span<const uint8_t> images;   // size * height * width * 3 bytes
  std::span<const int32_t> labels;   // size
  std::span<const int64_t> indices;  // record index of each sample (after any replacement)
  int replaced = 0;                  // samples whose record was bad and was replaced
  // Per sample: 1 where it stands in for a bad record (another record of the epoch, a duplicate
  // that evaluation leaves out), else 0. Host memory, valid while the batch is held.
  std::span<const uint8_t> stand_in;
  const void* device_images = nullptr;
  size_t device_labels_offset = 0;
  void* copied_event = nullptr;
  // Timing events around this batch's host-to-device copy (BatchMemory::copy_timing_events),
  // valid while the batch is held.
  void* copy_begin_event = nullptr;
  void* copy_end_event = nullptr;
};

struct LoaderStats {
  int64_t batches = 0;          // handed to the consumer
  int64_t samples = 0;
  int64_t bad_records = 0;      // distinct bad records among the own samples of the batches handed out, and the known_bad
  double elapsed_s = 0;         // since Create()
  double images_per_s = 0;      // samples / elapsed_s
  double consumer_wait_s = 0;   // time spent blocked in Next()
  double read_s = 0;            // worker time, summed over threads: record lookup (+ CRC)
  double decode_s = 0;          //   header, plan and region decode
  double augment_s = 0;         //   resize, flip, jitter into the slot
  double ready_depth_mean = 0;  // batches waiting when Next() was called
  int ready_depth_max = 0;
  int threads = 0;
  bool pinned = false;          // batch buffers are pinned and copied to a GPU
  bool storage_stage = false;   // records come through the storage stage
  StorageStats storage;         // its figures (read_s above includes its waits)
};

// How the loader fits a JPEG sample's crop to the DCT scales: snaps `plan` (of a width x height
// image) to the strongest scale 1/d whose whole decoded pixels still cover out_w x out_h, and
// returns d. Snapping can take a decoded pixel off an edge, so the scale the unsnapped region
// allowed is checked again after it, and halved until it holds.
int SnapToBestScale(augment::CropPlan& plan, int width, int height, int out_w, int out_h);

namespace detail {
struct LoaderState;
}

// A batch on loan from the ring. Destroying (or Release()-ing) it returns the slot for refilling.
// Default-constructed / end-of-run leases are empty. May outlive the Loader safely.
class BatchLease {
 public:
  BatchLease() = default;
  ~BatchLease();
  BatchLease(BatchLease&& other) noexcept;
  BatchLease& operator=(BatchLease&& other) noexcept;
  BatchLease(const BatchLease&) = delete;
  BatchLease& operator=(const BatchLease&) = delete;

  explicit operator bool() const { return slot_ >= 0; }
  const Batch& operator*() const { return *batch_; }
  const Batch* operator->() const { return batch_; }
  // Returns the slot. With a device, `stream` (a cudaStream_t, nullptr = default stream) is where
  // the consumer queued its work on device_images: the next copy into the slot waits for it. The
  // destructor releases on LoaderOptions::consumer_stream.
  void Release(void* stream = nullptr);

 private:
  friend class Loader;
  BatchLease(std::shared_ptr<detail::LoaderState> state, int slot, const Batch* batch)
      : state_(std::move(state)), slot_(slot), batch_(batch) {}
  std::shared_ptr<detail::LoaderState> state_;
  int slot_ = -1;
  const Batch* batch_ = nullptr;
};

class Loader {
 public:
  // Validates the options (kInvalidArgument naming the option), allocates the ring and starts the
  // pipeline. The loader holds a share of the dataset (a copy of it): the caller's may be moved or
  // destroyed meanwhile.
  static Result<std::unique_ptr<Loader>> Create(const dataset::Dataset& dataset, LoaderOptions options);
  // Stops the pipeline and joins every thread; leases still held stay valid.
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // The next batch; an empty lease at the end of the run (or after Stop()); the run's error
  // (a bad record under kFail, too many bad records under kSkip, I/O) after the batches before it.
  // kInvalidArgument, at once, when the consumer already holds all ring_size batches (waiting
  // would never end). Not thread-safe: one consumer.
  Result<BatchLease> Next();
  // Waits up to `timeout` until Next() would not block (a batch, the end or an error is ready).
  // For consumers that must stay interruptible (the Python binding checks for Ctrl-C between
  // waits). Thread-safe.
  bool WaitReady(std::chrono::microseconds timeout) const;
  // Ends the run early: Next() returns an empty lease from now on. Safe from any thread.
  void Stop();

  LoaderStats stats() const;
  // The bad records of the batches handed out so far, of the batch whose bad records ended the run
  // (its error handed out), and the known_bad; sorted by index: what a resumed run passes back as
  // known_bad. Those of batches made ahead but not yet handed out are left out; they are met again
  // after a resume, and counted then.
  std::vector<BadRecord> bad_records() const;
  int64_t batches_per_epoch() const;
  const LoaderOptions& options() const;

 private:
  explicit Loader(std::shared_ptr<detail::LoaderState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::LoaderState> state_;
};

}  // namespace stoke::prefetch
