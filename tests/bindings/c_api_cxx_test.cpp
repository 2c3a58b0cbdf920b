// The C ABI from C++ (the header's extern "C" guards), where C cannot reach: producer deleters that
// throw, deleters and leases under concurrency, and — on a GPU — the consumer's stream ordering the
// end of a write lease. Links only libtier.so (and the CUDA runtime for the GPU cases).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tier/tier.h"

#ifdef TIER_TEST_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() / ("tier-c-api-cxx-" + std::to_string(getpid()) + "-" + std::to_string(counter++));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string config_json(const fs::path& dir, const char* device = "emulated", int acquire_timeout_ms = 20000) {
  return std::string(R"({"tier": {"device": ")") + device +
         R"(", "budgets": {"device": 4194304, "host": 8388608, "nvme": 33554432}, "swap_paths": [")" + dir.string() +
         R"("], "huge_pages": "off", "acquire_timeout_ms": )" + std::to_string(acquire_timeout_ms) +
         R"(, "log_level": "warn", "io": {"bounce_unaligned": true}}})";
}

tier_engine_t* make_engine(const fs::path& dir, tier_status_t* status = nullptr, const char* device = "emulated",
                           int acquire_timeout_ms = 20000) {
  const std::string json = config_json(dir, device, acquire_timeout_ms);
  tier_engine_config_t config = TIER_ENGINE_CONFIG_INIT;
  config.json = json.c_str();
  config.ignore_env = 1;
  tier_engine_t* e = nullptr;
  const tier_status_t s = tier_engine_create(&config, &e);
  if (status != nullptr) *status = s;
  return e;
}

// A host tensor whose deleter counts its calls and may throw.
struct Producer {
  DLManagedTensor managed{};
  std::vector<float> data;
  std::int64_t shape[1];
  std::atomic<int>* deleted;
  bool throws;

  static DLManagedTensor* make(std::size_t n, float seed, std::atomic<int>* deleted, bool throws = false) {
    auto* p = new Producer;
    p->data.resize(n);
    for (std::size_t i = 0; i < n; ++i) p->data[i] = seed + static_cast<float>(i);
    p->shape[0] = static_cast<std::int64_t>(n);
    p->deleted = deleted;
    p->throws = throws;
    DLTensor& t = p->managed.dl_tensor;
    t.data = p->data.data();
    t.device = {kDLCPU, 0};
    t.ndim = 1;
    t.dtype = {kDLFloat, 32, 1};
    t.shape = p->shape;
    p->managed.manager_ctx = p;
    p->managed.deleter = [](DLManagedTensor* self) {
      auto* me = static_cast<Producer*>(self->manager_ctx);
      const bool throws = me->throws;
      ++*me->deleted;
      delete me;
      if (throws) throw std::runtime_error("producer deleter failed");
    };
    return &p->managed;
  }
};

