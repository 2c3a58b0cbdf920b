// The device conformance suite: the same behaviours checked on every Device implementation — the
// emulated device (unpaced and paced) everywhere, CudaDevice where a GPU is usable (skipped, with
// the reason, elsewhere).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "gpu/caching_allocator.hpp"
#include "gpu/device_test_util.hpp"
#include "tier/ext/device.hpp"
#include "tier/stats.hpp"

namespace tier {
namespace {

using namespace std::chrono_literals;
using test::make_arena;
using test::pattern;

constexpr std::uint64_t kMiB = 1ull << 20;

struct Impl {
  const char* name;
  DeviceKind kind;
  EmulatedDeviceConfig emulated;
};

void PrintTo(const Impl& impl, std::ostream* os) {
  *os << impl.name;
}

class DeviceConformance : public ::testing::TestWithParam<Impl> {
 protected:
  void SetUp() override {
    if (GetParam().kind == DeviceKind::kCuda) TIER_SKIP_WITHOUT_CUDA();
    arena_ = make_arena(64 * kMiB);
    ASSERT_TRUE(arena_);
  }

  std::unique_ptr<Device> make(std::uint64_t budget = 256 * kMiB, std::chrono::milliseconds timeout = 0ms,
                               Counters* counters = nullptr) {
    DeviceOptions o;
    o.kind = GetParam().kind;
    o.budget_bytes = budget;
    o.alloc_timeout = timeout;
    o.emulated = GetParam().emulated;
    o.counters = counters;
    auto d = o.kind == DeviceKind::kCuda ? create_cuda_device(o) : create_emulated_device(o);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return nullptr;
    EXPECT_TRUE((*d)->register_host(arena_->base(), arena_->capacity()).ok());
    return std::move(d).value();
  }

  // Host memory from the pinned arena.
  HostBlock host(std::uint64_t bytes) {
    auto b = arena_->allocate(bytes);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? std::move(b).value() : HostBlock();
  }

  std::unique_ptr<HostArena> arena_;
};

TEST_P(DeviceConformance, ReportsItsKindNameAndCapabilities) {
  auto d = make();
  ASSERT_TRUE(d);
  const DeviceInfo& info = d->info();
  EXPECT_EQ(info.kind, GetParam().kind);
  EXPECT_TRUE(info.has(DeviceCap::kAsyncCopy));
  EXPECT_EQ(info.budget_bytes, 256 * kMiB);
  EXPECT_FALSE(info.detail.empty());
  if (info.kind == DeviceKind::kCuda) {
    EXPECT_EQ(info.name.rfind("cuda: ", 0), 0u) << info.name;
    EXPECT_TRUE(info.has(DeviceCap::kGpuStreams));
    EXPECT_TRUE(info.has(DeviceCap::kHostRegister));
    EXPECT_FALSE(info.has(DeviceCap::kHostAddressable));
  } else {
    EXPECT_EQ(info.name, "emulated");
    EXPECT_TRUE(info.has(DeviceCap::kHostAddressable));
    EXPECT_TRUE(info.has(DeviceCap::kDuplexCopy));
    EXPECT_FALSE(info.has(DeviceCap::kGpuStreams));
  }
}

TEST_P(DeviceConformance, AllocatesBySizeClassAndTracksStats) {
  auto d = make();
  ASSERT_TRUE(d);
  auto b = d->allocate(1000);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE(b->data(), nullptr);
  EXPECT_EQ(b->size(), 1000u);
  EXPECT_EQ(b->capacity(), detail::device_size_class(1000));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % 256, 0u);
  auto s = d->memory_stats();
  EXPECT_EQ(s.allocated_bytes, b->capacity());
  EXPECT_EQ(s.requested_bytes, 1000u);
  EXPECT_EQ(s.reserved_bytes, b->capacity());
  EXPECT_EQ(s.live_buffers, 1u);
  EXPECT_EQ(s.allocations, 1u);
  EXPECT_EQ(s.device_allocations, 1u);
  EXPECT_NEAR(s.fragmentation, 1.0 - 1000.0 / static_cast<double>(b->capacity()), 1e-9);
  const std::uint64_t cap = b->capacity();
  b->reset();
  s = d->memory_stats();
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(s.live_buffers, 0u);
  EXPECT_EQ(s.cached_bytes, cap);
  EXPECT_EQ(s.reserved_bytes, cap);
  EXPECT_EQ(s.peak_allocated_bytes, cap);
  EXPECT_EQ(d->release_cached(), cap);
  EXPECT_EQ(d->memory_stats().reserved_bytes, 0u);
  EXPECT_EQ(d->memory_stats().device_frees, 1u);
}

TEST_P(DeviceConformance, ReusesAFreedBlockOfTheSameClass) {
  auto d = make();
  ASSERT_TRUE(d);
  auto a = d->allocate(kMiB);
  ASSERT_TRUE(a.ok()) << a.status();
  void* p = a->data();
  a->reset();
  auto b = d->allocate(kMiB - 100);  // same class as 1 MiB
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->data(), p);
  const auto s = d->memory_stats();
  EXPECT_EQ(s.cache_hits, 1u);
  EXPECT_EQ(s.device_allocations, 1u);
  EXPECT_EQ(s.allocations, 2u);
}

