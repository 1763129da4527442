#include "prefetch/loader.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <thread>
#include <tuple>

#include <fmt/format.h>
#include <oneapi/tbb/concurrent_queue.h>
#include <oneapi/tbb/concurrent_unordered_map.h>
#include <oneapi/tbb/concurrent_unordered_set.h>
#include <oneapi/tbb/enumerable_thread_specific.h>
#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/parallel_pipeline.h>
#include <oneapi/tbb/task_arena.h>

#include "augment/transform.h"
#include "common/logging.h"
#include "common/random.h"
#include "common/sys_memory.h"
#include "common/thread_name.h"
#include "common/tsan.h"
#include "decode/jpeg_decoder.h"
#include "prefetch/batch_memory.h"

namespace stoke::prefetch {

int SnapToBestScale(augment::CropPlan& plan, int width, int height, int out_w, int out_h) {
  const augment::CropPlan wanted = plan;
  int d = decode::ChooseRegionScale(static_cast<int>(wanted.region.width), static_cast<int>(wanted.region.height),
                                    out_w, out_h);
  for (;; d /= 2) {
    plan = augment::SnapToScale(wanted, d, width, height);
    if (d == 1 || (plan.region.width / d >= out_w && plan.region.height / d >= out_h)) return d;
  }
}

Result<CropMode> ParseCropMode(std::string_view name) {
  if (name == "random-resized") return CropMode::kRandomResized;
  if (name == "center") return CropMode::kCenter;
  return InvalidArgumentError(fmt::format("crop mode '{}' (expected random-resized or center)", name));
}

Result<ErrorPolicy> ParseErrorPolicy(std::string_view name) {
  if (name == "skip") return ErrorPolicy::kSkip;
  if (name == "fail") return ErrorPolicy::kFail;
  return InvalidArgumentError(fmt::format("error policy '{}' (expected skip or fail)", name));
}

namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

int64_t Nanos(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}

// TBB caps its workers at the core count and, of several live max_allowed_parallelism controls,
// applies the smallest: one control per loader let a loader of 3 threads hold another of 6 (and
// its own arena) to 3, with a warning on stderr. The process keeps one control, at the largest
// count any live loader asked for; a loader holds its request (the handle) for its lifetime.
class ParallelismRequests {
 public:
  static std::shared_ptr<void> Hold(size_t threads) {
    static ParallelismRequests* const requests = new ParallelismRequests;  // never destroyed: loaders may outlive statics
    std::lock_guard lock(requests->mu_);
    const auto at = requests->wanted_.insert(threads);
    requests->Apply();
    return std::shared_ptr<void>(nullptr, [at](void*) {
      std::lock_guard lock(requests->mu_);
      requests->wanted_.erase(at);
      requests->Apply();
    });
  }

 private:
  void Apply() {  // under mu_
    const size_t want = wanted_.empty() ? 0 : *wanted_.rbegin();
    if (want == applied_) return;
    // The new control first: until the old one goes, the smaller of the two holds.
    auto next = want == 0 ? nullptr
                          : std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism, want);
    control_ = std::move(next);
    applied_ = want;
  }
  std::mutex mu_;
  std::multiset<size_t> wanted_;
  std::unique_ptr<tbb::global_control> control_;
  size_t applied_ = 0;
};

constexpr size_t kAlign = 64;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// What one decoding thread owns: its read transaction, its decoder and its decode scratch.
struct Worker {
  explicit Worker(const decode::DecoderOptions& o) : decoder(o) {}
  std::optional<dataset::Reader> reader;
  decode::JpegDecoder decoder;
  Image image;
  int64_t making = -1;  // the record being made (its own or a stand-in), for an exception's message
};

}  // namespace

// One batch buffer of the ring. Owned by exactly one party at a time: the free queue, the
// pipeline (from the input stage taking it to the output stage publishing it), or the consumer.
struct Slot {
  int id = 0;
  Batch batch;
  uint8_t* images = nullptr;
  int32_t* labels = nullptr;
  int64_t* indices = nullptr;
  std::vector<uint8_t> stand_in;  // per sample: 1 where it stands in for a bad record
  std::shared_ptr<const std::vector<int64_t>> order;  // the epoch's global order (all ranks)
  std::atomic<int> replaced{0};
  // The bad records met making this batch, at its own sample positions and in stand-in walks:
  // the output stage fills them, Next() adds them to the run's when it hands the batch out.
  std::vector<int64_t> own_bad, other_bad;
};

// A run of consecutive samples of one batch: the unit of parallel work.
struct Chunk {
  Slot* slot = nullptr;
  int begin = 0;
  int end = 0;
  bool last = false;  // the batch's final chunk
  Status error;
  bool skipped = false;  // not made: the pipeline was failing when its turn came
  // Bad records met at this chunk's own sample positions (index, reason), in sample order: held
  // against the skip budget by the in-order output stage, so that where a run over budget stops
  // follows the sampler's order, not the threads' timing.
  std::vector<std::pair<int64_t, std::string>> own_bad;
  std::vector<int64_t> other_bad;  // met only while looking for a stand-in
};

struct Ready {
  enum Kind { kBatch, kEnd, kError } kind = kEnd;
  int slot = -1;
  Status error;
};

