#include "tier/ext/cuda_probe.hpp"

#include <gtest/gtest.h>

namespace tier {
namespace {

TEST(CudaProbe, AnswersWithoutCrashingWhetherOrNotAGpuExists) {
  const CudaProbe& p = probe_cuda();
#ifdef TIER_WITH_CUDA
  EXPECT_TRUE(p.compiled_in);
  EXPECT_GT(p.runtime_version, 0) << "the statically linked runtime knows its own version";
#else
  EXPECT_FALSE(p.compiled_in);
#endif
  if (p.usable()) {
    ASSERT_FALSE(p.gpus.empty());
    EXPECT_GT(p.gpus[0].total_bytes, 0u);
    EXPECT_FALSE(p.gpus[0].name.empty());
    EXPECT_NE(p.summary().find(p.gpus[0].name), std::string::npos);
  } else {
    EXPECT_TRUE(p.gpus.empty());
    EXPECT_FALSE(p.status.ok());
    EXPECT_FALSE(p.status.message().empty()) << "says why no GPU is usable";
    EXPECT_EQ(p.summary().rfind("none: ", 0), 0u);
  }
  // Probing twice gives the same cached answer.
  EXPECT_EQ(&probe_cuda(), &p);
}

}  // namespace
}  // namespace tier
