// Test backends for the engine's state machine: every tier is plain host memory with a capacity,
// and a worker thread moves bytes with memcpy, with an optional delay per transfer and injected
// failures. They let tests drive eviction, prefetch and error paths quickly and deterministically;
// the same tests also run on the real backends (engine_real_test.cpp).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "engine/backend.hpp"
#include "gpu/event_state.hpp"

namespace tier::testing {

class MemoryStore : public detail::TierStore {
 public:
  // `granule`: every allocation takes a multiple of it from the capacity, so that the store can be
  // full while the engine's budget (which counts the bytes asked for) still has room, as a
  // fragmented pinned arena can be.
  explicit MemoryStore(std::uint64_t capacity, std::uint64_t granule = 1) : capacity_(capacity), granule_(granule) {}
  Result<detail::Buffer> allocate(std::uint64_t bytes) override {
    const std::uint64_t taken = (bytes + granule_ - 1) / granule_ * granule_;
    if (used_->load() + taken > capacity_) return resource_exhausted("memory store full");
    void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    if (!p) return resource_exhausted("aligned_alloc failed");
    std::memset(p, 0xA5, bytes);  // garbage: the engine must never read what it did not write
    used_->fetch_add(taken);
    auto used = used_;
    detail::Buffer b;
    b.ptr = p;
    b.bytes = bytes;
    b.holder = std::shared_ptr<void>(p, [used, taken](void* q) {
      used->fetch_sub(taken);
      std::free(q);
    });
    return b;
  }
  std::uint64_t capacity() const override { return capacity_; }
  std::string describe() const override { return "memory"; }

 private:
  std::uint64_t capacity_;
  std::uint64_t granule_;
  std::shared_ptr<std::atomic<std::uint64_t>> used_ = std::make_shared<std::atomic<std::uint64_t>>(0);
};

class ThreadMover : public detail::Mover {
 public:
  explicit ThreadMover(std::shared_ptr<Counters> counters) : counters_(std::move(counters)) {
    worker_ = std::thread([this] { run(); });
  }
  ~ThreadMover() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  DeviceEvent move(Tier from, const detail::Buffer& src, Tier to, const detail::Buffer& dst, std::uint64_t bytes,
                   detail::Done done) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<detail::EventState> ev;
    // As a GPU's copy gives one: an event that completes once the bytes have landed.
    if (device_events.load() && to == Tier::kDevice) ev = detail::EventState::pending();
    jobs_.push_back(Job{from, to, src, dst, bytes, std::move(done), ev});
    cv_.notify_one();
    return ev ? DeviceEvent(ev) : DeviceEvent{};  // without: nothing for a stream to wait on
  }
  Status zero(Tier, const detail::Buffer& dst, std::uint64_t bytes) override {
    std::memset(dst.ptr, 0, bytes);
    return Status::Ok();
  }
  Status sync() override {
    ++syncs;
    return Status::Ok();
  }

  // Every transfer from `from` to `to` fails with EIO while set.
  void fail_link(Tier from, Tier to, bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_[static_cast<int>(from)][static_cast<int>(to)] = on;
  }
  std::atomic<int> delay_us{0};
  std::atomic<int> syncs{0};
  // Copies to the device return an event (see move) while set.
  std::atomic<bool> device_events{false};

 private:
  struct Job {
    Tier from, to;
    detail::Buffer src, dst;
    std::uint64_t bytes;
    detail::Done done;
    std::shared_ptr<detail::EventState> event;  // the copy's device event, if move() gave one
  };
  static Link link_of(Tier from, Tier to) {
    if (from == Tier::kNvme) return Link::kNvmeToHost;
    if (to == Tier::kNvme) return Link::kHostToNvme;
    if (to == Tier::kDevice) return Link::kHostToDevice;
    return Link::kDeviceToHost;
  }
  void run() {
    while (true) {
      Job job;
      bool fail = false;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
        fail = fail_[static_cast<int>(job.from)][static_cast<int>(job.to)];
      }
      auto t = counters_->begin(link_of(job.from, job.to));
      if (delay_us.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us.load()));
      if (fail) {
        job.src = detail::Buffer{};
        job.dst = detail::Buffer{};
        t.finish(0, false);
        const Status failed =
            errno_status(EIO, str("injected failure ", tier_name(job.from), " -> ", tier_name(job.to)));
        if (job.event) job.event->complete(failed);
        job.done(failed);
        continue;
      }
      std::memcpy(job.dst.ptr, job.src.ptr, job.bytes);
      t.finish(job.bytes);
      // Drop this thread's references before completing: the engine may free the storage at once.
      job.src = detail::Buffer{};
      job.dst = detail::Buffer{};
      if (job.event) job.event->complete(Status::Ok());
      job.done(Status::Ok());
    }
  }
  std::shared_ptr<Counters> counters_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool fail_[kNumTiers][kNumTiers] = {};
  bool stop_ = false;
  std::thread worker_;
};

struct MemoryEngine {
  std::unique_ptr<Engine> engine;
  ThreadMover* mover = nullptr;
  std::shared_ptr<Counters> counters;
};

// device/host/nvme capacities in bytes (0: tier absent).
// `host_granule`: the host store's allocation granule (see MemoryStore).
// `streams`: a device whose streams the engine orders consumers on (Engine::acquire_on_stream);
// the caller keeps it alive past the engine.
inline Result<MemoryEngine> make_memory_engine(EngineConfig cfg, std::uint64_t device, std::uint64_t host,
                                               std::uint64_t nvme, std::uint64_t host_granule = 1,
                                               Device* streams = nullptr) {
  MemoryEngine m;
  m.counters = std::make_shared<Counters>();
  detail::Backends b;
  if (device) b.stores[0] = std::make_unique<MemoryStore>(device);
  if (host) b.stores[1] = std::make_unique<MemoryStore>(host, host_granule);
  if (nvme) b.stores[2] = std::make_unique<MemoryStore>(nvme);
  auto mover = std::make_unique<ThreadMover>(m.counters);
  m.mover = mover.get();
  b.mover = std::move(mover);
  b.device = streams;
  TIER_ASSIGN_OR_RETURN(m.engine, detail::make_engine(cfg, std::move(b), m.counters));
  return m;
}

}  // namespace tier::testing
