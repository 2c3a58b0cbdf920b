#include "tier/engine.hpp"

#include <algorithm>
#include <cstring>
#include <future>
#include <optional>
#include <thread>

#include "engine/engine_impl.hpp"
#include "tier/ext/device.hpp"
#include "tier/log.hpp"
#include "tier/units.hpp"

namespace tier {

using detail::Buffer;
using detail::Done;
using CopyState = Engine::Impl::CopyState;

const char* access_name(Access a) noexcept {
  switch (a) {
    case Access::kRead: return "read";
    case Access::kWrite: return "write";
    case Access::kReadWrite: return "read_write";
  }
  return "unknown";
}

namespace {

constexpr std::size_t kNever = AccessTrace::kNever;

const char* copy_state_name(const Engine::Impl::Copy& c, bool home_valid) {
  switch (c.state) {
    case CopyState::kAbsent: return "absent";
    case CopyState::kReserved: return "reserved";
    case CopyState::kLoading: return "loading";
    case CopyState::kStale: return "stale";
    case CopyState::kValid:
      if (c.writing_back) return "writing_back";
      return home_valid ? "valid_clean" : "valid_dirty";
  }
  return "unknown";
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Lease, LeaseState, AcquireFuture

void detail::LeaseState::end(bool abandon) noexcept {
  if (released.exchange(true)) return;
  if (!link) return;
  const TensorId id = tensor;
  const Tier t = tier;
  const Access a = access;
  const std::uint64_t g = generation;
  link->post([id, t, a, g, abandon](Engine::Impl& e) { e.on_release(id, t, a, g, abandon); });
}

bool detail::EngineLink::post(std::function<void(Engine::Impl&)> fn) {
  return with([&](Engine::Impl& e) {
    Engine::Impl* pe = &e;
    e.post([pe, fn = std::move(fn)] { fn(*pe); });
  });
}

Lease::Lease(Lease&& o) noexcept : state_(std::move(o.state_)) {}
Lease& Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    if (state_) state_->end();
    state_ = std::move(o.state_);
  }
  return *this;
}
Lease::~Lease() {
  if (state_) state_->end();
}
void* Lease::data() const noexcept {
  return state_ ? state_->data : nullptr;
}
std::uint64_t Lease::bytes() const noexcept {
  return state_ ? state_->bytes : 0;
}
Tier Lease::tier() const noexcept {
  return state_ ? state_->tier : Tier::kHost;
}
DType Lease::dtype() const noexcept {
  return state_ ? state_->dtype : DType::kF32;
}
Access Lease::access() const noexcept {
  return state_ ? state_->access : Access::kRead;
}
TensorId Lease::tensor() const noexcept {
  return state_ ? state_->tensor : kInvalidTensor;
}

Status Lease::release() {
  if (!state_) return failed_precondition("release of an empty lease");
  state_->end();
  state_.reset();
  return Status::Ok();
}

Status Lease::release_after(const DeviceEvent& done) {
  if (!state_) return failed_precondition("release_after of an empty lease");
  if (!done.valid()) return invalid_argument("release_after: the event is empty (DeviceEvent()); the lease is kept");
  std::shared_ptr<detail::LeaseState> st = std::move(state_);
  try {
    done.on_complete([st](const Status& s) {
      if (s.ok()) {
        st->end();
        return;
      }
      const bool wrote = st->access != Access::kRead;
      TIER_LOG(kError, "lease of tensor ", st->tensor, " on the ", tier_name(st->tier),
               " tier: the event it was to end after failed (", s.to_string(), "); ",
               wrote ? "its writes are not published, the tensor keeps the contents it had" : "the read lease ends");
      st->end(/*abandon=*/wrote);
    });
  } catch (...) {
    st->end();  // out of memory while deferring: end it now rather than never
    throw;
  }
  return Status::Ok();
}

Status Lease::release_after(DeviceStream stream) {
  if (!state_) return failed_precondition("release_after of an empty lease");
  Result<DeviceEvent> done = DeviceEvent::completed();
  const bool attached =
      state_->link && state_->link->with([&](Engine::Impl& e) { done = e.be.device->record_event(stream); });
  if (!attached) return release();  // the engine is gone: nothing left to order after
  if (!done.ok()) {
    return Status(done.status().code(),
                  str("release_after: could not record an event on the consumer's stream; the lease is kept: ",
                      done.status().message()));
  }
  return release_after(*done);
}

Status Lease::abandon() {
  if (!state_) return failed_precondition("abandon of an empty lease");
  state_->end(/*abandon=*/true);
  state_.reset();
  return Status::Ok();
}

bool AcquireFuture::ready() const {
  if (!state_) return false;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done;
}

Result<Lease> AcquireFuture::wait() {
  return wait_for(std::chrono::milliseconds::max());
}

void AcquireFuture::cancel() {
  if (!state_) return;
  std::shared_ptr<detail::LeaseState> granted;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->taken || state_->cancelled) return;
    state_->cancelled = true;
    if (state_->done) granted = std::move(state_->lease);
    state_->done = true;
    state_->taken = true;
    state_->status = cancelled("the acquire was cancelled");
    state_->cv.notify_all();
  }
  if (granted) {
    granted->end(/*abandon=*/true);
  } else if (state_->link) {
    // Tell the scheduler, so that an acquire queued for room lets go of the tensor now.
    state_->link->post([st = state_](Engine::Impl& e) { e.give_up(st); });
  }
}

Result<Lease> AcquireFuture::wait_for(std::chrono::milliseconds timeout) {
  if (!state_) return failed_precondition("wait on an empty acquire future");
  std::unique_lock<std::mutex> lock(state_->mu);
  if (state_->cancelled) return state_->status;
  if (state_->taken) return failed_precondition("the lease of this acquire was already taken");
  if (!state_->done) {
    const auto t0 = std::chrono::steady_clock::now();
    bool done = true;
    if (timeout == std::chrono::milliseconds::max()) {
      state_->cv.wait(lock, [&] { return state_->done; });
    } else {
      done = state_->cv.wait_for(lock, timeout, [&] { return state_->done; });
    }
    const auto t1 = std::chrono::steady_clock::now();
    const double waited = std::chrono::duration<double>(t1 - t0).count();
    if (state_->link) {
      state_->link->with([&](Engine::Impl& e) {
        {
          std::lock_guard<std::mutex> g(e.stall_mu);
          ++e.m_stalls;
          e.m_stall_seconds += waited;
        }
        if (e.counters->tracing()) {
          const std::string what =
              !state_->lease ? std::string("stall")
              : state_->lease->name.empty()
                  ? str("stall on tensor ", state_->lease->tensor, " (", tier_name(state_->lease->tier), ")")
                  : str("stall on '", state_->lease->name, "' (", tier_name(state_->lease->tier), ")");
          e.counters->trace_span("stalls", what, t0, t1);
        }
      });
    }
    if (!done) return timed_out(str("acquire still pending after ", timeout.count(), " ms"));
  }
  state_->taken = true;
  if (!state_->status.ok()) return state_->status;
  return Lease(std::move(state_->lease));
}

// ----------------------------------------------------------------------------------------------
// Impl: construction and the scheduler thread

Engine::Impl::Impl(const EngineConfig& c, detail::Backends backends, std::shared_ptr<Counters> ctr)
    : cfg(c), counters(std::move(ctr)), be(std::move(backends)) {
  link->engine = this;
  const std::uint64_t configured[kNumTiers] = {cfg.tier.device_budget, cfg.tier.host_budget, cfg.tier.nvme_budget};
  for (int i = 0; i < kNumTiers; ++i) {
    if (!be.stores[i]) continue;
    const std::uint64_t cap = be.stores[i]->capacity();
    budget[i] = configured[i] ? std::min(configured[i], cap) : cap;
    counters->set_budget(static_cast<Tier>(i), budget[i]);
  }
  // The window spans the upcoming acquires that fit in the staging tier (the host budget, or the
  // device's when it is larger), and at most `lookahead` of them (0, auto: at most 1024).
  prefetch::PrefetchLimits lim;
  lim.lookahead = cfg.tier.prefetch.lookahead > 0 ? static_cast<std::uint64_t>(cfg.tier.prefetch.lookahead) : 0;
  lim.window_bytes = std::max(budget[static_cast<int>(Tier::kHost)], budget[static_cast<int>(Tier::kDevice)]);
  lim.max_inflight_bytes = cfg.tier.prefetch.max_inflight_bytes
                               ? cfg.tier.prefetch.max_inflight_bytes
                               : std::max<std::uint64_t>(budget[static_cast<int>(Tier::kDevice)] / 2, 64ull << 20);
  // NVMe -> host staging runs further ahead, bounded by half the host budget.
  lim.max_staging_bytes = std::max<std::uint64_t>(budget[static_cast<int>(Tier::kHost)] / 2, 64ull << 20);
  scheduler = prefetch::PrefetchScheduler(lim);
  eviction.set_device_budget(budget[static_cast<int>(Tier::kDevice)]);
  counters->set_info(
      "prefetch",
      cfg.tier.prefetch.enabled
          ? str("lookahead ", lim.lookahead ? str(lim.lookahead) : str("auto (", format_bytes(lim.window_bytes), ")"),
                ", max in flight ", format_bytes(lim.max_inflight_bytes))
          : "off");
  worker = std::thread([this] { run(); });
}

