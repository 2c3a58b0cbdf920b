// The swap space: files, extent allocation and the I/O threads that move extents.
//
// A transfer (Op) waits in one FIFO shared by all I/O threads. Each thread owns an engine and
// `queue_depth` request slots; whenever slots are free it cuts the next requests off the transfer
// at the head of the FIFO (at most block_size bytes, never across a stripe boundary), submits them
// as one batch, and reaps completions. A completion either finishes its request, resubmits the
// rest (short transfer, EAGAIN/EINTR), or fails the transfer; the transfer's future completes when
// it has no request left in flight and nothing left to cut.
#include "tier/ext/swap_space.hpp"

#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "nvme/extent_allocator.hpp"
#include "nvme/io_op_state.hpp"
#include "nvme/swap_file.hpp"
#include "tier/ext/host_arena.hpp"
#include "tier/log.hpp"
#include "tier/stats.hpp"
#include "tier/units.hpp"

namespace tier::nvme {

namespace {

constexpr std::uint64_t kGranule = 4096;
// A swap file that grows does so in steps of this many bytes (fewer fallocate calls, longer runs
// on disk), never past its capacity.
constexpr std::uint64_t kGrowStep = 32ull << 20;
// The auto cap of a path whose file system reports no space (ramfs): fallocate decides.
constexpr std::uint64_t kAutoCapUnaccounted = 64ull << 30;
constexpr unsigned kMaxRetries = 64;

std::uint64_t round_up(std::uint64_t v, std::uint64_t a) {
  return (v + a - 1) / a * a;
}

struct AlignedFree {
  void operator()(std::byte* p) const noexcept { std::free(p); }
};

}  // namespace

struct SwapSpace::Impl {
  struct Piece {
    unsigned path = 0;
    std::uint64_t offset = 0;  // in the path's file
    std::uint64_t length = 0;
  };

  struct ExtentRec {
    std::uint64_t bytes = 0;
    std::uint64_t reserved = 0;
    std::vector<Piece> pieces;  // piece i holds stripes i, i + n, i + 2n, ... (n = pieces.size())
    unsigned ops = 0;           // transfers not yet finished
    bool freed = false;         // released by its handle; reclaimed when ops reaches 0
  };

  struct Op {
    std::shared_ptr<detail::IoOpState> state;
    IoOp kind = IoOp::kRead;
    std::uint64_t extent_id = 0;
    std::vector<Piece> pieces;
    std::byte* buf = nullptr;
    std::uint64_t bytes = 0;
    std::uint64_t offset = 0;  // in the extent
    bool bounce_all = false;   // the buffer is misaligned: every request goes through a bounce buffer
    Counters::Transfer xfer;
    // Guarded by Impl::mu.
    std::uint64_t cursor = 0;  // bytes of the transfer already cut into requests
    unsigned chunks_out = 0;   // requests cut and not finished
    bool queued = true;        // still in the FIFO
    bool failed = false;
    bool cancelled = false;
    Status error;
  };

  struct Slot {
    std::shared_ptr<Op> op;
    unsigned path = 0;
    std::uint64_t file_offset = 0;
    std::uint64_t length = 0;    // bytes the kernel moves (a bounced tail is padded)
    std::uint64_t user_len = 0;  // bytes of the caller's buffer covered
    std::byte* user = nullptr;
    std::byte* io = nullptr;  // the caller's buffer or the bounce buffer
    std::uint64_t done = 0;
    unsigned retries = 0;
    bool bounced = false;
    std::unique_ptr<std::byte, AlignedFree> bounce;  // block_size bytes, allocated on first use
  };

  struct Worker {
    std::unique_ptr<IoEngine> engine;
    std::vector<int> file_index;  // per path: the engine's slot, or -1 to pass the descriptor
    std::vector<Slot> slots;
    std::vector<unsigned> free_slots;
    std::vector<unsigned> resubmit;
    unsigned busy = 0;
    bool waiting = false;  // blocked in reap with free slots; guarded by mu
    // Of arena_ranges, how many this engine has been given (guarded by mu), and those taken but
    // not registered yet (this thread only).
    std::size_t ranges_taken = 0;
    std::vector<std::pair<std::byte*, std::uint64_t>> ranges_to_register;
    std::thread thread;
  };

  explicit Impl(const SwapSpaceOptions& o) : opt(o) {}

  const SwapSpaceOptions& opt;
  std::vector<detail::SwapFile> files;
  std::vector<detail::ExtentAllocator> allocs;
  // Per path: the bytes of its file reserved on disk so far (fallocate). Extents lie below it;
  // without preallocation it grows as extents are allocated, up to the allocator's capacity.
  std::vector<std::uint64_t> committed;
  std::uint64_t unit = 0;
  std::uint64_t threshold = 0;
  bool direct = false;
  std::uint64_t mem_align = 1;
  std::uint64_t size_align = 1;
  std::uint64_t resume_align = 1;  // a short transfer resumes at a multiple of this
  std::vector<std::unique_ptr<Worker>> workers;
  std::string engine_name;
  std::uint32_t engine_caps = 0;
  bool fixed_registered = false;
  // A lazy arena: its extents as they are committed (guarded by mu); each I/O thread registers
  // them with its own engine before its next submission (an io_uring ring is single-issuer).
  std::vector<std::pair<std::byte*, std::uint64_t>> arena_ranges;
  std::uint64_t arena_listener = 0;  // the arena's commit listener id, 0: none

