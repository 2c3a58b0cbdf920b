// tier/log.hpp — tier's diagnostics: levelled messages to stderr or a user sink.
//
// The level comes from set_log_level() or, at first use, the TIER_LOG_LEVEL environment variable
// (trace, debug, info, warn, error, off; default info). Fallbacks and degraded modes (no O_DIRECT,
// mlock refused, no GPU) are logged once through log_once(), so a long run is not flooded.
//
// Thread safety: all functions are safe from any thread; a sink is called under a lock, one
// message at a time.
#pragma once

#include <functional>
#include <string_view>

#include "tier/status.hpp"

namespace tier {

enum class LogLevel : int { kTrace = 0, kDebug, kInfo, kWarn, kError, kOff };

const char* log_level_name(LogLevel l) noexcept;
Result<LogLevel> parse_log_level(std::string_view text);

void set_log_level(LogLevel level) noexcept;
LogLevel log_level() noexcept;
inline bool log_enabled(LogLevel level) noexcept {
  return level >= log_level() && level != LogLevel::kOff;
}

// Replaces the destination of messages; an empty function restores stderr.
using LogSink = std::function<void(LogLevel, std::string_view)>;
void set_log_sink(LogSink sink);

void log(LogLevel level, std::string_view message);
// Logs the message only the first time `key` is seen in this process; returns whether it logged.
bool log_once(std::string_view key, LogLevel level, std::string_view message);

}  // namespace tier

#define TIER_LOG(level, ...)                                          \
  do {                                                                \
    if (::tier::log_enabled(::tier::LogLevel::level)) {               \
      ::tier::log(::tier::LogLevel::level, ::tier::str(__VA_ARGS__)); \
    }                                                                 \
  } while (0)
