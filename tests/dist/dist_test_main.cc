// main() of the multi-rank test binaries: one communicator for the process (a world of one when
// not started by mpirun); rank 0 prints gtest's usual report, the other ranks only their failures,
// each line prefixed with the rank.
#include <gtest/gtest.h>

#include <cstdio>

#include "tests/dist/dist_test_env.h"

namespace stoke::dist::test {
namespace {

std::unique_ptr<Communicator> g_world;

class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?", r.line_number(),
                 r.summary());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
    }
  }

 private:
  int rank_;
};

}  // namespace

Communicator* World() { return g_world.get(); }

}  // namespace stoke::dist::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto world = stoke::dist::Communicator::Create({.timeout_s = 60});
  if (!world.ok()) {
    std::fprintf(stderr, "cannot start the world: %s\n", world.status().ToString().c_str());
    return 1;
  }
  stoke::dist::test::g_world = std::move(*world);
  const int rank = stoke::dist::test::g_world->rank();
  if (rank > 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new stoke::dist::test::FailurePrinter(rank));
  } else if (stoke::dist::test::g_world->size() > 1) {
    std::printf("world of %d ranks (rank 0 reports; other ranks print their failures)\n",
                stoke::dist::test::g_world->size());
  }
  const int rc = RUN_ALL_TESTS();
  stoke::dist::test::g_world.reset();
  return rc;
}