  std::mutex mu;
  std::condition_variable work_cv;
  std::deque<std::shared_ptr<Op>> pending;
  std::unordered_map<std::uint64_t, ExtentRec> extents;
  std::uint64_t next_id = 1;
  bool stop = false;
  std::uint64_t used = 0;
  std::uint64_t peak = 0;
  std::uint64_t striped = 0;

  std::atomic<std::uint64_t> bytes_read{0}, bytes_written{0}, reads{0}, writes{0}, failed{0}, requests{0}, retries{0},
      shorts{0}, bounced{0};

  // ------------------------------------------------------------------ allocation (under mu)

  void publish_metrics_locked() {
    if (!opt.counters) return;
    std::uint64_t free_bytes = 0, largest = 0;
    for (const auto& a : allocs) {
      free_bytes += a.free_bytes();
      largest = std::max(largest, a.largest_free());
    }
    std::uint64_t allocated = 0;
    for (std::uint64_t c : committed) allocated += c;
    opt.counters->set_metric(opt.metrics_prefix + ".used_bytes", static_cast<double>(used));
    opt.counters->set_metric(opt.metrics_prefix + ".allocated_bytes", static_cast<double>(allocated));
    opt.counters->set_metric(opt.metrics_prefix + ".live_extents", static_cast<double>(extents.size()));
    opt.counters->set_metric(opt.metrics_prefix + ".fragmentation",
                             free_bytes ? 1.0 - static_cast<double>(largest) / static_cast<double>(free_bytes) : 0.0);
  }

  void release_locked(std::unordered_map<std::uint64_t, ExtentRec>::iterator it) {
    for (const Piece& p : it->second.pieces) allocs[p.path].release(p.offset, p.length);
    used -= it->second.reserved;
    if (it->second.pieces.size() > 1) --striped;
    extents.erase(it);
    publish_metrics_locked();
  }

  // Pieces of a striped extent over all paths, or empty when some path lacks the room.
  std::vector<Piece> try_striped(std::uint64_t reserved) {
    const std::uint64_t stripes = (reserved + unit - 1) / unit;
    const unsigned n = static_cast<unsigned>(std::min<std::uint64_t>(stripes, files.size()));
    std::vector<std::uint64_t> len(n, 0);
    for (std::uint64_t s = 0; s < stripes; ++s) len[s % n] += std::min(unit, reserved - s * unit);
    std::vector<Piece> pieces;
    // Start on the paths with the most free space so that repeated stripes spread evenly.
    std::vector<unsigned> order(files.size());
    for (unsigned i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](unsigned a, unsigned b) { return allocs[a].free_bytes() > allocs[b].free_bytes(); });
    for (unsigned i = 0; i < n; ++i) {
      auto off = allocs[order[i]].allocate(len[i]);
      if (!off) {
        for (const Piece& p : pieces) allocs[p.path].release(p.offset, p.length);
        return {};
      }
      pieces.push_back({order[i], *off, len[i]});
    }
    return pieces;
  }

  std::vector<Piece> try_single(std::uint64_t reserved) {
    int best = -1;
    for (unsigned i = 0; i < allocs.size(); ++i) {
      if (allocs[i].largest_free() < reserved) continue;
      if (best < 0 || allocs[i].free_bytes() > allocs[static_cast<unsigned>(best)].free_bytes()) {
        best = static_cast<int>(i);
      }
    }
    if (best < 0) return {};
    auto off = allocs[static_cast<unsigned>(best)].allocate(reserved);
    if (!off) return {};
    return {Piece{static_cast<unsigned>(best), *off, reserved}};
  }

  // Makes path `p`'s file hold [0, end) on disk: a swap file that grows takes what its extents
  // need, in kGrowStep steps (up to its capacity), so a small model costs megabytes. A file system
  // without fallocate grows the file sparse (one log line); a full one gives kNoSpace with the
  // bytes asked for and free, and nothing changes.
  Status grow_locked(unsigned p, std::uint64_t end) {
    if (end <= committed[p]) return Status::Ok();
    detail::SwapFile& f = files[p];
    const std::uint64_t cap = allocs[p].capacity();
    const std::uint64_t stepped = std::min(cap, round_up(end, kGrowStep));
    Status s = f.file->allocate(committed[p], stepped - committed[p]);
    std::uint64_t target = stepped;
    if (!s.ok() && (s.sys_errno() == ENOSPC || s.sys_errno() == EDQUOT) && stepped > end) {
      target = end;  // the step does not fit: the bytes asked for may
      s = f.file->allocate(committed[p], end - committed[p]);
    }
    if (!s.ok() && s.sys_errno() == EOPNOTSUPP) {
      s = f.file->truncate(target);
      if (s.ok()) {
        log_once(str("nvme.no_fallocate.", f.dir), LogLevel::kWarn,
                 str("swap path ", f.dir, ": ", f.fs,
                     " cannot preallocate; the swap file is sparse, so a full disk shows only when a write fails"));
      }
    }
    if (!s.ok()) {
      const int err = s.sys_errno();
      if (err == ENOSPC || err == EDQUOT) {
        std::string free_text = "no";
        struct statvfs vfs {};
        if (fstatvfs(f.dir_file->fd(), &vfs) == 0) {
          free_text = format_bytes(static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize);
        }
        return Status(StatusCode::kNoSpace,
                      str("swap path ", f.dir, ": its swap file cannot grow from ", format_bytes(committed[p]), " to ",
                          format_bytes(end), " (", end - committed[p], " more bytes): ", free_text, " free on ", f.fs,
                          "; free space, offload less to NVMe or add another path"),
                      err);
      }
      return s.with_context(str("swap file ", f.path, ": growing it to ", format_bytes(target)));
    }
    committed[p] = target;
    return Status::Ok();
  }

