// The NCCL communicator on a GPU (world 1: NCCL refuses two ranks on one device), through the C
// ABI and the C++ API: every collective on device buffers, host buffers staged, the norm
// reduction, and a peer that never joins coming back as kTimedOut instead of a hang. Skipped
// without a GPU (TIER_REQUIRE_CUDA=1 makes that a failure, as bench/gpu_check.sh sets); without
// NCCL in the build, the factories must say kUnsupported.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "tier/comm.hpp"
#include "tier/tier.h"

#ifdef TIER_TEST_WITH_NCCL
#include <cuda_runtime_api.h>
#endif

namespace tier {
namespace {

#ifndef TIER_TEST_WITH_NCCL

TEST(NcclCommunicator, WithoutNcclTheFactoriesSaySo) {
  EXPECT_EQ(nccl_available().code(), StatusCode::kUnsupported);
  EXPECT_EQ(make_nccl_unique_id().status().code(), StatusCode::kUnsupported);
  NcclOptions o;
  const Status s = make_nccl_communicator(o).status();
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("TIER_WITH_NCCL"), std::string::npos) << s;
  std::uint8_t id[TIER_COMM_UNIQUE_ID_BYTES];
  EXPECT_EQ(tier_comm_nccl_unique_id(id), TIER_ERROR_UNSUPPORTED);
  tier_comm_nccl_config_t c = TIER_COMM_NCCL_CONFIG_INIT;
  tier_comm_t* comm = nullptr;
  EXPECT_EQ(tier_comm_create_nccl(&c, &comm), TIER_ERROR_UNSUPPORTED);
  EXPECT_EQ(comm, nullptr);
}

#else

bool require_cuda() {
  const char* v = std::getenv("TIER_REQUIRE_CUDA");
  return v != nullptr && std::string(v) == "1";
}

// Skips (or fails, under TIER_REQUIRE_CUDA=1) without a GPU or a loadable libnccl.
#define TIER_NEED_NCCL_GPU()                                                  \
  do {                                                                        \
    int devices = 0;                                                          \
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {        \
      cudaGetLastError();                                                     \
      if (require_cuda()) FAIL() << "TIER_REQUIRE_CUDA=1 but no CUDA device"; \
      GTEST_SKIP() << "no CUDA device";                                       \
    }                                                                         \
    const Status nccl = nccl_available();                                     \
    if (!nccl.ok()) {                                                         \
      if (require_cuda()) FAIL() << nccl;                                     \
      GTEST_SKIP() << nccl;                                                   \
    }                                                                         \
  } while (0)

template <class T>
struct DeviceBuffer {
  T* p = nullptr;
  explicit DeviceBuffer(std::size_t n) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(T)), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(p); }
  void put(const std::vector<T>& v) {
    ASSERT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> get(std::size_t n) {
    std::vector<T> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
};

TEST(NcclCommunicator, WorldOfOneRunsEveryCollectiveOnDeviceAndHostBuffers) {
  TIER_NEED_NCCL_GPU();
  std::uint8_t id[TIER_COMM_UNIQUE_ID_BYTES];
  ASSERT_EQ(tier_comm_nccl_unique_id(id), TIER_OK) << tier_last_error();
  tier_comm_nccl_config_t c = TIER_COMM_NCCL_CONFIG_INIT;
  std::memcpy(c.unique_id, id, sizeof id);
  c.rank = 0;
  c.world = 1;
  c.device = 0;
  c.timeout_ms = 60000;
  tier_comm_t* comm = nullptr;
  ASSERT_EQ(tier_comm_create_nccl(&c, &comm), TIER_OK) << tier_last_error();
  const std::size_t n = 1 << 20;
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 1000) * 0.5f;
  DeviceBuffer<float> a(n), b(n);
  a.put(host);
  ASSERT_EQ(tier_comm_all_reduce(comm, a.p, n, TIER_DTYPE_F32, TIER_REDUCE_SUM), TIER_OK) << tier_last_error();
  EXPECT_EQ(a.get(n), host);
  ASSERT_EQ(tier_comm_reduce_scatter(comm, a.p, b.p, n, TIER_DTYPE_F32, TIER_REDUCE_SUM), TIER_OK) << tier_last_error();
  EXPECT_EQ(b.get(n), host);
  ASSERT_EQ(tier_comm_all_gather(comm, b.p, a.p, n, TIER_DTYPE_F32), TIER_OK) << tier_last_error();
  EXPECT_EQ(a.get(n), host);
  ASSERT_EQ(tier_comm_broadcast(comm, a.p, n, TIER_DTYPE_F32, 0), TIER_OK) << tier_last_error();
  ASSERT_EQ(tier_comm_barrier(comm), TIER_OK) << tier_last_error();
  // Host memory is staged through the device.
  std::vector<double> h = {1.5, -2.0, 3.25};
  ASSERT_EQ(tier_comm_all_reduce(comm, h.data(), h.size(), TIER_DTYPE_F64, TIER_REDUCE_MAX), TIER_OK)
      << tier_last_error();
  EXPECT_EQ(h, (std::vector<double>{1.5, -2.0, 3.25}));
  std::vector<std::int32_t> gathered(1, -1);
  std::int32_t mine = 42;
  ASSERT_EQ(tier_comm_all_gather(comm, &mine, gathered.data(), 1, TIER_DTYPE_I32), TIER_OK) << tier_last_error();
  EXPECT_EQ(gathered[0], 42);
  tier_comm_destroy(comm);
}

TEST(NcclCommunicator, ReduceSumsqOverNcclTakesAHostDouble) {
  TIER_NEED_NCCL_GPU();
  auto id = make_nccl_unique_id();
  ASSERT_TRUE(id.ok()) << id.status();
  NcclOptions o;
  o.id = *id;
  auto comm = make_nccl_communicator(o);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_STREQ((*comm)->name(), "nccl");
  double sumsq = 12.5;
  CommunicatorNorm norm(**comm);
  ASSERT_TRUE(norm.all_reduce_sumsq(sumsq).ok());
  EXPECT_EQ(sumsq, 12.5);
  double inf = std::numeric_limits<double>::infinity();
  ASSERT_TRUE(norm.all_reduce_sumsq(inf).ok());
  EXPECT_TRUE(std::isinf(inf));
}

// Rank 0 of two, whose peer never comes: joining times out and says why, instead of hanging.
TEST(NcclCommunicator, APeerThatNeverJoinsIsATimeout) {
  TIER_NEED_NCCL_GPU();
  auto id = make_nccl_unique_id();
  ASSERT_TRUE(id.ok()) << id.status();
  NcclOptions o;
  o.id = *id;
  o.world = 2;
  o.timeout = std::chrono::milliseconds(3000);
  const auto t0 = std::chrono::steady_clock::now();
  auto comm = make_nccl_communicator(o);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kTimedOut) << comm.status();
  EXPECT_LT(seconds, 30.0);
}

TEST(NcclCommunicator, BadArgumentsAreRefused) {
  NcclOptions o;
  o.rank = 1;
  EXPECT_EQ(make_nccl_communicator(o).status().code(), StatusCode::kInvalidArgument);
  tier_comm_nccl_config_t c = TIER_COMM_NCCL_CONFIG_INIT;
  c.world = 0;
  tier_comm_t* comm = nullptr;
  EXPECT_EQ(tier_comm_create_nccl(&c, &comm), TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(tier_comm_create_nccl(nullptr, &comm), TIER_ERROR_INVALID_ARGUMENT);
}

#endif

}  // namespace
}  // namespace tier
