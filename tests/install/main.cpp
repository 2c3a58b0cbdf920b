#include <cstdio>
#include <string>

#include "tier/config.hpp"
#include "tier/ext/cuda_probe.hpp"
#include "tier/ext/host_arena.hpp"
#include "tier/stats.hpp"

std::string public_api_names();  // public_headers.cpp

int main() {
  auto cfg = tier::EngineConfig::from_json(R"({"zero_optimization": {"stage": 3}})");
  if (!cfg.ok()) {
    std::fprintf(stderr, "%s\n", cfg.status().to_string().c_str());
    return 1;
  }
  auto arena = tier::HostArena::create({2 << 20});
  if (!arena.ok()) return 2;
  tier::Counters counters;
  counters.set_info("cuda", tier::probe_cuda().summary());
  counters.add_resident(tier::Tier::kHost, static_cast<std::int64_t>((*arena)->capacity()));
  std::printf("%s\n", counters.snapshot().to_json().c_str());
  if (public_api_names() != "read nvme") return 4;
  return cfg->zero_stage == 3 ? 0 : 3;
}