  // ------------------------------------------------------------------ I/O threads

  IoRequest request_for(Worker& w, unsigned tag) const {
    const Slot& s = w.slots[tag];
    IoRequest r;
    r.op = s.op->kind;
    r.fd = files[s.path].fd;
    r.file_index = w.file_index[s.path];
    r.offset = s.file_offset + s.done;
    r.length = static_cast<std::uint32_t>(s.length - s.done);
    r.buffer = s.io + s.done;
    r.tag = tag;
    return r;
  }

  // Cuts requests off the head of the FIFO into free slots. Under mu.
  void pull_locked(Worker& w, std::vector<unsigned>& fresh, std::vector<std::shared_ptr<Op>>& finished) {
    while (!pending.empty()) {
      const std::shared_ptr<Op>& op = pending.front();
      if (!op->failed && !op->cancelled && (op->state->cancel_requested() || stop)) op->cancelled = true;
      if (op->failed || op->cancelled || op->cursor >= op->bytes) {
        op->queued = false;
        if (op->chunks_out == 0) finished.push_back(op);
        pending.pop_front();
        continue;
      }
      if (w.free_slots.empty()) return;
      const unsigned tag = w.free_slots.back();
      w.free_slots.pop_back();
      Slot& s = w.slots[tag];
      const std::uint64_t logical = op->offset + op->cursor;
      std::uint64_t room = op->bytes - op->cursor;
      const Piece* piece = &op->pieces[0];
      std::uint64_t file_offset = piece->offset + logical;
      if (op->pieces.size() > 1) {
        const std::uint64_t n = op->pieces.size();
        const std::uint64_t stripe = logical / unit;
        const std::uint64_t within = logical % unit;
        piece = &op->pieces[stripe % n];
        file_offset = piece->offset + (stripe / n) * unit + within;
        room = std::min(room, unit - within);
      }
      const std::uint64_t len = std::min(room, opt.block_size);
      s.op = op;
      s.path = piece->path;
      s.file_offset = file_offset;
      s.user = op->buf + op->cursor;
      s.user_len = len;
      s.bounced = op->bounce_all || (direct && len % size_align != 0);
      s.length = s.bounced && direct ? round_up(len, size_align) : len;
      s.io = s.user;
      s.done = 0;
      s.retries = 0;
      op->cursor += len;
      ++op->chunks_out;
      fresh.push_back(tag);
      if (op->cursor >= op->bytes) {
        op->queued = false;
        pending.pop_front();
      }
    }
  }

  // Points a fresh slot at its bounce buffer and fills it for a write. Outside mu.
  bool prepare(Slot& s) {
    if (!s.bounced) return true;
    if (!s.bounce) {
      const std::uint64_t align = std::max<std::uint64_t>(kGranule, mem_align);
      s.bounce.reset(static_cast<std::byte*>(std::aligned_alloc(align, round_up(opt.block_size, align))));
      if (!s.bounce) return false;
    }
    s.io = s.bounce.get();
    if (s.op->kind == IoOp::kWrite) {
      std::memcpy(s.io, s.user, s.user_len);
      if (s.length > s.user_len) std::memset(s.io + s.user_len, 0, s.length - s.user_len);
    }
    return true;
  }

  void finish_chunk(Worker& w, unsigned tag, Status err, std::vector<std::shared_ptr<Op>>& finished) {
    Slot& s = w.slots[tag];
    if (err.ok() && s.bounced && s.op->kind == IoOp::kRead) std::memcpy(s.user, s.io, s.user_len);
    {
      std::lock_guard<std::mutex> lk(mu);
      Op& op = *s.op;
      --op.chunks_out;
      if (!err.ok() && !op.failed) {
        if (err.code() == StatusCode::kCancelled) {
          op.cancelled = true;
        } else {
          op.failed = true;
          op.error = std::move(err);
        }
      }
      if (!op.queued && op.chunks_out == 0) finished.push_back(s.op);
    }
    s.op.reset();
    w.free_slots.push_back(tag);
    --w.busy;
  }

