// tier/ext/file_system.hpp — the one layer through which tier touches files.
//
// Every file operation of tier that can fail or that durability depends on goes through a
// FileSystem: the checkpoints (the optimizer's C++ writer and reader, and tier.torch's Python
// writer through tier._tier), the trace, the config reader, tier-bench's config writer and the swap
// files' creation, preallocation, locking, flushing and removal. Tests install another
// implementation process-wide (FaultInjectingFileSystem, include/tier/ext/
// fault_injecting_file_system.hpp) that fails chosen calls or drops what was not synced, which is
// how a power cut is simulated.
//
// What does not go through it: the I/O engines' O_DIRECT reads and writes of swap file extents
// (io_uring, libaio, the posix engine) use the swap file's descriptor (File::fd()) directly, and
// the switch of a swap file to O_DIRECT is an fcntl on it. Swap files are scratch, not durable
// state: they hold nothing a restart needs, so a power cut has nothing to lose there. Reads whose
// loss cannot matter (/proc, /sys, a file system's type or free space) are plain system calls too.
//
// Calls return Status/Result; a failed system call gives errno_status() with its errno
// (Status::sys_errno()), and the message names the operation and the path ("rename /a to /b: No
// such file or directory"). Callers add what the file is and the fix.
//
// Thread safety: a FileSystem may be called from any number of threads at once. A File is used by
// one thread at a time, except pread and pwrite, which may run concurrently on one File as the
// system calls may. FileSystem::current() and install() may be called from any thread; a File
// keeps the implementation that opened it alive, so installing another one never pulls a file
// from under its user.
//
// Extension interface (include/tier/ext/README.md): stable for backends, tests and tools; not
// the user API.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tier/status.hpp"

namespace tier {

// The kinds of call, for counting and for choosing which call a fault hits.
enum class FileOp : std::uint8_t {
  kOpen = 0,
  kClose,
  kRead,
  kWrite,     // write, writev, pwrite
  kSync,      // fsync or fdatasync, of a file or of a directory
  kAllocate,  // fallocate
  kTruncate,  // ftruncate
  kStat,      // fstat, fstatat
  kLock,      // flock
  kRename,
  kUnlink,
  kMkdir,
  kRmdir,
  kSymlink,
  kReadlink,
  kChmod,
  kList,  // reading a directory's names
};
inline constexpr int kFileOpCount = 17;

// "open", "sync", ...
const char* file_op_name(FileOp op) noexcept;

enum class LockMode : std::uint8_t { kShared, kExclusive, kUnlock };

// An open file or directory. Closing it (close() or the destructor) releases its flock.
class File {
 public:
  virtual ~File() = default;  // closes it when still open; close() reports the error instead
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  // The path it was opened under (joined to the directory's path when opened relative to one).
  const std::string& path() const noexcept { return path_; }

  // The descriptor, for what the layer does not cover: the I/O engines' transfers on a swap file,
  // fcntl and statx queries. What goes through it bypasses the layer (and so fault injection and
  // the power-loss model): never for durable data. -1 once closed.
  virtual int fd() const noexcept = 0;

  // One pread(2)/pwrite(2): may transfer fewer bytes than asked (0 from pread: end of file);
  // EINTR is retried.
  virtual Result<std::size_t> pread(void* dst, std::size_t bytes, std::uint64_t offset) = 0;
  virtual Result<std::size_t> pwrite(const void* src, std::size_t bytes, std::uint64_t offset) = 0;
  // One writev(2) at the file's offset: may be short; EINTR is retried.
  virtual Result<std::size_t> writev(const struct iovec* iov, int count) = 0;
  // fsync(2): the file's data and metadata, or a directory's entries, are durable when it returns.
  virtual Status sync() = 0;
  // fdatasync(2): the data (and the size) are durable; other metadata may not be.
  virtual Status data_sync() = 0;
  // fallocate(2) with mode 0: reserves [offset, offset + bytes), growing the file.
  virtual Status allocate(std::uint64_t offset, std::uint64_t bytes) = 0;
  // ftruncate(2).
  virtual Status truncate(std::uint64_t bytes) = 0;
  // fstat(2).
  virtual Result<struct stat> stat() = 0;
  // flock(2); `wait` false: an error with sys_errno() EWOULDBLOCK when another holder has it.
  virtual Status lock(LockMode mode, bool wait) = 0;
  // close(2); later calls fail. Closing twice is a no-op.
  virtual Status close() = 0;

