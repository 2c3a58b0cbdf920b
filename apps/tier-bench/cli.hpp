// Command-line plumbing shared by tier-bench's subcommands: options, the subcommand registry,
// a progress line, result tables and the summary probes.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tier/status.hpp"

namespace tier::bench {

// `--name value`, `--name=value` and bare `--flag`. Every option a command reads is marked used;
// finish() reports the rest as errors, with a suggestion for likely typos.
class Args {
 public:
  Args(std::vector<std::string> argv);  // argv without the program and subcommand names

  bool flag(const std::string& name);
  std::string get(const std::string& name, const std::string& fallback);
  Result<std::uint64_t> size(const std::string& name, std::uint64_t fallback);   // "4G", "1M", 4096
  Result<std::uint64_t> count(const std::string& name, std::uint64_t fallback);  // "100M" params = 100e6
  Result<long long> integer(const std::string& name, long long fallback);
  Result<double> number(const std::string& name, double fallback);
  // One of `choices`; an error names the option, the value and the choices.
  Result<std::string> choice(const std::string& name, const std::vector<std::string>& choices,
                             const std::string& fallback);
  bool has(const std::string& name) const;
  // Errors for options nobody read and for positional arguments.
  Status finish() const;

 private:
  std::map<std::string, std::optional<std::string>> opts_;
  std::vector<std::string> positional_;
  std::map<std::string, bool> used_;
  std::vector<std::string> known_;
};

// Reads an option's parsed value into `into`, or, when parsing failed, keeps the first error in
// `first_error`, so a command can read every option and report one problem.
template <typename T, typename U>
void take_option(Status& first_error, Result<T> r, U& into) {
  if (!r.ok()) {
    if (first_error.ok()) first_error = r.status();
    return;
  }
  into = static_cast<U>(*r);
}

// Writes `text` as the file `path`: into a fresh temporary file of an unpredictable name in its
// folder (O_CREAT|O_EXCL|O_NOFOLLOW), fsync'd and renamed over `path`, so that a file or symlink
// another user planted there is never written through and `path` is old or new, never half.
// (tier::write_file_atomically of tier/ext/file_system.hpp: the library's writer, through its file layer.)
Status write_file_atomically(const std::string& path, const std::string& text);

// 64 unpredictable bits as 16 hex digits, for names another user must not guess.
std::string random_hex();

// "a,b,,c" -> {"a", "b", "c"}: a comma-separated option value (e.g. several --path directories).
std::vector<std::string> split_list(const std::string& s);

// The "NVMe" paths that are on tmpfs or ramfs (their data is in RAM: the figures are not NVMe
// figures); a path that cannot be checked is not listed.
std::vector<std::string> in_memory_paths(const std::vector<std::string>& paths);
// Prints, after a command's summary, one warning line per such path.
void warn_in_memory_paths(const std::vector<std::string>& paths);

struct Command {
  std::string name;
  std::string summary;  // one line
  std::string usage;    // options, one per line
  std::function<int(Args&)> run;
};

std::vector<Command>& commands();
struct CommandRegistrar {
  explicit CommandRegistrar(Command c) { commands().push_back(std::move(c)); }
};

// A row of `tier-bench summary`: one link or kernel, its figure and, where there is one, the
// reference it is compared with in the same run.
struct SummaryRow {
  std::string what;       // "host memory (in-place r/w)"
  std::string figure;     // "12.3 GB/s"
  std::string reference;  // "memcpy 10.1 GB/s" or ""
  double ratio = 0;       // figure / reference, 0 when there is none
  std::string note;
};
struct SummaryProbe {
  int order;
  std::string name;
  // Runs a short measurement; `quick` asks for the smallest sizes that still mean something.
  std::function<Result<std::vector<SummaryRow>>(bool quick)> run;
};
std::vector<SummaryProbe>& summary_probes();
struct SummaryRegistrar {
  explicit SummaryRegistrar(SummaryProbe p) { summary_probes().push_back(std::move(p)); }
};

// A single progress line on stderr: redrawn in place on a terminal, a line every few seconds
// otherwise. Silent when `enabled` is false (e.g. --quiet).
class Progress {
 public:
  Progress(std::string label, std::uint64_t total, bool bytes = true, bool enabled = true);
  ~Progress();
  void update(std::uint64_t done);
  void finish();

 private:
  void draw(bool final);
  std::string label_;
  std::uint64_t total_;
  std::uint64_t done_ = 0;
  bool bytes_;
  bool enabled_;
  bool tty_;
  bool finished_ = false;
  std::chrono::steady_clock::time_point start_, last_;
};

// Fixed-width text table on stdout.
class Table {
 public:
  explicit Table(std::vector<std::string> header);
  void add(std::vector<std::string> row);
  void print() const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

std::string fmt(double v, int precision = 2);

}  // namespace tier::bench
