// Internal: the engine's state machine. Everything here runs on the scheduler thread, except the
// small shared states of futures and leases, which have their own locks.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/backend.hpp"
#include "prefetch/eviction.hpp"
#include "prefetch/scheduler.hpp"
#include "tier/engine.hpp"

namespace tier::detail {

using Clock = std::chrono::steady_clock;

// What leases and acquire futures hold of the engine: it outlives the engine, which detaches it
// when it starts to go away. Posting through it after that does nothing, so a lease released (or
// an acquire given up) after the Engine was destroyed is a no-op instead of a use-after-free.
struct EngineLink {
  std::mutex mu;
  tier::Engine::Impl* engine = nullptr;  // null once detached
  // Runs fn(engine) under the link's lock while the engine is attached; false when it is not.
  template <class F>
  bool with(F&& fn) {
    std::lock_guard<std::mutex> lock(mu);
    if (engine == nullptr) return false;
    fn(*engine);
    return true;
  }
  // Queues fn(engine) on the scheduler thread while the engine is attached; false when it is not.
  bool post(std::function<void(tier::Engine::Impl&)> fn);
};

struct AcquireState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool taken = false;
  bool cancelled = false;
  // Set on the scheduler thread when it learns of the cancel (a state transition of the acquire:
  // from then on no room request of it may stay queued; check_invariants_locked checks it).
  bool given_up = false;
  Status status;
  std::shared_ptr<LeaseState> lease;
  std::shared_ptr<EngineLink> link;
  // The last reference gone (the future dropped unwaited, before or after the grant) with a lease
  // nobody took: it ends unused. A write lease is abandoned, so the reserved copy, which holds no
  // data, is never published as the tensor's contents.
  ~AcquireState();
};

struct LeaseState {
  std::shared_ptr<EngineLink> link;
  TensorId tensor = kInvalidTensor;
  Tier tier = Tier::kHost;
  Access access = Access::kRead;
  void* data = nullptr;
  std::uint64_t bytes = 0;
  DType dtype = DType::kF32;
  std::uint64_t generation = 0;  // the tensor registration it belongs to
  std::string name;              // the tensor's name, kept only while tracing (a stall span names it)
  std::atomic<bool> released{false};
  // Ends the lease once (from Lease::release, the Lease's destructor, or an abandoned future).
  // `abandon`: a write lease ends without publishing its copy (nothing was written).
  void end(bool abandon = false) noexcept;
  ~LeaseState() { end(); }
};

inline AcquireState::~AcquireState() {
  if (lease) lease->end(/*abandon=*/true);
}

}  // namespace tier::detail

namespace tier {

struct Engine::Impl {
  using Clock = detail::Clock;
  static constexpr std::chrono::milliseconds kWritebackRetry{200};
  enum class CopyState : std::uint8_t { kAbsent, kReserved, kLoading, kValid, kStale };
  static constexpr std::uint64_t kNoMark = ~std::uint64_t{0};
  static constexpr std::uint32_t kNotCached = ~std::uint32_t{0};

  struct Copy {
    CopyState state = CopyState::kAbsent;
    detail::Buffer buf;
    std::uint32_t pins = 0;     // leases and transfers using this copy
    bool writing_back = false;  // being copied one tier toward home for an eviction
    bool prefetched = false;    // loaded by the prefetcher and not used yet
    // trace.advances() when a prefetched copy was last dropped unused (kNoMark: never); while the
    // trace has not moved on since, the tensor is not prefetched to this tier again.
    std::uint64_t dropped_unused_at = kNoMark;
    std::uint64_t last_use = 0;  // LRU clock
    // This copy's place in `cached` of its tier (kNotCached: not there).
    std::uint32_t cached_pos = kNotCached;
    Clock::time_point retry_writeback_after{};  // after a failed write-back, wait before the next
    std::vector<detail::Done> on_ready;         // waiters for a load in flight
    // A load to the device whose copy is queued: its event (empty until then, and once the load
    // ends). Stream-ordered acquires are granted on it: their stream waits for the event, not the
    // host (Engine::acquire_on_stream).
    DeviceEvent queued;
    // Stream-ordered acquires waiting for the load's copy to be queued (or for the load to end,
    // when the mover gives no event).
    std::vector<detail::Done> on_queued;
    // Who a load in flight is for, while it waits for room: the acquires among its waiters, and
    // how many waiters no acquire owns (a flush, a write-back, a registration; a prefetch is not
    // counted). Once every one of them is a given-up acquire, the load stops waiting (and lets go
    // of its source copy, which a flush may need room for).
    std::vector<std::shared_ptr<detail::AcquireState>> wanted_by;
    std::uint32_t wanted_unowned = 0;
    // The load ended (done, failed or dropped): nobody waits for it any more.
    void forget_wanted() {
      wanted_by.clear();
      wanted_unowned = 0;
    }
  };

