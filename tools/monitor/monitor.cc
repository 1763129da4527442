#include "tools/monitor/monitor.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <httplib.h>
#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include "common/file_util.h"
#include "common/json_util.h"
#include "common/logging.h"
#include "common/thread_name.h"
#include "dataset/dataset.h"
#include "tools/monitor/assets.h"

namespace stoke::monitor {
namespace {

constexpr size_t kMaxMetricsChunk = 4 << 20;  // bytes of metrics.jsonl per answer
constexpr size_t kMaxConfigBytes = 1 << 20;   // config.yaml shown on the page
constexpr size_t kMaxHeaderLines = 100;
constexpr size_t kMaxHeaderBytes = 64 << 10;
constexpr size_t kMaxRequestBytes = 80 << 10;  // request line + headers + body, read per request
constexpr int kListenBacklog = 512;
constexpr int kKeepAliveRequests = 100;
constexpr int kReadTimeoutMs = 5000, kWriteTimeoutMs = 5000, kKeepAliveTimeoutMs = 5000;
constexpr int kRequestDeadlineMs = 10000;
constexpr size_t kMaxParked = 4096;  // idle connections waiting for their next request, at most

// The monitor shares the trainer's process, whose datasets, checkpoints and logs need most of the
// descriptors it may open: idle connections may hold an eighth of them, and connections waiting
// for a worker another eighth (the workers' own are few). Beyond that, connections wait in the
// kernel's backlog. (Only the idle ones were bounded: a flood of slow clients once filled the
// queue and a low limit, and the run failed to write its checkpoint.)
size_t DescriptorShare() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return kMaxParked;
  return static_cast<size_t>(limit.rlim_cur / 8);
}
size_t MaxParked() { return std::clamp<size_t>(DescriptorShare(), 16, kMaxParked); }
int MaxQueued(int asked) {
  return static_cast<int>(std::min(static_cast<size_t>(asked), std::max<size_t>(DescriptorShare(), 8)));
}

// Waits up to timeout_ms for `events` on fd; gives up at once when `stop` is set (the monitor is
// stopping: a slow client must not hold its shutdown, or the trainer's exit, for its timeouts).
bool WaitFor(int fd, short events, int timeout_ms, const std::atomic<bool>* stop = nullptr) {
  constexpr int kSliceMs = 50;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  int wait_ms = 0;  // first: ready now? (then it is served even when stopping: a client that keeps up gets its answer)
  while (true) {
    pollfd p{fd, events, 0};
    int r;
    do {
      r = ::poll(&p, 1, wait_ms);
    } while (r < 0 && errno == EINTR);
    if (r != 0) return r > 0;
    if (stop != nullptr && stop->load()) return false;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) return false;
    wait_ms = static_cast<int>(stop != nullptr ? std::min<int64_t>(kSliceMs, left) : left);
  }
}

// Connection workers with a bounded queue of connections ready to be served. When the queue is
// full, enqueue() blocks its caller (the listener, or Parking), so further connections wait in the
// kernel's backlog instead of growing memory here.
class BoundedPool : public httplib::TaskQueue {
 public:
  // `before_shutdown` runs first in shutdown(): whoever hands this pool work stops doing so.
  BoundedPool(int threads, int max_queued, std::function<void()> before_shutdown)
      : max_queued_(static_cast<size_t>(max_queued)), before_shutdown_(std::move(before_shutdown)) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { Work(); });
  }
  void enqueue(std::function<void()> fn) override {
    std::unique_lock lock(mu_);
    not_full_.wait(lock, [&] { return stopping_ || jobs_.size() < max_queued_; });
    jobs_.push_back(std::move(fn));  // even when stopping: the job closes its socket
    ready_.notify_one();
  }
  void shutdown() override {
    if (before_shutdown_) before_shutdown_();
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    ready_.notify_all();
    not_full_.notify_all();
    for (auto& t : workers_) t.join();
  }

 private:
  void Work() {
    while (true) {
      std::function<void()> job;
      {
        std::unique_lock lock(mu_);
        ready_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping, and nothing left to serve
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      not_full_.notify_one();
      job();
    }
  }
  const size_t max_queued_;
  const std::function<void()> before_shutdown_;
  std::mutex mu_;
  std::condition_variable ready_, not_full_;
  std::deque<std::function<void()>> jobs_;  // guarded by mu_
  bool stopping_ = false;                   // guarded by mu_
  std::vector<std::thread> workers_;
};

// A connection's socket as cpp-httplib reads and writes it, except that each request may read at
// most kMaxRequestBytes: past that, reads fail and cpp-httplib answers 400 and closes. (Its own
// header reader keeps every header line it is sent, so without this a client could grow the
// server's memory without limit.) Reads are buffered: the parser reads a line at a time.
class BoundedStream : public httplib::Stream {
 public:
  BoundedStream(int fd, const std::atomic<bool>* stop) : fd_(fd), stop_(stop) {}
  void NewRequest() {
    budget_ = kMaxRequestBytes;
    deadline_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(kRequestDeadlineMs);
  }
  bool Exhausted() const { return budget_ == 0; }
  bool HasBuffered() const { return begin_ < end_; }

