// `tier-bench io`: NVMe read/write bandwidth through the swap space, the path every NVMe byte of
// the engine takes (extents, block-size requests kept queue-depth in flight, arena buffers).
//
// Stream mode moves one extent of --size in --block-size transfers, queue_depth of them
// outstanding (each refilled from its completion callback), like fio's sequential jobs. Tensor
// mode (--tensors N) moves a batch of N extents of random sizes, each with its own arena buffer,
// submitted at once. Both print the average device request size from /proc/diskstats, which
// shows whether buffers were contiguous enough for large requests to reach the disk.
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "io_bench.hpp"
#include "tier/ext/host_arena.hpp"
#include "tier/stats.hpp"
#include "tier/ext/swap_space.hpp"
#include "tier/units.hpp"

namespace tier::bench {
namespace {

using nvme::IoFuture;
using nvme::SwapExtent;
using nvme::SwapSpace;
using nvme::SwapSpaceOptions;

// ------------------------------------------------------------------ /proc/diskstats

struct DiskCounters {
  std::uint64_t reads = 0, read_sectors = 0, writes = 0, write_sectors = 0;
};

// The diskstats name of the device holding `path` (the partition when it is one).
std::string device_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  std::ifstream f("/proc/diskstats");
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream ls(line);
    unsigned maj = 0, min = 0;
    std::string name;
    if (ls >> maj >> min >> name && maj == major(st.st_dev) && min == minor(st.st_dev)) return name;
  }
  return {};
}

bool read_disk(const std::string& device, DiskCounters& out) {
  std::ifstream f("/proc/diskstats");
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream ls(line);
    unsigned maj = 0, min = 0;
    std::string name;
    std::uint64_t v[7] = {};
    if (!(ls >> maj >> min >> name) || name != device) continue;
    for (auto& x : v) ls >> x;
    out = {v[0], v[2], v[4], v[6]};
    return true;
  }
  return false;
}

// ------------------------------------------------------------------ buffers

// Either arena blocks or ordinary heap memory in 4 KiB pages (what `fio --mem=malloc` uses).
class Buffers {
 public:
  static Result<Buffers> make(std::uint64_t bytes, bool heap, HugePageMode mode) {
    Buffers b;
    b.bytes_ = (bytes + 4095) / 4096 * 4096;
    if (heap) {
      b.heap_ = static_cast<std::byte*>(std::aligned_alloc(4096, b.bytes_));
      if (!b.heap_) return resource_exhausted(str("no memory for ", format_bytes(b.bytes_), " of buffers"));
      ::madvise(b.heap_, b.bytes_, MADV_NOHUGEPAGE);
      std::memset(b.heap_, 0, b.bytes_);
    } else {
      HostArenaOptions o;
      o.bytes = b.bytes_;
      o.huge_pages = mode;
      TIER_ASSIGN_OR_RETURN(b.arena_, HostArena::create(o));
      TIER_ASSIGN_OR_RETURN(b.block_, b.arena_->allocate(b.bytes_, std::chrono::milliseconds(0), HostArena::kHugePage));
    }
    return b;
  }
  Buffers() = default;
  Buffers(Buffers&& o) noexcept
      : arena_(std::move(o.arena_)),
        block_(std::move(o.block_)),
        heap_(std::exchange(o.heap_, nullptr)),
        bytes_(o.bytes_) {}
  Buffers& operator=(Buffers&&) = delete;
  ~Buffers() {
    block_.reset();
    std::free(heap_);
  }
  std::byte* data() const { return heap_ ? heap_ : block_.data(); }
  HostArena* arena() const { return arena_.get(); }
  double huge_fraction() const {
    if (!arena_) return 0;
    auto s = arena_->stats();
    return s.reserved_bytes ? static_cast<double>(s.huge_page_bytes) / static_cast<double>(s.reserved_bytes) : 0;
  }

 private:
  std::unique_ptr<HostArena> arena_;
  HostBlock block_;
  std::byte* heap_ = nullptr;
  std::uint64_t bytes_ = 0;
};

