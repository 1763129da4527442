// Progress reporting for long jobs (pack, verify, bench): count, rate and ETA.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

namespace stoke {

// Prints progress of a job with a known total to a FILE (stderr by default).
// On a terminal it redraws one live line ("\r") at most every 200 ms; otherwise (logs, CI) it
// prints a plain line at most every `plain_interval_s` seconds. Thread-safe: Advance() may be
// called from any number of threads; printing is serialised and never blocks a caller that
// loses the race (try_lock).
class ProgressReporter {
 public:
  ProgressReporter(std::string label, int64_t total, std::FILE* out = stderr,
                   double plain_interval_s = 10.0);
  ~ProgressReporter();  // calls Finish() if not yet called

  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  // Adds `n` finished items and prints if the interval has passed.
  void Advance(int64_t n = 1);
  // Prints the final line (count, elapsed, mean rate). Idempotent.
  void Finish();

  int64_t done() const { return done_.load(std::memory_order_relaxed); }
  // Formats "1234/5000 | 812.3/s | ETA 4.6s": exposed for tests.
  static std::string FormatLine(const std::string& label, int64_t done, int64_t total,
                                double elapsed_s);

 private:
  void Print(bool final_line);

  const std::string label_;
  const int64_t total_;
  std::FILE* const out_;
  const bool live_;  // out_ is a terminal
  const std::chrono::steady_clock::duration interval_;
  const std::chrono::steady_clock::time_point start_;
  std::atomic<int64_t> done_{0};
  std::atomic<bool> finished_{false};
  std::mutex print_mu_;
  std::chrono::steady_clock::time_point last_print_;  // guarded by print_mu_
};

}  // namespace stoke