  bool is_readable() const override { return HasBuffered() || WaitFor(fd_, POLLIN, kReadTimeoutMs, stop_); }
  bool is_writable() const override { return WaitFor(fd_, POLLOUT, kWriteTimeoutMs, stop_); }
  ssize_t read(char* ptr, size_t size) override {
    if (budget_ == 0) return -1;
    if (!HasBuffered()) {
      // A request must arrive whole within kRequestDeadlineMs, however slowly it trickles in.
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - std::chrono::steady_clock::now());
      if (left.count() <= 0 || !WaitFor(fd_, POLLIN, std::min<int>(kReadTimeoutMs, static_cast<int>(left.count())), stop_)) {
        return -1;
      }
      ssize_t n;
      do {
        n = ::recv(fd_, buf_, sizeof buf_, 0);
      } while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      begin_ = 0;
      end_ = static_cast<size_t>(n);
    }
    const size_t n = std::min({size, end_ - begin_, budget_});
    std::memcpy(ptr, buf_ + begin_, n);
    begin_ += n;
    budget_ -= n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    ssize_t n;
    do {
      n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override { Address(true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { Address(false, ip, port); }
  socket_t socket() const override { return fd_; }

 private:
  void Address(bool peer, std::string& ip, int& port) const {
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    ip.clear();
    port = 0;
    if ((peer ? ::getpeername(fd_, reinterpret_cast<sockaddr*>(&addr), &len)
              : ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len)) != 0) {
      return;
    }
    char text[INET6_ADDRSTRLEN] = "";
    if (addr.ss_family == AF_INET) {
      const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
      inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
      port = ntohs(a->sin_port);
    } else if (addr.ss_family == AF_INET6) {
      const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
      inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof text);
      port = ntohs(a->sin6_port);
    }
    ip = text;
  }
  const int fd_;
  const std::atomic<bool>* const stop_;
  char buf_[4096];
  size_t begin_ = 0, end_ = 0;
  size_t budget_ = kMaxRequestBytes;
  std::chrono::steady_clock::time_point deadline_ = std::chrono::steady_clock::now();
};

// Idle connections (accepted, or kept alive between requests) wait here, on one epoll thread,
// rather than each holding a worker: a worker takes a connection only once it has bytes to read.
// A connection that stays idle past its deadline is closed, and so is the oldest one when more
// than kMaxParked wait.
class Parking {
 public:
  explicit Parking(std::function<void(int)> dispatch)
      : dispatch_(std::move(dispatch)), epoll_(::epoll_create1(EPOLL_CLOEXEC)), max_parked_(MaxParked()) {
    thread_ = std::thread([this] {
      SetThreadName("stoke-mon-idle");
      Loop();
    });
  }
  ~Parking() { Stop(); }
  void Park(int fd, int timeout_ms) {
    std::lock_guard lock(mu_);
    if (stopping_) return Close(fd);
    if (deadlines_.size() >= max_parked_) {
      auto oldest = std::min_element(deadlines_.begin(), deadlines_.end(),
                                     [](const auto& a, const auto& b) { return a.second < b.second; });
      ::epoll_ctl(epoll_, EPOLL_CTL_DEL, oldest->first, nullptr);
      Close(oldest->first);
      deadlines_.erase(oldest);
    }
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
    ev.data.fd = fd;
    if (::epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev) != 0) return Close(fd);
    deadlines_[fd] = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  }
  void Stop() {
    {
      std::lock_guard lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    thread_.join();
    for (const auto& [fd, deadline] : deadlines_) Close(fd);
    deadlines_.clear();
    ::close(epoll_);
  }

 private:
  static void Close(int fd) {
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
  }
  void Loop() {
    epoll_event events[64];
    while (true) {
      const int n = ::epoll_wait(epoll_, events, 64, 100);
      std::vector<int> ready;
      {
        std::lock_guard lock(mu_);
        if (stopping_) return;
        for (int i = 0; i < n; ++i) {
          const int fd = events[i].data.fd;
          if (deadlines_.erase(fd) == 0) continue;
          ::epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
          ready.push_back(fd);
        }
        const auto now = std::chrono::steady_clock::now();
        for (auto it = deadlines_.begin(); it != deadlines_.end();) {
          if (it->second > now) {
            ++it;
            continue;
          }
          ::epoll_ctl(epoll_, EPOLL_CTL_DEL, it->first, nullptr);
          Close(it->first);
          it = deadlines_.erase(it);
        }
      }
      for (int fd : ready) dispatch_(fd);  // may wait while every worker is busy: backpressure
    }
  }
  std::function<void(int)> dispatch_;
  const int epoll_;
  const size_t max_parked_;
  std::mutex mu_;
  std::map<int, std::chrono::steady_clock::time_point> deadlines_;  // parked fd -> when to close it; guarded by mu_
  bool stopping_ = false;                                            // guarded by mu_
  std::thread thread_;
};

// cpp-httplib's server with its per-connection loop replaced: keep-alive as before, but over a
// BoundedStream, and a connection with nothing to read waits in Parking instead of in a worker.
// The status of the response the current thread wrote last (cpp-httplib's logger sees every one).
thread_local int t_last_status = 0;
// Set while serving a request that came with a body (the monitor reads none): the connection is
// closed after the answer, since the unread body would be taken for the next request.
thread_local bool t_close_after = false;

class BoundedServer : public httplib::Server {
 public:
  BoundedServer() {
    set_logger([](const httplib::Request&, const httplib::Response& res) { t_last_status = res.status; });
    // cpp-httplib shuts the pool down and deletes it when its accept loop ends: on stop(), and
    // also on an accept() error other than EMFILE. Parking hands idle connections to the pool, so
    // it stops first and forgets the pool before the pool goes.
    new_task_queue = [this] {
      auto* pool = new BoundedPool(threads_, max_queued_, [this] {
        parking_.Stop();
        pool_.store(nullptr);
      });
      pool_.store(pool);
      return pool;
    };
  }
  void Configure(int threads, int max_queued) {
    threads_ = threads;
    max_queued_ = max_queued;
  }
  // Before stop(): no parked connection is handed to the pool once it is being shut down, and
  // connections still queued for a worker, or waiting on a slow client, end at once.
  void StopParking() {
    stopping_.store(true);
    parking_.Stop();
  }

