// The offloaded optimizer: creation, partition registration, gradient intake, the pipelined step
// and state access. Checkpoints are in checkpoint.cpp, option plumbing in optimizer_options.cpp.
#include "tier/offloaded_optimizer.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <limits>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>

#include "optim/chunk_pipeline.hpp"
#include "optim/grad_accumulate.hpp"
#include "optim/optimizer_impl.hpp"
#include "tier/ext/host_arena.hpp"
#include "tier/log.hpp"
#include "tier/stats.hpp"
#include "tier/units.hpp"

namespace tier::optim {

using detail::Buffer;
using detail::Chunk;
using detail::ChunkLayout;
using detail::Partition;
using detail::Section;

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kDefaultBufferBytes = 256ull << 20;
// The automatic chunk size aims at this many chunks per step, with chunks of at least this many
// elements.
constexpr std::uint64_t kMinChunks = 64;
constexpr std::uint64_t kMinAutoChunk = 256 * 1024;
// Pinned bytes of a buffer of `ce` elements: the chunk record (16 bytes per element for fp32
// state, 12 for bf16, about 10 for int8, with page rounding), then 4 bytes of low-precision
// staging per element.
// With the masters outside (master_source): the record, then the master section; no staging (such
// partitions deliver nothing).
std::uint64_t buffer_bytes_for(std::uint64_t ce, cpu::StateDType d, bool external_master) {
  return detail::round_up(ChunkLayout::of(ce, d, external_master).span + (external_master ? 0 : ce * 4), 4096);
}
// Elements per piece handed to one update thread.
constexpr std::uint64_t kUpdateGranule = 32 * 1024;
// Partitions without a gradient are updated with zeros taken from this many at a time.
constexpr std::uint64_t kZeroSlice = 16 * 1024;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

const float* zero_grads() {
  static const std::vector<float> zeros(kZeroSlice, 0.0f);
  return zeros.data();
}

// Memory for a chunk record of `bytes` (host home, scratch).
detail::FloatPtr alloc_floats(std::uint64_t count);
detail::FloatPtr alloc_record(std::uint64_t bytes) {
  return alloc_floats((bytes + 3) / 4);
}

detail::FloatPtr alloc_floats(std::uint64_t count) {
  const std::uint64_t bytes = detail::round_up(std::max<std::uint64_t>(count, 1) * sizeof(float), 4096);
  const std::uint64_t align = bytes >= HostArena::kHugePage ? HostArena::kHugePage : 4096;
  void* p = std::aligned_alloc(align, detail::round_up(bytes, align));
  if (p != nullptr && bytes >= HostArena::kHugePage) ::madvise(p, detail::round_up(bytes, align), MADV_HUGEPAGE);
  return detail::FloatPtr(static_cast<float*>(p));
}

std::string partition_label(PartitionId id, const Partition& p) {
  return p.name.empty() ? str("partition ", id) : str("partition ", id, " ('", p.name, "')");
}

}  // namespace

// ------------------------------------------------------------------------------------ names

const char* state_home_name(StateHome h) noexcept {
  return h == StateHome::kNvme ? "nvme" : "host";
}

const char* param_output_name(ParamOutput o) noexcept {
  switch (o) {
    case ParamOutput::kNone: return "none";
    case ParamOutput::kF16: return "fp16";
    case ParamOutput::kBF16: return "bf16";
    case ParamOutput::kF32: return "fp32";
  }
  return "?";
}

std::size_t param_output_size(ParamOutput o) noexcept {
  switch (o) {
    case ParamOutput::kNone: return 0;
    case ParamOutput::kF16:
    case ParamOutput::kBF16: return 2;
    case ParamOutput::kF32: return 4;
  }
  return 0;
}

DType param_output_dtype(ParamOutput o) noexcept {
  return o == ParamOutput::kF16 ? DType::kF16 : (o == ParamOutput::kBF16 ? DType::kBF16 : DType::kF32);
}

const char* state_kind_name(StateKind k) noexcept {
  switch (k) {
    case StateKind::kMaster: return "master";
    case StateKind::kExpAvg: return "exp_avg";
    case StateKind::kExpAvgSq: return "exp_avg_sq";
  }
  return "?";
}

// ------------------------------------------------------------------------------------ Impl helpers

Status OffloadedOptimizer::Impl::usable(const char* what, bool loading, bool finishing) const {
  if (!poisoned.ok()) return poisoned.with_context(str("optimizer ", what));
  if (!loading && !state_invalid.ok()) return state_invalid.with_context(str("optimizer ", what));
  if (!registered) {
    return failed_precondition(
        str("optimizer ", what, ": partitions are still being registered; call finish_registration() first"));
  }
  if (owed && !loading && !finishing) {
    const auto n = static_cast<std::uint64_t>(std::count(done.begin(), done.end(), std::uint8_t{1}));
    return failed_precondition(str("optimizer ", what, ": step ", owed->step, " failed after ", n, " of ",
                                   chunks.size(),
                                   " chunks took their update (state_copies 1 keeps one copy of the state, so it is "
                                   "finished, not undone); call step() to finish it with the gradients it kept"));
  }
  return {};
}

bool OffloadedOptimizer::Impl::take_spare(Chunk& c) {
  if (c.next) return true;
  std::lock_guard<std::mutex> lk(pool_mu);
  if (pool.empty()) return false;
  c.next = std::move(pool.back());
  pool.pop_back();
  return true;
}

void OffloadedOptimizer::Impl::drop_spare(Chunk& c) {
  if (!c.next) return;
  std::lock_guard<std::mutex> lk(pool_mu);
  pool.push_back(std::move(c.next));
}

void OffloadedOptimizer::Impl::drop_spares() {
  for (Chunk& c : chunks) drop_spare(c);
}

void OffloadedOptimizer::Impl::commit_spare(Chunk& c) {
  std::swap(c.slot[c.committed], c.next);
  drop_spare(c);
}

Result<float*> OffloadedOptimizer::Impl::hold_master(PartitionId pid) {
  MasterLease& l = masters[pid];
  if (l.holds == 0) {
    auto d = opt.master_source->acquire(pid);
    if (!d.ok()) return d.status().with_context(str("the master params of ", partition_label(pid, parts[pid])));
    if (*d == nullptr) {
      return internal_error(str("the MasterSource gave no memory for ", partition_label(pid, parts[pid])));
    }
    l.data = *d;
    l.wrote = false;
  }
  ++l.holds;
  return l.data;
}

Status OffloadedOptimizer::Impl::let_go_master(PartitionId pid, bool wrote) {
  MasterLease& l = masters[pid];
  if (l.holds == 0)
    return internal_error(str("optimizer: ", partition_label(pid, parts[pid]), "'s master is not held"));
  l.wrote = l.wrote || wrote;
  if (--l.holds > 0) return {};
  l.data = nullptr;
  Status s = opt.master_source->release(pid, l.wrote);
  if (!s.ok()) return s.with_context(str("releasing the master params of ", partition_label(pid, parts[pid])));
  return {};
}

namespace {
// Calls fn(pid, element of the chunk, element of the partition, n) for each partition piece of c.
template <class Fn>
void for_chunk_pieces(const OffloadedOptimizer::Impl& im, const Chunk& c, Fn&& fn) {
  for (PartitionId pid = c.first; pid <= c.last; ++pid) {
    const Partition& p = im.parts[pid];
    const std::uint64_t a = std::max(p.start, c.start);
    const std::uint64_t e = std::min(p.start + p.numel, c.start + c.numel);
    if (e > a) fn(pid, a - c.start, a - p.start, e - a);
  }
}
}  // namespace

Status OffloadedOptimizer::Impl::hold_masters(const Chunk& c) {
  for (PartitionId pid = c.first; pid <= c.last; ++pid) {
    auto held = hold_master(pid);
    if (held.ok()) continue;
    for (PartitionId q = c.first; q < pid; ++q) let_go_master(q, false).ignore();
    return held.status();
  }
  return {};
}

Status OffloadedOptimizer::Impl::fill_masters(const Chunk& c, void* base) {
  TIER_RETURN_IF_ERROR(hold_masters(c));
  float* m = master(base, c);
  for_chunk_pieces(*this, c, [&](PartitionId pid, std::uint64_t ca, std::uint64_t pa, std::uint64_t n) {
    std::memcpy(m + ca, masters[pid].data + pa, n * sizeof(float));
  });
  return {};
}

Status OffloadedOptimizer::Impl::settle_masters(const Chunk& c, void* base, bool put_back) {
  if (put_back) {
    const float* m = master(base, c);
    for_chunk_pieces(*this, c, [&](PartitionId pid, std::uint64_t ca, std::uint64_t pa, std::uint64_t n) {
      std::memcpy(masters[pid].data + pa, m + ca, n * sizeof(float));
    });
  }
  Status first;
  for (PartitionId pid = c.first; pid <= c.last; ++pid) {
    Status s = let_go_master(pid, put_back);
    if (first.ok()) first = s;
  }
  return first;
}

PartitionId OffloadedOptimizer::Impl::partition_at(const Chunk& c, std::uint64_t flat) const {
  auto first = parts.begin() + c.first;
  auto last = parts.begin() + c.last + 1;
  auto it = std::upper_bound(first, last, flat, [](std::uint64_t f, const Partition& p) { return f < p.start; });
  return static_cast<PartitionId>((it - parts.begin()) - 1);
}

cpu::AdamTensors OffloadedOptimizer::Impl::state_at(void* base, const Chunk& c, std::uint64_t a,
                                                    std::uint64_t n) const {
  const cpu::StateDType d = state_dtype();
  const DType md = cpu::exp_avg_dtype(d);
  const DType vd = cpu::exp_avg_sq_dtype(d);
  cpu::AdamTensors t;
  t.params = {master(base, c) + a, DType::kF32, n};
  t.exp_avg = {section(base, c, Section::kExpAvg) + a * dtype_size(md), md, n};
  t.exp_avg_sq = {section(base, c, Section::kExpAvgSq) + a * dtype_size(vd), vd, n};
  if (d == cpu::StateDType::kInt8) {
    t.exp_avg_scales = reinterpret_cast<float*>(section(base, c, Section::kExpAvgScales)) + a / cpu::kStateBlock;
    t.exp_avg_sq_scales = reinterpret_cast<float*>(section(base, c, Section::kExpAvgSqScales)) + a / cpu::kStateBlock;
  }
  return t;
}

Status OffloadedOptimizer::Impl::idle(const char* what) const {
  if (!overlap) return {};
  return failed_precondition(str("optimizer ", what,
                                 ": an overlapped step is running; finish_overlapped_step() or "
                                 "cancel_overlapped_step() first"));
}

void OffloadedOptimizer::Impl::report_resident(std::int64_t host_delta, std::int64_t nvme_delta) const {
  if (!opt.counters) return;
  if (host_delta) opt.counters->add_resident(Tier::kHost, host_delta);
  if (nvme_delta) opt.counters->add_resident(Tier::kNvme, nvme_delta);
}

// A step's update of one chunk whose sections are at `base` (with the chunk's stride): every
// partition piece of the chunk on the workers' threads, each piece with its group's constants,
// outputs to the partition's destination or packed into `staging` from its first element's slot
// (chunk offset * 4), where process() hands them to the ParamSink.
// `part_steps`, when not empty, holds each partition's step (Lamb: with its trust ratio) and
// takes the place of its group's.
static Status update_chunk(const OffloadedOptimizer::Impl& im, const Chunk& c, float* base, std::byte* staging,
                           const std::vector<cpu::AdamStep>& steps, const std::vector<void*>& dest,
                           const std::vector<cpu::AdamStep>& part_steps = {}) {
  std::mutex mu;
  Status first_error;
  im.workers->for_ranges(c.numel, kUpdateGranule, [&](std::uint64_t b, std::uint64_t e) {
    std::uint64_t flat = c.start + b;
    const std::uint64_t end = c.start + e;
    PartitionId pid = im.partition_at(c, flat);
    while (flat < end) {
      const Partition& p = im.parts[pid];
      // int8 alignment gaps belong to no partition: skip to the next partition's first element.
      if (flat < p.start) flat = p.start;
      if (flat >= end) break;
      if (flat >= p.start + p.numel) {
        if (pid == c.last) break;
        ++pid;
        continue;
      }
      const std::uint64_t n = std::min(p.start + p.numel, end) - flat;
      if (!im.skipping.empty() && im.skipping[pid]) {
        flat += n;
        ++pid;
        continue;
      }
      const std::uint64_t ci = flat - c.start;
      const std::uint64_t pi = flat - p.start;
      const cpu::AdamStep& st = part_steps.empty() ? steps[static_cast<std::size_t>(p.group)] : part_steps[pid];
      const std::size_t os = param_output_size(p.output);
      std::byte* out = nullptr;
      if (p.output != ParamOutput::kNone) {
        if (dest.empty() || dest[pid] == nullptr) {
          // The partition's outputs in this chunk are packed from the staging slot of its first
          // element in the chunk (where the ParamSink reads them), whichever thread writes which piece.
          const std::uint64_t first = std::max(p.start, c.start);
          out = staging + (first - c.start) * 4 + (flat - first) * os;
        } else {
          out = static_cast<std::byte*>(dest[pid]) + pi * os;
        }
      }
      const DType od = param_output_dtype(p.output);
      Status s;
      if (p.grad != nullptr) {
        const std::size_t gs = dtype_size(p.grad_dtype);
        cpu::AdamTensors t = im.state_at(base, c, ci, n);
        t.grads = cpu::ConstTensorRef(static_cast<const std::byte*>(p.grad) + pi * gs, p.grad_dtype, n);
        if (out) t.out = cpu::TensorRef{out, od, n};
        s = cpu::adam_update_chunk(st, t);
      } else {
        // kZeroSlice is a multiple of the int8 block: every slice starts on a block boundary.
        for (std::uint64_t k = 0; k < n && s.ok(); k += kZeroSlice) {
          const std::uint64_t m = std::min(kZeroSlice, n - k);
          cpu::AdamTensors t = im.state_at(base, c, ci + k, m);
          t.grads = cpu::ConstTensorRef(zero_grads(), DType::kF32, m);
          if (out) t.out = cpu::TensorRef{out + k * os, od, m};
          s = cpu::adam_update_chunk(st, t);
        }
      }
      if (!s.ok()) {
        std::lock_guard<std::mutex> lk(mu);
        if (first_error.ok()) first_error = s.with_context(partition_label(pid, p));
        return;
      }
      flat += n;
      ++pid;
    }
  });
  return first_error;
}

