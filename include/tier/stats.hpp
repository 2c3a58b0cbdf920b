// tier/stats.hpp — counters every tier and link reports into, and the snapshot users read.
//
// A Counters object belongs to one engine (or one benchmark). Tiers report resident bytes as
// copies come and go; each transfer on a link is bracketed by begin()/finish(), which counts
// bytes and operations and accumulates the link's busy time: the wall time during which at least
// one transfer was in flight, so overlapping transfers are not counted twice.
//
// Thread safety: every Counters member may be called from any thread concurrently. A snapshot is
// a plain value.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "tier/status.hpp"
#include "tier/types.hpp"

namespace tier {

struct TierUsage {
  std::uint64_t resident_bytes = 0;
  std::uint64_t peak_bytes = 0;
  std::uint64_t budget_bytes = 0;  // 0: no budget set
  // Host tier only (0 elsewhere): bytes of the host arena mlock'd, registered with the device
  // (cudaHostRegister; bookkeeping on the emulated device) and registered with io_uring as fixed
  // buffers (with every I/O thread). An auto host budget's arena grows these as it fills.
  std::uint64_t pinned_bytes = 0;
  std::uint64_t device_registered_bytes = 0;
  std::uint64_t io_registered_bytes = 0;
};

struct LinkUsage {
  std::uint64_t bytes = 0;
  std::uint64_t ops = 0;
  std::uint64_t errors = 0;
  std::uint64_t in_flight = 0;
  double busy_seconds = 0;  // wall time with at least one transfer in flight
  // bytes / busy_seconds, or 0 before any transfer.
  double bytes_per_second() const noexcept { return busy_seconds > 0 ? static_cast<double>(bytes) / busy_seconds : 0; }
};

struct StatsSnapshot {
  std::array<TierUsage, kNumTiers> tiers{};
  std::array<LinkUsage, kNumLinks> links{};
  std::map<std::string, std::string> info;  // e.g. "io_engine" -> "uring", "device" -> "emulated"
  std::map<std::string, double> metrics;    // module figures, e.g. "prefetch.stall_seconds"
  double uptime_seconds = 0;

  const TierUsage& tier(Tier t) const noexcept { return tiers[static_cast<int>(t)]; }
  const LinkUsage& link(Link l) const noexcept { return links[static_cast<int>(l)]; }
  // Link counters and metrics accumulated since `earlier` (tiers and info are taken from *this).
  StatsSnapshot since(const StatsSnapshot& earlier) const;
  // {"uptime_seconds":..,"tiers":{"device":{..},..},"links":{"nvme_to_host":{..},..},"info":{..},"metrics":{..}}
  std::string to_json(int indent = 2) const;
};

class Counters {
 public:
  Counters();
  ~Counters();
  Counters(const Counters&) = delete;
  Counters& operator=(const Counters&) = delete;

  void set_budget(Tier t, std::uint64_t bytes) noexcept;
  // Adds (or, negative, removes) resident bytes; the peak follows.
  void add_resident(Tier t, std::int64_t delta) noexcept;

  // A transfer in flight on one link. Finish it exactly once; one destroyed unfinished counts as
  // a failed transfer of 0 bytes.
  class Transfer {
   public:
    Transfer() = default;
    Transfer(Transfer&& o) noexcept : owner_(o.owner_), link_(o.link_), begin_(o.begin_) { o.owner_ = nullptr; }
    Transfer& operator=(Transfer&& o) noexcept;
    ~Transfer();
    void finish(std::uint64_t bytes, bool ok = true) noexcept;

   private:
    friend class Counters;
    Transfer(Counters* owner, Link link, std::chrono::steady_clock::time_point begin)
        : owner_(owner), link_(link), begin_(begin) {}
    Counters* owner_ = nullptr;
    Link link_ = Link::kNvmeToHost;
    std::chrono::steady_clock::time_point begin_{};
  };
  Transfer begin(Link link) noexcept;
  // Counts a transfer made and timed elsewhere (e.g. by a framework's own copy): `bytes` and one
  // operation, and `seconds` of busy time (added as is: overlap with other transfers on the link
  // is not known here). On the timeline it ends now and began `seconds` ago.
  void record(Link link, std::uint64_t bytes, double seconds) noexcept;

  void set_info(const std::string& key, const std::string& value);
  void add_metric(const std::string& key, double delta);
  void set_metric(const std::string& key, double value);

  StatsSnapshot snapshot() const;

  // ---- The timeline: Chrome trace-event JSON, as Perfetto (ui.perfetto.dev) and chrome://tracing
  // open it. Once started, every transfer on every link is recorded from begin() to finish() on
  // that link's lane, with its bytes; spans given with trace_span() go on their own lanes (the
  // adapter's "compute", the engine's "stalls", the optimizer's "optimizer"). At most
  // `max_events` are kept; later ones are counted as dropped (written in the file's metadata).
  void start_trace(std::size_t max_events = 1'000'000);
  bool tracing() const noexcept { return tracing_.load(std::memory_order_acquire); }
  // A span [begin, end) named `name` on lane `lane`; `bytes` (0: none) goes into its args.
  void trace_span(const std::string& lane, const std::string& name, std::chrono::steady_clock::time_point begin,
                  std::chrono::steady_clock::time_point end, std::uint64_t bytes = 0);
  // What was recorded so far (recording goes on), as {"traceEvents": [...], ...}.
  std::string trace_json() const;
  // trace_json() written to a fresh file of an unpredictable name in `path`'s folder (created
  // O_EXCL|O_NOFOLLOW: nobody else's planted file or symlink is written through), fsync'd and
  // renamed to `path`. Errors: a path holding a NUL byte, the file's I/O error.
  Status write_trace(const std::string& path) const;

 private:
  void end_transfer(Link link, std::uint64_t bytes, bool ok, std::chrono::steady_clock::time_point begin = {}) noexcept;
  struct TraceEvent;
  struct Trace;
  std::atomic<bool> tracing_{false};
  std::unique_ptr<Trace> trace_;

  struct LinkState;
  std::array<std::atomic<std::uint64_t>, kNumTiers> resident_{};
  std::array<std::atomic<std::uint64_t>, kNumTiers> peak_{};
  std::array<std::atomic<std::uint64_t>, kNumTiers> budget_{};
  std::unique_ptr<LinkState[]> links_;
  mutable std::mutex info_mu_;
  std::map<std::string, std::string> info_;
  std::map<std::string, double> metrics_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace tier
