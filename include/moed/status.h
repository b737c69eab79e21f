// Status and StatusOr<T>: how moed reports anything a caller can get wrong.
//
// Every public function that can fail on bad input returns a Status (or StatusOr<T>); the
// message names the offending value, e.g.
//   "topk_idx[17][3] = 300 is outside [-1, 256)".
// Both types are [[nodiscard]] so an error cannot be dropped silently.
//
//   moed::StatusOr<int> parse(std::string_view s);
//   MOED_ASSIGN_OR_RETURN(int n, parse("12"));
//   MOED_RETURN_IF_ERROR(check(n));
//
// Internal invariants (bugs in moed, not in the caller's input) use MOED_CHECK, which stays
// on in release builds and aborts with the location and message.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <variant>

namespace moed {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,   // the caller's input is wrong
  kFailedPrecondition,  // the object is not in a state for this call
  kUnimplemented,     // a combination moed does not support
  kDeadlineExceeded,  // a collective timed out waiting for a peer
  kAborted,           // a peer rank failed; this call cannot complete
  kInternal,          // an error from a library underneath (MPI, allocation)
  kOutOfRange,
  kNotFound,
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: topk_idx[1][0] = 9 is outside [-1, 8)"
  std::string to_string() const;
  // Marks an error as deliberately ignored (destructors, best-effort cleanup).
  void ignore() const {}

  // Prefixes the message with context, keeping the code: "rank 2: <message>".
  Status with_context(const std::string& context) const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status ok_status() { return Status(); }

// Builds a message from any streamable pieces: invalid_argument("E = ", e, " is not ...").
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
template <typename... Args>
Status invalid_argument(const Args&... args) {
  return Status(StatusCode::kInvalidArgument, str_cat(args...));
}
template <typename... Args>
Status failed_precondition(const Args&... args) {
  return Status(StatusCode::kFailedPrecondition, str_cat(args...));
}
template <typename... Args>
Status unimplemented(const Args&... args) {
  return Status(StatusCode::kUnimplemented, str_cat(args...));
}
template <typename... Args>
Status internal_error(const Args&... args) {
  return Status(StatusCode::kInternal, str_cat(args...));
}
template <typename... Args>
Status aborted(const Args&... args) {
  return Status(StatusCode::kAborted, str_cat(args...));
}
template <typename... Args>
Status deadline_exceeded(const Args&... args) {
  return Status(StatusCode::kDeadlineExceeded, str_cat(args...));
}

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(const Status& status) : status_(status) { check_not_ok(); }  // NOLINT
  StatusOr(Status&& status) : status_(std::move(status)) { check_not_ok(); }  // NOLINT
  StatusOr(const T& value) : value_(value) {}  // NOLINT
  StatusOr(T&& value) : value_(std::move(value)) {}  // NOLINT

  bool ok() const { return status_.ok(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  // Precondition: ok(). Calling on an error is a bug in the caller and aborts.
  T& value() & { check_ok(); return *value_; }
  const T& value() const& { check_ok(); return *value_; }
  T&& value() && { check_ok(); return std::move(*value_); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void check_not_ok() const {
    if (status_.ok()) {
      std::fprintf(stderr, "moed: StatusOr constructed from an OK status\n");
      std::abort();
    }
  }
  void check_ok() const {
    if (!status_.ok()) {
      std::fprintf(stderr, "moed: StatusOr::value() on error: %s\n", status_.to_string().c_str());
      std::abort();
    }
  }
  Status status_;
  std::optional<T> value_;
};

namespace internal {
[[noreturn]] void check_failed(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace internal

}  // namespace moed

#define MOED_STATUS_CONCAT_INNER(a, b) a##b
#define MOED_STATUS_CONCAT(a, b) MOED_STATUS_CONCAT_INNER(a, b)

#define MOED_RETURN_IF_ERROR(expr)                 \
  do {                                             \
    ::moed::Status _moed_status = (expr);          \
    if (!_moed_status.ok()) return _moed_status;   \
  } while (0)

#define MOED_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return std::move(tmp).status();   \
  lhs = std::move(tmp).value()

#define MOED_ASSIGN_OR_RETURN(lhs, expr) \
  MOED_ASSIGN_OR_RETURN_IMPL(MOED_STATUS_CONCAT(_moed_statusor_, __LINE__), lhs, expr)

// Release-build invariant check for moed's own bugs (never for caller input).
#define MOED_CHECK(cond, ...)                                                          \
  do {                                                                                 \
    if (!(cond)) ::moed::internal::check_failed(__FILE__, __LINE__, #cond,             \
                                                ::moed::str_cat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)
