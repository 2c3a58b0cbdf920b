#include "tier/ext/io_engine.hpp"

#include <cerrno>

#include "nvme/backends.hpp"
#include "tier/log.hpp"

namespace tier::nvme {

const char* io_op_name(IoOp op) noexcept {
  return op == IoOp::kRead ? "read" : "write";
}

IoEngine::~IoEngine() = default;

Result<int> IoEngine::register_file(int fd) {
  if (fd < 0) return invalid_argument(str("I/O engine ", name(), ": cannot register file descriptor ", fd));
  for (std::size_t i = 0; i < files_.size(); ++i) {
    if (files_[i] < 0) {
      files_[i] = fd;
      return static_cast<int>(i);
    }
  }
  files_.push_back(fd);
  return static_cast<int>(files_.size() - 1);
}

void IoEngine::release_file_slot(int slot) noexcept {
  if (slot >= 0 && static_cast<std::size_t>(slot) < files_.size()) files_[slot] = -1;
}

Status IoEngine::unregister_file(int index) {
  if (index < 0 || static_cast<std::size_t>(index) >= files_.size() || files_[index] < 0) {
    return not_found(str("I/O engine ", name(), ": no registered file in slot ", index));
  }
  files_[index] = -1;
  return Status::Ok();
}

Status IoEngine::register_buffers(void*, std::uint64_t) {
  return unsupported(str("I/O engine ", name(), " has no fixed buffers; requests use plain buffers"));
}

Status IoEngine::reserve_buffers(void*, std::uint64_t) {
  return unsupported(str("I/O engine ", name(), " has no fixed buffers; requests use plain buffers"));
}

Status IoEngine::register_buffer_range(void*, std::uint64_t) {
  return unsupported(str("I/O engine ", name(), " has no fixed buffers; requests use plain buffers"));
}

IoEngineStats IoEngine::stats() const noexcept {
  IoEngineStats s;
  s.requests = requests_.load(std::memory_order_relaxed);
  s.fixed_buffer_requests = fixed_requests_.load(std::memory_order_relaxed);
  s.submit_calls = submit_calls_.load(std::memory_order_relaxed);
  return s;
}

void IoEngine::count_submit(std::uint64_t requests, std::uint64_t fixed, std::uint64_t calls) noexcept {
  requests_.fetch_add(requests, std::memory_order_relaxed);
  fixed_requests_.fetch_add(fixed, std::memory_order_relaxed);
  submit_calls_.fetch_add(calls, std::memory_order_relaxed);
}

int IoEngine::resolve_fd(const IoRequest& r) const noexcept {
  if (r.file_index < 0) return r.fd;
  if (static_cast<std::size_t>(r.file_index) >= files_.size()) return -1;
  return files_[r.file_index];
}

namespace detail {

int check_request(const IoRequest& r) noexcept {
  if (r.length == 0 || r.length > kMaxRequestBytes || r.buffer == nullptr) return EINVAL;
  if (r.tag >= kFirstReservedTag) return EINVAL;
  return 0;
}

}  // namespace detail

namespace {

Result<std::unique_ptr<IoEngine>> make_kind(IoEngineKind kind, const IoEngineOptions& o) {
  switch (kind) {
    case IoEngineKind::kUring: return detail::make_uring_engine(o);
    case IoEngineKind::kAio: return detail::make_aio_engine(o);
    case IoEngineKind::kPosix: return detail::make_posix_engine(o);
    case IoEngineKind::kAuto: break;
  }
  return internal_error("make_io_engine: no backend for kind auto");
}

}  // namespace

Result<std::unique_ptr<IoEngine>> make_io_engine(const IoEngineOptions& options) {
  if (options.queue_depth < 1 || options.queue_depth > 4096) {
    return invalid_argument(
        str("I/O engine: queue depth ", options.queue_depth, " is out of range; use 1 to 4096 (aio.queue_depth)"));
  }
  if (options.kind != IoEngineKind::kAuto) return make_kind(options.kind, options);

  std::string passed_over;
  for (IoEngineKind k : {IoEngineKind::kUring, IoEngineKind::kAio, IoEngineKind::kPosix}) {
    auto e = make_kind(k, options);
    if (e.ok()) {
      if (!passed_over.empty()) {
        log_once(str("nvme.auto_engine.", io_engine_kind_name(k)), LogLevel::kWarn,
                 str("I/O engine auto: using ", io_engine_kind_name(k), " (", passed_over,
                     "); set tier.io_engine to choose one explicitly"));
      } else {
        log_once("nvme.auto_engine", LogLevel::kDebug, str("I/O engine auto: using ", io_engine_kind_name(k)));
      }
      return e;
    }
    passed_over += str(passed_over.empty() ? "" : "; ", io_engine_kind_name(k), " unavailable: ", e.status().message());
  }
  return unsupported(str("I/O engine auto: no backend works here (", passed_over, ")"));
}

Status probe_io_engine(IoEngineKind kind) {
  if (kind == IoEngineKind::kAuto) return Status::Ok();
  IoEngineOptions o;
  o.kind = kind;
  o.queue_depth = 2;
  o.posix_threads = 1;
  auto e = make_io_engine(o);
  return e.ok() ? Status::Ok() : e.status();
}

}  // namespace tier::nvme
