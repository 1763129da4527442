#include "prefetch/storage.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "common/file_util.h"
#include "common/logging.h"
#include "common/map_guard.h"
#include "common/sys_memory.h"
#include "common/thread_name.h"

namespace stoke::prefetch {
namespace {

using Clock = std::chrono::steady_clock;

// Two records are read with one request when less than this lies between them: on a disk, reading
// 256 KB costs less than a seek, and within a block only LMDB's own small pages separate records.
constexpr uint64_t kMaxGap = 256 << 10;
// One pread reads at most this much, so that a long range is several requests in flight.
constexpr uint64_t kPieceBytes = 4 << 20;
// A merged range stops growing here (a whole window of contiguous blocks would otherwise be one).
constexpr uint64_t kMaxRange = 64 << 20;
constexpr int64_t kDefaultSegment = 256;
// A small budget shrinks the segments of the full and sequential orders down to this.
constexpr int64_t kMinSegment = 64;
// Segments built ahead of the decoders, whatever their size (resident ones take no buffer).
constexpr size_t kMaxSegmentsAhead = 8;
constexpr uint64_t kPage = 4096;
constexpr int64_t kReportedReadFailures = 5;

// Bytes in the unit of data.io.memory_mb (2^20 bytes), for the budget's messages.
std::string Mib(double bytes) {
  if (bytes < (1 << 20)) return fmt::format("{:.1f} KB", bytes / 1024);
  const double mb = bytes / (1 << 20);
  return mb < 10 ? fmt::format("{:.1f} MB", mb) : fmt::format("{:.0f} MB", mb);
}

int64_t Nanos(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}

// Read-ahead buffers come straight from the kernel and go straight back: through malloc, tens of
// MB of varied sizes would fragment the heap and stay with the process (in a memory-limited
// cgroup that memory is taken from the page cache the reads need).
struct MappedBuffer {
  std::byte* data = nullptr;
  size_t size = 0;
  MappedBuffer() = default;
  MappedBuffer(const MappedBuffer&) = delete;
  MappedBuffer& operator=(const MappedBuffer&) = delete;
  ~MappedBuffer() {
    if (data != nullptr) ::munmap(data, size);
  }
  bool Allocate(size_t bytes) {
    size = (bytes + kPage - 1) / kPage * kPage;
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data = p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p);
    return data != nullptr;
  }
  std::byte* get() const { return data; }
};

struct Segment;

// One pread into a segment's buffer.
// Ranges start and end on page boundaries in the file and in the buffer, so that a piece can be
// read with O_DIRECT; only `needed` bytes of it must arrive (the rest lies past the file's end).
struct Piece {
  Segment* segment = nullptr;
  uint64_t file_offset = 0;
  uint64_t length = 0;
  uint64_t needed = 0;
  uint64_t buffer_offset = 0;  // where in the segment's buffer
  bool failed = false;
};

// The samples at positions [begin, end) of one epoch and the buffer their records are read into.
struct Segment {
  int64_t seq = 0, epoch = 0, begin = 0, end = 0;
  std::vector<int64_t> indices;          // record index per position
  std::vector<uint64_t> offsets;         // per position: the value's file offset (UINT64_MAX: not held)
  std::vector<uint32_t> sizes;           // per position: the value's size
  std::vector<uint64_t> buffer_offsets;  // per position: where it lands in `buffer` (UINT64_MAX: map)
  MappedBuffer buffer;
  uint64_t bytes = 0;
  std::vector<Piece> pieces;
  // Guarded by State::mu.
  int pending = 0;
  bool allocated = false;
  bool queued = false;  // its pieces are with the I/O threads, which make it ready
  bool ready = false;
  int64_t remaining = 0;
};

constexpr uint64_t kNotHeld = UINT64_MAX;

}  // namespace

struct StorageStage::State {
  std::optional<dataset::Dataset> ds;  // a share of it: the caller's may be moved or go
  const dataset::Sampler* sampler = nullptr;
  dataset::ShuffleMode mode = dataset::ShuffleMode::kFull;
  StoragePlan plan;
  StorageOptions o;
  std::vector<dataset::RecordExtent> extents;
  int fd = -1;
  // O_DIRECT on the same file when ranges are dropped from the page cache anyway: no copy through
  // the cache and nothing for the kernel to reclaim. -1 where the filesystem refuses it.
  int direct_fd = -1;
  std::atomic<bool> direct_ok{true};
  int64_t segment = 0;
  int64_t segs_per_epoch = 0;
  int64_t first_seq = 0;
  int64_t end_seq = -1;  // -1: endless
  uint64_t budget = 0;
  // Ranges read are dropped from the page cache (a dataset larger than memory). The map is then
  // never used for records: pages found resident while planning a segment would often be gone by
  // the time a decoder touched them, and a fault on the map reads read_ahead_kb around it.
  bool drop = false;
  bool use_map = true;

