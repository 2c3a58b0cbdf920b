#include "tier/status.hpp"

#include <cerrno>
#include <cstring>
#include <ostream>

namespace tier {

const char* status_code_name(StatusCode code) noexcept {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid_argument";
    case StatusCode::kNotFound: return "not_found";
    case StatusCode::kAlreadyExists: return "already_exists";
    case StatusCode::kOutOfRange: return "out_of_range";
    case StatusCode::kResourceExhausted: return "resource_exhausted";
    case StatusCode::kTimedOut: return "timed_out";
    case StatusCode::kCancelled: return "cancelled";
    case StatusCode::kIoError: return "io_error";
    case StatusCode::kNoSpace: return "no_space";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kFailedPrecondition: return "failed_precondition";
    case StatusCode::kDataLoss: return "data_loss";
    case StatusCode::kDeviceError: return "device_error";
    case StatusCode::kInternal: return "internal";
  }
  return "unknown";
}

namespace {
const std::string& empty_string() {
  static const std::string empty;
  return empty;
}

const char* errno_name(int err) {
  switch (err) {
    case EIO: return "EIO";
    case ENOSPC: return "ENOSPC";
    case EDQUOT: return "EDQUOT";
    case EINVAL: return "EINVAL";
    case ENOENT: return "ENOENT";
    case EEXIST: return "EEXIST";
    case EACCES: return "EACCES";
    case EPERM: return "EPERM";
    case ENOMEM: return "ENOMEM";
    case EAGAIN: return "EAGAIN";
    case EINTR: return "EINTR";
    case EBADF: return "EBADF";
    case EFAULT: return "EFAULT";
    case ENOTSUP: return "EOPNOTSUPP";
    case ENOSYS: return "ENOSYS";
    case ETIMEDOUT: return "ETIMEDOUT";
    case ECANCELED: return "ECANCELED";
    case ELOOP: return "ELOOP";
    case EROFS: return "EROFS";
    case EFBIG: return "EFBIG";
    case ENODEV: return "ENODEV";
    case EISDIR: return "EISDIR";
    case ENOTDIR: return "ENOTDIR";
    case EBUSY: return "EBUSY";
    default: return nullptr;
  }
}
}  // namespace

Status::Status(StatusCode code, std::string message, int sys_errno) {
  if (code == StatusCode::kOk) return;  // an "ok with a message" is still ok
  rep_ = std::make_shared<const Rep>(Rep{code, sys_errno < 0 ? -sys_errno : sys_errno, std::move(message)});
}

const std::string& Status::message() const noexcept {
  return rep_ ? rep_->message : empty_string();
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  std::string out = status_code_name(rep_->code);
  if (rep_->sys_errno != 0) {
    const char* name = errno_name(rep_->sys_errno);
    out += name ? str(" (", name, ")") : str(" (errno ", rep_->sys_errno, ")");
  }
  out += ": ";
  out += rep_->message;
  return out;
}

Status Status::with_context(std::string_view context) const {
  if (ok()) return *this;
  return Status(rep_->code, str(context, ": ", rep_->message), rep_->sys_errno);
}

std::ostream& operator<<(std::ostream& os, const Status& s) {
  return os << s.to_string();
}

Status errno_status(int err, std::string_view what) {
  if (err < 0) err = -err;
  StatusCode code = StatusCode::kIoError;
  switch (err) {
    case ENOSPC:
    case EDQUOT: code = StatusCode::kNoSpace; break;
    case EINVAL: code = StatusCode::kInvalidArgument; break;
    case ENOENT: code = StatusCode::kNotFound; break;
    case EEXIST: code = StatusCode::kAlreadyExists; break;
    case ENOMEM: code = StatusCode::kResourceExhausted; break;
    case ETIMEDOUT: code = StatusCode::kTimedOut; break;
    case ECANCELED: code = StatusCode::kCancelled; break;
    case ENOTSUP:
    case ENOSYS: code = StatusCode::kUnsupported; break;
    case EACCES:
    case EPERM:
    case ELOOP:
    case EROFS: code = StatusCode::kFailedPrecondition; break;
    default: break;
  }
  char buf[256];
  const char* text = strerror_r(err, buf, sizeof buf);  // GNU variant returns the string
  return Status(code, str(what, ": ", text), err);
}

namespace detail {
void die_on_bad_access(const Status& s, const char* what) noexcept {
  std::fprintf(stderr, "tier: fatal: %s: %s\n", what, s.to_string().c_str());
  std::fflush(stderr);
  std::abort();
}
}  // namespace detail

}  // namespace tier
