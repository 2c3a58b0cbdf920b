// The file layer's system implementation (PosixFileSystem), the process-wide choice and the
// helpers shared by every implementation.
#include "tier/ext/file_system.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <utility>

#include "core/atomic_file.hpp"
#include "core/text.hpp"

namespace tier {

const char* file_op_name(FileOp op) noexcept {
  switch (op) {
    case FileOp::kOpen: return "open";
    case FileOp::kClose: return "close";
    case FileOp::kRead: return "read";
    case FileOp::kWrite: return "write";
    case FileOp::kSync: return "sync";
    case FileOp::kAllocate: return "allocate";
    case FileOp::kTruncate: return "truncate";
    case FileOp::kStat: return "stat";
    case FileOp::kLock: return "lock";
    case FileOp::kRename: return "rename";
    case FileOp::kUnlink: return "unlink";
    case FileOp::kMkdir: return "mkdir";
    case FileOp::kRmdir: return "rmdir";
    case FileOp::kSymlink: return "symlink";
    case FileOp::kReadlink: return "readlink";
    case FileOp::kChmod: return "chmod";
    case FileOp::kList: return "list";
  }
  return "?";
}

Status File::write_all(const void* data, std::size_t bytes) {
  iovec v{const_cast<void*>(data), bytes};
  return write_all(&v, 1);
}

Status File::write_all(struct iovec* iov, int count) {
  while (count > 0 && iov->iov_len == 0) {
    ++iov;
    --count;
  }
  while (count > 0) {
    TIER_ASSIGN_OR_RETURN(std::size_t n, writev(iov, count));
    if (n == 0) return errno_status(EIO, str("write ", path(), ": the write made no progress"));
    while (count > 0 && n >= iov->iov_len) {
      n -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<std::uint8_t*>(iov->iov_base) + n;
      iov->iov_len -= n;
    }
  }
  return {};
}

Status File::pwrite_all(const void* data, std::size_t bytes, std::uint64_t offset) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  while (bytes > 0) {
    TIER_ASSIGN_OR_RETURN(std::size_t n, pwrite(p, bytes, offset));
    if (n == 0) return errno_status(EIO, str("write ", path(), ": the write made no progress"));
    p += n;
    bytes -= n;
    offset += n;
  }
  return {};
}