  void on_completion(Worker& w, const IoCompletion& c, std::vector<std::shared_ptr<Op>>& finished) {
    const unsigned tag = static_cast<unsigned>(c.tag);
    Slot& s = w.slots[tag];
    const std::uint64_t want = s.length - s.done;
    const std::uint64_t at = s.file_offset + s.done;
    const std::string& path = files[s.path].path;
    Status err;
    if (c.result > 0) {
      const std::uint64_t before = s.done;
      s.done += std::min<std::uint64_t>(static_cast<std::uint64_t>(c.result), want);
      if (s.done >= s.length) {
        finish_chunk(w, tag, Status::Ok(), finished);
        return;
      }
      // O_DIRECT resumes at an aligned position; the bytes in between are moved again.
      s.done = s.done / resume_align * resume_align;
      ++shorts;
      if (s.done > before || ++s.retries <= kMaxRetries) {
        w.resubmit.push_back(tag);
        return;
      }
      err = Status(StatusCode::kIoError,
                   str("swap file ", path, ": ", io_op_name(s.op->kind), " at offset ", at,
                       " keeps coming back short of an aligned position (", c.result, " of ", want, " bytes)"),
                   EIO);
    } else if (c.result == 0) {
      err = s.op->kind == IoOp::kRead
                ? Status(StatusCode::kDataLoss,
                         str("swap file ", path, ": read at offset ", at, " found the end of the file with ", want,
                             " bytes still to read; the file was truncated by someone else"),
                         EIO)
                : Status(StatusCode::kIoError,
                         str("swap file ", path, ": write at offset ", at, " wrote nothing (", want, " bytes asked)"),
                         EIO);
    } else {
      const int e = static_cast<int>(-c.result);
      if ((e == EAGAIN || e == EINTR) && s.retries < kMaxRetries) {
        ++s.retries;
        ++retries;
        if (s.retries > 8) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        w.resubmit.push_back(tag);
        return;
      }
      if (e == ECANCELED) {
        err = cancelled(str("swap ", io_op_name(s.op->kind), " cancelled"));
      } else {
        err = errno_status(
            e, str("swap file ", path, ": ", io_op_name(s.op->kind), " of ", want, " bytes at offset ", at, " failed"));
      }
    }
    finish_chunk(w, tag, std::move(err), finished);
  }

  void complete_op(Op& op) {
    Status st;
    if (op.failed) {
      st = op.error.with_context(str("swap ", io_op_name(op.kind), " of extent #", op.extent_id, " (",
                                     format_bytes(op.bytes), " at offset ", op.offset, ")"));
    } else if (op.cancelled) {
      st = cancelled(str("swap ", io_op_name(op.kind), " of extent #", op.extent_id, " was cancelled"));
    }
    {
      std::lock_guard<std::mutex> lk(mu);
      auto it = extents.find(op.extent_id);
      if (it != extents.end() && --it->second.ops == 0 && it->second.freed) release_locked(it);
    }
    if (st.ok()) {
      (op.kind == IoOp::kRead ? bytes_read : bytes_written) += op.bytes;
      ++(op.kind == IoOp::kRead ? reads : writes);
    } else {
      ++failed;
    }
    op.xfer.finish(st.ok() ? op.bytes : 0, st.ok());
    op.state->complete(std::move(st));
  }

  // Submits the batch; `sent` says how many requests the engine took, also on error.
  Status submit_batch(Worker& w, std::vector<IoRequest>& batch, std::size_t& sent) {
    sent = 0;
    while (sent < batch.size()) {
      const std::size_t n = opt.single_submit ? 1 : batch.size() - sent;
      auto taken = w.engine->submit(batch.data() + sent, n);
      if (!taken.ok()) return taken.status();
      if (*taken == 0) return internal_error("swap space: the I/O engine took no request below its queue depth");
      sent += *taken;
    }
    return Status::Ok();
  }

