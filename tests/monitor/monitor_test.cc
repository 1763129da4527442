// The monitor's server, over real sockets: what it serves, what it refuses (traversal, absolute
// paths, symlinks out of a run, other methods, oversized requests), metrics files that are
// malformed or cut short, and 200 clients at once. Also TensorBoard's record framing.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <map>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/testing/test_util.h"
#include "tools/monitor/assets.h"
#include "tools/monitor/monitor.h"
#include "train/tensorboard.h"

namespace stoke::monitor {

void WriteText(const std::filesystem::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
}

struct Reply {
  int status = 0;  // 0: no answer (connection closed or failed)
  std::string head, body;
};

// A socket connected to 127.0.0.1:port, or -1.
int ConnectLoopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Sends `request` as it is (no normalisation of the path) and reads until the server closes.
Reply Send(int port, const std::string& request) {
  Reply r;
  const int fd = ConnectLoopback(port);
  if (fd < 0) return r;
  timeval tv{30, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may stop reading an oversized request and answer at once
    sent += static_cast<size_t>(n);
  }
  std::string all;
  char buf[65536];
  while (true) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    all.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  const size_t split = all.find("\r\n\r\n");
  if (all.rfind("HTTP/1.1 ", 0) != 0 || split == std::string::npos) return r;
  r.status = std::stoi(all.substr(9, 3));
  r.head = all.substr(0, split);
  r.body = all.substr(split + 4);
  return r;
}

Reply Get(int port, const std::string& target) {
  return Send(port, fmt::format("GET {} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", target));
}

namespace {

class MonitorServer : public ::testing::Test {
 protected:
  void SetUp() override {
    run_ = dir_.path() / "run-a";
    std::filesystem::create_directories(run_ / "sub");
    WriteText(run_ / "config.yaml", "data:\n  train: /nonexistent/train.lmdb\nepochs: 2\n");
    WriteText(run_ / "sub" / "note.txt", "inside\n");
    WriteText(dir_.path() / "secret.txt", "outside\n");
    std::filesystem::create_directories(dir_.path() / "run-ab");
    WriteText(dir_.path() / "run-ab" / "x.txt", "sibling\n");
    std::filesystem::create_symlink(dir_.path() / "secret.txt", run_ / "link-out");
    std::filesystem::create_symlink("../run-ab/x.txt", run_ / "link-sibling");
    std::filesystem::create_symlink("sub/note.txt", run_ / "link-in");
    WriteText(run_ / "metrics.jsonl",
              R"({"type":"start","step":0,"total_steps":20,"steps_per_epoch":10,"epochs":2,"time":100.0})"
              "\n"
              R"({"type":"train","step":5,"loss":2.5,"top1":0.1,"lr":0.1,"images_per_s":900,"data_wait":0.01,"time":101.0})"
              "\n"
              "{not json at all\n"
              R"({"type":"train","step":10,"loss":2.0,"top1":0.2,"lr":0.1,"images_per_s":950,"data_wait":0.02,"time":102.0})"
              "\n"
              R"({"type":"val","step":10,"loss":1.9,"top1":0.3,"top5":0.8,"time":103.0})"
              "\n"
              R"({"type":"train","step":15,"lo)");  // cut short: a writer mid-line, or a crash
    ASSERT_OK_AND_ASSIGN(monitor_, Monitor::Start({.run_dirs = {run_.string()}, .port = 0, .threads = 4,
                                                   .max_queued = 64}));
    port_ = monitor_->port();
    ASSERT_GT(port_, 0);
  }

