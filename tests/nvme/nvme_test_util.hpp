// Helpers shared by the NVMe tests: scratch directories, byte patterns, backend probes.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "tier/config.hpp"
#include "tier/ext/io_engine.hpp"

namespace tier::nvme::test {

// Where tests put files that must live on a real disk (O_DIRECT): $TIER_TEST_DIR, else the
// current directory (ctest runs in the build tree).
inline std::string disk_base() {
  if (const char* d = std::getenv("TIER_TEST_DIR"); d && *d) return d;
  return std::filesystem::current_path().string();
}

inline std::string shm_base() {
  return "/dev/shm";
}

// A fresh directory removed (with everything in it) when the object goes.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& base, const std::string& tag = "nvme") {
    std::string templ = base + "/tier-test-" + tag + "-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) != nullptr) path_ = buf.data();
  }
  ~ScratchDir() {
    if (!path_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(path_, ec);
    }
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Whether files in `dir` accept O_DIRECT ("" when they do, otherwise why not).
inline std::string direct_refused(const std::string& dir) {
  const std::string p = dir + "/.tier-odirect-probe";
  const int fd = ::open(p.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return std::string("cannot create a probe file in ") + dir + ": " + std::strerror(errno);
  const int fl = ::fcntl(fd, F_GETFL);
  const bool ok = ::fcntl(fd, F_SETFL, fl | O_DIRECT) == 0;
  const int err = errno;
  ::close(fd);
  ::unlink(p.c_str());
  return ok ? std::string() : dir + " refuses O_DIRECT (" + std::strerror(err) + ")";
}

// Deterministic bytes for (seed, position), so any slice can be checked on its own.
inline std::uint8_t pattern_byte(std::uint64_t seed, std::uint64_t pos) {
  std::uint64_t x = (pos + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xBF58476D1CE4E5B9ull);
  x ^= x >> 31;
  return static_cast<std::uint8_t>(x ^ (x >> 17));
}

inline void fill_pattern(void* p, std::uint64_t n, std::uint64_t seed, std::uint64_t start = 0) {
  auto* b = static_cast<std::uint8_t*>(p);
  for (std::uint64_t i = 0; i < n; ++i) b[i] = pattern_byte(seed, start + i);
}

// Index of the first byte that differs from the pattern, or -1.
inline std::int64_t check_pattern(const void* p, std::uint64_t n, std::uint64_t seed, std::uint64_t start = 0) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  for (std::uint64_t i = 0; i < n; ++i) {
    if (b[i] != pattern_byte(seed, start + i)) return static_cast<std::int64_t>(i);
  }
  return -1;
}

// 4 KiB-aligned heap memory.
struct AlignedBuffer {
  explicit AlignedBuffer(std::uint64_t n, std::uint64_t align = 4096)
      : size((n + align - 1) / align * align), data(static_cast<std::uint8_t*>(std::aligned_alloc(align, size))) {
    std::memset(data, 0, size);
  }
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  std::uint64_t size;
  std::uint8_t* data;
};

// One backend configuration the conformance suites run.
struct Backend {
  IoEngineKind kind;
  bool direct;  // O_DIRECT files on the disk; otherwise buffered files on /dev/shm
  const char* name;
};

// What gtest and ctest show for a parameter.
inline void PrintTo(const Backend& b, std::ostream* os) {
  *os << b.name;
}

inline std::vector<Backend> all_backends() {
  return {{IoEngineKind::kUring, true, "uring_direct"},
          {IoEngineKind::kAio, true, "aio_direct"},
          {IoEngineKind::kPosix, true, "posix_direct"},
          {IoEngineKind::kUring, false, "uring_shm"},
          {IoEngineKind::kPosix, false, "posix_shm"}};
}

inline std::string backend_name(const testing::TestParamInfo<Backend>& info) {
  return info.param.name;
}

// "" when the backend can run here, otherwise the reason to skip.
inline std::string backend_unavailable(const Backend& b) {
  Status s = probe_io_engine(b.kind);
  if (!s.ok()) return std::string(io_engine_kind_name(b.kind)) + " unavailable: " + s.message();
  if (b.direct) return direct_refused(disk_base());
  return {};
}

}  // namespace tier::nvme::test
