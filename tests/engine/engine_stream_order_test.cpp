// Leases that end in stream order, on the emulated device's delayed streams
// (tier.emulated.delayed_streams): each stream handle is a worker that runs its queued work later
// than the caller queued it, as a GPU does. A consumer that ends a lease while work on its stream
// still uses the memory sees the engine reuse that memory: the "MissingOrder" tests show the mode
// catches it, the others that Lease::release_after does not let it happen.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "tier/engine.hpp"
#include "tier/ext/device.hpp"

namespace tier {
namespace {

constexpr std::uint64_t kWords = 64 * 1024;  // 256 KiB tensors
constexpr std::uint64_t kBytes = kWords * 4;
const DeviceStream kStream = reinterpret_cast<DeviceStream>(0x51);

std::vector<std::uint32_t> pattern(std::uint32_t seed) {
  std::vector<std::uint32_t> v(kWords);
  for (std::uint64_t i = 0; i < kWords; ++i) v[i] = seed * 2654435761u + static_cast<std::uint32_t>(i);
  return v;
}

// Holds a stream until open(): what is queued behind it runs only after the test's next steps.
class Gate {
 public:
  Gate(Device& d, DeviceStream s) {
    EXPECT_TRUE(d.enqueue_host(s, [st = st_] {
                   std::unique_lock<std::mutex> lock(st->mu);
                   st->cv.wait(lock, [&] { return st->open; });
                 }).ok());
  }
  ~Gate() { open(); }
  void open() {
    {
      std::lock_guard<std::mutex> lock(st_->mu);
      st_->open = true;
    }
    st_->cv.notify_all();
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;
  };
  std::shared_ptr<State> st_ = std::make_shared<State>();
};

class StreamOrder : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineConfig c;
    c.tier.device = DeviceKind::kEmulated;
    c.tier.emulated.delayed_streams = true;
    c.tier.device_budget = kBytes;  // one tensor: a second one takes the first one's memory
    c.tier.host_budget = 8 * kBytes;
    c.tier.acquire_timeout_ms = 10000;
    c.tier.debug_checks = true;
    auto e = Engine::create(c);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(e).value();
    ASSERT_TRUE(engine_->device().has(DeviceCap::kGpuStreams));
    a_ = add("a", pattern(1));
    b_ = add("b", pattern(2));
  }

  TensorId add(const char* name, const std::vector<std::uint32_t>& init) {
    TensorDesc d;
    d.name = name;
    d.dtype = DType::kF32;
    d.numel = kWords;
    auto id = engine_->register_tensor(d, Tier::kHost, init.data());
    EXPECT_TRUE(id.ok()) << id.status();
    return *id;
  }

  Lease acquire(TensorId id, Tier t, Access a) {
    auto l = engine_->acquire(id, t, a).wait();
    EXPECT_TRUE(l.ok()) << l.status();
    return l.ok() ? std::move(l).value() : Lease();
  }

  std::vector<std::uint32_t> host_contents(TensorId id) {
    Lease l = acquire(id, Tier::kHost, Access::kRead);
    std::vector<std::uint32_t> v(kWords);
    if (l.valid()) std::memcpy(v.data(), l.data(), kBytes);
    EXPECT_TRUE(l.release().ok());
    return v;
  }

  // A "kernel" on kStream that copies what the lease's memory holds when it runs.
  std::shared_ptr<std::vector<std::uint32_t>> read_on_stream(const Lease& l) {
    auto seen = std::make_shared<std::vector<std::uint32_t>>(kWords);
    const void* src = l.data();
    EXPECT_TRUE(engine_->device().enqueue_host(kStream, [seen, src] { std::memcpy(seen->data(), src, kBytes); }).ok());
    return seen;
  }

  std::unique_ptr<Engine> engine_;
  TensorId a_ = kInvalidTensor;
  TensorId b_ = kInvalidTensor;
};