  // All of `bytes` at the file's offset, retrying short writes.
  Status write_all(const void* data, std::size_t bytes);
  // All of iov[0..count) at the file's offset; `iov` is advanced in place.
  Status write_all(struct iovec* iov, int count);
  // All of `bytes` at `offset`, retrying short writes.
  Status pwrite_all(const void* data, std::size_t bytes, std::uint64_t offset);

 protected:
  explicit File(std::string path) : path_(std::move(path)) {}

 private:
  std::string path_;
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;

  // open(2)/openat(2) with `flags` (O_CREAT, O_EXCL, O_NOFOLLOW, O_DIRECT, O_DIRECTORY, ...; tier
  // adds O_CLOEXEC) and `mode` for a new file. `at`: a directory opened through a FileSystem,
  // relative to which a relative `path` is resolved; nullptr: the working directory. A path
  // holding a NUL byte is kInvalidArgument.
  virtual Result<std::unique_ptr<File>> open(const std::string& path, int flags, mode_t mode = 0,
                                             const File* at = nullptr) = 0;
  // rename(2): replaces `to` atomically (a symlink at `to` is replaced, not followed).
  virtual Status rename(const std::string& from, const std::string& to) = 0;
  // unlink(2)/unlinkat(2) of a file or symlink.
  virtual Status unlink(const std::string& path, const File* at = nullptr) = 0;
  virtual Status mkdir(const std::string& path, mode_t mode) = 0;
  // rmdir(2) of an empty directory.
  virtual Status rmdir(const std::string& path) = 0;
  // symlink(2): a link at `link` holding `target`.
  virtual Status symlink(const std::string& target, const std::string& link) = 0;
  virtual Result<std::string> readlink(const std::string& path) = 0;
  // stat(2) (`follow`) or lstat(2), relative to `at` as for open().
  virtual Result<struct stat> stat(const std::string& path, bool follow = true, const File* at = nullptr) = 0;
  virtual Status chmod(const std::string& path, mode_t mode) = 0;
  // The names in directory `dir` (relative to `at` as for open()), without "." and "..", in the
  // order the directory gives them.
  virtual Result<std::vector<std::string>> list(const std::string& dir, const File* at = nullptr) = 0;

  // Opens directory `dir` and fsyncs it: the entries created, renamed or removed in it are durable
  // when it returns.
  Status sync_dir(const std::string& dir);
  // mkdir -p: creates the missing directories of `path`, the last with permission bits `mode`, the
  // others with 0777 (each less the umask). A component that exists and is not a directory (nor a
  // symlink to one) fails with ENOTDIR. Creates nothing durable: sync the parents for that.
  Status create_directories(const std::string& path, mode_t mode);

  // The process-wide file system every part of tier uses: posix() unless a test installed another.
  static std::shared_ptr<FileSystem> current();
  // The system's own (a process-wide instance that lives as long as the process).
  static std::shared_ptr<FileSystem> posix();
  // Test hook: makes `fs` (nullptr: posix()) the process-wide file system from now on; returns the
  // one it replaces. Files already open keep theirs.
  static std::shared_ptr<FileSystem> install(std::shared_ptr<FileSystem> fs);
};

// Writes `data` as `path`, whole or not at all, through FileSystem::current(): a fresh temporary
// file beside it (O_CREAT|O_EXCL|O_NOFOLLOW, unpredictable name, permission bits `mode` less the
// umask), fsynced, renamed over `path`, then the directory fsynced. `what` names the file in
// messages ("config", "trace").
Status write_file_atomically(const std::string& path, std::string_view data, mode_t mode, std::string_view what);

}  // namespace tier
