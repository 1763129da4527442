// Collectives on real ranks: ctest runs this binary under mpirun with 2 and 3 ranks (and it runs
// alone as a world of one). Every rank runs every test and derives its expectations from
// (rank, world).
#include "dist/communicator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "dist/reducer.h"
#include "tests/dist/dist_test_env.h"

namespace stoke::dist {
namespace {

Communicator& Comm() { return *test::World(); }

// Sizes that do not fall on any power of two, page or chunk boundary.
const std::vector<size_t> kAwkward = {0, 1, 3, 7, 1023, 4097, 65537, (size_t{1} << 20) + 3};

// Which launcher started this process, from the environment alone (saved and put back: under
// mpirun this process has Open MPI's variables).
TEST(Launch, SlurmsBatchScriptIsNotATaskOfAStep) {
  static constexpr const char* kNames[] = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                           "PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
                                           "SLURM_LOCALID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "PMI_RANK",
                                           "PMI_SIZE", "MPI_LOCALRANKID"};
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  for (const char* name : kNames) {
    const char* v = std::getenv(name);
    saved.emplace_back(name, v ? std::optional<std::string>(v) : std::nullopt);
    ::unsetenv(name);
  }
  auto detect = [](std::vector<std::pair<const char*, const char*>> env) {
    for (auto [k, v] : env) ::setenv(k, v, 1);
    LaunchInfo info = DetectLaunch();
    for (auto [k, v] : env) ::unsetenv(k);
    return info;
  };
  // `sbatch --ntasks=2` running stoke itself: the batch step, a world of one.
  LaunchInfo batch = detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}});
  EXPECT_EQ(batch.size, 1);
  EXPECT_EQ(batch.launcher, "");
  // `srun -n 3` inside that job: task 2 of the step's 3 (the job's SLURM_NTASKS is 4 here).
  LaunchInfo task = detect({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"}, {"SLURM_STEP_ID", "0"},
                            {"SLURM_STEP_NUM_TASKS", "3"}});
  EXPECT_EQ(task.launcher, "srun");
  EXPECT_EQ(task.rank, 2);
  EXPECT_EQ(task.size, 3);
  EXPECT_EQ(task.local_rank, 1);
  LaunchInfo ompi = detect({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"},
                            {"SLURM_NTASKS", "2"}});
  EXPECT_EQ(ompi.launcher, "mpirun");
  EXPECT_EQ(ompi.rank, 1);
  for (const auto& [k, v] : saved) {
    if (v) ::setenv(k.c_str(), v->c_str(), 1);
  }
}

TEST(Collectives, AllReduceSumAvgMaxMinOfAwkwardSizes) {
  const int r = Comm().rank(), w = Comm().size();
  for (size_t n : kAwkward) {
    SCOPED_TRACE(n);
    std::vector<float> f(n);
    std::vector<double> d(n);
    std::vector<int64_t> i(n), lo(n);
    std::vector<int32_t> hi(n);
    for (size_t k = 0; k < n; ++k) {
      f[k] = static_cast<float>((r + 1) * (k % 97));
      d[k] = 0.5 * (r + 1) + static_cast<double>(k);
      i[k] = static_cast<int64_t>(k) * (r + 1) + (int64_t{1} << 40);
      hi[k] = static_cast<int32_t>((k + static_cast<size_t>(r)) % static_cast<size_t>(w));
      lo[k] = -static_cast<int64_t>(r) * static_cast<int64_t>(k);
    }
    ASSERT_TRUE(Comm().AllReduce(f.data(), n, DataType::kFloat32, ReduceOp::kSum).Wait().ok());
    ASSERT_TRUE(Comm().AllReduce(d.data(), n, DataType::kFloat64, ReduceOp::kAvg).Wait().ok());
    ASSERT_TRUE(Comm().AllReduce(i.data(), n, DataType::kInt64, ReduceOp::kSum).Wait().ok());
    ASSERT_TRUE(Comm().AllReduce(hi.data(), n, DataType::kInt32, ReduceOp::kMax).Wait().ok());
    ASSERT_TRUE(Comm().AllReduce(lo.data(), n, DataType::kInt64, ReduceOp::kMin).Wait().ok());
    const int tri = w * (w + 1) / 2;  // sum of (rank + 1)
    for (size_t k = 0; k < n; ++k) {
      ASSERT_EQ(f[k], static_cast<float>(tri * static_cast<int>(k % 97))) << k;
      ASSERT_NEAR(d[k], 0.5 * tri / w + static_cast<double>(k), 1e-9) << k;
      ASSERT_EQ(i[k], static_cast<int64_t>(k) * tri + w * (int64_t{1} << 40)) << k;
      ASSERT_EQ(hi[k], w - 1) << k;
      ASSERT_EQ(lo[k], -static_cast<int64_t>(w - 1) * static_cast<int64_t>(k)) << k;
    }
  }
}

