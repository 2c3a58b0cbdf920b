#include "cli.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <random>

#include "tier/ext/file_system.hpp"
#include "tier/ext/swap_space.hpp"
#include "tier/units.hpp"

namespace tier::bench {
namespace {

// tier-bench uses only the installed headers, so its few string helpers are its own.
std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

std::string trim(std::string_view s) {
  std::size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

// The option closest to `word` when it is a likely typo (a few edits for its length), else empty.
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates) {
  auto distance = [](std::string_view a, std::string_view b) {
    std::vector<std::size_t> row(b.size() + 1);
    for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (std::size_t i = 1; i <= a.size(); ++i) {
      std::size_t diag = row[0];
      row[0] = i;
      for (std::size_t j = 1; j <= b.size(); ++j) {
        const std::size_t up = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1,
                           diag + (std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                                           std::tolower(static_cast<unsigned char>(b[j - 1]))
                                       ? 0
                                       : 1)});
        diag = up;
      }
    }
    return row[b.size()];
  };
  // Bounded work, as the config reader's: no option is 256 characters long, and a candidate whose
  // length alone differs by more than the limit cannot be within it.
  if (word.size() > 256) return {};
  const std::size_t limit = std::max<std::size_t>(2, word.size() / 4);
  std::string best;
  std::size_t best_d = static_cast<std::size_t>(-1);
  for (const auto& c : candidates) {
    if ((c.size() > word.size() ? c.size() - word.size() : word.size() - c.size()) > limit) continue;
    const std::size_t d = distance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best_d <= limit ? best : std::string();
}

}  // namespace

Args::Args(std::vector<std::string> argv) {
  for (std::size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a.rfind("--", 0) == 0 && a.size() > 2) {
      const auto eq = a.find('=');
      if (eq != std::string::npos) {
        opts_[a.substr(2, eq - 2)] = a.substr(eq + 1);
      } else if (i + 1 < argv.size() && argv[i + 1].rfind("--", 0) != 0) {
        opts_[a.substr(2)] = argv[++i];
      } else {
        opts_[a.substr(2)] = std::nullopt;
      }
    } else {
      positional_.push_back(a);
    }
  }
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

std::vector<std::string> in_memory_paths(const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  for (const auto& p : paths) {
    auto r = nvme::path_is_in_memory(p);
    if (r.ok() && *r) out.push_back(p);
  }
  return out;
}

void warn_in_memory_paths(const std::vector<std::string>& paths) {
  for (const auto& p : in_memory_paths(paths)) {
    std::printf("warning: %s is tmpfs: 'NVMe' tier data is held in RAM; figures are not NVMe figures\n", p.c_str());
  }
}

bool Args::has(const std::string& name) const {
  return opts_.count(name) != 0;
}

bool Args::flag(const std::string& name) {
  known_.push_back(name);
  auto it = opts_.find(name);
  if (it == opts_.end()) return false;
  used_[name] = true;
  if (!it->second) return true;
  const std::string v = lower(*it->second);
  // `--json false` and friends; anything else means the flag swallowed a positional argument.
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  if (v != "1" && v != "true" && v != "yes" && v != "on") positional_.push_back(*it->second);
  return true;
}

std::string Args::get(const std::string& name, const std::string& fallback) {
  known_.push_back(name);
  auto it = opts_.find(name);
  if (it == opts_.end() || !it->second) return fallback;
  used_[name] = true;
  return *it->second;
}

Result<std::uint64_t> Args::size(const std::string& name, std::uint64_t fallback) {
  if (!has(name)) {
    known_.push_back(name);
    return fallback;
  }
  const std::string v = get(name, "");
  auto r = parse_size(v);
  if (!r.ok()) return r.status().with_context("--" + name);
  return r;
}

Result<std::uint64_t> Args::count(const std::string& name, std::uint64_t fallback) {
  if (!has(name)) {
    known_.push_back(name);
    return fallback;
  }
  std::string v = lower(trim(get(name, "")));
  double mult = 1;
  if (!v.empty()) {
    switch (v.back()) {
      case 'k': mult = 1e3; break;
      case 'm': mult = 1e6; break;
      case 'g':
      case 'b': mult = 1e9; break;
      default: break;
    }
    if (mult != 1) v.pop_back();
  }
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !(d > 0) || d * mult > 1e15 || d * mult != std::floor(d * mult)) {
    return invalid_argument(
        str("--", name, " '", get(name, ""), "' is not a count; write e.g. 1000000, 100M or 1G (powers of 1000)"));
  }
  return static_cast<std::uint64_t>(d * mult);
}

Result<long long> Args::integer(const std::string& name, long long fallback) {
  if (!has(name)) {
    known_.push_back(name);
    return fallback;
  }
  const std::string v = get(name, "");
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0') return invalid_argument(str("--", name, " '", v, "' is not an integer"));
  return x;
}