struct LoaderState {
  std::optional<dataset::Dataset> dataset;  // a share of it: the caller's may be moved or go
  LoaderOptions o;
  std::optional<dataset::Sampler> sampler;
  std::vector<int64_t> shard_positions;  // sampler->ShardPositions(): this rank's global positions
  decode::DecoderOptions decoder_options;
  int64_t per_epoch = 0;
  int64_t batches_per_epoch = 0;
  int threads = 1;
  int chunk = 1;
  int out_w = 0, out_h = 0;
  size_t sample_bytes = 0;
  size_t labels_offset = 0;
  int64_t max_bad = 0;
  int64_t budget_samples = 0;  // the samples max_skip_fraction is a fraction of

  std::unique_ptr<BatchMemory> memory;
  std::unique_ptr<StorageStage> storage;  // null when off
  std::vector<std::unique_ptr<Slot>> slots;
  // concurrent_bounded_queue for both ends of the ring: the input stage blocks on `free` when
  // every buffer is in use, the consumer blocks on `ready` until a batch is published. Neither
  // can grow past the ring size (plus the end/stop markers). A stop pushes a marker into each
  // rather than abort()ing them, so a thread that is about to wait still sees it.
  tbb::concurrent_bounded_queue<int> free;      // slot ids; -1 = stop
  tbb::concurrent_bounded_queue<Ready> ready;
  // Wakes WaitReady() (a timed wait the queue does not offer) after every push to `ready`.
  std::mutex ready_mu;
  std::condition_variable ready_cv;
  void PushReady(Ready r) {
    ready.push(std::move(r));
    { std::lock_guard<std::mutex> lock(ready_mu); }
    ready_cv.notify_all();
  }
  // concurrent_unordered_map: workers insert bad records while stats()/bad_records() traverse;
  // nothing is ever erased, which is what this container allows concurrently.
  tbb::concurrent_unordered_map<int64_t, std::string> bad;  // every bad record met, with its reason
  // The bad records of this rank's own samples: what max_skip_fraction budgets. A stand-in walk
  // can meet records of other ranks' shards; those are skipped and reported but counted by the
  // rank whose sample they are, so the budget means the same at any world size.
  tbb::concurrent_unordered_set<int64_t> own_bad;
  std::atomic<int64_t> bad_count{0};
  // Those of the batches handed to the consumer (and the known_bad): what bad_records() reports.
  // The output stage counts a batch's bad records when it makes it, ring_size batches ahead of the
  // consumer; reporting those would make a resumed run count records it had not yet reached.
  tbb::concurrent_unordered_set<int64_t> handed_own, handed_other;
  std::atomic<int64_t> handed_own_count{0};
  // By the consumer's thread, for a batch it is handed or the batch whose bad records ended the run.
  void HandOutBadRecords(const Slot& slot) {
    for (int64_t index : slot.own_bad) {
      if (handed_own.insert(index).second) handed_own_count.fetch_add(1);
    }
    for (int64_t index : slot.other_bad) handed_other.insert(index);
  }

  std::shared_ptr<void> allow_threads;  // when asked for more threads than cores: ParallelismRequests
  std::unique_ptr<tbb::task_arena> arena;
  tbb::enumerable_thread_specific<std::unique_ptr<Worker>> workers;
  std::thread driver;
  std::atomic<bool> stop{false};      // consumer asked to stop
  std::atomic<int> leased{0};         // slots the consumer holds
  std::atomic<bool> failing{false};   // the pipeline hit an error and is winding down

  // Input stage (serial): where the run is.
  int64_t epoch = 0;
  int64_t batch = 0;
  int pos = 0;
  Slot* filling = nullptr;
  std::shared_ptr<const std::vector<int64_t>> order;  // GlobalOrder(order_epoch)
  int64_t order_epoch = -1;
  bool input_done = false;
  // Output stage (serial).
  bool output_failed = false;
  bool error_pushed = false;  // the output stage handed the consumer an error

  // Statistics.
  Clock::time_point started;
  std::atomic<int64_t> read_ns{0}, decode_ns{0}, augment_ns{0};
  std::atomic<int64_t> batches_out{0}, samples_out{0}, wait_ns{0};
  std::atomic<int64_t> depth_sum{0}, depth_calls{0};
  std::atomic<int> depth_max{0};
  // Set by Next() (one consumer), read by WaitReady() from any thread.
  std::atomic<bool> finished{false};
  // An exception in the input stage (it cannot hand out a chunk to carry it): reported by Run()
  // once the chunks before it have come out.
  Status input_error;

  Worker& LocalWorker() {
    auto& w = workers.local();
    if (w == nullptr) w = std::make_unique<Worker>(decoder_options);
    return *w;
  }

  augment::CropPlan Plan(int width, int height, SplitMix64& rng) const {
    if (o.augment.mode == CropMode::kRandomResized) {
      return augment::PlanRandomResizedCrop(width, height, o.augment.random, rng);
    }
    return augment::PlanCenterCrop(width, height, o.augment.resize, o.augment.crop);
  }

