// tier-bench: measures every link tier moves bytes over. `tier-bench help` lists the commands.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cli.hpp"

namespace {

void print_help() {
  auto& cmds = tier::bench::commands();
  std::sort(cmds.begin(), cmds.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  std::printf("usage: tier-bench <command> [options]\n\ncommands:\n");
  for (const auto& c : cmds) std::printf("  %-10s %s\n", c.name.c_str(), c.summary.c_str());
  std::printf("\n`tier-bench <command> --help` shows a command's options.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "help" || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    print_help();
    return argc < 2 ? 2 : 0;
  }
  const std::string name = argv[1];
  for (auto& c : tier::bench::commands()) {
    if (c.name != name) continue;
    std::vector<std::string> rest(argv + 2, argv + argc);
    if (std::find(rest.begin(), rest.end(), "--help") != rest.end()) {
      std::printf("usage: tier-bench %s [options]\n%s\n\n%s\n", c.name.c_str(), c.summary.c_str(), c.usage.c_str());
      return 0;
    }
    tier::bench::Args args(std::move(rest));
    return c.run(args);
  }
  std::fprintf(stderr, "tier-bench: unknown command '%s'\n\n", name.c_str());
  print_help();
  return 2;
}