Status FileSystem::sync_dir(const std::string& dir) {
  TIER_ASSIGN_OR_RETURN(std::unique_ptr<File> d, open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  TIER_RETURN_IF_ERROR(d->sync());
  return d->close();
}

Status FileSystem::create_directories(const std::string& path, mode_t mode) {
  std::string whole = path;
  while (whole.size() > 1 && whole.back() == '/') whole.pop_back();
  for (std::size_t slash = whole.find('/', 1);; slash = whole.find('/', slash + 1)) {
    const bool last = slash == std::string::npos;
    const std::string prefix = last ? whole : whole.substr(0, slash);
    if (!prefix.empty() && !prefix.ends_with('/')) {  // "a//b" has an empty step
      auto st = stat(prefix, /*follow=*/true);
      if (st.ok() && !S_ISDIR(st->st_mode)) {
        return errno_status(ENOTDIR, str("mkdir ", path, ": ", prefix, " is not a directory"));
      }
      if (!st.ok()) {
        if (st.status().sys_errno() != ENOENT) return st.status();
        Status made = mkdir(prefix, last ? mode : 0777);
        if (!made.ok()) {
          // Made meanwhile by someone else: fine if it is a directory.
          auto again = stat(prefix, /*follow=*/true);
          if (made.sys_errno() != EEXIST || !again.ok() || !S_ISDIR(again->st_mode)) return made;
        }
      }
    }
    if (last) return {};
  }
}

namespace {

Status bad_path(std::string_view op, const std::string& path) {
  return invalid_argument(str(op, " '", detail::printable(path.substr(0, 200)),
                              "': the path holds a NUL byte, which would cut it short; give a path without one"));
}

std::string joined(const File* at, const std::string& path) {
  if (at == nullptr || path.empty() || path.front() == '/') return path;
  return at->path() + (at->path().ends_with('/') ? "" : "/") + path;
}

class PosixFile final : public File {
 public:
  PosixFile(std::string path, int fd) : File(std::move(path)), fd_(fd) {}
  ~PosixFile() override {
    if (fd_ >= 0) ::close(fd_);
  }

  int fd() const noexcept override { return fd_; }

  Result<std::size_t> pread(void* dst, std::size_t bytes, std::uint64_t offset) override {
    for (;;) {
      const ssize_t n = ::pread(fd_, dst, bytes, static_cast<off_t>(offset));
      if (n >= 0) return static_cast<std::size_t>(n);
      if (errno != EINTR) return errno_status(errno, str("read ", path(), " at byte ", offset));
    }
  }

  Result<std::size_t> pwrite(const void* src, std::size_t bytes, std::uint64_t offset) override {
    for (;;) {
      const ssize_t n = ::pwrite(fd_, src, bytes, static_cast<off_t>(offset));
      if (n >= 0) return static_cast<std::size_t>(n);
      if (errno != EINTR) return errno_status(errno, str("write ", path(), " at byte ", offset));
    }
  }

  Result<std::size_t> writev(const struct iovec* iov, int count) override {
    for (;;) {
      const ssize_t n = ::writev(fd_, iov, count);
      if (n >= 0) return static_cast<std::size_t>(n);
      if (errno != EINTR) return errno_status(errno, str("write ", path()));
    }
  }

  Status sync() override {
    if (::fsync(fd_) != 0) return errno_status(errno, str("fsync ", path()));
    return {};
  }

  Status data_sync() override {
    if (::fdatasync(fd_) != 0) return errno_status(errno, str("fdatasync ", path()));
    return {};
  }

  Status allocate(std::uint64_t offset, std::uint64_t bytes) override {
    if (::fallocate(fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(bytes)) != 0) {
      return errno_status(errno, str("fallocate ", path(), " of ", bytes, " bytes at byte ", offset));
    }
    return {};
  }

  Status truncate(std::uint64_t bytes) override {
    if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
      return errno_status(errno, str("ftruncate ", path(), " to ", bytes, " bytes"));
    }
    return {};
  }

  Result<struct stat> stat() override {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) return errno_status(errno, str("fstat ", path()));
    return st;
  }

  Status lock(LockMode mode, bool wait) override {
    const int op = (mode == LockMode::kShared      ? LOCK_SH
                    : mode == LockMode::kExclusive ? LOCK_EX
                                                   : LOCK_UN) |
                   (wait ? 0 : LOCK_NB);
    for (;;) {
      if (::flock(fd_, op) == 0) return {};
      if (errno != EINTR) return errno_status(errno, str("flock ", path()));
    }
  }

  Status close() override {
    if (fd_ < 0) return {};
    const int rc = ::close(std::exchange(fd_, -1));
    // Linux closes the descriptor even when close() reports an error (EINTR included).
    if (rc != 0) return errno_status(errno, str("close ", path()));
    return {};
  }

 private:
  int fd_;
};

class PosixFileSystem final : public FileSystem {
 public:
  Result<std::unique_ptr<File>> open(const std::string& path, int flags, mode_t mode, const File* at) override {
    if (detail::has_nul(path)) return bad_path("open", path);
    const int fd = ::openat(at ? at->fd() : AT_FDCWD, path.c_str(), flags | O_CLOEXEC, mode);
    if (fd < 0) return errno_status(errno, str("open ", joined(at, path)));
    return std::unique_ptr<File>(new PosixFile(joined(at, path), fd));
  }

  Status rename(const std::string& from, const std::string& to) override {
    if (detail::has_nul(from) || detail::has_nul(to)) return bad_path("rename", detail::has_nul(from) ? from : to);
    if (::rename(from.c_str(), to.c_str()) != 0) return errno_status(errno, str("rename ", from, " to ", to));
    return {};
  }

  Status unlink(const std::string& path, const File* at) override {
    if (detail::has_nul(path)) return bad_path("unlink", path);
    if (::unlinkat(at ? at->fd() : AT_FDCWD, path.c_str(), 0) != 0) {
      return errno_status(errno, str("unlink ", joined(at, path)));
    }
    return {};
  }