  // Produces the sample of record `index` into dst; the record's label into *label. `value` is the
  // record's stored bytes when the storage stage fetched them, else empty (read through the map).
  Status MakeSample(Worker& w, int64_t index, std::span<const std::byte> value, uint64_t seed, int64_t ep,
                    uint8_t* dst, int32_t* label) {
    const auto t0 = Clock::now();
    STOKE_ASSIGN_OR_RETURN(dataset::RecordView r,
                           value.empty() ? w.reader->Get(index) : dataset->CheckRecord(value, index, o.verify_crc));
    const auto t1 = Clock::now();
    read_ns.fetch_add(Nanos(t0, t1), std::memory_order_relaxed);
    const dataset::RecordHeader& h = r.header;
    SplitMix64 rng = SampleRng(seed, ep, index);
    augment::ImageView view;
    augment::RectF where;
    augment::CropPlan plan;
    if (h.encoding == dataset::PayloadEncoding::kJpeg || h.encoding == dataset::PayloadEncoding::kJpegIndexed) {
      STOKE_ASSIGN_OR_RETURN(decode::JpegInfo info, w.decoder.ReadHeader(r.image));
      if (static_cast<uint32_t>(info.width) != h.width || static_cast<uint32_t>(info.height) != h.height) {
        return CorruptError(fmt::format("record header says {}x{}, its JPEG is {}x{}", h.width,
                                        h.height, info.width, info.height));
      }
      plan = Plan(info.width, info.height, rng);
      const int d = SnapToBestScale(plan, info.width, info.height, out_w, out_h);
      const decode::Region region{static_cast<int>(plan.region.x), static_cast<int>(plan.region.y),
                                  static_cast<int>(plan.region.width),
                                  static_cast<int>(plan.region.height)};
      // With a restart index only the intervals the crop needs are decoded.
      const dataset::JpegIndexView& x = r.jpeg_index;
      const decode::RestartIndex index{x.restart_mcus, x.mcus_per_row, x.mcu_rows, x.entry_bytes, x.intervals,
                                       x.entries};
      STOKE_ASSIGN_OR_RETURN(decode::DecodedRegion dr,
                             w.decoder.DecodeRegion(r.image, region, out_w, out_h, &w.image, d,
                                                    x.entry_bytes != 0 ? &index : nullptr));
      view = {w.image.pixels.data(), w.image.width, w.image.height, w.image.channels, w.image.row_bytes()};
      where = {dr.x, dr.y, dr.width, dr.height};
    } else if (h.encoding == dataset::PayloadEncoding::kRaw) {
      STOKE_RETURN_IF_ERROR(dataset::CheckRawDimensions(h, r.payload.size()));  // as the reader
      plan = Plan(static_cast<int>(h.width), static_cast<int>(h.height), rng);
      view = {reinterpret_cast<const uint8_t*>(r.payload.data()), static_cast<int>(h.width),
              static_cast<int>(h.height), h.channels, size_t{h.width} * h.channels};
      where = plan.region;
    } else {
      return CorruptError(fmt::format("unknown payload encoding {}", static_cast<int>(h.encoding)));
    }
    const auto t2 = Clock::now();
    decode_ns.fetch_add(Nanos(t1, t2), std::memory_order_relaxed);
    // Cropping decoded pixels fails only for want of memory or by stoke's own fault, never the
    // record's: the run ends (kInternal) rather than a good record being replaced and counted.
    if (Status cropped = augment::ApplyPlan(view, where, plan, std::span<uint8_t>(dst, sample_bytes)); !cropped.ok()) {
      return InternalError(fmt::format("{} (cropping the decoded pixels of record {} of {})", cropped.ToString(), index,
                                       dataset->path().string()));
    }
    augment_ns.fetch_add(Nanos(t2, Clock::now()), std::memory_order_relaxed);
    *label = h.label;
    return OkStatus();
  }

  // Records a bad record once (logging it the first time); an error when the policy says stop.
  // `own` (the record at a sample's own position) receives it for the skip budget (CountOwnBad).
  Status NoteBad(Worker& w, int64_t index, const Status& s, Chunk& c, bool own) {
    std::string where = fmt::format("record {}", index);
    if (auto path = w.reader->SourcePath(index); path.ok() && !path->empty()) {
      where += fmt::format(" ({})", *path);
    }
    std::string reason = fmt::format("{} of {}: {}", where, dataset->path().string(), s.message());
    if (o.on_error == ErrorPolicy::kFail) {
      return Status(s.code(), reason + " (on_error fail)");
    }
    if (bad.emplace(index, reason).second) STOKE_LOG(WARN, "skipping {}", reason);
    if (own) {
      c.own_bad.emplace_back(index, std::move(reason));
    } else {
      c.other_bad.push_back(index);
    }
    return OkStatus();
  }

  // This rank's own bad records (each once), in sampler order: an error once they exceed the
  // budget. Called by the serial, in-order output stage only.
  // A record already counted (met earlier, or known from an earlier part of the run) is not counted
  // again, but meeting it over the budget still ends the run: a resumed run that had used its
  // budget ends at the first bad record it meets, and one whose records were repaired goes on.
  Status CountOwnBad(const Chunk& c) {
    for (const auto& [index, reason] : c.own_bad) {
      const int64_t n = own_bad.insert(index).second ? bad_count.fetch_add(1) + 1 : bad_count.load();
      if (n > max_bad) {
        return CorruptError(fmt::format(
            "{} bad records, more than max_skip_fraction {} of the {} samples of an epoch allows "
            "(latest: {})", n, o.max_skip_fraction, budget_samples, reason));
      }
    }
    return OkStatus();
  }

