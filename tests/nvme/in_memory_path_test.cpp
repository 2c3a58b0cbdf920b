// The "NVMe" path on tmpfs: detected, warned about once per path, and still usable.
#include <linux/magic.h>
#include <sys/statfs.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "nvme/nvme_test_util.hpp"
#include "tier/ext/swap_space.hpp"
#include "tier/log.hpp"

namespace tier::nvme {
namespace {

bool statfs_says_tmpfs(const std::string& path) {
  struct statfs sf {};
  return ::statfs(path.c_str(), &sf) == 0 && static_cast<unsigned long>(sf.f_type) == TMPFS_MAGIC;
}

TEST(InMemoryPath, DevShmIsDetectedAsInMemory) {
  if (!std::filesystem::exists("/dev/shm")) GTEST_SKIP() << "no /dev/shm here";
  if (!statfs_says_tmpfs("/dev/shm")) GTEST_SKIP() << "/dev/shm is not a tmpfs here";
  auto r = path_is_in_memory("/dev/shm");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(*r);
}

TEST(InMemoryPath, TheBuildDirectoryIsNotInMemory) {
  const std::string dir = test::disk_base();
  if (statfs_says_tmpfs(dir)) GTEST_SKIP() << dir << " is itself a tmpfs (TIER_TEST_DIR?)";
  auto r = path_is_in_memory(dir);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(*r) << dir;
}

TEST(InMemoryPath, AMissingPathIsAnErrorNamingIt) {
  auto r = path_is_in_memory("/nonexistent/tier-in-memory-path");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("/nonexistent/tier-in-memory-path"), std::string::npos) << r.status();
}

TEST(InMemoryPath, ASwapSpaceOnTmpfsWarnsOnceNamingThePathAndWorks) {
  if (!std::filesystem::exists(test::shm_base()) || !statfs_says_tmpfs(test::shm_base())) {
    GTEST_SKIP() << "/dev/shm is not a tmpfs here";
  }
  test::ScratchDir dir(test::shm_base(), "in-memory");
  ASSERT_TRUE(dir.ok());
  std::vector<std::string> lines;
  std::mutex lines_mu;
  set_log_sink([&](LogLevel, std::string_view m) {
    std::lock_guard<std::mutex> lk(lines_mu);
    lines.emplace_back(m);
  });
  SwapSpaceOptions o;
  o.paths = {dir.path()};
  o.bytes_per_path = 4 << 20;
  o.use_direct = false;
  auto sp = SwapSpace::create(o);
  auto sp2 = SwapSpace::create(o);
  set_log_sink(nullptr);
  ASSERT_TRUE(sp.ok()) << sp.status();
  ASSERT_TRUE(sp2.ok()) << sp2.status();
  std::size_t mentions = 0;
  for (const auto& l : lines) {
    if (l.find("is tmpfs: 'NVMe' tier data is held in RAM") != std::string::npos) {
      ++mentions;
      EXPECT_NE(l.find(dir.path()), std::string::npos) << l;
    }
  }
  EXPECT_EQ(mentions, 1u) << "warned once per path";
}

}  // namespace
}  // namespace tier::nvme