Engine::Impl::~Impl() {
  // Leases and futures that outlive the engine stop reaching it from here on.
  {
    std::lock_guard<std::mutex> lock(link->mu);
    link->engine = nullptr;
  }
  // Let every transfer in flight complete (their completions post here) before the backends go:
  // the backends must not be torn down under a transfer, however long it takes; say so loudly.
  auto next_note = Clock::now() + std::chrono::seconds(10);
  for (std::uint64_t moving; (moving = call([this] { return moves_in_flight; })) > 0;) {
    if (Clock::now() >= next_note) {
      TIER_LOG(kWarn, "engine shutdown: still waiting for ", moving, " transfer(s) in flight to complete");
      next_note = Clock::now() + std::chrono::seconds(10);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
  }
  cv.notify_all();
  if (worker.joinable()) worker.join();
}

void Engine::Impl::post(std::function<void()> fn) {
  // Notify under the lock: once the scheduler can see the item, the poster no longer touches the
  // engine (completions may come from threads that outlive a finishing engine's last transfer).
  std::lock_guard<std::mutex> lock(mu);
  queue.push_back(std::move(fn));
  cv.notify_one();
}

template <class F>
auto Engine::Impl::call(F&& fn) -> decltype(fn()) {
  using R = decltype(fn());
  if (std::this_thread::get_id() == worker_id.load()) return fn();
  std::promise<R> p;
  auto f = p.get_future();
  post([&] {
    if constexpr (std::is_void_v<R>) {
      fn();
      p.set_value();
    } else {
      p.set_value(fn());
    }
  });
  return f.get();
}

void Engine::Impl::run() {
  worker_id.store(std::this_thread::get_id());
  auto last_expiry = Clock::now();
  while (true) {
    std::deque<std::function<void()>> batch;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, std::chrono::milliseconds(20), [&] { return stopping || !queue.empty(); });
      if (stopping && queue.empty()) break;
      batch.swap(queue);
    }
    for (auto& fn : batch) {
      fn();
      after_event();
    }
    if (Clock::now() - last_expiry > std::chrono::milliseconds(20)) {
      last_expiry = Clock::now();
      expire_waiters();
      for (Tier x : kAllTiers) serve_room_waiters(x);  // retries of failed write-backs come due here
    }
  }
  // Anything still waiting fails: the engine is going away.
  fail_everything(cancelled("the engine is shutting down"));
}

void Engine::Impl::after_event() {
  if (!cfg.tier.debug_checks || !first_violation.ok()) return;
  Status s = check_invariants_locked();
  if (!s.ok()) {
    first_violation = s;
    TIER_LOG(kError, "engine invariant violated: ", s.message());
  }
}

void Engine::Impl::fail_everything(const Status& why) {
  shutting_down = true;
  shutdown_status = why;
  for (auto& waiters : room_waiters) {
    auto list = std::move(waiters);
    waiters.clear();
    for (auto& w : list) w.done(why, Buffer{});
  }
  // Acquires still waiting behind another lease's lock are answered too: nobody will wake them.
  for (TensorRec& t : tensors) {
    auto list = std::move(t.blocked);
    t.blocked.clear();
    for (auto& b : list) {
      std::lock_guard<std::mutex> lock(b.acquire->mu);
      if (b.acquire->done) continue;
      b.acquire->status = why;
      b.acquire->done = true;
      b.acquire->cv.notify_all();
    }
  }
}

void Engine::Impl::note_role_bytes(const TensorDesc& d, Tier tier, std::int64_t delta) {
  if (d.role != Role::kActivation) return;
  const int ti = static_cast<int>(tier);
  activation_used[ti] = static_cast<std::uint64_t>(static_cast<std::int64_t>(activation_used[ti]) + delta);
  activation_peak[ti] = std::max(activation_peak[ti], activation_used[ti]);
}

void Engine::Impl::note_resident(Tier tier, std::int64_t delta) {
  const auto& store = be.stores[static_cast<int>(tier)];
  if (store && store->reports_resident()) return;
  counters->add_resident(tier, delta);
}

// ----------------------------------------------------------------------------------------------
// Acquire

void Engine::Impl::start_acquire(TensorId id, Tier tier, Access access, std::shared_ptr<detail::AcquireState> st,
                                 bool first, bool traced, std::optional<DeviceStream> order) {
  auto fail = [&](Status s) {
    std::lock_guard<std::mutex> lock(st->mu);
    st->status = std::move(s);
    st->done = true;
    st->cv.notify_all();
  };
  {
    std::lock_guard<std::mutex> lock(st->mu);
    if (st->cancelled) return;  // given up while it was queued or blocked: it holds nothing yet
  }
  if (shutting_down) return fail(shutdown_status);
  if (id >= tensors.size() || !tensors[id].live) return fail(not_found(str("acquire: no tensor with id ", id)));
  TensorRec& t = tensors[id];
  if (!be.stores[static_cast<int>(tier)]) {
    return fail(invalid_argument(str("acquire '", t.desc.name, "' on ", tier_name(tier), ": the ", tier_name(tier),
                                     " tier is not configured (give it a budget or a swap path)")));
  }
  if (t.desc.bytes() > budget[static_cast<int>(tier)]) {
    return fail(resource_exhausted(str("acquire '", t.desc.name, "' (", format_bytes(t.desc.bytes()), ") on ",
                                       tier_name(tier), ": larger than the ", tier_name(tier), " budget (",
                                       format_bytes(budget[static_cast<int>(tier)]), "); raise tier.budgets.",
                                       tier_name(tier))));
  }
  if (first) {
    ++m_acquires;
    if (traced) trace.on_acquire(id, tier, access == Access::kWrite);
  }
  const bool writes = access != Access::kRead;
  if ((writes && (t.readers > 0 || t.writer)) || (!writes && t.writer)) {
    t.blocked.push_back(
        {st, [this, id, tier, access, st, order] { start_acquire(id, tier, access, st, false, false, order); }});
    return;
  }
  if (writes) {
    t.writer = true;
  } else {
    ++t.readers;
  }
  Copy& c = t.copies[static_cast<int>(tier)];
  if (first) {
    if (c.state == CopyState::kValid) {
      ++m_hits;
      if (c.prefetched) ++m_prefetch_hits;
    } else if (c.state == CopyState::kLoading && c.prefetched) {
      ++m_late_prefetch;
    }
  }
  c.prefetched = false;
  const std::uint64_t gen = t.generation;
  ensure_copy(
      id, tier, access != Access::kWrite, kNever,
      [this, id, tier, access, st, gen, order](Status s) {
        TensorRec& t2 = tensors[id];
        if (!t2.live || t2.generation != gen) {
          s = cancelled("the tensor was unregistered while it was being acquired");
        }
        if (s.ok() && order) {
          // Granted while the copy to the device is in flight: the consumer's stream waits for it.
          const Copy& c2 = t2.copies[static_cast<int>(tier)];
          if (c2.state == CopyState::kLoading && c2.queued.valid()) {
            s = be.device->stream_wait(*order, c2.queued).with_context("ordering the consumer's stream after the copy");
          }
        }
        if (!s.ok()) {
          if (t2.generation == gen) {
            if (access != Access::kRead) {
              t2.writer = false;
            } else if (t2.readers > 0) {
              --t2.readers;
            }
            wake_blocked(t2);
          }
          std::lock_guard<std::mutex> lock(st->mu);
          if (st->cancelled) return;  // the give-up already answered the future
          st->status = s.with_context(str("acquire '", t2.desc.name, "' on ", tier_name(tier)));
          st->done = true;
          st->cv.notify_all();
          return;
        }
        grant(id, tier, access, st);
      },
      /*staging=*/false, st, /*queued=*/order.has_value());
  issue_prefetches();
}

void Engine::Impl::grant(TensorId id, Tier tier, Access access, std::shared_ptr<detail::AcquireState> st) {
  TensorRec& t = tensors[id];
  Copy& c = t.copies[static_cast<int>(tier)];
  ++c.pins;
  c.last_use = ++clock;
  auto lease = std::make_shared<detail::LeaseState>();
  lease->link = link;
  lease->tensor = id;
  lease->tier = tier;
  lease->access = access;
  lease->data = c.buf.ptr;
  lease->bytes = t.desc.bytes();
  lease->dtype = t.desc.dtype;
  lease->generation = t.generation;
  if (counters->tracing()) lease->name = t.desc.name;
  std::unique_lock<std::mutex> lock(st->mu);
  if (st->cancelled) {  // nobody will take it: end it unused, as an event of its own (see below)
    lock.unlock();
    lease->released = true;
    const std::uint64_t gen = lease->generation;
    // Not now: grant runs inside a load's completion, whose other waiters are still to be granted.
    post([this, id, tier, access, gen] { on_release(id, tier, access, gen, /*abandon=*/true); });
    return;
  }
  st->lease = std::move(lease);
  st->done = true;
  st->cv.notify_all();
}

