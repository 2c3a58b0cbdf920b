#include "read_reference.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "cli.hpp"
#include "tier/units.hpp"

namespace tier::bench {

namespace fs = std::filesystem;

std::string ReadReference::describe() const {
  return str("sequential ", direct ? "O_DIRECT" : "buffered", bytes_written ? " read + write (1:1)" : " read", ", ",
             format_bytes(block_bytes), " blocks, depth ", depth,
             streams > 1 ? str(", ", streams, " streams") : std::string(),
             method == ReferenceMethod::kUring ? ", io_uring" : ", pread/pwrite threads");
}

namespace {

struct OpenFile {
  int fd = -1;
  std::uint64_t length = 0;  // bytes to move, whole blocks
  bool write = false;
};

struct Request {
  std::size_t file;
  std::uint64_t offset;
};

// Opens with O_DIRECT, or without where the file system refuses it (clearing *direct).
int open_file(const fs::path& p, int flags, bool* direct) {
  int fd = ::open(p.c_str(), flags | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0 && errno == EINVAL) {
    *direct = false;  // tmpfs and a few others refuse O_DIRECT
    fd = ::open(p.c_str(), flags | O_CLOEXEC, 0600);
  }
  return fd;
}

// A fresh scratch file (O_CREAT|O_EXCL|O_NOFOLLOW under an unpredictable name: nothing another
// user planted in the folder is truncated or written through), then O_DIRECT on that very file,
// reopened through its descriptor rather than its name, where the file system allows it.
int create_scratch(const fs::path& p, bool* direct) {
  const int fd = ::open(p.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0 || !*direct) return fd;
  const int d = ::open(str("/proc/self/fd/", fd).c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
  if (d < 0) {
    *direct = false;  // refused (tmpfs), or no /proc: buffered
    return fd;
  }
  ::close(fd);
  return d;
}

// The regular files under `dirs` (recursively), sorted, each to be read up to its share of `bytes`.
Status open_for_reading(const std::vector<std::string>& dirs, std::uint64_t bytes, std::uint64_t block,
                        std::vector<OpenFile>* files, bool* direct) {
  std::vector<fs::path> paths;
  for (const auto& dir : dirs) {
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
         it.increment(ec)) {
      if (it->is_regular_file(ec)) paths.push_back(it->path());
    }
  }
  if (paths.empty()) return not_found("NVMe reference: no file to read under the given directories");
  std::sort(paths.begin(), paths.end());
  const std::uint64_t per_file = (bytes / paths.size() + block - 1) / block * block;
  for (const auto& p : paths) {
    const int fd = open_file(p, O_RDONLY, direct);
    if (fd < 0) return errno_status(errno, str("NVMe reference: open ", p.string()));
    std::error_code ec;
    const std::uint64_t size = fs::file_size(p, ec);
    files->push_back({fd, std::min(per_file, ec ? 0 : size / block * block), false});
  }
  return {};
}

// A request's buffer: anonymous memory in 2 MiB transparent huge pages where the kernel gives them
// (MADV_HUGEPAGE, as the engine's arena asks), so that pinning the pages of an O_DIRECT request
// costs what it costs the engine; 4 KiB pages otherwise.
class PageBuffer {
 public:
  explicit PageBuffer(std::uint64_t bytes) : bytes_((bytes + (2u << 20) - 1) & ~std::uint64_t{(2u << 20) - 1}) {
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    ::madvise(p, bytes_, MADV_HUGEPAGE);
    std::memset(p, 0x5a, bytes_);
    data_ = p;
  }
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;
  ~PageBuffer() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
  }
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  std::uint64_t bytes_;
};

// A value no other pass of this process (or another) uses, for stamp().
std::uint64_t pass_nonce() {
  static std::atomic<std::uint64_t> passes{0};
  return (static_cast<std::uint64_t>(::getpid()) << 32) ^ passes.fetch_add(1) ^
         static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
}

// Every 512-byte sector of a write gets bytes no other write had (pass, request, sector), so that
// a deduplicating or compressing virtual disk cannot flatter the reference.
void stamp(void* buf, std::uint64_t block, std::uint64_t nonce, std::size_t request) {
  for (std::uint64_t sector = 0; sector < block / 512; ++sector) {
    const std::uint64_t words[2] = {nonce, (static_cast<std::uint64_t>(request) << 24) | sector};
    std::memcpy(static_cast<char*>(buf) + sector * 512, words, sizeof words);
  }
}

// Runs `requests` with `depth` threads, each taking the next request, so `depth` blocks are in
// flight. Returns the wall time.
Result<double> run_threads(const std::vector<OpenFile>& files, const std::vector<Request>& requests,
                           std::uint64_t block, int depth) {
  std::atomic<std::size_t> next{0};
  std::atomic<int> first_error{0};
  const std::uint64_t nonce = pass_nonce();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < depth; ++t) {
    threads.emplace_back([&] {
      PageBuffer page(block);
      void* buf = page.data();
      if (buf == nullptr) {
        first_error.store(ENOMEM);
        return;
      }
      while (first_error.load() == 0) {
        const std::size_t i = next.fetch_add(1);
        if (i >= requests.size()) break;
        const OpenFile& f = files[requests[i].file];
        if (f.write) stamp(buf, block, nonce, i);
        std::uint64_t done = 0;
        while (done < block) {
          char* p = static_cast<char*>(buf) + done;
          const auto off = static_cast<off_t>(requests[i].offset + done);
          const ssize_t n = f.write ? ::pwrite(f.fd, p, block - done, off) : ::pread(f.fd, p, block - done, off);
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) {
            first_error.store(n < 0 ? errno : EIO);
            break;
          }
          done += static_cast<std::uint64_t>(n);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (int err = first_error.load(); err != 0) return errno_status(err, "NVMe reference: a request failed");
  return secs;
}

// The same requests through one io_uring, `depth` in flight, each refilled as one completes. A
// short transfer is finished by a follow-up request for the rest.
Result<double> run_uring(const std::vector<OpenFile>& files, const std::vector<Request>& requests, std::uint64_t block,
                         int depth) {
  io_uring ring{};
  const unsigned entries = static_cast<unsigned>(std::max(depth, 1));
  if (int rc = io_uring_queue_init(entries, &ring, 0); rc < 0) {
    return errno_status(-rc, "NVMe reference: io_uring_queue_init");
  }
  struct Slot {
    void* buf = nullptr;
    std::size_t request = 0;
    std::uint64_t done = 0;  // bytes of the request finished
  };
  // One mapping for every slot's buffer (huge pages, see PageBuffer).
  PageBuffer pages(block * entries);
  std::vector<Slot> slots(entries);
  int error = pages.data() == nullptr ? ENOMEM : 0;
  for (std::size_t k = 0; error == 0 && k < slots.size(); ++k) {
    slots[k].buf = static_cast<char*>(pages.data()) + k * block;
  }
  const std::uint64_t nonce = pass_nonce();
  std::size_t next = 0;
  unsigned in_flight = 0;
  auto queue = [&](std::size_t k) {
    Slot& sl = slots[k];
    const Request& r = requests[sl.request];
    const OpenFile& f = files[r.file];
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    char* p = static_cast<char*>(sl.buf) + sl.done;
    const unsigned n = static_cast<unsigned>(block - sl.done);
    const auto off = static_cast<__u64>(r.offset + sl.done);
    if (f.write) {
      io_uring_prep_write(sqe, f.fd, p, n, off);
    } else {
      io_uring_prep_read(sqe, f.fd, p, n, off);
    }
    io_uring_sqe_set_data64(sqe, k);
    ++in_flight;
  };
  auto start = [&](std::size_t k) {
    slots[k].request = next++;
    slots[k].done = 0;
    if (files[requests[slots[k].request].file].write) stamp(slots[k].buf, block, nonce, slots[k].request);
    queue(k);
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t k = 0; error == 0 && k < slots.size() && next < requests.size(); ++k) start(k);
  while (error == 0 && in_flight > 0) {
    if (int rc = io_uring_submit(&ring); rc < 0 && rc != -EINTR) {
      error = -rc;
      break;
    }
    io_uring_cqe* cqe = nullptr;
    const int rc = io_uring_wait_cqe(&ring, &cqe);
    if (rc == -EINTR) continue;
    if (rc < 0) {
      error = -rc;
      break;
    }
    const std::size_t k = static_cast<std::size_t>(io_uring_cqe_get_data64(cqe));
    const int res = cqe->res;
    io_uring_cqe_seen(&ring, cqe);
    --in_flight;
    if (res == -EINTR || res == -EAGAIN) {
      queue(k);
      continue;
    }
    if (res <= 0) {
      error = res < 0 ? -res : EIO;
      break;
    }
    slots[k].done += static_cast<std::uint64_t>(res);
    if (slots[k].done < block) {
      queue(k);
    } else if (next < requests.size()) {
      start(k);
    }
  }
  // An error leaves requests in flight: wait for them before their buffers go.
  while (in_flight > 0) {
    io_uring_cqe* cqe = nullptr;
    if (io_uring_wait_cqe(&ring, &cqe) < 0) break;
    io_uring_cqe_seen(&ring, cqe);
    --in_flight;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  io_uring_queue_exit(&ring);
  if (error != 0) return errno_status(error, "NVMe reference: a request failed");
  return secs;
}

Result<double> run_requests(const std::vector<OpenFile>& files, const std::vector<Request>& requests,
                            std::uint64_t block, int depth, ReferenceMethod method) {
  return method == ReferenceMethod::kUring ? run_uring(files, requests, block, depth)
                                           : run_threads(files, requests, block, depth);
}

// `seq` as `streams` sequential streams over consecutive parts of it, taken in turn (a block of
// the first part, then of the second, ...): with enough requests in flight the disk sees that many
// sequential streams at once, as it does when the engine moves several tensors together.
std::vector<Request> as_streams(const std::vector<Request>& seq, int streams) {
  const std::size_t n = seq.size();
  const std::size_t k = static_cast<std::size_t>(std::max(streams, 1));
  if (k == 1 || n < 2) return seq;
  const std::size_t part = (n + k - 1) / k;
  std::vector<Request> out;
  out.reserve(n);
  for (std::size_t i = 0; i < part; ++i) {
    for (std::size_t p = 0; p < k; ++p) {
      if (p * part + i < n) out.push_back(seq[p * part + i]);
    }
  }
  return out;
}

void close_all(std::vector<OpenFile>& files) {
  for (auto& f : files) {
    if (f.fd >= 0) ::close(f.fd);
  }
}

std::vector<Request> blocks_of(const std::vector<OpenFile>& files, bool write, std::uint64_t block) {
  std::vector<Request> out;
  for (std::size_t f = 0; f < files.size(); ++f) {
    if (files[f].write != write) continue;
    for (std::uint64_t off = 0; off < files[f].length; off += block) out.push_back({f, off});
  }
  return out;
}

Status check_shape(std::uint64_t block, int depth) {
  if (block == 0 || block % 4096 != 0 || depth < 1) {
    return invalid_argument("NVMe reference: the block must be a non-zero multiple of 4096 and the depth at least 1");
  }
  return {};
}

}  // namespace

Result<ReadReference> measure_sequential_read(const std::string& dir, std::uint64_t bytes, std::uint64_t block_bytes,
                                              int depth, ReferenceMethod method, int streams) {
  TIER_RETURN_IF_ERROR(check_shape(block_bytes, depth));
  std::vector<OpenFile> files;
  bool direct = true;
  Status s = open_for_reading({dir}, bytes, block_bytes, &files, &direct);
  const std::vector<Request> reads = as_streams(blocks_of(files, false, block_bytes), streams);
  Result<double> secs = s.ok() ? run_requests(files, reads, block_bytes, depth, method) : Result<double>(s);
  close_all(files);
  if (!secs.ok()) return secs.status();
  ReadReference r;
  r.bytes_read = reads.size() * block_bytes;
  r.bytes_per_second = *secs > 0 ? static_cast<double>(r.bytes_read) / *secs : 0;
  r.block_bytes = block_bytes;
  r.depth = depth;
  r.direct = direct;
  r.method = method;
  r.streams = std::max(streams, 1);
  r.files = static_cast<int>(files.size());
  return r;
}

Result<ReadReference> measure_mixed_read_write(const std::vector<std::string>& dirs, std::uint64_t bytes,
                                               std::uint64_t block_bytes, int depth, ReferenceMethod method,
                                               int streams) {
  TIER_RETURN_IF_ERROR(check_shape(block_bytes, depth));
  if (dirs.empty()) return invalid_argument("NVMe reference: no directory given");
  std::vector<OpenFile> files;
  bool direct = true;
  std::vector<fs::path> scratch;
  auto cleanup = [&] {
    close_all(files);
    std::error_code ec;
    for (const auto& p : scratch) fs::remove(p, ec);
  };
  Status s = open_for_reading(dirs, bytes, block_bytes, &files, &direct);
  const std::uint64_t per_dir = (bytes / dirs.size() + block_bytes - 1) / block_bytes * block_bytes;
  for (std::size_t d = 0; s.ok() && d < dirs.size(); ++d) {
    scratch.push_back(fs::path(dirs[d]) / str(".tier-bench-reference-", ::getpid(), "-", random_hex(), ".tmp"));
    const int fd = create_scratch(scratch.back(), &direct);
    if (fd < 0) {
      s = errno_status(errno, str("NVMe reference: create ", scratch.back().string()));
      break;
    }
    files.push_back({fd, per_dir, true});
  }
  // Untimed: the scratch files' first writes allocate their blocks.
  const std::vector<Request> writes = blocks_of(files, true, block_bytes);
  if (s.ok()) {
    if (auto first = run_requests(files, writes, block_bytes, depth, method); !first.ok()) s = first.status();
  }
  // Timed: reads and writes alternate in one sequence.
  const std::vector<Request> reads = as_streams(blocks_of(files, false, block_bytes), streams);
  const std::vector<Request> stream_writes = as_streams(writes, streams);
  std::vector<Request> mixed;
  for (std::size_t i = 0; i < std::max(reads.size(), writes.size()); ++i) {
    if (i < reads.size()) mixed.push_back(reads[i]);
    if (i < writes.size()) mixed.push_back(stream_writes[i]);
  }
  Result<double> secs = s.ok() ? run_requests(files, mixed, block_bytes, depth, method) : Result<double>(s);
  cleanup();
  if (!secs.ok()) return secs.status();
  ReadReference r;
  r.bytes_read = reads.size() * block_bytes;
  r.bytes_written = writes.size() * block_bytes;
  r.bytes_per_second = *secs > 0 ? static_cast<double>(r.bytes_read + r.bytes_written) / *secs : 0;
  r.block_bytes = block_bytes;
  r.depth = depth;
  r.direct = direct;
  r.method = method;
  r.streams = std::max(streams, 1);
  r.files = static_cast<int>(files.size());
  return r;
}

Result<ReferenceFolders> ReferenceFolders::create(const std::vector<std::string>& paths, std::uint64_t bytes,
                                                  const std::string& what) {
  if (paths.empty()) return invalid_argument(str(what, ": no directory given"));
  ReferenceFolders out;
  // Whole multiples of any block a reference uses (1 MiB, 4 MiB, the engine's), so that its share
  // per file is read whole.
  constexpr std::uint64_t kRound = std::uint64_t{64} << 20;
  const std::uint64_t per_dir = (bytes / paths.size() + kRound - 1) / kRound * kRound;
  std::vector<std::uint64_t> block((std::uint64_t{1} << 20) / 8);
  std::uint64_t x = 0x9e3779b97f4a7c15ull ^ static_cast<std::uint64_t>(::getpid());
  for (const auto& p : paths) {
    std::error_code ec;
    fs::create_directories(p, ec);
    if (ec) return errno_status(ec.value(), str(what, ": path ", p));
    std::string d = str(p, "/.tier-bench-ref-", ::getpid(), "-XXXXXX");
    if (::mkdtemp(d.data()) == nullptr) return errno_status(errno, str(what, ": reference folder in ", p));
    out.dirs_.push_back(d);
    const std::string f = d + "/data";
    const int fd = ::open(f.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return errno_status(errno, str(what, ": create ", f));
    Status s;
    for (std::uint64_t done = 0; s.ok() && done < per_dir; done += block.size() * 8) {
      for (auto& w : block) {  // xorshift64: incompressible bytes, as the engine's state is
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w = x;
      }
      const std::size_t n = block.size() * 8;
      std::size_t put = 0;
      while (put < n) {
        const ssize_t k = ::write(fd, reinterpret_cast<const char*>(block.data()) + put, n - put);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
          s = errno_status(k < 0 ? errno : ENOSPC, str(what, ": writing ", f));
          break;
        }
        put += static_cast<std::size_t>(k);
      }
    }
    if (s.ok() && ::fdatasync(fd) != 0) s = errno_status(errno, str(what, ": fdatasync ", f));
    ::close(fd);
    if (!s.ok()) return s;  // the destructor removes what was made
  }
  return out;
}

ReferenceFolders::~ReferenceFolders() {
  for (const auto& d : dirs_) {
    std::error_code ec;
    fs::remove_all(d, ec);
  }
}

void print_reference(const ReadReference& r) {
  std::fprintf(stderr, "  %s: %s\n", format_rate(r.bytes_per_second).c_str(), r.describe().c_str());
}

ReferenceShapes reference_shapes(std::uint64_t engine_block, int engine_depth) {
  ReferenceShapes out;
  out.methods = {ReferenceMethod::kThreads, ReferenceMethod::kUring};
  out.streams = {1, 4};
  out.passes = 1;  // the benchmarks measure the best shape again beside their timed runs
  for (std::uint64_t b : {engine_block, std::uint64_t{1} << 20, std::uint64_t{4} << 20}) {
    if (b != 0 && std::find(out.blocks.begin(), out.blocks.end(), b) == out.blocks.end()) out.blocks.push_back(b);
  }
  const int d = std::max(engine_depth, 1);
  for (int x : {d, 4 * d, 16 * d}) {
    x = std::min(x, 256);
    if (std::find(out.depths.begin(), out.depths.end(), x) == out.depths.end()) out.depths.push_back(x);
  }
  return out;
}

namespace {

template <class Measure>
Result<ReadReference> best_of(const ReferenceShapes& shapes, void (*progress)(const ReadReference&),
                              Measure&& measure) {
  if (shapes.methods.empty() || shapes.blocks.empty() || shapes.depths.empty() || shapes.streams.empty() ||
      shapes.passes < 1) {
    return invalid_argument("NVMe reference: no request shape to measure");
  }
  ReadReference best;
  for (ReferenceMethod method : shapes.methods) {
    for (std::uint64_t block : shapes.blocks) {
      for (int depth : shapes.depths) {
        for (int streams : shapes.streams) {
          for (int pass = 0; pass < shapes.passes; ++pass) {
            TIER_ASSIGN_OR_RETURN(ReadReference r, measure(method, block, depth, streams));
            if (progress != nullptr) progress(r);
            if (r.bytes_per_second > best.bytes_per_second) best = r;
          }
        }
      }
    }
  }
  return best;
}

}  // namespace

Result<ReadReference> best_sequential_read(const std::string& dir, std::uint64_t bytes, const ReferenceShapes& shapes,
                                           void (*progress)(const ReadReference&)) {
  return best_of(shapes, progress, [&](ReferenceMethod method, std::uint64_t block, int depth, int streams) {
    return measure_sequential_read(dir, bytes, block, depth, method, streams);
  });
}

Result<ReadReference> best_mixed_read_write(const std::vector<std::string>& dirs, std::uint64_t bytes,
                                            const ReferenceShapes& shapes, void (*progress)(const ReadReference&)) {
  return best_of(shapes, progress, [&](ReferenceMethod method, std::uint64_t block, int depth, int streams) {
    return measure_mixed_read_write(dirs, bytes, block, depth, method, streams);
  });
}

Result<ReadReference> measure_again(const ReadReference& best, const std::string& dir, std::uint64_t bytes) {
  TIER_ASSIGN_OR_RETURN(ReadReference r,
                        measure_sequential_read(dir, bytes, best.block_bytes, best.depth, best.method, best.streams));
  return r.bytes_per_second > best.bytes_per_second ? r : best;
}

Result<ReadReference> measure_again(const ReadReference& best, const std::vector<std::string>& dirs,
                                    std::uint64_t bytes) {
  TIER_ASSIGN_OR_RETURN(ReadReference r,
                        measure_mixed_read_write(dirs, bytes, best.block_bytes, best.depth, best.method, best.streams));
  return r.bytes_per_second > best.bytes_per_second ? r : best;
}

}  // namespace tier::bench