  void run(Worker& w) {
    std::vector<IoRequest> batch;
    std::vector<IoCompletion> cqes(w.slots.size());
    std::vector<unsigned> fresh;
    std::vector<std::shared_ptr<Op>> finished;
    for (;;) {
      fresh.clear();
      bool exit_now = false;
      {
        std::unique_lock<std::mutex> lk(mu);
        for (;;) {
          pull_locked(w, fresh, finished);
          if (w.busy > 0 || !fresh.empty() || !w.resubmit.empty() || !finished.empty()) break;
          if (stop) {
            exit_now = true;
            break;
          }
          work_cv.wait(lk);
        }
        // Taken with the requests: an extent committed before a transfer through it was enqueued
        // is registered before that transfer is submitted.
        for (; w.ranges_taken < arena_ranges.size(); ++w.ranges_taken) {
          w.ranges_to_register.push_back(arena_ranges[w.ranges_taken]);
        }
      }
      for (auto& op : finished) complete_op(*op);
      finished.clear();
      if (exit_now) return;
      for (const auto& [p, n] : w.ranges_to_register) {
        // A range left unregistered only costs speed: its requests use plain opcodes.
        if (Status s = w.engine->register_buffer_range(p, n); !s.ok()) {
          log_once("nvme.fixed_buffer_range", LogLevel::kWarn,
                   str("swap space: host arena extent not registered as fixed buffers: ", s.message()));
        }
      }
      w.ranges_to_register.clear();

      batch.clear();
      for (unsigned tag : w.resubmit) batch.push_back(request_for(w, tag));
      w.resubmit.clear();
      for (unsigned tag : fresh) {
        ++w.busy;
        Slot& s = w.slots[tag];
        if (!prepare(s)) {
          finish_chunk(w, tag, resource_exhausted("swap space: no memory for a bounce buffer"), finished);
          continue;
        }
        if (s.bounced) ++bounced;
        batch.push_back(request_for(w, tag));
      }
      std::size_t sent = 0;
      if (Status s = submit_batch(w, batch, sent); !s.ok()) {
        // The engine itself failed: the requests it did not take fail with its status.
        TIER_LOG(kError, "swap space: ", s.to_string());
        for (std::size_t i = sent; i < batch.size(); ++i) {
          finish_chunk(w, static_cast<unsigned>(batch[i].tag), s, finished);
        }
      }
      requests += sent;
      if (w.busy == 0) continue;
      {
        std::lock_guard<std::mutex> lk(mu);
        if (!pending.empty() && !w.free_slots.empty()) continue;  // more to cut first
        w.waiting = !w.free_slots.empty();
      }
      auto n = w.engine->reap(cqes.data(), cqes.size(), 1, std::chrono::nanoseconds(-1));
      {
        std::lock_guard<std::mutex> lk(mu);
        w.waiting = false;
      }
      if (!n.ok()) {
        TIER_LOG(kError, "swap space: ", n.status().to_string());
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      for (std::size_t i = 0; i < *n; ++i) on_completion(w, cqes[i], finished);
    }
  }

  IoFuture enqueue(std::shared_ptr<Op> op) {
    IoFuture f(op->state);
    std::vector<IoEngine*> to_wake;
    {
      std::unique_lock<std::mutex> lk(mu);
      if (stop) {
        // Only a callback can get here, while the swap space is being destroyed.
        auto it = extents.find(op->extent_id);
        if (it != extents.end() && --it->second.ops == 0 && it->second.freed) release_locked(it);
        lk.unlock();
        ++failed;
        op->xfer.finish(0, false);
        op->state->complete(cancelled("swap space is closing"));
        return f;
      }
      pending.push_back(std::move(op));
      for (auto& w : workers) {
        if (w->waiting) {
          w->waiting = false;
          to_wake.push_back(w->engine.get());
        }
      }
    }
    work_cv.notify_all();
    for (IoEngine* e : to_wake) e->wake();
    return f;
  }

  void shutdown() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
    }
    work_cv.notify_all();
    for (auto& w : workers) w->engine->wake();
    for (auto& w : workers) {
      if (w->thread.joinable()) w->thread.join();
    }
  }
};

// ---------------------------------------------------------------------------------- SwapExtent

SwapExtent& SwapExtent::operator=(SwapExtent&& o) noexcept {
  if (this != &o) {
    reset();
    space_ = o.space_;
    id_ = o.id_;
    bytes_ = o.bytes_;
    stripes_ = o.stripes_;
    o.space_ = nullptr;
    o.id_ = 0;
    o.bytes_ = 0;
    o.stripes_ = 0;
  }
  return *this;
}

void SwapExtent::reset() noexcept {
  if (space_) space_->free_extent(id_);
  space_ = nullptr;
  id_ = 0;
  bytes_ = 0;
  stripes_ = 0;
}

// ---------------------------------------------------------------------------------- SwapSpace

SwapSpaceOptions SwapSpaceOptions::from_config(const EngineConfig& config, std::uint64_t bytes_per_path,
                                               HostArena* arena, Counters* counters) {
  SwapSpaceOptions o;
  o.paths = config.resolved_swap_paths();
  o.bytes_per_path = bytes_per_path;
  o.engine = config.tier.io.engine;
  o.block_size = config.aio.block_size;
  o.queue_depth = static_cast<unsigned>(config.aio.queue_depth);
  o.intra_op_parallelism = static_cast<unsigned>(config.aio.intra_op_parallelism);
  o.single_submit = config.aio.single_submit;
  o.use_direct = config.tier.io.use_direct;
  o.sqpoll = config.tier.io.sqpoll;
  o.fixed_buffers = config.tier.io.fixed_buffers;
  o.bounce_unaligned = config.tier.io.bounce_unaligned;
  o.preallocate = config.tier.io.preallocate;
  o.arena = arena;
  o.counters = counters;
  return o;
}

SwapSpace::SwapSpace(const SwapSpaceOptions& options) : options_(options), impl_(new Impl(options_)) {}

SwapSpace::~SwapSpace() {
  if (impl_->arena_listener != 0) options_.arena->remove_commit_listener(impl_->arena_listener);
  impl_->shutdown();
  impl_->workers.clear();  // engines go before the files they address
  impl_->files.clear();
}