// Makes the copy of `id` on `tier` valid (need_data) or reserved for a writer (!need_data).
void Engine::Impl::ensure_copy(TensorId id, Tier tier, bool need_data, std::size_t horizon, Done done, bool staging,
                               std::shared_ptr<detail::AcquireState> owner, bool queued) {
  TensorRec& t = tensors[id];
  Copy& c = t.copies[static_cast<int>(tier)];
  switch (c.state) {
    case CopyState::kValid:  // a writer overwrites it in place; its release makes it the newest
      return done(Status::Ok());
    case CopyState::kLoading:
      want(c, horizon, owner);
      wait_for_load(c, std::move(done), queued);
      return;
    case CopyState::kReserved:
      return done(
          internal_error(str("tensor '", t.desc.name, "': copy on ", tier_name(tier), " is reserved by a writer")));
    case CopyState::kStale:
    case CopyState::kAbsent: break;
  }
  if (!need_data) {
    if (c.state == CopyState::kStale) {  // the home copy's storage is always there
      c.state = CopyState::kReserved;
      return done(Status::Ok());
    }
    const std::uint64_t gen = t.generation;
    make_room(
        tier, t.desc.bytes(), id, horizon,
        [this, id, tier, gen, done](Status s, Buffer b) {
          TensorRec& t2 = tensors[id];
          if (!s.ok()) return done(s);
          if (!t2.live || t2.generation != gen) return done(cancelled("tensor unregistered"));
          Copy& c2 = t2.copies[static_cast<int>(tier)];
          c2.buf = std::move(b);
          c2.state = CopyState::kReserved;
          note_cached(id, tier);
          done(Status::Ok());
        },
        std::move(owner));
    return;
  }
  // Copies move between adjacent tiers only: device <-> host <-> nvme.
  const auto valid = [&](Tier x) { return t.copies[static_cast<int>(x)].state == CopyState::kValid; };
  if (tier == Tier::kHost) {
    if (valid(Tier::kDevice))
      return load_from(id, Tier::kHost, Tier::kDevice, horizon, std::move(done), staging, std::move(owner), queued);
    if (valid(Tier::kNvme))
      return load_from(id, Tier::kHost, Tier::kNvme, horizon, std::move(done), staging, std::move(owner), queued);
    return done(internal_error(str("tensor '", t.desc.name, "' has no valid copy to load from")));
  }
  // Device or NVMe: through the host copy.
  if (valid(Tier::kHost)) {
    return load_from(id, tier, Tier::kHost, horizon, std::move(done), staging, std::move(owner), queued);
  }
  const std::uint64_t gen = t.generation;
  ensure_copy(
      id, Tier::kHost, true, horizon,
      [this, id, tier, horizon, gen, done, staging, owner, queued](Status s) {
        TensorRec& t2 = tensors[id];
        if (s.ok() && (!t2.live || t2.generation != gen)) s = cancelled("tensor unregistered");
        if (!s.ok()) return done(s);
        if (owner != nullptr && owner->given_up) return done(cancelled("the acquire was given up between two hops"));
        if (t2.copies[static_cast<int>(Tier::kHost)].state != CopyState::kValid) {
          // Evicted between the two hops (possible when the host tier is tight): start again.
          return ensure_copy(id, tier, true, horizon, done, staging, owner, queued);
        }
        load_from(id, tier, Tier::kHost, horizon, done, staging, owner, queued);
      },
      /*staging=*/true, owner);
}

void Engine::Impl::want(Copy& c, std::size_t horizon, const std::shared_ptr<detail::AcquireState>& owner) {
  if (owner != nullptr) {
    c.wanted_by.push_back(owner);
  } else if (horizon == kNever) {
    ++c.wanted_unowned;
  }
}

void Engine::Impl::wait_for_load(Copy& c, Done done, bool queued) {
  if (!queued) {
    c.on_ready.push_back(std::move(done));
  } else if (c.queued.valid()) {
    done(Status::Ok());
  } else {
    c.on_queued.push_back(std::move(done));
  }
}

bool Engine::Impl::abandoned(const RoomRequest& r) const {
  if (r.owner != nullptr) return r.owner->given_up;
  if (!r.for_load || r.for_tensor >= tensors.size()) return false;
  const TensorRec& t = tensors[r.for_tensor];
  if (t.generation != r.generation) return false;
  const Copy& c = t.copies[static_cast<int>(r.tier)];
  if (c.state != CopyState::kLoading || c.wanted_unowned > 0 || c.wanted_by.empty()) return false;
  for (const auto& a : c.wanted_by) {
    if (!a->given_up) return false;
  }
  return true;
}

void Engine::Impl::load_from(TensorId id, Tier to, Tier from, std::size_t horizon, Done done, bool staging,
                             std::shared_ptr<detail::AcquireState> owner, bool queued) {
  TensorRec& t = tensors[id];
  Copy& dst = t.copies[static_cast<int>(to)];
  if (dst.state == CopyState::kValid) return done(Status::Ok());
  const bool prefetch = horizon != kNever;
  if (dst.state == CopyState::kLoading) {
    if (!prefetch) dst.prefetched = false;  // a demand waits for it: it will be used
    want(dst, horizon, owner);
    wait_for_load(dst, std::move(done), queued);
    return;
  }
  // Which prefetch budget the transfer counts against: 0 none (a demand), 1 the final hop of a
  // prefetch (max_inflight), 2 a staging hop (max_staging).
  const int counted = !prefetch ? 0 : (staging ? 2 : 1);
  // Pin the source (and count the transfer as a reader, so writers wait) until the copy is done.
  Copy& src = t.copies[static_cast<int>(from)];
  ++src.pins;
  ++t.readers;
  ++t.transfers;
  const std::uint64_t gen = t.generation;
  const std::uint64_t bytes = t.desc.bytes();
  auto start = [this, id, to, from, counted, gen, bytes](Buffer b) {
    TensorRec& t2 = tensors[id];
    Copy& d = t2.copies[static_cast<int>(to)];
    Copy& s2 = t2.copies[static_cast<int>(from)];
    if (b) {
      d.buf = std::move(b);
      note_cached(id, to);
    }
    if (counted == 1) prefetch_inflight_bytes += bytes;
    if (counted == 2) staging_inflight_bytes += bytes;
    if (from == t2.home && t2.zero_home) {
      Status z = be.mover->zero(to, d.buf, bytes);
      ++moves_in_flight;
      post([this, id, to, from, gen, counted, z] { complete_load(id, to, from, gen, counted, z); });
      return;
    }
    ++moves_in_flight;
    DeviceEvent ev = be.mover->move(from, s2.buf, to, d.buf, bytes, [this, id, to, from, gen, counted](Status st) {
      post([this, id, to, from, gen, counted, st] { complete_load(id, to, from, gen, counted, st); });
    });
    // The copy is queued (its completion is posted, so the load is still in flight here): the
    // stream-ordered acquires waiting for it are granted on its event.
    if (ev.valid() && to == Tier::kDevice) {
      Copy& d2 = tensors[id].copies[static_cast<int>(to)];
      d2.queued = std::move(ev);
      auto waiters = std::move(d2.on_queued);
      d2.on_queued.clear();
      for (auto& w : waiters) w(Status::Ok());
    }
  };
  // Storage already there: the home's, or a copy whose load failed while stream-ordered leases
  // held it (complete_load).
  const bool home_storage = dst.state == CopyState::kStale;
  dst.state = CopyState::kLoading;  // later ensure_copy calls queue on on_ready from now on
  // Set now, not when the room comes: an acquire from here on finds a prefetch under way (late)
  // and marks the copy used.
  dst.prefetched = prefetch;
  want(dst, horizon, owner);
  wait_for_load(dst, std::move(done), queued);
  if (home_storage) {
    start(Buffer{});
    return;
  }
  make_room(
      to, bytes, id, horizon,
      [this, id, to, from, gen, start](Status s, Buffer b) {
        TensorRec& t2 = tensors[id];
        if (s.ok() && (!t2.live || t2.generation != gen)) s = cancelled("tensor unregistered");
        if (!s.ok()) {
          if (t2.generation == gen) {
            Copy& d = t2.copies[static_cast<int>(to)];
            Copy& s2 = t2.copies[static_cast<int>(from)];
            --s2.pins;
            --t2.readers;
            --t2.transfers;
            // A copy in kLoading whose room never came holds no storage (a stale one keeps its own
            // and never waits for room).
            d.state = CopyState::kAbsent;
            d.forget_wanted();
            auto waiters = std::move(d.on_ready);
            d.on_ready.clear();
            for (auto& w : d.on_queued) waiters.push_back(std::move(w));
            d.on_queued.clear();
            for (auto& w : waiters) w(s);
            wake_blocked(t2);
          }
          return;
        }
        start(std::move(b));
      },
      nullptr, /*for_load=*/true);
}