TEST(CApiCxx, ThrowingProducerDeleterIsReportedAndNothingStaysRegistered) {
  TempDir dir;
  tier_engine_t* e = make_engine(dir.path);
  ASSERT_NE(e, nullptr) << tier_last_error();
  std::atomic<int> deleted{0};
  tier_tensor_t t{7};
  EXPECT_EQ(tier_tensor_register(e, "x", Producer::make(64, 0, &deleted, true), nullptr, &t), TIER_ERROR_INTERNAL);
  EXPECT_EQ(deleted.load(), 1);
  EXPECT_EQ(t.id, 0u);
  EXPECT_NE(std::strstr(tier_last_error(), "deleter threw"), nullptr) << tier_last_error();
  tier_tensor_t found{};
  EXPECT_EQ(tier_tensor_find(e, "x", &found), TIER_ERROR_NOT_FOUND);

  // On an error path (no engine), the throwing deleter runs once and nothing escapes either.
  EXPECT_EQ(tier_tensor_register(nullptr, "x", Producer::make(64, 0, &deleted, true), nullptr, &t),
            TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(deleted.load(), 2);

  // The name is free again.
  EXPECT_EQ(tier_tensor_register(e, "x", Producer::make(64, 0, &deleted), nullptr, &t), TIER_OK) << tier_last_error();
  EXPECT_EQ(deleted.load(), 3);
  EXPECT_EQ(tier_engine_check(e), TIER_OK) << tier_last_error();
  tier_engine_destroy(e);
}

// Many threads register, acquire on both tiers, hand the DLPack tensors to another thread whose
// deleter ends them, and unregister: every producer deleter and every lease runs exactly once
// (a lease that never ended would block the unregister; one that ended twice would break the
// engine's reader counts, which check() verifies).
TEST(CApiCxx, DeletersRunExactlyOnceUnderConcurrency) {
  TempDir dir;
  tier_engine_t* e = make_engine(dir.path);
  ASSERT_NE(e, nullptr) << tier_last_error();
  constexpr int kThreads = 4;
  constexpr int kRounds = 40;
  constexpr std::size_t kElems = 4096;  // 16 KiB
  std::vector<std::atomic<int>> deleted(kThreads * kRounds);
  std::mutex handoff_mu;
  std::vector<DLManagedTensor*> handoff;
  std::atomic<bool> done{false};
  std::atomic<int> failures{0};
  std::atomic<int> freed{0};

  std::thread releaser([&] {
    for (;;) {
      std::vector<DLManagedTensor*> batch;
      {
        std::lock_guard<std::mutex> lock(handoff_mu);
        batch.swap(handoff);
      }
      for (DLManagedTensor* t : batch) {
        t->deleter(t);
        ++freed;
      }
      if (batch.empty()) {
        if (done.load()) return;
        std::this_thread::yield();
      }
    }
  });

  std::vector<std::thread> workers;
  for (int w = 0; w < kThreads; ++w) {
    workers.emplace_back([&, w] {
      for (int r = 0; r < kRounds; ++r) {
        const int k = w * kRounds + r;
        char name[32];
        std::snprintf(name, sizeof name, "t%d", k);
        tier_tensor_options_t opt = TIER_TENSOR_OPTIONS_INIT;
        opt.home = r % 2 ? TIER_TIER_NVME : TIER_TIER_HOST;
        tier_tensor_t t{};
        if (tier_tensor_register(e, name, Producer::make(kElems, static_cast<float>(k), &deleted[k]), &opt, &t) !=
            TIER_OK) {
          ++failures;
          continue;
        }
        for (tier_tier_t where : {TIER_TIER_DEVICE, TIER_TIER_HOST}) {
          tier_ticket_t* ticket = nullptr;
          DLManagedTensor* dl = nullptr;
          if (tier_tensor_acquire(e, t, where, TIER_ACCESS_READ, nullptr, &ticket) != TIER_OK ||
              tier_ticket_wait(ticket, &dl) != TIER_OK) {
            ++failures;
            tier_ticket_destroy(ticket);
            continue;
          }
          tier_ticket_destroy(ticket);
          const float* d = static_cast<const float*>(dl->dl_tensor.data);
          if (d[0] != static_cast<float>(k) || d[kElems - 1] != static_cast<float>(k) + (kElems - 1)) ++failures;
          std::lock_guard<std::mutex> lock(handoff_mu);
          handoff.push_back(dl);
        }
        // Unregister once both leases have ended on the releaser thread.
        tier_status_t s;
        int tries = 0;
        while ((s = tier_tensor_unregister(e, t)) == TIER_ERROR_FAILED_PRECONDITION && tries++ < 20000) {
          std::this_thread::yield();
        }
        if (s != TIER_OK) ++failures;
      }
    });
  }
  for (auto& t : workers) t.join();
  done = true;
  releaser.join();
  EXPECT_EQ(failures.load(), 0) << tier_last_error();
  EXPECT_EQ(freed.load(), kThreads * kRounds * 2);
  for (int k = 0; k < kThreads * kRounds; ++k) EXPECT_EQ(deleted[k].load(), 1) << "producer " << k;
  EXPECT_EQ(tier_engine_check(e), TIER_OK) << tier_last_error();
  tier_engine_destroy(e);
}

// On the emulated device (no GPU streams) a stream-ordered read is a device read whose contents
// are there when the ticket is; bad arguments are refused and hand out nothing.
TEST(CApiCxx, AStreamOrderedReadOnTheEmulatedDeviceHandsOutTheContents) {
  TempDir dir;
  tier_engine_t* e = make_engine(dir.path);
  ASSERT_NE(e, nullptr) << tier_last_error();
  std::atomic<int> deleted{0};
  tier_tensor_options_t opt = TIER_TENSOR_OPTIONS_INIT;
  opt.home = TIER_TIER_NVME;
  tier_tensor_t t{};
  ASSERT_EQ(tier_tensor_register(e, "w", Producer::make(4096, 5, &deleted), &opt, &t), TIER_OK) << tier_last_error();
  tier_ticket_t* ticket = nullptr;
  DLManagedTensor* dl = nullptr;
  ASSERT_EQ(tier_tensor_acquire_on_stream(e, t, nullptr, &ticket), TIER_OK) << tier_last_error();
  ASSERT_EQ(tier_ticket_wait(ticket, &dl), TIER_OK) << tier_last_error();
  tier_ticket_destroy(ticket);
  const float* v = static_cast<const float*>(dl->dl_tensor.data);
  for (int i = 0; i < 4096; i += 97) ASSERT_EQ(v[i], 5.0f + static_cast<float>(i)) << i;
  dl->deleter(dl);
  EXPECT_EQ(tier_tensor_acquire_on_stream(e, t, nullptr, nullptr), TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(tier_tensor_acquire_on_stream(nullptr, t, nullptr, &ticket), TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ticket, nullptr);
  tier_tensor_t stale = t;
  ASSERT_EQ(tier_tensor_unregister(e, t), TIER_OK) << tier_last_error();
  EXPECT_EQ(tier_tensor_acquire_on_stream(e, stale, nullptr, &ticket), TIER_ERROR_NOT_FOUND);
  EXPECT_EQ(ticket, nullptr);
  EXPECT_EQ(tier_engine_check(e), TIER_OK) << tier_last_error();
  tier_engine_destroy(e);
}

// Read-modify-write leases from several threads are exclusive: no increment is lost.
TEST(CApiCxx, ReadWriteLeasesAreExclusive) {
  TempDir dir;
  tier_engine_t* e = make_engine(dir.path);
  ASSERT_NE(e, nullptr) << tier_last_error();
  std::atomic<int> deleted{0};
  tier_tensor_options_t opt = TIER_TENSOR_OPTIONS_INIT;
  opt.home = TIER_TIER_NVME;
  tier_tensor_t t{};
  ASSERT_EQ(tier_tensor_register(e, "counter", Producer::make(16, 0, &deleted), &opt, &t), TIER_OK)
      << tier_last_error();
  constexpr int kThreads = 4;
  constexpr int kRounds = 50;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < kThreads; ++w) {
    threads.emplace_back([&, w] {
      for (int r = 0; r < kRounds; ++r) {
        tier_ticket_t* ticket = nullptr;
        DLManagedTensor* dl = nullptr;
        const tier_tier_t where = (w + r) % 2 ? TIER_TIER_DEVICE : TIER_TIER_HOST;
        if (tier_tensor_acquire(e, t, where, TIER_ACCESS_READ_WRITE, nullptr, &ticket) != TIER_OK ||
            tier_ticket_wait(ticket, &dl) != TIER_OK) {
          ++failures;
          tier_ticket_destroy(ticket);
          continue;
        }
        tier_ticket_destroy(ticket);
        static_cast<float*>(dl->dl_tensor.data)[0] += 1.0f;
        dl->deleter(dl);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0) << tier_last_error();
  float back[16];
  ASSERT_EQ(tier_tensor_read(e, t, back, sizeof back), TIER_OK) << tier_last_error();
  EXPECT_EQ(back[0], static_cast<float>(kThreads * kRounds));
  EXPECT_EQ(back[15], 15.0f);
  EXPECT_EQ(tier_engine_check(e), TIER_OK) << tier_last_error();
  tier_engine_destroy(e);
}

// ---- CUDA: run only where a GPU is usable.

#ifdef TIER_TEST_WITH_CUDA
tier_engine_t* cuda_engine_or_skip(const TempDir& dir, std::string* why) {
  tier_status_t s = TIER_OK;
  tier_engine_t* e = make_engine(dir.path, &s, "cuda");
  if (e == nullptr) *why = tier_last_error();
  return e;
}

// A CUDA engine in `e`, or the test skips (fails under TIER_REQUIRE_CUDA=1, as bench/gpu_check.sh
// runs it, so that a GPU machine cannot pass these tests by skipping them).
#define CUDA_ENGINE_OR_SKIP(e, dir)                                                \
  std::string why_##e;                                                             \
  tier_engine_t* e = cuda_engine_or_skip(dir, &why_##e);                           \
  if (e == nullptr) {                                                              \
    if (std::getenv("TIER_REQUIRE_CUDA") != nullptr) {                             \
      GTEST_FAIL() << "TIER_REQUIRE_CUDA is set, but no CUDA engine: " << why_##e; \
    }                                                                              \
    GTEST_SKIP() << "no usable CUDA device: " << why_##e;                          \
  }

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// A write lease released through its deleter while the consumer's stream still has work queued
// that writes it: the engine must not take the memory (copy it home, hand it to a reader) before
// that work has run. The stream is held up by a host function that sleeps, then a memset writes
// the lease's memory; the deleter is called right after queueing them.
TEST(CApiCxx, CudaConsumerStreamOrdersTheEndOfAWriteLease) {
  TempDir dir;
  CUDA_ENGINE_OR_SKIP(e, dir);
  DLDevice device{};
  ASSERT_EQ(tier_engine_device(e, &device), TIER_OK);
  EXPECT_EQ(device.device_type, kDLCUDA);
  std::atomic<int> deleted{0};
  constexpr std::size_t kElems = 1 << 18;  // 1 MiB
  tier_tensor_options_t opt = TIER_TENSOR_OPTIONS_INIT;
  opt.home = TIER_TIER_NVME;
  tier_tensor_t t{};
  ASSERT_EQ(tier_tensor_register(e, "w", Producer::make(kElems, 0, &deleted), &opt, &t), TIER_OK) << tier_last_error();

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  tier_ticket_t* ticket = nullptr;
  DLManagedTensor* dl = nullptr;
  ASSERT_EQ(tier_tensor_acquire(e, t, TIER_TIER_DEVICE, TIER_ACCESS_WRITE, stream, &ticket), TIER_OK);
  ASSERT_EQ(tier_ticket_wait(ticket, &dl), TIER_OK) << tier_last_error();
  tier_ticket_destroy(ticket);
  EXPECT_EQ(dl->dl_tensor.device.device_type, kDLCUDA);
  CUDA_OK(cudaLaunchHostFunc(
      stream, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }, nullptr));
  CUDA_OK(cudaMemsetAsync(dl->dl_tensor.data, 0x5a, kElems * sizeof(float), stream));
  dl->deleter(dl);  // returns at once; the lease ends after the memset

  std::vector<unsigned char> back(kElems * sizeof(float));
  ASSERT_EQ(tier_tensor_read(e, t, back.data(), back.size()), TIER_OK) << tier_last_error();
  for (std::size_t i = 0; i < back.size(); i += 4093) ASSERT_EQ(back[i], 0x5a) << "byte " << i;
  EXPECT_EQ(back.back(), 0x5a);

  // The host tier's pinned memory says so.
  ASSERT_EQ(tier_tensor_acquire(e, t, TIER_TIER_HOST, TIER_ACCESS_READ, stream, &ticket), TIER_OK);
  ASSERT_EQ(tier_ticket_wait(ticket, &dl), TIER_OK) << tier_last_error();
  tier_ticket_destroy(ticket);
  EXPECT_EQ(dl->dl_tensor.device.device_type, kDLCUDAHost);
  dl->deleter(dl);
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaStreamDestroy(stream));
  EXPECT_EQ(tier_engine_check(e), TIER_OK) << tier_last_error();
  tier_engine_destroy(e);
}

// A read lease ended through its deleter while the consumer's stream still has to read it, and a
// second tensor that needs its memory (the 4 MiB device budget holds one 4 MiB tensor): the
// second one is granted only after the stream has read the first, so a memset of it on another
// stream cannot land in what the first stream copies out.
TEST(CApiCxx, CudaConsumerStreamOrdersTheEndOfAReadLease) {
  TempDir dir;
  CUDA_ENGINE_OR_SKIP(e, dir);
  std::atomic<int> deleted{0};
  constexpr std::size_t kElems = 1 << 20;  // 4 MiB
  constexpr std::size_t kBytes = kElems * sizeof(float);
  tier_tensor_options_t opt = TIER_TENSOR_OPTIONS_INIT;
  opt.home = TIER_TIER_HOST;
  tier_tensor_t a{}, b{};
  ASSERT_EQ(tier_tensor_register(e, "a", Producer::make(kElems, 1, &deleted), &opt, &a), TIER_OK) << tier_last_error();
  ASSERT_EQ(tier_tensor_register(e, "b", Producer::make(kElems, 2, &deleted), &opt, &b), TIER_OK) << tier_last_error();
  cudaStream_t reader = nullptr, writer = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&reader, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&writer, cudaStreamNonBlocking));
  float* out = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&out), kBytes, cudaHostAllocDefault));

  tier_ticket_t* ticket = nullptr;
  DLManagedTensor* dl = nullptr;
  ASSERT_EQ(tier_tensor_acquire(e, a, TIER_TIER_DEVICE, TIER_ACCESS_READ, reader, &ticket), TIER_OK);
  ASSERT_EQ(tier_ticket_wait(ticket, &dl), TIER_OK) << tier_last_error();
  tier_ticket_destroy(ticket);
  void* where = dl->dl_tensor.data;
  CUDA_OK(cudaLaunchHostFunc(
      reader, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }, nullptr));
  CUDA_OK(cudaMemcpyAsync(out, where, kBytes, cudaMemcpyDeviceToHost, reader));
  dl->deleter(dl);  // returns at once; the lease ends after the copy

  ASSERT_EQ(tier_tensor_acquire(e, b, TIER_TIER_DEVICE, TIER_ACCESS_WRITE, writer, &ticket), TIER_OK);
  ASSERT_EQ(tier_ticket_wait(ticket, &dl), TIER_OK) << tier_last_error();
  tier_ticket_destroy(ticket);
  EXPECT_EQ(dl->dl_tensor.data, where) << "the test needs b placed in a's block";
  CUDA_OK(cudaMemsetAsync(dl->dl_tensor.data, 0x33, kBytes, writer));
  dl->deleter(dl);
  CUDA_OK(cudaStreamSynchronize(reader));
  CUDA_OK(cudaStreamSynchronize(writer));
  for (std::size_t i = 0; i < kElems; i += 4093) ASSERT_EQ(out[i], 1.0f + static_cast<float>(i)) << "element " << i;
  CUDA_OK(cudaFreeHost(out));
  CUDA_OK(cudaStreamDestroy(reader));
  CUDA_OK(cudaStreamDestroy(writer));
  EXPECT_EQ(tier_engine_check(e), TIER_OK) << tier_last_error();
  tier_engine_destroy(e);
}

