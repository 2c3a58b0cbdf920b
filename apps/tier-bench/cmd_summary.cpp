// `tier-bench summary`: one short measurement of every link this machine has, as a table.
#include <algorithm>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "tier/log.hpp"

namespace tier::bench {
namespace {

int run_summary(Args& args) {
  const bool json_out = args.flag("json");
  const bool quick = args.flag("quick");
  if (Status s = args.finish(); !s.ok()) {
    std::fprintf(stderr, "tier-bench summary: %s\n", s.message().c_str());
    return 2;
  }
  auto probes = summary_probes();
  std::sort(probes.begin(), probes.end(), [](const auto& a, const auto& b) { return a.order < b.order; });
  Table table({"link / kernel", "measured", "reference (same run)", "ratio", "note"});
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  int failures = 0;
  for (std::size_t i = 0; i < probes.size(); ++i) {
    const auto& p = probes[i];
    if (!json_out) std::fprintf(stderr, "[%zu/%zu] %s ...\n", i + 1, probes.size(), p.name.c_str());
    auto rows = p.run(quick);
    if (!rows.ok()) {
      ++failures;
      table.add({p.name, "failed", "", "", rows.status().to_string()});
      out.push_back({{"probe", p.name}, {"error", rows.status().to_string()}});
      continue;
    }
    for (const auto& r : *rows) {
      table.add({r.what, r.figure, r.reference, r.ratio > 0 ? fmt(r.ratio, 2) : "", r.note});
      out.push_back({{"probe", p.name},
                     {"what", r.what},
                     {"figure", r.figure},
                     {"reference", r.reference},
                     {"ratio", r.ratio},
                     {"note", r.note}});
    }
  }
  if (json_out) {
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("\ntier-bench summary\n\n");
    table.print();
  }
  return failures ? 1 : 0;
}

const CommandRegistrar kRegister({"summary", "measure every link this machine has, briefly, and print a table",
                                  "  --quick   smallest sizes that still mean something\n"
                                  "  --json    print the rows as JSON",
                                  run_summary});

}  // namespace
}  // namespace tier::bench