void Engine::Impl::complete_load(TensorId id, Tier to, Tier from, std::uint64_t gen, int counted, Status s) {
  --moves_in_flight;
  if (counted == 1) prefetch_inflight_bytes -= std::min(prefetch_inflight_bytes, tensors[id].desc.bytes());
  if (counted == 2) staging_inflight_bytes -= std::min(staging_inflight_bytes, tensors[id].desc.bytes());
  TensorRec& t = tensors[id];
  if (t.generation != gen) return;
  Copy& d = t.copies[static_cast<int>(to)];
  Copy& src = t.copies[static_cast<int>(from)];
  d.forget_wanted();
  d.queued = DeviceEvent{};
  --src.pins;
  --t.readers;
  --t.transfers;
  if (s.ok()) {
    d.state = CopyState::kValid;
    d.last_use = ++clock;
    if (to == t.home) t.zero_home = false;
    // A staged copy has served the hop it was staged for: it was used (dropping it later wastes
    // nothing the prefetcher brought in).
    if (to == Tier::kDevice) src.prefetched = false;
  } else {
    TIER_LOG(kError, "tensor '", t.desc.name, "': ", tier_name(from), " -> ", tier_name(to), " failed; the ",
             tier_name(from), " copy stays the valid one: ", s.to_string());
    if (to == t.home || d.pins > 0) {
      // Home storage stays allocated; so does a copy that stream-ordered leases were granted on
      // (their streams waited for the failed copy, so they fail too), until the last one ends.
      // The source copy is still valid.
      d.state = CopyState::kStale;
    } else {
      drop_copy(t, to);
    }
  }
  auto waiters = std::move(d.on_ready);
  d.on_ready.clear();
  for (auto& w : d.on_queued) waiters.push_back(std::move(w));  // a mover without events, or a failure
  d.on_queued.clear();
  // The new copy stays pinned until every waiter had its turn: one waiter's callback may release
  // or make room (e.g. a given-up acquire), which must not evict the copy the next one is granted.
  const bool pin = s.ok();
  if (pin) ++d.pins;
  for (auto& w : waiters) w(s);
  if (pin) --tensors[id].copies[static_cast<int>(to)].pins;
  wake_blocked(tensors[id]);
  for (Tier x : kAllTiers) serve_room_waiters(x);
  issue_prefetches();
}

// ----------------------------------------------------------------------------------------------
// Room, eviction, write-back

bool Engine::Impl::has_other_valid(const TensorRec& t, Tier except) const {
  for (Tier x : kAllTiers) {
    if (x != except && t.copies[static_cast<int>(x)].state == CopyState::kValid) return true;
  }
  return false;
}

bool Engine::Impl::backed_toward_home(const TensorRec& t, Tier tier) const {
  for (Tier x = tier; x != t.home;) {
    x = toward_home(x, t.home);
    if (t.copies[static_cast<int>(x)].state == CopyState::kValid) return true;
  }
  return false;
}

Tier Engine::Impl::toward_home(Tier from, Tier home) const {
  if (from == Tier::kDevice || from == Tier::kNvme) return Tier::kHost;
  return home;  // from host: toward the device or NVMe home
}

void Engine::Impl::forget_tensor(TensorId id) {
  TensorRec& t = tensors[id];
  for (Tier x : kAllTiers) drop_copy(t, x);
  t.live = false;
  ++t.generation;
  by_name.erase(t.desc.name);
  free_ids.push_back(id);
  // The recorded order stays valid unless it holds this tensor (an untraced one, such as a
  // reserve_host region, leaves it alone).
  if (trace.touches(id)) trace.reset();
}

void Engine::Impl::drop_copy(TensorRec& t, Tier tier) {
  Copy& c = t.copies[static_cast<int>(tier)];
  if (c.prefetched && c.state == CopyState::kValid) {
    // Brought in for a use that has not come: the room was needed sooner. See Target::start.
    c.dropped_unused_at = trace.advances();
    ++m_prefetch_dropped_unused;
  }
  if (c.cached_pos != kNotCached) {
    auto& list = cached[static_cast<int>(tier)];
    const TensorId moved = list.back();
    list[c.cached_pos] = moved;
    tensors[moved].copies[static_cast<int>(tier)].cached_pos = c.cached_pos;
    list.pop_back();
    c.cached_pos = kNotCached;
  }
  if (c.buf) {
    const std::uint64_t bytes = c.buf.bytes;
    c.buf = Buffer{};
    used[static_cast<int>(tier)] -= bytes;
    note_resident(tier, -static_cast<std::int64_t>(bytes));
    note_role_bytes(t.desc, tier, -static_cast<std::int64_t>(bytes));
  }
  c.state = CopyState::kAbsent;
  c.prefetched = false;
  c.writing_back = false;
  c.queued = DeviceEvent{};
  c.forget_wanted();
}

void Engine::Impl::note_cached(TensorId id, Tier tier) {
  TensorRec& t = tensors[id];
  Copy& c = t.copies[static_cast<int>(tier)];
  if (tier == t.home || c.cached_pos != kNotCached) return;
  auto& list = cached[static_cast<int>(tier)];
  c.cached_pos = static_cast<std::uint32_t>(list.size());
  list.push_back(id);
}

bool Engine::Impl::try_place(Tier tier, std::uint64_t bytes, TensorId for_tensor, std::size_t horizon, Buffer* out,
                             Status* fatal) {
  const int ti = static_cast<int>(tier);
  const bool prefetch = horizon != kNever;
  // Set when the budget has room but the store cannot place the bytes (fragmented): then dirty
  // copies must be written back too, although the budget alone would not ask for it.
  bool fragmented = false;
  for (int round = 0;; ++round) {
    if (used[ti] + bytes <= budget[ti]) {
      auto r = be.stores[ti]->allocate(bytes);
      if (r.ok()) {
        *out = std::move(r).value();
        out->bytes = bytes;
        used[ti] += bytes;
        note_resident(tier, static_cast<std::int64_t>(bytes));
        if (for_tensor < tensors.size())
          note_role_bytes(tensors[for_tensor].desc, tier, static_cast<std::int64_t>(bytes));
        return true;
      }
      if (r.status().code() != StatusCode::kResourceExhausted) {
        *fatal = r.status();
        return false;
      }
      // The store is fragmented or short although the budget allows: evict more below.
      fragmented = true;
    }
    // Candidates: the copies this tier holds that are not home copies (`cached`, in id order as
    // the policy's ties have always been broken); the policy picks and orders the victims.
    std::vector<TensorId> ids(cached[ti].begin(), cached[ti].end());
    std::sort(ids.begin(), ids.end());
    std::vector<prefetch::EvictionCandidate> cands;
    cands.reserve(ids.size());
    for (TensorId i : ids) {
      const TensorRec& t = tensors[i];
      if (!t.live) continue;
      const Copy& c = t.copies[ti];
      cands.push_back({.tensor = i,
                       .valid = c.state == CopyState::kValid,
                       .pinned = c.pins > 0,
                       .writing_back = c.writing_back,
                       .home = t.home == tier,
                       .last_use = c.last_use,
                       .device_copy_valid = t.copies[static_cast<int>(Tier::kDevice)].state == CopyState::kValid});
    }
    const std::vector<prefetch::Victim> victims = eviction.choose(cands, tier, for_tensor, horizon, clock);
    bool dropped = false;
    for (const prefetch::Victim& v : victims) {
      TensorRec& t = tensors[v.tensor];
      // Only a copy backed on the way home is dropped as it is. A host copy whose one other
      // current copy is on the device is written back instead: dropped, it would leave the device
      // copy the only current one, and that copy's eviction would then go back through the host
      // (device -> host -> NVMe), taking host room when it is scarcest.
      if (backed_toward_home(t, tier)) {
        drop_copy(t, tier);
        ++m_evictions[ti];
        dropped = true;
        break;
      }
      if (!prefetch && !t.writer && (fragmented || used[ti] - freeing[ti] + bytes > budget[ti]) &&
          Clock::now() >= t.copies[ti].retry_writeback_after) {
        start_writeback(v.tensor, tier);
      }
    }
    if (!dropped) return false;
  }
}

