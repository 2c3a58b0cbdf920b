// tier/ext/io_future.hpp — the handle of one asynchronous transfer: poll it, wait for it, or have a
// callback run when it completes.
//
// A transfer either completes whole (ok) or fails with the status of its first failed request (the
// path, the file offset and the errno are in the message); there is no partial success, so a read
// whose future failed must not be treated as having produced data. Callbacks let a scheduler chain
// stages (NVMe -> host -> device) without a waiting thread.
//
// Thread safety: every member may be called from any thread, on copies of the same future too.
// A callback runs exactly once: on the I/O thread that completed the transfer, or at once on the
// caller's thread when the transfer is already complete and its earlier callbacks have all run
// (one added while they still run is run after them, by the thread running them). Keep callbacks short (they hold up
// the I/O thread that runs them), never wait() inside one on a transfer of the same swap space, and never destroy the
// swap space from one (its destructor joins the thread the callback runs on). Extension interface
// (include/tier/ext/README.md): stable for backends, tests and tools; not the user API.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "tier/status.hpp"

namespace tier::nvme {

namespace detail {
class IoOpState;
}

class [[nodiscard]] IoFuture {
 public:
  // An empty future: valid() is false, ready() is true and wait() reports kFailedPrecondition.
  IoFuture() = default;
  explicit IoFuture(std::shared_ptr<detail::IoOpState> state) noexcept : state_(std::move(state)) {}

  // A future that is already complete with `status` (an error, or ok for a no-op transfer).
  static IoFuture completed(Status status, std::uint64_t bytes = 0);

  bool valid() const noexcept { return state_ != nullptr; }
  // Whether the transfer has finished, successfully or not.
  bool ready() const noexcept;
  // Blocks until the transfer finishes and returns its status (the same on every call).
  Status wait() const;
  // Waits at most `timeout`; returns whether the transfer finished.
  bool wait_for(std::chrono::nanoseconds timeout) const;
  // The status once ready(); kFailedPrecondition ("still in flight") before.
  Status status() const;
  // Runs `fn(status)` once when the transfer finishes (see the thread-safety note above). Several
  // callbacks may be added; they run in the order added.
  void on_complete(std::function<void(const Status&)> fn) const;
  // Asks the transfer to stop: requests not yet sent to the kernel are dropped and the future
  // finishes with kCancelled, unless it finished first. Requests already in flight complete (their
  // buffers stay in use until the future is ready). A cancelled write leaves the extent's content
  // undefined; a cancelled read leaves the destination undefined.
  void cancel() const noexcept;
  // Bytes the transfer moves (as asked).
  std::uint64_t bytes() const noexcept;

 private:
  std::shared_ptr<detail::IoOpState> state_;
};

// Waits for every future and returns the first error (in the order given), or ok.
Status wait_all(const IoFuture* futures, std::size_t n);

}  // namespace tier::nvme
