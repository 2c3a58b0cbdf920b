// One swap file: created fresh in a directory, preallocated, optionally O_DIRECT, removed at close.
// Creation, preallocation, locking, flushing and removal go through the file layer
// (tier/ext/file_system.hpp); the I/O engines read and write extents through `fd` directly (a
// swap file is scratch: nothing in it must survive a crash).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tier/ext/file_system.hpp"
#include "tier/status.hpp"

namespace tier::nvme::detail {

struct SwapFile {
  std::string dir;
  std::string name;                // file name inside dir
  std::string path;                // dir + "/" + name
  std::string fs;                  // the file system's name ("ext4", "tmpfs", ...) or its magic number
  std::unique_ptr<File> dir_file;  // the directory, which names are resolved in
  std::unique_ptr<File> file;
  int fd = -1;  // file->fd(), for the I/O engines
  std::uint64_t bytes = 0;
  bool direct = false;
  std::string direct_refusal;    // why O_DIRECT was refused, when asked for and refused
  std::uint32_t mem_align = 1;   // O_DIRECT buffer alignment (1 when buffered)
  std::uint32_t size_align = 1;  // O_DIRECT offset/length granularity (1 when buffered)
  dev_t dev = 0;
  ino_t ino = 0;

  SwapFile() = default;
  SwapFile(SwapFile&& o) noexcept { *this = std::move(o); }
  // Makes the data written so far durable (fdatasync).
  Status data_sync();
  SwapFile& operator=(SwapFile&& o) noexcept;
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;
  // Closes and removes the file (only if the name still refers to this file).
  ~SwapFile() { remove(); }
  void remove() noexcept;
};

// Swap files are named tier-swap-<pid>-<start>-<boot>-<n>.bin: the creating process's pid, its
// start time in clock ticks since boot (field 22 of /proc/<pid>/stat), the first 8 hex digits of
// the boot id, and a sequence number. A recycled pid has another start time and a reboot another
// boot id, so the name says whether its owner still runs. The owner also holds an flock on the file
// while it is open, which covers owners in another pid namespace.
//
// The name prefix of this process's swap files ("tier-swap-<pid>-<start>-<boot>-").
std::string swap_file_prefix();

// A tier swap file found in a directory: its name, bytes held on disk and the owner's state.
struct FoundSwapFile {
  std::string name;
  std::uint64_t bytes = 0;  // allocated blocks, i.e. what removing it frees
  int pid = 0;
  bool alive = false;  // the owner runs (or holds the file's lock)
};

// Removes the swap files in directory `d` (named `dir`) whose owner is gone: only regular files of this
// user whose names match tier's pattern exactly (also the older tier-swap-<pid>-<n>.bin, when that
// pid no longer exists), that no process holds locked. Logs one line when it removed any. Returns
// the tier swap files left (of live owners, or not removable).
std::vector<FoundSwapFile> reclaim_stale_swap_files(FileSystem& fs, const File& d, const std::string& dir);

// Creates `dir` when missing (mode 0700), reclaims stale swap files in it (see above), then a new
// file in it with O_CREAT|O_EXCL|O_NOFOLLOW and mode 0600, and preallocates `bytes` with fallocate.
// A symlink to a directory is followed; a dangling one, a file or another non-directory gets
// kFailedPrecondition naming what the path is. With `want_direct`, switches the file to
// O_DIRECT; a file system that refuses it leaves the file buffered with direct_refusal set.
// Errors name the path: kNoSpace when the file system lacks `bytes` (naming the tier swap files of
// other processes that remain there and their sizes), kAlreadyExists when no fresh
// name could be found, kIoError/kInvalidArgument/... from the system calls.
Result<SwapFile> create_swap_file(const std::string& dir, std::uint64_t bytes, bool want_direct);

// Switches O_DIRECT on or off for an open swap file.
Status set_direct(SwapFile& f, bool on);

}  // namespace tier::nvme::detail