// Delivers chunk c's params from its state (at `base`) without updating it: each partition piece's
// master converted to its output dtype, into its destination or the staging where update_chunk
// puts it. state_copies 1: a chunk that a failed try of the step updated, of a partition that try
// left half delivered, when the step is finished.
// Only the partitions `which` names.
static Status output_chunk(const OffloadedOptimizer::Impl& im, const Chunk& c, float* base, std::byte* staging,
                           const std::vector<void*>& dest, const std::vector<std::uint8_t>& which) {
  for (PartitionId pid = c.first; pid <= c.last; ++pid) {
    const Partition& p = im.parts[pid];
    if (!which[pid] || p.output == ParamOutput::kNone || (!im.skipping.empty() && im.skipping[pid])) continue;
    const std::uint64_t a = std::max(p.start, c.start);
    const std::uint64_t e = std::min(p.start + p.numel, c.start + c.numel);
    if (e <= a) continue;
    const std::size_t os = param_output_size(p.output);
    std::byte* out = dest.empty() || dest[pid] == nullptr ? staging + (a - c.start) * 4
                                                          : static_cast<std::byte*>(dest[pid]) + (a - p.start) * os;
    Status s =
        cpu::convert(cpu::ConstTensorRef(OffloadedOptimizer::Impl::master(base, c) + (a - c.start), DType::kF32, e - a),
                     cpu::TensorRef{out, param_output_dtype(p.output), e - a});
    if (!s.ok()) return s.with_context(partition_label(pid, p));
  }
  return {};
}

// Lamb's first pass over one chunk whose sections are at `base`: adds the squared norms of p and
// u of every Lamb partition piece in it to that partition's accumulator. Reads only. Pieces go in
// element order on the calling thread (each call spreads its 64 Ki blocks over the threads), so
// the sums do not depend on the chunk size or the thread count.
static Status lamb_norms_chunk(const OffloadedOptimizer::Impl& im, const Chunk& c, float* base,
                               const std::vector<cpu::AdamStep>& steps,
                               std::vector<std::unique_ptr<cpu::LambNorms>>& norms) {
  for (PartitionId pid = c.first; pid <= c.last; ++pid) {
    if (!norms[pid] || (!im.skipping.empty() && im.skipping[pid])) continue;
    const Partition& p = im.parts[pid];
    const std::uint64_t a = std::max(p.start, c.start);
    const std::uint64_t e = std::min(p.start + p.numel, c.start + c.numel);
    const cpu::AdamStep& st = steps[static_cast<std::size_t>(p.group)];
    const std::uint64_t ci = a - c.start;
    const std::uint64_t pi = a - p.start;
    const std::uint64_t n = e - a;
    Status s;
    if (p.grad != nullptr) {
      const std::size_t gs = dtype_size(p.grad_dtype);
      cpu::AdamTensors t = im.state_at(base, c, ci, n);
      t.grads = cpu::ConstTensorRef(static_cast<const std::byte*>(p.grad) + pi * gs, p.grad_dtype, n);
      s = cpu::lamb_accumulate_norms(st, t, pi, *norms[pid], im.opt.threads);
    } else {
      for (std::uint64_t k = 0; k < n && s.ok(); k += kZeroSlice) {
        const std::uint64_t m = std::min(kZeroSlice, n - k);
        cpu::AdamTensors t = im.state_at(base, c, ci + k, m);
        t.grads = cpu::ConstTensorRef(zero_grads(), DType::kF32, m);
        s = cpu::lamb_accumulate_norms(st, t, pi + k, *norms[pid], im.opt.threads);
      }
    }
    if (!s.ok()) return s.with_context(partition_label(pid, p));
  }
  return {};
}

// ------------------------------------------------------------------------------------ creation

OffloadedOptimizer::OffloadedOptimizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

OffloadedOptimizer::~OffloadedOptimizer() {
  if (!impl_) return;
  Impl& im = *impl_;
  if (im.overlap) {
    // Stopped without delivering anything again: the caller's destinations may be gone.
    {
      std::lock_guard<std::mutex> lk(im.overlap->mu);
      im.overlap->abort = true;
      im.overlap->all_in = true;
    }
    im.overlap->cv.notify_all();
    im.overlap->thread.join();
    im.overlap.reset();
    im.skipping.clear();
  }
  for (Buffer& b : im.bufs) {
    if (b.pending.valid()) b.pending.wait().ignore();
  }
  // Give back what was reported as resident.
  std::int64_t host = 0, nvme = 0;
  host += im.own_pinned_bytes();
  host += static_cast<std::int64_t>(im.accumulator_bytes.load());
  for (const Chunk& c : im.chunks) {
    if (c.host) host += static_cast<std::int64_t>(c.bytes());
  }
  nvme = static_cast<std::int64_t>(im.nvme_slot_bytes.load());
  im.report_resident(-host, -nvme);
}

Result<std::unique_ptr<OffloadedOptimizer>> OffloadedOptimizer::create(const OffloadedOptimizerOptions& options) {
  const OffloadedOptimizerOptions& o = options;
  if (o.home != StateHome::kNvme && o.home != StateHome::kHost)
    return invalid_argument("optimizer: unknown state home");
  if (o.buffer_count < 1 || o.buffer_count > 1024) {
    return invalid_argument(str("optimizer: buffer_count ", o.buffer_count,
                                " must be from 1 to 1024 (zero_optimization.offload_optimizer.buffer_count)"));
  }
  if (o.chunk_elements % detail::kSectionAlign != 0) {
    return invalid_argument(str("optimizer: chunk_elements ", o.chunk_elements, " must be a multiple of ",
                                detail::kSectionAlign, " (tier.optimizer.chunk_elements)"));
  }
  if (o.groups.empty()) return invalid_argument("optimizer: give at least one parameter group");
  if (!std::isfinite(o.max_grad_norm) || o.max_grad_norm < 0) {
    return invalid_argument(
        str("optimizer: max_grad_norm ", o.max_grad_norm, " must be finite and not negative (gradient_clipping)"));
  }
  if (o.gradient_accumulation_steps < 1) {
    return invalid_argument(
        str("optimizer: gradient_accumulation_steps ", o.gradient_accumulation_steps, " must be at least 1"));
  }
  if (o.threads < 0) return invalid_argument(str("optimizer: threads ", o.threads, " is negative; 0 means all cores"));
  if (o.state_dtype != cpu::StateDType::kF32 && o.state_dtype != cpu::StateDType::kBF16 &&
      o.state_dtype != cpu::StateDType::kInt8) {
    return invalid_argument("optimizer: unknown state dtype (tier.optimizer.state_dtype: fp32, bf16 or int8)");
  }
  if (o.state_dtype != cpu::StateDType::kF32) {
    for (std::size_t g = 0; g < o.groups.size(); ++g) {
      if (o.groups[g].kind == cpu::OptimizerKind::kLamb) {
        return invalid_argument(str("optimizer: parameter group ", g, " is Lamb, which needs fp32 moments; ",
                                    "tier.optimizer.state_dtype is ", cpu::state_dtype_name(o.state_dtype),
                                    " (use fp32, or another optimizer)"));
      }
    }
  }
  if (o.state_copies != 1 && o.state_copies != 2) {
    return invalid_argument(str("optimizer: state_copies ", o.state_copies,
                                " must be 1 (one copy and a few spare chunks; a failed step is finished by the next "
                                "step()) or 2 (a committed and a shadow copy; a failed step applies nothing)"));
  }
  if (o.speculation_chunks > (1u << 20)) {
    return invalid_argument(str("optimizer: speculation_chunks ", o.speculation_chunks, " is implausible"));
  }
  if (o.home == StateHome::kNvme && o.swap == nullptr) {
    if (o.max_elements == 0) {
      return invalid_argument(
          "optimizer: NVMe home without a swap space needs max_elements (the model size) to size the swap files");
    }
    if (o.swap_options.paths.empty()) {
      return invalid_argument(
          "optimizer: NVMe home needs swap paths (zero_optimization.offload_optimizer.nvme_path or "
          "tier.swap_paths)");
    }
  }

  if (o.master_source != nullptr) {
    // The masters stay the caller's until a chunk's update is committed: that needs one copy of
    // the state on NVMe (a chunk commits alone), and an overlapped pass that updates no more
    // chunks than there are buffers (their masters wait there).
    const char* why = o.home != StateHome::kNvme  ? "the state on NVMe"
                      : o.state_copies != 1       ? "state_copies 1"
                      : o.speculation_chunks != 0 ? "speculation_chunks 0"
                                                  : nullptr;
    if (why != nullptr) {
      return invalid_argument(str("optimizer: masters held by the caller (master_source) need ", why));
    }
    for (std::size_t g = 0; g < o.groups.size(); ++g) {
      if (o.groups[g].kind == cpu::OptimizerKind::kLamb) {
        return invalid_argument(str("optimizer: parameter group ", g,
                                    " is Lamb, whose norms pass reads the masters; not with master_source"));
      }
    }
  }
  auto im = std::make_unique<Impl>();
  im->opt = o;
  for (std::size_t g = 0; g < o.groups.size(); ++g) {
    auto group = cpu::AdamGroup::create(o.groups[g]);
    if (!group.ok()) return group.status().with_context(str("optimizer: parameter group ", g));
    im->groups.push_back(std::move(group).value());
  }
  TIER_ASSIGN_OR_RETURN(LossScaler scaler, LossScaler::create(o.loss_scale));
  im->scaler = std::make_unique<LossScaler>(scaler);

  // Chunk size: what the buffer budget allows, capped by the model size when known.
  const cpu::StateDType sd = o.state_dtype;
  const bool ext = o.master_source != nullptr;
  std::uint64_t ce = o.chunk_elements;
  if (ce == 0) {
    const std::uint64_t budget = o.buffer_bytes ? o.buffer_bytes : kDefaultBufferBytes;
    // The largest multiple of 1024 whose buffers fit the budget (a first guess from the bytes
    // per element, walked down past the sections' page rounding).
    // (No staging with the masters outside: they are the params.)
    const std::uint64_t per_element =
        static_cast<std::uint64_t>(4 + cpu::state_bytes_per_element(sd) + (ext ? 0 : 4) + 0.5);
    ce = budget / o.buffer_count / per_element / detail::kSectionAlign * detail::kSectionAlign;
    while (ce > 0 && buffer_bytes_for(ce, sd, ext) * o.buffer_count > budget) ce -= detail::kSectionAlign;
    if (ce == 0) {
      return invalid_argument(str("optimizer: buffer_bytes ", o.buffer_bytes, " leaves no room for ", o.buffer_count,
                                  " buffers of at least ", detail::kSectionAlign, " elements (",
                                  buffer_bytes_for(detail::kSectionAlign, sd, ext) * o.buffer_count,
                                  " bytes); raise tier.optimizer.buffer_bytes"));
    }
    if (o.max_elements) {
      // At least ~64 chunks when the model allows, so that filling the pipeline (the first read)
      // and draining it (the last write) cost a small part of the step; not below 256 Ki elements
      // (3 MiB transfers), and never more than the model.
      const std::uint64_t spread = std::max<std::uint64_t>(
          kMinAutoChunk, detail::round_up((o.max_elements + kMinChunks - 1) / kMinChunks, detail::kSectionAlign));
      ce = std::min({ce, spread, detail::round_up(o.max_elements, detail::kSectionAlign)});
    }
  } else if (o.buffer_bytes && buffer_bytes_for(ce, sd, ext) * o.buffer_count > o.buffer_bytes) {
    return invalid_argument(str("optimizer: ", o.buffer_count, " buffers of ", ce, " elements need ",
                                format_bytes(buffer_bytes_for(ce, sd, ext) * o.buffer_count),
                                " of pinned memory but buffer_bytes allows ", format_bytes(o.buffer_bytes),
                                "; lower chunk_elements or buffer_count, or raise buffer_bytes"));
  }
  im->chunk_elems = ce;
  if (o.home == StateHome::kNvme && o.swap != nullptr && o.nvme_reserve && o.max_elements == 0) {
    return invalid_argument("optimizer: a shared swap space with a reservation (nvme_reserve) needs max_elements");
  }

  // Pinned buffers.
  const std::uint64_t state_bytes = ChunkLayout::of(ce, sd, ext).bytes;
  const std::uint64_t buf_bytes = buffer_bytes_for(ce, sd, ext);
  const std::uint64_t align = buf_bytes >= HostArena::kHugePage ? HostArena::kHugePage : 4096;
  im->arena = o.arena;
  if (im->arena == nullptr && !o.pinned_source) {
    HostArenaOptions ao;
    ao.bytes = detail::round_up(buf_bytes, align) * (o.home == StateHome::kHost ? 1 : o.buffer_count);
    TIER_ASSIGN_OR_RETURN(im->own_arena, HostArena::create(ao));
    im->arena = im->own_arena.get();
  }
  // Host home moves no chunks: one buffer serves as the output staging and scratch.
  const unsigned nbufs = o.home == StateHome::kHost ? 1 : o.buffer_count;
  for (unsigned b = 0; b < nbufs; ++b) {
    Result<PinnedRegion> mem{Status(StatusCode::kInternal, "not allocated")};
    if (o.pinned_source) {
      mem = o.pinned_source(buf_bytes, str("tier/optimizer/buffer", b));
      if (mem.ok() && (mem->bytes < buf_bytes || reinterpret_cast<std::uintptr_t>(mem->data) % 4096 != 0)) {
        mem = internal_error(str("the pinned source gave ", mem->bytes, " bytes at ", static_cast<void*>(mem->data),
                                 " for ", buf_bytes, " bytes, 4 KiB aligned"));
      }
    } else if (auto block = im->arena->try_allocate(buf_bytes, align); block.ok()) {
      auto held = std::make_shared<HostBlock>(std::move(block).value());
      mem = PinnedRegion{held->data(), held->size(), held};
    } else {
      mem = block.status();
    }
    if (!mem.ok()) {
      return mem.status().with_context(str("optimizer: pinned buffer ", b + 1, " of ", nbufs, " (",
                                           format_bytes(buf_bytes), " each; lower tier.optimizer.buffer_bytes or ",
                                           "offload_optimizer.buffer_count, or give the buffers more room)"));
    }
    Buffer buf;
    buf.mem = std::move(mem).value();
    buf.state = reinterpret_cast<float*>(buf.mem.data);
    buf.staging = ext ? nullptr : buf.mem.data + state_bytes;  // (none with the masters outside: nothing delivered)
    im->bufs.push_back(std::move(buf));
  }

  // Swap space.
  if (o.home == StateHome::kNvme) {
    im->swap = o.swap;
    // int8 state: room for the partitions' alignment gaps too.
    std::uint64_t gaps = 0;
    if (sd == cpu::StateDType::kInt8) {
      gaps = o.max_partitions ? o.max_partitions * (cpu::kStateBlock - 1) : o.max_elements / 16;
    }
    const std::uint64_t chunks = (o.max_elements + gaps + ce - 1) / ce;
    // state_copies 1: the spare slots (one per buffer for the writes in flight, and the pass's).
    const std::uint64_t spares = o.state_copies == 1 ? o.buffer_count + o.speculation_chunks : 0;
    const std::uint64_t slots = o.state_copies * chunks + spares;
    // Bounded here when the optimizer sizes its own files or reserves room in a shared space.
    if (im->swap == nullptr || o.nvme_reserve) im->capacity = chunks * ce;
    if (im->swap != nullptr && o.nvme_reserve) {
      // Every slot of every chunk, and the spares (a short last chunk takes less).
      const std::uint64_t bytes = slots * detail::round_up(state_bytes, 4096);
      TIER_ASSIGN_OR_RETURN(im->nvme_reserved, o.nvme_reserve(bytes, "tier/optimizer/state"));
    }
    if (im->swap == nullptr) {
      nvme::SwapSpaceOptions so = o.swap_options;
      // Every slot; a striped extent may put one stripe unit more than its share on a path, and
      // small extents go whole to one path, so leave a chunk of slack per path.
      const std::uint64_t n_paths = so.paths.size();
      const std::uint64_t unit = so.stripe_unit ? so.stripe_unit : so.block_size;
      const std::uint64_t per_extent = detail::round_up(state_bytes, unit * n_paths) / n_paths;
      so.bytes_per_path = slots * per_extent + 2 * detail::round_up(state_bytes, unit);
      if (so.arena == nullptr) so.arena = im->arena;
      if (so.counters == nullptr) so.counters = o.counters;
      so.metrics_prefix = "optim.swap";  // beside the engine's nvme.swap.* in shared counters
      TIER_ASSIGN_OR_RETURN(im->own_swap, nvme::SwapSpace::create(so));
      im->swap = im->own_swap.get();
    }
    im->pool_size = spares;  // allocated with the first chunk (nothing is written before)
  }
  im->workers = std::make_unique<detail::Workers>(o.threads);
  (void)cpu::simd_target();  // applies TIER_CPU_SIMD before any kernel runs

  std::int64_t pinned = 0;
  for (const Buffer& b : im->bufs) pinned += static_cast<std::int64_t>(b.mem.bytes);
  im->report_resident(im->own_pinned_bytes(), 0);
  if (o.counters) {
    o.counters->set_info("optim.home", state_home_name(o.home));
    o.counters->set_metric("optim.chunk_elements", static_cast<double>(ce));
    o.counters->set_metric("optim.pinned_bytes", static_cast<double>(pinned));
  }
  return std::unique_ptr<OffloadedOptimizer>(new OffloadedOptimizer(std::move(im)));
}

