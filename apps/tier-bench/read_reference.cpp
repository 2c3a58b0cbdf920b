#include "read_reference.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
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
             format_bytes(block_bytes), " blocks, depth ", depth);
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

// Runs `requests` with `depth` threads, each taking the next request: a sequential stream (or two,
// interleaved) with `depth` blocks in flight. Returns the wall time.
Result<double> run_requests(const std::vector<OpenFile>& files, const std::vector<Request>& requests,
                            std::uint64_t block, int depth) {
  std::atomic<std::size_t> next{0};
  std::atomic<int> first_error{0};
  static std::atomic<std::uint64_t> passes{0};
  const std::uint64_t nonce = (static_cast<std::uint64_t>(::getpid()) << 32) ^ passes.fetch_add(1) ^
                              static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < depth; ++t) {
    threads.emplace_back([&] {
      void* buf = nullptr;
      if (posix_memalign(&buf, 4096, block) != 0) {
        first_error.store(ENOMEM);
        return;
      }
      std::memset(buf, 0x5a, block);
      while (first_error.load() == 0) {
        const std::size_t i = next.fetch_add(1);
        if (i >= requests.size()) break;
        const OpenFile& f = files[requests[i].file];
        if (f.write) {
          // Every 512-byte sector gets bytes no other write had (pass, request, sector), so that a
          // deduplicating or compressing virtual disk cannot flatter the reference.
          for (std::uint64_t sector = 0; sector < block / 512; ++sector) {
            const std::uint64_t stamp[2] = {nonce, (static_cast<std::uint64_t>(i) << 24) | sector};
            std::memcpy(static_cast<char*>(buf) + sector * 512, stamp, sizeof stamp);
          }
        }
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
      std::free(buf);
    });
  }
  for (auto& t : threads) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (int err = first_error.load(); err != 0) return errno_status(err, "NVMe reference: a request failed");
  return secs;
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
                                              int depth) {
  TIER_RETURN_IF_ERROR(check_shape(block_bytes, depth));
  std::vector<OpenFile> files;
  bool direct = true;
  Status s = open_for_reading({dir}, bytes, block_bytes, &files, &direct);
  const std::vector<Request> reads = blocks_of(files, false, block_bytes);
  Result<double> secs = s.ok() ? run_requests(files, reads, block_bytes, depth) : Result<double>(s);
  close_all(files);
  if (!secs.ok()) return secs.status();
  ReadReference r;
  r.bytes_read = reads.size() * block_bytes;
  r.bytes_per_second = *secs > 0 ? static_cast<double>(r.bytes_read) / *secs : 0;
  r.block_bytes = block_bytes;
  r.depth = depth;
  r.direct = direct;
  r.files = static_cast<int>(files.size());
  return r;
}

Result<ReadReference> measure_mixed_read_write(const std::vector<std::string>& dirs, std::uint64_t bytes,
                                               std::uint64_t block_bytes, int depth) {
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
    if (auto first = run_requests(files, writes, block_bytes, depth); !first.ok()) s = first.status();
  }
  // Timed: reads and writes alternate in one sequence.
  const std::vector<Request> reads = blocks_of(files, false, block_bytes);
  std::vector<Request> mixed;
  for (std::size_t i = 0; i < std::max(reads.size(), writes.size()); ++i) {
    if (i < reads.size()) mixed.push_back(reads[i]);
    if (i < writes.size()) mixed.push_back(writes[i]);
  }
  Result<double> secs = s.ok() ? run_requests(files, mixed, block_bytes, depth) : Result<double>(s);
  cleanup();
  if (!secs.ok()) return secs.status();
  ReadReference r;
  r.bytes_read = reads.size() * block_bytes;
  r.bytes_written = writes.size() * block_bytes;
  r.bytes_per_second = *secs > 0 ? static_cast<double>(r.bytes_read + r.bytes_written) / *secs : 0;
  r.block_bytes = block_bytes;
  r.depth = depth;
  r.direct = direct;
  r.files = static_cast<int>(files.size());
  return r;
}

}  // namespace tier::bench
