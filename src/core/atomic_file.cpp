#include "core/atomic_file.hpp"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <random>
#include <utility>

#include "core/text.hpp"

namespace tier::detail {
namespace {

// 64 unpredictable bits: another user cannot guess the name in advance and plant it.
std::uint64_t random_bits() {
  std::uint64_t v = 0;
  std::size_t got = 0;
  auto* p = reinterpret_cast<unsigned char*>(&v);
  while (got < sizeof v) {
    const ssize_t n = ::getrandom(p + got, sizeof v - got, GRND_NONBLOCK);
    if (n > 0) {
      got += static_cast<std::size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      // No getrandom (old kernel, seccomp) or not yet seeded: the library's source instead.
      std::random_device rd;
      return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
    }
  }
  return v;
}

std::string split_dir(const std::string& path, std::string* name) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) {
    *name = path;
    return ".";
  }
  *name = path.substr(slash + 1);
  return slash == 0 ? std::string("/") : path.substr(0, slash);
}

}  // namespace

Result<AtomicFile> AtomicFile::create(const std::string& path, mode_t mode, std::string_view what) {
  if (path.empty()) return invalid_argument(str(what, ": empty path; give a file name"));
  if (has_nul(path)) {
    return invalid_argument(str(what, " path '", printable(path.substr(0, 200)),
                                "' holds a NUL byte, which would cut it short; give a path without one"));
  }
  AtomicFile f;
  f.fs_ = FileSystem::current();
  f.path_ = path;
  f.what_ = std::string(what);
  std::string name;
  f.dir_ = split_dir(path, &name);
  if (name.empty() || name == "." || name == "..") {
    return invalid_argument(str(what, " ", path, ": names a directory, not a file; give a file name"));
  }
  // Short enough for NAME_MAX with the suffix: the name only needs to be recognisable.
  const std::string stem = name.size() > 160 ? name.substr(0, 160) : name;
  for (int attempt = 0; attempt < 100; ++attempt) {
    char suffix[48];
    std::snprintf(suffix, sizeof suffix, ".%ld.%016llx.tmp", static_cast<long>(::getpid()),
                  static_cast<unsigned long long>(random_bits()));
    // In the target's directory (the rename must not cross file systems), as given.
    std::string temp = path.substr(0, path.size() - name.size()) + "." + stem + suffix;
    auto file = f.fs_->open(temp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (file.ok()) {
      f.file_ = std::move(file).value();
      f.temp_ = std::move(temp);
      return f;
    }
    if (file.status().sys_errno() != EEXIST) {
      return file.status().with_context(str(what, " ", path, ": cannot create the temporary file ", temp,
                                            " (the directory must exist and be writable by this user)"));
    }
  }
  return already_exists(str(what, " ", path, ": no fresh temporary file name in ", f.dir_, " after 100 tries"));
}

AtomicFile::AtomicFile(AtomicFile&& other) noexcept
    : fs_(std::move(other.fs_)),
      file_(std::move(other.file_)),
      path_(std::move(other.path_)),
      temp_(std::move(other.temp_)),
      dir_(std::move(other.dir_)),
      what_(std::move(other.what_)) {
  other.temp_.clear();
}

AtomicFile& AtomicFile::operator=(AtomicFile&& other) noexcept {
  if (this != &other) {
    discard();
    fs_ = std::move(other.fs_);
    file_ = std::move(other.file_);
    path_ = std::move(other.path_);
    temp_ = std::move(other.temp_);
    dir_ = std::move(other.dir_);
    what_ = std::move(other.what_);
    other.temp_.clear();
  }
  return *this;
}

AtomicFile::~AtomicFile() {
  discard();
}

void AtomicFile::discard() noexcept {
  file_.reset();                                           // closes it
  if (!temp_.empty() && fs_) fs_->unlink(temp_).ignore();  // best effort: a leftover is only a stray file
  temp_.clear();
}

Status AtomicFile::write(const void* data, std::size_t bytes) {
  if (!file_) return failed_precondition(str(what_, " ", path_, ": write after commit"));
  Status s = file_->write_all(data, bytes);
  if (!s.ok()) return s.with_context(str(what_, " ", path_));
  return {};
}

Status AtomicFile::commit() {
  if (!file_) return failed_precondition(str(what_, " ", path_, ": committed twice"));
  Status s = file_->sync();
  if (s.ok()) s = file_->close();
  file_.reset();
  if (s.ok()) s = fs_->rename(temp_, path_);
  if (!s.ok()) return s.with_context(str(what_, " ", path_));  // the destructor removes the temporary file
  temp_.clear();                                               // it is the target now
  s = fs_->sync_dir(dir_);
  if (!s.ok()) return s.with_context(str(what_, " ", path_, ": syncing its directory"));
  return {};
}

}  // namespace tier::detail