Result<std::unique_ptr<SwapSpace>> SwapSpace::create(const SwapSpaceOptions& options) {
  const SwapSpaceOptions& o = options;
  if (o.paths.empty()) {
    return invalid_argument("swap space: no swap paths; set tier.swap_paths or an offload nvme_path");
  }
  if (o.bytes_per_path == 0 && o.preallocate) {
    return invalid_argument("swap space: bytes_per_path is 0 with preallocate; give each path some space");
  }
  if (o.block_size == 0 || o.block_size % kGranule != 0 || o.block_size > kMaxRequestBytes) {
    return invalid_argument(str("swap space: block size ", o.block_size,
                                " must be a multiple of 4096 from 4096 to 1 GiB (aio.block_size)"));
  }
  if (o.queue_depth < 1 || o.queue_depth > 4096) {
    return invalid_argument(
        str("swap space: queue depth ", o.queue_depth, " must be from 1 to 4096 (aio.queue_depth)"));
  }
  if (o.intra_op_parallelism < 1 || o.intra_op_parallelism > 256) {
    return invalid_argument(str("swap space: intra_op_parallelism ", o.intra_op_parallelism,
                                " must be from 1 to 256 (aio.intra_op_parallelism)"));
  }
  if (o.stripe_unit % kGranule != 0) {
    return invalid_argument(str("swap space: stripe unit ", o.stripe_unit, " must be a multiple of 4096"));
  }

  std::unique_ptr<SwapSpace> sp(new SwapSpace(options));
  Impl& im = *sp->impl_;
  const std::uint64_t per_path = round_up(o.bytes_per_path, kGranule);
  im.unit = o.stripe_unit ? o.stripe_unit : o.block_size;
  im.threshold = o.stripe_threshold ? o.stripe_threshold : 2 * im.unit;

  // Files: all O_DIRECT or all buffered, so that one alignment rule holds for every extent.
  std::string refusal;
  for (const std::string& dir : o.paths) {
    TIER_ASSIGN_OR_RETURN(detail::SwapFile f,
                          detail::create_swap_file(dir, o.preallocate ? per_path : 0, o.use_direct));
    std::uint64_t cap = per_path;
    if (o.bytes_per_path == 0) {
      // Auto: a cap at the file system's free space now (the file takes only what its extents
      // need); one without space accounting (ramfs) gets kAutoCapUnaccounted.
      cap = kAutoCapUnaccounted;
      struct statvfs vfs {};
      if (fstatvfs(f.dir_file->fd(), &vfs) == 0 && vfs.f_blocks > 0) {
        cap = (static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize) & ~(kGranule - 1);
      }
      if (cap == 0) {
        return Status(StatusCode::kNoSpace,
                      str("swap path ", dir, ": no free space on ", f.fs, "; free space or add another path"), ENOSPC);
      }
    }
    if (f.fs == "tmpfs" || f.fs == "ramfs") {
      log_once(str("nvme.in_memory.", dir), LogLevel::kWarn,
               str("swap path ", dir, " is ", f.fs,
                   ": 'NVMe' tier data is held in RAM; figures are not NVMe figures (use a directory on an SSD)"));
    }
    if (o.use_direct && f.direct && f.size_align > kGranule) {
      f.direct_refusal = str("swap path ", dir, ": O_DIRECT on ", f.fs, " needs ", f.size_align,
                             "-byte granules, more than tier's 4 KiB extents");
    }
    if (refusal.empty() && !f.direct_refusal.empty()) refusal = f.direct_refusal;
    im.files.push_back(std::move(f));
    im.allocs.emplace_back(cap);
    im.committed.push_back(o.preallocate ? per_path : 0);
  }
  im.direct = o.use_direct && refusal.empty();
  for (auto& f : im.files) {
    if (f.direct != im.direct) TIER_RETURN_IF_ERROR(detail::set_direct(f, im.direct));
    im.mem_align = std::max<std::uint64_t>(im.mem_align, f.mem_align);
    im.size_align = std::max<std::uint64_t>(im.size_align, f.size_align);
  }
  im.resume_align = std::max(im.mem_align, im.size_align);

  IoEngineKind kind = o.engine;
  if (!im.direct && kind == IoEngineKind::kAuto) {
    kind = IoEngineKind::kPosix;
    if (!refusal.empty()) {
      log_once(str("nvme.no_direct.", refusal), LogLevel::kWarn,
               str(refusal,
                   "; using buffered I/O through the posix engine (tier.io.use_direct=false picks this "
                   "without a warning)"));
    }
  } else if (!im.direct && !refusal.empty()) {
    log_once(str("nvme.no_direct.", refusal), LogLevel::kWarn,
             str(refusal, "; using buffered I/O through the ", io_engine_kind_name(kind), " engine"));
  }
  if (!im.direct && kind == IoEngineKind::kAio) {
    log_once("nvme.aio_buffered", LogLevel::kWarn,
             "swap space: libaio on buffered files submits synchronously; prefer tier.io_engine=posix or uring");
  }

  IoEngineOptions eo;
  eo.kind = kind;
  eo.queue_depth = o.queue_depth;
  eo.sqpoll = o.sqpoll;
  // A lazy arena is registered extent by extent: one fixed buffer per extent.
  const bool lazy_arena = o.arena && o.fixed_buffers && o.arena->lazy();
  if (lazy_arena) eo.fixed_buffer_piece = o.arena->extent_bytes();
  for (unsigned i = 0; i < o.intra_op_parallelism; ++i) {
    auto w = std::make_unique<Impl::Worker>();
    TIER_ASSIGN_OR_RETURN(w->engine, make_io_engine(eo));
    eo.kind = w->engine->kind();  // every thread gets the backend the first one found
    if (o.wrap_engine) {
      w->engine = o.wrap_engine(std::move(w->engine));
      if (!w->engine) return invalid_argument("swap space: wrap_engine returned no engine");
    }
    for (const auto& f : im.files) {
      auto slot = w->engine->register_file(f.fd);
      w->file_index.push_back(slot.ok() ? *slot : -1);
    }
    if (o.arena && o.fixed_buffers && (w->engine->kind() == IoEngineKind::kUring)) {
      Status s = lazy_arena ? w->engine->reserve_buffers(o.arena->base(), o.arena->capacity())
                            : w->engine->register_buffers(o.arena->base(), o.arena->capacity());
      if (s.ok()) {
        im.fixed_registered = true;
      } else {
        log_once("nvme.fixed_buffers", LogLevel::kWarn, str("swap space: fixed buffers off: ", s.message()));
      }
    }
    w->slots.resize(o.queue_depth);
    for (unsigned t = o.queue_depth; t-- > 0;) w->free_slots.push_back(t);
    im.workers.push_back(std::move(w));
  }
  im.fixed_registered = im.fixed_registered && im.workers.front()->engine->has(kIoCapFixedBuffers);
  im.engine_name = im.workers.front()->engine->name();
  im.engine_caps = im.workers.front()->engine->capabilities();
  sp->engine_kind_ = im.workers.front()->engine->kind();
  sp->mem_align_ = im.direct ? im.mem_align : 1;
  sp->size_align_ = im.direct ? im.size_align : 1;
  if (o.counters) {
    o.counters->set_info("io_engine", im.engine_name);
    o.counters->set_info("nvme.direct_io", im.direct ? "true" : "false");
    o.counters->set_info("nvme.fixed_buffers", im.fixed_registered ? "true" : "false");
    std::uint64_t capacity = 0;
    for (const auto& a : im.allocs) capacity += a.capacity();
    o.counters->set_metric(o.metrics_prefix + ".capacity_bytes", static_cast<double>(capacity));
    std::lock_guard<std::mutex> lk(im.mu);
    im.publish_metrics_locked();
  }
  if (lazy_arena && im.fixed_registered) {
    // Called for the extents committed already, then by the allocating thread for each later one.
    im.arena_listener = o.arena->add_commit_listener([&im](std::byte* p, std::uint64_t n) {
      std::lock_guard<std::mutex> lk(im.mu);
      im.arena_ranges.emplace_back(p, n);
    });
  }
  for (auto& w : im.workers) {
    Impl::Worker* wp = w.get();
    wp->thread = std::thread([&im, wp] { im.run(*wp); });
  }
  return sp;
}