  struct Pending;  // an acquire waiting for a reader/writer conflict to clear

  struct TensorRec {
    TensorDesc desc;
    Tier home = Tier::kHost;
    bool live = false;
    bool zero_home = false;  // the home copy reads as zeros without I/O
    std::uint64_t generation = 0;
    std::array<Copy, kNumTiers> copies;
    std::uint32_t readers = 0;    // read leases + internal transfers reading this tensor
    std::uint32_t transfers = 0;  // of which internal transfers (a load's source)
    bool writer = false;
    struct Blocked {
      std::shared_ptr<detail::AcquireState> acquire;
      std::function<void()> retry;
    };
    std::deque<Blocked> blocked;  // acquires waiting for the lock
  };

  struct RoomRequest {
    Tier tier;
    std::uint64_t bytes;
    TensorId for_tensor;
    Clock::time_point deadline;
    std::function<void(Status, detail::Buffer)> done;
    // The one acquire this room is for (a writer's reservation), or null when the room serves a
    // copy that others may wait on too. A given-up owner takes its request out of the queue.
    std::shared_ptr<detail::AcquireState> owner;
    // For a load's room: the copy being loaded (`for_tensor` on `tier`, of that generation), whose
    // wanted_by / wanted_unowned say whether anyone still waits for it.
    bool for_load = false;
    std::uint64_t generation = 0;
  };

  Impl(const EngineConfig& config, detail::Backends backends, std::shared_ptr<Counters> counters);
  ~Impl();

  // ---- scheduler thread plumbing
  void post(std::function<void()> fn);
  template <class F>
  auto call(F&& fn) -> decltype(fn());  // runs fn on the scheduler thread and waits for its result
  void run();
  void after_event();

  // ---- state machine (scheduler thread only)
  // `first`: the acquire's first attempt (a retry after a lock conflict is not counted again);
  // `traced`: recorded in / matched against the access trace (Engine::acquire).
  // `order`: a stream-ordered device read (Engine::acquire_on_stream) for that consumer stream.
  void start_acquire(TensorId id, Tier tier, Access access, std::shared_ptr<detail::AcquireState> st, bool first,
                     bool traced, std::optional<DeviceStream> order = std::nullopt);
  void grant(TensorId id, Tier tier, Access access, std::shared_ptr<detail::AcquireState> st);
  // `horizon`: kNever for a demand (may wait for room, may write back); for a prefetch, the trace
  // distance of its target (only copies used later than that may be evicted, nothing waits).
  // `staging`: the copy is an intermediate hop of a longer move (NVMe -> host on the way to the
  // device); a prefetch counts only its final hop against max_inflight_bytes.
  // `owner`: the acquire a writer's reservation is for (see RoomRequest::owner).
  // `queued`: `done` may run as soon as the final hop's device copy is queued (Copy::queued), not
  // once it is done (stream-ordered acquires).
  void ensure_copy(TensorId id, Tier tier, bool need_data, std::size_t horizon, detail::Done done, bool staging = false,
                   std::shared_ptr<detail::AcquireState> owner = nullptr, bool queued = false);
  void load_from(TensorId id, Tier to, Tier from, std::size_t horizon, detail::Done done, bool staging = false,
                 std::shared_ptr<detail::AcquireState> owner = nullptr, bool queued = false);
  // Adds `done` to the waiters of the load in flight of `c`: run now when its copy is queued and
  // the waiter only needs that (`queued`), else when it is queued or done as asked.
  static void wait_for_load(Copy& c, detail::Done done, bool queued);
  // Records who waits for the load of `c` (see Copy::wanted_by); a prefetch (horizon set) does not count.
  static void want(Copy& c, std::size_t horizon, const std::shared_ptr<detail::AcquireState>& owner);
  // `for_load`: the room is for the load of `for_tensor` on `tier` (see RoomRequest::for_load).
  void make_room(Tier tier, std::uint64_t bytes, TensorId for_tensor, std::size_t horizon,
                 std::function<void(Status, detail::Buffer)> done,
                 std::shared_ptr<detail::AcquireState> owner = nullptr, bool for_load = false, bool for_home = false);
  // A queued room request nobody waits for any more: its acquire, or every acquire waiting for
  // its load, was given up.
  bool abandoned(const RoomRequest& r) const;
  bool try_place(Tier tier, std::uint64_t bytes, TensorId for_tensor, std::size_t horizon, detail::Buffer* out,
                 Status* fatal);
  // Gives room to the queued requests that now fit (and ends given-up and failed ones). Callbacks
  // run only after the queue was walked, and a call made from inside one (a release, a failed
  // load) is folded into the walk already running: no callback ever sees a list mid-iteration.
  void serve_room_waiters(Tier tier);
  // The scheduler's side of AcquireFuture::cancel.
  void give_up(const std::shared_ptr<detail::AcquireState>& st);
  void drop_copy(TensorRec& t, Tier tier);
  // A copy on `tier` that is not the tensor's home copy got its buffer: it is an eviction
  // candidate of that tier from now until drop_copy.
  void note_cached(TensorId id, Tier tier);
  // Drops every copy of an idle tensor and frees its id and name (the access trace is forgotten
  // only if it holds the tensor: the id may name another tensor later).
  void forget_tensor(TensorId id);
  void start_writeback(TensorId id, Tier from);
  void on_release(TensorId id, Tier tier, Access access, std::uint64_t generation, bool abandon = false);
  void complete_load(TensorId id, Tier to, Tier from, std::uint64_t gen, int counted, Status s);
  void wake_blocked(TensorRec& t);
  void issue_prefetches();
  void expire_waiters();
  bool has_other_valid(const TensorRec& t, Tier except) const;
  // Whether a copy between `tier` and the tensor's home tier, or the home itself, is valid: then
  // `tier`'s copy can be dropped without writing it back.
  bool backed_toward_home(const TensorRec& t, Tier tier) const;
  Tier toward_home(Tier from, Tier home) const;
  Status check_invariants_locked() const;
  void note_resident(Tier tier, std::int64_t delta);
  void fail_everything(const Status& why);