  mutable std::mutex mu;
  std::condition_variable cv;  // a segment was created or became ready, memory was freed, stop
  std::map<int64_t, std::unique_ptr<Segment>> segments;  // by seq; guarded by mu
  int64_t next_seq = 0;     // the scheduler creates this one next; guarded by mu
  int64_t wanted = -1;      // the highest seq a decoder has waited for; guarded by mu
  uint64_t held = 0;        // bytes of buffers allocated; guarded by mu
  uint64_t peak = 0;        // guarded by mu
  bool stopped = false;     // guarded by mu
  // The scheduler ended on an exception (memory ran out while it planned a segment): segments it
  // did not create are read through the map from then on. Guarded by mu.
  bool abandoned = false;

  std::mutex io_mu;
  std::condition_variable io_cv;
  std::deque<Piece*> io_queue;  // guarded by io_mu
  bool io_stop = false;         // guarded by io_mu

  std::thread scheduler;
  // Started by the scheduler when it first has something to read: a dataset that stays in the page
  // cache never needs them. Joined after the scheduler.
  std::vector<std::thread> io;
  int io_count = 0;
  bool io_refused = false;  // the system refused a thread: do not ask again (scheduler only)

  std::atomic<int64_t> failed_reads{0};
  std::atomic<int64_t> bytes_read{0}, read_calls{0}, buffered{0}, mapped{0}, direct{0}, wait_ns{0};
  // Starvation advice: wait_ns at the start of the current window.
  Clock::time_point window_start = Clock::now(), last_advice{};
  int64_t window_wait_ns = 0;

  ~State() {
    if (fd >= 0) ::close(fd);
    if (direct_fd >= 0) ::close(direct_fd);
  }

  // -1 (outside the plan: read by the decoder) for an epoch too far to number its segments.
  int64_t SeqOf(int64_t epoch, int64_t position) const {
    int64_t seq = 0;
    if (__builtin_mul_overflow(epoch - plan.start_epoch, segs_per_epoch, &seq) ||
        __builtin_add_overflow(seq, position / segment, &seq)) {
      return -1;
    }
    return seq;
  }

  // Whether every page of [offset, offset + size) of the data file is in the page cache.
  bool Resident(uint64_t offset, uint64_t size) const {
    const auto* base = ds->map().data();
    const uint64_t first = offset / kPage * kPage, last = offset + size;
    const size_t pages = static_cast<size_t>((last - first + kPage - 1) / kPage);
    thread_local std::vector<unsigned char> vec;
    vec.resize(pages);
    if (::mincore(const_cast<std::byte*>(base + first), static_cast<size_t>(last - first), vec.data()) != 0) {
      return false;
    }
    return std::all_of(vec.begin(), vec.end(), [](unsigned char v) { return (v & 1) != 0; });
  }

  // The segment's records and the merged ranges they are read with; no buffer yet.
  std::unique_ptr<Segment> Build(int64_t seq, int64_t epoch, int64_t begin, int64_t end,
                                 const std::vector<int64_t>& order) const {
    auto s = std::make_unique<Segment>();
    s->seq = seq;
    s->epoch = epoch;
    s->begin = begin;
    s->end = end;
    const auto n = static_cast<size_t>(end - begin);
    s->indices.resize(n);
    s->offsets.assign(n, kNotHeld);
    s->sizes.assign(n, 0);
    s->buffer_offsets.assign(n, kNotHeld);
    s->remaining = end - begin;
    struct Wanted {
      uint64_t offset;
      uint32_t size;
      size_t slot;
    };
    std::vector<Wanted> reads;
    for (size_t i = 0; i < n; ++i) {
      const int64_t index = order[static_cast<size_t>(begin) + i];
      s->indices[i] = index;
      const dataset::RecordExtent e = extents[static_cast<size_t>(index)];
      if (e.size == 0) continue;  // no extent: the decoder's reader says what is wrong
      s->offsets[i] = e.offset;
      s->sizes[i] = e.size;
      if (use_map && Resident(e.offset, e.size)) continue;  // served from the map
      reads.push_back({e.offset, e.size, i});
    }
    std::sort(reads.begin(), reads.end(), [](const Wanted& a, const Wanted& b) { return a.offset < b.offset; });
    // Gaps read along are bounded by a quarter of the records' own bytes, so a segment's buffer
    // stays close to what its records need (small records scattered by a full shuffle would
    // otherwise merge into most of the file). A gap is the whole pages between two records: the
    // rest of a record's last page is read with it anyway (counted, the tails of records a little
    // over 2 KB, one LMDB overflow page each, used the allowance up halfway through a segment,
    // and each record after that was read on its own, even in sequential order).
    uint64_t record_bytes = 0;
    for (const Wanted& w : reads) record_bytes += w.size;
    uint64_t gap_allowance = record_bytes / 4;
    // Merge into ranges, then cut the ranges into pieces of at most kPieceBytes.
    const uint64_t file_bytes = ds->map().size();
    uint64_t range_start = 0, range_end = 0, range_buffer = 0;
    auto close_range = [&] {
      const uint64_t read_end = (range_end + kPage - 1) / kPage * kPage;
      for (uint64_t at = range_start; at < read_end; at += kPieceBytes) {
        const uint64_t length = std::min(kPieceBytes, read_end - at);
        const uint64_t needed = std::min(length, file_bytes > at ? file_bytes - at : 0);
        s->pieces.push_back({s.get(), at, length, needed, range_buffer + (at - range_start), false});
      }
      s->bytes += read_end - range_start;
    };
    bool open = false;
    for (const Wanted& w : reads) {
      const uint64_t w_end = w.offset + w.size;
      const uint64_t read_to = (range_end + kPage - 1) / kPage * kPage, page_start = w.offset / kPage * kPage;
      const uint64_t gap = open && page_start > read_to ? page_start - read_to : 0;
      if (open && w.offset <= range_end + kMaxGap && gap <= gap_allowance && w_end - range_start <= kMaxRange) {
        gap_allowance -= gap;
        range_end = std::max(range_end, w_end);
      } else {
        if (open) close_range();
        range_start = w.offset / kPage * kPage;
        range_end = w_end;
        range_buffer = s->bytes;  // a multiple of the page size, as every range's length is
        open = true;
      }
      s->buffer_offsets[w.slot] = range_buffer + (w.offset - range_start);
    }
    if (open) close_range();
    return s;
  }

