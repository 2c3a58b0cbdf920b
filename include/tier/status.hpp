// tier/status.hpp — the error vocabulary of tier: Status and Result<T>.
//
// Every fallible function in tier returns a Status or a Result<T>; no exception leaves a module.
// Both types are [[nodiscard]], and tier builds with -Werror=unused-result, so a dropped error is a
// compile error; drop one on purpose with `.ignore()`. An I/O failure carries the positive errno of
// its cause (sys_errno()), and every message names the object that failed and, where there is one,
// the fix.
//
// Thread safety: Status and Result are values. A Status is immutable once built and cheap to copy
// (the ok status holds no allocation; an error shares its message), so copies may be read from
// any thread.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace tier {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,      // bad input: a config value, a size, a dtype, a path, API misuse
  kNotFound = 2,             // a named thing (tensor, file, key) does not exist
  kAlreadyExists = 3,        // registering a name twice, creating over someone else's file
  kOutOfRange = 4,           // an offset or index past the end
  kResourceExhausted = 5,    // a budget or pool cannot satisfy the request
  kTimedOut = 6,             // waited for a resource or completion longer than allowed
  kCancelled = 7,            // the operation was cancelled before it completed
  kIoError = 8,              // a read or write failed; sys_errno() says why
  kNoSpace = 9,              // ENOSPC or EDQUOT: the file system is full
  kUnsupported = 10,         // the kernel, file system or device lacks a capability
  kFailedPrecondition = 11,  // the object is in the wrong state for the call
  kDataLoss = 12,            // stored data is corrupt or incomplete (checksum, truncated file)
  kDeviceError = 13,         // the accelerator runtime reported an error
  kInternal = 14,            // a bug in tier: an invariant did not hold
};

// Short stable name of a code, e.g. "io_error".
const char* status_code_name(StatusCode code) noexcept;

class [[nodiscard]] Status {
 public:
  // The ok status. Holds no allocation.
  Status() noexcept = default;
  Status(StatusCode code, std::string message, int sys_errno = 0);

  static Status Ok() noexcept { return Status(); }

  bool ok() const noexcept { return rep_ == nullptr; }
  explicit operator bool() const noexcept { return ok(); }
  StatusCode code() const noexcept { return rep_ ? rep_->code : StatusCode::kOk; }
  // Positive errno of the underlying system error, or 0.
  int sys_errno() const noexcept { return rep_ ? rep_->sys_errno : 0; }
  // The message without the code, e.g. "swap path /x: O_DIRECT not supported by tmpfs; ...".
  const std::string& message() const noexcept;
  // "io_error (EIO): swap path /x: ..." or "ok".
  std::string to_string() const;

  // The same error with "context: " put in front of the message. Ok stays ok.
  Status with_context(std::string_view context) const;

  // Marks a deliberately unused status.
  void ignore() const noexcept {}

  friend bool operator==(const Status& a, const Status& b) noexcept {
    return a.code() == b.code() && a.sys_errno() == b.sys_errno() && a.message() == b.message();
  }

 private:
  struct Rep {
    StatusCode code;
    int sys_errno;
    std::string message;
  };
  std::shared_ptr<const Rep> rep_;
};

std::ostream& operator<<(std::ostream& os, const Status& s);

