// config_reference_markdown(): the key table, generated from the schema (tier-bench config
// --reference prints it; a test checks that docs/configuration.md carries the current one).
#include <string>

#include <nlohmann/json.hpp>

#include "core/config_schema.hpp"
#include "tier/config.hpp"

namespace tier {
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

}  // namespace

std::string config_reference_markdown() {
  const json defaults = json::parse(EngineConfig().to_json());
  std::string out = "| key | allowed | default | treatment |\n|---|---|---|---|\n";
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
    out += "| `" + k.path + "` | " + k.allowed() + " | " + def + " | " + treatment + " |\n";
  }
  return out;
}

}  // namespace tier