  // Marks the positions whose record overlaps a failed piece as not held and the segment ready.
  void Finish(Segment& s) {
    for (const Piece& p : s.pieces) {
      if (!p.failed) continue;
      for (size_t i = 0; i < s.offsets.size(); ++i) {
        if (s.buffer_offsets[i] == kNotHeld) continue;
        const uint64_t a = s.offsets[i], b = a + s.sizes[i];
        if (a < p.file_offset + p.length && p.file_offset < b) s.buffer_offsets[i] = kNotHeld, s.offsets[i] = kNotHeld;
      }
    }
    s.ready = true;
  }

  void MaybeAdvise(Clock::time_point now) {
    const double window_s = std::chrono::duration<double>(now - window_start).count();
    if (window_s < 10) return;
    const int64_t total = wait_ns.load(std::memory_order_relaxed);
    const double waited = static_cast<double>(total - window_wait_ns) / 1e9 / std::max(1, plan.decode_threads);
    window_start = now;
    window_wait_ns = total;
    if (waited / window_s < 0.25 || (last_advice != Clock::time_point{} && now - last_advice < std::chrono::minutes(1))) {
      return;
    }
    last_advice = now;
    const std::string file = ds->data_file().string();
    if (mode == dataset::ShuffleMode::kFull) {
      STOKE_LOG(WARN,
                "loader: the decoders spent {:.0f}% of the last {:.0f} s waiting for records from {}: this storage "
                "cannot keep up with a full shuffle's random reads ({} in flight); set data.shuffle: block to read "
                "it in long sequential runs (docs/LARGE_DATASETS.md)",
                100 * waited / window_s, window_s, file, io.size());
    } else if (mode == dataset::ShuffleMode::kSequential) {
      STOKE_LOG(WARN,
                "loader: the decoders spent {:.0f}% of the last {:.0f} s waiting for records from {}: the storage is "
                "the bottleneck even for sequential reads; more data.io.threads keep more reads in flight and a "
                "larger data.io.memory_mb reads further ahead (docs/LARGE_DATASETS.md)",
                100 * waited / window_s, window_s, file);
    } else {
      STOKE_LOG(WARN,
                "loader: the decoders spent {:.0f}% of the last {:.0f} s waiting for records from {}: the storage is "
                "the bottleneck; a larger data.block_size makes reads longer and a larger data.io.memory_mb reads "
                "further ahead (docs/LARGE_DATASETS.md)",
                100 * waited / window_s, window_s, file);
    }
  }

  // The scheduler thread. An exception must not end the process (std::terminate) nor leave a
  // decoder waiting for a segment that will never be ready: every segment the scheduler created
  // and did not give to the I/O threads is made ready with its reads failed, and the rest of the
  // run goes the reader's way, as when no I/O thread could start.
  void Schedule() {
    SetThreadName("stoke-storage");
    try {
      ScheduleSegments();
    } catch (const std::exception& e) {
      Abandon(e.what());
    } catch (...) {
      Abandon("an unknown exception");
    }
  }