TEST(Collectives, AveragingIntegersIsRefused) {
  int64_t x = 1;
  Status s = Comm().AllReduce(&x, 1, DataType::kInt64, ReduceOp::kAvg).Wait();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
}

TEST(Collectives, BroadcastFromEveryRoot) {
  const int r = Comm().rank(), w = Comm().size();
  for (int root = 0; root < w; ++root) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{4097}, (size_t{3} << 20) + 1}) {
      std::vector<uint8_t> buf(n);
      for (size_t k = 0; k < n; ++k) buf[k] = static_cast<uint8_t>(r == root ? (k * 7 + static_cast<size_t>(root)) : 0xEE);
      ASSERT_TRUE(Comm().Broadcast(buf.data(), n, root).Wait().ok());
      for (size_t k = 0; k < n; ++k) {
        ASSERT_EQ(buf[k], static_cast<uint8_t>(k * 7 + static_cast<size_t>(root))) << "root " << root << " at " << k;
      }
    }
  }
  int dummy = 0;
  EXPECT_EQ(Comm().Broadcast(&dummy, sizeof(dummy), w).Wait().code(), StatusCode::kInvalidArgument);
}

TEST(Collectives, AllGatherPlacesEveryRank) {
  const int r = Comm().rank(), w = Comm().size();
  for (size_t n : {size_t{1}, size_t{13}, size_t{1000}}) {
    std::vector<uint8_t> mine(n, static_cast<uint8_t>(r + 1));
    std::vector<uint8_t> all(n * static_cast<size_t>(w), 0);
    ASSERT_TRUE(Comm().AllGather(mine.data(), n, all.data()).Wait().ok());
    for (int q = 0; q < w; ++q) {
      for (size_t k = 0; k < n; ++k) ASSERT_EQ(all[static_cast<size_t>(q) * n + k], q + 1);
    }
  }
}

TEST(Collectives, ManyInFlightFinishInOrder) {
  const int w = Comm().size();
  std::vector<std::vector<float>> bufs(40);
  std::vector<Work> works;
  for (size_t b = 0; b < bufs.size(); ++b) {
    bufs[b].assign(1 + b * 101, static_cast<float>(b));
    works.push_back(Comm().AllReduce(bufs[b].data(), bufs[b].size(), DataType::kFloat32, ReduceOp::kSum));
  }
  // Wait in reverse: order of waiting does not matter, order of enqueueing does.
  for (size_t b = works.size(); b-- > 0;) ASSERT_TRUE(works[b].Wait().ok());
  for (size_t b = 0; b < bufs.size(); ++b) {
    for (float v : bufs[b]) ASSERT_EQ(v, static_cast<float>(b) * static_cast<float>(w));
  }
  for (size_t b = 1; b < works.size(); ++b) {
    EXPECT_GE(works[b].started_s(), works[b - 1].finished_s());
    EXPECT_GT(works[b].seq(), works[b - 1].seq());
  }
}

TEST(Collectives, AgreeNamesTheLowestFailingRank) {
  const int r = Comm().rank(), w = Comm().size();
  EXPECT_TRUE(Comm().Agree(OkStatus()).ok());
  if (w == 1) {
    EXPECT_EQ(Comm().Agree(NotFoundError("x")).code(), StatusCode::kNotFound);
    return;
  }
  // The last rank and (with 3 or more) rank 1 fail; everyone hears rank 1's (or the last's) error.
  const bool fails = r == w - 1 || r == 1;
  Status local = fails ? NotFoundError(fmt::format("dataset missing on rank {}", r)) : OkStatus();
  Status agreed = Comm().Agree(local);
  ASSERT_FALSE(agreed.ok());
  if (fails) {
    EXPECT_EQ(agreed, local);
  } else {
    EXPECT_EQ(agreed.code(), StatusCode::kNotFound);
    EXPECT_EQ(agreed.message(), fmt::format("rank 1 ({}) failed: dataset missing on rank 1", Comm().host()))  // one machine
        << agreed.message();
  }
}