void Engine::Impl::make_room(Tier tier, std::uint64_t tensor_bytes, TensorId for_tensor, std::size_t horizon,
                             std::function<void(Status, Buffer)> done, std::shared_ptr<detail::AcquireState> owner,
                             bool for_load, bool for_home) {
  const int ti = static_cast<int>(tier);
  // Counted as the store really allocates it (4 KiB blocks on host and NVMe).
  const std::uint64_t bytes = be.stores[ti] ? be.stores[ti]->footprint(tensor_bytes) : tensor_bytes;
  if (bytes > budget[ti]) {
    return done(
        resource_exhausted(str(format_bytes(bytes), " on ", tier_name(tier), " is larger than the ", tier_name(tier),
                               " budget (", format_bytes(budget[ti]), "); raise tier.budgets.", tier_name(tier))),
        Buffer{});
  }
  Buffer b;
  Status fatal;
  if (try_place(tier, bytes, for_tensor, horizon, &b, &fatal)) return done(Status::Ok(), std::move(b));
  if (!fatal.ok()) return done(fatal, Buffer{});
  if (horizon != kNever) {
    prefetch_blocked = true;
    return done(resource_exhausted("no room for a prefetch"), Buffer{});
  }
  if (for_home && cached[ti].empty() && moves_in_flight == 0) {
    // A new home copy on a tier that holds nothing evictable and has nothing in flight: only an
    // unregister could make room, so waiting out the acquire timeout would just delay the error.
    const std::string name = for_tensor < tensors.size() ? tensors[for_tensor].desc.name : std::string("?");
    std::string why =
        str("registering '", name, "' needs ", format_bytes(bytes), " on ", tier_name(tier), " but ",
            format_bytes(budget[ti] - std::min(used[ti], budget[ti])), " of the ", format_bytes(budget[ti]),
            " budget are free and the rest holds home copies, which are never "
            "evicted; raise tier.budgets.",
            tier_name(tier), " or unregister tensors first");
    if (tier == Tier::kNvme && reserved_nvme > 0) {
      why += str("; ", format_bytes(reserved_nvme),
                 " of the budget is reserved by components sharing the swap space (an offloaded optimizer's state)");
    }
    return done(resource_exhausted(std::move(why)), Buffer{});
  }
  ++m_room_waits;
  const std::uint64_t gen = for_tensor < tensors.size() ? tensors[for_tensor].generation : 0;
  room_waiters[ti].push_back(RoomRequest{tier, bytes, for_tensor,
                                         Clock::now() + std::chrono::milliseconds(cfg.tier.acquire_timeout_ms),
                                         std::move(done), std::move(owner), for_load, gen});
}

void Engine::Impl::give_up(const std::shared_ptr<detail::AcquireState>& st) {
  st->given_up = true;
  for (Tier x : kAllTiers) serve_room_waiters(x);
}

namespace {
// A room request taken out of its queue, with what its callback is to be told.
struct Answer {
  std::function<void(Status, Buffer)> done;
  Status status;
  Buffer buf;
};
}  // namespace

void Engine::Impl::serve_room_waiters(Tier tier) {
  rooms_to_serve |= 1u << static_cast<int>(tier);
  if (serving_rooms) return;  // called back from an answer below: the running walk covers it
  serving_rooms = true;
  while (rooms_to_serve != 0) {
    for (Tier x : kAllTiers) {
      const unsigned bit = 1u << static_cast<int>(x);
      if ((rooms_to_serve & bit) == 0) continue;
      rooms_to_serve &= ~bit;
      std::vector<Answer> answers;
      auto& list = room_waiters[static_cast<int>(x)];
      for (auto it = list.begin(); it != list.end();) {
        Buffer b;
        Status fatal;
        if (abandoned(*it)) {
          answers.push_back({std::move(it->done), cancelled("the acquire was given up while it waited for room"), {}});
        } else if (try_place(x, it->bytes, it->for_tensor, kNever, &b, &fatal)) {
          answers.push_back({std::move(it->done), Status::Ok(), std::move(b)});
        } else if (!fatal.ok()) {
          answers.push_back({std::move(it->done), fatal, {}});
        } else {
          ++it;
          continue;
        }
        it = list.erase(it);
      }
      for (Answer& a : answers) a.done(a.status, std::move(a.buf));
    }
  }
  serving_rooms = false;
}

void Engine::Impl::expire_waiters() {
  const auto now = Clock::now();
  std::vector<Answer> answers;
  for (Tier tier : kAllTiers) {
    auto& list = room_waiters[static_cast<int>(tier)];
    // What the tier's pinned bytes are, for the message: one scan of the tensors, made only when
    // a waiter of this tier expires and shared by every one that does (nothing here changes it).
    std::optional<std::uint64_t> pinned_bytes;
    for (auto it = list.begin(); it != list.end();) {
      if (it->deadline > now) {
        ++it;
        continue;
      }
      if (!pinned_bytes) {
        std::uint64_t sum = 0;
        for (const auto& t : tensors) {
          const Copy& c = t.copies[static_cast<int>(tier)];
          if (t.live && c.buf && (c.pins > 0 || c.state != CopyState::kValid || t.home == tier)) sum += c.buf.bytes;
        }
        pinned_bytes = sum;
      }
      const std::uint64_t pinned = *pinned_bytes;
      auto done = std::move(it->done);
      const std::uint64_t bytes = it->bytes;
      it = list.erase(it);
      std::string why =
          str("no room for ", format_bytes(bytes), " on ", tier_name(tier), " after ", cfg.tier.acquire_timeout_ms,
              " ms: ", format_bytes(pinned), " of the ", format_bytes(budget[static_cast<int>(tier)]),
              " budget is pinned by leases, home copies or transfers; release leases sooner or raise "
              "tier.budgets.",
              tier_name(tier));
      if (tier == Tier::kNvme && reserved_nvme > 0) {
        why += str("; another ", format_bytes(reserved_nvme),
                   " of it is reserved by components sharing the swap space (an offloaded optimizer's state)");
      }
      if (!last_writeback_error.ok()) why += str(" (last write-back error: ", last_writeback_error.to_string(), ")");
      answers.push_back({std::move(done), timed_out(why), {}});
    }
  }
  for (Answer& a : answers) a.done(a.status, std::move(a.buf));
}

void Engine::Impl::start_writeback(TensorId id, Tier from) {
  TensorRec& t = tensors[id];
  Copy& c = t.copies[static_cast<int>(from)];
  if (c.writing_back) return;
  const Tier to = toward_home(from, t.home);
  c.writing_back = true;
  freeing[static_cast<int>(from)] += t.desc.bytes();
  ++m_writebacks;
  const std::uint64_t gen = t.generation;
  load_from(id, to, from, kNever, [this, id, from, gen](Status s) {
    TensorRec& t2 = tensors[id];
    if (t2.generation != gen) return;
    Copy& c2 = t2.copies[static_cast<int>(from)];
    c2.writing_back = false;
    freeing[static_cast<int>(from)] -= std::min(freeing[static_cast<int>(from)], t2.desc.bytes());
    if (!s.ok()) {
      last_writeback_error = s;
      c2.retry_writeback_after = Clock::now() + kWritebackRetry;
      return;
    }
    if (c2.state == CopyState::kValid && c2.pins == 0 && t2.home != from && has_other_valid(t2, from)) {
      drop_copy(t2, from);
      ++m_evictions[static_cast<int>(from)];
    }
    serve_room_waiters(from);
  });
}

// ----------------------------------------------------------------------------------------------
// Release and waking

void Engine::Impl::on_release(TensorId id, Tier tier, Access access, std::uint64_t gen, bool abandon) {
  if (id >= tensors.size() || tensors[id].generation != gen) return;
  TensorRec& t = tensors[id];
  Copy& c = t.copies[static_cast<int>(tier)];
  if (c.pins > 0) --c.pins;
  c.last_use = ++clock;
  if (access == Access::kRead) {
    if (t.readers > 0) --t.readers;
    // The last stream-ordered lease on a copy whose load failed (complete_load): its storage goes.
    if (tier != t.home && c.state == CopyState::kStale && c.pins == 0) drop_copy(t, tier);
    // An activation checkpoint is read once per step, by its recompute: once that lease ends its
    // device copy is garbage until the next step writes the tensor again, so it goes now rather
    // than when room is short (the device then holds the checkpoint in use and the one prefetched).
    if (tier == Tier::kDevice && tier != t.home && t.desc.role == Role::kActivation && c.pins == 0 &&
        c.state == CopyState::kValid && !c.writing_back && t.transfers == 0) {
      bool other_valid = false;
      for (Tier o : kAllTiers) {
        other_valid = other_valid || (o != tier && t.copies[static_cast<int>(o)].state == CopyState::kValid);
      }
      if (other_valid) drop_copy(t, tier);
    }
  } else if (abandon) {
    // Nothing was written: the other copies stay the valid ones. A fresh reservation holds no
    // data and goes (home storage stays, stale); a valid copy written in place is unchanged.
    t.writer = false;
    if (c.state == CopyState::kReserved) {
      if (tier == t.home) {
        c.state = CopyState::kStale;
      } else {
        drop_copy(t, tier);
      }
    }
  } else {
    t.writer = false;
    c.state = CopyState::kValid;
    for (Tier o : kAllTiers) {
      if (o == tier) continue;
      Copy& oc = t.copies[static_cast<int>(o)];
      if (oc.state != CopyState::kValid) continue;
      if (o == t.home) {
        oc.state = CopyState::kStale;
      } else {
        drop_copy(t, o);
      }
    }
    t.zero_home = false;
  }
  wake_blocked(t);
  for (Tier x : kAllTiers) serve_room_waiters(x);
  issue_prefetches();
}

void Engine::Impl::wake_blocked(TensorRec& t) {
  if (t.blocked.empty()) return;
  auto list = std::move(t.blocked);
  t.blocked.clear();
  for (auto& b : list) b.retry();
}

// ----------------------------------------------------------------------------------------------
// Prefetch

