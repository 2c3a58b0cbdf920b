#include "tier/stats.hpp"

#include <cerrno>
#include <cstdio>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/atomic_file.hpp"

namespace tier {

using Clock = std::chrono::steady_clock;

struct Counters::LinkState {
  std::mutex mu;
  std::uint64_t bytes = 0;
  std::uint64_t ops = 0;
  std::uint64_t errors = 0;
  std::uint64_t in_flight = 0;
  Clock::time_point busy_since{};
  Clock::duration busy{};
};

// The timeline: fixed lanes for the links, then one per span lane name, in order of first use.
struct Counters::TraceEvent {
  int lane = 0;
  std::string name;
  Clock::time_point begin, end;
  std::uint64_t bytes = 0;
  bool ok = true;
};

struct Counters::Trace {
  mutable std::mutex mu;
  std::size_t max_events = 0;
  std::uint64_t dropped = 0;
  std::vector<TraceEvent> events;
  std::vector<std::string> lanes;  // span lanes; lane id kNumLinks + index

  int lane_of(const std::string& name) {
    for (std::size_t i = 0; i < lanes.size(); ++i) {
      if (lanes[i] == name) return kNumLinks + static_cast<int>(i);
    }
    lanes.push_back(name);
    return kNumLinks + static_cast<int>(lanes.size() - 1);
  }
  void add(TraceEvent e) {
    if (events.size() >= max_events) {
      ++dropped;
      return;
    }
    events.push_back(std::move(e));
  }
};

Counters::Counters() : links_(new LinkState[kNumLinks]), start_(Clock::now()) {}
Counters::~Counters() = default;

void Counters::set_budget(Tier t, std::uint64_t bytes) noexcept {
  budget_[static_cast<int>(t)].store(bytes);
}

void Counters::add_resident(Tier t, std::int64_t delta) noexcept {
  const int i = static_cast<int>(t);
  const std::uint64_t now =
      resident_[i].fetch_add(static_cast<std::uint64_t>(delta)) + static_cast<std::uint64_t>(delta);
  std::uint64_t peak = peak_[i].load();
  while (static_cast<std::int64_t>(now) > 0 && now > peak && !peak_[i].compare_exchange_weak(peak, now)) {
  }
}

Counters::Transfer& Counters::Transfer::operator=(Transfer&& o) noexcept {
  if (this != &o) {
    if (owner_) owner_->end_transfer(link_, 0, false, begin_);
    owner_ = o.owner_;
    link_ = o.link_;
    begin_ = o.begin_;
    o.owner_ = nullptr;
  }
  return *this;
}

Counters::Transfer::~Transfer() {
  if (owner_) owner_->end_transfer(link_, 0, false, begin_);
}

void Counters::Transfer::finish(std::uint64_t bytes, bool ok) noexcept {
  if (!owner_) return;
  owner_->end_transfer(link_, bytes, ok, begin_);
  owner_ = nullptr;
}

Counters::Transfer Counters::begin(Link link) noexcept {
  LinkState& s = links_[static_cast<int>(link)];
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.in_flight++ == 0) s.busy_since = now;
  return Transfer(this, link, now);
}

void Counters::record(Link link, std::uint64_t bytes, double seconds) noexcept {
  const auto busy = seconds > 0 ? std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds))
                                : Clock::duration{};
  {
    LinkState& s = links_[static_cast<int>(link)];
    std::lock_guard<std::mutex> lock(s.mu);
    s.bytes += bytes;
    ++s.ops;
    s.busy += busy;
  }
  if (tracing()) {
    const auto now = Clock::now();
    try {
      std::lock_guard<std::mutex> lock(trace_->mu);
      trace_->add({static_cast<int>(link), link_name(link), now - busy, now, bytes, true});
    } catch (...) {
      // Out of memory for the timeline: the event is lost, the counters above are kept.
    }
  }
}

