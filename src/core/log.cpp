#include "tier/log.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

#include "core/text.hpp"

namespace tier {

namespace {
std::atomic<int> g_level{-1};  // -1: not read from the environment yet

struct LogState {
  std::mutex mu;
  LogSink sink;
  std::set<std::string, std::less<>> once_keys;
};
LogState& state() {
  static LogState* s = new LogState();  // leaked on purpose: usable during static destruction
  return *s;
}
}  // namespace

const char* log_level_name(LogLevel l) noexcept {
  switch (l) {
    case LogLevel::kTrace: return "trace";
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kError: return "error";
    case LogLevel::kOff: return "off";
  }
  return "unknown";
}

Result<LogLevel> parse_log_level(std::string_view text) {
  const std::string s = detail::lower(detail::trim(text));
  if (s == "trace") return LogLevel::kTrace;
  if (s == "debug") return LogLevel::kDebug;
  if (s == "info") return LogLevel::kInfo;
  if (s == "warn" || s == "warning") return LogLevel::kWarn;
  if (s == "error") return LogLevel::kError;
  if (s == "off" || s == "none") return LogLevel::kOff;
  return invalid_argument(
      str("log level '", detail::printable(text), "' is not one of: trace, debug, info, warn, error, off"));
}

void set_log_level(LogLevel level) noexcept {
  g_level.store(static_cast<int>(level));
}

LogLevel log_level() noexcept {
  int v = g_level.load(std::memory_order_relaxed);
  if (v >= 0) return static_cast<LogLevel>(v);
  LogLevel level = LogLevel::kInfo;
  if (const char* env = std::getenv("TIER_LOG_LEVEL")) {
    auto parsed = parse_log_level(env);
    if (parsed.ok()) {
      level = *parsed;
    } else {
      std::fprintf(stderr, "tier: warn: TIER_LOG_LEVEL: %s\n", parsed.status().message().c_str());
    }
  }
  int expected = -1;
  g_level.compare_exchange_strong(expected, static_cast<int>(level));
  return static_cast<LogLevel>(g_level.load());
}

void set_log_sink(LogSink sink) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().sink = std::move(sink);
}

void log(LogLevel level, std::string_view message) {
  if (!log_enabled(level)) return;
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.sink) {
    s.sink(level, message);
    return;
  }
  std::fprintf(stderr, "tier: %s: %.*s\n", log_level_name(level), static_cast<int>(message.size()), message.data());
}

bool log_once(std::string_view key, LogLevel level, std::string_view message) {
  {
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.once_keys.emplace(key).second) return false;
  }
  log(level, message);
  return true;
}

}  // namespace tier
