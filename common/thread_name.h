// Names the calling thread for `top -H`, `ps -L`, gdb and perf, so that a stalled or busy loader
// thread can be told apart from TBB's workers and the trainer's own.
#pragma once

#include <pthread.h>

#include <string_view>

namespace stoke {

// Linux keeps at most 15 characters of a thread's name; longer names are cut there. Best effort:
// a name the system refuses changes nothing else.
inline void SetThreadName(std::string_view name) {
  char buf[16] = {};
  name.copy(buf, sizeof(buf) - 1);
  (void)::pthread_setname_np(::pthread_self(), buf);
}

}  // namespace stoke