  testing::TempDir dir_;
  std::filesystem::path run_;
  std::unique_ptr<Monitor> monitor_;
  int port_ = 0;
};

TEST_F(MonitorServer, ServesThePageItsScriptsAndTheRuns) {
  Reply page = Get(port_, "/");
  ASSERT_EQ(page.status, 200);
  EXPECT_NE(page.body.find("stoke monitor"), std::string::npos);
  EXPECT_NE(page.head.find("Content-Security-Policy"), std::string::npos);
  Reply chart = Get(port_, "/chart.js");
  ASSERT_EQ(chart.status, 200);
  EXPECT_EQ(chart.body.size(), ChartJs().size());
  EXPECT_NE(chart.body.find("Chart"), std::string::npos);
  EXPECT_EQ(Get(port_, "/app.js").body, std::string(AppJs()));

  Reply runs = Get(port_, "/api/runs");
  ASSERT_EQ(runs.status, 200);
  auto j = nlohmann::json::parse(runs.body);
  ASSERT_EQ(j["runs"].size(), 1u);
  EXPECT_EQ(j["runs"][0]["name"], "run-a");
  EXPECT_NE(j["runs"][0]["config"].get<std::string>().find("epochs: 2"), std::string::npos);
  // The dataset it names does not exist: said, not fatal.
  EXPECT_NE(j["runs"][0]["datasets"]["train"]["error"].get<std::string>().find("/nonexistent/train.lmdb"),
            std::string::npos);
  Reply file = Get(port_, "/runs/0/sub/note.txt");
  EXPECT_EQ(file.status, 200);
  EXPECT_EQ(file.body, "inside\n");
  EXPECT_EQ(Get(port_, "/runs/0/link-in").body, "inside\n");  // a symlink that stays inside
}

TEST_F(MonitorServer, RefusesEverythingOutsideTheRuns) {
  for (const char* target :
       {"/runs/0/../secret.txt", "/runs/0/%2e%2e/secret.txt", "/runs/0/..%2fsecret.txt", "/runs/0//etc/passwd",
        "/runs/0/%2fetc%2fpasswd", "/runs/0/link-out", "/runs/0/link-sibling", "/runs/0/sub", "/runs/0/",
        "/runs/0/./config.yaml", "/runs/1/config.yaml", "/runs/-1/config.yaml", "/runs/00000000001/x",
        "/runs/0/sub/../config.yaml", "/etc/passwd", "/../../etc/passwd", "/api/runs/1/metrics",
        "/api/runs/0/other", "/runs/0/config.yaml%00.txt", "/nothing"}) {
    Reply r = Get(port_, target);
    EXPECT_EQ(r.status, 404) << target;
    EXPECT_EQ(r.body.find("outside"), std::string::npos) << target;
    EXPECT_EQ(r.body.find("sibling"), std::string::npos) << target;
    EXPECT_EQ(r.body.find("root:"), std::string::npos) << target;
  }
  // Read-only.
  for (const char* method : {"POST", "PUT", "DELETE", "PATCH"}) {
    Reply r = Send(port_, fmt::format("{} /runs/0/config.yaml HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n"
                                      "Connection: close\r\n\r\nhi",
                                      method));
    EXPECT_EQ(r.status, 405) << method;
  }
  EXPECT_GE(monitor_->stats().not_found, 20);
}

// A folder of the path swapped for a link out of the run between the server's check of the path
// and its open: the file is checked as opened, so the outside file is never served. (Checking the
// path and then opening it by name served "outside" within the first hundred requests here.)
TEST_F(MonitorServer, AFolderSwappedForALinkOutMeanwhileIsNeverFollowed) {
  const std::filesystem::path outside = dir_.path() / "elsewhere";
  std::filesystem::create_directories(outside);
  WriteText(outside / "note.txt", "outside\n");
  // "sub" is in turn the real folder (renamed in from "sub-real") and a link to the folder outside.
  std::filesystem::rename(run_ / "sub", run_ / "sub-real");
  std::atomic<bool> done{false};
  std::thread swapper([&] {
    while (!done.load()) {
      std::error_code ec;
      std::filesystem::rename(run_ / "sub-real", run_ / "sub", ec);
      std::this_thread::yield();
      std::filesystem::rename(run_ / "sub", run_ / "sub-real", ec);
      std::filesystem::create_symlink(outside, run_ / "sub", ec);
      std::this_thread::yield();
      std::filesystem::remove(run_ / "sub", ec);
    }
  });
  int inside = 0, refused = 0, leaked = 0;
  for (int i = 0; i < 3000 && leaked == 0; ++i) {
    const Reply r = Get(port_, "/runs/0/sub/note.txt");
    if (r.body.find("outside") != std::string::npos) {
      ++leaked;
    } else if (r.status == 200) {
      EXPECT_EQ(r.body, "inside\n");
      ++inside;
    } else {
      EXPECT_EQ(r.status, 404);
      ++refused;
    }
  }
  done = true;
  swapper.join();
  EXPECT_EQ(leaked, 0) << "served the file outside the run (" << inside << " inside, " << refused << " refused before)";
  EXPECT_GT(inside, 0) << "the swaps left the folder in place too rarely to test anything";
}

// stoke rewrites a run's files by renaming a new copy over them (WriteFileAtomic): a rename
// between the server's open and its check of what it opened must not make the file look absent.
TEST_F(MonitorServer, FilesReplacedByRenameWhileServedAreStillServed) {
  WriteText(run_ / "curves.svg", "<svg/>\n");
  const std::string metrics = R"({"type":"start","step":0,"total_steps":20,"time":100.0})" "\n";
  WriteText(run_ / "metrics.jsonl", metrics);
  std::atomic<bool> done{false};
  std::thread writer([&] {
    for (int i = 0; !done.load(); ++i) {
      std::error_code ec;
      WriteText(run_ / ".curves.tmp", "<svg/>\n");
      std::filesystem::rename(run_ / ".curves.tmp", run_ / "curves.svg", ec);
      WriteText(run_ / ".metrics.tmp", metrics);
      std::filesystem::rename(run_ / ".metrics.tmp", run_ / "metrics.jsonl", ec);
    }
  });
  int file_missing = 0, metrics_missing = 0, listed_short = 0;
  for (int i = 0; i < 600; ++i) {
    const Reply file = Get(port_, "/runs/0/curves.svg");
    file_missing += file.status != 200 || file.body != "<svg/>\n";
    const Reply chunk = Get(port_, "/api/runs/0/metrics");
    metrics_missing += chunk.status != 200 || nlohmann::json::parse(chunk.body).value("exists", false) != true;
    if (i % 10 == 0) {
      const auto runs = nlohmann::json::parse(Get(port_, "/api/runs").body);
      listed_short += runs["runs"][0]["files"].size() != 3 || runs["runs"][0]["has_metrics"] != true;
    }
  }
  done = true;
  writer.join();
  EXPECT_EQ(file_missing, 0) << "of 600 downloads";
  EXPECT_EQ(metrics_missing, 0) << "of 600 metrics reads";
  EXPECT_EQ(listed_short, 0) << "of 60 run listings";
}

TEST_F(MonitorServer, OversizedRequestsAreRefusedAndServingGoesOn) {
  // A request line over 8 KiB, a large body, too many header lines, endless header bytes.
  EXPECT_EQ(Get(port_, "/" + std::string(9000, 'a')).status, 414);
  Reply body = Send(port_, "POST /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\nConnection: close\r\n\r\n" +
                               std::string(100000, 'b'));
  EXPECT_EQ(body.status, 405);  // refused before its body is read
  std::string many = "GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  for (int i = 0; i < 150; ++i) many += fmt::format("X-Header-{}: {}\r\n", i, i);
  EXPECT_EQ(Send(port_, many + "\r\n").status, 431);
  std::string flood = "GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n";
  for (int i = 0; i < 2000; ++i) flood += fmt::format("X-Flood-{}: {}\r\n", i, std::string(1000, 'c'));
  EXPECT_EQ(Send(port_, flood + "\r\n").status, 400);  // stopped reading at 80 KiB
  EXPECT_EQ(Get(port_, "/api/runs").status, 200);
}

TEST_F(MonitorServer, MalformedAndTruncatedMetricsAreSkippedAndCounted) {
  Reply r = Get(port_, "/api/runs/0/metrics?from=0");
  ASSERT_EQ(r.status, 200);
  auto j = nlohmann::json::parse(r.body);
  EXPECT_EQ(j["records"].size(), 4u);
  EXPECT_EQ(j["malformed"], 1);
  EXPECT_EQ(j["records"][3]["type"], "val");
  const int64_t size = j["size"];
  const int64_t offset = j["offset"];
  EXPECT_EQ(j["partial"], size - offset);  // the cut line is not consumed: it may still be finished
  EXPECT_GT(j["partial"].get<int64_t>(), 0);

  // The writer finishes the line and adds another: the next poll returns just those.
  {
    std::ofstream out(run_ / "metrics.jsonl", std::ios::app);
    out << R"(ss":1.5,"top1":0.4,"time":104.0})" << "\n" << R"({"type":"end","step":20,"stopped":false})" << "\n";
  }
  auto next = nlohmann::json::parse(Get(port_, fmt::format("/api/runs/0/metrics?from={}", offset)).body);
  ASSERT_EQ(next["records"].size(), 2u);
  EXPECT_EQ(next["records"][0]["step"], 15);
  EXPECT_EQ(next["records"][1]["type"], "end");
  EXPECT_EQ(next["malformed"], 0);
  EXPECT_EQ(next["offset"], next["size"]);