// Incompressible bytes, as fio writes by default: a virtual disk may store runs of zeros as holes
// (detect-zeroes, discard), which would make zero-filled buffers look faster than any real data.
void fill_random(std::byte* p, std::uint64_t n, std::uint64_t seed) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  std::uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<std::byte>(x >> (8 * (i % 8)));
}

// Makes every 512-byte sector of a block unique (like fio's scramble_buffers), so that a virtual
// disk that deduplicates blocks sees new data on every write; the first 8 bytes are the block's
// index, which reads check.
void stamp(std::byte* p, std::uint64_t n, std::uint64_t index) {
  std::memcpy(p, &index, sizeof index);
  for (std::uint64_t off = 512; off + 16 <= n; off += 512) {
    const std::uint64_t v[2] = {index, off};
    std::memcpy(p + off, v, sizeof v);
  }
}

// ------------------------------------------------------------------ the measurement

// Moves [0, total) of `e` in block-size transfers with `window` of them outstanding, each buffer
// slot refilled from the completion callback of the transfer that used it. The state is shared
// with the callbacks, which run on the swap space's I/O threads.
class Stream : public std::enable_shared_from_this<Stream> {
 public:
  Stream(SwapSpace& sp, const SwapExtent& e, std::byte* buf, std::uint64_t total, std::uint64_t block, bool write)
      : sp_(sp), e_(e), buf_(buf), total_(total), block_(block), blocks_((total + block - 1) / block), write_(write) {}

  Status run(unsigned window, Progress* progress) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      live_ = window;
    }
    for (unsigned s = 0; s < window; ++s) issue(s);
    std::unique_lock<std::mutex> lk(mu_);
    while (live_ > 0) {
      cv_.wait_for(lk, std::chrono::milliseconds(100));
      if (progress) progress->update(done_.load());
    }
    if (progress) progress->update(done_.load());
    return error_;
  }

 private:
  void fail(const Status& s) {
    std::lock_guard<std::mutex> lk(mu_);
    if (error_.ok()) error_ = s;
  }

  void issue(unsigned slot) {
    for (;;) {
      const std::uint64_t i = next_.fetch_add(1);
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (i >= blocks_ || !error_.ok()) {
          if (--live_ == 0) cv_.notify_all();
          return;
        }
      }
      const std::uint64_t off = i * block_;
      const std::uint64_t n = std::min(block_, total_ - off);
      std::byte* p = buf_ + static_cast<std::uint64_t>(slot) * block_;
      if (write_) stamp(p, n, i);
      IoFuture f = write_ ? sp_.write(e_, p, n, off) : sp_.read(e_, p, n, off);
      if (f.ready() && !f.status().ok()) {
        fail(f.status());
        continue;
      }
      f.on_complete([self = shared_from_this(), slot, i, n, p](const Status& s) {
        if (!s.ok()) self->fail(s);
        if (s.ok() && !self->write_) {
          std::uint64_t tag = 0;
          std::memcpy(&tag, p, sizeof tag);
          if (tag != i) self->fail(data_loss(str("block ", i, " read back the content of block ", tag)));
        }
        self->done_ += n;
        self->issue(slot);  // refill this slot from the I/O thread
      });
      return;
    }
  }

  SwapSpace& sp_;
  const SwapExtent& e_;
  std::byte* buf_;
  const std::uint64_t total_, block_, blocks_;
  const bool write_;
  std::atomic<std::uint64_t> next_{0};
  std::atomic<std::uint64_t> done_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  unsigned live_ = 0;
  Status error_;
};

Status stream(SwapSpace& sp, const SwapExtent& e, std::byte* buf, std::uint64_t total, std::uint64_t block,
              unsigned window, bool write, Progress* progress) {
  auto st = std::make_shared<Stream>(sp, e, buf, total, block, write);
  return st->run(window, progress);
}

}  // namespace