  // Fills sample `s` of the slot: the record at its epoch position, or, when that record is bad
  // and the policy is skip, the next good record of the epoch's global order (wrapping around),
  // keyed by the attempt number so a stand-in differs from that record's own sample. Walking the
  // global order rather than this rank's shard gives a bad record the same stand-in at any world
  // size.
  Status FillSample(Worker& w, Chunk& c, int s) {
    Slot& slot = *c.slot;
    const auto& order = *slot.order;
    const int64_t n = static_cast<int64_t>(order.size());
    const int64_t pos = slot.batch.number * o.batch_size + s;
    const int64_t global_pos = shard_positions[static_cast<size_t>(pos)];
    uint8_t* dst = slot.images + static_cast<size_t>(s) * sample_bytes;
    // The storage stage holds this position's record until the sample is made (or given up).
    struct Released {
      StorageStage* storage;
      int64_t epoch, pos;
      ~Released() {
        if (storage) storage->Release(epoch, pos);
      }
    } released{storage.get(), slot.batch.epoch, pos};
    for (int64_t k = 0; k < n; ++k) {
      const int64_t index = order[static_cast<size_t>((global_pos + k) % n)];
      // A stand-in is never a record known to be bad: read again, it would fail again (a run of m
      // bad records cost m^2/2 reads).
      if (k > 0 && bad.count(index) != 0) continue;
      const uint64_t seed = k == 0 ? o.sampler.seed : MixSeed(o.sampler.seed, static_cast<uint64_t>(k));
      std::span<const std::byte> value;
      if (k == 0 && storage) {
        const auto t0 = Clock::now();
        auto fetched = storage->Acquire(slot.batch.epoch, pos, index);
        read_ns.fetch_add(Nanos(t0, Clock::now()), std::memory_order_relaxed);
        if (!fetched.ok() && fetched.status().code() == StatusCode::kUnavailable) return fetched.status();  // stopped
        if (fetched.ok()) value = *fetched;
        // Otherwise (a page of the map that cannot be read) the reader's own read reports it.
      }
      w.making = index;
      Status st = MakeSample(w, index, value, seed, slot.batch.epoch, dst, &slot.labels[s]);
      if (st.ok()) {
        slot.indices[s] = index;
        slot.stand_in[static_cast<size_t>(s)] = k > 0 ? 1 : 0;
        if (k > 0) slot.replaced.fetch_add(1, std::memory_order_relaxed);
        return OkStatus();
      }
      if (st.code() == StatusCode::kInternal) return st;  // not the record's fault
      STOKE_RETURN_IF_ERROR(NoteBad(w, index, st, c, k == 0));
    }
    return CorruptError(fmt::format("{}: no readable record in the epoch", dataset->path().string()));
  }

  // --- pipeline stages ---

  Chunk* Input(tbb::flow_control& fc) {
    if (input_done || stop.load() || failing.load()) {
      input_done = true;
      fc.stop();
      return nullptr;
    }
    if (filling == nullptr) {
      if (o.epochs > 0 && epoch >= o.start_epoch + o.epochs) {
        input_done = true;
        fc.stop();
        return nullptr;
      }
      int id = -1;
      free.pop(id);
      if (id < 0) {  // stop marker
        input_done = true;
        fc.stop();
        return nullptr;
      }
      Slot* slot = slots[static_cast<size_t>(id)].get();
      STOKE_TSAN_ACQUIRE(slot);
      if (order_epoch != epoch) {
        order = std::make_shared<const std::vector<int64_t>>(sampler->GlobalOrder(epoch));
        order_epoch = epoch;
      }
      slot->order = order;
      slot->batch.epoch = epoch;
      slot->batch.number = batch;
      slot->batch.size = static_cast<int>(std::min<int64_t>(o.batch_size, per_epoch - batch * o.batch_size));
      slot->replaced.store(0, std::memory_order_relaxed);
      slot->own_bad.clear();
      slot->other_bad.clear();
      filling = slot;
      pos = 0;
      Status reusable = memory->WaitHostReusable(id);
      if (!reusable.ok()) {
        auto* c = new Chunk{slot, 0, 0, true, reusable};
        filling = nullptr;
        return c;
      }
    }
    auto* c = new Chunk{filling, pos, std::min(pos + chunk, filling->batch.size), false, {}};
    pos = c->end;
    if (pos == filling->batch.size) {
      c->last = true;
      filling = nullptr;
      if (++batch == batches_per_epoch) {
        batch = 0;
        ++epoch;
      }
    }
    return c;
  }

  // What an exception escaping a stage becomes: a status for the consumer, after the batches
  // before it. Left to TBB it would cancel the pipeline, drop the chunks in flight (good batches
  // among them) and wait forever for an input stage blocked on a ring the consumer holds.
  // Called inside a catch block: common's CatchExceptions names the exception being handled.
  static Status FromException(std::string_view where) {
    return CatchExceptions(fmt::format("loader: {}", where), []() -> Status { throw; });
  }

  // `making`: the record whose sample was being made (a stand-in's when it was one), or -1
  // before any record was read.
  std::string WhereIs(const Chunk& c, int s, int64_t making) const {
    const Slot& slot = *c.slot;
    std::string record = making >= 0 ? fmt::format(" (record {} of {})", making, dataset->path().string())
                                     : std::string(" (before reading a record)");
    return fmt::format("making sample {} of batch {} of epoch {}{}", s, slot.batch.number, slot.batch.epoch, record);
  }