TEST_F(StreamOrder, DelayedStreamsRunLaterAndInOrder) {
  Device& d = engine_->device();
  std::vector<int> order;
  std::mutex mu;
  auto gate = std::make_unique<Gate>(d, kStream);
  ASSERT_TRUE(d.enqueue_host(kStream, [&] {
                 std::lock_guard<std::mutex> lock(mu);
                 order.push_back(1);
               }).ok());
  auto ev = d.record_event(kStream);
  ASSERT_TRUE(ev.ok());
  ASSERT_TRUE(d.enqueue_host(kStream, [&] {
                 std::lock_guard<std::mutex> lock(mu);
                 order.push_back(2);
               }).ok());
  // The host goes on while the stream is held: nothing ran, the event is pending.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(ev->ready());
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_TRUE(order.empty());
  }
  // Another stream is not held by this one.
  const DeviceStream other = reinterpret_cast<DeviceStream>(0x52);
  auto other_ev = d.record_event(other);
  ASSERT_TRUE(other_ev.ok());
  EXPECT_TRUE(other_ev->wait_for(std::chrono::milliseconds(5000)).ok());
  // A stream waiting on a held one's event runs after it.
  ASSERT_TRUE(d.stream_wait(other, *ev).ok());
  auto after = d.record_event(other);
  ASSERT_TRUE(after.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_FALSE(after->ready());
  gate->open();
  ASSERT_TRUE(d.synchronize().ok());
  EXPECT_TRUE(ev->ready() && ev->status().ok());
  EXPECT_TRUE(after->ready() && after->status().ok());
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
}

TEST_F(StreamOrder, AStreamThatWaitedForAFailedEventFailsItsLaterEvents) {
  Device& d = engine_->device();
  ASSERT_TRUE(d.stream_wait(kStream, DeviceEvent::completed(device_error("injected"))).ok());
  auto ev = d.record_event(kStream);
  ASSERT_TRUE(ev.ok());
  Status s = ev->wait();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("injected"), std::string::npos) << s;
}

TEST_F(StreamOrder, MissingOrderIsCaught) {
  // Without stream order the delayed stream reads memory the engine already gave another tensor.
  Gate gate(engine_->device(), kStream);
  Lease la = acquire(a_, Tier::kDevice, Access::kRead);
  const void* where = la.data();
  auto seen = read_on_stream(la);
  ASSERT_TRUE(la.release().ok());  // wrong: the stream has not read yet
  Lease lb = acquire(b_, Tier::kDevice, Access::kWrite);
  ASSERT_EQ(lb.data(), where) << "the test needs b placed in a's block";
  const auto c = pattern(3);
  std::memcpy(lb.data(), c.data(), kBytes);
  gate.open();
  ASSERT_TRUE(engine_->device().synchronize().ok());
  EXPECT_EQ(*seen, c);
  EXPECT_NE(*seen, pattern(1));
  ASSERT_TRUE(lb.release().ok());
}

TEST_F(StreamOrder, AReadLeaseEndsAfterItsStream) {
  Gate gate(engine_->device(), kStream);
  Lease la = acquire(a_, Tier::kDevice, Access::kRead);
  auto seen = read_on_stream(la);
  ASSERT_TRUE(la.release_after(kStream).ok());
  EXPECT_FALSE(la.valid());
  // b needs a's memory, which stays pinned until the stream has passed the read.
  AcquireFuture fb = engine_->acquire(b_, Tier::kDevice, Access::kWrite);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(fb.ready());
  gate.open();
  auto lb = fb.wait();
  ASSERT_TRUE(lb.ok()) << lb.status();
  const auto c = pattern(3);
  std::memcpy(lb->data(), c.data(), kBytes);
  ASSERT_TRUE(lb->release().ok());
  ASSERT_TRUE(engine_->device().synchronize().ok());
  EXPECT_EQ(*seen, pattern(1));
  EXPECT_EQ(host_contents(a_), pattern(1));
  EXPECT_EQ(host_contents(b_), c);
}

TEST_F(StreamOrder, MissingOrderPublishesAWriteBeforeItIsMade) {
  Gate gate(engine_->device(), kStream);
  Lease la = acquire(a_, Tier::kDevice, Access::kWrite);
  void* dst = la.data();
  const auto w = pattern(4);
  ASSERT_TRUE(engine_->device().enqueue_host(kStream, [dst, &w] { std::memcpy(dst, w.data(), kBytes); }).ok());
  ASSERT_TRUE(la.release().ok());  // wrong: the stream has not written yet
  EXPECT_NE(host_contents(a_), w);
  gate.open();
  ASSERT_TRUE(engine_->device().synchronize().ok());
}