 private:
  bool process_and_close_socket(socket_t sock) override {
    BoundedStream stream(sock, &stopping_);
    bool ok = true;
    for (int i = 0; i < kKeepAliveRequests && is_running() && !stopping_.load(); ++i) {
      if (!stream.HasBuffered() && !WaitFor(sock, POLLIN, 0)) {
        parking_.Park(sock, i == 0 ? kReadTimeoutMs : kKeepAliveTimeoutMs);
        return ok;
      }
      stream.NewRequest();
      bool closed = false;
      t_last_status = 0;
      t_close_after = false;
      ok = process_request(stream, i + 1 == kKeepAliveRequests, closed, nullptr);
      // After an error the rest of the connection cannot be trusted to be a request (an unread
      // body, an oversized line): close it.
      if (!ok || closed || stream.Exhausted() || t_last_status >= 400 || t_close_after) break;
    }
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return ok;
  }
  int threads_ = 8, max_queued_ = 256;
  std::atomic<bool> stopping_{false};
  std::atomic<BoundedPool*> pool_{nullptr};
  Parking parking_{[this](int fd) {
    BoundedPool* pool = pool_.load();
    if (pool == nullptr) {
      ::shutdown(fd, SHUT_RDWR);
      ::close(fd);
      return;
    }
    pool->enqueue([this, fd] { process_and_close_socket(fd); });
  }};
};

struct Run {
  std::filesystem::path dir;  // canonical
  std::string name;
};

bool ParseIndex(std::string_view text, size_t* out) {
  if (text.empty() || text.size() > 6) return false;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size();
}

std::string ContentType(const std::filesystem::path& p) {
  const std::string ext = p.extension().string();
  if (ext == ".svg") return "image/svg+xml";
  if (ext == ".png") return "image/png";
  if (ext == ".json") return "application/json";
  if (ext == ".yaml" || ext == ".jsonl" || ext == ".txt" || ext == ".log" || ext == ".csv") {
    return "text/plain; charset=utf-8";
  }
  return "application/octet-stream";
}

// pread until `want` bytes or the end of the file; the bytes read.
std::string ReadAt(int fd, int64_t from, size_t want) {
  std::string buf(want, '\0');
  size_t got = 0;
  while (got < want) {
    const ssize_t n = ::pread(fd, buf.data() + got, want - got, static_cast<off_t>(from) + static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  buf.resize(got);
  return buf;
}

std::string ReadPrefix(const RunFile& file, size_t max_bytes, bool* truncated) {
  std::string text = ReadAt(file.fd(), 0, max_bytes + 1);
  *truncated = text.size() > max_bytes;
  if (*truncated) text.resize(max_bytes);
  return text;
}

// What the page shows about one dataset named by the run's config: its manifest, or why not.
nlohmann::json DatasetSummary(const std::string& path) {
  nlohmann::json j = {{"path", path}};
  auto ds = dataset::Dataset::Open(path);
  if (!ds.ok()) {
    j["error"] = ds.status().ToString();
    return j;
  }
  const dataset::Manifest& m = ds->manifest();
  j["records"] = m.records;
  j["format_version"] = m.format_version;
  j["payload_bytes"] = m.payload_bytes;
  nlohmann::json classes = nlohmann::json::array();
  for (size_t i = 0; i < m.classes.size(); ++i) {
    classes.push_back({{"name", m.classes[i]}, {"records", i < m.class_counts.size() ? m.class_counts[i] : 0}});
  }
  j["classes"] = std::move(classes);
  // What pack skipped, when its record says.
  for (const char* key : {"skipped", "skipped_inputs", "bad_inputs"}) {
    if (m.packing.contains(key)) j["pack_skipped"] = m.packing[key];
  }
  return j;
}

nlohmann::json RunInfo(size_t id, const Run& run) {
  nlohmann::json j = {{"id", id}, {"name", run.name}, {"dir", run.dir.string()}};
  // Through OpenRunFile, as every file the page shows: a link out of the run's folder (to
  // /proc/self/environ, say) is not followed.
  const auto metrics = OpenRunFile(run.dir, "metrics.jsonl");
  j["has_metrics"] = metrics.ok();
  if (metrics.ok()) {
    struct stat st{};
    if (::fstat(metrics->fd(), &st) == 0) {
      const auto written = std::chrono::system_clock::time_point(
          std::chrono::duration_cast<std::chrono::system_clock::duration>(
              std::chrono::seconds(st.st_mtim.tv_sec) + std::chrono::nanoseconds(st.st_mtim.tv_nsec)));
      j["metrics_age_s"] = std::chrono::duration<double>(std::chrono::system_clock::now() - written).count();
    } else {
      j["metrics_age_s"] = -1.0;
    }
  }
  const auto opened_config = OpenRunFile(run.dir, "config.yaml");
  if (opened_config.ok()) {
    const std::filesystem::path& config = opened_config->path();
    bool truncated = false;
    const std::string text = ReadPrefix(*opened_config, kMaxConfigBytes, &truncated);
    j["config"] = nlohmann::json(text + (truncated ? "\n... (cut at 1 MiB)\n" : ""));
    try {
      YAML::Node root = YAML::Load(text);
      nlohmann::json datasets = nlohmann::json::object();
      if (root["data"] && root["data"]["train"]) {
        datasets["train"] = DatasetSummary(root["data"]["train"].as<std::string>());
      }
      if (root["data"] && root["data"]["val"] && !root["data"]["val"].as<std::string>().empty()) {
        datasets["val"] = DatasetSummary(root["data"]["val"].as<std::string>());
      }
      j["datasets"] = std::move(datasets);
    } catch (const std::exception& e) {
      j["config_error"] = fmt::format("{}: {}", config.string(), e.what());
    }
  }
  std::vector<std::string> files;
  for (const char* name : {"curves.svg", "config.yaml", "metrics.jsonl"}) {
    if (OpenRunFile(run.dir, name).ok()) files.emplace_back(name);
  }
  j["files"] = files;
  return j;
}

}  // namespace

Result<std::pair<std::string, int>> ParseListenAddress(std::string_view text, std::string_view default_host) {
  std::string host(default_host);
  std::string_view port_text = text;
  if (const size_t colon = text.rfind(':'); colon != std::string_view::npos) {
    host = std::string(text.substr(0, colon));
    port_text = text.substr(colon + 1);
    const bool bracketed = host.size() >= 2 && host.front() == '[' && host.back() == ']';
    if (bracketed) {
      host = host.substr(1, host.size() - 2);
    } else if (host.find(':') != std::string::npos) {
      return InvalidArgumentError(
          fmt::format("'{}': an IPv6 address goes in brackets, e.g. [::1]:8080", text));
    }
    if (host.empty()) {
      return InvalidArgumentError(fmt::format("'{}': expected [HOST:]PORT, e.g. 8080 or 127.0.0.1:8080", text));
    }
  }
  int port = -1;
  auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || end != port_text.data() + port_text.size() || port < 0 || port > 65535) {
    return InvalidArgumentError(
        fmt::format("'{}': expected [HOST:]PORT with PORT in 0..65535 (0: any free port), e.g. 8080", text));
  }
  return std::make_pair(host, port);
}

namespace {

// Why listening on host:port fails, found by trying it: the HTTP library says only that it did.
std::string WhyCannotListen(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return fmt::format("host '{}': {}", host, ::gai_strerror(rc));
  }
  std::string why = "no address to listen on";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    int on = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    const bool ok = ::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1) == 0;
    why = ok ? "it listens now: try again" : std::strerror(errno);
    ::close(fd);
    if (!ok) break;
  }
  ::freeaddrinfo(found);
  return why;
}

}  // namespace