Result<IoBenchResult> run_io_bench(const IoBenchSpec& spec) {
  if (spec.paths.empty()) return invalid_argument("--path: give the directory to test (on the SSD)");
  if (spec.block_size % 4096 != 0 || spec.block_size == 0 || spec.block_size > (1u << 30)) {
    return invalid_argument("--block-size must be a multiple of 4K from 4K to 1G");
  }
  if (spec.queue_depth < 1 || spec.queue_depth > 4096) return invalid_argument("--queue-depth must be from 1 to 4096");
  if (spec.tensors && (spec.min_tensor == 0 || spec.min_tensor > spec.max_tensor)) {
    return invalid_argument("--min-tensor must be at least 1 and at most --max-tensor");
  }

  // Tensor sizes (4 KiB multiples) or one stream of --size.
  std::vector<std::uint64_t> sizes;
  std::uint64_t total = 0;
  if (spec.tensors) {
    std::mt19937_64 rng(spec.seed);
    std::uniform_int_distribution<std::uint64_t> dist(spec.min_tensor, spec.max_tensor);
    for (unsigned i = 0; i < spec.tensors; ++i) {
      const std::uint64_t n = (dist(rng) + 4095) / 4096 * 4096;
      sizes.push_back(n);
      total += n;
    }
  } else {
    total = (spec.size + spec.block_size - 1) / spec.block_size * spec.block_size;
  }
  if (total == 0) return invalid_argument("--size must be at least one block");
  const unsigned window = spec.queue_depth * spec.parallelism;
  const std::uint64_t buffer_bytes =
      spec.tensors ? total : std::min<std::uint64_t>(total, std::uint64_t{window} * spec.block_size);
  TIER_ASSIGN_OR_RETURN(Buffers bufs, Buffers::make(buffer_bytes, spec.heap_buffers, spec.huge_pages));
  fill_random(bufs.data(), buffer_bytes, spec.seed);

  Counters counters;
  SwapSpaceOptions o;
  o.paths = spec.paths;
  o.bytes_per_path = (total / spec.paths.size() + spec.block_size) / 4096 * 4096 + (16 << 20);
  o.preallocate = true;  // laid out before the clock starts, as fio lays out its files
  o.engine = spec.engine;
  o.block_size = spec.block_size;
  o.queue_depth = spec.queue_depth;
  o.intra_op_parallelism = spec.parallelism;
  o.single_submit = spec.single_submit;
  o.use_direct = spec.direct;
  o.sqpoll = spec.sqpoll;
  o.fixed_buffers = spec.fixed_buffers;
  o.stripe_unit = spec.block_size;
  o.arena = bufs.arena();
  o.counters = &counters;
  TIER_ASSIGN_OR_RETURN(auto sp, SwapSpace::create(o));

  std::vector<SwapExtent> extents;
  if (spec.tensors) {
    for (std::uint64_t n : sizes) {
      TIER_ASSIGN_OR_RETURN(SwapExtent e, sp->allocate(n));
      extents.push_back(std::move(e));
    }
  } else {
    TIER_ASSIGN_OR_RETURN(SwapExtent e, sp->allocate(total));
    extents.push_back(std::move(e));
  }

  // Tensor mode: every tensor has its own buffer and the whole batch is submitted at once.
  auto batch = [&](bool write, Progress* progress) -> Status {
    std::vector<IoFuture> fs;
    std::uint64_t off = 0;
    for (std::size_t i = 0; i < extents.size(); ++i) {
      std::byte* p = bufs.data() + off;
      if (write) stamp(p, sizes[i], i);
      fs.push_back(write ? sp->write(extents[i], p, sizes[i]) : sp->read(extents[i], p, sizes[i]));
      off += sizes[i];
    }
    std::uint64_t done = 0;
    Status first;
    off = 0;
    for (std::size_t i = 0; i < fs.size(); ++i) {
      Status s = fs[i].wait();
      if (s.ok() && !write) {
        std::uint64_t tag = 0;
        std::memcpy(&tag, bufs.data() + off, sizeof tag);
        if (tag != i) s = data_loss(str("tensor ", i, " read back the content of tensor ", tag));
      }
      if (first.ok() && !s.ok()) first = s;
      done += sizes[i];
      off += sizes[i];
      if (progress) progress->update(done);
    }
    return first;
  };
  auto pass = [&](bool write, Progress* progress) -> Status {
    if (spec.tensors) return batch(write, progress);
    return stream(*sp, extents[0], bufs.data(), total, spec.block_size, window, write, progress);
  };

  if (spec.prefill) {
    Progress prep("preparing (writing the file once)", total, true, spec.progress);
    TIER_RETURN_IF_ERROR(pass(true, &prep));
    prep.finish();
  }

  const std::string device = spec.device.empty() ? device_of(spec.paths[0]) : spec.device;
  DiskCounters d0, d1;
  const bool have_disk = !device.empty() && read_disk(device, d0);
  std::vector<double> rates;
  double secs_total = 0;
  for (unsigned k = 0; k < spec.passes; ++k) {
    const std::string label =
        str(spec.write ? "write " : "read ", format_bytes(spec.block_size), " x ", spec.queue_depth, " (",
            sp->stats().engine, ")", spec.passes > 1 ? str(" pass ", k + 1, "/", spec.passes) : "");
    Progress progress(label, total, true, spec.progress);
    const auto t0 = std::chrono::steady_clock::now();
    TIER_RETURN_IF_ERROR(pass(spec.write, &progress));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    progress.finish();
    secs_total += secs;
    rates.push_back(secs > 0 ? static_cast<double>(total) / secs : 0);
  }

  IoBenchResult r;
  auto st = sp->stats();
  r.engine = st.engine;
  r.bytes = total;
  r.passes = rates;
  r.seconds = secs_total / spec.passes;
  std::vector<double> sorted = rates;
  std::sort(sorted.begin(), sorted.end());
  r.bytes_per_second = sorted[sorted.size() / 2];  // the median pass
  r.device = device;
  if (have_disk && read_disk(device, d1)) {
    const std::uint64_t reqs = spec.write ? d1.writes - d0.writes : d1.reads - d0.reads;
    const std::uint64_t sectors = spec.write ? d1.write_sectors - d0.write_sectors : d1.read_sectors - d0.read_sectors;
    r.device_requests = reqs;
    r.avg_request_bytes = reqs ? 512.0 * static_cast<double>(sectors) / static_cast<double>(reqs) : 0;
  }
  r.direct = !st.paths.empty() && st.paths[0].direct_io;
  r.fixed_buffers = st.fixed_buffers;
  r.huge_page_fraction = bufs.huge_fraction();
  r.requests = st.requests;
  r.submit_calls = st.submit_calls;
  return r;
}

