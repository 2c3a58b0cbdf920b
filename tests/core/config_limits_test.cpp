// Input limits of the config reader: nesting depth, document size and the kinds of file it reads.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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

// An unknown key of megabytes: the "did you mean" search compared it with every known key by
// edit distance (len(key) x len(candidate) each: minutes for a large key), and the note and the
// log quoted it whole. Now the search skips what cannot be a typo and the key is quoted cut short.
TEST(ConfigLimits, AHugeUnknownKeyIsQuotedCutShortWithNoSuggestion) {
  const std::string key(std::size_t{2} << 20, 'k');
  ConfigOptions o;
  o.apply_env = false;
  auto c = EngineConfig::from_json("{\"" + key + "\": 1}", o);
  ASSERT_TRUE(c.ok()) << c.status().message().substr(0, 300);
  std::size_t longest = 0;
  bool noted = false;
  for (const auto& n : c->notes) {
    longest = std::max(longest, n.size());
    noted = noted || n.find("(2097152 bytes)") != std::string::npos;
  }
  EXPECT_TRUE(noted);
  EXPECT_LT(longest, 1000u);
  o.strict = true;
  auto strict = EngineConfig::from_json("{\"tier\": {\"" + key + "\": 1}}", o);
  ASSERT_FALSE(strict.ok());
  EXPECT_LT(strict.status().message().size(), 1000u);
  EXPECT_TRUE(mentions(strict.status(), "is not known to tier")) << strict.status().message().substr(0, 300);
  EXPECT_FALSE(mentions(strict.status(), "did you mean"));
}

TEST(ConfigLimits, TyposOfKnownKeysAreStillSuggested) {
  ConfigOptions o;
  o.apply_env = false;
  o.strict = true;
  auto c = EngineConfig::from_json(R"({"tier": {"budgetz": {}}})", o);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(mentions(c.status(), "did you mean 'tier.budgets'?")) << c.status();
}

// A NUL byte in a path: the system reads the path up to it, so "/nvme/a\0b" put the swap file in
// /nvme/a without a word. Every config string is refused with a NUL in it.
TEST(ConfigLimits, ANulByteInAPathIsRefused) {
  const char* const configs[] = {
      R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/a\u0000b"}}})",
      R"({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/tmp/a\u0000b"}}})",
      R"({"tier": {"swap_paths": ["/tmp/ok", "/tmp/a\u0000b"]}})",
      R"({"tier": {"swap_paths": "/tmp/a\u0000b"}})",
      R"({"tier": {"trace_file": "/tmp/trace\u0000.json"}})",
  };
  for (const char* text : configs) {
    auto c = parse(text);
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_TRUE(mentions(c.status(), "NUL byte")) << c.status();
    EXPECT_TRUE(mentions(c.status(), "\\u0000")) << c.status();  // shown escaped, not cut
  }
  EXPECT_TRUE(parse(R"({"tier": {"swap_paths": ["/tmp/ok"]}})").ok());
}

}  // namespace
}  // namespace tier