RunFile& RunFile::operator=(RunFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    path_ = std::move(o.path_);
  }
  return *this;
}

RunFile::~RunFile() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {

// Whether the kernel's names of open descriptors can be read (/proc is mounted): without them a
// run's file is checked by its path just before it is opened, which a folder swapped for a link
// in between defeats.
bool CanNameDescriptors() {
  static const bool can = [] {
    std::error_code ec;
    const bool there = std::filesystem::is_directory("/proc/self/fd", ec);
    if (!there) {
      STOKE_LOG(WARN, "monitor: /proc/self/fd is not there (/proc not mounted?): a run's files are checked by "
                      "their path before they are opened, not as opened");
    }
    return there;
  }();
  return can;
}

}  // namespace

Result<RunFile> OpenRunFile(const std::filesystem::path& run_dir, std::string_view relative) {
  auto refuse = [&] { return NotFoundError(fmt::format("monitor: no such file in {}", run_dir.string())); };
  if (relative.empty() || relative.front() == '/' || relative.find('\0') != std::string_view::npos ||
      relative.find('\\') != std::string_view::npos) {
    return refuse();
  }
  size_t start = 0;
  while (start <= relative.size()) {
    size_t slash = relative.find('/', start);
    if (slash == std::string_view::npos) slash = relative.size();
    const std::string_view part = relative.substr(start, slash - start);
    if (part.empty() || part == "." || part == "..") return refuse();
    start = slash + 1;
  }
  // A file that stoke rewrites (config.yaml, metrics.jsonl on a resume, curves.svg) is replaced by
  // a rename: one that lands between the open and the check below makes the opened file read as
  // "... (deleted)". The next try finds the new file; a swapped link fails every try.
  constexpr int kTries = 8;
  for (int attempt = 0; attempt < kTries; ++attempt) {
    std::error_code ec;
    const auto resolved = std::filesystem::canonical(run_dir / std::filesystem::path(relative), ec);
    if (ec || !PathWithin(resolved, run_dir) || !std::filesystem::is_regular_file(resolved, ec)) return refuse();
    // O_NONBLOCK: a FIFO swapped in does not block the open (and is refused below).
    const int fd = ::open(resolved.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    if (fd < 0) continue;  // replaced meanwhile, or a link now: the next try checks the path again
    RunFile file(fd, resolved);
    struct stat st{};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (!CanNameDescriptors()) return file;  // checked by its path only (said once, at the first file)
    // What was opened, as the kernel names it: a folder of the path replaced by a link between
    // canonical() and open() took the open somewhere else, and this name says where.
    const auto opened = std::filesystem::read_symlink(fmt::format("/proc/self/fd/{}", fd), ec);
    if (!ec && opened == resolved) return file;
  }
  return refuse();
}

namespace {

// Metrics lines nest two or three levels; deeper ones are counted as malformed, before parsing
// (copying and serialising a value recurse once per level).
constexpr int kMaxMetricsDepth = 32;

}  // namespace

std::string ReadMetricsChunk(const std::filesystem::path& path, int64_t from, size_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
  if (fd < 0) return ReadMetricsChunk(nullptr, from, max_bytes);
  const RunFile file(fd, path);
  return ReadMetricsChunk(&file, from, max_bytes);
}

std::string ReadMetricsChunk(const RunFile* file, int64_t from, size_t max_bytes) {
  nlohmann::json out = {{"offset", 0}, {"size", 0}, {"file_id", ""}, {"reset", false},
                        {"records", nlohmann::json::array()}, {"malformed", 0}, {"partial", 0}};
  // One descriptor for the size, the identity and the bytes: a file replaced meanwhile (a resume
  // rewrites it) cannot give one file's size and another's lines.
  struct stat st{};
  if (file == nullptr || ::fstat(file->fd(), &st) != 0 || !S_ISREG(st.st_mode)) {
    out["exists"] = false;
    return out.dump();
  }
  const int fd = file->fd();
  out["exists"] = true;
  const auto size = static_cast<int64_t>(st.st_size);
  out["size"] = size;
  out["file_id"] = fmt::format("{}:{}", st.st_dev, st.st_ino);
  if (from < 0 || from > size) {
    out["reset"] = true;
    from = 0;
  }
  const auto want = static_cast<size_t>(std::min<int64_t>(size - from, static_cast<int64_t>(max_bytes)));
  const std::string buf = ReadAt(fd, from, want);
  int64_t malformed = 0, consumed = 0;
  auto& records = out["records"];
  size_t pos = 0;
  while (pos < buf.size()) {
    const size_t nl = buf.find('\n', pos);
    if (nl == std::string::npos) break;
    const std::string_view line(buf.data() + pos, nl - pos);
    if (!line.empty()) {
      auto j = NestingDepth(line) <= kMaxMetricsDepth ? nlohmann::json::parse(line, nullptr, false)
                                                      : nlohmann::json(nlohmann::json::value_t::discarded);
      if (j.is_object()) {
        records.push_back(std::move(j));
      } else {
        ++malformed;
      }
    }
    pos = nl + 1;
    consumed = static_cast<int64_t>(pos);
  }
  if (consumed == 0 && buf.size() == max_bytes && max_bytes > 0) {
    // One line longer than a whole chunk: no metrics line is that long. Skip it as malformed.
    int64_t at = from + static_cast<int64_t>(buf.size());
    while (at < size) {
      const std::string more = ReadAt(fd, at, 1 << 16);
      if (more.empty()) break;
      const size_t nl = more.find('\n');
      if (nl != std::string::npos) {
        consumed = at + static_cast<int64_t>(nl) + 1 - from;
        ++malformed;
        break;
      }
      at += static_cast<int64_t>(more.size());
    }
  }
  out["offset"] = from + consumed;
  out["malformed"] = malformed;
  // Bytes after the last complete line, when this answer reached the end of the file: a line
  // still being written (or cut short for good). Before the end, the rest is simply more to read.
  const bool at_end = from + static_cast<int64_t>(buf.size()) >= size;
  out["partial"] = at_end ? size - (from + consumed) : 0;
  return out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

struct Monitor::State {
  MonitorOptions options;
  std::vector<Run> runs;
  BoundedServer server;
  std::thread listener;
  int port = 0;
  int listen_fd = -1;
  std::atomic<int64_t> requests{0}, not_found{0}, refused{0};
  std::once_flag stopped;
  std::atomic<bool> stopping{false};  // Stop() began: the listener's end is expected
  bool loopback = false;              // listening on a loopback address only (HostAllowed)
  std::string bound;                  // the address listened on, numeric (getsockname), for url()

  // Listening on a loopback address, only requests for a loopback name are answered: a web page
  // elsewhere could otherwise point a name of its own at 127.0.0.1 (DNS rebinding) and read the
  // runs through the visitor's browser. Without a Host header (HTTP/1.0), answered.
  bool HostAllowed(const httplib::Request& req) const {
    if (!loopback) return true;
    if (!req.has_header("Host")) return true;
    std::string host = req.get_header_value("Host");
    std::string port;
    if (!host.empty() && host.front() == '[') {
      const size_t close = host.find(']');
      if (close == std::string::npos) return false;
      port = host.substr(close + 1);
      host = host.substr(1, close - 1);
    } else if (const size_t colon = host.find(':'); colon != std::string::npos) {
      port = host.substr(colon);
      host = host.substr(0, colon);
    }
    // Nothing after the name but ":PORT".
    if (!port.empty() && (port.size() < 2 || port[0] != ':' ||
                          !std::all_of(port.begin() + 1, port.end(), [](char c) { return c >= '0' && c <= '9'; }))) {
      return false;
    }
    std::transform(host.begin(), host.end(), host.begin(), [](unsigned char c) { return std::tolower(c); });
    if (!host.empty() && host.back() == '.') host.pop_back();
    // Browsers resolve every *.localhost to loopback themselves: no other machine can answer for it.
    return host == "localhost" || host.ends_with(".localhost") || host == options.host || IsLoopbackAddress(host);
  }
  // Where the listening socket is bound, as the kernel says, whatever name or spelling was given
  // for it (127.1, LOCALHOST, a name that resolves to loopback): the address, numeric, and whether
  // it is loopback or every interface. False when it cannot be asked.
  bool LearnBoundAddress(bool* any) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    if (listen_fd < 0 || ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return false;
    char text[NI_MAXHOST] = {};
    if (::getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, text, sizeof text, nullptr, 0, NI_NUMERICHOST) != 0) {
      return false;
    }
    bound = text;
    if (ss.ss_family == AF_INET) {
      *any = reinterpret_cast<const sockaddr_in&>(ss).sin_addr.s_addr == htonl(INADDR_ANY);
    } else {
      *any = IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6&>(ss).sin6_addr);
    }
    loopback = IsLoopbackAddress(bound);
    return true;
  }

  // 127.0.0.0/8, ::1 however written, and IPv4-mapped 127.x (::ffff:127.0.0.1).
  static bool IsLoopbackAddress(const std::string& text) {
    in_addr a4{};
    if (::inet_pton(AF_INET, text.c_str(), &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
    in6_addr a6{};
    if (::inet_pton(AF_INET6, text.c_str(), &a6) != 1) return false;
    return IN6_IS_ADDR_LOOPBACK(&a6) || (IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127);
  }

  void NotFound(httplib::Response& res) {
    not_found++;
    res.status = 404;
    res.set_content("404 not found\n", "text/plain; charset=utf-8");
  }

  void Serve(const httplib::Request& req, httplib::Response& res) {
    requests++;
    res.set_header("X-Content-Type-Options", "nosniff");
    res.set_header("Cache-Control", "no-store");
    res.set_header("Referrer-Policy", "no-referrer");
    if (req.method != "GET" && req.method != "HEAD") {
      refused++;
      res.status = 405;
      res.set_header("Allow", "GET, HEAD");
      res.set_content("405 read-only: GET and HEAD only\n", "text/plain; charset=utf-8");
      return;
    }
    size_t header_bytes = 0;
    for (const auto& [k, v] : req.headers) header_bytes += k.size() + v.size() + 4;
    if (req.headers.size() > kMaxHeaderLines || header_bytes > kMaxHeaderBytes) {
      refused++;
      res.status = 431;
      res.set_content("431 too many request headers\n", "text/plain; charset=utf-8");
      return;
    }
    const std::string& path = req.path;
    if (path == "/" || path == "/index.html") {
      res.set_header("Content-Security-Policy",
                     "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                     "connect-src 'self'");
      res.set_content(std::string(PageHtml()), "text/html; charset=utf-8");
      return;
    }
    if (path == "/app.js") return res.set_content(std::string(AppJs()), "text/javascript; charset=utf-8");
    if (path == "/chart.js") return res.set_content(std::string(ChartJs()), "text/javascript; charset=utf-8");
    if (path == "/api/runs") {
      nlohmann::json j = {{"poll_ms", options.poll_ms}, {"runs", nlohmann::json::array()}};
      for (size_t i = 0; i < runs.size(); ++i) j["runs"].push_back(RunInfo(i, runs[i]));
      return res.set_content(j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                             "application/json");
    }
    constexpr std::string_view kApi = "/api/runs/", kFiles = "/runs/";
    if (path.starts_with(kApi)) {
      const std::string_view rest = std::string_view(path).substr(kApi.size());
      const size_t slash = rest.find('/');
      size_t id = 0;
      if (slash == std::string_view::npos || !ParseIndex(rest.substr(0, slash), &id) || id >= runs.size() ||
          rest.substr(slash) != "/metrics") {
        return NotFound(res);
      }
      int64_t from = 0;
      if (req.has_param("from")) {
        const std::string f = req.get_param_value("from");
        auto [end, ec] = std::from_chars(f.data(), f.data() + f.size(), from);
        if (ec != std::errc() || end != f.data() + f.size()) {
          res.status = 400;
          return res.set_content("400 from: expected a byte offset\n", "text/plain; charset=utf-8");
        }
      }
      // A metrics file that resolves out of the run's folder reads as absent.
      const auto metrics = OpenRunFile(runs[id].dir, "metrics.jsonl");
      return res.set_content(ReadMetricsChunk(metrics.ok() ? &*metrics : nullptr, from, kMaxMetricsChunk),
                             "application/json");
    }
    if (path.starts_with(kFiles)) {
      const std::string_view rest = std::string_view(path).substr(kFiles.size());
      const size_t slash = rest.find('/');
      size_t id = 0;
      if (slash == std::string_view::npos || !ParseIndex(rest.substr(0, slash), &id) || id >= runs.size()) {
        return NotFound(res);
      }
      auto opened = OpenRunFile(runs[id].dir, rest.substr(slash + 1));
      if (!opened.ok()) return NotFound(res);
      struct stat st{};
      if (::fstat(opened->fd(), &st) != 0) return NotFound(res);
      // Files of a run are data, never a page: no scripts, whatever they hold.
      res.set_header("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; sandbox");
      auto file = std::make_shared<RunFile>(std::move(*opened));
      res.set_content_provider(
          static_cast<size_t>(st.st_size), ContentType(file->path()),
          [file](size_t offset, size_t length, httplib::DataSink& sink) {
            const std::string buf = ReadAt(file->fd(), static_cast<int64_t>(offset), std::min<size_t>(length, 64 << 10));
            if (buf.empty()) return false;  // the file shrank under us: end the response
            return sink.write(buf.data(), buf.size());
          });
      return;
    }
    NotFound(res);
  }
};

Monitor::Monitor(std::unique_ptr<State> state) : state_(std::move(state)) {}

Monitor::~Monitor() { Stop(); }

Result<std::unique_ptr<Monitor>> Monitor::Start(MonitorOptions options) {
  if (options.run_dirs.empty()) return InvalidArgumentError("monitor: give at least one run directory");
  if (options.threads < 1 || options.max_queued < 1) {
    return InvalidArgumentError("monitor: threads and max_queued must be at least 1");
  }
  auto state = std::make_unique<State>();
  std::map<std::string, int> names;
  for (const std::string& dir : options.run_dirs) {
    std::error_code ec;
    const auto kind = std::filesystem::status(dir, ec).type();
    if (kind == std::filesystem::file_type::not_found) {
      return NotFoundError(fmt::format("monitor: {}: no such folder; give a run directory (a config's run_dir)", dir));
    }
    if (kind != std::filesystem::file_type::directory) {
      return InvalidArgumentError(fmt::format(
          "monitor: {}: not a folder; give a run directory (a config's run_dir, the folder that holds its "
          "metrics.jsonl), not a file",
          dir));
    }
    if (options.warn_empty_runs && !std::filesystem::exists(std::filesystem::path(dir) / "metrics.jsonl", ec) &&
        !std::filesystem::exists(std::filesystem::path(dir) / "config.yaml", ec)) {
      // A run about to start is served as it begins; a wrong folder shows an empty card: said here.
      STOKE_LOG(WARN, "monitor: {} holds no metrics.jsonl or config.yaml (no run has written there yet); its card "
                "stays empty until one does", dir);
    }
    Run run{std::filesystem::canonical(dir, ec), ""};
    if (ec) return NotFoundError(fmt::format("monitor: {}: {}", dir, ec.message()));
    run.name = run.dir.filename().string();
    if (run.name.empty()) run.name = run.dir.string();
    if (const int seen = names[run.name]++; seen > 0) run.name += fmt::format(" ({})", seen + 1);
    state->runs.push_back(std::move(run));
  }
  if (options.host.empty()) {
    return InvalidArgumentError("monitor: the host to listen on is empty; give an address, e.g. 127.0.0.1 (this "
                                "machine only) or 0.0.0.0 (every interface)");
  }
  state->options = std::move(options);
  const MonitorOptions& o = state->options;
  BoundedServer& svr = state->server;
  State* s = state.get();
  svr.Configure(o.threads, MaxQueued(o.max_queued));
  svr.set_socket_options([s](int fd) {
    int on = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    s->listen_fd = fd;
  });
  svr.set_payload_max_length(1024);
  svr.set_pre_routing_handler([s](const httplib::Request& req, httplib::Response& res) {
    const std::string length = req.get_header_value("Content-Length");
    t_close_after = req.has_header("Transfer-Encoding") || (!length.empty() && length != "0");
    if (t_close_after) res.set_header("Connection", "close");
    // Every answer is whole: byte ranges are not served (the HTTP library's answers to some of
    // them are malformed), and a client asking for one gets the whole file with 200, as HTTP allows.
    const_cast<httplib::Request&>(req).ranges.clear();  // the server's own Request, not a constant
    // Said as such: the library would advertise "bytes" on answers to HEAD (not on GET's).
    res.set_header("Accept-Ranges", "none");
    // gzip at most: the library compresses with brotli at its highest quality when asked (browsers
    // ask even over loopback), which cost seconds of CPU per metrics answer inside the trainer.
    auto& headers = const_cast<httplib::Headers&>(req.headers);
    const bool gzip = req.get_header_value("Accept-Encoding").find("gzip") != std::string::npos;
    headers.erase("Accept-Encoding");
    if (gzip) headers.emplace("Accept-Encoding", "gzip");
    if (!s->HostAllowed(req)) {
      s->refused++;
      res.status = 403;
      res.set_content(fmt::format("403 this monitor answers requests for {} only, not for Host: {}\n",
                                  s->bound.find(':') != std::string::npos ? "[" + s->bound + "]"
                                                                          : s->bound + " or localhost",
                                  req.get_header_value("Host")),
                      "text/plain; charset=utf-8");
      return httplib::Server::HandlerResponse::Handled;
    }
    try {
      s->Serve(req, res);
    } catch (const std::exception& e) {
      res.status = 500;
      res.set_content(fmt::format("500 {}\n", e.what()), "text/plain; charset=utf-8");
    }
    return httplib::Server::HandlerResponse::Handled;
  });
  svr.set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (res.body.empty()) res.set_content(fmt::format("{} error\n", res.status), "text/plain; charset=utf-8");
  });
  const bool bound = o.port == 0 ? (s->port = svr.bind_to_any_port(o.host)) > 0 : svr.bind_to_port(o.host, o.port);
  if (!bound) {
    return UnavailableError(
        fmt::format("monitor: cannot listen on {}:{}: {}", o.host, o.port, WhyCannotListen(o.host, o.port)));
  }
  if (o.port != 0) s->port = o.port;
  // Loopback or not is decided by the address bound, not by how it was written: "127.1" or a name
  // for 127.0.0.1 once turned the Host check off.
  bool any = false;
  if (!s->LearnBoundAddress(&any)) {
    s->bound = o.host;
    s->loopback = o.host == "localhost" || State::IsLoopbackAddress(o.host);
  }
  if (any) {
    STOKE_LOG(WARN, "monitor: listening on every interface ({} port {}): whoever can reach this machine can read "
              "the runs' files (no authentication)", s->bound, s->port);
  }
  // cpp-httplib listens with a backlog of 5; a page, its scripts and a few hundred clients need more.
  if (s->listen_fd >= 0) ::listen(s->listen_fd, kListenBacklog);
  state->listener = std::thread([s] {
    SetThreadName("stoke-monitor");
    s->server.listen_after_bind();
    if (!s->stopping.load()) {
      // cpp-httplib leaves its accept loop on any accept() error but EMFILE (ENFILE, ENOMEM, ...).
      STOKE_LOG(WARN, "monitor: {}:{} stopped accepting connections (an accept() error other than 'too many open "
                "files' ends cpp-httplib's loop); the run goes on without its page", s->options.host, s->port);
    }
  });
  // stop() only reaches a server that has started listening: wait for that before returning.
  for (int i = 0; i < 5000 && !state->server.is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return std::unique_ptr<Monitor>(new Monitor(std::move(state)));
}

void Monitor::Stop() {
  if (!state_) return;
  std::call_once(state_->stopped, [&] {
    state_->stopping.store(true);
    state_->server.StopParking();
    state_->server.stop();
    if (state_->listener.joinable()) state_->listener.join();
  });
}

int Monitor::port() const { return state_->port; }

std::string Monitor::url() const {
  const std::string& h = state_->bound;
  return h.find(':') != std::string::npos ? fmt::format("http://[{}]:{}/", h, port())
                                          : fmt::format("http://{}:{}/", h, port());
}

MonitorStats Monitor::stats() const {
  return {state_->requests.load(), state_->not_found.load(), state_->refused.load()};
}

}  // namespace stoke::monitor