void Engine::Impl::issue_prefetches() {
  if (!cfg.tier.prefetch.enabled) return;
  // The engine's side of the scheduler's questions: its records and its transfers.
  struct Target final : prefetch::PrefetchTarget {
    Engine::Impl& e;
    explicit Target(Engine::Impl& engine) : e(engine) {}
    bool known(TensorId id) const override { return id < e.tensors.size(); }
    bool prefetchable(TensorId id) const override { return e.tensors[id].live && !e.tensors[id].writer; }
    std::uint64_t bytes(TensorId id) const override { return e.tensors[id].desc.bytes(); }
    bool one_ahead(TensorId id) const override { return e.tensors[id].desc.role == Role::kActivation; }
    bool present_or_coming(TensorId id, Tier tier) const override {
      const CopyState s = e.tensors[id].copies[static_cast<int>(tier)].state;
      return s == CopyState::kValid || s == CopyState::kLoading || s == CopyState::kReserved;
    }
    std::uint64_t inflight_bytes() const override { return e.prefetch_inflight_bytes; }
    std::uint64_t staging_bytes() const override { return e.staging_inflight_bytes; }
    Started start(TensorId id, Tier tier, std::size_t distance, bool staging) override {
      // Its last prefetch to this tier was dropped before its use and no acquire of the trace has
      // come since: the tier has no room for it now, and loading it again would only evict it
      // again (or evict what is needed sooner). Between steps, while an optimizer pass fills the
      // host, this stopped prefetches restaging the next forward's layers over and over.
      if (e.tensors[id].copies[static_cast<int>(tier)].dropped_unused_at == e.trace.advances()) {
        return Started::kNoRoom;
      }
      e.prefetch_blocked = false;
      ++e.m_prefetches;
      e.ensure_copy(
          id, tier, true, distance, [](Status) {}, staging);
      if (e.prefetch_blocked) return Started::kNoRoom;
      const CopyState now = e.tensors[id].copies[static_cast<int>(tier)].state;
      return now == CopyState::kLoading || now == CopyState::kValid ? Started::kInFlight : Started::kWaiting;
    }
  };
  Target target(*this);
  scheduler.issue(trace, target);
}

// ----------------------------------------------------------------------------------------------
// Invariants

Status Engine::Impl::check_invariants_locked() const {
  std::array<std::uint64_t, kNumTiers> sum{};
  for (TensorId i = 0; i < tensors.size(); ++i) {
    const TensorRec& t = tensors[i];
    for (Tier x : kAllTiers) {
      const Copy& c = t.copies[static_cast<int>(x)];
      if (c.buf) sum[static_cast<int>(x)] += c.buf.bytes;
      // The eviction index holds exactly the non-home copies with storage, each at its place.
      const bool indexed = c.cached_pos != kNotCached;
      if (indexed != (c.buf && x != t.home) || (indexed && (c.cached_pos >= cached[static_cast<int>(x)].size() ||
                                                            cached[static_cast<int>(x)][c.cached_pos] != i))) {
        return internal_error(str("tensor '", t.desc.name, "': copy on ", tier_name(x), " is ", indexed ? "" : "not ",
                                  "in the eviction index, against its storage"));
      }
      if (!t.live) continue;
      if ((c.state == CopyState::kValid || c.state == CopyState::kReserved || c.state == CopyState::kStale) && !c.buf) {
        return internal_error(str("tensor '", t.desc.name, "': copy on ", tier_name(x), " has a state but no storage"));
      }
    }
    if (!t.live) continue;
    int valid = 0;
    for (Tier x : kAllTiers) valid += t.copies[static_cast<int>(x)].state == CopyState::kValid;
    if (valid == 0) return internal_error(str("tensor '", t.desc.name, "' has no valid copy"));
    if (!t.copies[static_cast<int>(t.home)].buf) {
      return internal_error(str("tensor '", t.desc.name, "' lost its home storage"));
    }
    for (Tier x : kAllTiers) {
      if (t.copies[static_cast<int>(x)].state == CopyState::kReserved && !t.writer) {
        return internal_error(
            str("tensor '", t.desc.name, "': copy on ", tier_name(x), " is reserved without a writer"));
      }
    }
  }
  for (const auto& list : room_waiters) {
    for (const RoomRequest& r : list) {
      if (abandoned(r)) {
        return internal_error(
            str("a given-up acquire of tensor ", r.for_tensor, " still waits for room on ", tier_name(r.tier)));
      }
    }
  }
  for (Tier x : kAllTiers) {
    const int i = static_cast<int>(x);
    if (x == Tier::kNvme) sum[i] += reserved_nvme;
    if (sum[i] != used[i]) {
      return internal_error(str(tier_name(x), ": copies hold ", sum[i], " bytes but the engine counts ", used[i]));
    }
    if (used[i] > budget[i]) {
      return internal_error(str(tier_name(x), ": ", used[i], " bytes resident over the budget of ", budget[i]));
    }
  }
  return Status::Ok();
}

// ----------------------------------------------------------------------------------------------
// Engine: the public API

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  if (!impl_ || impl_->cfg.tier.trace_file.empty()) return;
  const std::string& path = impl_->cfg.tier.trace_file;
  if (Status s = impl_->counters->write_trace(path); !s.ok()) {
    TIER_LOG(kError, "engine: the timeline (tier.trace_file) could not be written: ", s.to_string());
  } else {
    TIER_LOG(kInfo, "engine: timeline written to ", path, " (open it in ui.perfetto.dev or chrome://tracing)");
  }
}

Result<TensorId> Engine::register_tensor(const TensorDesc& desc, Tier home, const void* initial, bool durable) {
  if (initial == nullptr) return register_filled_impl(desc, home, nullptr, durable);
  const Fill copy = [initial](void* dst, std::uint64_t bytes) {
    std::memcpy(dst, initial, bytes);
    return Status::Ok();
  };
  return register_filled_impl(desc, home, &copy, durable);
}

Result<TensorId> Engine::register_filled(const TensorDesc& desc, Tier home, const Fill& fill, bool durable) {
  if (!fill) return invalid_argument(str("register '", desc.name, "': no fill function"));
  return register_filled_impl(desc, home, &fill, durable);
}

Result<TensorId> Engine::register_filled_impl(const TensorDesc& desc, Tier home, const Fill* fill, bool durable) {
  TIER_RETURN_IF_ERROR(desc.validate());
  Impl& e = *impl_;
  std::uint64_t gen = 0;  // the registration's generation (set by the reservation)
  auto reserved = e.call([&]() -> Result<TensorId> {
    if (!e.be.stores[static_cast<int>(home)]) {
      return invalid_argument(str("register '", desc.name, "': home tier ", tier_name(home),
                                  " is not configured (give it a budget or a swap path)"));
    }
    if (e.by_name.count(desc.name)) return already_exists(str("register '", desc.name, "': the name is taken"));
    TensorId id;
    if (!e.free_ids.empty()) {
      id = e.free_ids.back();
      e.free_ids.pop_back();
    } else {
      id = static_cast<TensorId>(e.tensors.size());
      e.tensors.emplace_back();
    }
    Impl::TensorRec& t = e.tensors[id];
    for (auto& c : t.copies) c = Impl::Copy{};
    t.live = false;
    t.zero_home = false;
    t.readers = 0;
    t.transfers = 0;
    t.blocked.clear();
    t.desc = desc;
    t.home = home;
    t.generation = ++e.generation;
    gen = t.generation;
    t.writer = true;  // nobody may touch it until it is filled
    e.by_name[desc.name] = id;
    return id;
  });
  if (!reserved.ok()) return reserved.status();
  const TensorId id = *reserved;

  // Home storage (may have to evict cached copies, which is asynchronous).
  std::promise<Status> placed;
  e.post([&] {
    e.make_room(
        home, desc.bytes(), id, kNever,
        [&](Status s, Buffer b) {
          if (s.ok()) {
            Impl::Copy& c = e.tensors[id].copies[static_cast<int>(home)];
            c.buf = std::move(b);
            c.state = CopyState::kValid;
            c.last_use = ++e.clock;
            if (home == Tier::kNvme) {
              e.tensors[id].zero_home = true;
            } else {
              s = e.be.mover->zero(home, c.buf, desc.bytes());
            }
          }
          placed.set_value(s);
        },
        /*owner=*/nullptr, /*for_load=*/false, /*for_home=*/true);
  });
  Status s = placed.get_future().get();
  if (s.ok()) {
    e.call([&] {
      e.tensors[id].writer = false;
      e.tensors[id].live = true;
    });
  }
  if (s.ok() && fill != nullptr) {
    auto lease = acquire_now(id, Tier::kHost, Access::kWrite);
    if (!lease.ok()) {
      s = lease.status();
    } else {
      s = (*fill)(lease->data(), lease->bytes());
      const Status released = lease->release();
      if (!s.ok()) {
        // The released copy is live and dirty: the engine may have started writing it back (a
        // full host tier evicts), so it goes the way an unregister goes, waiting for that.
        const Status gone = unregister_tensor(id);
        if (!gone.ok())
          TIER_LOG(kError, "register '", desc.name, "': removing it after its fill failed: ", gone.to_string());
        return s.with_context(str("register '", desc.name, "' on ", tier_name(home)));
      }
      s = released;
    }
    if (s.ok()) {
      // The write home, counted as a reader (as a load's transfer is), so an unregister waits for
      // it; `then` gets its status on the scheduler thread.
      const auto write_home = [&e, id, home, gen](std::function<void(Status)> then) {
        e.post([&e, id, home, gen, then = std::move(then)] {
          Impl::TensorRec& t = e.tensors[id];
          if (t.generation != gen) return then(cancelled("the tensor was unregistered"));
          if (t.copies[static_cast<int>(home)].state == CopyState::kValid) return then(Status::Ok());
          ++t.readers;
          e.ensure_copy(id, home, true, kNever, [&e, id, gen, then](Status st) {
            Impl::TensorRec& t2 = e.tensors[id];
            if (t2.generation == gen) {
              if (t2.readers > 0) --t2.readers;
              e.wake_blocked(t2);
            }
            then(st);
          });
        });
      };
      if (durable) {  // the registered contents durable at home before returning
        std::promise<Status> homed;
        write_home([&homed](Status st) { homed.set_value(st); });
        s = homed.get_future().get();
      } else {  // started, not waited for (see the header)
        write_home([name = desc.name](Status st) {
          if (!st.ok()) {
            TIER_LOG(kError, "register '", name, "': writing its contents home failed (", st.to_string(),
                     "); the host copy stays the valid one and flush() writes it home again");
          }
        });
      }
    }
  }
  if (!s.ok()) {
    e.call([&] {
      Impl::TensorRec& t = e.tensors[id];
      for (Tier x : kAllTiers) e.drop_copy(t, x);
      t.live = false;
      t.writer = false;
      e.by_name.erase(desc.name);
      e.free_ids.push_back(id);
    });
    return s.with_context(str("register '", desc.name, "' on ", tier_name(home)));
  }
  return id;
}