  Status mkdir(const std::string& path, mode_t mode) override {
    if (detail::has_nul(path)) return bad_path("mkdir", path);
    if (::mkdir(path.c_str(), mode) != 0) return errno_status(errno, str("mkdir ", path));
    return {};
  }

  Status rmdir(const std::string& path) override {
    if (detail::has_nul(path)) return bad_path("rmdir", path);
    if (::rmdir(path.c_str()) != 0) return errno_status(errno, str("rmdir ", path));
    return {};
  }

  Status symlink(const std::string& target, const std::string& link) override {
    if (detail::has_nul(target) || detail::has_nul(link))
      return bad_path("symlink", detail::has_nul(link) ? link : target);
    if (::symlink(target.c_str(), link.c_str()) != 0) return errno_status(errno, str("symlink ", link, " -> ", target));
    return {};
  }

  Result<std::string> readlink(const std::string& path) override {
    if (detail::has_nul(path)) return bad_path("readlink", path);
    std::string buf(256, '\0');
    for (;;) {
      const ssize_t n = ::readlink(path.c_str(), buf.data(), buf.size());
      if (n < 0) return errno_status(errno, str("readlink ", path));
      if (static_cast<std::size_t>(n) < buf.size()) {
        buf.resize(static_cast<std::size_t>(n));
        return buf;
      }
      buf.resize(buf.size() * 2);
    }
  }

  Result<struct stat> stat(const std::string& path, bool follow, const File* at) override {
    if (detail::has_nul(path)) return bad_path("stat", path);
    struct stat st {};
    if (::fstatat(at ? at->fd() : AT_FDCWD, path.c_str(), &st, follow ? 0 : AT_SYMLINK_NOFOLLOW) != 0) {
      return errno_status(errno, str(follow ? "stat " : "lstat ", joined(at, path)));
    }
    return st;
  }

  Status chmod(const std::string& path, mode_t mode) override {
    if (detail::has_nul(path)) return bad_path("chmod", path);
    if (::chmod(path.c_str(), mode) != 0) return errno_status(errno, str("chmod ", path));
    return {};
  }

  Result<std::vector<std::string>> list(const std::string& dir, const File* at) override {
    if (detail::has_nul(dir)) return bad_path("list", dir);
    const int fd = ::openat(at ? at->fd() : AT_FDCWD, dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno_status(errno, str("open directory ", joined(at, dir)));
    DIR* d = ::fdopendir(fd);
    if (d == nullptr) {
      const int err = errno;
      ::close(fd);
      return errno_status(err, str("open directory ", joined(at, dir)));
    }
    std::vector<std::string> names;
    for (;;) {
      errno = 0;
      const dirent* e = ::readdir(d);
      if (e == nullptr) break;
      const std::string_view n = e->d_name;
      if (n != "." && n != "..") names.emplace_back(n);
    }
    const int err = errno;
    ::closedir(d);
    if (err != 0) return errno_status(err, str("read directory ", joined(at, dir)));
    return names;
  }
};

struct Installed {
  std::mutex mu;
  std::shared_ptr<FileSystem> fs;
};

Installed& installed() {
  static Installed* i = new Installed{{}, FileSystem::posix()};  // never destroyed: used until exit
  return *i;
}

}  // namespace

std::shared_ptr<FileSystem> FileSystem::posix() {
  static const std::shared_ptr<FileSystem>* fs = new std::shared_ptr<FileSystem>(std::make_shared<PosixFileSystem>());
  return *fs;
}

std::shared_ptr<FileSystem> FileSystem::current() {
  Installed& i = installed();
  std::lock_guard<std::mutex> lock(i.mu);
  return i.fs;
}

std::shared_ptr<FileSystem> FileSystem::install(std::shared_ptr<FileSystem> fs) {
  Installed& i = installed();
  std::lock_guard<std::mutex> lock(i.mu);
  return std::exchange(i.fs, fs ? std::move(fs) : posix());
}

Status write_file_atomically(const std::string& path, std::string_view data, mode_t mode, std::string_view what) {
  TIER_ASSIGN_OR_RETURN(detail::AtomicFile f, detail::AtomicFile::create(path, mode, what));
  TIER_RETURN_IF_ERROR(f.write(data.data(), data.size()));
  return f.commit();
}

}  // namespace tier