// A stream-ordered read (tier_tensor_acquire_on_stream): the ticket is ready once the copy to the
// device is queued; the consumer's stream, made to wait for it, reads the tensor's bytes. The
// stream is busy first (a sleeping host function) so the engine's copy and the stream's wait
// really overlap the host's progress.
TEST(CApiCxx, CudaStreamOrderedReadIsSeenByItsStream) {
  TempDir dir;
  CUDA_ENGINE_OR_SKIP(e, dir);
  std::atomic<int> deleted{0};
  constexpr std::size_t kElems = 1 << 20;  // 4 MiB
  constexpr std::size_t kBytes = kElems * sizeof(float);
  tier_tensor_options_t opt = TIER_TENSOR_OPTIONS_INIT;
  opt.home = TIER_TIER_HOST;
  tier_tensor_t a{};
  ASSERT_EQ(tier_tensor_register(e, "a", Producer::make(kElems, 3, &deleted), &opt, &a), TIER_OK) << tier_last_error();
  cudaStream_t reader = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&reader, cudaStreamNonBlocking));
  float* out = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&out), kBytes, cudaHostAllocDefault));
  CUDA_OK(cudaLaunchHostFunc(
      reader, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(100)); }, nullptr));
  tier_ticket_t* ticket = nullptr;
  DLManagedTensor* dl = nullptr;
  ASSERT_EQ(tier_tensor_acquire_on_stream(e, a, reader, &ticket), TIER_OK) << tier_last_error();
  ASSERT_EQ(tier_ticket_wait(ticket, &dl), TIER_OK) << tier_last_error();
  tier_ticket_destroy(ticket);
  EXPECT_EQ(dl->dl_tensor.device.device_type, kDLCUDA);
  CUDA_OK(cudaMemcpyAsync(out, dl->dl_tensor.data, kBytes, cudaMemcpyDeviceToHost, reader));
  dl->deleter(dl);  // the lease ends after the stream's copy
  CUDA_OK(cudaStreamSynchronize(reader));
  for (std::size_t i = 0; i < kElems; i += 4093) ASSERT_EQ(out[i], 3.0f + static_cast<float>(i)) << "element " << i;
  CUDA_OK(cudaFreeHost(out));
  CUDA_OK(cudaStreamDestroy(reader));
  EXPECT_EQ(tier_engine_check(e), TIER_OK) << tier_last_error();
  tier_engine_destroy(e);
}