// ------------------------------------------------------------------------------------ registration

namespace {

Status open_chunk(OffloadedOptimizer::Impl& im, PartitionId first) {
  Chunk c;
  c.start = im.elements;
  c.stride = im.chunk_elems;
  c.layout = im.layout_of(c.stride);
  c.first = c.last = first;
  if (im.nvme()) {
    Buffer& b = im.bufs[im.chunks.size() % im.bufs.size()];
    if (b.pending.valid()) {
      Status s = b.pending.wait();
      b.pending = nvme::IoFuture();
      if (!s.ok()) {
        im.poisoned =
            s.with_context("writing the initial state of a chunk during registration (create a new optimizer)");
        return im.poisoned;
      }
    }
    im.open_base = b.state;
  } else {
    c.host = alloc_record(c.bytes());
    if (!c.host) {
      return resource_exhausted(
          str("optimizer: no host memory for a chunk of ", format_bytes(c.bytes()), " (host home)"));
    }
    im.open_base = c.host.get();
    im.report_resident(static_cast<std::int64_t>(c.bytes()), 0);
  }
  // Zero moments (and zero int8 scales, which decode to zero moments) in every format.
  const std::uint64_t after_master = c.layout.offset[static_cast<int>(Section::kExpAvg)];
  std::memset(reinterpret_cast<std::byte*>(im.open_base) + after_master, 0, c.bytes() - after_master);
  im.chunks.push_back(std::move(c));
  im.chunk_open = true;
  im.open_fill = 0;
  return {};
}

Status close_chunk(OffloadedOptimizer::Impl& im) {
  Chunk& c = im.chunks.back();
  c.numel = im.open_fill;
  im.chunk_open = false;
  if (!im.nvme()) return {};
  // A short last chunk is stored compactly: its sections move down to its own stride's layout
  // (every offset only decreases, so moving them in order never overwrites one not yet moved).
  const std::uint64_t stride = detail::round_up(c.numel, detail::kSectionAlign);
  if (stride < c.stride) {
    const ChunkLayout small = im.layout_of(stride);
    const cpu::StateDType d = im.state_dtype();
    const std::uint64_t used[5] = {0, c.numel * dtype_size(cpu::exp_avg_dtype(d)),
                                   c.numel * dtype_size(cpu::exp_avg_sq_dtype(d)),
                                   cpu::state_scale_count(d, c.numel) * 4, cpu::state_scale_count(d, c.numel) * 4};
    auto* base = reinterpret_cast<std::byte*>(im.open_base);
    for (int s = 1; s < 5; ++s) {
      if (used[s]) std::memmove(base + small.offset[s], base + c.layout.offset[s], used[s]);
    }
    c.stride = stride;
    c.layout = small;
  }
  // state_copies 1: slots and spares trade places, so each has a whole chunk's room (a short last
  // chunk's slot too). The spares come with the first chunk.
  const std::uint64_t slot_bytes = im.once() ? im.layout_of(im.chunk_elems).bytes : c.bytes();
  while (im.once() && im.pool.size() < im.pool_size && im.chunks.size() == 1) {
    auto e = im.swap->allocate(slot_bytes);
    if (!e.ok()) {
      im.poisoned = e.status().with_context(str("optimizer: spare slot ", im.pool.size() + 1, " of ", im.pool_size,
                                                " (", format_bytes(slot_bytes), " each; state_copies 1)"));
      return im.poisoned;
    }
    im.report_resident(0, static_cast<std::int64_t>(e->reserved_bytes()));
    im.nvme_slot_bytes += e->reserved_bytes();
    im.pool.push_back(std::move(e).value());
  }
  for (unsigned k = 0; k < im.opt.state_copies; ++k) {
    auto e = im.swap->allocate(slot_bytes);
    if (!e.ok()) {
      im.poisoned = e.status().with_context(str("optimizer: swap space for chunk ", im.chunks.size() - 1, " (",
                                                format_bytes(c.bytes()), " x ", im.opt.state_copies,
                                                " slots; give a larger swap space or max_elements)"));
      return im.poisoned;
    }
    c.slot[k] = std::move(e).value();
  }
  im.report_resident(0, static_cast<std::int64_t>(c.slot[0].reserved_bytes() + c.slot[1].reserved_bytes()));
  im.nvme_slot_bytes += c.slot[0].reserved_bytes() + c.slot[1].reserved_bytes();
  Buffer& b = im.bufs[(im.chunks.size() - 1) % im.bufs.size()];
  c.committed = 0;
  b.pending = im.swap->write(c.slot[0], b.state, c.bytes());
  return {};
}

}  // namespace

Result<PartitionId> OffloadedOptimizer::add_partition(const PartitionSpec& spec) {
  Impl& im = *impl_;
  if (!im.poisoned.ok()) return im.poisoned;
  if (im.registered) {
    return failed_precondition("optimizer: add_partition after finish_registration(); register every partition first");
  }
  if (spec.numel == 0) return invalid_argument(str("optimizer: partition '", spec.name, "' has 0 elements"));
  if (spec.group < 0 || static_cast<std::size_t>(spec.group) >= im.groups.size()) {
    return invalid_argument(str("optimizer: partition '", spec.name, "' names group ", spec.group, " but there are ",
                                im.groups.size(), " groups (add_group() adds one)"));
  }
  if (spec.output != ParamOutput::kNone && spec.output != ParamOutput::kF16 && spec.output != ParamOutput::kBF16 &&
      spec.output != ParamOutput::kF32) {
    return invalid_argument(str("optimizer: partition '", spec.name, "' has an unknown output dtype"));
  }
  if (spec.numel > (std::uint64_t{1} << 56)) {
    return invalid_argument(str("optimizer: partition '", spec.name, "' has an implausible ", spec.numel, " elements"));
  }
  if (im.parts.size() >= 0xFFFFFFFFull) return resource_exhausted("optimizer: too many partitions");
  if (im.external() && spec.output != ParamOutput::kNone && spec.output != ParamOutput::kF32) {
    return invalid_argument(str("optimizer: partition '", spec.name, "' asks for ", param_output_name(spec.output),
                                " params, but its fp32 master is the caller's (master_source): it is its params"));
  }
  // int8 state: the partition starts on a block boundary (its blocks then never straddle another
  // partition, and chunk boundaries fall on its block boundaries). The gap stays zero.
  const std::uint64_t gap =
      im.state_dtype() == cpu::StateDType::kInt8 ? detail::round_up(im.elements, cpu::kStateBlock) - im.elements : 0;
  if (im.capacity > 0 &&
      (im.numel_total + spec.numel > im.opt.max_elements || im.elements + gap + spec.numel > im.capacity)) {
    return resource_exhausted(str("optimizer: partition '", spec.name, "' (", spec.numel, " elements) would bring the ",
                                  "state to ", im.numel_total + spec.numel, " elements (",
                                  im.elements + gap + spec.numel, " with the int8 alignment gaps), more than ",
                                  "max_elements ", im.opt.max_elements, " (", im.capacity,
                                  ") the swap space was sized for", gap ? "; give max_partitions for int8 state" : ""));
  }
  if (gap) {
    // elements is not on a chunk boundary (those are multiples of 256), so a chunk is open.
    if (!im.external()) std::memset(im.open_base + im.open_fill, 0, gap * sizeof(float));  // (the master section)
    im.open_fill += gap;
    im.elements += gap;
    if (im.open_fill == im.chunk_elems) TIER_RETURN_IF_ERROR(close_chunk(im));
  }
  const auto id = static_cast<PartitionId>(im.parts.size());
  Partition p;
  p.start = im.elements;
  p.numel = spec.numel;
  p.group = spec.group;
  // The caller's master is the partition's params: nothing is delivered.
  p.output = im.external() ? ParamOutput::kNone : spec.output;
  p.name = spec.name;
  im.parts.push_back(std::move(p));
  im.numel_total += spec.numel;
  if (im.external()) {
    im.masters.emplace_back();
    if (spec.initial != nullptr) {
      // Initial values given all the same: they go to the caller's master.
      Status s = im.with_master(id, true, [&](float* m) {
        std::memcpy(m, spec.initial, spec.numel * sizeof(float));
        return Status();
      });
      if (!s.ok()) {
        im.parts.pop_back();
        im.masters.pop_back();
        im.numel_total -= spec.numel;
        return s;
      }
    }
  }

  std::uint64_t done = 0;
  while (done < spec.numel) {
    if (!im.chunk_open) TIER_RETURN_IF_ERROR(open_chunk(im, id));
    Chunk& c = im.chunks.back();
    const std::uint64_t take = std::min(spec.numel - done, im.chunk_elems - im.open_fill);
    if (!im.external()) {  // the master section (fp32) comes first; the caller holds it otherwise
      float* dst = im.open_base + im.open_fill;
      if (spec.initial) {
        std::memcpy(dst, spec.initial + done, take * sizeof(float));
      } else {
        std::memset(dst, 0, take * sizeof(float));
      }
    }
    c.last = id;
    im.open_fill += take;
    im.elements += take;
    done += take;
    if (im.open_fill == im.chunk_elems) TIER_RETURN_IF_ERROR(close_chunk(im));
  }
  return id;
}

Status OffloadedOptimizer::finish_registration() {
  Impl& im = *impl_;
  if (!im.poisoned.ok()) return im.poisoned;
  if (im.registered) return {};
  if (im.chunk_open) TIER_RETURN_IF_ERROR(close_chunk(im));
  for (Buffer& b : im.bufs) {
    if (!b.pending.valid()) continue;
    Status s = b.pending.wait();
    b.pending = nvme::IoFuture();
    if (!s.ok() && im.poisoned.ok()) {
      im.poisoned = s.with_context("writing the initial state of a chunk during registration (create a new optimizer)");
    }
  }
  if (!im.poisoned.ok()) return im.poisoned;
  im.registered = true;
  if (im.opt.counters) {
    im.opt.counters->set_metric("optim.partitions", static_cast<double>(im.parts.size()));
    im.opt.counters->set_metric("optim.elements", static_cast<double>(im.numel_total));
    im.opt.counters->set_metric("optim.chunks", static_cast<double>(im.chunks.size()));
  }
  return {};
}

Result<int> OffloadedOptimizer::add_group(const cpu::AdamHyperParams& hp) {
  Impl& im = *impl_;
  if (hp.kind == cpu::OptimizerKind::kLamb && im.state_dtype() != cpu::StateDType::kF32) {
    return invalid_argument(str("optimizer add_group: Lamb needs fp32 moments; the state dtype is ",
                                cpu::state_dtype_name(im.state_dtype())));
  }
  TIER_ASSIGN_OR_RETURN(cpu::AdamGroup g, cpu::AdamGroup::create(hp));
  // A new group starts at the step the others are at, so that its bias correction matches.
  std::lock_guard<std::mutex> lock(im.groups_mu);
  if (!im.groups.empty()) TIER_RETURN_IF_ERROR(g.set_step(im.groups[0].step()));
  im.groups.push_back(std::move(g));
  return static_cast<int>(im.groups.size() - 1);
}

// ------------------------------------------------------------------------------------ gradients

Status OffloadedOptimizer::add_grad(PartitionId id, cpu::ConstTensorRef grad, GradMode mode) {
  Impl& im = *impl_;
  TIER_RETURN_IF_ERROR(im.usable("add_grad"));
  if (id >= im.parts.size()) {
    return invalid_argument(
        str("optimizer add_grad: partition ", id, " does not exist (", im.parts.size(), " partitions)"));
  }
  Partition& p = im.parts[id];
  if (grad.numel != p.numel) {
    return invalid_argument(str("optimizer add_grad: ", partition_label(id, p), " has ", p.numel,
                                " elements but the gradient has ", grad.numel));
  }
  if (!cpu::is_float_dtype(grad.dtype)) {
    return invalid_argument(str("optimizer add_grad: ", partition_label(id, p), ": gradient dtype ",
                                dtype_name(grad.dtype), " is not supported; use fp32, fp16 or bf16"));
  }
  if (grad.data == nullptr) return invalid_argument(str("optimizer add_grad: ", partition_label(id, p), ": null data"));
  const int gas = im.opt.gradient_accumulation_steps;
  if (p.contributions >= gas) {
    return failed_precondition(str("optimizer add_grad: ", partition_label(id, p), " already has ", p.contributions,
                                   " gradient(s) this step (gradient_accumulation_steps = ", gas,
                                   "); call step() or clear_grads() first"));
  }
  const bool final = p.contributions + 1 == gas;
  if (mode == GradMode::kBorrow) {
    if (gas != 1) {
      return invalid_argument(str("optimizer add_grad: ", partition_label(id, p),
                                  ": a borrowed gradient needs gradient_accumulation_steps == 1 (it is ", gas,
                                  "); use GradMode::kCopy to accumulate"));
    }
    if (reinterpret_cast<std::uintptr_t>(grad.data) % dtype_size(grad.dtype) != 0) {
      return invalid_argument(str("optimizer add_grad: ", partition_label(id, p), ": data is not aligned to its ",
                                  dtype_size(grad.dtype), "-byte elements"));
    }
    auto s = detail::sum_of_squares(grad, im.workers.get());
    if (!s.ok()) return s.status().with_context(str("optimizer add_grad: ", partition_label(id, p)));
    p.grad = grad.data;
    p.grad_dtype = grad.dtype;
    p.sumsq = *s;
    p.norm_known = true;
  } else {
    if (!p.acc) {
      p.acc = alloc_floats(p.numel);
      if (!p.acc) {
        return resource_exhausted(str("optimizer add_grad: no host memory for the fp32 gradient accumulator of ",
                                      partition_label(id, p), " (", format_bytes(p.numel * 4), ")"));
      }
      const std::uint64_t bytes = detail::round_up(p.numel * sizeof(float), 4096);
      im.accumulator_bytes += bytes;
      im.report_resident(static_cast<std::int64_t>(bytes), 0);
    }
    double s = 0;
    const Status st =
        detail::accumulate_grad(p.acc.get(), grad, p.contributions == 0, final ? &s : nullptr, im.workers.get());
    if (!st.ok()) return st.with_context(str("optimizer add_grad: ", partition_label(id, p)));
    p.grad = p.acc.get();
    p.grad_dtype = DType::kF32;
    if (final) {
      p.sumsq = s;
      p.norm_known = true;
    }
  }
  if (p.contributions++ == 0) ++im.with_grads;
  if (final) im.note_ready(id);
  return {};
}

