// Internal: the table of every configuration key tier knows. config.cpp parses, validates,
// applies environment overrides and writes JSON from this table; the tests walk it so that every
// key is covered with a valid, an invalid and an unknown neighbour.
#pragma once

#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tier/config.hpp"

namespace tier::detail {

enum class ValueKind {
  kObject,  // a known section; its children are keys of their own
  kOpaque,  // a section accepted whole (its inner keys are not checked)
  kBool,
  kInt,  // an integer (an integral float such as 1e8 is accepted)
  kNumber,
  kSize,  // bytes: an integer or a string with a unit ("4G")
  kString,
  kEnum,        // one of `choices`, case-insensitive
  kStringList,  // an array of strings, or one string
  kPair,        // two numbers, e.g. betas
};

enum class Treatment { kActed, kNoted };

struct KeySpec {
  std::string path;
  ValueKind kind = ValueKind::kObject;
  Treatment treatment = Treatment::kActed;
  std::string note;  // kNoted: how tier treats the key
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  std::uint64_t multiple_of = 0;
  std::vector<std::string> choices;
  bool auto_ok = false;
  nlohmann::json auto_value;  // what "auto" resolves to
  std::string canonical;      // for an alias: the key it stands for
  // Extra validation of a normalized value; returns an "allowed: ..." description on failure.
  std::function<std::string(const nlohmann::json&)> check;
  std::function<void(EngineConfig&, const nlohmann::json&)> set;  // gets the normalized value
  std::function<nlohmann::json(const EngineConfig&)> get;         // for to_json; absent for aliases
  nlohmann::json sample_valid;                                    // for tests
  nlohmann::json sample_expected;                                 // normalized form of sample_valid (null: the same)
  nlohmann::json sample_invalid;                                  // null: no invalid value exists (opaque sections)
  nlohmann::json sample_context;  // other keys a test must set for sample_valid to apply

  const std::string& canonical_path() const { return canonical.empty() ? path : canonical; }
  // "an integer from 1 to 4096", "one of: none, cpu, nvme", ...
  std::string allowed() const;
};

const std::vector<KeySpec>& config_schema();
const KeySpec* find_key_spec(std::string_view path);
// TIER_IO_ENGINE for tier.io_engine; empty for keys outside the tier section.
std::string env_name_for(const KeySpec& spec);

}  // namespace tier::detail
