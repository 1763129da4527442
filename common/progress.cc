#include "common/progress.h"

#include <unistd.h>

#include <fmt/format.h>

namespace stoke {
namespace {

std::string FormatSeconds(double s) {
  if (s < 0 || s > 1e7) return "?";
  if (s < 60) return fmt::format("{:.1f}s", s);
  auto total = static_cast<int64_t>(s + 0.5);
  if (total < 3600) return fmt::format("{}m{:02}s", total / 60, total % 60);
  return fmt::format("{}h{:02}m", total / 3600, (total % 3600) / 60);
}

}  // namespace

ProgressReporter::ProgressReporter(std::string label, int64_t total, std::FILE* out,
                                   double plain_interval_s)
    : label_(std::move(label)),
      total_(total),
      out_(out),
      live_(out != nullptr && isatty(fileno(out))),
      interval_(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(live_ ? 0.2 : plain_interval_s))),
      start_(std::chrono::steady_clock::now()),
      last_print_(start_) {}

ProgressReporter::~ProgressReporter() { Finish(); }

std::string ProgressReporter::FormatLine(const std::string& label, int64_t done, int64_t total,
                                         double elapsed_s) {
  double rate = elapsed_s > 0 ? static_cast<double>(done) / elapsed_s : 0.0;
  std::string line = fmt::format("{}: {}/{} | {:.1f}/s", label, done, total, rate);
  if (done < total && rate > 0) {
    line += " | ETA " + FormatSeconds(static_cast<double>(total - done) / rate);
  } else {
    line += " | " + FormatSeconds(elapsed_s);
  }
  return line;
}

void ProgressReporter::Advance(int64_t n) {
  done_.fetch_add(n, std::memory_order_relaxed);
  if (out_ == nullptr) return;
  std::unique_lock lock(print_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return;
  auto now = std::chrono::steady_clock::now();
  if (now - last_print_ < interval_) return;
  last_print_ = now;
  Print(false);
}

void ProgressReporter::Finish() {
  if (finished_.exchange(true)) return;
  if (out_ == nullptr) return;
  std::lock_guard lock(print_mu_);
  Print(true);
}

void ProgressReporter::Print(bool final_line) {
  double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::string line = FormatLine(label_, done(), total_, elapsed);
  if (live_) {
    // \33[K clears what a longer previous line left behind.
    std::fprintf(out_, "\r%s\33[K%s", line.c_str(), final_line ? "\n" : "");
  } else {
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
}

}  // namespace stoke