  // Truncated below the client's offset (a resume rewrote it): the answer says start again.
  WriteText(run_ / "metrics.jsonl", R"({"type":"train","step":1,"loss":3})" "\n");
  auto reset = nlohmann::json::parse(Get(port_, fmt::format("/api/runs/0/metrics?from={}", offset)).body);
  EXPECT_TRUE(reset["reset"].get<bool>());
  ASSERT_EQ(reset["records"].size(), 1u);
  EXPECT_EQ(reset["records"][0]["step"], 1);
  EXPECT_EQ(Get(port_, "/api/runs/0/metrics?from=abc").status, 400);

  // Binary garbage and an empty file are lines that are not JSON, never a crash.
  std::string garbage(5000, '\0');
  for (size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<char>((i * 131) % 256);
  WriteText(run_ / "metrics.jsonl", garbage + "\n");
  auto g = nlohmann::json::parse(Get(port_, "/api/runs/0/metrics?from=0").body);
  EXPECT_EQ(g["records"].size(), 0u);
  EXPECT_GE(g["malformed"].get<int>(), 1);
  std::filesystem::remove(run_ / "metrics.jsonl");
  auto gone = nlohmann::json::parse(Get(port_, "/api/runs/0/metrics?from=0").body);
  EXPECT_FALSE(gone["exists"].get<bool>());
}

TEST_F(MonitorServer, TwoHundredConcurrentClients) {
  // 200 idle connections held open, then 200 clients at once: every one is answered in full.
  std::vector<int> idle;
  for (int i = 0; i < 200; ++i) {
    const int fd = ConnectLoopback(port_);
    ASSERT_GE(fd, 0);
    idle.push_back(fd);
  }
  std::atomic<int> ok{0}, complete{0};
  std::vector<std::thread> clients;
  for (int i = 0; i < 200; ++i) {
    clients.emplace_back([&, i] {
      Reply r = Get(port_, i % 2 ? "/chart.js" : "/api/runs/0/metrics?from=0");
      if (r.status == 200) ok++;
      if (i % 2 == 1 && r.body.size() == ChartJs().size()) complete++;
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(ok.load(), 200);
  EXPECT_EQ(complete.load(), 100);
  for (int fd : idle) ::close(fd);
  EXPECT_EQ(Get(port_, "/api/runs").status, 200);
}

TEST_F(MonitorServer, ABodyEndsTheConnectionAndRangesGetTheWholeFile) {
  // A GET with a body: answered, then the connection closed, so the body is never read as the next
  // request (which would get a 400, or worse, be answered as someone else's request).
  Reply r = Send(port_,
                 "GET /app.js HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\nhello"
                 "GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body.find("HTTP/1.1 400"), std::string::npos);
  EXPECT_EQ(r.body.find("HTTP/1.1"), std::string::npos) << "one answer, then the connection closed";
  // Byte ranges, in range, out of range or several: the whole file with 200.
  for (const char* range : {"bytes=0-3", "bytes=60000000-", "bytes=0-,0-", "bytes=-0"}) {
    SCOPED_TRACE(range);
    Reply f = Send(port_, fmt::format("GET /runs/0/config.yaml HTTP/1.1\r\nHost: 127.0.0.1\r\nRange: {}\r\n"
                                      "Connection: close\r\n\r\n",
                                      range));
    EXPECT_EQ(f.status, 200);
    EXPECT_EQ(f.body, "data:\n  train: /nonexistent/train.lmdb\nepochs: 2\n");
  }
  // HEAD answers as GET does, and neither offers ranges (HEAD said "Accept-Ranges: bytes").
  const Reply head = Send(port_, "HEAD /runs/0/config.yaml HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  const Reply get = Get(port_, "/runs/0/config.yaml");
  EXPECT_EQ(head.status, 200);
  EXPECT_NE(head.head.find("Accept-Ranges: none"), std::string::npos) << head.head;
  EXPECT_NE(get.head.find("Accept-Ranges: none"), std::string::npos) << get.head;
}

// The HTTP library leaves its accept loop on an accept() error other than EMFILE and deletes the
// worker pool; an idle kept-alive connection that then sent a request was handed to the deleted
// pool (a use after free, found under valgrind). Shutting the listening socket down for reading
// makes accept() fail with EINVAL: the same path, without fault injection.
TEST(MonitorRuns, AnAcceptLoopThatEndsLeavesNoConnectionToADeletedPool) {
  testing::TempDir dir;
  const auto run = dir.path() / "run";
  std::filesystem::create_directories(run);
  WriteText(run / "config.yaml", "epochs: 1\n");
  ASSERT_OK_AND_ASSIGN(auto monitor, Monitor::Start({.run_dirs = {run.string()}, .port = 0}));
  // A kept-alive connection, answered once and then idle (parked).
  const int conn = ConnectLoopback(monitor->port());
  ASSERT_GE(conn, 0);
  timeval tv{10, 0};
  setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  const std::string request = "GET /runs/0/config.yaml HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  ASSERT_EQ(::send(conn, request.data(), request.size(), MSG_NOSIGNAL), static_cast<ssize_t>(request.size()));
  char buf[4096];
  std::string first;
  while (first.find("epochs: 1\n") == std::string::npos) {
    const ssize_t n = ::recv(conn, buf, sizeof buf, 0);
    ASSERT_GT(n, 0) << first;
    first.append(buf, static_cast<size_t>(n));
  }
  // The server's listening socket: the one bound to its port that accepts connections.
  int listening = -1;
  for (int fd = 3; fd < 4096 && listening < 0; ++fd) {
    sockaddr_in bound{};
    socklen_t len = sizeof bound;
    int accepts = 0;
    socklen_t accepts_len = sizeof accepts;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0 && bound.sin_family == AF_INET &&
        ntohs(bound.sin_port) == monitor->port() &&
        ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &accepts, &accepts_len) == 0 && accepts == 1) {
      listening = fd;
    }
  }
  ASSERT_GE(listening, 0);
  ASSERT_EQ(::shutdown(listening, SHUT_RD), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the accept loop ends
  // The idle connection was closed with the pool, not handed to it.
  ::send(conn, request.data(), request.size(), MSG_NOSIGNAL);
  std::string rest;
  ssize_t last = 0;
  while ((last = ::recv(conn, buf, sizeof buf, 0)) > 0) rest.append(buf, static_cast<size_t>(last));
  EXPECT_EQ(rest, "");
  EXPECT_EQ(last, 0) << "closed at once, not left to time out (the request went to the deleted pool)";
  ::close(conn);
  monitor->Stop();  // and stopping afterwards neither hangs nor crashes
}

// Idle connections hold at most a quarter of the process's descriptors: 1,200 of them ended a
// training run ("Too many open files") under the usual limit of 1,024, since the monitor shares
// the trainer's process.
TEST(MonitorRuns, IdleConnectionsLeaveTheTrainerItsDescriptors) {
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  if (old.rlim_max != RLIM_INFINITY && old.rlim_max < 512) GTEST_SKIP() << "the hard limit is below 512";
  rlimit low = old;
  low.rlim_cur = 512;  // an eighth: 64 idle connections
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  struct Restore {
    rlimit limit;
    ~Restore() { ::setrlimit(RLIMIT_NOFILE, &limit); }
  } restore{old};
  testing::TempDir dir;
  const auto run = dir.path() / "run";
  std::filesystem::create_directories(run);
  ASSERT_OK_AND_ASSIGN(auto monitor, Monitor::Start({.run_dirs = {run.string()}, .port = 0}));
  std::vector<int> clients;
  for (int i = 0; i < 200; ++i) {
    const int fd = ConnectLoopback(monitor->port());
    ASSERT_GE(fd, 0);
    clients.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // accepted and parked (5 s before idle ones close)
  int closed = 0;
  for (int fd : clients) {
    char c;
    if (::recv(fd, &c, 1, MSG_DONTWAIT) == 0) ++closed;
    ::close(fd);
  }
  EXPECT_GE(closed, 200 - 64 - 4) << "idle connections beyond an eighth of 512 descriptors are closed";
  EXPECT_EQ(Get(monitor->port(), "/api/runs").status, 200);
}

// Slow clients (a byte now and then) once held Stop(), and so the trainer's exit, for minutes:
// each connection queued for a worker was still served, each for its full 10 s deadline.
TEST(MonitorRuns, SlowClientsDoNotHoldTheStop) {
  testing::TempDir dir;
  const auto run = dir.path() / "run";
  std::filesystem::create_directories(run);
  ASSERT_OK_AND_ASSIGN(auto monitor, Monitor::Start({.run_dirs = {run.string()}, .port = 0, .threads = 2}));
  std::vector<int> clients;
  for (int i = 0; i < 24; ++i) {
    const int fd = ConnectLoopback(monitor->port());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::send(fd, "GET /api/ru", 11, MSG_NOSIGNAL), 11);  // and nothing more: a request trickling in
    clients.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // in the workers and the queue
  const auto start = std::chrono::steady_clock::now();
  monitor->Stop();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(took, 3.0) << "Stop() waited for the slow clients";
  for (int fd : clients) ::close(fd);
}

// Bound to loopback, the monitor answers only requests for a loopback name: a page elsewhere that
// points its own name at 127.0.0.1 (DNS rebinding) read the runs' files.
TEST_F(MonitorServer, OnlyLoopbackHostNamesAreAnswered) {
  auto with_host = [&](const std::string& host) {
    return Send(port_, fmt::format("GET /runs/0/config.yaml HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n", host));
  };
  for (const std::string& host : std::vector<std::string>{"127.0.0.1", fmt::format("127.0.0.1:{}", port_), fmt::format("localhost:{}", port_),
                                 "LOCALHOST", "[::1]:8080", "127.1.2.3", "localhost.", "app.localhost",
                                                          "[::ffff:127.0.0.1]", "[::ffff:7f00:1]:80", "[0:0:0:0:0:0:0:1]"}) {
    EXPECT_EQ(with_host(host).status, 200) << host;
  }
  for (const std::string& host : std::vector<std::string>{"attacker.example", fmt::format("attacker.example:{}", port_), "127.0.0.1.example",
                                 "10.0.0.1", "[::1", "localhost.attacker.example", "[::1]evil.example",
                                                          "127.0.0.1:80x", "[::ffff:10.0.0.1]"}) {
    const Reply r = with_host(host);
    EXPECT_EQ(r.status, 403) << host;
    EXPECT_EQ(r.body.find("epochs"), std::string::npos) << host << ": the config was served";
  }
  // HTTP/1.0 without a Host header: answered.
  EXPECT_EQ(Send(port_, "GET /api/runs HTTP/1.0\r\n\r\n").status, 200);
}

// Loopback is what the socket is bound to, not how the host was written: "127.1" and "LOCALHOST"
// bind 127.0.0.1 too, and once turned the Host check off (an empty host is refused).
TEST(MonitorStart, TheHostCheckFollowsTheBoundAddress) {
  testing::TempDir dir;
  for (const std::string host : {"127.1", "LOCALHOST", "127.0.0.1"}) {
    ASSERT_OK_AND_ASSIGN(auto m, Monitor::Start({.run_dirs = {dir.path().string()}, .host = host, .port = 0}));
    EXPECT_EQ(m->url(), fmt::format("http://127.0.0.1:{}/", m->port())) << host;
    const Reply r = Send(m->port(), "GET /api/runs HTTP/1.1\r\nHost: attacker.example\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(r.status, 403) << host;
    EXPECT_EQ(Get(m->port(), "/api/runs").status, 200) << host;
    m->Stop();
  }
  auto empty = Monitor::Start({.run_dirs = {dir.path().string()}, .host = "", .port = 0});
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("empty"), std::string::npos) << empty.status().message();
}

// Browsers ask for brotli even over loopback, which the library then spent seconds of CPU on for
// each metrics answer (at its highest quality) inside the trainer's process: gzip at most.
TEST_F(MonitorServer, AnswersAreNeverBrotli) {
  for (const char* accept : {"br", "gzip, deflate, br, zstd", "identity"}) {
    const Reply r = Send(port_, fmt::format("GET /chart.js HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept-Encoding: {}\r\n"
                                            "Connection: close\r\n\r\n",
                                            accept));
    EXPECT_EQ(r.status, 200) << accept;
    EXPECT_EQ(r.head.find("Content-Encoding: br"), std::string::npos) << accept << "\n" << r.head;
    if (std::string(accept) == "br" || std::string(accept) == "identity") {
      EXPECT_EQ(r.head.find("Content-Encoding"), std::string::npos) << accept << "\n" << r.head;
    }
  }
}

// config.yaml and metrics.jsonl of a run are read for the run list and the metrics API: a link
// out of the run's folder is not followed there either (it served /proc/self/environ).
TEST(MonitorRuns, LinksOutOfARunAreNotFollowedByTheApi) {
  testing::TempDir dir;
  const auto run = dir.path() / "run";
  std::filesystem::create_directories(run);
  WriteText(dir.path() / "outside.yaml", "secret: outside-the-run\n");
  WriteText(dir.path() / "outside.jsonl", R"({"type":"start","step":0,"secret":"from outside"})" "\n");
  std::filesystem::create_symlink(dir.path() / "outside.yaml", run / "config.yaml");
  std::filesystem::create_symlink(dir.path() / "outside.jsonl", run / "metrics.jsonl");
  ASSERT_OK_AND_ASSIGN(auto monitor, Monitor::Start({.run_dirs = {run.string()}, .port = 0}));
  const Reply runs = Get(monitor->port(), "/api/runs");
  ASSERT_EQ(runs.status, 200);
  EXPECT_EQ(runs.body.find("outside"), std::string::npos) << runs.body;
  const auto j = nlohmann::json::parse(runs.body);
  EXPECT_FALSE(j["runs"][0].contains("config"));
  EXPECT_EQ(j["runs"][0]["has_metrics"], false);
  EXPECT_TRUE(j["runs"][0]["files"].empty());
  const Reply metrics = Get(monitor->port(), "/api/runs/0/metrics?from=0");
  EXPECT_EQ(metrics.body.find("outside"), std::string::npos) << metrics.body;
  EXPECT_EQ(nlohmann::json::parse(metrics.body)["exists"], false);
}

TEST(MetricsChunk, ALineNestedBeyondReasonIsMalformedNotACrash) {
  testing::TempDir dir;
  const auto path = dir.path() / "metrics.jsonl";
  const int n = 200000;  // serialising this recursively would take far more than a thread's stack
  WriteText(path, std::string(R"({"type":"train","step":1,"loss":1})") + "\n" + R"({"type":"train","step":2,"x":)" +
                      std::string(n, '[') + std::string(n, ']') + "}\n" + R"({"type":"train","step":3,"s":"[[[[{{"})" +
                      "\n");
  auto j = nlohmann::json::parse(ReadMetricsChunk(path, 0, 1 << 20));
  ASSERT_EQ(j["records"].size(), 2u);
  EXPECT_EQ(j["records"][1]["step"], 3) << "brackets inside strings do not count";
  EXPECT_EQ(j["malformed"], 1);
}

TEST(MetricsChunk, ReadsAFileInPiecesAndSkipsOverlongLines) {
  testing::TempDir dir;
  const auto path = dir.path() / "metrics.jsonl";
  std::string text;
  for (int i = 1; i <= 50; ++i) {
    text += fmt::format(R"({{"type":"train","step":{},"loss":{}}})", i, 1.0 / i) + "\n";
    if (i == 20) text += std::string(300, 'x') + "\n";  // longer than a whole chunk
  }
  WriteText(path, text);
  int64_t offset = 0, records = 0, malformed = 0, last_step = 0;
  for (int polls = 0; polls < 1000 && offset < static_cast<int64_t>(text.size()); ++polls) {
    auto j = nlohmann::json::parse(ReadMetricsChunk(path, offset, 120));
    ASSERT_GT(j["offset"].get<int64_t>(), offset) << "every answer makes progress";
    if (j["offset"].get<int64_t>() < j["size"].get<int64_t>()) {
      EXPECT_EQ(j["partial"], 0) << "mid-file, the rest is more to read, not a partial line";
    }
    for (const auto& r : j["records"]) {
      EXPECT_EQ(r["step"].get<int64_t>(), last_step + 1);
      last_step = r["step"];
      records++;
    }
    malformed += j["malformed"].get<int64_t>();
    offset = j["offset"];
  }
  EXPECT_EQ(records, 50);
  EXPECT_EQ(malformed, 1);
  EXPECT_EQ(offset, static_cast<int64_t>(text.size()));
}

TEST(MonitorStart, RefusesMissingRunsAndBusyPorts) {
  auto missing = Monitor::Start({.run_dirs = {"/nonexistent/run"}, .port = 0});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/run"), std::string::npos);
  testing::TempDir dir;
  ASSERT_OK_AND_ASSIGN(auto first, Monitor::Start({.run_dirs = {dir.path().string()}, .port = 0}));
  auto second = Monitor::Start({.run_dirs = {dir.path().string()}, .port = first->port()});
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find(std::to_string(first->port())), std::string::npos);
  EXPECT_NE(second.status().message().find("Address already in use"), std::string::npos) << second.status().message();
  first->Stop();
  first->Stop();  // idempotent
}

TEST(MonitorAddress, Parses) {
  ASSERT_OK_AND_ASSIGN(auto a, ParseListenAddress("8080", "127.0.0.1"));
  EXPECT_EQ(a, std::make_pair(std::string("127.0.0.1"), 8080));
  ASSERT_OK_AND_ASSIGN(auto b, ParseListenAddress("0.0.0.0:9000", "127.0.0.1"));
  EXPECT_EQ(b, std::make_pair(std::string("0.0.0.0"), 9000));
  ASSERT_OK_AND_ASSIGN(auto c, ParseListenAddress("[::1]:0", "127.0.0.1"));
  EXPECT_EQ(c, std::make_pair(std::string("::1"), 0));
  auto v6 = ParseListenAddress("::1", "127.0.0.1");
  ASSERT_FALSE(v6.ok());
  EXPECT_NE(v6.status().message().find("in brackets, e.g. [::1]:8080"), std::string::npos) << v6.status().message();
  for (const char* bad : {"", "x", "80a", "65536", "-1", ":80", "host:"}) {
    auto r = ParseListenAddress(bad, "127.0.0.1");
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_NE(r.status().message().find("[HOST:]PORT"), std::string::npos) << bad;
    }
  }
}

}  // namespace
}  // namespace stoke::monitor

namespace stoke::train {
namespace {

using monitor::WriteText;

TEST(TensorBoard, FramingMatchesTheFormat) {
  // The masked CRC-32C of TFRecord framing: CRC-32C("123456789") is 0xe3069283.
  const uint32_t crc = 0xe3069283u;
  EXPECT_EQ(MaskedCrc32c("123456789"), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
  const std::string framed = FrameRecord("abc");
  ASSERT_EQ(framed.size(), 8u + 4 + 3 + 4);
  EXPECT_EQ(static_cast<unsigned char>(framed[0]), 3);
  for (int i = 1; i < 8; ++i) EXPECT_EQ(framed[i], 0);
  EXPECT_EQ(framed.substr(12, 3), "abc");
}

TEST(TensorBoard, MetricsLinesBecomeScalars) {
  auto m = ScalarsOfMetricsLine(R"({"type":"val","step":30,"loss":1.5,"top1":0.5,"top5":0.9,"samples":10,"time":7.5})", 1);
  EXPECT_EQ(m.step, 30);
  EXPECT_EQ(m.wall_time, 7.5);
  ASSERT_EQ(m.scalars.size(), 3u);
  EXPECT_EQ(m.scalars[0].tag, "val/loss");
  EXPECT_EQ(m.scalars[2].value, 0.9f);
  EXPECT_TRUE(ScalarsOfMetricsLine(R"({"type":"start","step":0})", 1).scalars.empty());
  EXPECT_TRUE(ScalarsOfMetricsLine("{broken", 1).scalars.empty());
  EXPECT_TRUE(ScalarsOfMetricsLine(R"({"type":"train","loss":1})", 1).scalars.empty());  // no step
  // Not finite: left out, as metrics.jsonl (which writes it as null) is read back on a resume.
  const nlohmann::json diverged = {{"type", "val"}, {"step", 4}, {"loss", std::nan("")}, {"top1", 0.25}};
  const MetricsScalars d = ScalarsOfMetrics(diverged, 1);
  ASSERT_EQ(d.scalars.size(), 1u);
  EXPECT_EQ(d.scalars[0].tag, "val/top1");
}

TEST(TensorBoard, WritesAndReadsBackAndFindsDamage) {
  if (!EventWriter::Available()) GTEST_SKIP() << "this build has no TensorBoard event files (no protobuf)";
  testing::TempDir dir;
  ASSERT_OK_AND_ASSIGN(auto w, EventWriter::Create(dir.path() / "tb", 1000.0));
  ASSERT_OK(w->Write(5, 1001.0, {{"train/loss", 2.5f}, {"train/top1", 0.25f}}));
  ASSERT_OK(w->Write(10, 1002.0, {{"val/top5", 0.75f}}));
  const auto path = w->path();
  w.reset();
  EXPECT_NE(path.filename().string().find("events.out.tfevents.1000."), std::string::npos);
  ASSERT_OK_AND_ASSIGN(auto events, ReadScalarEvents(path));
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].tag, "train/loss");
  EXPECT_EQ(events[0].value, 2.5f);
  EXPECT_EQ(events[2].step, 10);
  EXPECT_EQ(events[2].wall_time, 1002.0);

  // A flipped byte in the last record is found; a record cut short at the end is not an error.
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::string damaged = bytes;
  damaged[damaged.size() - 6] ^= 0x40;
  WriteText(path, damaged);
  auto bad = ReadScalarEvents(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("checksum"), std::string::npos);
  WriteText(path, bytes.substr(0, bytes.size() - 3));
  ASSERT_OK_AND_ASSIGN(auto cut, ReadScalarEvents(path));
  EXPECT_EQ(cut.size(), 2u);
}

}  // namespace
}  // namespace stoke::train