Status Engine::retag(TensorId id, const std::string& name, Role role, int group) {
  Impl& e = *impl_;
  if (name.empty()) return invalid_argument("retag: the name is empty");
  return e.call([&]() -> Status {
    if (id >= e.tensors.size() || !e.tensors[id].live) return not_found(str("retag: no tensor with id ", id));
    Impl::TensorRec& t = e.tensors[id];
    if (t.readers > t.transfers || t.writer) {
      return failed_precondition(str("retag '", t.desc.name, "': leases are held"));
    }
    if (name != t.desc.name && e.by_name.count(name)) {
      return already_exists(str("retag '", t.desc.name, "' as '", name, "': the name is taken"));
    }
    // Its resident bytes move from one role's count to the other's.
    for (Tier x : kAllTiers) {
      const auto& c = t.copies[static_cast<int>(x)];
      if (c.buf) e.note_role_bytes(t.desc, x, -static_cast<std::int64_t>(c.buf.bytes));
    }
    e.by_name.erase(t.desc.name);
    t.desc.name = name;
    t.desc.role = role;
    t.desc.group = group;
    e.by_name[name] = id;
    for (Tier x : kAllTiers) {
      const auto& c = t.copies[static_cast<int>(x)];
      if (c.buf) e.note_role_bytes(t.desc, x, static_cast<std::int64_t>(c.buf.bytes));
    }
    return Status::Ok();
  });
}

Status Engine::unregister_tensor(TensorId id) {
  Impl& e = *impl_;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(e.cfg.tier.acquire_timeout_ms);
  auto pause = std::chrono::microseconds(100);
  for (;;) {
    bool transfers = false;
    Status s = e.call([&]() -> Status {
      if (id >= e.tensors.size() || !e.tensors[id].live) return not_found(str("unregister: no tensor with id ", id));
      Impl::TensorRec& t = e.tensors[id];
      if (t.readers > t.transfers || t.writer || !t.blocked.empty()) {
        return failed_precondition(str("unregister '", t.desc.name, "': leases are held or acquires wait"));
      }
      for (const auto& c : t.copies)
        transfers = transfers || c.pins > 0 || c.state == CopyState::kLoading || c.writing_back;
      if (transfers) {
        return failed_precondition(
            str("unregister '", t.desc.name, "': the engine's own transfers of it are in flight"));
      }
      e.forget_tensor(id);
      return Status::Ok();
    });
    // A prefetch or an eviction's write-back of an idle tensor ends on its own: wait for it.
    if (!transfers) return s;
    if (std::chrono::steady_clock::now() >= deadline) {
      return timed_out(str(s.message(), " after ", e.cfg.tier.acquire_timeout_ms, " ms"));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(5000));
  }
}

AcquireFuture Engine::acquire(TensorId id, Tier tier, Access access, bool traced) {
  auto st = std::make_shared<detail::AcquireState>();
  st->link = impl_->link;
  Impl* e = impl_.get();
  e->post([e, id, tier, access, st, traced] { e->start_acquire(id, tier, access, st, true, traced); });
  return AcquireFuture(st);
}

AcquireFuture Engine::acquire_on_stream(TensorId id, DeviceStream stream, bool traced) {
  Impl* e = impl_.get();
  if (e->be.device == nullptr || !e->be.device->has(DeviceCap::kGpuStreams)) {
    return acquire(id, Tier::kDevice, Access::kRead, traced);  // the host is the stream: wait on it
  }
  auto st = std::make_shared<detail::AcquireState>();
  st->link = e->link;
  e->post([e, id, st, traced, stream] {
    e->start_acquire(id, Tier::kDevice, Access::kRead, st, true, traced, std::optional<DeviceStream>(stream));
  });
  return AcquireFuture(st);
}

Status Engine::read(TensorId id, void* dst) {
  TIER_ASSIGN_OR_RETURN(Lease lease, acquire_now(id, Tier::kHost, Access::kRead));
  std::memcpy(dst, lease.data(), lease.bytes());
  return lease.release();
}

Status Engine::write(TensorId id, const void* src) {
  TIER_ASSIGN_OR_RETURN(Lease lease, acquire_now(id, Tier::kHost, Access::kWrite));
  std::memcpy(lease.data(), src, lease.bytes());
  return lease.release();
}

namespace {
// What keeps a reserve_host region: the lease on the tensor, then the tensor itself.
// It reaches the engine only through the engine's link, so a region that outlives its engine
// (against the documented order) ends harmlessly: the engine took its memory with it.
struct HostReservation {
  std::shared_ptr<detail::EngineLink> link;
  std::shared_ptr<std::atomic<std::uint64_t>> reserved;
  TensorId id = 0;
  std::uint64_t generation = 0;
  Lease lease;
  std::uint64_t bytes = 0;
  ~HostReservation() {
    lease.release().ignore();  // posted to the engine first, so the tensor is idle below
    reserved->fetch_sub(bytes);
    const TensorId tid = id;
    const std::uint64_t gen = generation;
    link->post([tid, gen](Engine::Impl& e) {
      if (tid >= e.tensors.size() || e.tensors[tid].generation != gen || !e.tensors[tid].live) return;
      e.forget_tensor(tid);
      for (Tier x : kAllTiers) e.serve_room_waiters(x);
    });
  }
};
}  // namespace

Result<PinnedRegion> Engine::reserve_host(const std::string& name, std::uint64_t bytes) {
  TensorDesc desc;
  desc.name = name;
  desc.dtype = DType::kU8;
  desc.numel = bytes;
  auto why = [&](const Status& s) {
    return s.with_context(str("reserving ", format_bytes(bytes), " of pinned memory for '", name,
                              "' inside tier.budgets.host (",
                              format_bytes(impl_->budget[static_cast<int>(Tier::kHost)]), ")"));
  };
  // Reserved memory is held until its region goes, never evicted: past the budget, waiting for
  // room would only end in the acquire timeout.
  // Claimed before anything is placed, in one step: two reservations made at once cannot both
  // pass the check and then wait for room the other holds.
  std::uint64_t held = impl_->reserved_host->load();
  do {
    if (held > 0 && held + bytes > impl_->budget[static_cast<int>(Tier::kHost)]) {
      return why(resource_exhausted(str("the reservations already made hold ", format_bytes(held),
                                        ", and reserved memory is not given back to make room")));
    }
  } while (!impl_->reserved_host->compare_exchange_weak(held, held + bytes));
  auto unclaim = [&] { impl_->reserved_host->fetch_sub(bytes); };
  auto id = register_tensor(desc, Tier::kHost);
  if (!id.ok()) {
    unclaim();
    return why(id.status());
  }
  auto lease = acquire_now(*id, Tier::kHost, Access::kWrite);
  if (!lease.ok()) {
    unregister_tensor(*id).ignore();
    unclaim();
    return why(lease.status());
  }
  auto keep = std::make_shared<HostReservation>();
  keep->link = impl_->link;
  keep->reserved = impl_->reserved_host;
  keep->id = *id;
  keep->generation = impl_->call([&] { return impl_->tensors[*id].generation; });
  keep->lease = std::move(lease).value();
  keep->bytes = bytes;
  PinnedRegion r;
  r.data = static_cast<std::byte*>(keep->lease.data());
  r.bytes = bytes;
  r.keep = std::move(keep);
  return r;
}