TEST_F(StreamOrder, AWriteLeaseIsPublishedAfterItsStream) {
  Gate gate(engine_->device(), kStream);
  Lease la = acquire(a_, Tier::kDevice, Access::kWrite);
  void* dst = la.data();
  const auto w = pattern(4);
  ASSERT_TRUE(engine_->device().enqueue_host(kStream, [dst, &w] { std::memcpy(dst, w.data(), kBytes); }).ok());
  ASSERT_TRUE(la.release_after(kStream).ok());
  AcquireFuture fh = engine_->acquire(a_, Tier::kHost, Access::kRead);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(fh.ready());  // the writer holds the tensor until its stream has written
  gate.open();
  auto lh = fh.wait();
  ASSERT_TRUE(lh.ok()) << lh.status();
  std::vector<std::uint32_t> got(kWords);
  std::memcpy(got.data(), lh->data(), kBytes);
  EXPECT_EQ(got, w);
  ASSERT_TRUE(lh->release().ok());
}

TEST_F(StreamOrder, AFailedEventAbandonsAWriteAndEndsARead) {
  Lease la = acquire(a_, Tier::kDevice, Access::kWrite);
  const auto w = pattern(5);
  std::memcpy(la.data(), w.data(), kBytes);
  ASSERT_TRUE(la.release_after(DeviceEvent::completed(device_error("the stream failed"))).ok());
  EXPECT_EQ(host_contents(a_), pattern(1));  // the partial write is not published

  Lease lr = acquire(a_, Tier::kDevice, Access::kRead);
  ASSERT_TRUE(lr.release_after(DeviceEvent::completed(device_error("the stream failed"))).ok());
  Lease lw = acquire(a_, Tier::kHost, Access::kWrite);  // a writer passes: the read lease ended
  EXPECT_TRUE(lw.valid());
  EXPECT_TRUE(lw.abandon().ok());
}

TEST_F(StreamOrder, BadCallsAreRefusedAndKeepTheLease) {
  Lease empty;
  EXPECT_EQ(empty.release_after(kStream).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(empty.release_after(DeviceEvent::completed()).code(), StatusCode::kFailedPrecondition);
  Lease la = acquire(a_, Tier::kDevice, Access::kRead);
  EXPECT_EQ(la.release_after(DeviceEvent()).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(la.valid());
  EXPECT_TRUE(la.release_after(kStream).ok());
  EXPECT_EQ(la.release_after(kStream).code(), StatusCode::kFailedPrecondition);  // twice
  EXPECT_EQ(la.release().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(engine_->device().synchronize().ok());
}

TEST_F(StreamOrder, ALeaseThatOutlivesItsEngineEndsHarmlessly) {
  Lease la = acquire(a_, Tier::kHost, Access::kRead);
  Lease lb = acquire(b_, Tier::kDevice, Access::kRead);
  // A deferred end whose stream passes only while the engine is going away.
  std::thread opener;
  {
    auto gate = std::make_shared<Gate>(engine_->device(), kStream);
    ASSERT_TRUE(lb.release_after(kStream).ok());
    opener = std::thread([gate] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      gate->open();
    });
  }
  engine_.reset();
  opener.join();
  EXPECT_TRUE(la.release_after(kStream).ok());  // the engine is gone: the lease just ends
  EXPECT_FALSE(la.valid());
}

TEST(StreamOrderPlain, WithoutDelayedStreamsReleaseAfterIsRelease) {
  EngineConfig c;
  c.tier.device = DeviceKind::kEmulated;
  c.tier.device_budget = kBytes;
  c.tier.host_budget = 4 * kBytes;
  auto e = Engine::create(c);
  ASSERT_TRUE(e.ok()) << e.status();
  Engine& engine = **e;
  EXPECT_FALSE(engine.device().has(DeviceCap::kGpuStreams));
  TensorDesc d;
  d.name = "a";
  d.dtype = DType::kF32;
  d.numel = kWords;
  const auto init = pattern(1);
  auto id = engine.register_tensor(d, Tier::kHost, init.data());
  ASSERT_TRUE(id.ok());
  auto l = engine.acquire(*id, Tier::kDevice, Access::kReadWrite).wait();
  ASSERT_TRUE(l.ok());
  bool ran = false;
  ASSERT_TRUE(engine.device().enqueue_host(kStream, [&] { ran = true; }).ok());
  EXPECT_TRUE(ran);  // the caller's thread is the stream
  ASSERT_TRUE(l->release_after(kStream).ok());
  auto w = engine.acquire(*id, Tier::kHost, Access::kWrite).wait_for(std::chrono::milliseconds(5000));
  EXPECT_TRUE(w.ok()) << w.status();  // ended at once
}

}  // namespace
}  // namespace tier