  // Allocates nothing until the decoders are released: memory may still be short.
  void Abandon(const char* why) noexcept {
    {
      std::lock_guard lock(mu);
      abandoned = true;
      for (auto& [seq, s] : segments) {
        if (s->ready || s->queued) continue;
        for (Piece& p : s->pieces) p.failed = true;
        Finish(*s);
      }
    }
    cv.notify_all();
    try {
      STOKE_LOG(WARN, "loader: storage stage: planning reads of {} stopped ({}); the remaining records are read "
                "through the map", ds->data_file().c_str(), why);
    } catch (...) {  // the warning is lost, nothing else
    }
  }

  void ScheduleSegments() {
    std::vector<int64_t> order;
    int64_t order_epoch = -1;
    for (int64_t seq = first_seq; end_seq < 0 || seq < end_seq; ++seq) {
      const int64_t epoch = plan.start_epoch + seq / segs_per_epoch;
      int64_t begin = (seq % segs_per_epoch) * segment;
      const int64_t end = std::min(begin + segment, plan.positions_per_epoch);
      if (epoch == plan.start_epoch) begin = std::max(begin, plan.start_position);
      if (begin >= end) continue;
      if (order_epoch != epoch) {
        order = sampler->Epoch(epoch);
        order_epoch = epoch;
      }
      std::unique_ptr<Segment> built = Build(seq, epoch, begin, end, order);
      Segment* s = built.get();
      {
        std::unique_lock lock(mu);
        // Not too far ahead: a bounded number of segments, and their buffers within the budget.
        // A segment a decoder already waits for is read even over the budget, so the decoders
        // cannot wait on memory that only they can free. The excess is therefore bounded by the
        // segments the samples in flight reach into (the pipeline's 4 x threads chunks of up to 16
        // samples): at most ceil(64 x threads / segment) + 1 segments over the budget.
        auto room = [&] {
          if (stopped || wanted >= seq) return true;
          if (segments.size() > kMaxSegmentsAhead) return false;
          return s->bytes == 0 || held == 0 || held + s->bytes <= budget;
        };
        segments.emplace(seq, std::move(built));
        next_seq = seq + 1;
        cv.notify_all();
        while (!room()) {
          cv.wait_for(lock, std::chrono::seconds(1));
          MaybeAdvise(Clock::now());
        }
        if (stopped) return;
        MaybeAdvise(Clock::now());
        held += s->bytes;
        peak = std::max(peak, held);
        s->allocated = true;
      }
      if (s->bytes > 0) {
        if (!s->buffer.Allocate(s->bytes)) {
          STOKE_LOG(WARN, "loader: no memory for {} of read-ahead; its records are read through the map",
                    Mib(static_cast<double>(s->bytes)));
          for (Piece& p : s->pieces) p.failed = true;
          std::lock_guard lock(mu);
          Finish(*s);
          s->pieces.clear();
          cv.notify_all();
          continue;
        }
      }
      {
        std::lock_guard lock(mu);
        s->pending = static_cast<int>(s->pieces.size());
        if (s->pending == 0) {
          Finish(*s);
          cv.notify_all();
          continue;
        }
      }
      if (io.empty() && !io_refused) StartIo();
      if (io.empty()) {  // no I/O thread could start: this segment's records go the reader's way
        for (Piece& p : s->pieces) p.failed = true;
        std::lock_guard lock(mu);
        s->pending = 0;
        Finish(*s);
        s->pieces.clear();
        cv.notify_all();
        continue;
      }
      {
        std::lock_guard lock(mu);
        s->queued = true;
      }
      {
        std::lock_guard lock(io_mu);
        const size_t before = io_queue.size();
        try {
          for (Piece& p : s->pieces) io_queue.push_back(&p);
        } catch (...) {
          // No I/O thread has taken any of them (io_mu is held): take them back, so that
          // Abandon() finishes the segment.
          io_queue.resize(before);
          std::lock_guard seg_lock(mu);
          s->queued = false;
          throw;
        }
      }
      io_cv.notify_all();
    }
  }

  // Starts the I/O threads; as many as the system lets this process have (thread limits, memory
  // for stacks), with a warning when that is fewer than asked.
  void StartIo() {
    try {
      io.reserve(static_cast<size_t>(io_count));
      for (int i = 0; i < io_count; ++i) io.emplace_back([this] { ReadPieces(); });
    } catch (const std::exception& e) {  // system_error (no thread) or bad_alloc (no memory for one)
      io_refused = true;
      STOKE_LOG(WARN, "loader: storage stage: started {} of {} I/O threads ({}){}", io.size(), io_count, e.what(),
                io.empty() ? "; records are read through the map" : "");
    }
  }