Result<SwapExtent> SwapSpace::allocate(std::uint64_t bytes) {
  if (bytes == 0) return invalid_argument("swap space: allocate(0); an extent needs at least one byte");
  if (bytes > (std::uint64_t{1} << 62)) return invalid_argument(str("swap space: allocate(", bytes, ") is absurd"));
  Impl& im = *impl_;
  const std::uint64_t reserved = round_up(bytes, kGranule);
  std::lock_guard<std::mutex> lk(im.mu);
  std::vector<Impl::Piece> pieces;
  if (im.files.size() > 1 && reserved >= im.threshold) pieces = im.try_striped(reserved);
  if (pieces.empty()) pieces = im.try_single(reserved);
  if (pieces.empty()) {
    std::uint64_t free_bytes = 0, largest = 0;
    for (const auto& a : im.allocs) {
      free_bytes += a.free_bytes();
      largest = std::max(largest, a.largest_free());
    }
    return resource_exhausted(str("swap space: no room for ", format_bytes(reserved), " (", format_bytes(free_bytes),
                                  " free over ", im.files.size(), " path(s), largest free run ", format_bytes(largest),
                                  "); free extents or give the swap space more bytes per path"));
  }
  for (const Impl::Piece& piece : pieces) {
    if (Status grown = im.grow_locked(piece.path, piece.offset + piece.length); !grown.ok()) {
      for (const Impl::Piece& q : pieces) im.allocs[q.path].release(q.offset, q.length);
      im.publish_metrics_locked();
      return grown;
    }
  }
  const std::uint64_t id = im.next_id++;
  Impl::ExtentRec rec;
  rec.bytes = bytes;
  rec.reserved = reserved;
  rec.pieces = std::move(pieces);
  const unsigned stripes = static_cast<unsigned>(rec.pieces.size());
  if (stripes > 1) ++im.striped;
  im.extents.emplace(id, std::move(rec));
  im.used += reserved;
  im.peak = std::max(im.peak, im.used);
  im.publish_metrics_locked();
  return SwapExtent(this, id, bytes, stripes);
}

void SwapSpace::free_extent(std::uint64_t id) noexcept {
  Impl& im = *impl_;
  std::lock_guard<std::mutex> lk(im.mu);
  auto it = im.extents.find(id);
  if (it == im.extents.end()) return;
  it->second.freed = true;
  if (it->second.ops == 0) im.release_locked(it);
}

IoFuture SwapSpace::write(const SwapExtent& extent, const void* src, std::uint64_t bytes, std::uint64_t offset) {
  return transfer(IoOp::kWrite, extent, const_cast<void*>(src), bytes, offset);
}

IoFuture SwapSpace::read(const SwapExtent& extent, void* dst, std::uint64_t bytes, std::uint64_t offset) {
  return transfer(IoOp::kRead, extent, dst, bytes, offset);
}

