// `tier-bench tune`: finds the I/O engine, request size, queue depth and I/O threads that move
// tier's NVMe traffic fastest on the disks given, within a time budget, and prints the `aio` and
// `tier` config sections that select them.
//
// The objective is an optimizer step's traffic: as many bytes read as written, so each candidate
// is scored by the harmonic mean of its read and write rates (the rate of moving B bytes in and B
// out one after the other). The search is coordinate-wise, not a grid: the engine first (at 1 MiB
// x 32), then the request size walked outward from 1 MiB while it gains, then the queue depth
// from 32, then more I/O threads; a step that gains less than --min-gain ends that walk. A
// default configuration (DeepSpeed's aio defaults: 1 MiB x 8, one thread) and plain
// pread/pwrite outside tier's engine are measured in the same run as references.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "io_bench.hpp"
#include "read_reference.hpp"
#include "tier/units.hpp"

namespace tier::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Candidate {
  IoEngineKind engine = IoEngineKind::kUring;
  std::uint64_t block = 1 << 20;
  unsigned depth = 32;
  unsigned threads = 1;
  bool operator<(const Candidate& o) const {
    return std::tie(engine, block, depth, threads) < std::tie(o.engine, o.block, o.depth, o.threads);
  }
};

struct Trial {
  Candidate c;
  std::string engine_name;
  double read = 0, write = 0, score = 0, seconds = 0;
  std::string phase;
};

const char* engine_key(IoEngineKind k) {
  switch (k) {
    case IoEngineKind::kUring: return "uring";
    case IoEngineKind::kAio: return "aio";
    case IoEngineKind::kPosix: return "posix";
    default: return "auto";
  }
}

double harmonic(double a, double b) {
  return a > 0 && b > 0 ? 2.0 / (1.0 / a + 1.0 / b) : 0.0;
}

class Tuner {
 public:
  Tuner(std::vector<std::string> paths, std::uint64_t size, double budget, double min_gain, bool verbose)
      : paths_(std::move(paths)),
        size_(size),
        budget_(budget),
        min_gain_(min_gain),
        verbose_(verbose),
        start_(Clock::now()) {}

  double elapsed() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  // Room for one more trial of about the last one's length.
  bool time_left() const { return elapsed() + last_seconds_ <= budget_; }

  // Measures `c` (once; later calls return the first result). Null when the engine is
  // unavailable here or the budget is spent.
  const Trial* measure(const Candidate& c, const std::string& phase) {
    if (auto it = done_.find(c); it != done_.end()) return it->second.score > 0 ? &it->second : nullptr;
    if (!time_left()) return nullptr;
    const auto t0 = Clock::now();
    Trial t;
    t.c = c;
    t.phase = phase;
    for (bool write : {false, true}) {
      IoBenchSpec spec;
      spec.paths = paths_;
      spec.size = size_;
      spec.block_size = c.block;
      spec.queue_depth = c.depth;
      spec.parallelism = c.threads;
      spec.engine = c.engine;
      spec.write = write;
      spec.progress = false;
      auto r = run_io_bench(spec);
      if (!r.ok()) {
        if (verbose_) std::fprintf(stderr, "  %s: skipped (%s)\n", describe(c).c_str(), r.status().message().c_str());
        t.score = 0;
        done_[c] = t;
        return nullptr;
      }
      (write ? t.write : t.read) = r->bytes_per_second;
      t.engine_name = r->engine;
    }
    t.score = harmonic(t.read, t.write);
    t.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    last_seconds_ = t.seconds;
    trials_.push_back(t);
    done_[c] = t;
    if (verbose_) {
      std::fprintf(stderr, "  [%5.1fs] %-8s %-26s read %-11s write %-11s score %s\n", elapsed(), phase.c_str(),
                   describe(c).c_str(), format_rate(t.read).c_str(), format_rate(t.write).c_str(),
                   format_rate(t.score).c_str());
    }
    return &done_[c];
  }

  // Walks one coordinate from `best` through `values` (sorted), outward in both directions from
  // best's own value, while each step gains at least min_gain.
  Candidate walk(Candidate best, const std::vector<std::uint64_t>& values,
                 const std::function<void(Candidate&, std::uint64_t)>& set,
                 const std::function<std::uint64_t(const Candidate&)>& get, const std::string& phase) {
    const Trial* at = measure(best, phase);
    if (at == nullptr) return best;
    double best_score = at->score;
    const auto here = std::find(values.begin(), values.end(), get(best));
    if (here == values.end()) return best;
    for (int dir : {+1, -1}) {
      Candidate cur = best;
      for (auto it = here;;) {
        if (dir > 0 ? std::next(it) == values.end() : it == values.begin()) break;
        it = dir > 0 ? std::next(it) : std::prev(it);
        Candidate next = cur;
        set(next, *it);
        const Trial* t = measure(next, phase);
        if (t == nullptr || t->score < best_score * (1.0 + min_gain_)) break;
        best = cur = next;
        best_score = t->score;
      }
    }
    return best;
  }