Status OffloadedOptimizer::declare_grad(PartitionId id, double sumsq) {
  Impl& im = *impl_;
  TIER_RETURN_IF_ERROR(im.usable("declare_grad"));
  if (id >= im.parts.size()) {
    return invalid_argument(
        str("optimizer declare_grad: partition ", id, " does not exist (", im.parts.size(), " partitions)"));
  }
  if (sumsq < 0) {  // inf and nan pass: a non-finite gradient is an overflow, as with add_grad
    return invalid_argument(
        str("optimizer declare_grad: ", partition_label(id, im.parts[id]), ": sum of squares ", sumsq, " is negative"));
  }
  Partition& p = im.parts[id];
  if (p.contributions != 0) {
    return failed_precondition(str("optimizer declare_grad: ", partition_label(id, p),
                                   " already has a gradient this step; call step() or clear_grads() first"));
  }
  p.declared = true;
  p.grad = nullptr;
  p.grad_dtype = DType::kF32;
  p.sumsq = sumsq;
  p.norm_known = true;
  p.contributions = im.opt.gradient_accumulation_steps;
  ++im.with_grads;
  im.note_ready(id);
  return {};
}

void OffloadedOptimizer::clear_grads() noexcept {
  Impl& im = *impl_;
  cancel_overlapped_step();
  if (im.owed) {
    // The failed step still to finish needs them (state_copies 1).
    log(LogLevel::kError, str("optimizer clear_grads: step ", im.owed->step,
                              " failed part-way and is owed; its gradients are kept until step() finishes it"));
    return;
  }
  for (Partition& p : im.parts) {
    p.grad = nullptr;
    p.declared = false;
    p.contributions = 0;
    p.norm_known = false;
    p.sumsq = 0;
  }
  im.with_grads = 0;
}

std::uint64_t OffloadedOptimizer::partitions_with_grads() const noexcept {
  return impl_->with_grads.load();
}

// ------------------------------------------------------------------------------------ the step

