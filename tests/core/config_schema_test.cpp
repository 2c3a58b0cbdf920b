// Walks the table of configuration keys: every key gets a valid value, an invalid value and an
// unknown neighbour, so a key added to the table is tested without writing a new test.
#include <gtest/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "core/config_schema.hpp"
#include "tier/config.hpp"

namespace tier {
namespace {

using json = nlohmann::json;
using detail::KeySpec;
using detail::ValueKind;

json at_path(const std::string& path, json value) {
  json doc = json::object();
  json* node = &doc;
  std::size_t start = 0;
  while (true) {
    const auto dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (dot == std::string::npos) {
      (*node)[part] = std::move(value);
      return doc;
    }
    node = &(*node)[part];
    start = dot + 1;
  }
}

json lookup(const json& doc, const std::string& path) {
  const json* node = &doc;
  std::size_t start = 0;
  while (true) {
    const auto dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!node->contains(part)) return nullptr;
    node = &(*node)[part];
    if (dot == std::string::npos) return *node;
    start = dot + 1;
  }
}

std::vector<const KeySpec*> specs_where(bool (*pred)(const KeySpec&)) {
  std::vector<const KeySpec*> out;
  for (const auto& k : detail::config_schema()) {
    if (pred(k)) out.push_back(&k);
  }
  return out;
}

std::string test_name(const testing::TestParamInfo<const KeySpec*>& info) {
  std::string n = info.param->path.empty() ? "root" : info.param->path;
  for (char& c : n) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return n;
}

Result<EngineConfig> parse(const json& doc, bool strict = false) {
  ConfigOptions o;
  o.apply_env = false;
  o.strict = strict;
  return EngineConfig::from_json(doc.dump(), o);
}

json merged(json base, const json& extra) {
  if (extra.is_object()) base.merge_patch(extra);
  return base;
}

class EveryValueKey : public testing::TestWithParam<const KeySpec*> {};

TEST_P(EveryValueKey, AcceptsAValidValue) {
  const KeySpec& k = *GetParam();
  ASSERT_FALSE(k.sample_valid.is_null()) << k.path << " has no valid sample";
  const json doc = merged(at_path(k.path, k.sample_valid), k.sample_context);
  auto cfg = parse(doc);
  ASSERT_TRUE(cfg.ok()) << k.path << ": " << cfg.status();
  if (k.treatment == detail::Treatment::kNoted) {
    bool noted = false;
    for (const auto& n : cfg->notes) noted = noted || n.rfind(k.path + ":", 0) == 0;
    EXPECT_TRUE(noted) << k.path << " accepted without a note saying how tier treats it";
  }
  if (k.get || !k.canonical.empty()) {
    // What was set reads back from the resolved config at the key's canonical place.
    const KeySpec* canon = detail::find_key_spec(k.canonical_path());
    ASSERT_NE(canon, nullptr);
    if (canon->get) {
      const json expected = k.sample_expected.is_null() ? k.sample_valid : k.sample_expected;
      const json got = lookup(json::parse(cfg->to_json()), k.canonical_path());
      if (expected.is_number() && got.is_number()) {
        EXPECT_DOUBLE_EQ(got.get<double>(), expected.get<double>()) << k.path;
      } else if (expected.is_object() || expected.is_array()) {
        EXPECT_EQ(got.dump(), expected.dump()) << k.path;
      } else {
        EXPECT_EQ(got, expected) << k.path;
      }
    }
  }
}

TEST_P(EveryValueKey, RejectsAnInvalidValueNamingKeyValueAndWhatIsAllowed) {
  const KeySpec& k = *GetParam();
  ASSERT_FALSE(k.sample_invalid.is_null()) << k.path << " has no invalid sample";
  auto cfg = parse(merged(at_path(k.path, k.sample_invalid), k.sample_context));
  ASSERT_FALSE(cfg.ok()) << k.path << " accepted " << k.sample_invalid.dump();
  const std::string& msg = cfg.status().message();
  EXPECT_EQ(cfg.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(msg.find("'" + k.path + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find(k.sample_invalid.dump()), std::string::npos) << msg;
  EXPECT_NE(msg.find("allowed: "), std::string::npos) << msg;
}

TEST_P(EveryValueKey, AutoIsAcceptedExactlyWhereAllowed) {
  const KeySpec& k = *GetParam();
  if (k.kind == ValueKind::kString || k.kind == ValueKind::kStringList) {
    // "auto" is a legitimate string here (a path named auto); it must be kept as given.
    auto cfg = parse(at_path(k.path, "auto"));
    if (cfg.ok()) return;
    FAIL() << k.path << ": " << cfg.status();
  }
  auto cfg = parse(merged(at_path(k.path, "auto"), k.sample_context));
  if (k.auto_ok) {
    ASSERT_TRUE(cfg.ok()) << k.path << ": " << cfg.status();
    EXPECT_NE(std::find(cfg->auto_keys.begin(), cfg->auto_keys.end(), k.path), cfg->auto_keys.end());
    const KeySpec* canon = detail::find_key_spec(k.canonical_path());
    if (canon->get && k.treatment == detail::Treatment::kActed) {
      const json got = lookup(json::parse(cfg->to_json()), k.canonical_path());
      EXPECT_EQ(got.dump(), json(k.auto_value).dump()) << k.path << " resolves to its documented default";
    }
  } else {
    ASSERT_FALSE(cfg.ok()) << k.path << " accepted \"auto\"";
    EXPECT_NE(cfg.status().message().find("'" + k.path + "'"), std::string::npos);
  }
}

INSTANTIATE_TEST_SUITE_P(Config, EveryValueKey,
                         testing::ValuesIn(specs_where([](const KeySpec& k) { return k.kind != ValueKind::kObject; })),
                         test_name);

class EverySection : public testing::TestWithParam<const KeySpec*> {};

TEST_P(EverySection, ReportsAnUnknownKeyWithASuggestion) {
  const KeySpec& k = *GetParam();
  // A typo of a real child: its last letter doubled.
  std::string child;
  for (const auto& other : detail::config_schema()) {
    const std::string prefix = k.path.empty() ? "" : k.path + ".";
    if (!other.path.empty() && other.path != k.path && other.path.rfind(prefix, 0) == 0 &&
        other.path.find('.', prefix.size()) == std::string::npos) {
      child = other.path.substr(prefix.size());
      break;
    }
  }
  ASSERT_FALSE(child.empty()) << k.path << " has no children";
  const std::string typo = child + child.back();
  const std::string typo_path = k.path.empty() ? typo : k.path + "." + typo;
  const json doc = k.path.empty() ? json{{typo, 1}} : at_path(k.path, json{{typo, 1}});
  // tier's own section and DeepSpeed's zero_optimization (whose models forbid extra keys) refuse
  // unknown keys; elsewhere they are noted.
  const bool in_tier = k.path.rfind("tier", 0) == 0 || k.path.rfind("zero_optimization", 0) == 0;

  auto lenient = parse(doc);
  if (in_tier) {
    ASSERT_FALSE(lenient.ok()) << "unknown key inside " << k.path << " must be an error";
    EXPECT_NE(lenient.status().message().find("'" + typo_path + "'"), std::string::npos);
  } else {
    ASSERT_TRUE(lenient.ok()) << lenient.status();
    bool reported = false;
    for (const auto& n : lenient->notes) {
      reported = reported ||
                 (n.find("'" + typo_path + "'") != std::string::npos && n.find("did you mean") != std::string::npos);
    }
    EXPECT_TRUE(reported) << typo_path << " was not reported";
  }
  auto strict = parse(doc, /*strict=*/true);
  ASSERT_FALSE(strict.ok());
  EXPECT_NE(strict.status().message().find("'" + typo_path + "'"), std::string::npos);
  EXPECT_NE(strict.status().message().find("did you mean"), std::string::npos) << strict.status();
}

TEST_P(EverySection, RejectsANonObject) {
  const KeySpec& k = *GetParam();
  if (k.path.empty()) {
    EXPECT_FALSE(EngineConfig::from_json("[1, 2]").ok());
    return;
  }
  auto cfg = parse(at_path(k.path, 5));
  ASSERT_FALSE(cfg.ok());
  EXPECT_NE(cfg.status().message().find("'" + k.path + "'"), std::string::npos) << cfg.status();
}

INSTANTIATE_TEST_SUITE_P(Config, EverySection,
                         testing::ValuesIn(specs_where([](const KeySpec& k) { return k.kind == ValueKind::kObject; })),
                         test_name);

TEST(ConfigSchema, EveryTierKeyHasAnEnvironmentOverride) {
  int checked = 0;
  for (const auto& k : detail::config_schema()) {
    if (k.path.rfind("tier.", 0) != 0 || k.kind == ValueKind::kObject) continue;
    const std::string name = detail::env_name_for(k);
    ASSERT_FALSE(name.empty());
    std::string text = k.sample_valid.is_string() ? k.sample_valid.get<std::string>() : k.sample_valid.dump();
    if (k.kind == ValueKind::kStringList) {
      text.clear();
      for (const auto& e : k.sample_valid) {
        if (!text.empty()) text += ',';
        text += e.get<std::string>();
      }
    }
    setenv(name.c_str(), text.c_str(), 1);
    auto cfg = EngineConfig::from_json(k.sample_context.is_null() ? "{}" : k.sample_context.dump());
    unsetenv(name.c_str());
    ASSERT_TRUE(cfg.ok()) << name << "=" << text << ": " << cfg.status();
    const json expected = k.sample_expected.is_null() ? k.sample_valid : k.sample_expected;
    const json got = lookup(json::parse(cfg->to_json()), k.path);
    if (expected.is_number()) {
      EXPECT_DOUBLE_EQ(got.get<double>(), expected.get<double>()) << name;
    } else {
      EXPECT_EQ(got.dump(), expected.dump()) << name;
    }
    bool noted = false;
    for (const auto& n : cfg->notes) noted = noted || n.find(name) != std::string::npos;
    EXPECT_TRUE(noted) << name << " applied without a note";
    ++checked;
  }
  EXPECT_GT(checked, 10);
}

// DeepSpeed keys that nothing in tier reads: `config --check` must say so, and name what governs
// the same thing in tier, instead of reporting them as applied. Taking one of these out of the
// list means making the engine act on it (with a test of the effect).
TEST(ConfigSchema, KeysNothingReadsAreReportedAsNotActedOn) {
  const std::vector<std::pair<std::string, std::string>> keys = {
      {"zero_optimization.offload_param.buffer_count", "tier.budgets.host"},
      {"zero_optimization.offload_param.buffer_size", "tier.budgets.host"},
      {"zero_optimization.offload_param.max_in_cpu", "tier.budgets.host"},
      {"zero_optimization.offload_param.pin_memory", "tier.budgets.host"},
      {"zero_optimization.offload_optimizer.pin_memory", "tier.budgets.host"},
      {"zero_optimization.cpu_offload_use_pin_memory", "tier.budgets.host"},
      {"zero_optimization.offload_optimizer.pipeline_read", "buffer_count"},
      {"zero_optimization.offload_optimizer.pipeline_write", "buffer_count"},
      {"zero_optimization.offload_optimizer.ratio", "partial"},
      {"tier.pinned_arena_bytes", "tier.budgets.host"},
  };
  for (const auto& [path, instead] : keys) {
    const KeySpec* k = detail::find_key_spec(path);
    ASSERT_NE(k, nullptr) << path;
    EXPECT_EQ(k->treatment, detail::Treatment::kNoted) << path << " is labelled acted on but nothing reads it";
    EXPECT_NE(k->note.find(instead), std::string::npos) << path << ": note should point at " << instead;
    auto cfg = parse(merged(at_path(path, k->sample_valid), k->sample_context));
    ASSERT_TRUE(cfg.ok()) << path << ": " << cfg.status();
    bool said = false;
    for (const auto& n : cfg->notes) said = said || n.rfind(path + ": accepted, not acted on: ", 0) == 0;
    EXPECT_TRUE(said) << path << ": config --check must report it as accepted, not acted on";
  }
  // The one buffer_count tier does act on stays labelled so.
  const KeySpec* oo = detail::find_key_spec("zero_optimization.offload_optimizer.buffer_count");
  ASSERT_NE(oo, nullptr);
  EXPECT_EQ(oo->treatment, detail::Treatment::kActed);
}

}  // namespace
}  // namespace tier
