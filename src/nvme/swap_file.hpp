// One swap file: created fresh in a directory, preallocated, optionally O_DIRECT, removed at close.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "tier/status.hpp"

namespace tier::nvme::detail {

struct SwapFile {
  std::string dir;
  std::string name;  // file name inside dir
  std::string path;  // dir + "/" + name
  std::string fs;    // the file system's name ("ext4", "tmpfs", ...) or its magic number
  int dir_fd = -1;
  int fd = -1;
  std::uint64_t bytes = 0;
  bool direct = false;
  std::string direct_refusal;    // why O_DIRECT was refused, when asked for and refused
  std::uint32_t mem_align = 1;   // O_DIRECT buffer alignment (1 when buffered)
  std::uint32_t size_align = 1;  // O_DIRECT offset/length granularity (1 when buffered)
  dev_t dev = 0;
  ino_t ino = 0;

  SwapFile() = default;
  SwapFile(SwapFile&& o) noexcept { *this = std::move(o); }
  SwapFile& operator=(SwapFile&& o) noexcept;
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;
  // Closes and removes the file (only if the name still refers to this file).
  ~SwapFile() { remove(); }
  void remove() noexcept;
};

// Creates `dir` when missing (mode 0700), then a new file in it with O_CREAT|O_EXCL|O_NOFOLLOW and
// mode 0600, and preallocates `bytes` with fallocate. With `want_direct`, switches the file to
// O_DIRECT; a file system that refuses it leaves the file buffered with direct_refusal set.
// Errors name the path: kNoSpace when the file system lacks `bytes`, kAlreadyExists when no fresh
// name could be found, kIoError/kInvalidArgument/... from the system calls.
Result<SwapFile> create_swap_file(const std::string& dir, std::uint64_t bytes, bool want_direct);

// Switches O_DIRECT on or off for an open swap file.
Status set_direct(SwapFile& f, bool on);

}  // namespace tier::nvme::detail