Result<Reservation> Engine::reserve_nvme(const std::string& name, std::uint64_t bytes) {
  Impl& e = *impl_;
  const int ti = static_cast<int>(Tier::kNvme);
  Status s = e.call([&]() -> Status {
    if (e.be.swap == nullptr) {  // (set exactly when the NVMe store is)
      return failed_precondition(str("reserving ", format_bytes(bytes), " of NVMe for '", name,
                                     "': the engine has no NVMe tier (set tier.swap_paths or an offload nvme_path)"));
    }
    // NVMe is the last tier: nothing is evicted from it, so the room is there now or not at all.
    if (e.used[ti] + bytes > e.budget[ti]) {
      return resource_exhausted(str("reserving ", format_bytes(bytes), " of NVMe for '", name,
                                    "' inside tier.budgets.nvme (", format_bytes(e.budget[ti]),
                                    "): ", format_bytes(e.used[ti]), " are in use (", format_bytes(e.reserved_nvme),
                                    " of them reserved); raise tier.budgets.nvme or free space on the swap paths"));
    }
    e.used[ti] += bytes;
    e.reserved_nvme += bytes;
    return Status::Ok();
  });
  TIER_RETURN_IF_ERROR(s);
  struct Keep {
    std::shared_ptr<detail::EngineLink> link;
    std::uint64_t bytes = 0;
    ~Keep() {
      const std::uint64_t n = bytes;
      link->post([n](Engine::Impl& x) {
        const int i = static_cast<int>(Tier::kNvme);
        x.used[i] -= n;
        x.reserved_nvme -= n;
        x.serve_room_waiters(Tier::kNvme);
      });
    }
  };
  auto keep = std::make_shared<Keep>();
  keep->link = e.link;
  keep->bytes = bytes;
  Reservation r;
  r.bytes = bytes;
  r.keep = std::move(keep);
  return r;
}

nvme::SwapSpace* Engine::swap_space() {
  return impl_->be.swap;
}

Status Engine::flush() {
  Impl& e = *impl_;
  struct Join {
    std::mutex mu;
    std::condition_variable cv;
    int pending = 0;
    Status first;
  };
  auto join = std::make_shared<Join>();
  e.call([&] {
    for (TensorId id = 0; id < e.tensors.size(); ++id) {
      Impl::TensorRec& t = e.tensors[id];
      if (!t.live || t.copies[static_cast<int>(t.home)].state == CopyState::kValid) continue;
      if (t.writer || !e.has_other_valid(t, t.home)) continue;  // a write lease is open: nothing to flush yet
      {
        std::lock_guard<std::mutex> lock(join->mu);
        ++join->pending;
      }
      ++t.readers;
      e.ensure_copy(id, t.home, true, kNever, [&e, join, id](Status s) {
        --e.tensors[id].readers;
        e.wake_blocked(e.tensors[id]);
        std::lock_guard<std::mutex> lock(join->mu);
        if (!s.ok() && join->first.ok()) join->first = s.with_context(str("flush '", e.tensors[id].desc.name, "'"));
        --join->pending;
        join->cv.notify_all();
      });
    }
  });
  {
    std::unique_lock<std::mutex> lock(join->mu);
    join->cv.wait(lock, [&] { return join->pending == 0; });
    if (!join->first.ok()) return join->first;
  }
  return e.be.mover->sync();
}

void Engine::begin_step() {
  Impl* e = impl_.get();
  e->post([e] {
    e->trace.begin_step();
    e->issue_prefetches();
  });
}

void Engine::end_step() {
  Impl* e = impl_.get();
  e->post([e] {
    e->trace.end_step();
    // Between steps the trace stands at its start: bring in the next step's first tensors now.
    e->issue_prefetches();
  });
}

Result<TensorId> Engine::find(std::string_view name) const {
  Impl& e = *impl_;
  return e.call([&]() -> Result<TensorId> {
    auto it = e.by_name.find(std::string(name));
    if (it == e.by_name.end()) return not_found(str("no tensor named '", name, "'"));
    return it->second;
  });
}

Result<TensorInfo> Engine::info(TensorId id) const {
  Impl& e = *impl_;
  return e.call([&]() -> Result<TensorInfo> {
    if (id >= e.tensors.size() || !e.tensors[id].live) return not_found(str("no tensor with id ", id));
    const Impl::TensorRec& t = e.tensors[id];
    TensorInfo info;
    info.desc = t.desc;
    info.home = t.home;
    const bool home_valid = t.copies[static_cast<int>(t.home)].state == CopyState::kValid;
    for (Tier x : kAllTiers)
      info.copy_state[static_cast<int>(x)] = copy_state_name(t.copies[static_cast<int>(x)], home_valid);
    info.readers = t.readers;
    info.writer = t.writer;
    return info;
  });
}

std::size_t Engine::tensor_count() const {
  Impl& e = *impl_;
  return e.call([&] { return e.by_name.size(); });
}

StatsSnapshot Engine::stats() const {
  Impl& e = *impl_;
  e.call([&] {
    auto& c = *e.counters;
    c.set_metric("engine.tensors", static_cast<double>(e.by_name.size()));
    c.set_metric("engine.acquires", static_cast<double>(e.m_acquires));
    c.set_metric("engine.acquire_hits", static_cast<double>(e.m_hits));
    c.set_metric("engine.room_waits", static_cast<double>(e.m_room_waits));
    c.set_metric("engine.writebacks", static_cast<double>(e.m_writebacks));
    for (Tier x : kAllTiers) {
      c.set_metric(str("engine.evictions.", tier_name(x)), static_cast<double>(e.m_evictions[static_cast<int>(x)]));
    }
    c.set_metric("prefetch.issued", static_cast<double>(e.m_prefetches));
    c.set_metric("prefetch.hits", static_cast<double>(e.m_prefetch_hits));
    c.set_metric("prefetch.late", static_cast<double>(e.m_late_prefetch));
    c.set_metric("prefetch.dropped_unused", static_cast<double>(e.m_prefetch_dropped_unused));
    c.set_metric("prefetch.trace_length", static_cast<double>(e.trace.entries().size()));
    c.set_metric("prefetch.order_changes", static_cast<double>(e.trace.order_changes()));
    c.set_metric("prefetch.inflight_bytes", static_cast<double>(e.prefetch_inflight_bytes));
    for (Tier x : kAllTiers) {
      const int ti = static_cast<int>(x);
      c.set_metric(str("activations.", tier_name(x), ".resident_bytes"), static_cast<double>(e.activation_used[ti]));
      c.set_metric(str("activations.", tier_name(x), ".peak_bytes"), static_cast<double>(e.activation_peak[ti]));
    }
  });
  {
    std::lock_guard<std::mutex> lock(e.stall_mu);
    e.counters->set_metric("engine.stalls", static_cast<double>(e.m_stalls));
    e.counters->set_metric("engine.stall_seconds", e.m_stall_seconds);
  }
  StatsSnapshot s = e.counters->snapshot();
  if (e.be.host_pinning) e.be.host_pinning(s.tiers[static_cast<int>(Tier::kHost)]);
  const double moved = s.link(Link::kNvmeToHost).busy_seconds + s.link(Link::kHostToDevice).busy_seconds;
  s.metrics["prefetch.overlap"] =
      moved > 0 ? std::clamp(1.0 - s.metrics["engine.stall_seconds"] / moved, 0.0, 1.0) : 1.0;
  return s;
}

Status Engine::check_invariants() const {
  Impl& e = *impl_;
  return e.call([&] {
    if (!e.first_violation.ok()) return e.first_violation;
    return e.check_invariants_locked();
  });
}

namespace detail {
// The one way to build an Engine around its state machine (its constructor is private).
struct EngineFactory {
  static std::unique_ptr<Engine> make(std::unique_ptr<Engine::Impl> impl) {
    return std::unique_ptr<Engine>(new Engine(std::move(impl)));
  }
};

Result<std::unique_ptr<Engine>> make_engine(const EngineConfig& config, Backends backends,
                                            std::shared_ptr<Counters> counters) {
  TIER_RETURN_IF_ERROR(config.validate());
  if (!backends.mover) return invalid_argument("engine: no mover");
  if (!backends.stores[static_cast<int>(Tier::kHost)]) {
    return invalid_argument("engine: the host tier is required (every copy between NVMe and the device stages there)");
  }
  if (!counters) counters = std::make_shared<Counters>();
  return EngineFactory::make(std::make_unique<Engine::Impl>(config, std::move(backends), std::move(counters)));
}
}  // namespace detail

Device& Engine::device() {
  return *impl_->be.device;
}
HostArena& Engine::host_arena() {
  return *impl_->be.arena;
}
Counters& Engine::counters() {
  return *impl_->counters;
}
const EngineConfig& Engine::config() const {
  return impl_->cfg;
}

}  // namespace tier
