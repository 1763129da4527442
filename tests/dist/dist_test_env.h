// The one communicator of a multi-rank test binary (MPI starts once per process), created by
// dist_test_main.cc before any test runs.
#pragma once

#include "dist/communicator.h"

namespace stoke::dist::test {
Communicator* World();
}  // namespace stoke::dist::test