TEST_P(DeviceConformance, CopiesRoundTripOddSizesAtOddOffsets) {
  auto d = make();
  ASSERT_TRUE(d);
  const std::vector<std::uint64_t> sizes = {1, 3, 511, 4097, 65537, kMiB + 7};
  const std::vector<std::uint64_t> offsets = {0, 1, 13, 4095};
  auto buf = d->allocate(kMiB + 7 + 4095);
  ASSERT_TRUE(buf.ok()) << buf.status();
  HostBlock in = host(2 * kMiB);
  HostBlock out = host(2 * kMiB);
  std::uint32_t seed = 1;
  for (std::uint64_t n : sizes) {
    for (std::uint64_t off : offsets) {
      const auto data = pattern(n, seed++);
      std::memcpy(in.data(), data.data(), n);
      std::memset(out.data(), 0, n);
      auto up = d->copy_to_device(*buf, off, in.data(), n);
      ASSERT_TRUE(up.ok()) << up.status();
      ASSERT_TRUE(up->wait().ok());
      auto down = d->copy_to_host(out.data(), *buf, off, n);
      ASSERT_TRUE(down.ok()) << down.status();
      ASSERT_TRUE(down->wait().ok());
      ASSERT_EQ(std::memcmp(out.data(), data.data(), n), 0) << n << " bytes at offset " << off;
      std::vector<std::uint8_t> back(n);
      ASSERT_TRUE(d->read_device(*buf, off, back.data(), n).ok());
      ASSERT_EQ(back, data) << "read_device of " << n << " bytes at offset " << off;
    }
  }
}

TEST_P(DeviceConformance, ScatteredCopiesGatherBackInOneCopy) {
  auto d = make();
  ASSERT_TRUE(d);
  constexpr std::uint64_t kPiece = 4099, kPieces = 64, kBase = 5;
  auto buf = d->allocate(kBase + kPiece * kPieces);
  ASSERT_TRUE(buf.ok()) << buf.status();
  const auto data = pattern(kPiece * kPieces, 42);
  HostBlock in = host(kPiece * kPieces);
  HostBlock out = host(kPiece * kPieces);
  std::memcpy(in.data(), data.data(), data.size());
  DeviceEvent last;
  for (std::uint64_t i = 0; i < kPieces; ++i) {
    // Pieces in a shuffled order, each to its own offset.
    const std::uint64_t k = (i * 37) % kPieces;
    auto e = d->copy_to_device(*buf, kBase + k * kPiece, in.data() + k * kPiece, kPiece);
    ASSERT_TRUE(e.ok()) << e.status();
    last = *e;
  }
  // Ordered after the last host-to-device copy only: the stream's order covers the others.
  auto down = d->copy_to_host(out.data(), *buf, kBase, kPiece * kPieces, {last});
  ASSERT_TRUE(down.ok()) << down.status();
  ASSERT_TRUE(down->wait().ok());
  EXPECT_EQ(std::memcmp(out.data(), data.data(), data.size()), 0);
}