// Builds a message from any streamable pieces: str("swap path ", p, ": ", n, " bytes").
template <class... Args>
std::string str(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

// Shorthands for the common codes.
inline Status invalid_argument(std::string msg) {
  return {StatusCode::kInvalidArgument, std::move(msg)};
}
inline Status not_found(std::string msg) {
  return {StatusCode::kNotFound, std::move(msg)};
}
inline Status already_exists(std::string msg) {
  return {StatusCode::kAlreadyExists, std::move(msg)};
}
inline Status out_of_range(std::string msg) {
  return {StatusCode::kOutOfRange, std::move(msg)};
}
inline Status resource_exhausted(std::string msg) {
  return {StatusCode::kResourceExhausted, std::move(msg)};
}
inline Status timed_out(std::string msg) {
  return {StatusCode::kTimedOut, std::move(msg)};
}
inline Status cancelled(std::string msg) {
  return {StatusCode::kCancelled, std::move(msg)};
}
inline Status unsupported(std::string msg) {
  return {StatusCode::kUnsupported, std::move(msg)};
}
inline Status failed_precondition(std::string msg) {
  return {StatusCode::kFailedPrecondition, std::move(msg)};
}
inline Status data_loss(std::string msg) {
  return {StatusCode::kDataLoss, std::move(msg)};
}
inline Status device_error(std::string msg) {
  return {StatusCode::kDeviceError, std::move(msg)};
}
inline Status internal_error(std::string msg) {
  return {StatusCode::kInternal, std::move(msg)};
}

// A status for a failed system call: picks the code from the errno (ENOSPC -> kNoSpace,
// EINVAL -> kInvalidArgument, ETIMEDOUT -> kTimedOut, ...; otherwise kIoError) and appends
// strerror to the message. `err` may be given positive or negative (-errno, as io_uring returns).
Status errno_status(int err, std::string_view what);

namespace detail {
[[noreturn]] void die_on_bad_access(const Status& s, const char* what) noexcept;
}  // namespace detail

// A value or the error that prevented it. Accessing the value of an error Result is a programming
// error and aborts the process with the error printed; check ok() first.
template <class T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<std::decay_t<T>, Status>, "Result<Status> makes no sense");

 public:
  // NOLINTNEXTLINE(google-explicit-constructor): implicit so that `return value;` works.
  Result(T value) : v_(std::in_place_index<1>, std::move(value)) {}
  // NOLINTNEXTLINE(google-explicit-constructor): implicit so that `return status;` works.
  Result(Status status) : v_(std::in_place_index<0>, std::move(status)) {
    if (std::get<0>(v_).ok()) {
      v_.template emplace<0>(StatusCode::kInternal, "Result built from an ok Status without a value");
    }
  }
  template <class U,
            class = std::enable_if_t<std::is_constructible_v<T, U&&> && !std::is_same_v<std::decay_t<U>, Status> &&
                                     !std::is_same_v<std::decay_t<U>, Result>>>
  // NOLINTNEXTLINE(google-explicit-constructor)
  Result(U&& value) : v_(std::in_place_index<1>, T(std::forward<U>(value))) {}

  bool ok() const noexcept { return v_.index() == 1; }
  explicit operator bool() const noexcept { return ok(); }

  // The error, or the ok status when there is a value.
  Status status() const { return ok() ? Status() : std::get<0>(v_); }

  T& value() & {
    check();
    return std::get<1>(v_);
  }
  const T& value() const& {
    check();
    return std::get<1>(v_);
  }
  T&& value() && {
    check();
    return std::move(std::get<1>(v_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  template <class U>
  T value_or(U&& fallback) const& {
    return ok() ? std::get<1>(v_) : static_cast<T>(std::forward<U>(fallback));
  }

  void ignore() const noexcept {}

 private:
  void check() const noexcept {
    if (!ok()) detail::die_on_bad_access(std::get<0>(v_), "Result::value() on an error");
  }
  std::variant<Status, T> v_;
};

}  // namespace tier

#define TIER_CONCAT_INNER_(a, b) a##b
#define TIER_CONCAT_(a, b) TIER_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function when `expr` (a Status) is an error.
#define TIER_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::tier::Status tier_status_ = (expr);        \
    if (!tier_status_.ok()) return tier_status_; \
  } while (0)

// `TIER_ASSIGN_OR_RETURN(auto x, f());` declares x from a Result or returns its error.
#define TIER_ASSIGN_OR_RETURN(lhs, expr) TIER_ASSIGN_OR_RETURN_IMPL_(TIER_CONCAT_(tier_result_, __LINE__), lhs, expr)
#define TIER_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()
