// `tier-bench summary`: one short measurement of every link this machine has, as a table.
// `--plot FILE` hands the rows (as `--json` prints them) to tier-bench-plot, a Python script
// beside this binary that draws them with matplotlib: tier-bench itself never links Python, and
// a machine without matplotlib still gets the table.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "tier/log.hpp"

extern char** environ;

namespace tier::bench {
namespace {

// The plot helper: $TIER_BENCH_PLOT, else tier-bench-plot in this executable's folder.
std::string plot_helper() {
  if (const char* e = std::getenv("TIER_BENCH_PLOT"); e != nullptr && *e != '\0') return e;
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("tier-bench-plot") : (self.parent_path() / "tier-bench-plot").string();
}

// Writes `rows` to a temporary file and runs `python3 tier-bench-plot ROWS OUT` ($TIER_BENCH_PYTHON
// instead of python3 when set). Returns the helper's exit status (127: it could not be started).
int plot(const nlohmann::ordered_json& rows, const std::string& out) {
  const std::string helper = plot_helper();
  if (!std::filesystem::exists(helper)) {
    std::fprintf(stderr, "tier-bench summary --plot: %s not found (set TIER_BENCH_PLOT to the script)\n",
                 helper.c_str());
    return 127;
  }
  std::string tmp = (std::filesystem::temp_directory_path() / "tier-bench-summary-XXXXXX").string();
  const int fd = mkstemp(tmp.data());
  if (fd < 0) {
    std::fprintf(stderr, "tier-bench summary --plot: cannot create %s\n", tmp.c_str());
    return 1;
  }
  {
    // Through the descriptor mkstemp made, not by name again.
    const std::string text = rows.dump(1) + "\n";
    for (std::size_t done = 0; done < text.size();) {
      const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        std::fprintf(stderr, "tier-bench summary --plot: cannot write %s\n", tmp.c_str());
        close(fd);
        unlink(tmp.c_str());
        return 1;
      }
      done += static_cast<std::size_t>(n);
    }
  }
  close(fd);
  const char* py = std::getenv("TIER_BENCH_PYTHON");
  std::string python = py != nullptr && *py != '\0' ? py : "python3";
  std::vector<std::string> argv_s = {python, helper, tmp, out};
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  int rc = 127;
  if (posix_spawnp(&pid, python.c_str(), nullptr, nullptr, argv.data(), environ) != 0) {
    std::fprintf(stderr, "tier-bench summary --plot: cannot run %s (set TIER_BENCH_PYTHON)\n", python.c_str());
  } else {
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
  }
  std::filesystem::remove(tmp);
  return rc;
}

int run_summary(Args& args) {
  const bool json_out = args.flag("json");
  const bool quick = args.flag("quick");
  const std::string plot_file = args.get("plot", "");
  const std::string from = args.get("from", "");
  if (Status s = args.finish(); !s.ok()) {
    std::fprintf(stderr, "tier-bench summary: %s\n", s.message().c_str());
    return 2;
  }
  if (!from.empty()) {
    // A saved `--json` output, drawn (or printed) again without measuring.
    std::ifstream f(from);
    auto rows = nlohmann::ordered_json::parse(f, nullptr, false);
    if (!f || rows.is_discarded() || !rows.is_array()) {
      std::fprintf(stderr, "tier-bench summary --from %s: not the JSON array `tier-bench summary --json` prints\n",
                   from.c_str());
      return 2;
    }
    if (json_out) std::printf("%s\n", rows.dump(2).c_str());
    if (plot_file.empty()) {
      if (!json_out) {
        Table table({"link / kernel", "measured", "reference (same run)", "ratio", "note"});
        for (const auto& r : rows) {
          const double ratio = r.value("ratio", 0.0);
          table.add({r.value("what", r.value("probe", "")), r.value("figure", r.contains("error") ? "failed" : ""),
                     r.value("reference", ""), ratio > 0 ? fmt(ratio, 2) : "", r.value("note", r.value("error", ""))});
        }
        table.print();
      }
      return 0;
    }
    return plot(rows, plot_file) == 0 ? 0 : 1;
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
  std::fflush(stdout);
  if (!plot_file.empty() && plot(out, plot_file) != 0) return 1;
  return failures ? 1 : 0;
}

const CommandRegistrar kRegister(
    {"summary", "measure every link this machine has, briefly, and print a table",
     "  --quick       smallest sizes that still mean something\n"
     "  --json        print the rows as JSON\n"
     "  --plot FILE   also draw each link's rate beside its reference into FILE (.png, .svg, .pdf) with\n"
     "                tier-bench-plot, the Python script beside tier-bench (needs matplotlib:\n"
     "                pip install matplotlib; TIER_BENCH_PYTHON names the interpreter, default python3)\n"
     "  --from FILE   a saved --json output instead of measuring (to print or --plot it again)",
     run_summary});

}  // namespace
}  // namespace tier::bench
