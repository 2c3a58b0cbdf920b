// libFuzzer target: the optimizer checkpoint reader. Each input is written as a checkpoint file and
// loaded into a small registered optimizer (host home); it must load or fail with a status, never
// crash, and a failed load must leave the optimizer usable.
//
// The first byte chooses how the rest is used: even, as the file's bytes; odd, with the header's
// and the metadata's CRC-32C recomputed first, so that the fuzzer gets past the checksums to the
// metadata and records behind them.
//
// TIER_FUZZ_WRITE_SEED=<path>: write a real checkpoint of the fuzzed optimizer (a seed) and exit.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "optim/crc32c.hpp"
#include "tier/log.hpp"
#include "tier/offloaded_optimizer.hpp"

namespace {

using tier::optim::OffloadedOptimizer;

std::unique_ptr<OffloadedOptimizer> g_opt;
std::string g_path;

std::unique_ptr<OffloadedOptimizer> make_optimizer() {
  tier::optim::OffloadedOptimizerOptions o;
  o.home = tier::optim::StateHome::kHost;
  o.chunk_elements = 1024;
  o.buffer_count = 2;
  o.threads = 1;
  tier::cpu::AdamHyperParams second;
  second.lr = 3e-4;
  o.groups.push_back(second);
  auto opt = OffloadedOptimizer::create(o);
  if (!opt.ok()) {
    std::fprintf(stderr, "fuzz_checkpoint: %s\n", opt.status().to_string().c_str());
    std::abort();
  }
  std::vector<float> init(200);
  for (std::size_t i = 0; i < init.size(); ++i) init[i] = 0.01f * static_cast<float>(i);
  const std::uint64_t sizes[] = {100, 37, 63};
  std::size_t at = 0;
  for (int p = 0; p < 3; ++p) {
    tier::optim::PartitionSpec spec;
    spec.numel = sizes[p];
    spec.group = p == 2 ? 1 : 0;
    spec.initial = init.data() + at;
    spec.name = "p" + std::to_string(p);
    at += sizes[p];
    if (!(*opt)->add_partition(spec).ok()) std::abort();
  }
  if (!(*opt)->finish_registration().ok()) std::abort();
  return std::move(opt).value();
}

void put32(std::vector<std::uint8_t>& b, std::size_t at, std::uint32_t v) {
  std::memcpy(b.data() + at, &v, 4);
}

std::uint64_t get64(const std::vector<std::uint8_t>& b, std::size_t at) {
  std::uint64_t v = 0;
  std::memcpy(&v, b.data() + at, 8);
  return v;
}

// Recomputes the checksums the reader checks first (layout in docs/optimizer.md): the header's
// over its first 60 bytes (at 60) and the metadata's (at 40) over the meta_bytes (at 16) after it.
void fix_checksums(std::vector<std::uint8_t>& b) {
  constexpr std::size_t kHeader = 64;
  if (b.size() < kHeader) return;
  const std::uint64_t meta = get64(b, 16);
  if (meta <= b.size() - kHeader) put32(b, 40, tier::optim::detail::crc32c(b.data() + kHeader, meta));
  put32(b, 60, tier::optim::detail::crc32c(b.data(), 60));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tier::set_log_level(tier::LogLevel::kOff);
  g_opt = make_optimizer();
  if (const char* seed = std::getenv("TIER_FUZZ_WRITE_SEED")) {
    const tier::Status s = g_opt->save_checkpoint(seed);
    std::fprintf(stderr, "fuzz_checkpoint: seed %s: %s\n", seed, s.to_string().c_str());
    std::exit(s.ok() ? 0 : 1);
  }
  const char* tmp = std::getenv("TMPDIR");
  g_path = std::string(tmp && *tmp ? tmp : "/tmp") + "/tier-fuzz-checkpoint-" + std::to_string(::getpid()) + ".ckpt";
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  std::vector<std::uint8_t> bytes(data + 1, data + size);
  if (data[0] & 1) fix_checksums(bytes);
  {
    std::ofstream out(g_path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  const tier::Status loaded = g_opt->load_checkpoint(g_path);
  (void)loaded.to_string();
  // A load that fails after verifying may leave the state marked invalid (documented); start over
  // from a fresh optimizer then, so that every input meets the same one.
  float probe = 0;
  if (!g_opt->read_state(0, tier::optim::StateKind::kMaster, &probe, 0, 1).ok()) g_opt = make_optimizer();
  ::unlink(g_path.c_str());
  return 0;
}
