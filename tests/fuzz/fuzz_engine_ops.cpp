// libFuzzer target: the engine's state machine driven by fuzz input. The input picks budgets and
// tensor sizes, then a sequence of operations — acquire, wait (briefly), give up, write, release,
// abandon, flush, check — over the memory backends, as one caller holding several leases and
// futures at once. A model of every tensor's contents says what each read must see; the
// engine's invariants are checked after every event (tier.debug_checks) and at the end.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <vector>

#include "engine/memory_backends.hpp"
#include "tier/engine.hpp"

namespace {

using namespace std::chrono_literals;

struct Input {
  const std::uint8_t* p;
  std::size_t n;
  std::uint8_t next() {
    if (n == 0) return 0;
    --n;
    return *p++;
  }
  bool empty() const { return n == 0; }
};

[[noreturn]] void fail(const char* what, const tier::Status& s = {}) {
  std::fprintf(stderr, "fuzz_engine_ops: %s %s\n", what, s.ok() ? "" : s.to_string().c_str());
  std::abort();
}

void fill(float* f, std::size_t n, float v) {
  for (std::size_t i = 0; i < n; ++i) f[i] = v + static_cast<float>(i);
}
bool holds(const float* f, std::size_t n, float v) {
  for (std::size_t i = 0; i < n; ++i) {
    if (f[i] != v + static_cast<float>(i)) return false;
  }
  return true;
}

struct Pending {
  tier::AcquireFuture future;
  std::size_t tensor;
  tier::Access access;
};
struct Held {
  tier::Lease lease;
  std::size_t tensor;
  bool wrote;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tier;
  Input in{data, size};
  constexpr std::size_t kUnit = 1024;  // floats per size unit (4 KiB)
  EngineConfig cfg;
  cfg.tier.debug_checks = true;
  cfg.tier.acquire_timeout_ms = 50;
  const std::uint64_t device = (1 + in.next() % 16) * kUnit * 4;
  const std::uint64_t host = (8 + in.next() % 24) * kUnit * 4;  // at least two of the largest tensors
  auto m = testing::make_memory_engine(cfg, device, host, 256 * kUnit * 4);
  if (!m.ok()) fail("engine", m.status());
  Engine& e = *m->engine;

  const std::size_t count = 1 + in.next() % 6;
  std::vector<TensorId> ids;
  std::vector<std::size_t> elems;
  std::vector<float> model;  // each tensor's first value
  // Host-homed tensors leave room on the host for the largest tensor to stage through it: a
  // configuration that cannot serve every acquire is not what this target looks for.
  std::uint64_t host_homed = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t n = (1 + in.next() % 4) * kUnit - in.next() % 7;  // odd sizes too
    Tier home = in.next() % 2 ? Tier::kNvme : Tier::kHost;
    if (home == Tier::kHost && host_homed + n * 4 + 4 * kUnit * 4 > host) home = Tier::kNvme;
    if (home == Tier::kHost) host_homed += n * 4;
    std::vector<float> init(n);
    fill(init.data(), n, static_cast<float>(i) * 1e6f);
    auto id =
        e.register_tensor(TensorDesc{"t" + std::to_string(i), DType::kF32, n, Role::kParam, 0}, home, init.data());
    if (!id.ok()) {
      if (id.status().code() == StatusCode::kResourceExhausted || id.status().code() == StatusCode::kTimedOut) break;
      fail("register", id.status());
    }
    ids.push_back(*id);
    elems.push_back(n);
    model.push_back(static_cast<float>(i) * 1e6f);
  }
  if (ids.empty()) return 0;

  std::vector<Pending> pending;
  std::vector<Held> held;
  std::vector<float> next_value(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) next_value[i] = model[i];

  auto take = [&](std::size_t k, std::chrono::milliseconds timeout) {
    Pending p = std::move(pending[k]);
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(k));
    auto lease = p.future.wait_for(timeout);
    if (!lease.ok()) {
      p.future.cancel();  // timed out or failed: give it up
      return;
    }
    const std::size_t n = elems[p.tensor];
    float* f = static_cast<float*>(lease->data());
    if (f == nullptr) fail("granted lease without memory");
    if (p.access != Access::kWrite && !holds(f, n, model[p.tensor])) fail("a lease sees contents the model does not");
    bool wrote = false;
    if (p.access != Access::kRead) {
      next_value[p.tensor] += 1.0f;
      fill(f, n, next_value[p.tensor]);
      wrote = true;
    }
    held.push_back({std::move(lease).value(), p.tensor, wrote});
  };

  for (int ops = 0; ops < 200 && !in.empty(); ++ops) {
    const std::uint8_t op = in.next();
    const std::uint8_t arg = in.next();
    switch (op % 7) {
      case 0:
      case 1: {  // acquire
        if (pending.size() >= 8) break;
        const std::size_t t = arg % ids.size();
        const Tier tier = (arg >> 3) % 2 ? Tier::kDevice : Tier::kHost;
        const Access access = static_cast<Access>((arg >> 4) % 3);
        pending.push_back({e.acquire(ids[t], tier, access), t, access});
        break;
      }
      case 2:  // wait for a pending acquire, briefly
        if (!pending.empty()) take(arg % pending.size(), std::chrono::milliseconds(arg % 3));
        break;
      case 3:  // give one up
        if (!pending.empty()) {
          const std::size_t k = arg % pending.size();
          pending[k].future.cancel();
          if (pending[k].future.wait().ok()) fail("a given-up acquire handed out a lease");
          pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(k));
        }
        break;
      case 4:  // release (publishes a write) or abandon an unwritten lease
        if (!held.empty()) {
          const std::size_t k = arg % held.size();
          Held h = std::move(held[k]);
          held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
          if (h.wrote) {
            model[h.tensor] = next_value[h.tensor];
            if (Status s = h.lease.release(); !s.ok()) fail("release", s);
          } else {
            if (Status s = h.lease.abandon(); !s.ok()) fail("abandon", s);
          }
        }
        break;
      case 5:  // flush (writers still open are skipped)
        if (Status s = e.flush(); !s.ok() && s.code() != StatusCode::kTimedOut) fail("flush", s);
        break;
      case 6:
        if (Status s = e.check_invariants(); !s.ok()) fail("invariant", s);
        break;
    }
  }
  for (auto& p : pending) p.future.cancel();
  pending.clear();
  for (auto& h : held) {
    if (h.wrote) model[h.tensor] = next_value[h.tensor];
    if (Status s = h.wrote ? h.lease.release() : h.lease.abandon(); !s.ok()) fail("final release", s);
  }
  held.clear();
  if (Status s = e.flush(); !s.ok()) fail("final flush", s);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    std::vector<float> back(elems[i]);
    if (Status s = e.read(ids[i], back.data()); !s.ok()) fail("final read", s);
    if (!holds(back.data(), back.size(), model[i])) fail("a tensor lost its last released write");
  }
  if (Status s = e.check_invariants(); !s.ok()) fail("final invariant", s);
  return 0;
}