  // A few warnings, then one saying that the rest are not reported: a failing disk fails every
  // read. Never throws (memory may be what is short): the segment must still be finished.
  void ReportFailedRead(const Piece& p, int error) noexcept {
    const int64_t count = failed_reads.fetch_add(1, std::memory_order_relaxed) + 1;
    if (count > kReportedReadFailures) return;
    try {
      STOKE_LOG(WARN, "loader: reading {} bytes at {} of {} failed ({}); those records are read through the map{}",
                p.length, p.file_offset, ds->data_file().c_str(), error != 0 ? std::strerror(error) : "end of file",
                count == kReportedReadFailures ? " (further failed reads are not reported)" : "");
    } catch (...) {  // the warning is lost, nothing else
    }
  }

  void ReadPieces() {
    SetThreadName("stoke-read");
    for (;;) {
      Piece* p = nullptr;
      {
        std::unique_lock lock(io_mu);
        io_cv.wait(lock, [&] { return io_stop || !io_queue.empty(); });
        if (io_stop) return;
        p = io_queue.front();
        io_queue.pop_front();
      }
      uint64_t done = 0;
      std::byte* dst = p->segment->buffer.get() + p->buffer_offset;
      bool direct = direct_fd >= 0 && direct_ok.load(std::memory_order_relaxed);
      while (done < p->needed) {
        const ssize_t n = ::pread(direct ? direct_fd : fd, dst + done, static_cast<size_t>(p->length - done),
                                  static_cast<off_t>(p->file_offset + done));
        read_calls.fetch_add(1, std::memory_order_relaxed);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EINVAL && direct) {  // the filesystem takes O_DIRECT only in part
          direct_ok.store(false);
          direct = false;
          continue;
        }
        if (direct && n > 0 && n % static_cast<ssize_t>(kPage) != 0 && done + static_cast<uint64_t>(n) < p->needed) {
          direct = false;  // a short direct read leaves an unaligned rest: finish it buffered
        }
        if (n <= 0) {
          // A read error or a file shorter than the table says: these records go the reader's
          // way, which reports them.
          if (!p->failed) ReportFailedRead(*p, n < 0 ? errno : 0);
          p->failed = true;
          break;
        }
        done += static_cast<uint64_t>(n);
      }
      bytes_read.fetch_add(static_cast<int64_t>(done), std::memory_order_relaxed);
      if (drop && done > 0 && !direct) {
        // Whole pages only are dropped: round out, or each range would leave its two edge pages.
        const uint64_t first = p->file_offset / kPage * kPage;
        const uint64_t last = (p->file_offset + done + kPage - 1) / kPage * kPage;
        ::posix_fadvise(fd, static_cast<off_t>(first), static_cast<off_t>(last - first), POSIX_FADV_DONTNEED);
      }
      std::lock_guard lock(mu);
      Segment& s = *p->segment;
      if (--s.pending == 0) {
        Finish(s);
        cv.notify_all();
      }
    }
  }
};

StorageStage::StorageStage(std::unique_ptr<State> state) : state_(std::move(state)) {}

StorageStage::~StorageStage() {
  Stop();
  if (state_->scheduler.joinable()) state_->scheduler.join();
  for (auto& t : state_->io) t.join();
}

