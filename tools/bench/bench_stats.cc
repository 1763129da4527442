#include "tools/bench/bench_stats.h"

#include <unistd.h>

#include <fmt/format.h>

namespace stoke::bench {

BenchProgress::BenchProgress(std::string command, int total_runs, std::FILE* out)
    : command_(std::move(command)),
      total_(total_runs),
      out_(out),
      live_(out != nullptr && isatty(fileno(out))),
      start_(std::chrono::steady_clock::now()),
      last_plain_(start_) {}

BenchProgress::~BenchProgress() {
  if (open_) {
    std::fputs("\r\33[K", out_);
    std::fflush(out_);
  }
}

void BenchProgress::Run(const std::string& figure, int run, int runs) {
  if (run > 0) ++done_;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  Show(fmt::format("{}: [{}/{}] {}: {} | {:.0f}s", command_, done_, total_, figure,
                   run == 0 ? std::string("warm-up") : fmt::format("run {} of {}", run, runs), elapsed));
}

void BenchProgress::Note(const std::string& what) { Show(fmt::format("{}: {}", command_, what)); }

void BenchProgress::Show(const std::string& line) {
  if (out_ == nullptr) return;
  if (live_) {
    std::fprintf(out_, "\r%s\33[K", line.c_str());
    open_ = true;
  } else {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_plain_ < std::chrono::seconds(10)) return;
    last_plain_ = now;
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
}

}  // namespace stoke::bench