void Counters::end_transfer(Link link, std::uint64_t bytes, bool ok, Clock::time_point begin) noexcept {
  const auto now = Clock::now();
  {
    LinkState& s = links_[static_cast<int>(link)];
    std::lock_guard<std::mutex> lock(s.mu);
    if (--s.in_flight == 0) s.busy += now - s.busy_since;
    if (ok) {
      s.bytes += bytes;
      ++s.ops;
    } else {
      ++s.errors;
    }
  }
  if (tracing() && begin != Clock::time_point{}) {
    try {
      std::lock_guard<std::mutex> lock(trace_->mu);
      trace_->add({static_cast<int>(link), link_name(link), begin, now, bytes, ok});
    } catch (...) {
      // Out of memory for the timeline: the counters above are what matters; the event is lost.
    }
  }
}

void Counters::start_trace(std::size_t max_events) {
  std::lock_guard<std::mutex> lock(info_mu_);
  if (!trace_) trace_ = std::make_unique<Trace>();
  {
    std::lock_guard<std::mutex> tl(trace_->mu);
    trace_->max_events = max_events;
  }
  tracing_.store(true, std::memory_order_release);  // after trace_ is set: tracing() readers see it
}

void Counters::trace_span(const std::string& lane, const std::string& name, Clock::time_point begin,
                          Clock::time_point end, std::uint64_t bytes) {
  if (!tracing()) return;
  std::lock_guard<std::mutex> lock(trace_->mu);
  trace_->add({trace_->lane_of(lane), name, begin, end, bytes, true});
}

std::string Counters::trace_json() const {
  std::ostringstream out;
  auto us = [&](Clock::time_point t) { return std::chrono::duration<double, std::micro>(t - start_).count(); };
  auto quoted = [](const std::string& s) { return nlohmann::json(s).dump(); };
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  out << R"({"ph":"M","pid":1,"name":"process_name","args":{"name":"tier"}})";
  std::vector<TraceEvent> events;
  std::vector<std::string> lanes;
  std::uint64_t dropped = 0;
  if (trace_) {
    std::lock_guard<std::mutex> lock(trace_->mu);
    events = trace_->events;
    lanes = trace_->lanes;
    dropped = trace_->dropped;
  }
  for (int i = 0; i < kNumLinks; ++i) {
    out << ",\n"
        << R"({"ph":"M","pid":1,"tid":)" << i << R"(,"name":"thread_name","args":{"name":)"
        << quoted(str("link ", link_name(static_cast<Link>(i)))) << "}}";
  }
  for (std::size_t i = 0; i < lanes.size(); ++i) {
    out << ",\n"
        << R"({"ph":"M","pid":1,"tid":)" << kNumLinks + i << R"(,"name":"thread_name","args":{"name":)"
        << quoted(lanes[i]) << "}}";
  }
  char num[64];
  for (const TraceEvent& e : events) {
    const double ts = us(e.begin);
    const double dur = std::max(0.0, us(e.end) - ts);
    out << ",\n{\"ph\":\"X\",\"pid\":1,\"tid\":" << e.lane << ",\"name\":" << quoted(e.name);
    std::snprintf(num, sizeof num, ",\"ts\":%.3f,\"dur\":%.3f", ts, dur);
    out << num << ",\"cat\":\"" << (e.lane < kNumLinks ? "transfer" : "span") << "\",\"args\":{";
    out << "\"bytes\":" << e.bytes;
    if (e.lane < kNumLinks && dur > 0) {
      std::snprintf(num, sizeof num, ",\"gbps\":%.3f", static_cast<double>(e.bytes) / (dur * 1e3));
      out << num;
    }
    if (!e.ok) out << ",\"failed\":true";
    out << "}}";
  }
  out << "\n],\"otherData\":{\"events\":" << events.size() << ",\"dropped_events\":" << dropped << "}}\n";
  return out.str();
}

