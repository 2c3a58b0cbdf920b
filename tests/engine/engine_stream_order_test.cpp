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

#include "memory_backends.hpp"
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
    configure(c);
    auto e = Engine::create(c);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(e).value();
    ASSERT_TRUE(engine_->device().has(DeviceCap::kGpuStreams));
    a_ = add("a", pattern(1));
    b_ = add("b", pattern(2));
  }

  virtual void configure(EngineConfig&) {}

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

// Stream-ordered acquires (Engine::acquire_on_stream): copies to the device take 150 ms here, so
// a grant that came before the copy landed, and a stream that did not wait for it, both show.
class StreamOrderedAcquire : public StreamOrder {
 protected:
  void configure(EngineConfig& c) override {
    c.tier.emulated.latency_us = 150000;
    c.tier.device_budget = 4 * kBytes;
  }
  const char* device_state(TensorId id) {
    auto i = engine_->info(id);
    EXPECT_TRUE(i.ok()) << i.status();
    return i.ok() ? i->copy_state[static_cast<int>(Tier::kDevice)] : "?";
  }
};

TEST_F(StreamOrderedAcquire, IsGrantedWhileTheCopyIsInFlightAndItsStreamSeesTheBytes) {
  // A module's fetch: both loads start, both leases come back before either copy has landed, and
  // the "kernels" queued on the stream after the grants read the tensors' bytes.
  AcquireFuture fa = engine_->acquire_on_stream(a_, kStream);
  AcquireFuture fb = engine_->acquire_on_stream(b_, kStream);
  auto la = fa.wait();
  auto lb = fb.wait();
  ASSERT_TRUE(la.ok()) << la.status();
  ASSERT_TRUE(lb.ok()) << lb.status();
  EXPECT_STREQ(device_state(a_), "loading");  // the host did not wait for the copies
  EXPECT_STREQ(device_state(b_), "loading");
  EXPECT_EQ(la->tier(), Tier::kDevice);
  EXPECT_EQ(la->access(), Access::kRead);
  auto seen_a = read_on_stream(*la);
  auto seen_b = read_on_stream(*lb);
  ASSERT_TRUE(la->release_after(kStream).ok());
  ASSERT_TRUE(lb->release_after(kStream).ok());
  ASSERT_TRUE(engine_->device().synchronize().ok());
  EXPECT_EQ(*seen_a, pattern(1));
  EXPECT_EQ(*seen_b, pattern(2));
  EXPECT_STREQ(device_state(a_), "valid_clean");
  EXPECT_TRUE(engine_->check_invariants().ok()) << engine_->check_invariants();
  // Both leases ended: a writer gets the tensor.
  Lease w = acquire(a_, Tier::kHost, Access::kWrite);
  EXPECT_TRUE(w.valid());
  EXPECT_TRUE(w.abandon().ok());
}

TEST_F(StreamOrderedAcquire, ACopyAlreadyInPlaceIsGrantedAsAcquireGrantsIt) {
  Lease first = acquire(a_, Tier::kDevice, Access::kRead);
  ASSERT_TRUE(first.release().ok());
  ASSERT_STREQ(device_state(a_), "valid_clean");
  auto l = engine_->acquire_on_stream(a_, kStream).wait();
  ASSERT_TRUE(l.ok()) << l.status();
  auto seen = read_on_stream(*l);
  ASSERT_TRUE(l->release_after(kStream).ok());
  ASSERT_TRUE(engine_->device().synchronize().ok());
  EXPECT_EQ(*seen, pattern(1));
}

TEST_F(StreamOrderedAcquire, ALeaseEndedBeforeItsCopyLandedLeavesTheEngineConsistent) {
  // Wrong use (the stream may still read), but the engine's books must stay right: the load goes
  // on to completion and the copy becomes valid, unpinned.
  auto l = engine_->acquire_on_stream(a_, kStream).wait();
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_STREQ(device_state(a_), "loading");
  ASSERT_TRUE(l->release().ok());
  ASSERT_TRUE(engine_->device().synchronize().ok());
  Lease again = acquire(a_, Tier::kDevice, Access::kRead);  // waits for the load in flight
  ASSERT_TRUE(again.valid());
  std::vector<std::uint32_t> got(kWords);
  std::memcpy(got.data(), again.data(), kBytes);
  EXPECT_EQ(got, pattern(1));
  ASSERT_TRUE(again.release().ok());
  Lease w = acquire(a_, Tier::kDevice, Access::kWrite);  // no reader is left behind
  EXPECT_TRUE(w.valid());
  EXPECT_TRUE(w.abandon().ok());
  EXPECT_TRUE(engine_->check_invariants().ok()) << engine_->check_invariants();
}

