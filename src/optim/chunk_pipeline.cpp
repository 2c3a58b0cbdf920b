#include "optim/chunk_pipeline.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

namespace tier::optim::detail {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Union of the intervals during which count > 0.
struct BusyClock {
  unsigned count = 0;
  Clock::time_point since;
  double total = 0;
  void start(Clock::time_point now) {
    if (count++ == 0) since = now;
  }
  void stop(Clock::time_point now) {
    if (--count == 0) total += seconds_between(since, now);
  }
};

class Pipeline : public std::enable_shared_from_this<Pipeline> {
 public:
  Pipeline(nvme::SwapSpace& swap, std::vector<Chunk>& chunks, std::vector<Buffer>& bufs, bool read, bool write,
           const std::vector<std::size_t>* order, const std::function<void(std::size_t)>* written)
      : swap_(swap),
        chunks_(chunks),
        order_(order),
        written_(written),
        n_(order ? order->size() : chunks.size()),
        bufs_(bufs),
        read_(read),
        write_(write),
        read_state_(chunks.size(), 0),
        buf_free_(bufs.size(), 1) {}

  Status run(const std::function<Status(std::size_t, Buffer&)>& process, PipelineStats* stats,
             const std::vector<std::uint8_t>* preloaded, std::vector<LeftoverRead>* leftover) {
    const std::size_t n = n_;
    const std::size_t nb = bufs_.size();
    double update_busy = 0, update_wait = 0;
    if (read_) {
      for (std::size_t k = 0; k < std::min(nb, n); ++k) {
        const bool have = preloaded && k < preloaded->size() && (*preloaded)[k] && write_;
        {
          std::lock_guard<std::mutex> lk(mu_);
          buf_free_[k] = 0;
          if (have) {
            read_state_[k] = 1;  // already in buffer k: no transfer
            continue;
          }
          reserve_locked(true);
        }
        issue_read(k);
      }
    }
    std::size_t processed = 0;  // positions [0, processed) were handed to `process`
    for (std::size_t i = 0; i < n; ++i) {
      Buffer& b = bufs_[i % nb];
      {
        std::unique_lock<std::mutex> lk(mu_);
        const auto t0 = Clock::now();
        if (read_) {
          cv_.wait(lk, [&] { return read_state_[i] != 0 || !error_.ok(); });
        } else {
          cv_.wait(lk, [&] { return buf_free_[i % nb] != 0 || !error_.ok(); });
          buf_free_[i % nb] = 0;
        }
        update_wait += seconds_between(t0, Clock::now());
        if (!error_.ok() || (read_ && read_state_[i] != 1)) break;
      }
      const auto t1 = Clock::now();
      processed = i + 1;
      Status s = process(at(i), b);
      update_busy += seconds_between(t1, Clock::now());
      ++updates_;
      if (s.code() == StatusCode::kCancelled) processed = i;  // it left the buffer as it was
      if (!s.ok()) {
        std::lock_guard<std::mutex> lk(mu_);
        if (error_.ok()) error_ = std::move(s);
        break;
      }
      if (write_) {
        {
          std::lock_guard<std::mutex> lk(mu_);
          reserve_locked(false);
        }
        issue_write(i);
      } else {
        // Read-only: the buffer is free once processed; it takes the read of chunk i + B.
        std::size_t next = 0;
        {
          std::lock_guard<std::mutex> lk(mu_);
          buf_free_[i % nb] = 1;
          if (read_ && i + nb < n && error_.ok()) {
            next = i + nb;
            reserve_locked(true);
            buf_free_[i % nb] = 0;
          }
        }
        if (next) issue_read(next);
      }
    }
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return in_flight_ == 0; });
    if (leftover && read_ && write_) {
      // A position handed to `process` may have been changed by it, even if it failed; later
      // positions whose reads completed hold their committed records untouched.
      leftover->clear();
      for (std::size_t k = processed; k < n; ++k) {
        if (read_state_[k] == 1) leftover->push_back({at(k), k % nb});
      }
    }
    if (stats) {
      stats->read = {read_bytes_, reads_, read_clock_.total};
      stats->write = {write_bytes_, writes_, write_clock_.total};
      stats->update = {0, updates_, update_busy};
      stats->io_busy_seconds = io_clock_.total;
      stats->update_wait_seconds = update_wait;
      stats->max_in_flight = max_in_flight_;
    }
    return error_;
  }

 private:
  // Counts a transfer as in flight before it is issued, so that run() cannot return while a
  // callback is about to issue one. Under mu_.
  void reserve_locked(bool is_read) {
    const auto now = Clock::now();
    ++in_flight_;
    max_in_flight_ = std::max(max_in_flight_, in_flight_);
    io_clock_.start(now);
    (is_read ? read_clock_ : write_clock_).start(now);
  }

  void release_locked(bool is_read) {
    const auto now = Clock::now();
    --in_flight_;
    io_clock_.stop(now);
    (is_read ? read_clock_ : write_clock_).stop(now);
  }

  // The chunk at position k of the sequence.
  std::size_t at(std::size_t k) const { return order_ ? (*order_)[k] : k; }

  void issue_read(std::size_t k) {
    const Chunk& c = chunks_[at(k)];
    Buffer& b = bufs_[k % bufs_.size()];
    nvme::IoFuture f = swap_.read(c.slot[c.committed], b.state, c.bytes());
    f.on_complete([self = shared_from_this(), k](const Status& s) { self->read_done(k, s); });
  }

  void issue_write(std::size_t i) {
    const Chunk& c = chunks_[at(i)];
    Buffer& b = bufs_[i % bufs_.size()];
    const nvme::SwapExtent& to = c.next ? c.next : c.slot[1 - c.committed];
    nvme::IoFuture f = swap_.write(to, b.state, c.bytes());
    f.on_complete([self = shared_from_this(), i](const Status& s) { self->write_done(i, s); });
  }

  void read_done(std::size_t k, const Status& s) {
    std::lock_guard<std::mutex> lk(mu_);
    release_locked(true);
    if (s.ok()) {
      read_state_[k] = 1;
      read_bytes_ += chunks_[at(k)].bytes();
      ++reads_;
    } else {
      read_state_[k] = 2;
      if (error_.ok()) error_ = s.with_context(str("reading chunk ", at(k), " of ", chunks_.size()));
    }
    cv_.notify_all();
  }

  void write_done(std::size_t i, const Status& s) {
    const std::size_t nb = bufs_.size();
    std::size_t next = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (s.ok()) {
        write_bytes_ += chunks_[at(i)].bytes();
        ++writes_;
        if (written_ != nullptr) (*written_)(at(i));
      } else if (error_.ok()) {
        error_ = s.with_context(str("writing chunk ", at(i), " of ", chunks_.size()));
      }
      buf_free_[i % nb] = 1;
      // Released before the next read is reserved (in one critical section, so run() never sees
      // nothing in flight in between): a buffer is counted once.
      release_locked(false);
      if (read_ && s.ok() && error_.ok() && i + nb < n_) {
        next = i + nb;
        reserve_locked(true);
        buf_free_[i % nb] = 0;
      }
      cv_.notify_all();
    }
    if (next) issue_read(next);
  }

  nvme::SwapSpace& swap_;
  std::vector<Chunk>& chunks_;
  const std::vector<std::size_t>* order_;
  const std::function<void(std::size_t)>* written_;
  const std::size_t n_;  // positions in the sequence
  std::vector<Buffer>& bufs_;
  const bool read_, write_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::uint8_t> read_state_;  // 0 in flight or not issued, 1 ok, 2 failed
  std::vector<std::uint8_t> buf_free_;
  Status error_;
  unsigned in_flight_ = 0;
  unsigned max_in_flight_ = 0;
  BusyClock read_clock_, write_clock_, io_clock_;
  std::uint64_t read_bytes_ = 0, write_bytes_ = 0, reads_ = 0, writes_ = 0, updates_ = 0;
};

}  // namespace

Status run_pipeline(nvme::SwapSpace& swap, std::vector<Chunk>& chunks, std::vector<Buffer>& bufs, bool read, bool write,
                    const std::function<Status(std::size_t, Buffer&)>& process, PipelineStats* stats,
                    const std::vector<std::size_t>* order, const std::vector<std::uint8_t>* preloaded,
                    std::vector<LeftoverRead>* leftover, const std::function<void(std::size_t)>* written) {
  if (bufs.empty()) return internal_error("optimizer pipeline: no buffers");
  if (order && order->size() > chunks.size()) return internal_error("optimizer pipeline: a chunk order too long");
  auto p = std::make_shared<Pipeline>(swap, chunks, bufs, read, write, order, written);
  return p->run(process, stats, preloaded, leftover);
}

}  // namespace tier::optim::detail