Status Counters::write_trace(const std::string& path) const {
  // A fresh file under an unpredictable name, renamed over `path`: a "<path>.tmp" that someone
  // else planted (a symlink to their victim) is never opened.
  TIER_ASSIGN_OR_RETURN(detail::AtomicFile f, detail::AtomicFile::create(path, 0666, "trace"));
  const std::string text = trace_json();
  TIER_RETURN_IF_ERROR(f.write(text.data(), text.size()));
  return f.commit();
}

void Counters::set_info(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(info_mu_);
  info_[key] = value;
}

void Counters::add_metric(const std::string& key, double delta) {
  std::lock_guard<std::mutex> lock(info_mu_);
  metrics_[key] += delta;
}

void Counters::set_metric(const std::string& key, double value) {
  std::lock_guard<std::mutex> lock(info_mu_);
  metrics_[key] = value;
}

StatsSnapshot Counters::snapshot() const {
  StatsSnapshot s;
  const auto now = Clock::now();
  s.uptime_seconds = std::chrono::duration<double>(now - start_).count();
  for (int i = 0; i < kNumTiers; ++i) {
    s.tiers[i].resident_bytes = resident_[i].load();
    s.tiers[i].peak_bytes = peak_[i].load();
    s.tiers[i].budget_bytes = budget_[i].load();
  }
  for (int i = 0; i < kNumLinks; ++i) {
    LinkState& l = links_[i];
    std::lock_guard<std::mutex> lock(l.mu);
    auto busy = l.busy;
    if (l.in_flight > 0) busy += now - l.busy_since;
    s.links[i] = LinkUsage{l.bytes, l.ops, l.errors, l.in_flight, std::chrono::duration<double>(busy).count()};
  }
  std::lock_guard<std::mutex> lock(info_mu_);
  s.info = info_;
  s.metrics = metrics_;
  return s;
}

StatsSnapshot StatsSnapshot::since(const StatsSnapshot& earlier) const {
  StatsSnapshot d = *this;
  d.uptime_seconds = uptime_seconds - earlier.uptime_seconds;
  for (int i = 0; i < kNumLinks; ++i) {
    d.links[i].bytes -= earlier.links[i].bytes;
    d.links[i].ops -= earlier.links[i].ops;
    d.links[i].errors -= earlier.links[i].errors;
    d.links[i].busy_seconds -= earlier.links[i].busy_seconds;
  }
  for (auto& [k, v] : d.metrics) {
    auto it = earlier.metrics.find(k);
    if (it != earlier.metrics.end()) v -= it->second;
  }
  return d;
}

std::string StatsSnapshot::to_json(int indent) const {
  nlohmann::ordered_json j;
  j["uptime_seconds"] = uptime_seconds;
  for (Tier t : kAllTiers) {
    const auto& u = tier(t);
    j["tiers"][tier_name(t)] = {
        {"resident_bytes", u.resident_bytes}, {"peak_bytes", u.peak_bytes}, {"budget_bytes", u.budget_bytes}};
    if (t == Tier::kHost) {
      j["tiers"][tier_name(t)]["pinned_bytes"] = u.pinned_bytes;
      j["tiers"][tier_name(t)]["device_registered_bytes"] = u.device_registered_bytes;
      j["tiers"][tier_name(t)]["io_registered_bytes"] = u.io_registered_bytes;
    }
  }
  for (Link l : kAllLinks) {
    const auto& u = link(l);
    j["links"][link_name(l)] = {{"bytes", u.bytes},
                                {"ops", u.ops},
                                {"errors", u.errors},
                                {"in_flight", u.in_flight},
                                {"busy_seconds", u.busy_seconds},
                                {"bytes_per_second", u.bytes_per_second()}};
  }
  j["info"] = nlohmann::ordered_json::object();
  for (const auto& [k, v] : info) j["info"][k] = v;
  j["metrics"] = nlohmann::ordered_json::object();
  for (const auto& [k, v] : metrics) j["metrics"][k] = v;
  return j.dump(indent);
}

}  // namespace tier