Result<IoEngineKind> parse_engine(const std::string& s) {
  if (s == "auto") return IoEngineKind::kAuto;
  if (s == "uring") return IoEngineKind::kUring;
  if (s == "aio") return IoEngineKind::kAio;
  if (s == "posix") return IoEngineKind::kPosix;
  return invalid_argument(str("--engine '", s, "' is not one of auto|uring|aio|posix"));
}

namespace {

int run_io(Args& args) {
  IoBenchSpec spec;
  Status s;
  auto take = [&](auto r, auto& into) { take_option(s, std::move(r), into); };
  spec.paths = split_list(args.get("path", ""));
  take(args.size("size", 4ull << 30), spec.size);
  take(args.size("block-size", 1 << 20), spec.block_size);
  take(args.integer("queue-depth", 32), spec.queue_depth);
  take(args.integer("parallelism", 1), spec.parallelism);
  std::string engine = "auto", rw = "read", buffers = "arena", huge = "auto";
  take(args.choice("engine", {"auto", "uring", "aio", "posix"}, "auto"), engine);
  take(args.choice("rw", {"read", "write"}, "read"), rw);
  take(args.choice("buffers", {"arena", "heap"}, "arena"), buffers);
  take(args.choice("huge-pages", {"auto", "thp", "hugetlbfs", "off"}, "auto"), huge);
  spec.direct = !args.flag("buffered");
  spec.sqpoll = args.flag("sqpoll");
  spec.fixed_buffers = !args.flag("no-fixed-buffers");
  spec.single_submit = args.flag("single-submit");
  spec.prefill = !args.flag("no-prefill");
  take(args.integer("tensors", 0), spec.tensors);
  take(args.size("min-tensor", 64 << 10), spec.min_tensor);
  take(args.size("max-tensor", 4 << 20), spec.max_tensor);
  take(args.integer("seed", 1), spec.seed);
  take(args.integer("passes", 1), spec.passes);
  spec.device = args.get("device", "");
  const bool json_out = args.flag("json");
  spec.progress = !args.flag("quiet") && !json_out;
  if (Status f = args.finish(); s.ok() && !f.ok()) s = f;
  if (s.ok()) {
    auto k = parse_engine(engine);
    if (k.ok()) {
      spec.engine = *k;
    } else {
      s = k.status();
    }
  }
  spec.write = rw == "write";
  spec.heap_buffers = buffers == "heap";
  spec.huge_pages = huge == "thp"         ? HugePageMode::kThp
                    : huge == "hugetlbfs" ? HugePageMode::kHugetlbfs
                    : huge == "off"       ? HugePageMode::kOff
                                          : HugePageMode::kAuto;
  if (s.ok() && (spec.parallelism < 1 || spec.parallelism > 256)) s = invalid_argument("--parallelism: 1 to 256");
  if (s.ok() && (spec.passes < 1 || spec.passes > 100)) s = invalid_argument("--passes: 1 to 100");
  if (!s.ok()) {
    std::fprintf(stderr, "tier-bench io: %s\n", s.message().c_str());
    return 2;
  }
  auto r = run_io_bench(spec);
  if (!r.ok()) {
    std::fprintf(stderr, "tier-bench io: %s\n", r.status().to_string().c_str());
    return 1;
  }
  if (json_out) {
    nlohmann::ordered_json j = {{"bytes_per_second", r->bytes_per_second},
                                {"engine", r->engine},
                                {"block_size", spec.block_size},
                                {"queue_depth", spec.queue_depth},
                                {"rw", rw},
                                {"bytes", r->bytes},
                                {"seconds", r->seconds},
                                {"passes", r->passes},
                                {"paths", spec.paths},
                                {"nvme_path_is_tmpfs", !in_memory_paths(spec.paths).empty()},
                                {"parallelism", spec.parallelism},
                                {"direct", r->direct},
                                {"buffers", buffers},
                                {"fixed_buffers", r->fixed_buffers},
                                {"huge_page_fraction", r->huge_page_fraction},
                                {"tensors", spec.tensors},
                                {"requests", r->requests},
                                {"submit_calls", r->submit_calls},
                                {"device", r->device},
                                {"device_requests", r->device_requests},
                                {"avg_request_bytes", r->avg_request_bytes}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  Table t({"engine", "rw", "block", "depth", "bytes", "time", "throughput", "avg device request", "buffers"});
  const std::string req = r->avg_request_bytes > 0 ? str(format_bytes(static_cast<std::uint64_t>(r->avg_request_bytes)),
                                                         " (", r->device, ")")
                                                   : "n/a";
  const std::string buf_note = spec.heap_buffers ? "heap, 4 KiB pages"
                                                 : str("arena, ", static_cast<int>(r->huge_page_fraction * 100 + 0.5),
                                                       "% huge pages", r->fixed_buffers ? ", fixed" : "");
  t.add({r->engine + (r->direct ? "" : " (buffered)"), rw + (spec.tensors ? str(", ", spec.tensors, " tensors") : ""),
         format_bytes(spec.block_size), std::to_string(spec.queue_depth), format_bytes(r->bytes),
         format_seconds(r->seconds),
         format_rate(r->bytes_per_second) +
             (r->passes.size() > 1 ? str(" (median of ", r->passes.size(), ", ",
                                         format_rate(*std::min_element(r->passes.begin(), r->passes.end())), "..",
                                         format_rate(*std::max_element(r->passes.begin(), r->passes.end())), ")")
                                   : ""),
         req, buf_note});
  t.print();
  warn_in_memory_paths(spec.paths);
  return 0;
}

const CommandRegistrar kRegister(
    {"io", "NVMe read/write bandwidth through the swap space (compare with bench/compare_fio.sh)",
     "  --path DIR[,DIR...]   directories on the SSD(s) to test; several stripe like swap paths (required)\n"
     "  --size N              bytes to move (default 4G; K/M/G suffixes)\n"
     "  --block-size N        bytes per request (default 1M)\n"
     "  --queue-depth N       requests in flight per I/O thread (default 32)\n"
     "  --engine E            auto|uring|aio|posix (default auto)\n"
     "  --rw read|write       direction (default read)\n"
     "  --parallelism N       I/O threads, each with its own engine (default 1)\n"
     "  --tensors N           move a batch of N tensors instead of one stream\n"
     "  --min-tensor N        smallest tensor (default 64K)\n"
     "  --max-tensor N        largest tensor (default 4M)\n"
     "  --seed N              tensor sizes' random seed (default 1)\n"
     "  --buffers arena|heap  pinned huge-page arena (default) or ordinary 4 KiB-page heap memory\n"
     "  --huge-pages M        arena backing: auto|thp|hugetlbfs|off (default auto)\n"
     "  --buffered            no O_DIRECT\n"
     "  --sqpoll              io_uring submission polling\n"
     "  --no-fixed-buffers    do not register the arena with io_uring\n"
     "  --single-submit       one system call per request\n"
     "  --no-prefill          skip writing the file before the timed pass\n"
     "  --passes N            timed passes over the same file; the median is reported (default 1)\n"
     "  --device NAME         /proc/diskstats device (default: the one holding --path)\n"
     "  --quiet               no progress line\n"
     "  --json                print one JSON object",
     run_io});

// `tier-bench summary`: the swap path's read and write next to the same engine with ordinary
// buffers, in the same run, in the system's temporary directory.
Result<std::vector<SummaryRow>> summary_nvme(bool quick) {
  IoBenchSpec spec;
  spec.paths = {std::filesystem::temp_directory_path().string()};
  spec.size = quick ? (256ull << 20) : (1ull << 30);
  spec.block_size = 1 << 20;
  spec.queue_depth = 32;
  spec.progress = false;
  std::vector<SummaryRow> rows;
  for (bool write : {false, true}) {
    spec.write = write;
    spec.heap_buffers = false;
    TIER_ASSIGN_OR_RETURN(IoBenchResult tier_r, run_io_bench(spec));
    spec.heap_buffers = true;
    TIER_ASSIGN_OR_RETURN(IoBenchResult heap_r, run_io_bench(spec));
    auto req = [](const IoBenchResult& x) {
      return x.avg_request_bytes > 0 ? format_bytes(static_cast<std::uint64_t>(x.avg_request_bytes)) : "n/a";
    };
    rows.push_back(
        {str("nvme ", write ? "write" : "read", " (", tier_r.engine, tier_r.direct ? ", O_DIRECT" : "", ", 1M x 32)"),
         format_rate(tier_r.bytes_per_second), str("4K-page buffers ", format_rate(heap_r.bytes_per_second)),
         heap_r.bytes_per_second > 0 ? tier_r.bytes_per_second / heap_r.bytes_per_second : 0,
         str("avg request ", req(tier_r), " vs ", req(heap_r), ", ", format_bytes(tier_r.bytes), " in ",
             spec.paths[0])});
  }
  return rows;
}

const SummaryRegistrar kSummary({30, "nvme (swap space)", summary_nvme});

}  // namespace
}  // namespace tier::bench
