// `tier-bench config`: checks a configuration file (DeepSpeed format plus tier's section) and
// prints how tier reads it, or prints the reference table of every key.
#include <cstdio>

#include "cli.hpp"
#include "tier/config.hpp"

namespace tier::bench {
namespace {

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
    std::fputs(config_reference_markdown().c_str(), stdout);
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
