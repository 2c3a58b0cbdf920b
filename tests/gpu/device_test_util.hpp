// Helpers shared by the device tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

#include "tier/ext/cuda_probe.hpp"
#include "tier/ext/device.hpp"
#include "tier/ext/host_arena.hpp"

namespace tier::test {

// Skips the current test when no CUDA GPU is usable, saying why. With TIER_REQUIRE_CUDA=1 in the
// environment (bench/gpu_check.sh sets it on GPU machines) the test fails instead, so a GPU run
// cannot pass by skipping everything.
#define TIER_SKIP_WITHOUT_CUDA()                                                                                   \
  do {                                                                                                             \
    if (!::tier::probe_cuda().usable()) {                                                                          \
      if (std::getenv("TIER_REQUIRE_CUDA") != nullptr) {                                                           \
        GTEST_FAIL() << "TIER_REQUIRE_CUDA is set, but no CUDA device: " << ::tier::probe_cuda().status.message(); \
      }                                                                                                            \
      GTEST_SKIP() << "no CUDA device: " << ::tier::probe_cuda().status.message();                                 \
    }                                                                                                              \
  } while (0)

// Bytes that differ from copy to copy (a fixed seed per call site keeps failures reproducible).
inline std::vector<std::uint8_t> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<std::uint8_t>(rng());
  return v;
}

// A pinned host arena for copies; fails the test if it cannot be made.
inline std::unique_ptr<HostArena> make_arena(std::uint64_t bytes) {
  auto a = HostArena::create({bytes, HugePageMode::kAuto, true});
  EXPECT_TRUE(a.ok()) << a.status();
  return a.ok() ? std::move(a).value() : nullptr;
}

}  // namespace tier::test