// A kDLCUDA source is copied in after the work on the producer's stream.
TEST(CApiCxx, CudaSourceIsCopiedAfterTheProducersStream) {
  TempDir dir;
  CUDA_ENGINE_OR_SKIP(e, dir);
  constexpr std::size_t kBytes = 1 << 20;
  void* dev = nullptr;
  CUDA_OK(cudaMalloc(&dev, kBytes));
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_OK(cudaLaunchHostFunc(
      stream, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }, nullptr));
  CUDA_OK(cudaMemsetAsync(dev, 0x3c, kBytes, stream));

  std::int64_t shape[1] = {static_cast<std::int64_t>(kBytes)};
  DLManagedTensor src{};
  src.dl_tensor.data = dev;
  src.dl_tensor.device = {kDLCUDA, 0};
  src.dl_tensor.ndim = 1;
  src.dl_tensor.dtype = {kDLUInt, 8, 1};
  src.dl_tensor.shape = shape;
  tier_tensor_options_t opt = TIER_TENSOR_OPTIONS_INIT;
  opt.stream = stream;
  tier_tensor_t t{};
  ASSERT_EQ(tier_tensor_register(e, "from_gpu", &src, &opt, &t), TIER_OK) << tier_last_error();
  std::vector<unsigned char> back(kBytes);
  ASSERT_EQ(tier_tensor_read(e, t, back.data(), back.size()), TIER_OK) << tier_last_error();
  for (std::size_t i = 0; i < kBytes; i += 4093) ASSERT_EQ(back[i], 0x3c) << "byte " << i;
  CUDA_OK(cudaStreamDestroy(stream));
  CUDA_OK(cudaFree(dev));
  tier_engine_destroy(e);
}
#else
TEST(CApiCxx, CudaStreamOrderedReadIsSeenByItsStream) {
  GTEST_SKIP() << "built without CUDA (TIER_WITH_CUDA=OFF)";
}
TEST(CApiCxx, CudaConsumerStreamOrdersTheEndOfAReadLease) {
  GTEST_SKIP() << "built without CUDA (TIER_WITH_CUDA=OFF)";
}
TEST(CApiCxx, CudaConsumerStreamOrdersTheEndOfAWriteLease) {
  GTEST_SKIP() << "built without CUDA (TIER_WITH_CUDA=OFF)";
}
TEST(CApiCxx, CudaSourceIsCopiedAfterTheProducersStream) {
  GTEST_SKIP() << "built without CUDA (TIER_WITH_CUDA=OFF)";
}
#endif

// ---------------------------------------------------------------------------------------------
// The optimizer across data-parallel ranks through the C ABI: two ranks (threads), each holding
// one parameter, step with a callback communicator in tier_step_options_t::comm and match, bit
// for bit, one optimizer holding both (the global norm clips them alike); a failing all-reduce
// fails the step with nothing applied and the gradients kept.

// An in-process all-reduce (fp64 sums only, as the norm needs) over `world` threads.
struct Rendezvous {
  explicit Rendezvous(int w) : world(w) {}
  const int world;
  std::mutex mu;
  std::condition_variable cv;
  double acc = 0;
  double result = 0;
  int arrived = 0;
  int left = 0;  // ranks still to read the previous round's result
  std::uint64_t round = 0;
  std::atomic<int> calls{0};

  int all_reduce_f64(double* v) {
    // A rank that gave up (a failed check) leaves the other waiting: time out rather than hang.
    constexpr auto kPatience = std::chrono::seconds(60);
    std::unique_lock<std::mutex> lk(mu);
    if (!cv.wait_for(lk, kPatience, [&] { return left == 0; })) return TIER_ERROR_TIMED_OUT;
    acc += *v;
    const std::uint64_t mine = round;
    if (++arrived == world) {
      result = acc;
      acc = 0;
      arrived = 0;
      left = world;
      ++round;
      cv.notify_all();
    } else {
      if (!cv.wait_for(lk, kPatience, [&] { return round != mine; })) return TIER_ERROR_TIMED_OUT;
    }
    *v = result;
    if (--left == 0) cv.notify_all();
    ++calls;
    return TIER_OK;
  }
};

struct RankComm {
  Rendezvous* rv;
  bool fail = false;
};

int rank_all_reduce(void* user, void* buf, uint64_t count, tier_dtype_t dtype, tier_reduce_op_t op) {
  auto* rc = static_cast<RankComm*>(user);
  if (rc->fail) return TIER_ERROR_TIMED_OUT;
  if (dtype != TIER_DTYPE_F64 || count != 1 || op != TIER_REDUCE_SUM) return TIER_ERROR_UNSUPPORTED;
  return rc->rv->all_reduce_f64(static_cast<double*>(buf));
}

tier_comm_t* rank_comm(RankComm* rc, int rank, int world) {
  tier_comm_callbacks_t cb = TIER_COMM_CALLBACKS_INIT;
  cb.user = rc;
  cb.rank = rank;
  cb.world = world;
  cb.all_reduce = rank_all_reduce;
  tier_comm_t* comm = nullptr;
  EXPECT_EQ(tier_comm_create_callbacks(&cb, &comm), TIER_OK) << tier_last_error();
  return comm;
}

constexpr std::int64_t kRankNumel[2] = {3000, 1000};

// (GCC 12 warns wrongly (-Wrestrict) on a literal + std::to_string: built with a stream instead.)
template <class... A>
std::string text(const A&... a) {
  std::ostringstream os;
  (os << ... << a);
  return os.str();
}

DLTensor host_f32(float* data, const std::int64_t* shape) {
  DLTensor t{};
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = 1;
  t.dtype = {kDLFloat, 32, 1};
  t.shape = const_cast<std::int64_t*>(shape);
  return t;
}

float init_value(int k, std::int64_t i) {
  return 0.5f * std::sin(0.37f * static_cast<float>(i) + static_cast<float>(k));
}

// Step 2's gradients are large (clipped at 1.0), the others small.
float grad_value(int step, int k, std::int64_t i) {
  const float scale = step == 2 ? 40.0f : 0.004f;
  return scale * std::sin(0.11f * static_cast<float>(i) + static_cast<float>(step * 3 + k));
}

// Parameter w<k>'s gradient at `step` (grad_value for each element).
std::vector<float> rank_grad(int step, int k) {
  std::vector<float> g(static_cast<std::size_t>(kRankNumel[k]));
  for (std::int64_t i = 0; i < kRankNumel[k]; ++i) g[static_cast<std::size_t>(i)] = grad_value(step, k, i);
  return g;
}

// An optimizer holding parameters `ks` (their names w<k>), state on NVMe under dir/sub, beside
// `engine` when given.
tier_optimizer_t* ranked_optimizer(const fs::path& dir, const char* sub, std::vector<int> ks,
                                   tier_engine_t* engine = nullptr, const tier_tensor_t* engine_masters = nullptr) {
  const std::string json =
      R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}, "gradient_clipping": 1.0,)"
      R"( "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
      (dir / sub).string() + R"("}}, "tier": {"io": {"use_direct": false}, "optimizer": {"chunk_elements": 1024}}})";
  tier_optimizer_config_t c = TIER_OPTIMIZER_CONFIG_INIT;
  c.json = json.c_str();
  c.ignore_env = 1;
  c.max_elements = 4096;
  c.engine = engine;
  c.engine_masters = engine_masters != nullptr ? 1 : 0;
  tier_optimizer_t* o = nullptr;
  EXPECT_EQ(tier_optimizer_create(&c, &o), TIER_OK) << tier_last_error();
  if (o == nullptr) return nullptr;
  for (int k : ks) {
    if (engine_masters != nullptr) {  // the tensors hold the values: they are the masters
      const std::string name = text("w", k);
      uint32_t index = 99;
      EXPECT_EQ(tier_optimizer_add_engine_param(o, name.c_str(), &kRankNumel[k], 1, engine_masters[k], 0, 0, &index),
                TIER_OK)
          << tier_last_error();
      EXPECT_EQ(index, static_cast<uint32_t>(k));
      continue;
    }
    std::vector<float> init(static_cast<std::size_t>(kRankNumel[k]));
    for (std::int64_t i = 0; i < kRankNumel[k]; ++i) init[static_cast<std::size_t>(i)] = init_value(k, i);
    DLTensor t = host_f32(init.data(), &kRankNumel[k]);
    const std::string name = text("w", k);
    EXPECT_EQ(tier_optimizer_add_param(o, name.c_str(), &t, 0, nullptr), TIER_OK) << tier_last_error();
  }
  return o;
}

