// CudaDevice behaviours that need the CUDA runtime in the test itself: error mapping (runs
// anywhere CUDA is compiled in), host registration and ordering a compute stream of the test's
// own (need a GPU; skipped without one).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>

#include "gpu/cuda_error.hpp"
#include "tier/ext/cuda_reference.hpp"
#include "gpu/device_test_util.hpp"
#include "tier/ext/device.hpp"

namespace tier {
namespace {

constexpr std::uint64_t kMiB = 1ull << 20;

TEST(CudaError, NamesTheCudaErrorAndMapsOutOfMemory) {
  const Status oom = detail::cuda_error_status(cudaErrorMemoryAllocation, "cudaMalloc(1 GiB) on device 0");
  EXPECT_EQ(oom.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(oom.message().find("cudaMalloc(1 GiB) on device 0: cudaErrorMemoryAllocation"), std::string::npos) << oom;
  const Status bad = detail::cuda_error_status(cudaErrorInvalidValue, "cudaMemcpyAsync");
  EXPECT_EQ(bad.code(), StatusCode::kDeviceError);
  EXPECT_NE(bad.message().find("cudaErrorInvalidValue"), std::string::npos) << bad;
}

TEST(CudaReference, MeasuresBothDirectionsOrSaysWhyNot) {
  auto r = measure_cuda_memcpy(0, 8 * kMiB, 2);
  if (!probe_cuda().usable()) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
    return;
  }
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->h2d_bytes_per_second, 1e8);
  EXPECT_GT(r->d2h_bytes_per_second, 1e8);
}

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TIER_SKIP_WITHOUT_CUDA();
    DeviceOptions o;
    o.kind = DeviceKind::kCuda;
    o.budget_bytes = 512 * kMiB;
    auto d = create_cuda_device(o);
    ASSERT_TRUE(d.ok()) << d.status();
    dev_ = std::move(d).value();
    arena_ = test::make_arena(64 * kMiB);
    ASSERT_TRUE(arena_);
  }
  // The arena outlives the device, which unregisters it when destroyed.
  std::unique_ptr<HostArena> arena_;
  std::unique_ptr<Device> dev_;
};

TEST_F(CudaDeviceTest, RegisterHostPinsTheArenaAndUnregisterReleasesIt) {
  ASSERT_TRUE(dev_->register_host(arena_->base(), arena_->capacity()).ok());
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, arena_->base() + 4096), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeHost);
  ASSERT_TRUE(dev_->unregister_host(arena_->base()).ok());
  ASSERT_EQ(cudaPointerGetAttributes(&attr, arena_->base() + 4096), cudaSuccess);
  EXPECT_NE(attr.type, cudaMemoryTypeHost);
}

TEST_F(CudaDeviceTest, MemoryAllocatedByCudaIsAcceptedWithoutRegisteringAgain) {
  void* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(&pinned, kMiB, cudaHostAllocDefault), cudaSuccess);
  EXPECT_TRUE(dev_->register_host(pinned, kMiB).ok());
  EXPECT_TRUE(dev_->unregister_host(pinned).ok());
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, pinned), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeHost) << "tier must not unregister memory it did not register";
  cudaFreeHost(pinned);
}

// The compute stream copies A to B on the GPU after waiting for the host-to-device copy into A;
// the device-to-host copy of B waits for an event recorded on the compute stream. Both orderings
// happen on the GPU, without the host waiting in between.
TEST_F(CudaDeviceTest, StreamWaitOrdersAComputeStreamOnTheGpu) {
  ASSERT_TRUE(dev_->register_host(arena_->base(), arena_->capacity()).ok());
  constexpr std::uint64_t n = 32 * kMiB;
  auto a = dev_->allocate(n);
  auto b = dev_->allocate(n);
  ASSERT_TRUE(a.ok() && b.ok());
  auto in = arena_->allocate(n);
  auto out = arena_->allocate(n);
  ASSERT_TRUE(in.ok() && out.ok());
  cudaStream_t compute = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), cudaSuccess);
  for (std::uint32_t round = 0; round < 4; ++round) {
    const auto data = test::pattern(n, round + 1);
    std::memcpy(in->data(), data.data(), n);
    auto up = dev_->copy_to_device(*a, 0, in->data(), n);
    ASSERT_TRUE(up.ok()) << up.status();
    ASSERT_TRUE(dev_->stream_wait(compute, *up).ok());
    ASSERT_EQ(cudaMemcpyAsync(b->data(), a->data(), n, cudaMemcpyDeviceToDevice, compute), cudaSuccess);
    auto done = dev_->record_event(compute);
    ASSERT_TRUE(done.ok()) << done.status();
    auto down = dev_->copy_to_host(out->data(), *b, 0, n, {*done});
    ASSERT_TRUE(down.ok()) << down.status();
    ASSERT_TRUE(down->wait().ok());
    ASSERT_EQ(std::memcmp(out->data(), data.data(), n), 0) << "round " << round;
  }
  cudaStreamDestroy(compute);
}

TEST_F(CudaDeviceTest, CopiesFromTheRegisteredArenaReturnBeforeTheyComplete) {
  ASSERT_TRUE(dev_->register_host(arena_->base(), arena_->capacity()).ok());
  constexpr std::uint64_t n = 64 * kMiB;
  auto a = dev_->allocate(n);
  ASSERT_TRUE(a.ok());
  auto in = arena_->allocate(n);
  ASSERT_TRUE(in.ok());
  // Several large copies queued back to back: the submitting thread is not held up by them.
  std::vector<DeviceEvent> events;
  for (int i = 0; i < 8; ++i) events.push_back(*dev_->copy_to_device(*a, 0, in->data(), n));
  EXPECT_FALSE(events.back().ready()) << "512 MiB copied before the submit calls returned: not asynchronous";
  ASSERT_TRUE(dev_->synchronize().ok());
  for (const auto& e : events) EXPECT_TRUE(e.ready());
}

}  // namespace
}  // namespace tier