  void Work(Chunk* c) {
    if (!c->error.ok()) return;
    if (failing.load(std::memory_order_relaxed)) {
      c->skipped = true;  // its samples are not made: the output stage must not publish its batch
      return;
    }
    int s = c->begin;  // the sample an exception came from
    Worker* worker = nullptr;
    try {
      Worker& w = LocalWorker();
      worker = &w;
      w.making = -1;
      if (!w.reader) {
        auto reader = dataset->NewReader({.verify_crc = o.verify_crc});
        if (!reader.ok()) {
          c->error = reader.status();
          return;
        }
        w.reader.emplace(std::move(*reader));
      }
      for (; s < c->end; ++s) {
        Status st = FillSample(w, *c, s);
        if (!st.ok()) {
          c->error = std::move(st);
          return;
        }
      }
    } catch (...) {
      c->error = FromException(WhereIs(*c, s, worker != nullptr ? worker->making : -1));
    }
  }

  void Output(Chunk* c) {
    std::unique_ptr<Chunk> owned(c);
    if (output_failed) return;
    if (c->skipped) {
      // The run is failing and this batch was not made: neither it nor any later one comes out.
      // The error is already on its way (from the stage that failed, or from Run()).
      output_failed = true;
      return;
    }
    Slot* slot = c->slot;
    Status st = c->error;
    try {
      if (Status counted = CountOwnBad(*c); st.ok()) st = std::move(counted);
      for (const auto& own : c->own_bad) slot->own_bad.push_back(own.first);
      slot->other_bad.insert(slot->other_bad.end(), c->other_bad.begin(), c->other_bad.end());
      if (st.ok() && c->last) {
        slot->batch.replaced = slot->replaced.load(std::memory_order_relaxed);
        const size_t bytes = labels_offset + static_cast<size_t>(slot->batch.size) * sizeof(int32_t);
        st = memory->CopyToDevice(slot->id, bytes);
        if (st.ok()) {
          STOKE_TSAN_RELEASE(slot);
          PushReady(Ready{Ready::kBatch, slot->id, {}});
          return;
        }
      }
    } catch (...) {
      st = FromException(fmt::format("handing out batch {} of epoch {}", slot->batch.number, slot->batch.epoch));
    }
    if (!st.ok()) {
      output_failed = true;
      failing = true;
      error_pushed = true;
      // With its slot: the bad records that ended the run are reported with its error.
      if (!stop.load()) PushReady(Ready{Ready::kError, slot->id, st});  // a stop is not an error
    }
  }

  void Run() {
    SetThreadName("stoke-loader");
    // `anchor` and `done` restate for TSan what task_arena::execute orders (common/tsan.h).
    int done = 0;
    auto chain =
        tbb::make_filter<void, Chunk*>(tbb::filter_mode::serial_in_order,
                                       [this, &done](tbb::flow_control& fc) -> Chunk* {
                                         STOKE_TSAN_ACQUIRE(&stoke_tsan_sync_anchor);
                                         STOKE_TSAN_ACQUIRE(&epoch);  // serial: ordered calls
                                         Chunk* c = nullptr;
                                         try {
                                           c = Input(fc);
                                         } catch (...) {
                                           input_error = FromException(fmt::format(
                                               "planning batch {} of epoch {}", batch, epoch));
                                           failing = true;
                                           input_done = true;
                                           fc.stop();
                                         }
                                         if (c != nullptr) STOKE_TSAN_RELEASE(c);
                                         STOKE_TSAN_RELEASE(&epoch);
                                         STOKE_TSAN_RELEASE(&done);
                                         return c;
                                       }) &
        tbb::make_filter<Chunk*, Chunk*>(tbb::filter_mode::parallel,
                                         [this, &done](Chunk* c) {
                                           STOKE_TSAN_ACQUIRE(&stoke_tsan_sync_anchor);
                                           STOKE_TSAN_ACQUIRE(c);
                                           Work(c);
                                           STOKE_TSAN_RELEASE(c);
                                           STOKE_TSAN_RELEASE(&done);
                                           return c;
                                         }) &
        tbb::make_filter<Chunk*, void>(tbb::filter_mode::serial_in_order, [this, &done](Chunk* c) {
          STOKE_TSAN_ACQUIRE(c);
          STOKE_TSAN_ACQUIRE(&output_failed);
          Output(c);
          STOKE_TSAN_RELEASE(&output_failed);
          STOKE_TSAN_RELEASE(&done);
        });
    STOKE_TSAN_RELEASE(&stoke_tsan_sync_anchor);
    try {
      // Enough chunks in flight to keep every thread busy while the in-order output stage waits
      // for a slow one.
      arena->execute([&] { tbb::parallel_pipeline(static_cast<size_t>(threads) * 4, chain); });
    } catch (...) {  // the stages catch their own; this is TBB's
      failing = true;
      PushReady(Ready{Ready::kError, -1, FromException("running the pipeline")});
    }
    STOKE_TSAN_ACQUIRE(&done);
    // Every chunk the input stage handed out has come out: its error follows their batches.
    if (!input_error.ok() && !error_pushed && !stop.load()) PushReady(Ready{Ready::kError, -1, input_error});
    PushReady(Ready{Ready::kEnd, -1, {}});
  }