namespace {

// Puts the groups' step counters back (a pass that was not committed advanced them).
void restore_steps(OffloadedOptimizer::Impl& im, const std::vector<std::int64_t>& old_steps) {
  std::lock_guard<std::mutex> lock(im.groups_mu);
  for (std::size_t g = 0; g < old_steps.size(); ++g) im.groups[g].set_step(old_steps[g]).ignore();
}

// master_source: the masters an overlapped pass filled are given back to the source, those of the
// chunks whose update was committed with their updated values (waiting in the pipeline buffers,
// which the pass's reads did not touch there), the others as they were. Before anything else uses
// the buffers.
void settle_pass_masters(OffloadedOptimizer::Impl& im, detail::Overlap& ov, bool committed) {
  for (const detail::LeftoverRead& f : ov.filled) {
    Status s = im.settle_masters(im.chunks[f.chunk], im.bufs[f.buffer].state, committed && ov.written[f.chunk] != 0);
    if (!s.ok()) log(LogLevel::kError, str("optimizer overlapped step: ", s.to_string()));
  }
  ov.filled.clear();
}

// Counters and the timeline after a step.
void publish_step(const OffloadedOptimizer::Impl& im, StepReport& r, Clock::time_point t0) {
  {
    std::lock_guard<std::mutex> lock(im.groups_mu);
    r.step = im.groups[0].step();
  }
  r.seconds = since(t0);
  if (Counters* c = im.opt.counters) {
    c->add_metric("optim.steps", 1);
    if (!r.applied) c->add_metric("optim.steps_skipped", 1);
    if (r.overlapped) c->add_metric("optim.overlapped_steps", 1);
    if (r.redone) c->add_metric("optim.redone_steps", 1);
    c->set_metric("optim.step_seconds", r.seconds);
    c->set_metric("optim.read_busy_seconds", r.read.busy_seconds);
    c->set_metric("optim.write_busy_seconds", r.write.busy_seconds);
    c->set_metric("optim.update_seconds", r.update.busy_seconds);
    c->set_metric("optim.update_wait_seconds", r.update_wait_seconds);
    c->set_metric("optim.grad_norm", r.grad_norm);
    c->set_metric("optim.loss_scale", r.next_loss_scale);
    c->trace_span("optimizer",
                  str("optimizer step ", r.step, r.applied ? "" : " (skipped)", r.overlapped ? " (overlapped)" : ""),
                  t0, Clock::now(), r.read.bytes + r.write.bytes);
  }
}

// An overlapped pass: waits until every partition of chunk c has its final gradient, all
// gradients are in, or the pass is aborted; false when aborted. Counts the chunks updated before
// all gradients were in.
bool wait_for_chunk(detail::Overlap& ov, const Chunk& c, std::uint64_t* speculated) {
  std::unique_lock<std::mutex> lk(ov.mu);
  ov.cv.wait(lk, [&] {
    if (ov.abort || ov.all_in) return true;
    for (PartitionId pid = c.first; pid <= c.last; ++pid) {
      if (!ov.ready[pid]) return false;
    }
    return true;
  });
  if (!ov.abort && !ov.all_in) {
    ++*speculated;
    ++ov.speculated;
  }
  return !ov.abort;
}

// A serial step's walk over the chunks other than 0, 1, ...: a redo that starts with the chunks an
// abandoned pass left read in the buffers (`preloaded`, run_pipeline's).
struct Walk {
  std::vector<std::size_t> order;
  std::vector<std::uint8_t> preloaded;
};

// The redo's walk after a pass that stopped with `leftover` read: the buffers' chunks first, each
// at a position that maps to its buffer (position k uses buffer k % B), the others in order.
//
// With `whole_partitions` (the step holds something per partition from its first chunk to its
// last: a declared gradient from the GradSource, a ParamSink's lease) a leftover chunk goes first
// only when every partition it holds has all its chunks among those going first: the walk then
// visits each partition's chunks without a gap, so what it holds for a partition is held for that
// partition's own chunks only. Taking a chunk from the middle of a partition first would hold that
// partition's gradient and its params' lease across the whole walk (at 7B a 500 MiB gradient of
// the output layer beside the embedding's, which then found no room in the host budget). The
// chunks left out are read again, as any other.
//
// `done` (state_copies 1), when given: the chunks that took the step's update already, left out.
Walk walk_after(const std::vector<detail::LeftoverRead>& leftover, const std::vector<Chunk>& all, std::size_t parts,
                std::size_t buffers, bool whole_partitions, const std::vector<std::uint8_t>* done = nullptr) {
  Walk w;
  const std::size_t chunks = all.size();
  std::vector<std::uint8_t> placed(chunks, 0);
  std::size_t todo = chunks;
  if (done != nullptr && done->size() == chunks) {
    placed = *done;
    todo -= static_cast<std::size_t>(std::count(placed.begin(), placed.end(), std::uint8_t{1}));
  }
  const std::size_t first = std::min(todo, buffers);
  std::vector<std::size_t> holds(first, chunks);  // chunks: none
  for (const detail::LeftoverRead& l : leftover) {
    if (l.buffer < first && l.chunk < chunks && !placed[l.chunk]) {
      holds[l.buffer] = l.chunk;
      placed[l.chunk] = 1;
    }
  }
  // Each partition's chunks [lo, hi]; drop leftover chunks until none holds a partition with a
  // chunk outside them (dropping one can make another's partition incomplete: repeat).
  std::vector<std::size_t> lo(parts, chunks), hi(parts, 0);
  for (std::size_t i = 0; i < chunks; ++i) {
    for (PartitionId pid = all[i].first; pid <= all[i].last && pid < parts; ++pid) {
      lo[pid] = std::min(lo[pid], i);
      hi[pid] = std::max(hi[pid], i);
    }
  }
  for (bool changed = whole_partitions; changed;) {
    changed = false;
    for (std::size_t& h : holds) {
      if (h >= chunks) continue;
      bool whole = true;
      for (PartitionId pid = all[h].first; pid <= all[h].last && pid < parts && whole; ++pid) {
        for (std::size_t c = lo[pid]; c <= hi[pid] && whole; ++c) whole = placed[c] != 0;
      }
      if (!whole) {
        placed[h] = 0;
        h = chunks;
        changed = true;
      }
    }
  }
  std::size_t next = 0;
  auto take = [&] {
    while (placed[next]) ++next;
    placed[next] = 1;
    return next++;
  };
  for (std::size_t b = 0; b < first; ++b) {
    const bool have = holds[b] < chunks;
    w.order.push_back(have ? holds[b] : take());
    w.preloaded.push_back(have ? 1 : 0);
  }
  while (w.order.size() < todo) w.order.push_back(take());
  return w;
}

Status restore_outputs(OffloadedOptimizer& self, OffloadedOptimizer::Impl& im, const StepOptions& o,
                       const std::vector<std::uint8_t>& touched);

// After a step that failed with the NVMe state intact: the params it had delivered already (its
// update of them was not committed) are delivered again from the committed masters, so that the
// params the training reads are the state's, whatever the caller does next (retry, clear_grads and
// a new backward, or a new backward adding to the kept gradients). A sink gathering pieces drops
// what it gathered first. Returns `failure` with what happened to the params in its message.
Status after_failed_step(OffloadedOptimizer& self, OffloadedOptimizer::Impl& im, const StepOptions& o,
                         const std::vector<std::uint8_t>& delivered, Status failure) {
  if (std::find(delivered.begin(), delivered.end(), std::uint8_t{1}) == delivered.end()) return failure;
  if (o.sink) o.sink->abandoned();
  Status restored = restore_outputs(self, im, o, delivered);
  if (restored.ok()) return failure;
  im.outputs_stale = true;
  log(LogLevel::kError,
      str("optimizer: the params a failed step had delivered could not be delivered again: ", restored.to_string()));
  return failure.with_context(str("the params it had delivered before failing could not be put back (",
                                  restored.to_string(),
                                  "); they are ahead of the optimizer state until a step succeeds or they are "
                                  "rewritten from read_params()"));
}

// The step, serial (spec null) or as an overlapped pass (see start_overlapped_step): the pass
// walks the chunks in reverse, waits for each chunk's gradients, assumes no clipping and no
// overflow, and commits nothing. A serial step walks `walk` when given, else 0, 1, ...
Result<StepReport> run_step(OffloadedOptimizer& self, OffloadedOptimizer::Impl& im, const StepOptions& options,
                            detail::Overlap* spec, const Walk* walk = nullptr) {
  TIER_RETURN_IF_ERROR(im.usable("step", false, /*finishing=*/true));
  // state_copies 1: a step that failed part-way is finished with what it began with.
  detail::Owed* const owed = spec ? nullptr : im.owed.get();
  struct SkipScope {  // the partitions left untouched, for this step only
    std::vector<std::uint8_t>* v;
    ~SkipScope() {
      if (v) v->clear();
    }
  } skip_scope{spec ? nullptr : &im.skipping};
  // (An overlapped pass's skipping vector is sized by start_overlapped_step, filled by
  // finish_overlapped_step when every gradient is in, and cleared by whoever joins the pass.)
  if (options.skip_missing_grads && !spec) {
    im.skipping.assign(im.parts.size(), 0);
    for (std::size_t i = 0; i < im.parts.size(); ++i) im.skipping[i] = im.parts[i].contributions == 0 ? 1 : 0;
  }
  const auto t0 = Clock::now();
  StepReport r;
  r.chunks = im.chunks.size();

  // The global norm from the per-partition sums taken at intake, in partition order.
  double total = 0;
  for (std::size_t i = 0; i < im.parts.size() && !spec; ++i) {
    Partition& p = im.parts[i];
    if (p.contributions == 0) {
      ++r.zero_grad_partitions;
      continue;
    }
    if (owed) continue;
    if (!p.norm_known) {
      // Fewer gradients than accumulation steps (a parameter unused in some micro-steps).
      auto s = detail::sum_of_squares(cpu::ConstTensorRef(p.grad, p.grad_dtype, p.numel), im.workers.get());
      if (!s.ok()) {
        if (options.norm) {
          // The other ranks wait in the all-reduce: take part with a nan, which makes them skip.
          double poisoned = std::numeric_limits<double>::quiet_NaN();
          options.norm->all_reduce_sumsq(poisoned).ignore();
        }
        return s.status();
      }
      p.sumsq = *s;
      p.norm_known = true;
      ++r.late_norm_partitions;
    }
    total += p.sumsq;
  }
  if (owed) total = owed->total;  // (combined across ranks when it began)
  if (!spec && !owed && options.norm) {
    Status reduced = options.norm->all_reduce_sumsq(total);
    if (!reduced.ok()) return reduced.with_context("optimizer step: combining the gradient norm across ranks");
  }
  const double scale = im.scaler->scale();
  r.loss_scale = scale;
  r.overflow = !std::isfinite(total);
  r.grad_norm = std::sqrt(total) / scale;

  auto publish = [&] { publish_step(im, r, t0); };

  if (!spec && !owed && r.overflow && (im.opt.skip_non_finite || im.scaler->enabled())) {
    r.applied = false;
    r.next_loss_scale = im.scaler->update(true);
    ++im.steps_skipped;
    self.clear_grads();
    if (!im.scaler->enabled()) {
      log_once("optim.non_finite", LogLevel::kWarn,
               "optimizer: a gradient is inf/nan; the step is skipped (reported in StepReport::overflow)");
    }
    publish();
    return r;
  }

  // An overlapped pass speculates: no clipping (validated by finish_overlapped_step).
  const float clip = owed                                ? owed->clip
                     : !spec && im.opt.max_grad_norm > 0 ? cpu::clip_coefficient(r.grad_norm, im.opt.max_grad_norm)
                                                         : 1.0f;
  r.clip_coefficient = clip;
  const double grad_scale = static_cast<double>(clip) / scale;

  std::vector<std::int64_t> old_steps;
  std::vector<cpu::AdamStep> steps;
  {
    std::lock_guard<std::mutex> lock(im.groups_mu);
    for (std::size_t g = 0; g < im.groups.size(); ++g) {
      old_steps.push_back(im.groups[g].step());
      auto st = im.groups[g].begin_step(grad_scale);
      if (!st.ok()) {
        for (std::size_t k = 0; k < g; ++k) im.groups[k].set_step(old_steps[k]).ignore();
        return st.status().with_context(str("optimizer step: parameter group ", g));
      }
      steps.push_back(std::move(st).value());
    }
  }
  // Finishing: the counters advanced as when it began; the constants are the ones it began with
  // (a scheduler may have set the next step's lr since).
  if (owed) steps = owed->steps;
  if (spec) spec->steps = steps;
  auto rollback = [&] {
    std::lock_guard<std::mutex> lock(im.groups_mu);
    for (std::size_t g = 0; g < old_steps.size(); ++g) im.groups[g].set_step(old_steps[g]).ignore();
  };

  // state_copies 1, serial: which chunks this call updates (1) and which it only delivers from
  // their state (2: chunks a failed try updated, of partitions it left half delivered), walked in
  // order unless the caller gave the walk (finish_overlapped_step's rest, which names chunks to
  // update only).
  std::vector<std::uint8_t> todo;
  std::vector<std::uint8_t> pending_part;  // partitions with a chunk to update
  Walk rest;
  if (im.once() && !spec) {
    if (im.done.size() != im.chunks.size()) im.done.assign(im.chunks.size(), 0);
    if (std::find(im.done.begin(), im.done.end(), std::uint8_t{1}) != im.done.end()) {
      todo.assign(im.chunks.size(), 0);
      pending_part.assign(im.parts.size(), 0);
      for (std::size_t i = 0; i < im.chunks.size(); ++i) {
        if (im.done[i]) continue;
        todo[i] = 1;
        for (PartitionId pid = im.chunks[i].first; pid <= im.chunks[i].last; ++pid) pending_part[pid] = 1;
      }
      for (std::size_t i = 0; i < im.chunks.size() && owed && owed->redeliver; ++i) {
        if (todo[i]) continue;
        for (PartitionId pid = im.chunks[i].first; pid <= im.chunks[i].last; ++pid) {
          if (pending_part[pid] && im.parts[pid].output != ParamOutput::kNone) todo[i] = 2;
        }
      }
      if (walk == nullptr) {
        for (std::size_t i = 0; i < im.chunks.size(); ++i) {
          if (todo[i]) rest.order.push_back(i);
        }
        walk = &rest;
      }
    }
  }
  // The chunks a walk updates (a chunk delivered from its state fetches no gradient).
  auto updates = [&](std::size_t i) { return todo.empty() || todo[i] == 1; };

  // Declared gradients are fetched before a partition's first chunk and handed back after its last
  // (an overlapped pass, which goes in reverse, hands them back after their first).
  bool any_declared = spec != nullptr;  // a pass cannot know yet: it looks at each chunk's
  for (std::size_t i = 0; i < im.parts.size() && !spec; ++i) any_declared = any_declared || im.parts[i].declared;
  std::vector<std::uint8_t> fetched(im.parts.size(), 0);
  if (!spec && any_declared && options.grads == nullptr) {
    rollback();
    return failed_precondition(
        "optimizer step: gradients were declared (declare_grad) but StepOptions::grads (a GradSource) is not set");
  }
  auto fetch_grads = [&](const Chunk& c) -> Status {
    for (PartitionId pid = c.first; pid <= c.last; ++pid) {
      Partition& p = im.parts[pid];
      if (!p.declared || p.grad != nullptr) continue;
      if (options.grads == nullptr) {
        return failed_precondition(
            "optimizer step: gradients were declared (declare_grad) but StepOptions::grads (a GradSource) is not set");
      }
      fetched[pid] = 1;
      auto g = options.grads->acquire(pid);
      if (!g.ok()) return g.status().with_context(str("the gradient of ", partition_label(pid, p)));
      const cpu::ConstTensorRef ref = *g;
      p.grad = ref.data;  // set first, so that a refused gradient is still handed back
      if (ref.numel != p.numel || !cpu::is_float_dtype(ref.dtype) || ref.data == nullptr) {
        return invalid_argument(str("optimizer step: the GradSource gave ", partition_label(pid, p), " ", ref.numel,
                                    " elements of ", dtype_name(ref.dtype), "; it needs ", p.numel,
                                    " elements of fp32, fp16 or bf16"));
      }
      p.grad_dtype = ref.dtype;
    }
    return {};
  };
  // A gradient is handed back after the last of its partition's chunks in the walk, whatever its
  // order (ascending, the pass's reverse, a redo's): chunks left per partition, counted afresh for
  // each walk over the chunks.
  std::vector<std::uint32_t> chunks_left;
  auto count_chunks = [&](bool over_walk) {
    chunks_left.assign(im.parts.size(), 0);
    for (std::size_t k = 0; k < (over_walk && walk ? walk->order.size() : im.chunks.size()); ++k) {
      const std::size_t i = over_walk && walk ? walk->order[k] : k;
      if (over_walk && !updates(i)) continue;
      for (PartitionId pid = im.chunks[i].first; pid <= im.chunks[i].last; ++pid) ++chunks_left[pid];
    }
  };
  auto return_grads = [&](const Chunk* c) {
    for (PartitionId pid = c ? c->first : 0; pid < (c ? c->last + 1 : im.parts.size()); ++pid) {
      if (!fetched[pid]) continue;
      Partition& p = im.parts[pid];
      if (!p.declared || p.grad == nullptr) continue;
      // The partition continues in a later chunk of the walk.
      if (c && --chunks_left[pid] > 0) continue;
      fetched[pid] = 0;
      p.grad = nullptr;
      if (options.grads != nullptr) options.grads->release(pid);
    }
  };
  // Lamb: pass 1 reads the whole state once (NVMe home: every chunk's committed slot, nothing
  // written) for each Lamb partition's ||p|| and ||u||; pass 2 below is the usual pipeline with
  // each Lamb partition's step scaled by its trust ratio.
  std::vector<cpu::AdamStep> part_steps;
  detail::PipelineStats lamb_pass;  // added to the report's streams after pass 2
  bool any_lamb = false;
  for (const Partition& p : im.parts) {
    // (the step's own constants: a group's kind is fixed when the step begins)
    any_lamb = any_lamb || steps[static_cast<std::size_t>(p.group)].hyper_params().kind == cpu::OptimizerKind::kLamb;
  }
  if (any_lamb && im.external()) {
    rollback();
    return failed_precondition(
        "optimizer step: a Lamb group's norms pass reads the masters, which are the caller's here (master_source)");
  }
  // Finishing: the trust ratios are the ones pass 1 took over the state the step began with.
  if (owed) part_steps = owed->part_steps;
  if (any_declared) count_chunks(/*over_walk=*/!(any_lamb && !owed));
  if (any_lamb && !owed) {
    std::vector<std::unique_ptr<cpu::LambNorms>> norms(im.parts.size());
    for (std::size_t i = 0; i < im.parts.size(); ++i) {
      const Partition& p = im.parts[i];
      if (steps[static_cast<std::size_t>(p.group)].hyper_params().kind == cpu::OptimizerKind::kLamb) {
        norms[i] = std::make_unique<cpu::LambNorms>(p.numel);
      }
    }
    // Declared gradients are fetched for pass 1 as for pass 2 (and handed back in between).
    auto norms_chunk = [&](std::size_t i, float* base) -> Status {
      const Chunk& c = im.chunks[i];
      if (any_declared) TIER_RETURN_IF_ERROR(fetch_grads(c));
      TIER_RETURN_IF_ERROR(lamb_norms_chunk(im, c, base, steps, norms));
      if (any_declared) return_grads(&c);
      return {};
    };
    Status s1;
    const auto tn = Clock::now();
    if (im.nvme()) {
      s1 = detail::run_pipeline(
          *im.swap, im.chunks, im.bufs, true, false, [&](std::size_t i, Buffer& b) { return norms_chunk(i, b.state); },
          &lamb_pass);
    } else {
      for (std::size_t i = 0; i < im.chunks.size() && s1.ok(); ++i) s1 = norms_chunk(i, im.chunks[i].host.get());
    }
    lamb_pass.update.busy_seconds = since(tn);
    if (!s1.ok()) {
      if (any_declared) return_grads(nullptr);
      rollback();
      ++im.steps_failed;
      return s1.with_context(str("optimizer step ", old_steps[0] + 1,
                                 " (lamb norms pass) was not applied; the state is intact and the gradients are kept "
                                 "(call step() again to retry, or clear_grads())"));
    }
    if (any_declared) count_chunks(true);  // pass 2 walks the chunks again
    part_steps.reserve(im.parts.size());
    for (std::size_t i = 0; i < im.parts.size(); ++i) {
      const cpu::AdamStep& st = steps[static_cast<std::size_t>(im.parts[i].group)];
      part_steps.push_back(norms[i] ? st.with_trust(cpu::lamb_trust_ratio(st.hyper_params(), norms[i]->param_sq(),
                                                                          norms[i]->update_sq()))
                                    : st);
    }
  }

  std::vector<void*> dest;
  if (!options.destinations.empty()) {
    dest.assign(im.parts.size(), nullptr);
    for (std::size_t i = 0; i < im.parts.size(); ++i) {
      if (im.parts[i].output != ParamOutput::kNone) dest[i] = options.destination(static_cast<PartitionId>(i));
    }
  }

  Status sink_error;
  double output_seconds = 0;
  // Transfers of outputs still reading a buffer's staging (see OutputChunk::pending).
  std::vector<std::vector<nvme::IoFuture>> pending(im.bufs.size());
  auto drain = [&](std::vector<nvme::IoFuture>& fs) {
    for (const nvme::IoFuture& f : fs) {
      Status s = f.wait();
      if (!s.ok() && sink_error.ok()) {
        sink_error = s.with_context("a transfer of updated params started by the ParamSink");
      }
    }
    fs.clear();
  };
  bool updated_any = false;
  // Partitions whose updated params went out (a serial step; a pass keeps spec->touched).
  std::vector<std::uint8_t> delivered(spec ? 0 : im.parts.size(), 0);
  // Serial steps hint the next chunk's declared gradients while the current chunk is updated (an
  // overlapped pass does not: its gradients are declared while it runs).
  std::vector<std::uint8_t> hinted;
  std::size_t position = 0;  // of the chunk being processed in the walk
  // (And the next chunk's masters, when they are the caller's and not held yet.)
  auto hint_next = [&] {
    if (spec || (options.grads == nullptr && !im.external()) ||
        position + 1 >= (walk ? walk->order.size() : im.chunks.size()))
      return;
    if (hinted.empty()) hinted.assign(im.parts.size(), 0);
    const Chunk& next = im.chunks[walk ? walk->order[position + 1] : position + 1];
    for (PartitionId pid = next.first; pid <= next.last; ++pid) {
      const Partition& p = im.parts[pid];
      if (hinted[pid]) continue;
      if (im.external() && im.masters[pid].holds == 0) {
        hinted[pid] = 1;
        im.opt.master_source->prefetch(pid);
      }
      if (options.grads == nullptr || !p.declared || p.grad != nullptr) continue;
      hinted[pid] = 1;
      options.grads->prefetch(pid);
    }
  };
  // master_source, serial: the chunk whose masters buffer b holds (-1: none). Its updated masters
  // go back to the source once its write completed and its spare is committed (im.done): when the
  // buffer comes round again, or after the last chunk.
  std::vector<std::ptrdiff_t> filled_in(im.bufs.size(), -1);
  auto settle_buffer = [&](std::size_t b) {
    const std::ptrdiff_t j = filled_in[b];
    if (j < 0) return;
    filled_in[b] = -1;
    const auto ci = static_cast<std::size_t>(j);
    Status s = im.settle_masters(im.chunks[ci], im.bufs[b].state, im.done[ci] != 0);
    if (!s.ok()) log(LogLevel::kError, str("optimizer step: ", s.to_string()));
  };
  auto process = [&](std::size_t i, std::size_t b, float* base, std::byte* staging) -> Status {
    Chunk& c = im.chunks[i];
    drain(pending[b]);            // the staging is about to be overwritten
    if (!spec) settle_buffer(b);  // its master section is about to be overwritten
    // state_copies 1: the chunk's write goes to a spare (a pass's is held until it is committed or
    // dropped, so the pool bounds how far it runs ahead of the gradient norm).
    if (im.once() && !im.take_spare(c)) {
      if (spec) {
        spec->out_of_room = true;
        return cancelled("the overlapped pass has no spare slot left (tier.optimizer.speculation_chunks)");
      }
      return internal_error(str("optimizer step: no spare slot for chunk ", i, " (", im.pool_size, " in all)"));
    }
    if (spec && !wait_for_chunk(*spec, c, &r.speculated_chunks)) {
      return cancelled("the overlapped step's speculation was stopped");
    }
    if (!updates(i)) {
      TIER_RETURN_IF_ERROR(output_chunk(im, c, base, staging, dest, pending_part));
      ++r.redelivered_chunks;
    } else {
      if (im.external()) {
        TIER_RETURN_IF_ERROR(im.fill_masters(c, base));
        if (spec) {
          spec->filled.push_back({i, b});
        } else {
          filled_in[b] = static_cast<std::ptrdiff_t>(i);
        }
      }
      if (any_declared) TIER_RETURN_IF_ERROR(fetch_grads(c));
      if (any_declared || im.external()) hint_next();
      TIER_RETURN_IF_ERROR(update_chunk(im, c, base, staging, steps, dest, part_steps));
      updated_any = true;
      ++r.updated_chunks;
      if (any_declared) return_grads(&c);
    }
    for (PartitionId pid = c.first; pid <= c.last; ++pid) (spec ? spec->touched : delivered)[pid] = 1;
    if (options.sink == nullptr || !sink_error.ok()) return {};
    const auto ts = Clock::now();
    for (PartitionId pid = c.first; pid <= c.last && sink_error.ok(); ++pid) {
      const Partition& p = im.parts[pid];
      if (p.output == ParamOutput::kNone || (!dest.empty() && dest[pid] != nullptr)) continue;
      if (!updates(i) && !pending_part[pid]) continue;  // delivered whole by the failed try
      if (!im.skipping.empty() && im.skipping[pid]) continue;
      const std::uint64_t a = std::max(p.start, c.start);
      const std::uint64_t e = std::min(p.start + p.numel, c.start + c.numel);
      OutputChunk oc{pid, a - p.start, e - a, p.output, staging + (a - c.start) * 4, &pending[b]};
      Status s = options.sink->deliver(oc);
      if (!s.ok()) sink_error = s.with_context(str("the ParamSink, for ", partition_label(pid, p)));
    }
    output_seconds += since(ts);
    return {};
  };

  Status st;
  if (im.nvme()) {
    detail::PipelineStats ps;
    std::vector<std::size_t> reverse;
    if (spec) {
      for (std::size_t i = im.chunks.size(); i-- > 0;) reverse.push_back(i);
    }
    // Buffers are taken in the walk's order: position k uses buffer k % B.
    std::size_t next_position = 0;
    // state_copies 1: a serial step's chunk is updated once its write completed (a pass's waits
    // for finish_overlapped_step).
    const std::function<void(std::size_t)> written = [&](std::size_t i) {
      if (spec) {
        spec->written[i] = 1;
      } else {
        im.commit_spare(im.chunks[i]);
        im.done[i] = 1;
      }
    };
    st = detail::run_pipeline(
        *im.swap, im.chunks, im.bufs, true, true,
        [&](std::size_t i, Buffer& b) {
          position = next_position++;
          return process(i, position % im.bufs.size(), b.state, b.staging);
        },
        &ps,
        spec   ? &reverse
        : walk ? &walk->order
               : nullptr,
        walk && !walk->preloaded.empty() ? &walk->preloaded : nullptr, spec ? &spec->leftover : nullptr,
        im.once() ? &written : nullptr);
    if (!spec && im.once()) {
      im.drop_spares();  // writes that failed or were not issued
    }
    if (!spec) {
      for (std::size_t b = 0; b < im.bufs.size(); ++b) settle_buffer(b);
    }
    if (walk)
      r.reused_chunks = static_cast<std::uint64_t>(std::count(walk->preloaded.begin(), walk->preloaded.end(), 1));
    r.read = ps.read;
    r.write = ps.write;
    r.update = ps.update;
    r.io_busy_seconds = ps.io_busy_seconds;
    r.update_wait_seconds = ps.update_wait_seconds;
    r.max_transfers_in_flight = ps.max_in_flight;
  } else {
    const auto tu = Clock::now();
    for (std::size_t i = 0; i < im.chunks.size() && st.ok(); ++i) {
      position = i;
      st = process(i, 0, im.chunks[i].host.get(), im.bufs[0].staging);
      ++r.update.transfers;
    }
    r.update.busy_seconds = since(tu);
  }
  r.read.bytes += lamb_pass.read.bytes;
  r.read.transfers += lamb_pass.read.transfers;
  r.read.busy_seconds += lamb_pass.read.busy_seconds;
  r.update.busy_seconds += lamb_pass.update.busy_seconds;
  r.io_busy_seconds += lamb_pass.io_busy_seconds;
  r.update_wait_seconds += lamb_pass.update_wait_seconds;
  for (auto& fs : pending) drain(fs);
  r.output_seconds = output_seconds;
  if (any_declared) return_grads(nullptr);  // after a failure: what is still held
  if (spec) {
    // Nothing is committed here: finish_overlapped_step validates and commits, or redoes. A
    // delivery error fails the pass, so that the serial redo reports it as step() does.
    if (st.ok() && !sink_error.ok()) st = sink_error;
    if (!st.ok()) {
      rollback();
      return st;
    }
    return r;
  }
  if (!st.ok() && im.once() && std::find(im.done.begin(), im.done.end(), std::uint8_t{1}) != im.done.end()) {
    // Some chunks took the update (this try's, or an earlier one's): it cannot be undone, so it is
    // owed. The counters go back until it is finished; what it began with is kept.
    rollback();
    ++im.steps_failed;
    if (options.sink != nullptr) options.sink->abandoned();
    const auto n_done = static_cast<std::uint64_t>(std::count(im.done.begin(), im.done.end(), std::uint8_t{1}));
    if (owed) {
      owed->redeliver = true;
    } else {
      auto o = std::make_unique<detail::Owed>();
      o->step = old_steps[0] + 1;
      o->steps = steps;
      o->part_steps = part_steps;
      o->total = total;
      o->clip = clip;
      o->redeliver = true;
      im.set_owed(std::move(o));
    }
    log(LogLevel::kError, str("optimizer: step ", old_steps[0] + 1, " failed after ", n_done, " of ", im.chunks.size(),
                              " chunks took their update; the next step() finishes it: ", st.to_string()));
    return st.with_context(str("optimizer step ", old_steps[0] + 1, " failed after ", n_done, " of ", im.chunks.size(),
                               " chunks took their update (state_copies 1 keeps one copy of the state: each chunk is "
                               "whole, before or after the step). The gradients and the step's constants are kept; "
                               "call step() to finish it (it updates the chunks left, to the result the step would "
                               "have had); until then the optimizer refuses everything else but load_checkpoint"));
  }
  if (!st.ok()) {
    rollback();
    ++im.steps_failed;
    if (!im.nvme() && updated_any) {
      // Host home updates in place: a failure mid-way (a kernel argument error, or a declared
      // gradient that could not be fetched) leaves a mix of steps, which must not pass unnoticed.
      im.state_invalid = st.with_context("optimizer step failed mid-way on host-resident state; load a checkpoint");
      return im.state_invalid;
    }
    return after_failed_step(
        self, im, options, delivered,
        st.with_context(str("optimizer step ", old_steps[0] + 1,
                            " was not applied; the state of the previous step is intact, the params it had "
                            "delivered are put back and the gradients are kept (call step() again to retry, or "
                            "clear_grads())")));
  }
  if (im.once()) {
    r.finished_failed = owed != nullptr;
    im.done.assign(im.chunks.size(), 0);
    im.set_owed(nullptr);
  } else {
    for (Chunk& c : im.chunks) c.committed ^= 1;
  }
  ++im.steps_applied;
  r.applied = true;
  r.next_loss_scale = im.scaler->update(false);
  self.clear_grads();
  publish();
  im.outputs_stale = !sink_error.ok();
  if (!sink_error.ok()) {
    return sink_error.with_context(str("optimizer step ", r.step,
                                       " was applied, but delivering its updated params failed and later outputs "
                                       "were not delivered (read_params() has them)"));
  }
  return r;
}

// Delivers again, from the committed masters, the params of the partitions an abandoned overlapped
// pass had delivered (to their destination, or through the ParamSink).
Status restore_outputs(OffloadedOptimizer& self, OffloadedOptimizer::Impl& im, const StepOptions& o,
                       const std::vector<std::uint8_t>& touched) {
  std::vector<float> tmp;
  for (PartitionId pid = 0; pid < touched.size(); ++pid) {
    const Partition& p = im.parts[pid];
    if (!touched[pid] || p.output == ParamOutput::kNone) continue;
    void* d = o.destination(pid);
    if (d != nullptr) {
      TIER_RETURN_IF_ERROR(self.read_params(pid, param_output_dtype(p.output), d));
      continue;
    }
    if (o.sink == nullptr) continue;
    std::byte* staging = im.bufs[0].staging;  // read_state bounces through the state part only
    for (std::uint64_t off = 0; off < p.numel; off += im.chunk_elems) {
      const std::uint64_t n = std::min(im.chunk_elems, p.numel - off);
      tmp.resize(n);
      TIER_RETURN_IF_ERROR(self.read_state(pid, StateKind::kMaster, tmp.data(), off, n));
      TIER_RETURN_IF_ERROR(cpu::convert(cpu::ConstTensorRef(tmp.data(), DType::kF32, n),
                                        cpu::TensorRef{staging, param_output_dtype(p.output), n}));
      std::vector<nvme::IoFuture> pending;
      OutputChunk oc{pid, off, n, p.output, staging, &pending};
      Status s = o.sink->deliver(oc);
      for (const nvme::IoFuture& f : pending) {
        Status w = f.wait();
        if (s.ok()) s = w;
      }
      TIER_RETURN_IF_ERROR(s.with_context(str("delivering the params of ", partition_label(pid, p), " again")));
    }
  }
  return {};
}

}  // namespace

