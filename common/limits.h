// Bounds on options that ask for threads (decoding, packing, verifying, compute): beyond them a
// request is a mistake, not a machine.
#pragma once

namespace stoke {

inline constexpr int kMaxThreads = 4096;

}  // namespace stoke