TEST_F(StreamOrderedAcquire, AWriterWaitsForTheStreamOrderedReader) {
  auto l = engine_->acquire_on_stream(a_, kStream).wait();
  ASSERT_TRUE(l.ok()) << l.status();
  AcquireFuture fw = engine_->acquire(a_, Tier::kHost, Access::kWrite);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(fw.ready());
  ASSERT_TRUE(l->release_after(kStream).ok());
  auto w = fw.wait();
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->abandon().ok());
}

// An engine on the emulated device without delayed streams (the caller's thread is the stream),
// with tensor "a" (pattern(1), homed on the host).
struct PlainEngine {
  std::unique_ptr<Engine> engine;
  TensorId a = kInvalidTensor;
};

PlainEngine plain_engine(double latency_us) {
  EngineConfig c;
  c.tier.device = DeviceKind::kEmulated;
  c.tier.emulated.latency_us = latency_us;
  c.tier.device_budget = kBytes;
  c.tier.host_budget = 4 * kBytes;
  PlainEngine out;
  auto e = Engine::create(c);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return out;
  out.engine = std::move(e).value();
  EXPECT_FALSE(out.engine->device().has(DeviceCap::kGpuStreams));
  TensorDesc d;
  d.name = "a";
  d.dtype = DType::kF32;
  d.numel = kWords;
  const auto init = pattern(1);
  auto id = out.engine->register_tensor(d, Tier::kHost, init.data());
  EXPECT_TRUE(id.ok()) << id.status();
  if (id.ok()) out.a = *id;
  return out;
}

TEST(StreamOrderPlain, WithoutDelayedStreamsAStreamOrderedAcquireWaitsForTheCopy) {
  PlainEngine p = plain_engine(50000);
  ASSERT_TRUE(p.engine && p.a != kInvalidTensor);
  Engine& engine = *p.engine;
  const auto init = pattern(1);
  auto l = engine.acquire_on_stream(p.a, kStream).wait();
  ASSERT_TRUE(l.ok()) << l.status();
  // The caller's thread is the stream: the bytes are there when the lease is.
  EXPECT_STREQ(engine.info(p.a)->copy_state[static_cast<int>(Tier::kDevice)], "valid_clean");
  std::vector<std::uint32_t> got(kWords);
  std::memcpy(got.data(), l->data(), kBytes);
  EXPECT_EQ(got, init);
  EXPECT_TRUE(l->release_after(kStream).ok());
}

// The engine's state machine over in-memory tiers whose mover gives device events (as a GPU's
// copies do), with the emulated device's delayed streams as the consumer's streams: the two-hop
// load from NVMe and a copy that fails after it was queued.
class StreamOrderedMemory : public ::testing::Test {
 protected:
  void SetUp() override {
    DeviceOptions o;
    o.emulated.delayed_streams = true;
    o.budget_bytes = 1 << 20;
    auto d = create_emulated_device(o);
    ASSERT_TRUE(d.ok()) << d.status();
    streams_ = std::move(d).value();
    EngineConfig c;
    c.tier.acquire_timeout_ms = 10000;
    c.tier.debug_checks = true;
    auto m = testing::make_memory_engine(c, 4 * kBytes, 4 * kBytes, 8 * kBytes, 1, streams_.get());
    ASSERT_TRUE(m.ok()) << m.status();
    m_ = std::move(m).value();
    m_.mover->device_events = true;
    m_.mover->delay_us = 40000;
  }
  void TearDown() override {
    if (streams_) {
      EXPECT_TRUE(streams_->synchronize().ok());
    }
    m_.engine.reset();
  }
  TensorId add(const char* name, Tier home, const std::vector<std::uint32_t>& init) {
    TensorDesc d;
    d.name = name;
    d.dtype = DType::kF32;
    d.numel = kWords;
    auto id = m_.engine->register_tensor(d, home, init.data());
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : kInvalidTensor;
  }
  const char* state(TensorId id, Tier t) { return m_.engine->info(id)->copy_state[static_cast<int>(t)]; }
  std::shared_ptr<std::vector<std::uint32_t>> read_on_stream(const Lease& l) {
    auto seen = std::make_shared<std::vector<std::uint32_t>>(kWords);
    const void* src = l.data();
    EXPECT_TRUE(streams_->enqueue_host(kStream, [seen, src] { std::memcpy(seen->data(), src, kBytes); }).ok());
    return seen;
  }

  std::unique_ptr<Device> streams_;  // outlives the engine (declared first, reset last)
  testing::MemoryEngine m_;
};

TEST_F(StreamOrderedMemory, ATensorOnNvmeIsGrantedOnceItsCopyToTheDeviceIsQueued) {
  const TensorId a = add("a", Tier::kNvme, pattern(7));
  auto l = m_.engine->acquire_on_stream(a, kStream).wait();
  ASSERT_TRUE(l.ok()) << l.status();
  // The NVMe -> host hop was waited for (the host copy is the device copy's source); the copy to
  // the device was only queued.
  EXPECT_STREQ(state(a, Tier::kHost), "valid_clean");
  EXPECT_STREQ(state(a, Tier::kDevice), "loading");
  auto seen = read_on_stream(*l);
  ASSERT_TRUE(l->release_after(kStream).ok());
  ASSERT_TRUE(streams_->synchronize().ok());
  EXPECT_EQ(*seen, pattern(7));
  EXPECT_TRUE(m_.engine->check_invariants().ok()) << m_.engine->check_invariants();
}

