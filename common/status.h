// Status and Result<T>: the error values every fallible stoke function returns.
// Errors at dataset scale (a corrupt JPEG, a truncated record, a bad flag) are ordinary data, so
// they travel as values, never as exceptions across an API.
#pragma once

#include <exception>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "common/check.h"

namespace stoke {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,    // a flag, option or argument the caller can fix
  kNotFound,           // a file, record or key that does not exist
  kCorrupt,            // data that exists but is malformed (image, record, dataset)
  kIoError,            // the operating system refused a read, write or rename
  kResourceExhausted,  // a size limit or out of memory / map space
  kUnavailable,        // a feature or device not present here (e.g. no GPU), or interrupted
  kInternal,           // a bug in stoke or an unexpected library failure
};

// Short lower-case name of a code, e.g. "corrupt".
std::string_view StatusCodeName(StatusCode code);

// An error code plus a message of the form "module: object: problem (fix)".
// Cheap to copy when ok; thread-compatible.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "corrupt: dataset: /d/x.lmdb: record 12: CRC mismatch".
  std::string ToString() const;

  // Returns a copy whose message starts with "context: ". No-op on ok statuses.
  Status Prepend(std::string_view context) const;

  bool operator==(const Status&) const = default;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }
inline Status InvalidArgumentError(std::string m) {
  return Status(StatusCode::kInvalidArgument, std::move(m));
}
inline Status NotFoundError(std::string m) { return Status(StatusCode::kNotFound, std::move(m)); }
inline Status CorruptError(std::string m) { return Status(StatusCode::kCorrupt, std::move(m)); }
inline Status IoError(std::string m) { return Status(StatusCode::kIoError, std::move(m)); }
inline Status ResourceExhaustedError(std::string m) {
  return Status(StatusCode::kResourceExhausted, std::move(m));
}
inline Status UnavailableError(std::string m) {
  return Status(StatusCode::kUnavailable, std::move(m));
}
inline Status InternalError(std::string m) { return Status(StatusCode::kInternal, std::move(m)); }

// Either a value or a non-ok Status. Accessing the value of an error is a bug (STOKE_CHECK).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    STOKE_CHECK(!status_.ok()) << "Result constructed from an ok Status without a value";
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }

  T& value() & {
    STOKE_CHECK(ok()) << status_.ToString();
    return *value_;
  }
  const T& value() const& {
    STOKE_CHECK(ok()) << status_.ToString();
    return *value_;
  }
  T&& value() && {
    STOKE_CHECK(ok()) << status_.ToString();
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

// Runs `fn` (returning a Status or a Result) and turns anything it throws into an error whose
// message starts with `what`: std::bad_alloc becomes kResourceExhausted ("out of memory"), any
// other exception kInternal. For the boundary of a module that calls into a throwing library, so
// that no exception crosses a stoke API.
template <typename F>
auto CatchExceptions(std::string_view what, F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(std::string(what) + ": out of memory");
  } catch (const std::exception& e) {
    return InternalError(std::string(what) + ": unexpected exception: " + e.what());
  } catch (...) {
    return InternalError(std::string(what) + ": unexpected exception of unknown type");
  }
}

}  // namespace stoke

#define STOKE_STATUS_CONCAT_INNER(a, b) a##b
#define STOKE_STATUS_CONCAT(a, b) STOKE_STATUS_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` (a Status) is not ok.
#define STOKE_RETURN_IF_ERROR(expr)                 \
  do {                                              \
    ::stoke::Status stoke_status_tmp_ = (expr);     \
    if (!stoke_status_tmp_.ok()) return stoke_status_tmp_; \
  } while (0)

// `STOKE_ASSIGN_OR_RETURN(T x, ResultExpr)`: declares/assigns the value or returns the error.
#define STOKE_ASSIGN_OR_RETURN(lhs, rexpr) \
  STOKE_ASSIGN_OR_RETURN_IMPL(STOKE_STATUS_CONCAT(stoke_result_, __LINE__), lhs, rexpr)
#define STOKE_ASSIGN_OR_RETURN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