TEST_P(DeviceConformance, CopiesOnOneStreamCompleteInSubmissionOrder) {
  auto d = make();
  ASSERT_TRUE(d);
  constexpr int kCopies = 32;
  auto buf = d->allocate(kCopies * 65536);
  ASSERT_TRUE(buf.ok()) << buf.status();
  HostBlock h = host(kCopies * 65536);
  std::memset(h.data(), 7, h.size());
  for (CopyDirection dir : {CopyDirection::kHostToDevice, CopyDirection::kDeviceToHost}) {
    std::mutex mu;
    std::vector<int> order;
    std::vector<DeviceEvent> events;
    for (int i = 0; i < kCopies; ++i) {
      const std::uint64_t off = static_cast<std::uint64_t>(i) * 65536;
      auto e = dir == CopyDirection::kHostToDevice ? d->copy_to_device(*buf, off, h.data() + off, 65536)
                                                   : d->copy_to_host(h.data() + off, *buf, off, 65536);
      ASSERT_TRUE(e.ok()) << e.status();
      e->on_complete([&mu, &order, i](const Status& s) {
        EXPECT_TRUE(s.ok()) << s;
        std::lock_guard<std::mutex> lock(mu);
        order.push_back(i);
      });
      events.push_back(*e);
    }
    ASSERT_TRUE(events.back().wait().ok());
    // The last one complete means every earlier one is.
    for (int i = 0; i < kCopies; ++i) EXPECT_TRUE(events[i].ready()) << copy_direction_name(dir) << " copy " << i;
    ASSERT_TRUE(d->synchronize().ok());
    std::vector<int> expected(kCopies);
    for (int i = 0; i < kCopies; ++i) expected[i] = i;
    EXPECT_EQ(order, expected) << copy_direction_name(dir);
  }
}

TEST_P(DeviceConformance, AnEventOrdersACopyOnTheOtherStream) {
  auto d = make();
  ASSERT_TRUE(d);
  constexpr std::uint64_t n = 2 * kMiB;
  auto buf = d->allocate(n);
  ASSERT_TRUE(buf.ok()) << buf.status();
  HostBlock in = host(n);
  HostBlock out = host(n);
  // Read after write: the device-to-host copy must see what the host-to-device copy wrote.
  for (std::uint32_t round = 0; round < 6; ++round) {
    const auto data = pattern(n, 100 + round);
    std::memcpy(in.data(), data.data(), n);
    auto up = d->copy_to_device(*buf, 0, in.data(), n);
    ASSERT_TRUE(up.ok()) << up.status();
    auto down = d->copy_to_host(out.data(), *buf, 0, n, {*up});
    ASSERT_TRUE(down.ok()) << down.status();
    ASSERT_TRUE(down->wait().ok());
    EXPECT_TRUE(up->ready());
    ASSERT_EQ(std::memcmp(out.data(), data.data(), n), 0) << "round " << round;
  }
  // Write after read: the host-to-device copy must not overwrite bytes before they were read.
  const auto old_bytes = pattern(n, 7);
  const auto new_bytes = pattern(n, 8);
  ASSERT_TRUE(d->write_device(*buf, 0, old_bytes.data(), n).ok());
  std::memcpy(in.data(), new_bytes.data(), n);
  auto down = d->copy_to_host(out.data(), *buf, 0, n);
  ASSERT_TRUE(down.ok()) << down.status();
  auto up = d->copy_to_device(*buf, 0, in.data(), n, {*down});
  ASSERT_TRUE(up.ok()) << up.status();
  ASSERT_TRUE(up->wait().ok());
  ASSERT_TRUE(down->wait().ok());
  EXPECT_EQ(std::memcmp(out.data(), old_bytes.data(), n), 0);
  std::vector<std::uint8_t> now(n);
  ASSERT_TRUE(d->read_device(*buf, 0, now.data(), n).ok());
  EXPECT_EQ(now, new_bytes);
}

TEST_P(DeviceConformance, CallbacksFireExactlyOnce) {
  auto d = make();
  ASSERT_TRUE(d);
  constexpr int kCopies = 16;
  auto buf = d->allocate(kCopies * 8192);
  ASSERT_TRUE(buf.ok()) << buf.status();
  HostBlock h = host(kCopies * 8192);
  std::vector<std::atomic<int>> fired(kCopies * 3);
  std::vector<DeviceEvent> events;
  for (int i = 0; i < kCopies; ++i) {
    auto e = d->copy_to_device(*buf, static_cast<std::uint64_t>(i) * 8192, h.data() + i * 8192, 8192);
    ASSERT_TRUE(e.ok()) << e.status();
    for (int k = 0; k < 3; ++k) {
      e->on_complete([&fired, i, k](const Status& s) {
        EXPECT_TRUE(s.ok()) << s;
        fired[static_cast<std::size_t>(i * 3 + k)].fetch_add(1);
      });
    }
    events.push_back(*e);
  }
  ASSERT_TRUE(d->synchronize().ok());
  for (std::size_t i = 0; i < fired.size(); ++i) EXPECT_EQ(fired[i].load(), 1) << "callback " << i;
  // Added after completion: runs at once, before on_complete returns.
  bool ran = false;
  events[0].on_complete([&ran](const Status& s) { ran = s.ok(); });
  EXPECT_TRUE(ran);
  for (std::size_t i = 0; i < fired.size(); ++i) EXPECT_EQ(fired[i].load(), 1) << "callback " << i;
}

