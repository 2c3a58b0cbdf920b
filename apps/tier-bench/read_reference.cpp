#include "read_reference.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>
#include <vector>

#include "tier/units.hpp"

namespace tier::bench {

std::string ReadReference::describe() const {
  return str("sequential ", direct ? "O_DIRECT" : "buffered", " read, ", format_bytes(block_bytes), " blocks, depth ",
             depth);
}

Result<ReadReference> measure_sequential_read(const std::string& dir, std::uint64_t bytes, std::uint64_t block_bytes,
                                              int depth) {
  namespace fs = std::filesystem;
  if (block_bytes == 0 || block_bytes % 4096 != 0 || depth < 1) {
    return invalid_argument("read reference: the block must be a non-zero multiple of 4096 and the depth at least 1");
  }
  std::vector<fs::path> paths;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (it->is_regular_file(ec)) paths.push_back(it->path());
  }
  if (paths.empty()) return not_found(str("read reference: no file under ", dir, " to read"));
  std::sort(paths.begin(), paths.end());

  struct File {
    int fd = -1;
    std::uint64_t length = 0;  // bytes to read, whole blocks
  };
  std::vector<File> files;
  bool direct = true;
  const std::uint64_t per_file = (bytes / paths.size() + block_bytes - 1) / block_bytes * block_bytes;
  for (const auto& p : paths) {
    int fd = ::open(p.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0 && errno == EINVAL) {
      direct = false;  // tmpfs and a few others refuse O_DIRECT
      fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    }
    if (fd < 0) {
      const int err = errno;
      for (auto& f : files) ::close(f.fd);
      return errno_status(err, str("read reference: open ", p.string()));
    }
    const std::uint64_t size = fs::file_size(p, ec);
    files.push_back({fd, std::min(per_file, ec ? 0 : size / block_bytes * block_bytes)});
  }

  // One sequence of blocks over the files in order; each reader takes the next block, so `depth`
  // consecutive blocks are in flight, as a sequential stream at that queue depth.
  std::vector<std::pair<std::size_t, std::uint64_t>> blocks;  // (file, offset)
  for (std::size_t f = 0; f < files.size(); ++f) {
    for (std::uint64_t off = 0; off < files[f].length; off += block_bytes) blocks.emplace_back(f, off);
  }
  std::atomic<std::size_t> next{0};
  std::atomic<int> first_error{0};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> readers;
  for (int r = 0; r < depth; ++r) {
    readers.emplace_back([&] {
      void* buf = nullptr;
      if (posix_memalign(&buf, 4096, block_bytes) != 0) {
        first_error.store(ENOMEM);
        return;
      }
      while (first_error.load() == 0) {
        const std::size_t i = next.fetch_add(1);
        if (i >= blocks.size()) break;
        const auto [f, off] = blocks[i];
        std::uint64_t done = 0;
        while (done < block_bytes) {
          const ssize_t n =
              ::pread(files[f].fd, static_cast<char*>(buf) + done, block_bytes - done, static_cast<off_t>(off + done));
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
  for (auto& t : readers) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (auto& f : files) ::close(f.fd);
  if (int err = first_error.load(); err != 0) return errno_status(err, str("read reference: reading under ", dir));

  ReadReference r;
  r.bytes = blocks.size() * block_bytes;
  r.bytes_per_second = secs > 0 ? static_cast<double>(r.bytes) / secs : 0;
  r.block_bytes = block_bytes;
  r.depth = depth;
  r.direct = direct;
  r.files = static_cast<int>(files.size());
  return r;
}

}  // namespace tier::bench