// The number after "key": in the optimizer's stats JSON.
std::uint64_t stats_number(tier_optimizer_t* o, const std::string& key) {
  char* js = nullptr;
  EXPECT_EQ(tier_optimizer_stats_json(o, &js), TIER_OK) << tier_last_error();
  const std::string s = js ? js : "";
  tier_string_free(js);
  const std::size_t at = s.find("\"" + key + "\":");
  if (at == std::string::npos) return ~std::uint64_t{0};
  const std::string rest = s.substr(at + key.size() + 3);
  if (rest.rfind("true", 0) == 0) return 1;
  if (rest.rfind("false", 0) == 0) return 0;
  return std::stoull(rest);
}

std::size_t files_in(const fs::path& dir, bool recursive) {
  std::size_t n = 0;
  if (recursive) {
    for (const auto& f : fs::recursive_directory_iterator(dir)) n += f.is_regular_file() ? 1 : 0;
  } else {
    for (const auto& f : fs::directory_iterator(dir)) n += f.is_regular_file() ? 1 : 0;
  }
  return n;
}

// An optimizer created beside an engine (tier_optimizer_config_t::engine) on the engine's swap
// path keeps its state in the engine's swap file, its room inside tier.budgets.nvme; it holds the
// engine, which may be destroyed first; its steps are those of an optimizer with files of its own.
TEST(CApiCxx, AnOptimizerBesideAnEngineKeepsItsStateInTheEnginesSwapFile) {
  TempDir dir;
  tier_engine_t* e = make_engine(dir.path, nullptr, "emulated", 300);
  ASSERT_NE(e, nullptr) << tier_last_error();
  tier_optimizer_t* own = ranked_optimizer(dir.path, "own", {0, 1});
  tier_optimizer_t* beside = ranked_optimizer(dir.path, "", {0, 1}, e);
  ASSERT_TRUE(own != nullptr && beside != nullptr);
  EXPECT_EQ(stats_number(own, "shared_swap"), 0u);
  EXPECT_EQ(stats_number(beside, "shared_swap"), 1u);
  EXPECT_EQ(files_in(dir.path, false), 1u);  // the engine's swap file, and no other
  EXPECT_EQ(files_in(dir.path, true), 2u);   // and the other optimizer's own, under own/
  const std::uint64_t reserved = stats_number(beside, "nvme_capacity_bytes");
  ASSERT_GT(reserved, 0u);
  ASSERT_LT(reserved, 1u << 20);

  // NVMe tensors get the budget (32 MiB) less the optimizer's room, and not a page more.
  std::atomic<int> deleted{0};
  tier_tensor_options_t on_nvme = TIER_TENSOR_OPTIONS_INIT;
  on_nvme.home = TIER_TIER_NVME;
  tier_tensor_t page{}, rest{};
  for (int i = 0; i < 8; ++i) {  // 4 MiB at a time: each is staged through the 8 MiB host budget
    const std::uint64_t bytes = i < 7 ? 4u << 20 : (4u << 20) - reserved;
    const std::string name = text("rest", i);
    ASSERT_EQ(tier_tensor_register(e, name.c_str(), Producer::make(bytes / 4, 0.0f, &deleted), &on_nvme, &rest),
              TIER_OK)
        << tier_last_error();
  }
  // (Only an unregistration could make NVMe room: the registration is refused at once.)
  EXPECT_EQ(tier_tensor_register(e, "page", Producer::make(1024, 0.0f, &deleted), &on_nvme, &page),
            TIER_ERROR_RESOURCE_EXHAUSTED);
  EXPECT_NE(std::string(tier_last_error()).find("nvme"), std::string::npos) << tier_last_error();

  for (int step = 1; step <= 4; ++step) {
    if (step == 4) {
      tier_engine_destroy(e);  // the optimizer holds it
      e = nullptr;
    }
    for (tier_optimizer_t* o : {own, beside}) {
      for (int k = 0; k < 2; ++k) {
        std::vector<float> g = rank_grad(step, k);
        DLTensor gt = host_f32(g.data(), &kRankNumel[k]);
        ASSERT_EQ(tier_optimizer_add_grad(o, static_cast<uint32_t>(k), &gt), TIER_OK) << tier_last_error();
      }
      ASSERT_EQ(tier_optimizer_step(o, nullptr, nullptr), TIER_OK) << tier_last_error();
    }
    for (int k = 0; k < 2; ++k) {
      std::vector<float> a(static_cast<std::size_t>(kRankNumel[k])), b(a.size());
      DLTensor ta = host_f32(a.data(), &kRankNumel[k]), tb = host_f32(b.data(), &kRankNumel[k]);
      ASSERT_EQ(tier_optimizer_read_param(own, static_cast<uint32_t>(k), &ta), TIER_OK) << tier_last_error();
      ASSERT_EQ(tier_optimizer_read_param(beside, static_cast<uint32_t>(k), &tb), TIER_OK) << tier_last_error();
      ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "step " << step << ", w" << k;
      ASSERT_NE(a[7], init_value(k, 7)) << "the steps changed nothing";
    }
  }
  tier_optimizer_destroy(beside);  // the engine goes with it, and its swap file
  EXPECT_EQ(files_in(dir.path, false), 0u);
  tier_optimizer_destroy(own);
}

