#include "tier/log.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace tier {
namespace {

struct CaptureLog {
  std::vector<std::pair<LogLevel, std::string>> lines;
  LogLevel saved = log_level();
  CaptureLog() {
    set_log_sink([this](LogLevel l, std::string_view m) { lines.emplace_back(l, std::string(m)); });
  }
  ~CaptureLog() {
    set_log_sink({});
    set_log_level(saved);
  }
};

TEST(Log, LevelFiltersMessages) {
  CaptureLog cap;
  set_log_level(LogLevel::kWarn);
  TIER_LOG(kInfo, "hidden ", 1);
  TIER_LOG(kWarn, "shown ", 2);
  TIER_LOG(kError, "shown ", 3);
  ASSERT_EQ(cap.lines.size(), 2u);
  EXPECT_EQ(cap.lines[0].second, "shown 2");
  EXPECT_EQ(cap.lines[1].first, LogLevel::kError);
  set_log_level(LogLevel::kOff);
  TIER_LOG(kError, "silenced");
  EXPECT_EQ(cap.lines.size(), 2u);
}

TEST(Log, OnceLogsTheFirstTimeOnly) {
  CaptureLog cap;
  set_log_level(LogLevel::kInfo);
  EXPECT_TRUE(log_once("log_test.key", LogLevel::kWarn, "fallback taken"));
  EXPECT_FALSE(log_once("log_test.key", LogLevel::kWarn, "fallback taken"));
  EXPECT_TRUE(log_once("log_test.other", LogLevel::kWarn, "other"));
  EXPECT_EQ(cap.lines.size(), 2u);
}

TEST(Log, ParseLevel) {
  EXPECT_EQ(*parse_log_level("debug"), LogLevel::kDebug);
  EXPECT_EQ(*parse_log_level("WARNING"), LogLevel::kWarn);
  auto bad = parse_log_level("chatty");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("trace, debug, info, warn, error, off"), std::string::npos);
}

}  // namespace
}  // namespace tier