IoFuture SwapSpace::transfer(IoOp kind, const SwapExtent& extent, void* buf, std::uint64_t bytes,
                             std::uint64_t offset) {
  Impl& im = *impl_;
  const char* what = io_op_name(kind);
  if (extent.space_ != this) {
    return IoFuture::completed(invalid_argument(
        str("swap ", what, ": the extent ", extent.empty() ? "is empty" : "belongs to another swap space")));
  }
  if (bytes == 0) return IoFuture::completed(Status::Ok());
  if (buf == nullptr) return IoFuture::completed(invalid_argument(str("swap ", what, ": null buffer")));
  if (offset % kGranule != 0) {
    return IoFuture::completed(
        invalid_argument(str("swap ", what, ": extent offset ", offset, " is not a multiple of 4096")));
  }
  if (offset > extent.bytes() || bytes > extent.bytes() - offset) {
    return IoFuture::completed(
        out_of_range(str("swap ", what, " of ", bytes, " bytes at offset ", offset, " runs past the end of extent #",
                         extent.id(), " (", extent.bytes(), " bytes)")));
  }
  bool bounce_all = false;
  if (im.direct) {
    const bool misaligned = reinterpret_cast<std::uintptr_t>(buf) % im.mem_align != 0;
    const bool ragged = bytes % im.size_align != 0;
    if ((misaligned || ragged) && !options_.bounce_unaligned) {
      return IoFuture::completed(
          invalid_argument(str("swap ", what, " of ", bytes, " bytes: ",
                               misaligned ? str("the buffer at ", buf, " is not aligned to ", im.mem_align, " bytes")
                                          : str("the size is not a multiple of ", im.size_align, " bytes"),
                               ", which O_DIRECT needs; use a buffer from the host arena and pad the size, or set "
                               "tier.io.bounce_unaligned=true")));
    }
    bounce_all = misaligned;
  }
  auto op = std::make_shared<Impl::Op>();
  {
    std::lock_guard<std::mutex> lk(im.mu);
    auto it = im.extents.find(extent.id());
    if (it == im.extents.end() || it->second.freed) {
      return IoFuture::completed(failed_precondition(str("swap ", what, ": extent #", extent.id(), " was freed")));
    }
    ++it->second.ops;
    op->pieces = it->second.pieces;
  }
  op->state = std::make_shared<detail::IoOpState>(bytes);
  op->kind = kind;
  op->extent_id = extent.id();
  op->buf = static_cast<std::byte*>(buf);
  op->bytes = bytes;
  op->offset = offset;
  op->bounce_all = bounce_all;
  if (options_.counters) {
    op->xfer = options_.counters->begin(kind == IoOp::kRead ? Link::kNvmeToHost : Link::kHostToNvme);
  }
  return im.enqueue(std::move(op));
}

Status SwapSpace::flush() {
  for (auto& f : impl_->files) TIER_RETURN_IF_ERROR(f.data_sync());
  return Status::Ok();
}

SwapSpaceStats SwapSpace::stats() const {
  Impl& im = *impl_;
  SwapSpaceStats s;
  s.engine = im.engine_name;
  s.engine_capabilities = im.engine_caps;
  s.fixed_buffers = im.fixed_registered;
  std::uint64_t free_bytes = 0, largest = 0;
  {
    std::lock_guard<std::mutex> lk(im.mu);
    for (std::size_t i = 0; i < im.files.size(); ++i) {
      const auto& f = im.files[i];
      const auto& a = im.allocs[i];
      SwapPathStats p;
      p.dir = f.dir;
      p.file = f.path;
      p.direct_io = f.direct;
      p.capacity_bytes = a.capacity();
      p.allocated_bytes = im.committed[i];
      p.used_bytes = a.used_bytes();
      p.largest_free_bytes = a.largest_free();
      p.free_extents = a.free_runs();
      p.fragmentation = a.fragmentation();
      s.paths.push_back(std::move(p));
      s.capacity_bytes += a.capacity();
      s.allocated_bytes += im.committed[i];
      free_bytes += a.free_bytes();
      largest = std::max(largest, a.largest_free());
    }
    s.used_bytes = im.used;
    s.peak_used_bytes = im.peak;
    s.live_extents = im.extents.size();
    s.striped_extents = im.striped;
  }
  s.fragmentation = free_bytes ? 1.0 - static_cast<double>(largest) / static_cast<double>(free_bytes) : 0.0;
  s.bytes_read = im.bytes_read.load();
  s.bytes_written = im.bytes_written.load();
  s.reads = im.reads.load();
  s.writes = im.writes.load();
  s.failed = im.failed.load();
  s.requests = im.requests.load();
  s.fixed_buffer_bytes = im.fixed_registered ? ~std::uint64_t{0} : 0;
  for (const auto& w : im.workers) {
    const IoEngineStats es = w->engine->stats();
    s.fixed_buffer_requests += es.fixed_buffer_requests;
    s.submit_calls += es.submit_calls;
    s.fixed_buffer_bytes = std::min(s.fixed_buffer_bytes, w->engine->registered_buffer_bytes());
  }
  s.retries = im.retries.load();
  s.short_transfers = im.shorts.load();
  s.bounced_requests = im.bounced.load();
  return s;
}

}  // namespace tier::nvme