TEST(CApiCxx, RanksStepWithTheGlobalNormThroughACommunicator) {
  TempDir dir;
  constexpr int kSteps = 3;
  // The reference: one optimizer with both parameters, no communicator.
  std::vector<float> ref_out[kSteps + 1][2];
  tier_step_report_t ref_rep[kSteps + 1];
  {
    tier_optimizer_t* ref = ranked_optimizer(dir.path, "ref", {0, 1});
    ASSERT_NE(ref, nullptr);
    for (int step = 1; step <= kSteps; ++step) {
      DLTensor outs[2];
      DLTensor* out_p[2];
      for (int k = 0; k < 2; ++k) {
        std::vector<float> g = rank_grad(step, k);
        DLTensor gt = host_f32(g.data(), &kRankNumel[k]);
        ASSERT_EQ(tier_optimizer_add_grad(ref, static_cast<uint32_t>(k), &gt), TIER_OK) << tier_last_error();
        ref_out[step][k].assign(static_cast<std::size_t>(kRankNumel[k]), 0.0f);
        outs[k] = host_f32(ref_out[step][k].data(), &kRankNumel[k]);
        out_p[k] = &outs[k];
      }
      tier_step_options_t so = TIER_STEP_OPTIONS_INIT;
      so.params_out = out_p;
      so.num_params_out = 2;
      ref_rep[step] = TIER_STEP_REPORT_INIT;
      ASSERT_EQ(tier_optimizer_step(ref, &so, &ref_rep[step]), TIER_OK) << tier_last_error();
    }
    EXPECT_LT(ref_rep[2].clip_coefficient, 1.0);
    EXPECT_EQ(ref_rep[1].clip_coefficient, 1.0);
    tier_optimizer_destroy(ref);
  }

  Rendezvous rv(2);
  std::vector<std::string> failures[2];
  auto rank_main = [&](int rank) {
    auto fail = [&](const std::string& what) { failures[rank].push_back(text(what, ": ", tier_last_error())); };
    RankComm good{&rv}, bad{&rv, true};
    tier_comm_t* comm = rank_comm(&good, rank, 2);
    tier_comm_t* broken = rank_comm(&bad, rank, 2);
    tier_optimizer_t* o = ranked_optimizer(dir.path, rank == 0 ? "r0" : "r1", {rank});
    if (comm == nullptr || broken == nullptr || o == nullptr) return fail("setup");
    std::vector<float> out(static_cast<std::size_t>(kRankNumel[rank]));
    DLTensor ot = host_f32(out.data(), &kRankNumel[rank]);
    DLTensor* out_p[1] = {&ot};
    for (int step = 1; step <= kSteps; ++step) {
      std::vector<float> g(static_cast<std::size_t>(kRankNumel[rank]));
      for (std::int64_t i = 0; i < kRankNumel[rank]; ++i) g[static_cast<std::size_t>(i)] = grad_value(step, rank, i);
      DLTensor gt = host_f32(g.data(), &kRankNumel[rank]);
      if (tier_optimizer_add_grad(o, 0, &gt) != TIER_OK) return fail("add_grad");
      tier_step_options_t so = TIER_STEP_OPTIONS_INIT;
      so.params_out = out_p;
      so.num_params_out = 1;
      tier_step_report_t rep = TIER_STEP_REPORT_INIT;
      if (step == 2) {
        // The framework's all-reduce fails (on every rank): nothing applied, the gradient kept.
        so.comm = broken;
        const std::vector<float> before = out;
        if (tier_optimizer_step(o, &so, &rep) != TIER_ERROR_TIMED_OUT) return fail("step with a failing comm");
        if (std::string(tier_last_error()).find("gradient norm across 2 ranks") == std::string::npos) {
          return fail("the failing comm's message");
        }
        int64_t at = -1;
        if (tier_optimizer_group_step(o, 0, &at) != TIER_OK || at != 1) return fail("step counter after the failure");
        if (out != before) return fail("outputs written by the failed step");
      }
      so.comm = comm;
      if (step == 3) {
        // Overlapped: the gradient in after the start, the norm combined at finish.
        if (tier_optimizer_clear_grads(o) != TIER_OK) return fail("clear_grads");
        if (tier_optimizer_start_overlap(o, &so) != TIER_OK) return fail("start_overlap");
        if (tier_optimizer_add_grad(o, 0, &gt) != TIER_OK) return fail("add_grad (overlapped)");
        if (tier_optimizer_finish_overlap(o, &rep) != TIER_OK) return fail("finish_overlap");
      } else if (tier_optimizer_step(o, &so, &rep) != TIER_OK) {
        return fail(text("step ", step));
      }
      if (rep.grad_norm != ref_rep[step].grad_norm || rep.clip_coefficient != ref_rep[step].clip_coefficient ||
          rep.step != ref_rep[step].step) {
        failures[rank].push_back(text("step ", step, ": norm ", rep.grad_norm, " clip ", rep.clip_coefficient,
                                      ", the reference's ", ref_rep[step].grad_norm, " clip ",
                                      ref_rep[step].clip_coefficient));
      }
      if (out != ref_out[step][rank]) failures[rank].push_back(text("step ", step, ": params differ"));
    }
    tier_optimizer_destroy(o);
    tier_comm_destroy(comm);
    tier_comm_destroy(broken);
  };
  std::thread r1(rank_main, 1);
  rank_main(0);
  r1.join();
  for (int r = 0; r < 2; ++r) {
    for (const auto& f : failures[r]) ADD_FAILURE() << "rank " << r << ": " << f;
  }
  EXPECT_EQ(rv.calls.load(), 2 * kSteps);  // one fp64 all-reduce per rank and step
}