Result<double> Args::number(const std::string& name, double fallback) {
  if (!has(name)) {
    known_.push_back(name);
    return fallback;
  }
  const std::string v = get(name, "");
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !std::isfinite(x)) {
    return invalid_argument(str("--", name, " '", v, "' is not a number"));
  }
  return x;
}

Result<std::string> Args::choice(const std::string& name, const std::vector<std::string>& choices,
                                 const std::string& fallback) {
  const std::string v = get(name, fallback);
  if (std::find(choices.begin(), choices.end(), v) != choices.end()) return v;
  std::string list;
  for (const auto& c : choices) list += (list.empty() ? "" : "|") + c;
  return invalid_argument(str("--", name, " '", v, "' is not one of ", list));
}

Status Args::finish() const {
  for (const auto& [name, value] : opts_) {
    if (used_.count(name)) continue;
    const std::string guess = closest_match(name, known_);
    const bool known = std::find(known_.begin(), known_.end(), name) != known_.end();
    if (known) return invalid_argument(str("--", name, " needs a value"));
    return invalid_argument(str("unknown option --", name, guess.empty() ? "" : str("; did you mean --", guess, "?")));
  }
  if (!positional_.empty()) return invalid_argument(str("unexpected argument '", positional_.front(), "'"));
  return Status::Ok();
}

std::vector<Command>& commands() {
  static std::vector<Command> c;
  return c;
}

std::vector<SummaryProbe>& summary_probes() {
  static std::vector<SummaryProbe> p;
  return p;
}

Progress::Progress(std::string label, std::uint64_t total, bool bytes, bool enabled)
    : label_(std::move(label)), total_(total), bytes_(bytes), enabled_(enabled), tty_(isatty(STDERR_FILENO) != 0) {
  start_ = last_ = std::chrono::steady_clock::now();
}

Progress::~Progress() {
  finish();
}

void Progress::update(std::uint64_t done) {
  done_ = done;
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  const auto every = tty_ ? std::chrono::milliseconds(200) : std::chrono::milliseconds(3000);
  if (now - last_ < every) return;
  last_ = now;
  draw(false);
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  if (enabled_) draw(true);
}

void Progress::draw(bool final) {
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double frac = total_ ? static_cast<double>(done_) / static_cast<double>(total_) : 1.0;
  const double rate = secs > 0 ? static_cast<double>(done_) / secs : 0;
  std::string line = str(label_, ": ", static_cast<int>(frac * 100 + 0.5), "% ");
  if (bytes_) {
    line += str(format_bytes(done_), " / ", format_bytes(total_), "  ", format_rate(rate));
  } else {
    line += str(done_, " / ", total_, "  ", fmt(rate, 1), "/s");
  }
  if (!final && rate > 0 && total_ > done_) {
    line += str("  eta ", format_seconds(static_cast<double>(total_ - done_) / rate));
  } else if (final) {
    line += str("  in ", format_seconds(secs));
  }
  if (tty_) {
    std::fprintf(stderr, "\r\033[K%s%s", line.c_str(), final ? "\n" : "");
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
}

Table::Table(std::vector<std::string> header) {
  rows_.push_back(std::move(header));
}

void Table::add(std::vector<std::string> row) {
  rows_.push_back(std::move(row));
}

void Table::print() const {
  std::vector<std::size_t> width;
  for (const auto& r : rows_) {
    if (width.size() < r.size()) width.resize(r.size(), 0);
    for (std::size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  for (std::size_t n = 0; n < rows_.size(); ++n) {
    std::string line;
    for (std::size_t i = 0; i < rows_[n].size(); ++i) {
      line += rows_[n][i];
      if (i + 1 < rows_[n].size()) line += std::string(width[i] - rows_[n][i].size() + 2, ' ');
    }
    std::printf("%s\n", line.c_str());
    if (n == 0) {
      std::size_t total = 0;
      for (std::size_t i = 0; i < width.size(); ++i) total += width[i] + (i + 1 < width.size() ? 2 : 0);
      std::printf("%s\n", std::string(total, '-').c_str());
    }
  }
  std::fflush(stdout);
}

std::string fmt(double v, int precision) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", precision, v);
  return buf;
}

std::string random_hex() {
  std::random_device rd;  // the kernel's random source on Linux
  char buf[17];
  std::snprintf(buf, sizeof buf, "%08x%08x", static_cast<unsigned>(rd()), static_cast<unsigned>(rd()));
  return buf;
}

Status write_file_atomically(const std::string& path, const std::string& text) {
  // The library's writer: through the file layer, and a failed directory fsync is an error.
  return tier::write_file_atomically(path, text, 0666, "config");
}

}  // namespace tier::bench