  void ReleaseSlot(int id, void* stream) {
    Status s = memory->MarkConsumed(id, stream);
    STOKE_TSAN_RELEASE(slots[static_cast<size_t>(id)].get());
    leased.fetch_sub(1);
    if (!s.ok()) {
      // The device failed under the consumer: the slot is not filled again (its batch may still
      // be in use), and the consumer's next Next() reports why.
      failing = true;
      PushReady(Ready{Ready::kError, -1, s.Prepend("loader: returning a batch")});
      return;
    }
    free.push(id);
  }

  void RequestStop() {
    if (!stop.exchange(true)) {
      free.push(-1);
      PushReady(Ready{Ready::kEnd, -1, {}});
    }
    // After the end marker: decoders waiting for reads give up, and what they report comes after
    // the end the consumer already sees.
    if (storage) storage->Stop();
  }
};

}  // namespace detail

// --- BatchLease ---

BatchLease::~BatchLease() {
  if (slot_ >= 0) Release(state_->o.consumer_stream);
}

BatchLease::BatchLease(BatchLease&& other) noexcept
    : state_(std::move(other.state_)), slot_(other.slot_), batch_(other.batch_) {
  other.slot_ = -1;
  other.batch_ = nullptr;
}

BatchLease& BatchLease::operator=(BatchLease&& other) noexcept {
  if (this != &other) {
    if (slot_ >= 0) Release(state_->o.consumer_stream);
    state_ = std::move(other.state_);
    slot_ = other.slot_;
    batch_ = other.batch_;
    other.slot_ = -1;
    other.batch_ = nullptr;
  }
  return *this;
}

void BatchLease::Release(void* stream) {
  if (slot_ < 0) return;
  state_->ReleaseSlot(slot_, stream);
  slot_ = -1;
  batch_ = nullptr;
  state_.reset();
}

// --- Loader ---

namespace {

Status ValidateOptions(const LoaderOptions& o) {
  if (o.batch_size <= 0) return InvalidArgumentError(fmt::format("loader: batch_size {} (expected > 0)", o.batch_size));
  if (o.threads < 0 || o.threads > kMaxThreads) {
    return InvalidArgumentError(
        fmt::format("loader: threads {} (expected 0 to {}; 0 = every core)", o.threads, kMaxThreads));
  }
  if (o.ring_size < 2 || o.ring_size > kMaxRingSize) {
    return InvalidArgumentError(fmt::format("loader: ring_size {} (expected 2 to {})", o.ring_size, kMaxRingSize));
  }
  if (!(o.max_skip_fraction >= 0 && o.max_skip_fraction <= 1)) {
    return InvalidArgumentError(fmt::format("loader: max_skip_fraction {} (expected 0 to 1)", o.max_skip_fraction));
  }
  if (o.skip_budget_samples < 0) {
    return InvalidArgumentError(fmt::format("loader: skip_budget_samples {} (expected >= 0)", o.skip_budget_samples));
  }
  for (const auto& [name, value] : {std::pair{"start_epoch", o.start_epoch}, std::pair{"start_batch", o.start_batch},
                                    std::pair{"epochs", o.epochs}}) {
    if (value < 0) return InvalidArgumentError(fmt::format("loader: {} {} (expected >= 0)", name, value));
  }
  if (o.epochs > std::numeric_limits<int64_t>::max() - o.start_epoch) {
    return InvalidArgumentError(fmt::format("loader: start_epoch {} + epochs {} is past the last epoch that can be "
                                            "counted", o.start_epoch, o.epochs));
  }
  if (o.augment.mode == CropMode::kRandomResized) {
    STOKE_RETURN_IF_ERROR(augment::ValidateOptions(o.augment.random));
  } else if (o.augment.crop <= 0 || o.augment.resize < o.augment.crop) {
    return InvalidArgumentError(fmt::format("loader: center crop {} after resize {} (expected 0 < crop <= resize)",
                                            o.augment.crop, o.augment.resize));
  }
  return OkStatus();
}

}  // namespace

