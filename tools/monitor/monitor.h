// stoke monitor: a small read-only HTTP server (cpp-httplib) showing one or more training runs
// live in a browser: loss, top-1/top-5, learning rate, images/s and data-wait against step or
// wall-clock time, several runs overlaid; epoch, step and ETA; the resolved config; the dataset
// summary; the records the loader skipped. The page polls for the metrics lines written since its
// last request, so it follows a run as it trains and shows a finished run just the same. The page,
// its script and Chart.js (Debian's libjs-chart.js) are compiled into the binary: no network.
//
// What it serves (everything else is 404):
//   /                          the page          /app.js, /chart.js   its scripts
//   /api/runs                  the runs: name, state, resolved config, dataset summary (JSON)
//   /api/runs/N/metrics?from=B the complete metrics lines from byte B on (JSON, at most ~4 MiB)
//   /runs/N/PATH               a regular file inside run N's directory (no "..", no absolute path,
//                              no symlink leading out of it)
// Limits: GET and HEAD only (405, before any body is read); request lines over 8 KiB 414 and
// header lines over 8 KiB 400 (cpp-httplib's own limits); more than 100 header lines or 64 KiB of
// them 431; a request that sends more than 80 KiB, or takes more than 10 s to arrive, 400 and the
// connection closed. Connections with nothing to read wait on one epoll thread (closed after 5 s
// idle; at most 4096 and an eighth of the open-file limit), not in a worker; `threads` workers
// serve requests, at most `max_queued` (and another eighth of the limit) ready connections wait
// for one, and beyond that the listener stops accepting for a while. Bound to loopback, requests
// whose Host is not a loopback name get 403 (DNS rebinding); answers are never brotli-compressed.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace stoke::monitor {

struct MonitorOptions {
  std::vector<std::string> run_dirs;  // each must exist and be a directory
  std::string host = "127.0.0.1";     // the address to listen on: loopback unless told otherwise
  int port = 8080;                    // 0: any free port (see Monitor::port())
  int threads = 8;                    // connection workers
  int max_queued = 256;               // accepted connections waiting for a worker
  int poll_ms = 1000;                 // how often the page asks for new metrics
  // Warn about a run directory that holds no run yet (a wrong folder shows an empty card); off
  // for the monitor a run serves of itself, which starts before the run writes anything.
  bool warn_empty_runs = true;
};

struct MonitorStats {
  int64_t requests = 0;
  int64_t not_found = 0;  // 404 answers (unknown paths, refused file requests)
  int64_t refused = 0;    // 403 (a Host that is not loopback) / 405 / 413 / 431 answers
};

class Monitor {
 public:
  // Checks the run directories, binds host:port and starts serving on its own threads.
  // kNotFound names a run directory that does not exist; kUnavailable says why the address
  // cannot be listened on.
  static Result<std::unique_ptr<Monitor>> Start(MonitorOptions options);
  ~Monitor();  // Stop()
  Monitor(const Monitor&) = delete;
  Monitor& operator=(const Monitor&) = delete;

  // Stops listening, closes every connection that would make it wait (queued, idle, a request
  // still arriving, an answer its client does not read), joins every thread. Idempotent.
  void Stop();
  int port() const;
  std::string url() const;  // http://host:port/
  MonitorStats stats() const;

  struct State;

 private:
  explicit Monitor(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// "[HOST:]PORT" (e.g. "8080", "0.0.0.0:8080", "[::1]:8080"); HOST defaults to `default_host`.
// kInvalidArgument names the text and what was expected.
Result<std::pair<std::string, int>> ParseListenAddress(std::string_view text, std::string_view default_host);

// A file of a run, open for reading: every read goes through this descriptor, never through the
// path again, so a link swapped in after the check cannot redirect it. Move-only.
class RunFile {
 public:
  RunFile() = default;
  RunFile(int fd, std::filesystem::path path) : fd_(fd), path_(std::move(path)) {}
  RunFile(RunFile&& o) noexcept : fd_(std::exchange(o.fd_, -1)), path_(std::move(o.path_)) {}
  RunFile& operator=(RunFile&& o) noexcept;
  RunFile(const RunFile&) = delete;
  RunFile& operator=(const RunFile&) = delete;
  ~RunFile();
  int fd() const { return fd_; }
  const std::filesystem::path& path() const { return path_; }  // where it was opened, resolved

 private:
  int fd_ = -1;
  std::filesystem::path path_;
};

// Opens the file `relative` names inside `run_dir` (an absolute, canonical directory), or
// kNotFound when it is empty, absolute, has an empty, "." or ".." component, does not exist, is
// not a regular file, or resolves (through symlinks) to somewhere outside run_dir. The check is
// made on the opened file itself (the kernel's name for the descriptor, from /proc), so a link or
// folder swapped in between the path's check and the open is refused as well; a file replaced by
// a rename meanwhile is opened again. Without /proc the path alone is checked (a warning says so).
Result<RunFile> OpenRunFile(const std::filesystem::path& run_dir, std::string_view relative);

// The metrics lines of `file` from byte `from` on, as the page receives them: the JSON object
// {"offset": next byte to ask for, "size": file size, "file_id": changes when the file is
// replaced, "reset": true when `from` was past the end (the file was rewritten: start again from
// 0), "records": [parsed lines], "malformed": lines that were not JSON objects (skipped),
// "partial": bytes of an unfinished last line}. At most `max_bytes` of the file are read. A null
// `file` (no metrics file) gives {"exists": false}.
std::string ReadMetricsChunk(const RunFile* file, int64_t from, size_t max_bytes);
// The same for a path, opened without following a final symlink.
std::string ReadMetricsChunk(const std::filesystem::path& path, int64_t from, size_t max_bytes);

}  // namespace stoke::monitor