TEST_P(DeviceConformance, ACallbackCanSubmitTheNextStage) {
  auto d = make();
  ASSERT_TRUE(d);
  constexpr std::uint64_t n = 3 * 65536 + 11;
  auto buf = d->allocate(n);
  ASSERT_TRUE(buf.ok()) << buf.status();
  HostBlock in = host(n);
  HostBlock out = host(n);
  const auto data = pattern(n, 9);
  std::memcpy(in.data(), data.data(), n);
  std::promise<DeviceEvent> next;
  auto up = d->copy_to_device(*buf, 0, in.data(), n);
  ASSERT_TRUE(up.ok()) << up.status();
  Device* dev = d.get();
  DeviceBuffer* b = &*buf;
  up->on_complete([&](const Status& s) {
    ASSERT_TRUE(s.ok()) << s;
    auto down = dev->copy_to_host(out.data(), *b, 0, n);
    next.set_value(down.ok() ? *down : DeviceEvent::completed(down.status()));
  });
  DeviceEvent down = next.get_future().get();
  ASSERT_TRUE(down.wait().ok());
  EXPECT_EQ(std::memcmp(out.data(), data.data(), n), 0);
}

TEST_P(DeviceConformance, ComputeStreamCanWaitForACopyAndRecordEvents) {
  auto d = make();
  ASSERT_TRUE(d);
  auto buf = d->allocate(4 * kMiB);
  ASSERT_TRUE(buf.ok()) << buf.status();
  HostBlock h = host(4 * kMiB);
  auto up = d->copy_to_device(*buf, 0, h.data(), 4 * kMiB);
  ASSERT_TRUE(up.ok()) << up.status();
  ASSERT_TRUE(d->stream_wait(nullptr, *up).ok());
  // Without GPU streams the caller's thread is the stream: the wait happened here.
  if (!d->has(DeviceCap::kGpuStreams)) {
    EXPECT_TRUE(up->ready());
  }
  auto rec = d->record_event(nullptr);
  ASSERT_TRUE(rec.ok()) << rec.status();
  ASSERT_TRUE(rec->wait().ok());
  EXPECT_TRUE(up->wait().ok());
  EXPECT_EQ(d->stream_wait(nullptr, DeviceEvent()).code(), StatusCode::kInvalidArgument);
}