TEST(Reducer, AveragesInBucketsWhateverTheReadyOrder) {
  const int r = Comm().rank(), w = Comm().size();
  // 30 gradients of awkward sizes, laid out so that backward order (the reverse of creation) walks
  // the buffer forwards, as the backends do.
  std::vector<size_t> sizes;
  std::mt19937 gen(7);
  for (int i = 0; i < 30; ++i) sizes.push_back(1 + gen() % 70000);
  const size_t total = std::accumulate(sizes.begin(), sizes.end(), size_t{0});
  std::vector<Slice> slices;
  size_t at = 0;
  for (size_t s : sizes) {
    slices.push_back({at, s});
    at += s;
  }
  std::vector<float> flat(total);
  auto reducer = Reducer::Create(Comm(), flat, slices, {.bucket_bytes = 256 << 10, .first_bucket_bytes = 16 << 10});
  ASSERT_TRUE(reducer.ok()) << reducer.status().ToString();
  // Buckets: contiguous, the first one small, none over its limit unless a single slice is larger.
  const auto bs = reducer->bucket_sizes();
  EXPECT_GT(bs.size(), 3u);
  EXPECT_EQ(std::accumulate(bs.begin(), bs.end(), size_t{0}), total);
  for (int step = 0; step < 3; ++step) {
    for (size_t k = 0; k < total; ++k) flat[k] = static_cast<float>((r + 1) * ((k + static_cast<size_t>(step)) % 13));
    // Ranks mark in different orders (rank 0 in order, others shuffled by rank).
    std::vector<int> order(slices.size());
    std::iota(order.begin(), order.end(), 0);
    if (r > 0) std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(r * 100 + step)));
    for (int i : order) reducer->Ready(i);
    ASSERT_TRUE(reducer->Finish().ok());
    const float mean = static_cast<float>(w + 1) / 2.f;
    for (size_t k = 0; k < total; ++k) {
      ASSERT_FLOAT_EQ(flat[k], mean * static_cast<float>((k + static_cast<size_t>(step)) % 13)) << k;
    }
    EXPECT_GE(reducer->last_step().comm_s, 0);
    EXPECT_LE(reducer->last_step().overlapped_s, reducer->last_step().comm_s + 1e-9);
  }
}

TEST(Reducer, RefusesSlicesOutsideOrOverlapping) {
  std::vector<float> flat(100);
  EXPECT_EQ(Reducer::Create(Comm(), flat, {{90, 20}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Reducer::Create(Comm(), flat, {{0, 50}, {40, 20}}).status().code(), StatusCode::kInvalidArgument);
}

// A rank that stops (stuck, SIGSTOP) before its buckets: the others' Finish ends at the first
// bucket's timeout. It waited on every bucket in turn, each for a full timeout: a stuck peer held
// the world for buckets x dist.timeout_s. Once the late rank arrives, the world goes on.
TEST(Reducer, AStuckRankEndsTheOthersFinishAtTheFirstTimeout) {
  const int r = Comm().rank(), w = Comm().size();
  if (w == 1) GTEST_SKIP() << "needs 2 or more ranks (run under mpirun)";
  std::vector<Slice> slices;
  for (size_t i = 0; i < 8; ++i) slices.push_back({i * 1000, 1000});
  std::vector<float> flat(8000, 1.f);
  auto reducer = Reducer::Create(Comm(), flat, slices, {.bucket_bytes = 4000, .first_bucket_bytes = 4000});
  ASSERT_TRUE(reducer.ok()) << reducer.status().ToString();
  ASSERT_EQ(reducer->bucket_sizes().size(), 8u);
  const double timeout = Comm().timeout_s();
  Comm().set_timeout_s(0.4);
  if (r == w - 1) std::this_thread::sleep_for(std::chrono::milliseconds(4000));
  const auto start = std::chrono::steady_clock::now();
  for (int i = 7; i >= 0; --i) reducer->Ready(i);
  const Status s = reducer->Finish();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  Comm().set_timeout_s(timeout);
  if (r != w - 1) {
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
    EXPECT_LT(took, 2.0) << "Finish waited on every bucket (8 x 0.4 s = 3.2 s)";
  } else {
    EXPECT_TRUE(s.ok()) << s.ToString();  // the others' collectives were still queued: they matched its own
  }
  EXPECT_TRUE(Comm().Barrier().Wait().ok());
}

// Runs last (gtest keeps declaration order): a rank that joins late makes the others time out, and
// the world still works once it arrives.
TEST(Collectives, ZLateRankTimesOutThenRecovers) {
  const int r = Comm().rank(), w = Comm().size();
  if (w == 1) GTEST_SKIP() << "needs 2 or more ranks (run under mpirun)";
  if (r == w - 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  float x = 1;
  Work work = Comm().AllReduce(&x, 1, DataType::kFloat32, ReduceOp::kSum);
  if (r != w - 1) {
    Status s = work.Wait(200);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
    EXPECT_NE(s.message().find("allreduce"), std::string::npos) << s.message();
  }
  EXPECT_TRUE(work.Wait().ok());
  EXPECT_EQ(x, static_cast<float>(w));
}

}  // namespace
}  // namespace stoke::dist
