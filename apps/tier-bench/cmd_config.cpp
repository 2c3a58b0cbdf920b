// `tier-bench config`: checks a configuration file (DeepSpeed format plus tier's section) and
// prints how tier reads it, or prints the reference table of every key.
#include <cstdio>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "core/config_schema.hpp"
#include "tier/config.hpp"

namespace tier::bench {
namespace {

using json = nlohmann::json;

json lookup(const json& doc, const std::string& path) {
  const json* node = &doc;
  std::size_t start = 0;
  while (true) {
    const auto dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!node->is_object() || !node->contains(part)) return nullptr;
    node = &(*node)[part];
    if (dot == std::string::npos) return *node;
    start = dot + 1;
  }
}

void print_reference() {
  const json defaults = json::parse(EngineConfig().to_json());
  std::printf("| key | allowed | default | treatment |\n|---|---|---|---|\n");
  for (const auto& k : detail::config_schema()) {
    if (k.path.empty() || k.kind == detail::ValueKind::kObject) continue;
    std::string def;
    if (k.get && k.canonical.empty()) {
      const json d = lookup(defaults, k.path);
      if (!d.is_null()) def = "`" + d.dump() + "`";
    }
    std::string treatment;
    if (!k.canonical.empty()) {
      treatment = "same as `" + k.canonical + "`";
    } else if (k.treatment == detail::Treatment::kNoted) {
      treatment = "accepted, not acted on: " + k.note;
    } else {
      treatment = "acted on";
    }
    if (k.auto_ok && !(k.auto_value.is_string() && k.auto_value == "auto")) {
      treatment += "; `\"auto\"` = `" + k.auto_value.dump() + "`";
    }
    const std::string env = detail::env_name_for(k);
    if (!env.empty()) treatment += "; env `" + env + "`";
    std::printf("| `%s` | %s | %s | %s |\n", k.path.c_str(), k.allowed().c_str(), def.c_str(), treatment.c_str());
  }
}

int run_config(Args& args) {
  const bool reference = args.flag("reference");
  const std::string file = args.get("check", "");
  const bool strict = args.flag("strict");
  if (Status s = args.finish(); !s.ok() || (reference == !file.empty())) {
    std::fprintf(stderr, "tier-bench config: %s\n",
                 s.ok() ? "give exactly one of --check FILE or --reference" : s.message().c_str());
    return 2;
  }
  if (reference) {
    print_reference();
    return 0;
  }
  ConfigOptions options;
  options.strict = strict;
  auto cfg = EngineConfig::from_file(file, options);
  if (!cfg.ok()) {
    std::fprintf(stderr, "tier-bench config: %s\n", cfg.status().to_string().c_str());
    return 1;
  }
  for (const auto& n : cfg->notes) std::fprintf(stderr, "note: %s\n", n.c_str());
  for (const auto& k : cfg->auto_keys) std::fprintf(stderr, "auto: %s\n", k.c_str());
  std::printf("%s\n", cfg->to_json().c_str());
  return 0;
}

const CommandRegistrar kRegister({"config", "check a config file and print how tier reads it; or the key reference",
                                  "  --check FILE   parse FILE (DeepSpeed JSON + tier section), print notes and the\n"
                                  "                 resolved config\n"
                                  "  --strict       unknown keys are errors\n"
                                  "  --reference    print the table of every key (markdown)",
                                  run_config});

}  // namespace
}  // namespace tier::bench