TEST_F(StreamOrderedMemory, ACopyThatFailsAfterTheGrantFailsTheStreamAndKeepsTheTensor) {
  const TensorId a = add("a", Tier::kHost, pattern(8));
  m_.mover->fail_link(Tier::kHost, Tier::kDevice, true);
  auto l = m_.engine->acquire_on_stream(a, kStream).wait();
  ASSERT_TRUE(l.ok()) << l.status();  // granted on the queued copy, which then fails
  auto after = streams_->record_event(kStream);
  ASSERT_TRUE(after.ok());
  Status s = after->wait();
  EXPECT_FALSE(s.ok());  // the stream waited for the failed copy: its later work fails
  EXPECT_NE(s.message().find("injected failure"), std::string::npos) << s;
  // The leased memory stays the lease's until it ends; the host copy is still the tensor.
  for (int i = 0; i < 500 && std::string(state(a, Tier::kDevice)) == "loading"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_STREQ(state(a, Tier::kDevice), "stale");
  EXPECT_TRUE(m_.engine->check_invariants().ok()) << m_.engine->check_invariants();
  ASSERT_TRUE(l->release().ok());
  EXPECT_STREQ(state(a, Tier::kDevice), "absent");
  EXPECT_TRUE(m_.engine->check_invariants().ok()) << m_.engine->check_invariants();
  EXPECT_EQ(m_.engine->stats().tiers[static_cast<int>(Tier::kDevice)].resident_bytes, 0u);
  // With the link back, the next acquire loads the tensor's bytes.
  m_.mover->fail_link(Tier::kHost, Tier::kDevice, false);
  auto again = m_.engine->acquire(a, Tier::kDevice, Access::kRead).wait();
  ASSERT_TRUE(again.ok()) << again.status();
  std::vector<std::uint32_t> got(kWords);
  std::memcpy(got.data(), again->data(), kBytes);
  EXPECT_EQ(got, pattern(8));
}

TEST_F(StreamOrderedMemory, ASecondStreamOrderedAcquireOfAFailedLeasedCopyLoadsIntoItsStorage) {
  const TensorId a = add("a", Tier::kHost, pattern(9));
  m_.mover->fail_link(Tier::kHost, Tier::kDevice, true);
  auto l = m_.engine->acquire_on_stream(a, kStream).wait();
  ASSERT_TRUE(l.ok()) << l.status();
  for (int i = 0; i < 500 && std::string(state(a, Tier::kDevice)) == "loading"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_STREQ(state(a, Tier::kDevice), "stale");
  m_.mover->fail_link(Tier::kHost, Tier::kDevice, false);
  const DeviceStream other = reinterpret_cast<DeviceStream>(0x61);
  auto l2 = m_.engine->acquire_on_stream(a, other).wait();
  ASSERT_TRUE(l2.ok()) << l2.status();
  EXPECT_EQ(l2->data(), l->data());  // the same storage, loaded again
  auto seen = std::make_shared<std::vector<std::uint32_t>>(kWords);
  const void* src = l2->data();
  ASSERT_TRUE(streams_->enqueue_host(other, [seen, src] { std::memcpy(seen->data(), src, kBytes); }).ok());
  ASSERT_TRUE(l->release().ok());
  ASSERT_TRUE(l2->release_after(other).ok());
  auto done = streams_->record_event(other);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(done->wait().ok());
  EXPECT_EQ(*seen, pattern(9));
  for (int i = 0; i < 500 && std::string(state(a, Tier::kDevice)) == "loading"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_STREQ(state(a, Tier::kDevice), "valid_clean");
  EXPECT_TRUE(m_.engine->check_invariants().ok()) << m_.engine->check_invariants();
}

TEST(StreamOrderPlain, WithoutDelayedStreamsReleaseAfterIsRelease) {
  PlainEngine p = plain_engine(0);
  ASSERT_TRUE(p.engine && p.a != kInvalidTensor);
  Engine& engine = *p.engine;
  auto l = engine.acquire(p.a, Tier::kDevice, Access::kReadWrite).wait();
  ASSERT_TRUE(l.ok());
  bool ran = false;
  ASSERT_TRUE(engine.device().enqueue_host(kStream, [&] { ran = true; }).ok());
  EXPECT_TRUE(ran);  // the caller's thread is the stream
  ASSERT_TRUE(l->release_after(kStream).ok());
  auto w = engine.acquire(p.a, Tier::kHost, Access::kWrite).wait_for(std::chrono::milliseconds(5000));
  EXPECT_TRUE(w.ok()) << w.status();  // ended at once
}

}  // namespace
}  // namespace tier
