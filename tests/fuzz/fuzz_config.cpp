// libFuzzer target: EngineConfig from JSON text. Any text must give a config or an error, never a
// crash; a config that parses must survive its own to_json.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "tier/config.hpp"
#include "tier/log.hpp"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tier::set_log_level(tier::LogLevel::kOff);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  tier::ConfigOptions options;
  options.apply_env = false;
  options.strict = size % 2 == 1;  // both modes, chosen by the input
  auto cfg = tier::EngineConfig::from_json(text, options);
  if (!cfg.ok()) {
    (void)cfg.status().to_string();
    return 0;
  }
  // What tier prints for a config it accepted must read back as the same config.
  const std::string once = cfg->to_json();
  tier::ConfigOptions again_options;
  again_options.apply_env = false;
  auto again = tier::EngineConfig::from_json(once, again_options);
  if (!again.ok()) {
    std::fprintf(stderr, "to_json of an accepted config does not parse: %s\n%s\n", again.status().to_string().c_str(),
                 once.c_str());
    std::abort();
  }
  if (again->to_json() != once) {
    std::fprintf(stderr, "to_json is not stable:\n%s\n%s\n", once.c_str(), again->to_json().c_str());
    std::abort();
  }
  return 0;
}