Result<StepReport> OffloadedOptimizer::step(const StepOptions& options) {
  if (impl_->overlap) {
    return failed_precondition(
        "optimizer step: an overlapped step is running; finish_overlapped_step() or cancel_overlapped_step() first");
  }
  return run_step(*this, *impl_, options, nullptr);
}

// ------------------------------------------------------------------------------------ the overlapped step

void OffloadedOptimizer::Impl::note_ready(PartitionId id) {
  detail::Overlap* ov = overlap.get();
  if (ov == nullptr) return;
  {
    std::lock_guard<std::mutex> lk(ov->mu);
    if (ov->ready[id]) return;
    ov->ready[id] = 1;
    ov->ready_sumsq += parts[id].sumsq;
    // The sum only grows: once it alone makes the step clipped or skipped, speculation is futile.
    if (!ov->abort && !std::isfinite(ov->ready_sumsq)) {
      ov->abort = true;
      ov->abort_reason = "a gradient is inf or nan (the step is skipped)";
    } else if (!ov->abort && opt.max_grad_norm > 0 &&
               cpu::clip_coefficient(std::sqrt(ov->ready_sumsq) / ov->scale, opt.max_grad_norm) < 1.0f) {
      ov->abort = true;
      ov->abort_reason = "the gradient norm exceeds gradient_clipping (the step is clipped)";
    }
  }
  ov->cv.notify_all();
}

Status OffloadedOptimizer::start_overlapped_step(const StepOptions& options) {
  Impl& im = *impl_;
  TIER_RETURN_IF_ERROR(im.usable("start_overlapped_step"));
  if (im.overlap) {
    return failed_precondition("optimizer start_overlapped_step: one is already running; finish or cancel it first");
  }
  if (!im.nvme()) {
    return failed_precondition(
        "optimizer start_overlapped_step: the state is in host memory and updated in place, so a speculative "
        "update could not be redone; overlap needs the NVMe home (use step())");
  }
  {
    std::lock_guard<std::mutex> lock(im.groups_mu);
    for (const cpu::AdamGroup& g : im.groups) {
      if (g.hyper_params().kind == cpu::OptimizerKind::kLamb) {
        return failed_precondition(
            "optimizer start_overlapped_step: Lamb needs every gradient for its trust ratios before any update "
            "(use step())");
      }
    }
  }
  auto ov = std::make_unique<detail::Overlap>();
  const std::size_t n = im.parts.size();
  ov->ready.assign(n, 0);
  ov->touched.assign(n, 0);
  ov->scale = im.scaler->scale();
  ov->options = options;
  ov->written.assign(im.chunks.size(), 0);
  {
    std::lock_guard<std::mutex> lock(im.groups_mu);
    for (const cpu::AdamGroup& g : im.groups) ov->old_steps.push_back(g.step());
  }
  if (options.skip_missing_grads) im.skipping.assign(n, 0);
  im.overlap = std::move(ov);
  // Gradients already final (declared before the start) count at once.
  for (PartitionId pid = 0; pid < n; ++pid) {
    const Partition& p = im.parts[pid];
    if (p.contributions == im.opt.gradient_accumulation_steps && p.norm_known) im.note_ready(pid);
  }
  detail::Overlap* raw = im.overlap.get();
  raw->thread = std::thread([this, raw] {
    Result<StepReport> r = run_step(*this, *impl_, raw->options, raw);
    std::lock_guard<std::mutex> lk(raw->mu);
    raw->result = std::move(r);
  });
  return {};
}

bool OffloadedOptimizer::outputs_stale() const noexcept {
  return impl_->outputs_stale;
}

bool OffloadedOptimizer::failed_step_owed() const noexcept {
  return impl_->owed_flag.load();
}

std::uint64_t OffloadedOptimizer::steps_applied() const noexcept {
  return impl_->steps_applied.load(std::memory_order_relaxed);
}

void OffloadedOptimizer::outputs_rewritten() noexcept {
  impl_->outputs_stale = false;
}

bool OffloadedOptimizer::overlapped_step_running() const noexcept {
  return impl_->overlap != nullptr;
}

std::uint64_t OffloadedOptimizer::overlapped_chunks_taken() const {
  detail::Overlap* ov = impl_->overlap.get();
  if (ov == nullptr) return 0;
  std::lock_guard<std::mutex> lk(ov->mu);
  return ov->speculated;
}

