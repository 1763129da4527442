// The revision of the sources a build is of.
#pragma once

namespace stoke {

// `git rev-parse --short=12 HEAD` when the build ran (every build, not only when CMake
// configured), "unknown" outside a git checkout.
const char* GitSha();

}  // namespace stoke