TEST_P(DeviceConformance, OverBudgetFailsAtOnceNamingTheBudgetAndTheRequest) {
  auto d = make(kMiB);
  ASSERT_TRUE(d);
  auto a = d->allocate(768 << 10);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = d->allocate(512 << 10);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  const std::string& msg = b.status().message();
  EXPECT_NE(msg.find("cannot allocate 512.00 KiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("budget of 1.00 MiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tier.budgets.device"), std::string::npos) << msg;
  EXPECT_EQ(d->memory_stats().failures, 1u);
  // Freed memory is cached, and given back when a request of another class needs the room.
  a->reset();
  auto c = d->allocate(512 << 10);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_LE(d->memory_stats().reserved_bytes, kMiB);
}

TEST_P(DeviceConformance, ARequestLargerThanTheBudgetFailsAtOnceEvenWhenWaitingIsAllowed) {
  auto d = make(kMiB, 20'000ms);
  ASSERT_TRUE(d);
  const auto t0 = std::chrono::steady_clock::now();
  auto b = d->allocate(2 * kMiB);
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("larger than the whole device budget"), std::string::npos) << b.status();
  EXPECT_LT(waited, 10s) << "it waited for memory that can never come";
  EXPECT_EQ(d->memory_stats().waits, 0u);
}

TEST_P(DeviceConformance, OverBudgetWaitsForAFreeWhenConfigured) {
  auto d = make(kMiB, 20'000ms);
  ASSERT_TRUE(d);
  auto a = d->allocate(768 << 10);
  ASSERT_TRUE(a.ok()) << a.status();
  std::thread freer([&] {
    std::this_thread::sleep_for(50ms);
    a->reset();
  });
  auto b = d->allocate(512 << 10);
  freer.join();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(d->memory_stats().waits, 1u);
  EXPECT_EQ(d->memory_stats().failures, 0u);
}

TEST_P(DeviceConformance, OverBudgetWaitTimesOutWithAClearError) {
  auto d = make(kMiB, 50ms);
  ASSERT_TRUE(d);
  auto a = d->allocate(768 << 10);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = d->allocate(512 << 10);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kTimedOut);
  EXPECT_NE(b.status().message().find("after waiting 50 ms"), std::string::npos) << b.status();
  EXPECT_EQ(d->memory_stats().waits, 1u);
}

TEST_P(DeviceConformance, ReportsBytesOpsAndResidencyIntoCounters) {
  Counters c;
  auto d = make(256 * kMiB, 0ms, &c);
  ASSERT_TRUE(d);
  auto buf = d->allocate(kMiB);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_EQ(c.snapshot().tier(Tier::kDevice).resident_bytes, kMiB);
  EXPECT_EQ(c.snapshot().tier(Tier::kDevice).budget_bytes, 256 * kMiB);
  HostBlock h = host(kMiB);
  HostBlock back = host(1000);
  DeviceEvent last_up;
  for (int i = 0; i < 3; ++i) {
    auto e = d->copy_to_device(*buf, 0, h.data(), kMiB);
    ASSERT_TRUE(e.ok()) << e.status();
    last_up = *e;
  }
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(d->copy_to_host(back.data(), *buf, 0, 1000, {last_up}).ok());
  ASSERT_TRUE(d->synchronize().ok());
  const auto s = c.snapshot();
  EXPECT_EQ(s.link(Link::kHostToDevice).bytes, 3 * kMiB);
  EXPECT_EQ(s.link(Link::kHostToDevice).ops, 3u);
  EXPECT_EQ(s.link(Link::kDeviceToHost).bytes, 2000u);
  EXPECT_EQ(s.link(Link::kDeviceToHost).ops, 2u);
  EXPECT_EQ(s.link(Link::kHostToDevice).errors, 0u);
  EXPECT_EQ(s.link(Link::kHostToDevice).in_flight, 0u);
  EXPECT_GT(s.link(Link::kHostToDevice).busy_seconds, 0.0);
  buf->reset();
  EXPECT_EQ(c.snapshot().tier(Tier::kDevice).resident_bytes, 0u);
  EXPECT_EQ(c.snapshot().tier(Tier::kDevice).peak_bytes, kMiB);
}

TEST_P(DeviceConformance, RejectsBadArgumentsWithClearErrors) {
  auto d = make();
  auto other = make();
  ASSERT_TRUE(d && other);
  auto buf = d->allocate(4096);
  auto foreign = other->allocate(4096);
  ASSERT_TRUE(buf.ok() && foreign.ok());
  HostBlock h = host(8192);
  auto r = d->copy_to_device(*buf, 4000, h.data(), 97);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(r.status().message().find("[4000, 4097)"), std::string::npos) << r.status();
  EXPECT_EQ(d->copy_to_host(h.data(), *buf, 4097, 0).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(d->copy_to_device(*buf, 0, nullptr, 16).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(d->copy_to_host(nullptr, *buf, 0, 16).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(d->copy_to_device(DeviceBuffer(), 0, h.data(), 16).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(d->copy_to_device(*foreign, 0, h.data(), 16).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(d->copy_to_device(*buf, 0, h.data(), 16, {DeviceEvent()}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(d->allocate(0).status().code(), StatusCode::kInvalidArgument);
  auto zero = d->copy_to_device(*buf, 4096, h.data(), 0);
  ASSERT_TRUE(zero.ok()) << zero.status();
  EXPECT_TRUE(zero->ready());
  EXPECT_EQ(d->read_device(*buf, 4090, h.data(), 7).code(), StatusCode::kOutOfRange);
}

TEST_P(DeviceConformance, RegistersHostRangesOnce) {
  auto extra = make_arena(4 * kMiB);  // outlives the device, which unregisters what is left
  ASSERT_TRUE(extra);
  auto d = make();
  ASSERT_TRUE(d);
  std::byte* base = extra->base();
  EXPECT_FALSE(d->is_registered(base, 4096));
  ASSERT_TRUE(d->register_host(base, extra->capacity()).ok());
  EXPECT_TRUE(d->register_host(base, extra->capacity()).ok()) << "the same range again is fine";
  EXPECT_EQ(d->register_host(base + 4096, 4096).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(d->register_host(nullptr, 4096).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(d->is_registered(base + 100, 100));
  EXPECT_FALSE(d->is_registered(base + extra->capacity() - 10, 100));
  EXPECT_TRUE(d->is_registered(arena_->base(), arena_->capacity())) << "registered by make()";
  ASSERT_TRUE(d->unregister_host(base).ok());
  EXPECT_EQ(d->unregister_host(base).code(), StatusCode::kNotFound);
  EXPECT_FALSE(d->is_registered(base, 4096));
}

// A range is registered only when every byte is: its first byte being in a registered range is not
// enough, and neighbouring registrations count only where they leave no gap.
TEST_P(DeviceConformance, RegistrationCoversWholeRangesAcrossNeighbours) {
  auto extra = make_arena(4 * kMiB);
  ASSERT_TRUE(extra);
  auto d = make();
  ASSERT_TRUE(d);
  std::byte* base = extra->base();
  ASSERT_TRUE(d->register_host(base, kMiB).ok());
  EXPECT_TRUE(d->is_registered(base, kMiB));
  EXPECT_FALSE(d->is_registered(base + kMiB - 4096, 8192)) << "runs 4 KiB past the end of the only range";
  ASSERT_TRUE(d->register_host(base + kMiB, kMiB).ok());
  EXPECT_TRUE(d->is_registered(base + kMiB - 4096, 8192)) << "the next range starts where the first ends";
  EXPECT_TRUE(d->is_registered(base, 2 * kMiB));
  ASSERT_TRUE(d->register_host(base + 3 * kMiB, kMiB).ok());
  EXPECT_FALSE(d->is_registered(base, 4 * kMiB)) << "the third MiB is not registered";
  EXPECT_FALSE(d->is_registered(base + 2 * kMiB - 4096, kMiB + 8192)) << "starts registered, crosses the gap";
  ASSERT_TRUE(d->unregister_host(base + kMiB).ok());
  EXPECT_FALSE(d->is_registered(base, 2 * kMiB)) << "the second range is gone";
  ASSERT_TRUE(d->unregister_host(base).ok());
  ASSERT_TRUE(d->unregister_host(base + 3 * kMiB).ok());
}

TEST_P(DeviceConformance, AFreedBufferIsNotReusedWhileACopyStillUsesIt) {
  auto d = make();
  ASSERT_TRUE(d);
  auto buf = d->allocate(8 * kMiB);
  ASSERT_TRUE(buf.ok()) << buf.status();
  void* old = buf->data();
  HostBlock h = host(8 * kMiB);
  auto up = d->copy_to_device(*buf, 0, h.data(), 8 * kMiB);
  ASSERT_TRUE(up.ok()) << up.status();
  buf->reset();
  auto again = d->allocate(8 * kMiB);
  ASSERT_TRUE(again.ok()) << again.status();
  if (again->data() == old) {
    EXPECT_TRUE(up->ready()) << "block reused while the copy into it was in flight";
  }
  ASSERT_TRUE(d->synchronize().ok());
  EXPECT_EQ(d->memory_stats().pending_free_bytes, 0u);
}

TEST_P(DeviceConformance, DestroyingTheDeviceWaitsForCopiesAndCallbacks) {
  auto d = make();
  ASSERT_TRUE(d);
  auto buf = d->allocate(4 * kMiB);
  ASSERT_TRUE(buf.ok()) << buf.status();
  HostBlock h = host(4 * kMiB);
  std::atomic<int> fired{0};
  std::vector<DeviceEvent> events;
  for (int i = 0; i < 8; ++i) {
    auto e = d->copy_to_device(*buf, 0, h.data(), 4 * kMiB);
    ASSERT_TRUE(e.ok()) << e.status();
    e->on_complete([&fired](const Status&) { fired.fetch_add(1); });
    events.push_back(*e);
  }
  d.reset();
  EXPECT_EQ(fired.load(), 8);
  for (const auto& e : events) {
    EXPECT_TRUE(e.ready());
    EXPECT_TRUE(e.status().ok()) << e.status();
  }
  buf->reset();  // a buffer may outlive its device
}

INSTANTIATE_TEST_SUITE_P(
    Devices, DeviceConformance,
    ::testing::Values(Impl{"emulated", DeviceKind::kEmulated, {}},
                      Impl{"emulated_paced", DeviceKind::kEmulated, {2'000'000'000, 3'000'000'000, 20}},
                      Impl{"cuda", DeviceKind::kCuda, {}}),
    [](const ::testing::TestParamInfo<Impl>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace tier
