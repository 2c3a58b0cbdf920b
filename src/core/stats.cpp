#include "tier/stats.hpp"

#include <nlohmann/json.hpp>

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
    if (owner_) owner_->end_transfer(link_, 0, false);
    owner_ = o.owner_;
    link_ = o.link_;
    o.owner_ = nullptr;
  }
  return *this;
}

Counters::Transfer::~Transfer() {
  if (owner_) owner_->end_transfer(link_, 0, false);
}

void Counters::Transfer::finish(std::uint64_t bytes, bool ok) noexcept {
  if (!owner_) return;
  owner_->end_transfer(link_, bytes, ok);
  owner_ = nullptr;
}

Counters::Transfer Counters::begin(Link link) noexcept {
  LinkState& s = links_[static_cast<int>(link)];
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.in_flight++ == 0) s.busy_since = Clock::now();
  return Transfer(this, link);
}

void Counters::record(Link link, std::uint64_t bytes, double seconds) noexcept {
  LinkState& s = links_[static_cast<int>(link)];
  std::lock_guard<std::mutex> lock(s.mu);
  s.bytes += bytes;
  ++s.ops;
  if (seconds > 0) s.busy += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

void Counters::end_transfer(Link link, std::uint64_t bytes, bool ok) noexcept {
  LinkState& s = links_[static_cast<int>(link)];
  std::lock_guard<std::mutex> lock(s.mu);
  if (--s.in_flight == 0) s.busy += Clock::now() - s.busy_since;
  if (ok) {
    s.bytes += bytes;
    ++s.ops;
  } else {
    ++s.errors;
  }
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