  // ---- configuration and backends
  EngineConfig cfg;
  // Declared before the backends: their worker threads report into it until they are joined.
  std::shared_ptr<Counters> counters;
  detail::Backends be;
  std::array<std::uint64_t, kNumTiers> budget{};
  std::array<std::uint64_t, kNumTiers> used{};
  // Of `used`, what tensors of Role::kActivation hold, and its peak (the activations.* metrics).
  std::array<std::uint64_t, kNumTiers> activation_used{}, activation_peak{};
  void note_role_bytes(const TensorDesc& d, Tier tier, std::int64_t delta);
  std::array<std::uint64_t, kNumTiers> freeing{};  // bytes of write-backs in flight per tier
  // Bytes held by Engine::reserve_host regions (any thread; never evicted until released).
  // Bytes held by reserve_host regions; shared with them, which give their bytes back at once when
  // they go (their tensors are dropped on this thread after).
  std::shared_ptr<std::atomic<std::uint64_t>> reserved_host = std::make_shared<std::atomic<std::uint64_t>>(0);
  // Of used[NVMe], what reserve_nvme reservations hold (no copy stands for them; scheduler thread).
  std::uint64_t reserved_nvme = 0;

  // ---- state
  std::vector<TensorRec> tensors;
  // Per tier, the tensors holding a copy there that is not their home copy: what try_place looks
  // at for victims, so that placing costs what the tier holds, not what the engine has registered.
  std::array<std::vector<TensorId>, kNumTiers> cached;
  std::unordered_map<std::string, TensorId> by_name;
  std::vector<TensorId> free_ids;
  std::array<std::list<RoomRequest>, kNumTiers> room_waiters;
  bool shutting_down = false;   // set by fail_everything: new acquires fail at once with
  Status shutdown_status;       // this
  bool serving_rooms = false;   // serve_room_waiters is running (further calls only mark tiers)
  unsigned rooms_to_serve = 0;  // tiers (bit per tier) to walk again before it returns
  AccessTrace trace;
  // The policies (src/prefetch): what to evict first, and what to prefetch next from the trace.
  prefetch::EvictionPolicy eviction{
      trace, [this](TensorId id) -> std::uint64_t { return id < tensors.size() ? tensors[id].desc.bytes() : 0; }};
  prefetch::PrefetchScheduler scheduler;
  std::uint64_t clock = 0;
  std::uint64_t generation = 0;
  std::uint64_t prefetch_inflight_bytes = 0;
  std::uint64_t staging_inflight_bytes = 0;
  std::uint64_t moves_in_flight = 0;  // transfers started and not yet completed
  bool prefetch_blocked = false;      // set when a prefetch found no room (stops the current window)
  Status first_violation;             // with tier.debug_checks: the first invariant that failed
  Status last_writeback_error;

  // ---- metrics (scheduler thread) and stall accounting (any thread)
  std::uint64_t m_acquires = 0, m_hits = 0, m_late_prefetch = 0, m_prefetch_hits = 0, m_prefetches = 0,
                m_prefetch_dropped_unused = 0, m_writebacks = 0, m_room_waits = 0;
  std::array<std::uint64_t, kNumTiers> m_evictions{};
  std::mutex stall_mu;
  std::uint64_t m_stalls = 0;
  double m_stall_seconds = 0;

  // ---- thread
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  bool stopping = false;
  std::thread worker;
  std::atomic<std::thread::id> worker_id{};
  std::shared_ptr<detail::EngineLink> link = std::make_shared<detail::EngineLink>();
};

}  // namespace tier