Result<std::unique_ptr<Loader>> Loader::Create(const dataset::Dataset& ds, LoaderOptions o) {
  STOKE_RETURN_IF_ERROR(ValidateOptions(o));
  auto st = std::make_shared<detail::LoaderState>();
  st->dataset = ds;
  STOKE_ASSIGN_OR_RETURN(dataset::Sampler sampler, dataset::Sampler::Create(ds.size(), o.sampler));
  st->per_epoch = sampler.samples_per_rank();
  st->sampler.emplace(sampler);
  st->shard_positions = sampler.ShardPositions();
  st->batches_per_epoch = o.drop_last_batch ? st->per_epoch / o.batch_size
                                            : (st->per_epoch + o.batch_size - 1) / o.batch_size;
  if (st->batches_per_epoch == 0) {
    if (st->per_epoch == 0) {
      return InvalidArgumentError(fmt::format("loader: {}: its {} records leave rank {} of {} no sample",
                                              ds.path().string(), ds.size(), o.sampler.rank, o.sampler.world_size));
    }
    return InvalidArgumentError(fmt::format(
        "loader: {}: {} samples per epoch make no batch of {} with drop_last_batch",
        ds.path().string(), st->per_epoch, o.batch_size));
  }
  if (o.start_batch >= st->batches_per_epoch) {
    return InvalidArgumentError(fmt::format("loader: start_batch {} (an epoch has {} batches)",
                                            o.start_batch, st->batches_per_epoch));
  }
  st->threads = ThreadsOrCores(o.threads);
  // Chunks small enough to spread a batch over every thread, large enough to amortise the
  // pipeline's per-item cost.
  st->chunk = std::clamp(o.batch_size / (2 * st->threads), 1, 16);
  st->out_w = st->out_h = o.augment.out_size();
  // The ring must fit in this machine's memory (which also keeps the sizes below from overflowing).
  const double ring_bytes =  // pixels, then a label and an index per sample
      (3.0 * st->out_w * st->out_h + sizeof(int32_t) + sizeof(int64_t)) * o.batch_size * o.ring_size;
  if (const double physical = static_cast<double>(PhysicalMemoryBytes()); physical > 0 && ring_bytes > physical) {
    return InvalidArgumentError(fmt::format(
        "loader: a ring of {} batches of {} images of {}x{} takes {:.1f} GB, more than this machine's {:.1f} GB "
        "(expected a smaller ring_size, batch_size or crop size)",
        o.ring_size, o.batch_size, st->out_w, st->out_h, ring_bytes / 1e9, physical / 1e9));
  }
  st->sample_bytes = static_cast<size_t>(st->out_w) * st->out_h * 3;
  const size_t images_bytes = detail::AlignUp(st->sample_bytes * static_cast<size_t>(o.batch_size));
  st->labels_offset = images_bytes;
  const size_t indices_offset = detail::AlignUp(images_bytes + sizeof(int32_t) * static_cast<size_t>(o.batch_size));
  const size_t slot_bytes = indices_offset + sizeof(int64_t) * static_cast<size_t>(o.batch_size);
  st->budget_samples = o.skip_budget_samples > 0 ? o.skip_budget_samples : st->per_epoch;
  st->max_bad = static_cast<int64_t>(std::floor(o.max_skip_fraction * static_cast<double>(st->budget_samples)));
  if (o.on_error == ErrorPolicy::kSkip) {
    int64_t outside = 0;  // the dataset was re-packed since (smaller): those records cannot be met
    for (const BadRecord& b : o.known_bad) {
      if (b.index < 0 || b.index >= ds.size()) {
        ++outside;
        continue;
      }
      st->bad.emplace(b.index, b.reason);
      if (b.own && st->own_bad.insert(b.index).second) st->bad_count.fetch_add(1);
      if (!b.own) {
        st->handed_other.insert(b.index);
      } else if (st->handed_own.insert(b.index).second) {
        st->handed_own_count.fetch_add(1);
      }
    }
    if (outside > 0) {
      STOKE_LOG(WARN, "loader: {} bad record(s) known from earlier in this run are not records of {} ({} records); "
                "left out", outside, ds.path().string(), ds.size());
    }
  }
  if (o.storage.enabled) {
    StoragePlan plan;
    plan.start_epoch = o.start_epoch;
    plan.start_position = o.start_batch * o.batch_size;
    plan.epochs = o.epochs;
    plan.positions_per_epoch = std::min(st->per_epoch, st->batches_per_epoch * o.batch_size);
    plan.decode_threads = st->threads;
    plan.batch_size = o.batch_size;
    plan.ring_batches = o.ring_size;
    auto storage = StorageStage::Create(ds, *st->sampler, o.sampler, plan, o.storage);
    if (storage.ok()) {
      st->storage = std::move(*storage);
    } else if (storage.status().code() == StatusCode::kUnavailable) {
      STOKE_LOG(WARN, "loader: no read-ahead ({}); records are read through the map", storage.status().message());
    } else {
      return storage.status();
    }
  }
  st->decoder_options.strict = o.strict_decode;

  int device = -1;
  if (o.device == DeviceMode::kCuda) {
    device = o.device_id;
  } else if (o.device == DeviceMode::kAuto && ProbeCuda().devices > 0) {
    device = 0;
  }
  STOKE_ASSIGN_OR_RETURN(st->memory, BatchMemory::Create(o.ring_size, slot_bytes, device));
  for (int i = 0; i < o.ring_size; ++i) {
    auto slot = std::make_unique<detail::Slot>();
    slot->id = i;
    std::byte* base = st->memory->host(i);
    slot->images = reinterpret_cast<uint8_t*>(base);
    slot->labels = reinterpret_cast<int32_t*>(base + st->labels_offset);
    slot->indices = reinterpret_cast<int64_t*>(base + indices_offset);
    slot->stand_in.assign(static_cast<size_t>(o.batch_size), 0);
    Batch& b = slot->batch;
    b.width = st->out_w;
    b.height = st->out_h;
    if (st->memory->on_device()) {
      b.device_images = st->memory->device(i);
      b.device_labels_offset = st->labels_offset;
      b.copied_event = st->memory->copied_event(i);
      std::tie(b.copy_begin_event, b.copy_end_event) = st->memory->copy_timing_events(i);
    }
    st->slots.push_back(std::move(slot));
    st->free.push(i);
  }
  st->epoch = o.start_epoch;
  st->batch = o.start_batch;
  st->o = std::move(o);
  augment::UseCallerThreadsOnly();  // OpenCV must not fan out inside our workers
  if (st->threads > tbb::this_task_arena::max_concurrency()) {
    // TBB caps its workers at the core count; honour an explicit larger request.
    st->allow_threads = detail::ParallelismRequests::Hold(static_cast<size_t>(st->threads));
  }
  st->arena = std::make_unique<tbb::task_arena>(st->threads);
  st->started = detail::Clock::now();
  st->driver = std::thread([raw = st.get()] { raw->Run(); });
  return std::unique_ptr<Loader>(new Loader(std::move(st)));
}