// engine_masters: fp32 parameters that are engine tensors are their own masters, updated in place
// by each step to the bits an optimizer with masters of its own gives; its records hold m and v
// only; what does not fit the mode is refused.
TEST(CApiCxx, EngineTensorsThatAreTheirOwnMastersAreUpdatedInPlace) {
  TempDir dir;
  tier_engine_t* e = make_engine(dir.path);
  ASSERT_NE(e, nullptr) << tier_last_error();
  std::atomic<int> deleted{0};
  tier_tensor_options_t on_nvme = TIER_TENSOR_OPTIONS_INIT;
  on_nvme.home = TIER_TIER_NVME;
  tier_tensor_t t[2]{};
  for (int k = 0; k < 2; ++k) {
    const std::string name = text("p", k);
    ASSERT_EQ(
        tier_tensor_register(e, name.c_str(), Producer::make(static_cast<std::size_t>(kRankNumel[k]), 0.0f, &deleted),
                             &on_nvme, &t[k]),
        TIER_OK)
        << tier_last_error();
    std::vector<float> init(static_cast<std::size_t>(kRankNumel[k]));
    for (std::int64_t i = 0; i < kRankNumel[k]; ++i) init[static_cast<std::size_t>(i)] = init_value(k, i);
    ASSERT_EQ(tier_tensor_write(e, t[k], init.data(), init.size() * sizeof(float)), TIER_OK) << tier_last_error();
  }
  tier_optimizer_t* own = ranked_optimizer(dir.path, "own", {0, 1});
  ASSERT_NE(own, nullptr);
  tier_optimizer_config_t c = TIER_OPTIMIZER_CONFIG_INIT;
  c.json = "{}";
  c.engine_masters = 1;
  tier_optimizer_t* refused = nullptr;
  EXPECT_EQ(tier_optimizer_create(&c, &refused), TIER_ERROR_INVALID_ARGUMENT);  // no engine
  EXPECT_NE(std::string(tier_last_error()).find("engine_masters"), std::string::npos) << tier_last_error();
  tier_optimizer_t* inplace = ranked_optimizer(dir.path, "inplace", {0, 1}, e, t);
  ASSERT_NE(inplace, nullptr);
  std::vector<float> one(1, 1.0f);
  const std::int64_t n1 = 1;
  DLTensor late = host_f32(one.data(), &n1);
  EXPECT_EQ(tier_optimizer_add_param(inplace, "late", &late, 0, nullptr), TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(tier_optimizer_add_engine_param(own, "late", &n1, 1, t[0], 0, 0, nullptr), TIER_ERROR_INVALID_ARGUMENT);

  std::vector<float> want[2];
  for (int k = 0; k < 2; ++k) want[k].assign(static_cast<std::size_t>(kRankNumel[k]), 0.0f);
  for (int step = 1; step <= 3; ++step) {
    std::vector<float> g[2] = {rank_grad(step, 0), rank_grad(step, 1)};
    DLTensor gt[2] = {host_f32(g[0].data(), &kRankNumel[0]), host_f32(g[1].data(), &kRankNumel[1])};
    DLTensor outs[2] = {host_f32(want[0].data(), &kRankNumel[0]), host_f32(want[1].data(), &kRankNumel[1])};
    DLTensor* out_p[2] = {&outs[0], &outs[1]};
    for (int k = 0; k < 2; ++k) {
      ASSERT_EQ(tier_optimizer_add_grad(own, static_cast<uint32_t>(k), &gt[k]), TIER_OK);
      ASSERT_EQ(tier_optimizer_add_grad(inplace, static_cast<uint32_t>(k), &gt[k]), TIER_OK);
    }
    tier_step_options_t oo = TIER_STEP_OPTIONS_INIT;
    oo.params_out = out_p;
    oo.num_params_out = 2;
    ASSERT_EQ(tier_optimizer_step(own, &oo, nullptr), TIER_OK) << tier_last_error();
    ASSERT_EQ(tier_optimizer_step(inplace, nullptr, nullptr), TIER_OK) << tier_last_error();
    for (int k = 0; k < 2; ++k) {
      std::vector<float> got(want[k].size());
      ASSERT_EQ(tier_tensor_read(e, t[k], got.data(), got.size() * sizeof(float)), TIER_OK) << tier_last_error();
      ASSERT_EQ(std::memcmp(got.data(), want[k].data(), got.size() * sizeof(float)), 0)
          << "step " << step << ", w" << k;
      ASSERT_NE(got[7], init_value(k, 7)) << "the steps changed nothing";
    }
  }
  EXPECT_EQ(stats_number(inplace, "record_bytes") * 3, stats_number(own, "record_bytes") * 2);
  tier_optimizer_destroy(inplace);
  tier_optimizer_destroy(own);
  tier_engine_destroy(e);
}

// Gradients summed in engine tensors (one homed on NVMe) and declared with their sums of squares
// (tier_sum_of_squares) are read by the step from there: serial (step 2 clipped) and overlapped
// steps match an optimizer handed the same gradients as host arrays, bit for bit. Bad grad
// tensors are refused naming the parameter, with nothing applied.
TEST(CApiCxx, DeclaredGradientsAreReadFromEngineTensors) {
  TempDir dir;
  tier_engine_t* e = make_engine(dir.path);
  ASSERT_NE(e, nullptr) << tier_last_error();
  std::atomic<int> deleted{0};
  tier_tensor_options_t on_nvme = TIER_TENSOR_OPTIONS_INIT;
  on_nvme.home = TIER_TIER_NVME;
  tier_tensor_t g0{}, g1{}, short_one{}, ints{};
  ASSERT_EQ(tier_tensor_register(e, "g0", Producer::make(kRankNumel[0], 0.0f, &deleted), &on_nvme, &g0), TIER_OK)
      << tier_last_error();
  ASSERT_EQ(tier_tensor_register(e, "g1", Producer::make(kRankNumel[1], 0.0f, &deleted), nullptr, &g1), TIER_OK);
  ASSERT_EQ(tier_tensor_register(e, "short", Producer::make(kRankNumel[1] - 1, 0.0f, &deleted), nullptr, &short_one),
            TIER_OK);
  DLManagedTensor* as_int = Producer::make(kRankNumel[1], 0.0f, &deleted);
  as_int->dl_tensor.dtype = {kDLInt, 32, 1};
  ASSERT_EQ(tier_tensor_register(e, "ints", as_int, nullptr, &ints), TIER_OK);

  tier_optimizer_t* host = ranked_optimizer(dir.path, "host", {0, 1});
  tier_optimizer_t* eng = ranked_optimizer(dir.path, "eng", {0, 1});
  ASSERT_TRUE(host != nullptr && eng != nullptr);
  const tier_tensor_t grads[2] = {g0, g1};
  tier_step_options_t eo = TIER_STEP_OPTIONS_INIT;
  eo.engine = e;
  eo.grad_tensors = grads;
  eo.num_grad_tensors = 2;
  for (int step = 1; step <= 3; ++step) {
    std::vector<float> g[2] = {rank_grad(step, 0), rank_grad(step, 1)};
    double sumsq[2];
    for (int k = 0; k < 2; ++k) {
      DLTensor gt = host_f32(g[k].data(), &kRankNumel[k]);
      ASSERT_EQ(tier_optimizer_add_grad(host, static_cast<uint32_t>(k), &gt), TIER_OK);
      ASSERT_EQ(tier_sum_of_squares(&gt, &sumsq[k]), TIER_OK) << tier_last_error();
      ASSERT_EQ(tier_tensor_write(e, grads[k], g[k].data(), g[k].size() * sizeof(float)), TIER_OK) << tier_last_error();
    }
    tier_step_report_t want = TIER_STEP_REPORT_INIT, got = TIER_STEP_REPORT_INIT;
    ASSERT_EQ(tier_optimizer_step(host, nullptr, &want), TIER_OK) << tier_last_error();
    if (step < 3) {
      for (int k = 0; k < 2; ++k)
        ASSERT_EQ(tier_optimizer_declare_grad(eng, static_cast<uint32_t>(k), sumsq[k]), TIER_OK);
      if (step == 1) {
        // Refused, each naming the parameter, with nothing applied.
        const tier_tensor_t too_short[2] = {g0, short_one}, wrong_dtype[2] = {g0, ints};
        for (const tier_tensor_t* list : {too_short, wrong_dtype}) {
          tier_step_options_t bad = eo;
          bad.grad_tensors = list;
          EXPECT_EQ(tier_optimizer_step(eng, &bad, nullptr), TIER_ERROR_INVALID_ARGUMENT);
          EXPECT_NE(std::string(tier_last_error()).find("parameter 'w1'"), std::string::npos) << tier_last_error();
        }
        tier_step_options_t bad = eo;
        bad.num_grad_tensors = 1;
        EXPECT_EQ(tier_optimizer_step(eng, &bad, nullptr), TIER_ERROR_INVALID_ARGUMENT);
        EXPECT_NE(std::string(tier_last_error()).find("grad_tensors has 1 entries"), std::string::npos)
            << tier_last_error();
        EXPECT_NE(tier_optimizer_step(eng, nullptr, nullptr), TIER_OK);  // declared, but no tensors to read
        EXPECT_EQ(tier_optimizer_declare_grad(eng, 0, sumsq[0]), TIER_ERROR_FAILED_PRECONDITION);  // twice
        int64_t at = -1;
        ASSERT_EQ(tier_optimizer_group_step(eng, 0, &at), TIER_OK);
        EXPECT_EQ(at, 0);
      }
      ASSERT_EQ(tier_optimizer_step(eng, &eo, &got), TIER_OK) << tier_last_error();
    } else {
      ASSERT_EQ(tier_optimizer_start_overlap(eng, &eo), TIER_OK) << tier_last_error();
      for (int k = 1; k >= 0; --k)
        ASSERT_EQ(tier_optimizer_declare_grad(eng, static_cast<uint32_t>(k), sumsq[k]), TIER_OK);
      ASSERT_EQ(tier_optimizer_finish_overlap(eng, &got), TIER_OK) << tier_last_error();
      EXPECT_EQ(got.overlapped, 1);
    }
    EXPECT_EQ(got.grad_norm, want.grad_norm) << "step " << step;
    EXPECT_EQ(got.clip_coefficient, want.clip_coefficient) << "step " << step;
    if (step == 2) {
      EXPECT_LT(want.clip_coefficient, 1.0);
    }
    for (int k = 0; k < 2; ++k) {
      std::vector<float> a(static_cast<std::size_t>(kRankNumel[k])), b(a.size());
      DLTensor ta = host_f32(a.data(), &kRankNumel[k]), tb = host_f32(b.data(), &kRankNumel[k]);
      ASSERT_EQ(tier_optimizer_read_param(host, static_cast<uint32_t>(k), &ta), TIER_OK);
      ASSERT_EQ(tier_optimizer_read_param(eng, static_cast<uint32_t>(k), &tb), TIER_OK);
      ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "step " << step << ", w" << k;
    }
  }
  tier_optimizer_destroy(eng);
  tier_optimizer_destroy(host);
  tier_engine_destroy(e);
}

// The step writes its params straight into engine tensors (tier_step_options_t::engine): one
// optimizer stepping into engine tensors (one homed on NVMe at an offset, one on the host) and one
// into host arrays give the same bytes, serial and overlapped; bad targets are refused by name
// with nothing applied.
TEST(CApiCxx, AStepWritesItsParamsIntoEngineTensors) {
  TempDir dir;
  tier_engine_t* e = make_engine(dir.path);
  ASSERT_NE(e, nullptr) << tier_last_error();
  std::atomic<int> deleted{0};
  constexpr std::uint64_t kOffset = 16;
  tier_tensor_options_t on_nvme = TIER_TENSOR_OPTIONS_INIT;
  on_nvme.home = TIER_TIER_NVME;
  tier_tensor_t t0{}, t1{}, small{}, ints{};
  ASSERT_EQ(tier_tensor_register(e, "t0", Producer::make(kRankNumel[0] + kOffset + 4, -1.0f, &deleted), &on_nvme, &t0),
            TIER_OK)
      << tier_last_error();
  ASSERT_EQ(tier_tensor_register(e, "t1", Producer::make(kRankNumel[1], 0.0f, &deleted), nullptr, &t1), TIER_OK);
  ASSERT_EQ(tier_tensor_register(e, "small", Producer::make(kRankNumel[1] - 1, 0.0f, &deleted), nullptr, &small),
            TIER_OK);
  DLManagedTensor* as_int = Producer::make(kRankNumel[1], 0.0f, &deleted);
  as_int->dl_tensor.dtype = {kDLInt, 32, 1};
  ASSERT_EQ(tier_tensor_register(e, "ints", as_int, nullptr, &ints), TIER_OK);
  tier_tensor_t gone{};
  ASSERT_EQ(tier_tensor_register(e, "gone", Producer::make(kRankNumel[1], 0.0f, &deleted), nullptr, &gone), TIER_OK);
  ASSERT_EQ(tier_tensor_unregister(e, gone), TIER_OK);

  tier_optimizer_t* host = ranked_optimizer(dir.path, "host", {0, 1});
  tier_optimizer_t* eng = ranked_optimizer(dir.path, "eng", {0, 1});
  ASSERT_TRUE(host != nullptr && eng != nullptr);
  const tier_tensor_t targets[2] = {t0, t1};
  const std::uint64_t offsets[2] = {kOffset, 0};
  std::vector<float> want[2], got0(static_cast<std::size_t>(kRankNumel[0] + kOffset + 4)),
      got1(static_cast<std::size_t>(kRankNumel[1]));
  for (int k = 0; k < 2; ++k) want[k].assign(static_cast<std::size_t>(kRankNumel[k]), 0.0f);
  for (int step = 1; step <= 3; ++step) {
    std::vector<float> g[2] = {rank_grad(step, 0), rank_grad(step, 1)};
    DLTensor gt[2] = {host_f32(g[0].data(), &kRankNumel[0]), host_f32(g[1].data(), &kRankNumel[1])};
    DLTensor outs[2] = {host_f32(want[0].data(), &kRankNumel[0]), host_f32(want[1].data(), &kRankNumel[1])};
    DLTensor* out_p[2] = {&outs[0], &outs[1]};
    for (int k = 0; k < 2; ++k) ASSERT_EQ(tier_optimizer_add_grad(host, static_cast<uint32_t>(k), &gt[k]), TIER_OK);
    tier_step_options_t ho = TIER_STEP_OPTIONS_INIT;
    ho.params_out = out_p;
    ho.num_params_out = 2;
    ASSERT_EQ(tier_optimizer_step(host, &ho, nullptr), TIER_OK) << tier_last_error();

    tier_step_options_t eo = TIER_STEP_OPTIONS_INIT;
    eo.engine = e;
    eo.param_tensors = targets;
    eo.param_offsets = offsets;
    eo.num_param_tensors = 2;
    if (step == 1) {
      // Refused, each naming its parameter, with nothing applied.
      for (int k = 0; k < 2; ++k) ASSERT_EQ(tier_optimizer_add_grad(eng, static_cast<uint32_t>(k), &gt[k]), TIER_OK);
      tier_step_options_t bad = eo;
      bad.num_param_tensors = 1;
      EXPECT_EQ(tier_optimizer_step(eng, &bad, nullptr), TIER_ERROR_INVALID_ARGUMENT);
      bad = eo;
      bad.engine = nullptr;
      EXPECT_EQ(tier_optimizer_step(eng, &bad, nullptr), TIER_ERROR_INVALID_ARGUMENT);
      EXPECT_NE(std::string(tier_last_error()).find("options->engine is NULL"), std::string::npos);
      const tier_tensor_t too_small[2] = {t0, small}, wrong_dtype[2] = {t0, ints}, stale[2] = {t0, gone};
      for (const tier_tensor_t* list : {too_small, wrong_dtype, stale}) {
        bad = eo;
        bad.param_tensors = list;
        EXPECT_EQ(tier_optimizer_step(eng, &bad, nullptr), TIER_ERROR_INVALID_ARGUMENT);
        EXPECT_NE(std::string(tier_last_error()).find("parameter 'w1'"), std::string::npos) << tier_last_error();
      }
      EXPECT_NE(std::string(tier_last_error()).find("not a live tensor"), std::string::npos) << tier_last_error();
      const std::uint64_t past_end[2] = {kOffset + 5, 0};
      bad = eo;
      bad.param_offsets = past_end;
      EXPECT_EQ(tier_optimizer_step(eng, &bad, nullptr), TIER_ERROR_INVALID_ARGUMENT);
      EXPECT_NE(std::string(tier_last_error()).find("parameter 'w0'"), std::string::npos) << tier_last_error();
      int64_t at = -1;
      ASSERT_EQ(tier_optimizer_group_step(eng, 0, &at), TIER_OK);
      EXPECT_EQ(at, 0);
      ASSERT_EQ(tier_tensor_read(e, t1, got1.data(), got1.size() * sizeof(float)), TIER_OK);
      EXPECT_EQ(got1[5], 5.0f);  // as registered
      ASSERT_EQ(tier_optimizer_step(eng, &eo, nullptr), TIER_OK) << tier_last_error();
    } else if (step == 2) {
      for (int k = 0; k < 2; ++k) ASSERT_EQ(tier_optimizer_add_grad(eng, static_cast<uint32_t>(k), &gt[k]), TIER_OK);
      ASSERT_EQ(tier_optimizer_step(eng, &eo, nullptr), TIER_OK) << tier_last_error();
    } else {
      ASSERT_EQ(tier_optimizer_start_overlap(eng, &eo), TIER_OK) << tier_last_error();
      for (int k = 1; k >= 0; --k) ASSERT_EQ(tier_optimizer_add_grad(eng, static_cast<uint32_t>(k), &gt[k]), TIER_OK);
      tier_step_report_t rep = TIER_STEP_REPORT_INIT;
      ASSERT_EQ(tier_optimizer_finish_overlap(eng, &rep), TIER_OK) << tier_last_error();
      EXPECT_EQ(rep.overlapped, 1);
    }
    ASSERT_EQ(tier_tensor_read(e, t0, got0.data(), got0.size() * sizeof(float)), TIER_OK) << tier_last_error();
    ASSERT_EQ(tier_tensor_read(e, t1, got1.data(), got1.size() * sizeof(float)), TIER_OK) << tier_last_error();
    EXPECT_EQ(std::memcmp(got0.data() + kOffset, want[0].data(), want[0].size() * sizeof(float)), 0) << "step " << step;
    EXPECT_EQ(std::memcmp(got1.data(), want[1].data(), want[1].size() * sizeof(float)), 0) << "step " << step;
    for (std::uint64_t i = 0; i < kOffset; ++i) EXPECT_EQ(got0[i], -1.0f + static_cast<float>(i)) << i;
    for (std::size_t i = kOffset + want[0].size(); i < got0.size(); ++i) {
      EXPECT_EQ(got0[i], -1.0f + static_cast<float>(i)) << i;  // past the parameter: untouched
    }
  }
  tier_optimizer_destroy(host);
  tier_optimizer_destroy(eng);
  EXPECT_EQ(tier_engine_check(e), TIER_OK) << tier_last_error();
  tier_engine_destroy(e);
}

}  // namespace