Result<StepReport> OffloadedOptimizer::finish_overlapped_step() {
  Impl& im = *impl_;
  if (!im.overlap) {
    return failed_precondition("optimizer finish_overlapped_step: no overlapped step was started");
  }
  const auto t0 = Clock::now();
  detail::Overlap& ov = *im.overlap;
  // The global norm exactly as step() takes it (partitions in order, late norms for those with
  // fewer gradients than accumulation steps: the pass has not touched them, they are not ready).
  double total = 0;
  Status norm_error;
  for (std::size_t i = 0; i < im.parts.size(); ++i) {
    Partition& p = im.parts[i];
    if (p.contributions == 0) continue;
    if (!p.norm_known) {
      auto s = detail::sum_of_squares(cpu::ConstTensorRef(p.grad, p.grad_dtype, p.numel), im.workers.get());
      if (!s.ok()) {
        norm_error = s.status();
        break;
      }
      p.sumsq = *s;
      p.norm_known = true;
    }
    total += p.sumsq;
  }
  if (ov.options.norm != nullptr) {
    // The pass's early stop used this rank's partial sum, a lower bound of the global one. A rank
    // that could not take its norm still takes part (with a nan, which makes the others skip).
    if (!norm_error.ok()) total = std::numeric_limits<double>::quiet_NaN();
    Status reduced = ov.options.norm->all_reduce_sumsq(total);
    if (norm_error.ok() && !reduced.ok()) norm_error = reduced.with_context("combining the gradient norm across ranks");
  }
  const bool overflow = !std::isfinite(total);
  const double norm = std::sqrt(total) / ov.scale;
  const float clip = im.opt.max_grad_norm > 0 ? cpu::clip_coefficient(norm, im.opt.max_grad_norm) : 1.0f;
  bool valid = norm_error.ok() && !overflow && clip == 1.0f;
  {
    std::lock_guard<std::mutex> lk(ov.mu);
    if (ov.options.skip_missing_grads) {
      for (std::size_t i = 0; i < im.parts.size(); ++i) {
        if (im.parts[i].contributions == 0) im.skipping[i] = 1;
      }
    }
    ov.all_in = true;
    if (!valid && !ov.abort) {
      ov.abort = true;
      ov.abort_reason = !norm_error.ok() ? "the gradient norm could not be taken"
                        : overflow       ? "a gradient is inf or nan (the step is skipped)"
                                         : "the gradient norm exceeds gradient_clipping (the step is clipped)";
    }
    valid = valid && !ov.abort;
  }
  ov.cv.notify_all();
  ov.thread.join();
  im.skipping.clear();
  // From here on add_grad and declare_grad no longer wake anyone.
  std::unique_ptr<detail::Overlap> held = std::move(im.overlap);
  Result<StepReport> pass = std::move(held->result);
  // state_copies 1: the chunks the pass wrote become the state (they are the step's), or are dropped.
  auto drop_pass = [&] {
    im.drop_spares();
    settle_pass_masters(im, *held, /*committed=*/false);
  };
  auto commit_pass = [&] {
    std::uint64_t n = 0;
    for (std::size_t i = 0; i < im.chunks.size(); ++i) {
      if (!held->written[i]) continue;
      im.commit_spare(im.chunks[i]);
      ++n;
    }
    settle_pass_masters(im, *held, /*committed=*/true);
    drop_pass();
    return n;
  };
  if (!norm_error.ok()) {
    drop_pass();
    restore_steps(im, held->old_steps);
    if (!held->options.redeliver_abandoned_outputs) return norm_error;
    return after_failed_step(*this, im, held->options, held->touched, norm_error);
  }
  if (valid && !pass.ok() && held->out_of_room && im.once()) {
    // The pass ran out of spare slots: what it wrote is the step's; the rest is updated now, with
    // the constants the pass used and the norm taken above.
    const std::uint64_t n = commit_pass();
    im.done.assign(im.chunks.size(), 0);
    for (std::size_t i = 0; i < im.chunks.size(); ++i) im.done[i] = held->written[i];
    restore_steps(im, held->old_steps);
    auto o = std::make_unique<detail::Owed>();
    o->step = held->old_steps[0] + 1;
    o->steps = held->steps;
    o->total = total;
    o->clip = 1;
    o->redeliver = false;  // the pass's deliveries stand; the rest completes them
    im.set_owed(std::move(o));
    bool holds_per_partition = held->options.sink != nullptr;
    for (const Partition& p : im.parts) holds_per_partition = holds_per_partition || p.declared;
    const Walk walk =
        walk_after(held->leftover, im.chunks, im.parts.size(), im.bufs.size(), holds_per_partition, &im.done);
    Result<StepReport> r = run_step(*this, im, held->options, nullptr, &walk);
    if (r.ok()) {
      r->overlapped = true;
      r->finished_failed = false;
      r->speculated_chunks = pass.ok() ? pass->speculated_chunks : held->speculated;
      r->updated_chunks += n;
      r->reused_chunks = static_cast<std::uint64_t>(std::count(walk.preloaded.begin(), walk.preloaded.end(), 1));
      if (Counters* c = im.opt.counters) c->add_metric("optim.overlapped_steps", 1);
    }
    return r;
  }
  if (valid && pass.ok()) {
    StepReport r = *pass;
    if (im.once()) {
      r.updated_chunks = commit_pass();
    } else {
      for (Chunk& c : im.chunks) c.committed ^= 1;
    }
    ++im.steps_applied;
    r.applied = true;
    r.overflow = false;
    r.grad_norm = norm;
    r.clip_coefficient = 1;
    r.loss_scale = held->scale;
    r.next_loss_scale = im.scaler->update(false);
    r.overlapped = true;
    im.outputs_stale = false;  // the pass delivered every output
    clear_grads();
    publish_step(im, r, t0);
    r.seconds = since(t0);  // what the caller waited for after the last gradient
    return r;
  }
  // The speculation is dropped: the shadows it wrote are overwritten by the redo, which reads the
  // committed slots as any step does.
  const std::string reason = pass.ok() || pass.status().code() == StatusCode::kCancelled
                                 ? std::string(held->abort_reason)
                                 : str("the speculative pass failed: ", pass.status().to_string());
  const std::uint64_t speculated = pass.ok() ? pass->speculated_chunks : held->speculated;
  drop_pass();
  restore_steps(im, held->old_steps);
  if (held->options.sink != nullptr) held->options.sink->abandoned();
  if (overflow && held->options.redeliver_abandoned_outputs) {
    // The skipped step must leave the params as they were: deliver the committed ones again.
    TIER_RETURN_IF_ERROR(restore_outputs(*this, im, held->options, held->touched));
  }
  // Combined once above (and maybe redone on this rank only): the redo uses the global sum.
  struct KnownNorm final : NormReducer {
    double total = 0;
    Status all_reduce_sumsq(double& sumsq) override {
      sumsq = total;
      return Status::Ok();
    }
  } known;
  known.total = total;
  StepOptions redo = held->options;
  if (redo.norm != nullptr) redo.norm = &known;
  // The chunks the pass had read when it stopped go first, as they are in the buffers.
  bool holds_per_partition = held->options.sink != nullptr;
  for (const Partition& p : im.parts) holds_per_partition = holds_per_partition || p.declared;
  const Walk walk = walk_after(held->leftover, im.chunks, im.parts.size(), im.bufs.size(), holds_per_partition);
  Result<StepReport> r = run_step(*this, im, redo, nullptr, im.nvme() ? &walk : nullptr);
  if (!r.ok() && held->options.redeliver_abandoned_outputs && !im.outputs_stale) {
    // The redo failed too (it put back what it had delivered): so must the params the pass had.
    return after_failed_step(*this, im, held->options, held->touched, r.status());
  }
  if (r.ok()) {
    r->overlapped = true;
    r->redone = true;
    r->redo_reason = reason;
    r->speculated_chunks = speculated;
    if (Counters* c = im.opt.counters) {  // (run_step published it as a serial step)
      c->add_metric("optim.overlapped_steps", 1);
      c->add_metric("optim.redone_steps", 1);
    }
  }
  return r;
}

void OffloadedOptimizer::cancel_overlapped_step() noexcept {
  Impl& im = *impl_;
  if (!im.overlap) return;
  detail::Overlap& ov = *im.overlap;
  {
    std::lock_guard<std::mutex> lk(ov.mu);
    ov.abort = true;
    ov.abort_reason = "cancelled";
    ov.all_in = true;
  }
  ov.cv.notify_all();
  ov.thread.join();
  im.skipping.clear();
  std::unique_ptr<detail::Overlap> held = std::move(im.overlap);
  im.drop_spares();
  settle_pass_masters(im, *held, /*committed=*/false);
  restore_steps(im, held->old_steps);
  // The params the pass delivered are not the committed state's: deliver those again.
  if (held->options.sink != nullptr) held->options.sink->abandoned();
  if (!held->options.redeliver_abandoned_outputs) return;
  Status s = restore_outputs(*this, im, held->options, held->touched);
  if (!s.ok()) {
    log(LogLevel::kError, str("optimizer: cancelling an overlapped step: ", s.to_string(),
                              "; the params it delivered may be ahead of the optimizer state (read_params() has "
                              "the committed ones)"));
  }
}

// ------------------------------------------------------------------------------------ hyper-parameters

std::size_t OffloadedOptimizer::group_count() const noexcept {
  std::lock_guard<std::mutex> lock(impl_->groups_mu);
  return impl_->groups.size();
}

namespace {
Status check_group(const OffloadedOptimizer::Impl& im, int group) {
  if (group < 0 || static_cast<std::size_t>(group) >= im.groups.size()) {
    return invalid_argument(str("optimizer: group ", group, " does not exist (", im.groups.size(), " groups)"));
  }
  return {};
}
}  // namespace

// Each takes the groups' lock: a step on another thread may be reading or advancing them.
Result<cpu::AdamHyperParams> OffloadedOptimizer::hyper_params(int group) const {
  std::lock_guard<std::mutex> lock(impl_->groups_mu);
  TIER_RETURN_IF_ERROR(check_group(*impl_, group));
  return impl_->groups[static_cast<std::size_t>(group)].hyper_params();
}

Status OffloadedOptimizer::set_hyper_params(int group, const cpu::AdamHyperParams& hp) {
  std::lock_guard<std::mutex> lock(impl_->groups_mu);
  TIER_RETURN_IF_ERROR(check_group(*impl_, group));
  return impl_->groups[static_cast<std::size_t>(group)].set_hyper_params(hp);
}

Status OffloadedOptimizer::set_lr(int group, double lr) {
  std::lock_guard<std::mutex> lock(impl_->groups_mu);
  TIER_RETURN_IF_ERROR(check_group(*impl_, group));
  return impl_->groups[static_cast<std::size_t>(group)].set_lr(lr);
}

Result<std::int64_t> OffloadedOptimizer::group_step(int group) const {
  std::lock_guard<std::mutex> lock(impl_->groups_mu);
  TIER_RETURN_IF_ERROR(check_group(*impl_, group));
  return impl_->groups[static_cast<std::size_t>(group)].step();
}

Status OffloadedOptimizer::set_group_step(int group, std::int64_t step) {
  std::lock_guard<std::mutex> lock(impl_->groups_mu);
  TIER_RETURN_IF_ERROR(check_group(*impl_, group));
  return impl_->groups[static_cast<std::size_t>(group)].set_step(step).with_context(str("optimizer group ", group));
}

const LossScaler& OffloadedOptimizer::loss_scaler() const noexcept {
  return *impl_->scaler;
}

double OffloadedOptimizer::loss_scale() const noexcept {
  return impl_->scaler->scale();
}

// ------------------------------------------------------------------------------------ state access

namespace {

Status check_range(const OffloadedOptimizer::Impl& im, PartitionId id, std::uint64_t offset, std::uint64_t count,
                   const char* what) {
  if (id >= im.parts.size()) {
    return invalid_argument(
        str("optimizer ", what, ": partition ", id, " does not exist (", im.parts.size(), " partitions)"));
  }
  const Partition& p = im.parts[id];
  if (offset > p.numel || count > p.numel - offset) {
    return out_of_range(str("optimizer ", what, ": elements [", offset, ", ", offset + count, ") are past the end of ",
                            partition_label(id, p), " (", p.numel, " elements)"));
  }
  return {};
}

// Calls fn(chunk index, element index in the chunk, n, elements done so far) for each chunk
// piece of partition elements [offset, offset + count).
template <class Fn>
Status for_pieces(const OffloadedOptimizer::Impl& im, PartitionId id, std::uint64_t offset, std::uint64_t count,
                  Fn&& fn) {
  std::uint64_t flat = im.parts[id].start + offset;
  const std::uint64_t end = flat + count;
  std::size_t ci = static_cast<std::size_t>(flat / im.chunk_elems);
  std::uint64_t done = 0;
  while (flat < end) {
    const Chunk& c = im.chunks[ci];
    const std::uint64_t n = std::min(end, c.start + c.numel) - flat;
    TIER_RETURN_IF_ERROR(fn(ci, flat - c.start, n, done));
    flat += n;
    done += n;
    ++ci;
  }
  return {};
}

}  // namespace

namespace {

cpu::StateMoment moment_of(StateKind kind) {
  return kind == StateKind::kExpAvg ? cpu::StateMoment::kExpAvg : cpu::StateMoment::kExpAvgSq;
}

// The section, element dtype and (int8) scales of one state array of chunk c at `base`.
struct StateView {
  std::byte* data;
  DType dtype;
  float* scales;
};
StateView view_of(const OffloadedOptimizer::Impl& im, void* base, const Chunk& c, StateKind kind) {
  if (kind == StateKind::kMaster)
    return {OffloadedOptimizer::Impl::section(base, c, Section::kMaster), DType::kF32, nullptr};
  const cpu::StateDType d = im.state_dtype();
  const bool m = kind == StateKind::kExpAvg;
  float* scales = nullptr;
  if (d == cpu::StateDType::kInt8) {
    scales = reinterpret_cast<float*>(
        OffloadedOptimizer::Impl::section(base, c, m ? Section::kExpAvgScales : Section::kExpAvgSqScales));
  }
  return {OffloadedOptimizer::Impl::section(base, c, m ? Section::kExpAvg : Section::kExpAvgSq),
          m ? cpu::exp_avg_dtype(d) : cpu::exp_avg_sq_dtype(d), scales};
}

// Elements [a, a + n) of a state array of chunk c (laid out at `base`) as fp32 into dst.
Status decode_piece(const OffloadedOptimizer::Impl& im, void* base, const Chunk& c, StateKind kind, std::uint64_t a,
                    std::uint64_t n, float* dst) {
  const StateView v = view_of(im, base, c, kind);
  const std::size_t es = dtype_size(v.dtype);
  if (v.dtype == DType::kF32) {
    std::memcpy(dst, v.data + a * 4, n * 4);
    return {};
  }
  if (v.scales == nullptr) {
    return cpu::decode_state(moment_of(kind), cpu::ConstTensorRef(v.data + a * es, v.dtype, n), nullptr,
                             cpu::TensorRef{dst, DType::kF32, n});
  }
  // int8: block by block from the block holding element a (each element uses its block's scale).
  constexpr std::uint64_t B = cpu::kStateBlock;
  float tmp[B];
  for (std::uint64_t b = a / B * B; b < a + n; b += B) {
    const std::uint64_t hi = std::min(a + n, b + B);
    TIER_RETURN_IF_ERROR(cpu::decode_state(moment_of(kind), cpu::ConstTensorRef(v.data + b * es, v.dtype, hi - b),
                                           v.scales + b / B, cpu::TensorRef{tmp, DType::kF32, hi - b}));
    const std::uint64_t lo = std::max(a, b);
    std::memcpy(dst + (lo - a), tmp + (lo - b), (hi - lo) * 4);
  }
  return {};
}

// Overwrites elements [a, a + n) of a state array of chunk c (laid out at `base`) with fp32 src,
// encoding into the state dtype. `limit` is the end (chunk element) of the partition piece that
// holds them: an int8 block is re-encoded whole, from its start up to the block's end or limit.
// The values must be encodable (check_encodable).
Status encode_piece(const OffloadedOptimizer::Impl& im, void* base, const Chunk& c, StateKind kind, std::uint64_t a,
                    std::uint64_t n, std::uint64_t limit, const float* src) {
  const StateView v = view_of(im, base, c, kind);
  const std::size_t es = dtype_size(v.dtype);
  if (v.dtype == DType::kF32) {
    std::memcpy(v.data + a * 4, src, n * 4);
    return {};
  }
  if (v.scales == nullptr) {
    return cpu::encode_state(moment_of(kind), cpu::ConstTensorRef(src, DType::kF32, n),
                             cpu::TensorRef{v.data + a * es, v.dtype, n}, nullptr);
  }
  constexpr std::uint64_t B = cpu::kStateBlock;
  float tmp[B];
  for (std::uint64_t b = a / B * B; b < a + n; b += B) {
    const std::uint64_t hi = std::min(limit, b + B);
    TIER_RETURN_IF_ERROR(cpu::decode_state(moment_of(kind), cpu::ConstTensorRef(v.data + b * es, v.dtype, hi - b),
                                           v.scales + b / B, cpu::TensorRef{tmp, DType::kF32, hi - b}));
    const std::uint64_t lo = std::max(a, b);
    const std::uint64_t e = std::min(a + n, hi);
    std::memcpy(tmp + (lo - b), src + (lo - a), (e - lo) * 4);
    TIER_RETURN_IF_ERROR(cpu::encode_state(moment_of(kind), cpu::ConstTensorRef(tmp, DType::kF32, hi - b),
                                           cpu::TensorRef{v.data + b * es, v.dtype, hi - b}, v.scales + b / B));
  }
  return {};
}

// Compressed moments take finite values, and exp_avg_sq no negative ones: checked over the whole
// source before anything is written.
Status check_encodable(const OffloadedOptimizer::Impl& im, StateKind kind, const float* src, std::uint64_t n) {
  if (kind == StateKind::kMaster || im.state_dtype() == cpu::StateDType::kF32) return {};
  for (std::uint64_t i = 0; i < n; ++i) {
    if (!std::isfinite(src[i]) || (kind == StateKind::kExpAvgSq && src[i] < 0)) {
      return invalid_argument(str("optimizer write_state: ", state_kind_name(kind), " element ", i, " is ", src[i],
                                  "; ", cpu::state_dtype_name(im.state_dtype()),
                                  " state takes finite values (and no negative exp_avg_sq); nothing was written"));
    }
  }
  return {};
}

}  // namespace

