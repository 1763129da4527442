// Small helpers shared by the bench commands: medians, runs sized by time, and progress.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace stoke::bench {

// The median (the mean of the middle two for an even count); 0 for no values.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Timed runs last about `seconds` each, whatever the data: a figure that is fast on one dataset
// and slow on another (a CRC over 110 KB records, a full pack) gets as many items as fit in the
// time instead of a fixed count. `min_items` keeps slow items averaged over several; `max_items`
// (0: none) caps a run at, say, the size of the dataset.
inline int64_t ItemsForSeconds(double rate, double seconds, int64_t min_items, int64_t max_items = 0) {
  const double want = rate > 0 ? rate * seconds : 0;
  int64_t n = want >= 9e18 ? INT64_MAX : static_cast<int64_t>(want + 0.5);
  n = std::max(n, min_items);
  if (max_items > 0) n = std::min(n, max_items);
  return n;
}

// The end of a timed run; Passed() is a clock read, so check it every few dozen items. `seconds`
// over about 30 years (or not a number) means never: converted as they are, they overflowed the
// clock's 64-bit nanoseconds and the deadline had passed at once.
class Deadline {
 public:
  explicit Deadline(double seconds) : never_(!(seconds < kMaxSeconds)) {
    if (!never_) {
      end_ = std::chrono::steady_clock::now() +
             std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
    }
  }
  static Deadline Never() { return Deadline(kMaxSeconds); }
  bool Passed() const { return !never_ && std::chrono::steady_clock::now() >= end_; }

 private:
  static constexpr double kMaxSeconds = 1e9;
  bool never_;
  std::chrono::steady_clock::time_point end_;
};

// Says which figure and which run a benchmark is on: on a terminal one live line on stderr,
// redrawn at every step and cleared at the end; elsewhere (logs, CI) a plain line at most every
// 10 s. Not thread-safe: the thread that runs the benchmark calls it.
class BenchProgress {
 public:
  BenchProgress(std::string command, int total_runs, std::FILE* out = stderr);
  ~BenchProgress();
  BenchProgress(const BenchProgress&) = delete;
  BenchProgress& operator=(const BenchProgress&) = delete;

  // Starts run `run` (1-based) of `runs` of `figure` ("random +CRC, 2 threads"); run 0 is a
  // warm-up.
  void Run(const std::string& figure, int run, int runs);
  // A step that is not a timed run ("packing the dataset").
  void Note(const std::string& what);

 private:
  void Show(const std::string& line);

  const std::string command_;
  const int total_;
  std::FILE* const out_;
  const bool live_;
  int done_ = 0;
  bool open_ = false;
  std::chrono::steady_clock::time_point start_, last_plain_;
};

}  // namespace stoke::bench