Result<std::unique_ptr<StorageStage>> StorageStage::Create(const dataset::Dataset& ds, const dataset::Sampler& sampler,
                                                           const dataset::SamplerOptions& so, const StoragePlan& plan,
                                                           const StorageOptions& o) {
  if (plan.positions_per_epoch <= 0 || plan.start_position < 0 || plan.start_position >= plan.positions_per_epoch ||
      plan.epochs < 0) {
    return InvalidArgumentError(fmt::format("loader: storage plan of {} positions per epoch from {} is empty",
                                            plan.positions_per_epoch, plan.start_position));
  }
  for (const auto& [name, value] : {std::pair{"memory_bytes", o.memory_bytes},
                                    std::pair{"io_threads", int64_t{o.io_threads}},
                                    std::pair{"segment_positions", int64_t{o.segment_positions}}}) {
    if (value < 0) return InvalidArgumentError(fmt::format("loader: storage {} {} (expected >= 0)", name, value));
  }
  auto st = std::make_unique<State>();
  st->ds = ds;
  st->sampler = &sampler;
  st->mode = so.mode;
  st->plan = plan;
  st->o = o;
  auto extents = ds.RecordExtents();
  if (!extents.ok() && extents.status().code() == StatusCode::kCorrupt) {
    // A damaged records table: the map path reads (and reports) each record on its own, under the
    // loader's bad-record policy, where refusing to start would stop a run over one bad page.
    return UnavailableError(fmt::format("{} (the records table is damaged: each record is read and checked on "
                                        "its own instead)",
                                        extents.status().message()));
  }
  STOKE_ASSIGN_OR_RETURN(st->extents, std::move(extents));

  // The mean record from the records' own extents (the manifest's payload_bytes is not checked
  // against the data, and an absurd value there made an absurd budget).
  const int64_t records = std::max<int64_t>(1, ds.size());
  uint64_t stored = 0;
  for (const auto& e : st->extents) stored += e.size;
  const double mean = std::max(1.0, static_cast<double>(stored) / static_cast<double>(records));
  const bool block = so.mode == dataset::ShuffleMode::kBlock;
  const dataset::SamplerOptions& clamped = sampler.options();  // block options fit the dataset
  int64_t segment = o.segment_positions > 0 ? o.segment_positions
                    : block                 ? clamped.block_size * clamped.window_blocks
                                            : kDefaultSegment;
  segment = std::min(segment, plan.positions_per_epoch);
  // A segment's buffer also holds its records' headers, the LMDB pages between them and merged
  // gaps: allow 15% over the mean.
  const double segment_bytes = 1.15 * mean * static_cast<double>(segment);
  // The default budget keeps the device busy: block shuffle holds the window being decoded, the
  // next one (read) and the one after (being read); the other orders read ahead a few segments
  // and at least the batches the ring can be filling plus one.
  const double ring_bytes = 1.15 * mean * static_cast<double>((plan.ring_batches + 1) * plan.batch_size);
  // (Rounded up: a default a byte short of three windows warned that it held fewer than three.)
  uint64_t budget = o.memory_bytes > 0 ? static_cast<uint64_t>(o.memory_bytes)
                    : block            ? static_cast<uint64_t>(std::ceil(3 * segment_bytes))
                                       : static_cast<uint64_t>(std::ceil(std::max(4 * segment_bytes, ring_bytes)));
  // The default never asks for more than half the memory this process may ever have (the machine's,
  // or its cgroup's limit): a large block x window otherwise got the process killed for memory.
  const uint64_t physical = o.physical_memory_bytes > 0 ? o.physical_memory_bytes : PhysicalMemoryBytes();
  if (o.memory_bytes == 0 && physical > 0 && budget > physical / 2) {
    budget = physical / 2;
    if (block && static_cast<double>(budget) < segment_bytes) {
      return InvalidArgumentError(fmt::format(
          "loader: one block-shuffle window of {} records ({} blocks of {} records of {:.0f} KB on average, {}) "
          "does not fit in half of the {} this process may use; lower data.window_blocks or data.block_size",
          segment, clamped.window_blocks, clamped.block_size, mean / 1024, Mib(segment_bytes),
          Mib(static_cast<double>(physical))));
    }
  }
  // A budget asked for that no allocation of this process can ever reach is a mistake, not a wish:
  // read ahead up to it, the process was killed for memory.
  if (o.memory_bytes > 0 && physical > 0 && budget > physical) {
    return InvalidArgumentError(fmt::format(
        "loader: a read-ahead budget (data.io.memory_mb; StorageOptions::memory_bytes) of {} is more than the {} "
        "this process may use (the machine's memory or its cgroup's limit); give at most half of that, or 0 for "
        "the default",
        Mib(static_cast<double>(budget)), Mib(static_cast<double>(physical))));
  }
  if (o.memory_bytes > 0 && physical > 0 && budget > physical / 2) {
    STOKE_LOG(WARN, "loader: a read-ahead budget (data.io.memory_mb) of {} is more than half of the {} this process "
              "may use: the decoders, the ring and the model share the rest",
              Mib(static_cast<double>(budget)), Mib(static_cast<double>(physical)));
  }
  if (block && static_cast<double>(budget) < segment_bytes) {
    return InvalidArgumentError(fmt::format(
        "loader: a read-ahead budget (data.io.memory_mb; StorageOptions::memory_bytes) of {} cannot hold one "
        "block-shuffle window of {} records ({} blocks of {} records of {:.0f} KB on average, {}); raise "
        "data.io.memory_mb or lower data.window_blocks or data.block_size",
        Mib(static_cast<double>(budget)), segment, clamped.window_blocks, clamped.block_size, mean / 1024,
        Mib(segment_bytes)));
  }
  if (block && static_cast<double>(budget) < 3 * segment_bytes) {
    const std::string which = o.memory_bytes > 0
                                  ? fmt::format("a read-ahead budget (data.io.memory_mb) of {}",
                                                Mib(static_cast<double>(budget)))
                                  : fmt::format("the default read-ahead budget, half of the {} this process may use,",
                                                Mib(static_cast<double>(physical)));
    STOKE_LOG(WARN,
              "loader: {} holds fewer than three block-shuffle windows of {}: reading the next window waits "
              "for the decoders, so reads will not keep the device busy",
              which, Mib(segment_bytes));
  }
  if (!block && o.segment_positions == 0 && static_cast<double>(budget) < 2 * segment_bytes) {
    // A smaller segment still reads ahead; full-shuffle reads are one request per record anyway.
    segment = std::min(segment, std::max<int64_t>(kMinSegment, static_cast<int64_t>(static_cast<double>(budget) / (2 * mean))));
    // Even the smallest segment is read whole (the one a decoder waits for is read over the
    // budget): said, not left for a peak figure to show.
    if (const double smallest = 1.15 * mean * static_cast<double>(segment); static_cast<double>(budget) < smallest) {
      STOKE_LOG(WARN, "loader: a read-ahead budget (data.io.memory_mb) of {} holds less than one segment of {} "
                "records ({}): one segment at a time is read, over the budget",
                Mib(static_cast<double>(budget)), segment, Mib(smallest));
    }
  }
  st->segment = segment;
  st->budget = budget;
  st->segs_per_epoch = (plan.positions_per_epoch + segment - 1) / segment;
  st->first_seq = plan.start_position / segment;
  // A count of epochs too large to number its segments is as good as endless.
  int64_t end_seq = -1;
  if (plan.epochs > 0 && __builtin_mul_overflow(plan.epochs, st->segs_per_epoch, &end_seq)) end_seq = -1;
  st->end_seq = end_seq;
  st->next_seq = st->first_seq;
  const uint64_t available = AvailableMemoryBytes();
  st->drop = o.cache == StorageOptions::Cache::kDrop ||
             (o.cache == StorageOptions::Cache::kAuto && available > 0 && ds.map().size() > available / 2);

  // The file the map shows, not whatever its path names now (`pack --overwrite` may have replaced
  // the dataset since it was opened, and its records lie elsewhere in the new file): reopened
  // through LMDB's own descriptor, or by path when it is still the same file.
  const int lmdb_fd = ds.data_fd();
  const std::string same_file = lmdb_fd >= 0 ? fmt::format("/proc/self/fd/{}", lmdb_fd) : std::string();
  auto open_same = [&](int flags) -> int {
    int fd = same_file.empty() ? -1 : ::open(same_file.c_str(), flags);
    if (fd >= 0) return fd;
    fd = ::open(ds.data_file().c_str(), flags);
    struct stat a {}, b {};
    if (fd >= 0 && lmdb_fd >= 0 &&
        (::fstat(fd, &a) != 0 || ::fstat(lmdb_fd, &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino)) {
      ::close(fd);
      errno = ESTALE;
      return -1;
    }
    return fd;
  };
  st->fd = open_same(O_RDONLY | O_CLOEXEC);
  if (st->fd < 0 && errno == ESTALE) {
    return UnavailableError(fmt::format("{} is another file than when the dataset was opened (replaced since)",
                                        ds.data_file().string()));
  }
  if (st->fd < 0) {
    return IoError(fmt::format("loader: {}: cannot open for reading: {}", ds.data_file().string(), std::strerror(errno)));
  }
  // mincore() answers for a file's pages only to a process that owns the file or may write it
  // (Linux 5.0 on): to others it reports every page resident, and nothing would be read ahead.
  struct stat file {};
  const bool residency_known = ::fstat(st->fd, &file) == 0 &&
                               (file.st_uid == ::geteuid() || ::geteuid() == 0 ||
                                ::access(same_file.empty() ? ds.data_file().c_str() : same_file.c_str(), W_OK) == 0);
  if (!residency_known) {
    STOKE_LOG(DEBUG, "loader: {} is not this user's to write: the page cache cannot be asked which records it holds, "
              "so every record is read ahead", ds.data_file().string());
  }
  st->use_map = o.use_map_when_resident && !st->drop && residency_known;
  if (st->drop) st->direct_fd = open_same(O_RDONLY | O_CLOEXEC | O_DIRECT);
  // The stage says exactly what it needs: the kernel's readahead past a read (up to
  // read_ahead_kb, often megabytes) would only spend the device's time on data read later by
  // another request, or never (the next block of a block shuffle is elsewhere in the file).
  ::posix_fadvise(st->fd, 0, 0, POSIX_FADV_RANDOM);

  const int io_threads = o.io_threads > 0 ? o.io_threads : so.mode == dataset::ShuffleMode::kFull ? 32 : 4;
  st->io_count = io_threads;
  State* raw = st.get();
  st->scheduler = std::thread([raw] { raw->Schedule(); });
  STOKE_LOG(DEBUG, "loader: storage stage: segments of {} samples, budget {}, {} I/O threads{}", segment,
            Mib(static_cast<double>(budget)), io_threads, st->drop ? ", dropping read ranges from the page cache" : "");
  return std::unique_ptr<StorageStage>(new StorageStage(std::move(st)));
}

Result<std::span<const std::byte>> StorageStage::Acquire(int64_t epoch, int64_t position, int64_t index) {
  State& st = *state_;
  const int64_t seq = st.SeqOf(epoch, position);
  if (epoch < st.plan.start_epoch || seq < st.first_seq || (st.end_seq >= 0 && seq >= st.end_seq) ||
      position >= st.plan.positions_per_epoch) {
    st.direct.fetch_add(1, std::memory_order_relaxed);
    return std::span<const std::byte>();
  }
  std::unique_lock lock(st.mu);
  Segment* s = nullptr;
  const auto t0 = Clock::now();
  bool waited = false;
  for (;;) {
    if (st.stopped) return UnavailableError("loader: stopped");
    auto it = st.segments.find(seq);
    if (it != st.segments.end() && it->second->ready) {
      s = it->second.get();
      break;
    }
    // Done with already (a second visit), or never to be planned (the scheduler stopped).
    if (it == st.segments.end() && (seq < st.next_seq || st.abandoned)) {
      st.direct.fetch_add(1, std::memory_order_relaxed);
      return std::span<const std::byte>();
    }
    waited = true;
    // Only a higher `wanted` can change the scheduler's mind (it may be holding back for the
    // budget). Notifying on every pass woke the other waiting decoders, which notified in turn:
    // they spun on the lock for as long as the read took.
    if (seq > st.wanted) {
      st.wanted = seq;
      st.cv.notify_all();
    }
    st.cv.wait(lock);
  }
  if (waited) st.wait_ns.fetch_add(Nanos(t0, Clock::now()), std::memory_order_relaxed);
  if (position < s->begin || position >= s->end) {
    st.direct.fetch_add(1, std::memory_order_relaxed);
    return std::span<const std::byte>();
  }
  const auto i = static_cast<size_t>(position - s->begin);
  if (s->indices[i] != index || s->offsets[i] == kNotHeld) {
    st.direct.fetch_add(1, std::memory_order_relaxed);
    return std::span<const std::byte>();
  }
  if (s->buffer_offsets[i] != kNotHeld) {
    st.buffered.fetch_add(1, std::memory_order_relaxed);
    return std::span<const std::byte>(s->buffer.get() + s->buffer_offsets[i], s->sizes[i]);
  }
  // Served from the map: touch its pages under the fault guard, as a reader does, so that a
  // page the kernel dropped since and that can no longer be read is an error here, not a crash
  // in the decoder.
  const std::byte* at = st.ds->map().data() + s->offsets[i];
  const uint32_t size = s->sizes[i];
  lock.unlock();
  struct Touch {
    const std::byte* at;
    uint32_t size;
    void operator()() const {
      const volatile std::byte* p = at;
      for (uint32_t k = 0; k < size; k += kPage) (void)p[k];
      if (size > 0) (void)p[size - 1];
    }
  } touch{at, size};
  if (!RunGuarded(touch)) {
    return CorruptError(fmt::format("dataset: {}: record {}: the data file is damaged (a page cannot be read)",
                                    st.ds->path().string(), index));
  }
  st.mapped.fetch_add(1, std::memory_order_relaxed);
  return std::span<const std::byte>(at, size);
}

void StorageStage::Release(int64_t epoch, int64_t position) {
  State& st = *state_;
  const int64_t seq = st.SeqOf(epoch, position);
  std::unique_ptr<Segment> done;
  {
    std::lock_guard lock(st.mu);
    auto it = st.segments.find(seq);
    if (it == st.segments.end() || position < it->second->begin || position >= it->second->end) return;
    Segment& s = *it->second;
    if (--s.remaining > 0 || !s.ready) return;
    if (s.allocated) st.held -= s.bytes;
    done = std::move(it->second);
    st.segments.erase(it);
  }
  st.cv.notify_all();
  // `done` (and its buffer) is freed here, outside the lock.
}

void StorageStage::Stop() {
  State& st = *state_;
  {
    std::lock_guard lock(st.mu);
    st.stopped = true;
  }
  st.cv.notify_all();
  {
    std::lock_guard lock(st.io_mu);
    st.io_stop = true;
  }
  st.io_cv.notify_all();
}

StorageStats StorageStage::stats() const {
  const State& st = *state_;
  StorageStats s;
  s.bytes_read = st.bytes_read.load();
  s.read_calls = st.read_calls.load();
  s.records_buffered = st.buffered.load();
  s.records_mapped = st.mapped.load();
  s.records_direct = st.direct.load();
  s.wait_s = static_cast<double>(st.wait_ns.load()) / 1e9;
  {
    std::lock_guard lock(st.mu);
    s.held_bytes = static_cast<int64_t>(st.held);
    s.peak_held_bytes = static_cast<int64_t>(st.peak);
  }
  s.budget_bytes = static_cast<int64_t>(st.budget);
  s.segment_positions = st.segment;
  s.io_threads = st.io_count;
  s.drops_cache = st.drop;
  return s;
}

}  // namespace stoke::prefetch