Status OffloadedOptimizer::read_state(PartitionId id, StateKind kind, float* dst, std::uint64_t offset,
                                      std::uint64_t count) {
  Impl& im = *impl_;
  TIER_RETURN_IF_ERROR(im.usable("read_state"));
  TIER_RETURN_IF_ERROR(im.idle("read_state"));
  TIER_RETURN_IF_ERROR(check_range(im, id, offset, count, "read_state"));
  if (count > 0 && dst == nullptr) return invalid_argument("optimizer read_state: null destination");
  if (kind == StateKind::kMaster && im.external()) {
    if (count == 0) return {};
    return im.with_master(id, false, [&](const float* m) {
      std::memcpy(dst, m + offset, count * sizeof(float));
      return Status();
    });
  }
  const bool raw = kind == StateKind::kMaster || im.state_dtype() == cpu::StateDType::kF32;
  return for_pieces(im, id, offset, count,
                    [&](std::size_t ci, std::uint64_t a, std::uint64_t n, std::uint64_t done) -> Status {
                      const Chunk& c = im.chunks[ci];
                      if (!im.nvme()) return decode_piece(im, c.host.get(), c, kind, a, n, dst + done);
                      auto* bounce = reinterpret_cast<std::byte*>(im.bufs[0].state);
                      if (!raw) {
                        // Compressed moments: the whole record (int8 needs the scales too).
                        Status s = im.swap->read(c.slot[c.committed], bounce, c.bytes()).wait();
                        if (!s.ok()) return s.with_context(str("optimizer read_state of chunk ", ci));
                        return decode_piece(im, bounce, c, kind, a, n, dst + done);
                      }
                      // An aligned window of the committed slot around the elements.
                      const std::uint64_t at = c.layout.offset[static_cast<int>(kind)] + a * sizeof(float);
                      const std::uint64_t lo = at / 4096 * 4096;
                      const std::uint64_t hi = std::min(c.bytes(), detail::round_up(at + n * sizeof(float), 4096));
                      Status s = im.swap->read(c.slot[c.committed], bounce, hi - lo, lo).wait();
                      if (!s.ok()) return s.with_context(str("optimizer read_state of chunk ", ci));
                      std::memcpy(dst + done, bounce + (at - lo), n * sizeof(float));
                      return {};
                    });
}

Status OffloadedOptimizer::write_state(PartitionId id, StateKind kind, const float* src, std::uint64_t offset,
                                       std::uint64_t count) {
  Impl& im = *impl_;
  TIER_RETURN_IF_ERROR(im.usable("write_state"));
  TIER_RETURN_IF_ERROR(im.idle("write_state"));
  TIER_RETURN_IF_ERROR(check_range(im, id, offset, count, "write_state"));
  if (count > 0 && src == nullptr) return invalid_argument("optimizer write_state: null source");
  TIER_RETURN_IF_ERROR(check_encodable(im, kind, src, count));
  if (kind == StateKind::kMaster && im.external()) {
    if (count == 0) return {};
    return im.with_master(id, true, [&](float* m) {
      std::memcpy(m + offset, src, count * sizeof(float));
      return Status();
    });
  }
  const Partition& p = im.parts[id];
  return for_pieces(
      im, id, offset, count, [&](std::size_t ci, std::uint64_t a, std::uint64_t n, std::uint64_t done) -> Status {
        Chunk& c = im.chunks[ci];
        const std::uint64_t limit = std::min(p.start + p.numel, c.start + c.numel) - c.start;
        if (!im.nvme()) return encode_piece(im, c.host.get(), c, kind, a, n, limit, src + done);
        // Read the whole chunk, patch it, write it to the shadow slot (state_copies 1: a spare),
        // switch over.
        float* buf = im.bufs[0].state;
        Status s = im.swap->read(c.slot[c.committed], buf, c.bytes()).wait();
        if (!s.ok()) return s.with_context(str("optimizer write_state: reading chunk ", ci));
        TIER_RETURN_IF_ERROR(encode_piece(im, buf, c, kind, a, n, limit, src + done));
        if (im.once() && !im.take_spare(c)) return internal_error("optimizer write_state: no spare slot");
        s = im.swap->write(im.once() ? c.next : c.slot[1 - c.committed], buf, c.bytes()).wait();
        if (!s.ok()) {
          im.drop_spare(c);
          return s.with_context(str("optimizer write_state: writing chunk ", ci, " (its previous content is intact)"));
        }
        if (im.once()) {
          im.commit_spare(c);
        } else {
          c.committed ^= 1;
        }
        return {};
      });
}

Status OffloadedOptimizer::read_params(PartitionId id, DType dtype, void* dst) {
  Impl& im = *impl_;
  TIER_RETURN_IF_ERROR(im.usable("read_params"));
  TIER_RETURN_IF_ERROR(im.idle("read_params"));
  TIER_RETURN_IF_ERROR(check_range(im, id, 0, 0, "read_params"));
  if (!cpu::is_float_dtype(dtype)) {
    return invalid_argument(str("optimizer read_params: dtype ", dtype_name(dtype), " is not fp32, fp16 or bf16"));
  }
  const std::uint64_t numel = im.parts[id].numel;
  if (dst == nullptr) return invalid_argument("optimizer read_params: null destination");
  if (dtype == DType::kF32) return read_state(id, StateKind::kMaster, static_cast<float*>(dst), 0, numel);
  if (im.external()) {
    // The caller's master, converted from where it is.
    return im.with_master(id, false, [&](const float* m) {
      return cpu::convert(cpu::ConstTensorRef(m, DType::kF32, numel), cpu::TensorRef{dst, dtype, numel});
    });
  }
  // fp32 slices into buffer 0's staging (read_state bounces through its state part), converted.
  auto* tmp = reinterpret_cast<float*>(im.bufs[0].staging);
  for (std::uint64_t off = 0; off < numel; off += im.chunk_elems) {
    const std::uint64_t n = std::min(im.chunk_elems, numel - off);
    TIER_RETURN_IF_ERROR(read_state(id, StateKind::kMaster, tmp, off, n));
    TIER_RETURN_IF_ERROR(
        cpu::convert(cpu::ConstTensorRef(tmp, DType::kF32, n),
                     cpu::TensorRef{static_cast<std::byte*>(dst) + off * dtype_size(dtype), dtype, n}));
  }
  return {};
}

// ------------------------------------------------------------------------------------ diagnostics

Result<PassReport> OffloadedOptimizer::measure_io_seconds() {
  Impl& im = *impl_;
  TIER_RETURN_IF_ERROR(im.usable("measure_io_seconds"));
  TIER_RETURN_IF_ERROR(im.idle("measure_io_seconds"));
  if (!im.nvme()) return failed_precondition("optimizer measure_io_seconds: the state is in host memory; no I/O");
  // What is written must be new to the disk, as a step's updated state is: virtual disks and
  // some SSDs deduplicate or compress, and writing back the bytes just read (which exist in the
  // committed slot) would flatter the bound. So every 512-byte sector gets a stamp unique to this
  // pass, chunk and position before it goes out (the shadow slots hold nothing of value).
  static std::atomic<std::uint64_t> passes{0};
  const std::uint64_t pass = ++passes ^ static_cast<std::uint64_t>(Clock::now().time_since_epoch().count());
  const auto t0 = Clock::now();
  detail::PipelineStats ps;
  // state_copies 1: the writes go to spares, given back as they complete (nothing is committed).
  const std::function<void(std::size_t)> written = [&](std::size_t i) { im.drop_spare(im.chunks[i]); };
  struct DropLeft {
    OffloadedOptimizer::Impl& im;
    ~DropLeft() { im.drop_spares(); }
  } drop_left{im};
  TIER_RETURN_IF_ERROR(detail::run_pipeline(
      *im.swap, im.chunks, im.bufs, true, true,
      [&](std::size_t i, Buffer& b) {
        if (im.once() && !im.take_spare(im.chunks[i])) return internal_error("measure_io_seconds: no spare slot");
        auto* p = reinterpret_cast<std::byte*>(b.state);
        const std::uint64_t bytes = im.chunks[i].bytes();
        for (std::uint64_t off = 0; off + 16 <= bytes; off += 512) {
          const std::uint64_t stamp[2] = {pass, (static_cast<std::uint64_t>(i) << 40) ^ off};
          std::memcpy(p + off, stamp, sizeof stamp);
        }
        return Status();
      },
      &ps, nullptr, nullptr, nullptr, im.once() ? &written : nullptr));
  PassReport r;
  r.seconds = since(t0);
  r.bytes_read = ps.read.bytes;
  r.bytes_written = ps.write.bytes;
  r.elements = im.numel_total;
  return r;
}

Result<PassReport> OffloadedOptimizer::measure_update_seconds() {
  Impl& im = *impl_;
  TIER_RETURN_IF_ERROR(im.usable("measure_update_seconds"));
  TIER_RETURN_IF_ERROR(im.idle("measure_update_seconds"));
  std::vector<cpu::AdamStep> steps;
  {
    std::lock_guard<std::mutex> lock(im.groups_mu);
    for (const cpu::AdamGroup& g : im.groups) {
      TIER_ASSIGN_OR_RETURN(cpu::AdamStep s,
                            cpu::AdamStep::make(g.hyper_params(), std::max<std::int64_t>(1, g.step() + 1)));
      steps.push_back(s);
    }
  }
  // Chunks take turns over scratch slots in RAM that together exceed the CPU caches (256 MiB, or
  // the whole state when smaller), so the pass streams from memory as the step does; the slots
  // hold sane values (params ~1, zero moments), touched once before timing.
  const std::uint64_t ce = im.chunk_elems;
  const ChunkLayout full = im.layout_of(ce);
  const std::uint64_t record_floats = full.span / 4;     // (with the master section, wherever it lies)
  const std::uint64_t slot_floats = record_floats + ce;  // a record and the staging
  const std::uint64_t slots = std::max<std::uint64_t>(
      1, std::min<std::uint64_t>(im.chunks.size(), ((256ull << 20) + slot_floats * 4 - 1) / (slot_floats * 4)));
  detail::FloatPtr scratch = alloc_floats(slots * slot_floats);
  if (!scratch) {
    return resource_exhausted(
        str("optimizer measure_update_seconds: no memory for ", format_bytes(slots * slot_floats * 4), " of scratch"));
  }
  for (std::uint64_t k = 0; k < slots; ++k) {
    float* base = scratch.get() + k * slot_floats;
    std::memset(base, 0, slot_floats * sizeof(float));
    float* m = base + full.offset[static_cast<int>(Section::kMaster)] / 4;
    for (std::uint64_t i = 0; i < ce; ++i) m[i] = 1.0f + static_cast<float>(i % 1000) * 1e-3f;
  }
  const std::vector<void*> no_dest;
  const auto t0 = Clock::now();
  for (std::size_t i = 0; i < im.chunks.size(); ++i) {
    // The chunk's own layout, inside the slot (stride <= chunk_elems).
    float* base = scratch.get() + (i % slots) * slot_floats;
    TIER_RETURN_IF_ERROR(
        update_chunk(im, im.chunks[i], base, reinterpret_cast<std::byte*>(base + record_floats), steps, no_dest));
  }
  PassReport r;
  r.seconds = since(t0);
  r.elements = im.numel_total;
  return r;
}

OptimizerStats OffloadedOptimizer::stats() const {
  const Impl& im = *impl_;
  OptimizerStats s;
  s.home = im.opt.home;
  s.partitions = im.parts.size();
  s.elements = im.numel_total;
  s.state_dtype = im.state_dtype();
  s.chunks = im.chunks.size();
  s.chunk_elements = im.chunk_elems;
  s.buffer_count = static_cast<unsigned>(im.bufs.size());
  for (const Buffer& b : im.bufs) s.pinned_bytes += b.mem.bytes;
  s.accumulator_bytes = im.accumulator_bytes.load();
  for (const Chunk& c : im.chunks) {
    s.record_bytes += c.bytes();
    if (c.host) s.host_state_bytes += c.bytes();
  }
  s.nvme_bytes = im.nvme_slot_bytes.load();
  s.state_copies = im.nvme() ? im.opt.state_copies : 1;
  s.spare_slots = im.pool_size;
  s.spare_bytes = im.pool_size * im.layout_of(im.chunk_elems).bytes;
  s.failed_step_owed = im.owed_flag.load();
  if (im.own_swap) {
    const nvme::SwapSpaceStats ss = im.own_swap->stats();
    s.nvme_capacity_bytes = ss.capacity_bytes;
    s.nvme_allocated_bytes = ss.allocated_bytes;
    s.io_registered_bytes = ss.fixed_buffer_bytes;
  } else if (im.swap != nullptr) {
    s.nvme_capacity_bytes = im.nvme_reserved.bytes;
    s.io_registered_bytes = im.swap->stats().fixed_buffer_bytes;
  }
  s.shared_swap = im.swap != nullptr && !im.own_swap;
  {
    std::lock_guard<std::mutex> lock(im.groups_mu);
    s.step = im.groups.empty() ? 0 : im.groups[0].step();
  }
  s.steps_skipped = im.steps_skipped.load(std::memory_order_relaxed);
  s.steps_failed = im.steps_failed.load(std::memory_order_relaxed);
  s.steps_applied = im.steps_applied.load(std::memory_order_relaxed);
  return s;
}

const OffloadedOptimizerOptions& OffloadedOptimizer::options() const noexcept {
  return impl_->opt;
}

std::uint64_t OffloadedOptimizer::partition_count() const noexcept {
  return impl_->parts.size();
}

std::uint64_t OffloadedOptimizer::partition_numel(PartitionId id) const noexcept {
  return id < impl_->parts.size() ? impl_->parts[id].numel : 0;
}

ParamOutput OffloadedOptimizer::partition_output(PartitionId id) const noexcept {
  return id < impl_->parts.size() ? impl_->parts[id].output : ParamOutput::kNone;
}

}  // namespace tier::optim