  const std::vector<Trial>& trials() const { return trials_; }
  const Trial* result(const Candidate& c) const {
    auto it = done_.find(c);
    return it != done_.end() && it->second.score > 0 ? &it->second : nullptr;
  }
  static std::string describe(const Candidate& c) {
    return str(engine_key(c.engine), " ", format_bytes(c.block), " x ", c.depth,
               c.threads > 1 ? str(" x", c.threads, " threads") : "");
  }

 private:
  std::vector<std::string> paths_;
  std::uint64_t size_;
  double budget_, min_gain_;
  bool verbose_;
  Clock::time_point start_;
  double last_seconds_ = 0;
  std::vector<Trial> trials_;
  std::map<Candidate, Trial> done_;
};

// pread/pwrite outside tier's engine: a file of `bytes` in a private folder under each path, read
// while as much is written (read_reference's mixed pass), then removed.
Result<ReadReference> plain_reference(const std::vector<std::string>& paths, std::uint64_t bytes) {
  TIER_ASSIGN_OR_RETURN(ReferenceFolders folders, ReferenceFolders::create(paths, bytes, "tune"));
  return measure_mixed_read_write(folders.dirs(), bytes);
}

int run_tune(Args& args) {
  Status s;
  auto take = [&](auto r, auto& into) { take_option(s, std::move(r), into); };
  const std::vector<std::string> paths = split_list(args.get("path", ""));
  std::uint64_t size = 256ull << 20;
  double budget = 45, min_gain = 0.03;
  take(args.size("size", size), size);
  take(args.number("budget-seconds", budget), budget);
  take(args.number("min-gain", min_gain), min_gain);
  const bool json_out = args.flag("json");
  const bool no_reference = args.flag("no-reference");
  if (Status f = args.finish(); s.ok() && !f.ok()) s = f;
  if (s.ok() && paths.empty())
    s = invalid_argument("--path: give the directory (or directories) on the SSD(s) to tune");
  if (s.ok() && (budget < 1 || budget > 3600)) s = invalid_argument("--budget-seconds: 1 to 3600");
  if (s.ok() && (min_gain < 0 || min_gain > 1)) s = invalid_argument("--min-gain: 0 to 1 (a fraction)");
  if (s.ok() && size < (8u << 20)) s = invalid_argument("--size: at least 8M per trial");
  if (!s.ok()) {
    std::fprintf(stderr, "tier-bench tune: %s\n", s.message().c_str());
    return 2;
  }
  for (const auto& p : paths) {
    std::error_code ec;
    if (!std::filesystem::is_directory(p, ec)) {
      std::fprintf(stderr, "tier-bench tune: --path %s is not a directory\n", p.c_str());
      return 2;
    }
  }

  const bool verbose = !json_out;
  if (verbose) {
    std::fprintf(stderr, "tier-bench tune: %s per trial (read + write) in %s, budget %.0f s\n",
                 format_bytes(size).c_str(), paths[0].c_str(), budget);
  }
  Tuner tuner(paths, size, budget, min_gain, verbose);

  // The reference configuration first: DeepSpeed's aio defaults.
  const Candidate reference_config{IoEngineKind::kAuto, 1 << 20, 8, 1};
  const Trial* ref_trial = tuner.measure(reference_config, "default");

  // 1. The engine, at 1 MiB x 32.
  Candidate best{IoEngineKind::kUring, 1 << 20, 32, 1};
  double best_score = 0;
  for (IoEngineKind k : {IoEngineKind::kUring, IoEngineKind::kAio, IoEngineKind::kPosix}) {
    Candidate c = best;
    c.engine = k;
    const Trial* t = tuner.measure(c, "engine");
    if (t != nullptr && t->score > best_score) {
      best_score = t->score;
      best.engine = k;
    }
  }
  if (best_score == 0) {
    std::fprintf(stderr, "tier-bench tune: no I/O engine worked in %s\n", paths[0].c_str());
    return 1;
  }
  // 2. Request size, 3. queue depth, 4. I/O threads.
  best = tuner.walk(
      best, {256u << 10, 512u << 10, 1u << 20, 2u << 20, 4u << 20, 8u << 20},
      [](Candidate& c, std::uint64_t v) { c.block = v; }, [](const Candidate& c) { return c.block; }, "block");
  best = tuner.walk(
      best, {4, 8, 16, 32, 64, 128}, [](Candidate& c, std::uint64_t v) { c.depth = static_cast<unsigned>(v); },
      [](const Candidate& c) { return std::uint64_t{c.depth}; }, "depth");
  best = tuner.walk(
      best, {1, 2, 4}, [](Candidate& c, std::uint64_t v) { c.threads = static_cast<unsigned>(v); },
      [](const Candidate& c) { return std::uint64_t{c.threads}; }, "threads");
  // The walks stop at a gain below min_gain; a step they declined may still have scored a little
  // higher than where they stopped, so the answer is the best trial of all.
  for (const Trial& t : tuner.trials()) {
    const Trial* b = tuner.result(best);
    if (b == nullptr || t.score > b->score) best = t.c;
  }
  const Trial* won = tuner.result(best);
  if (won == nullptr) {
    std::fprintf(stderr, "tier-bench tune: internal error: the best candidate has no result\n");
    return 1;
  }

  Result<ReadReference> plain{Status(StatusCode::kUnsupported, "skipped (--no-reference)")};
  if (!no_reference) plain = plain_reference(paths, size);

  nlohmann::ordered_json cfg;
  cfg["aio"] = {{"block_size", best.block},
                {"queue_depth", best.depth},
                {"intra_op_parallelism", best.threads},
                {"single_submit", false},
                {"overlap_events", true}};
  cfg["tier"] = {{"io_engine", engine_key(best.engine)}};

  const double vs_default = ref_trial ? won->score / ref_trial->score : 0;
  const double vs_plain = plain.ok() && plain->bytes_per_second > 0 ? won->score / plain->bytes_per_second : 0;
  if (json_out) {
    nlohmann::ordered_json j;
    j["paths"] = paths;
    j["bytes_per_trial"] = size;
    j["seconds"] = tuner.elapsed();
    j["trials"] = nlohmann::json::array();
    for (const Trial& t : tuner.trials()) {
      j["trials"].push_back({{"phase", t.phase},
                             {"engine", t.engine_name},
                             {"block_size", t.c.block},
                             {"queue_depth", t.c.depth},
                             {"threads", t.c.threads},
                             {"read_bytes_per_second", t.read},
                             {"write_bytes_per_second", t.write},
                             {"score_bytes_per_second", t.score}});
    }
    j["best"] = {{"engine", won->engine_name},
                 {"block_size", best.block},
                 {"queue_depth", best.depth},
                 {"threads", best.threads},
                 {"score_bytes_per_second", won->score}};
    j["default_score_bytes_per_second"] = ref_trial ? ref_trial->score : 0.0;
    j["ratio_to_default"] = vs_default;
    j["plain_mixed_bytes_per_second"] = plain.ok() ? plain->bytes_per_second : 0.0;
    j["plain_reference"] = plain.ok() ? plain->describe() : plain.status().message();
    j["ratio_to_plain"] = vs_plain;
    j["config"] = cfg;
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("\nbest: %s: read %s, write %s, read+write %s (%zu trials in %.1f s)\n", Tuner::describe(best).c_str(),
                format_rate(won->read).c_str(), format_rate(won->write).c_str(), format_rate(won->score).c_str(),
                tuner.trials().size(), tuner.elapsed());
    if (ref_trial) {
      std::printf("  %.2fx the default (1 MiB x 8, one thread: %s)\n", vs_default,
                  format_rate(ref_trial->score).c_str());
    }
    if (plain.ok()) {
      std::printf("  %.2fx plain pread/pwrite outside tier (%s: %s)\n", vs_plain, plain->describe().c_str(),
                  format_rate(plain->bytes_per_second).c_str());
    } else if (!no_reference) {
      std::printf("  plain pread/pwrite reference not measured: %s\n", plain.status().message().c_str());
    }
    std::printf("\nconfig sections (merge into your DeepSpeed/tier JSON):\n%s\n", cfg.dump(2).c_str());
  }
  warn_in_memory_paths(paths);
  return 0;
}

const CommandRegistrar kRegister(
    {"tune", "finds the I/O engine, request size, queue depth and threads that reach the disk's rate, within a budget",
     "  --path DIR[,DIR...]   directories on the SSD(s) the swap files will use (required)\n"
     "  --budget-seconds N    stop searching after about N seconds (default 45)\n"
     "  --size N              bytes read and written per trial (default 256M; K/M/G suffixes)\n"
     "  --min-gain F          a step must gain this fraction to continue a walk (default 0.03)\n"
     "  --no-reference        skip the plain pread/pwrite reference\n"
     "  --json                print one JSON object (trials, best, references, config)",
     run_tune});

}  // namespace
}  // namespace tier::bench
