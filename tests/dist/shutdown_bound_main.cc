// Two bounds on waiting for a stuck peer (tests/CMakeLists.txt). Started beside a program that never
// calls MPI_Init, with STOKE_DIST_INIT_TIMEOUT_S=2, Create itself ends the process after 2 s. Otherwise:
// a rank that finishes while another is stuck must not wait in MPI's shutdown for good: rank 1
// stays away from MPI (as a hung or stopped process does) while rank 0 destroys its communicator,
// whose MPI_Finalize would wait for rank 1. After the collective timeout (2 s here) rank 0 ends the
// world saying why; the test (tests/CMakeLists.txt) expects that message within its time limit.
#include <chrono>
#include <cstdio>
#include <thread>

#include "dist/communicator.h"

int main() {
  auto world = stoke::dist::Communicator::Create({.timeout_s = 2});
  if (!world.ok()) {
    std::fprintf(stderr, "cannot start the world: %s\n", world.status().ToString().c_str());
    return 1;
  }
  if ((*world)->size() != 2) {
    std::fprintf(stderr, "run with 2 ranks under mpirun\n");
    return 1;
  }
  const auto start = std::chrono::steady_clock::now();
  const int rank = (*world)->rank();
  if (rank == 1) std::this_thread::sleep_for(std::chrono::seconds(60));
  world->reset();  // rank 0: bounded by the timeout; never reached when the bound holds
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("rank %d: communicator destroyed after %.1f s (the bound did not end the world)\n", rank, s);
  return 1;
}