Loader::~Loader() {
  state_->RequestStop();
  if (state_->driver.joinable()) state_->driver.join();
  state_->storage.reset();  // joins its threads and frees its buffers; leases do not use them
  // Readers hold read transactions on the dataset; end them now, not when the last lease goes.
  state_->workers.clear();
}

void Loader::Stop() { state_->RequestStop(); }

Result<BatchLease> Loader::Next() {
  const std::shared_ptr<detail::LoaderState> keep = state_;  // the statistics below outlive a ~Loader meanwhile
  detail::LoaderState& st = *keep;
  if (st.finished) return BatchLease();
  if (st.stop.load()) {  // Stop(): no more batches, not even those already made
    st.finished = true;
    return BatchLease();
  }
  if (st.leased.load() >= st.o.ring_size) {
    // Waiting would never end: every buffer is with the consumer.
    return InvalidArgumentError(fmt::format(
        "loader: all {} ring buffers are held by the consumer; release a batch before asking for "
        "the next (or raise ring_size)", st.o.ring_size));
  }
  const int depth = std::max(0, static_cast<int>(st.ready.size()));
  st.depth_sum.fetch_add(depth, std::memory_order_relaxed);
  st.depth_calls.fetch_add(1, std::memory_order_relaxed);
  if (depth > st.depth_max.load(std::memory_order_relaxed)) st.depth_max.store(depth, std::memory_order_relaxed);
  const auto t0 = detail::Clock::now();
  detail::Ready r;
  st.ready.pop(r);
  st.wait_ns.fetch_add(detail::Nanos(t0, detail::Clock::now()), std::memory_order_relaxed);
  if (r.kind == detail::Ready::kEnd) {
    st.finished = true;
    return BatchLease();
  }
  if (r.kind == detail::Ready::kError) {
    if (r.slot >= 0) st.HandOutBadRecords(*st.slots[static_cast<size_t>(r.slot)]);
    st.finished = true;
    return r.error;
  }
  if (st.stop.load()) {  // stopped while this one waited: it is not handed out
    st.finished = true;
    return BatchLease();
  }
  detail::Slot* slot = st.slots[static_cast<size_t>(r.slot)].get();
  STOKE_TSAN_ACQUIRE(slot);
  st.HandOutBadRecords(*slot);
  Batch& b = slot->batch;
  const size_t n = static_cast<size_t>(b.size);
  b.images = {slot->images, n * st.sample_bytes};
  b.labels = {slot->labels, n};
  b.indices = {slot->indices, n};
  b.stand_in = {slot->stand_in.data(), n};
  st.leased.fetch_add(1);
  st.batches_out.fetch_add(1, std::memory_order_relaxed);
  st.samples_out.fetch_add(b.size, std::memory_order_relaxed);
  return BatchLease(state_, r.slot, &b);
}

bool Loader::WaitReady(std::chrono::microseconds timeout) const {
  detail::LoaderState& st = *state_;
  // A batch, the end or an error is ready; or every slot is with the consumer (Next() fails at once).
  auto ready = [&] { return st.finished || st.ready.size() > 0 || st.leased.load() >= st.o.ring_size; };
  std::unique_lock<std::mutex> lock(st.ready_mu);
  return st.ready_cv.wait_for(lock, timeout, ready);
}

LoaderStats Loader::stats() const {
  const detail::LoaderState& st = *state_;
  LoaderStats s;
  s.batches = st.batches_out.load();
  s.samples = st.samples_out.load();
  s.bad_records = st.handed_own_count.load();
  s.elapsed_s = std::chrono::duration<double>(detail::Clock::now() - st.started).count();
  s.images_per_s = s.elapsed_s > 0 ? static_cast<double>(s.samples) / s.elapsed_s : 0;
  s.consumer_wait_s = static_cast<double>(st.wait_ns.load()) / 1e9;
  s.read_s = static_cast<double>(st.read_ns.load()) / 1e9;
  s.decode_s = static_cast<double>(st.decode_ns.load()) / 1e9;
  s.augment_s = static_cast<double>(st.augment_ns.load()) / 1e9;
  const int64_t calls = st.depth_calls.load();
  s.ready_depth_mean = calls > 0 ? static_cast<double>(st.depth_sum.load()) / static_cast<double>(calls) : 0;
  s.ready_depth_max = st.depth_max.load();
  s.threads = st.threads;
  s.pinned = st.memory->pinned();
  s.storage_stage = st.storage != nullptr;
  if (st.storage) s.storage = st.storage->stats();
  return s;
}

std::vector<BadRecord> Loader::bad_records() const {
  std::vector<BadRecord> out;
  const detail::LoaderState& st = *state_;
  for (const auto& [index, reason] : st.bad) {
    const bool own = st.handed_own.count(index) > 0;
    if (own || st.handed_other.count(index) > 0) out.push_back({index, reason, own});
  }
  std::sort(out.begin(), out.end(), [](const BadRecord& a, const BadRecord& b) { return a.index < b.index; });
  return out;
}

int64_t Loader::batches_per_epoch() const { return state_->batches_per_epoch; }
const LoaderOptions& Loader::options() const { return state_->o; }

}  // namespace stoke::prefetch
