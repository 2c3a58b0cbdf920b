// Input limits of the config reader: nesting depth, document size and the kinds of file it reads.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tier/config.hpp"

namespace tier {
namespace {

Result<EngineConfig> parse(const std::string& text) {
  ConfigOptions o;
  o.apply_env = false;
  return EngineConfig::from_json(text, o);
}

bool mentions(const Status& s, const std::string& needle) {
  return s.message().find(needle) != std::string::npos;
}

// A scratch directory removed at the end of the test.
struct ScratchDir {
  std::filesystem::path path;
  ScratchDir() {
    path = std::filesystem::temp_directory_path() / ("tier-config-limits-" + std::to_string(::getpid()) + "-" +
                                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

TEST(ConfigLimits, DeeplyNestedArrayIsRefusedNamingTheLimit) {
  // 70,000 levels overflowed the stack while the error message quoted the document.
  const std::string deep = std::string(70'000, '[') + std::string(70'000, ']');
  auto c = parse(deep);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(mentions(c.status(), "more than 64 levels deep")) << c.status();
}

TEST(ConfigLimits, DeeplyNestedValueInsideAKnownKeyIsRefused) {
  std::string deep = R"({"scheduler": {"params": )";
  deep += std::string(70'000, '[') + std::string(70'000, ']') + "}}";
  auto c = parse(deep);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(mentions(c.status(), "levels deep")) << c.status();
}

TEST(ConfigLimits, UnterminatedDeepNestingIsRefusedForDepthNotSyntax) {
  auto c = parse(std::string(100'000, '['));
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(mentions(c.status(), "levels deep")) << c.status();
}

TEST(ConfigLimits, NestingAtTheLimitIsStillParsed) {
  // 64 levels: the document object plus 63 nested arrays in an unknown key (a note, not an error).
  const std::string text = R"({"x": )" + std::string(63, '[') + std::string(63, ']') + "}";
  auto c = parse(text);
  EXPECT_TRUE(c.ok()) << c.status();
  const std::string over = R"({"x": )" + std::string(64, '[') + std::string(64, ']') + "}";
  EXPECT_FALSE(parse(over).ok());
}

TEST(ConfigLimits, SyntaxErrorsStillSayWhere) {
  auto c = parse(R"({"aio": {"block_size": 4096,}})");
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(mentions(c.status(), "not valid JSON")) << c.status();
  EXPECT_TRUE(mentions(c.status(), "line 1")) << c.status();
}

TEST(ConfigLimits, OversizedTextIsRefusedNamingTheLimit) {
  std::string big = R"({"pad": ")";
  big.append(std::size_t{17} << 20, 'a');
  big += "\"}";
  auto c = parse(big);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(mentions(c.status(), "over the limit of 16.00 MiB")) << c.status();
}

TEST(ConfigLimits, DevZeroIsRefusedAsACharacterDevice) {
  auto c = EngineConfig::from_file("/dev/zero");
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(mentions(c.status(), "config file '/dev/zero'")) << c.status();
  EXPECT_TRUE(mentions(c.status(), "a character device")) << c.status();
}

TEST(ConfigLimits, DirectoryIsRefusedAsADirectory) {
  ScratchDir d;
  auto c = EngineConfig::from_file(d.path.string());
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(mentions(c.status(), "is a directory; give the path of a JSON file")) << c.status();
}

TEST(ConfigLimits, FifoIsRefusedWithoutWaitingForAWriter) {
  ScratchDir d;
  const std::string fifo = (d.path / "config.json").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto c = EngineConfig::from_file(fifo);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(mentions(c.status(), "a FIFO")) << c.status();
}

TEST(ConfigLimits, OversizedFileIsRefusedBeforeItIsRead) {
  ScratchDir d;
  const std::string path = (d.path / "big.json").string();
  {
    std::ofstream out(path);
    out << "{}";
  }
  std::filesystem::resize_file(path, std::uintmax_t{17} << 20);  // sparse: costs no disk
  auto c = EngineConfig::from_file(path);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(mentions(c.status(), "over the limit of 16.00 MiB")) << c.status();
}

TEST(ConfigLimits, RegularFileStillReads) {
  ScratchDir d;
  const std::string path = (d.path / "ok.json").string();
  {
    std::ofstream out(path);
    out << R"({"zero_optimization": {"stage": 2}})";
  }
  auto c = EngineConfig::from_file(path, {.apply_env = false});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->zero_stage, 2);
}

}  // namespace
}  // namespace tier
