// STOKE_CHECK: aborts with a message when an internal invariant is broken. Never used for input
// validation: bad input is a Status.
#pragma once

#include <sstream>

namespace stoke::internal {

// Collects the streamed message and aborts in its destructor.
class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition);
  [[noreturn]] ~CheckFailure();
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

// Lets `STOKE_CHECK(c) << ...` be an expression of type void.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace stoke::internal

#define STOKE_CHECK(condition)                 \
  (condition) ? (void)0                        \
              : ::stoke::internal::Voidify() & \
                    ::stoke::internal::CheckFailure(__FILE__, __LINE__, #condition).stream()
