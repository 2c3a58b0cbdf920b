#include "nvme/swap_file.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <string_view>
#include <system_error>

#include "core/text.hpp"
#include "tier/ext/swap_space.hpp"
#include "tier/log.hpp"
#include "tier/units.hpp"

#ifndef STATX_DIOALIGN
#define STATX_DIOALIGN 0x00002000U
#endif

namespace tier::nvme::detail {

namespace {

std::atomic<unsigned> g_sequence{0};

std::string fs_name(int fd) {
  struct statfs sf {};
  if (fstatfs(fd, &sf) != 0) return "an unknown file system";
  switch (static_cast<unsigned long>(sf.f_type)) {
    case EXT4_SUPER_MAGIC: return "ext4";
    case XFS_SUPER_MAGIC: return "xfs";
    case BTRFS_SUPER_MAGIC: return "btrfs";
    case TMPFS_MAGIC: return "tmpfs";
    case RAMFS_MAGIC: return "ramfs";
    case NFS_SUPER_MAGIC: return "nfs";
    case OVERLAYFS_SUPER_MAGIC: return "overlayfs";
    case 0x65735546: return "fuse";
    default: break;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "file system 0x%lx", static_cast<unsigned long>(sf.f_type));
  return buf;
}

constexpr std::string_view kSwapPrefix = "tier-swap-";
constexpr std::string_view kSwapSuffix = ".bin";

// Start time of process `pid` in clock ticks since boot, or nothing when no such process runs (a
// zombie counts as gone: it holds no files).
std::optional<std::uint64_t> process_start_time(long pid) {
  std::ifstream in(str("/proc/", pid, "/stat"));
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  // The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
  const auto close = line.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(line.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
    if (i == 3 && (field == "Z" || field == "X")) return std::nullopt;
    if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
  }
  return std::nullopt;
}

// The first 8 hex digits of this boot's id, or "00000000" when the kernel does not say.
const std::string& boot_token() {
  static const std::string token = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string id;
    if (in >> id && id.size() >= 8) return id.substr(0, 8);
    return std::string("00000000");
  }();
  return token;
}

bool all_digits(std::string_view s) {
  if (s.empty() || s.size() > 19) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

bool all_hex(std::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// The owner a swap file's name records; nothing unless the name is exactly tier's pattern.
struct NamedOwner {
  long pid = 0;
  bool legacy = false;  // tier-swap-<pid>-<n>.bin, written before names carried the start time
  std::uint64_t start = 0;
  std::string boot;
};

std::optional<NamedOwner> owner_from_name(std::string_view name) {
  if (name.size() <= kSwapPrefix.size() + kSwapSuffix.size() || !name.starts_with(kSwapPrefix) ||
      !name.ends_with(kSwapSuffix)) {
    return std::nullopt;
  }
  std::string_view body = name.substr(kSwapPrefix.size(), name.size() - kSwapPrefix.size() - kSwapSuffix.size());
  std::vector<std::string_view> parts;
  for (std::size_t at = 0;;) {
    const auto dash = body.find('-', at);
    parts.push_back(body.substr(at, dash == std::string_view::npos ? std::string_view::npos : dash - at));
    if (dash == std::string_view::npos) break;
    at = dash + 1;
  }
  NamedOwner o;
  if (parts.size() == 2 && all_digits(parts[0]) && all_digits(parts[1])) {
    o.legacy = true;
  } else if (parts.size() == 4 && all_digits(parts[0]) && all_digits(parts[1]) && parts[2].size() == 8 &&
             all_hex(parts[2]) && all_digits(parts[3])) {
    o.start = std::strtoull(std::string(parts[1]).c_str(), nullptr, 10);
    o.boot = std::string(parts[2]);
  } else {
    return std::nullopt;
  }
  o.pid = std::strtol(std::string(parts[0]).c_str(), nullptr, 10);
  if (o.pid <= 0) return std::nullopt;
  return o;
}

// Whether the process a name records still runs: same boot, and a process with that pid that
// started at the recorded time. A legacy name only has the pid, so any process with it counts.
bool named_owner_alive(const NamedOwner& o) {
  const auto start = process_start_time(o.pid);
  if (!start) return false;
  if (o.legacy) return true;
  return o.boot == boot_token() && *start == o.start;
}

std::string list_files(const std::vector<FoundSwapFile>& files) {
  std::string out;
  std::size_t shown = 0;
  for (const auto& f : files) {
    if (shown == 8) {
      out += str(" and ", files.size() - shown, " more");
      break;
    }
    out += str(shown ? ", " : "", f.name, " (", format_bytes(f.bytes), ", pid ", f.pid,
               f.alive ? " running" : " gone but the file could not be removed", ")");
    ++shown;
  }
  return out;
}

// What an unusable swap path is, for a message: "a dangling symlink to /x", "a regular file", ...
// Empty when the path is a directory (or a symlink to one), or does not exist.
std::string odd_path(const std::string& dir) {
  struct stat lst {};
  if (::lstat(dir.c_str(), &lst) != 0) return {};
  std::string link;
  if (S_ISLNK(lst.st_mode)) {
    std::error_code ec;
    link = std::filesystem::read_symlink(dir, ec).string();
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) {
      return str("a symbolic link to ", link, ", which does not resolve (", std::strerror(errno), "); create ", link,
                 " as a directory or point the swap path at an existing directory");
    }
    lst = st;
  }
  if (S_ISDIR(lst.st_mode)) return {};
  const char* what = S_ISREG(lst.st_mode)    ? "a regular file"
                     : S_ISCHR(lst.st_mode)  ? "a character device"
                     : S_ISBLK(lst.st_mode)  ? "a block device"
                     : S_ISFIFO(lst.st_mode) ? "a FIFO"
                     : S_ISSOCK(lst.st_mode) ? "a socket"
                                             : "not a directory";
  return str(link.empty() ? "" : str("a symbolic link to ", link, ", which is "), what,
             ", not a directory; give a directory on the SSD (zero_optimization.offload_*.nvme_path or "
             "tier.swap_paths)");
}

}  // namespace

std::string swap_file_prefix() {
  // Cached per pid: a forked child computes its own (its files must name it, not its parent).
  static std::mutex mu;
  static long cached_pid = 0;
  static std::string cached;
  const long pid = ::getpid();
  std::lock_guard<std::mutex> lock(mu);
  if (cached_pid != pid) {
    cached = str(kSwapPrefix, pid, "-", process_start_time(pid).value_or(0), "-", boot_token(), "-");
    cached_pid = pid;
  }
  return cached;
}

std::vector<FoundSwapFile> reclaim_stale_swap_files(FileSystem& fs, const File& d, const std::string& dir) {
  std::vector<FoundSwapFile> left;
  auto names = fs.list(".", &d);
  if (!names.ok()) return left;
  std::vector<std::string> removed;
  std::uint64_t removed_bytes = 0;
  for (const std::string& name : *names) {
    const auto owner = owner_from_name(name);
    if (!owner) continue;
    // O_NOFOLLOW: a symlink with a swap file's name is never followed, never removed.
    auto opened = fs.open(name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0, &d);
    if (!opened.ok()) continue;
    File& f = **opened;
    auto st = f.stat();
    if (!st.ok() || !S_ISREG(st->st_mode) || st->st_uid != ::geteuid()) continue;
    FoundSwapFile found{name, static_cast<std::uint64_t>(st->st_blocks) * 512, static_cast<int>(owner->pid), true};
    // A live owner keeps its file locked, so a lock we can take proves nobody uses the file, even
    // an owner whose pid this process cannot see.
    const bool unlocked = f.lock(LockMode::kExclusive, /*wait=*/false).ok();
    if (unlocked && !named_owner_alive(*owner)) {
      // Remove by name only while the name still refers to the file checked above.
      auto now = fs.stat(name, /*follow=*/false, &d);
      if (now.ok() && now->st_dev == st->st_dev && now->st_ino == st->st_ino && fs.unlink(name, &d).ok()) {
        removed.push_back(name);
        removed_bytes += found.bytes;
        continue;
      }
      found.alive = false;
    }
    left.push_back(std::move(found));
  }
  if (!removed.empty()) {
    std::string names_text;
    for (const auto& n : removed) names_text += str(names_text.empty() ? "" : ", ", n);
    TIER_LOG(kWarn, "swap path ", dir, ": removed ", removed.size(), " swap file", removed.size() == 1 ? "" : "s", " (",
             format_bytes(removed_bytes), ") left by tier processes that are gone: ", names_text);
  }
  return left;
}

SwapFile& SwapFile::operator=(SwapFile&& o) noexcept {
  if (this != &o) {
    remove();
    dir = std::move(o.dir);
    name = std::move(o.name);
    path = std::move(o.path);
    fs = std::move(o.fs);
    dir_file = std::move(o.dir_file);
    file = std::move(o.file);
    fd = o.fd;
    bytes = o.bytes;
    direct = o.direct;
    direct_refusal = std::move(o.direct_refusal);
    mem_align = o.mem_align;
    size_align = o.size_align;
    dev = o.dev;
    ino = o.ino;
    o.fd = -1;
  }
  return *this;
}

void SwapFile::remove() noexcept {
  if (file) {
    // Unlink by name only while the name still refers to the file we created.
    if (dir_file) {
      std::shared_ptr<FileSystem> fsys = FileSystem::current();
      auto st = fsys->stat(name, /*follow=*/false, dir_file.get());
      if (st.ok() && st->st_dev == dev && st->st_ino == ino) {
        if (Status s = fsys->unlink(name, dir_file.get()); !s.ok()) {
          TIER_LOG(kWarn, "swap file ", path, ": could not be removed: ", s.message());
        }
      }
    }
    file.reset();  // closes it
    fd = -1;
  }
  dir_file.reset();
}

Status SwapFile::data_sync() {
  if (!file) return failed_precondition(str("swap file ", path, ": closed"));
  Status s = file->data_sync();
  if (!s.ok()) return s.with_context(str("swap file ", path));
  return {};
}

Status set_direct(SwapFile& f, bool on) {
  const int flags = fcntl(f.fd, F_GETFL);
  if (flags < 0) return errno_status(errno, str("swap file ", f.path, ": F_GETFL"));
  const int want = on ? (flags | O_DIRECT) : (flags & ~O_DIRECT);
  if (fcntl(f.fd, F_SETFL, want) != 0) {
    const int err = errno;
    if (on && err == EINVAL) {
      return unsupported(str("swap path ", f.dir, ": O_DIRECT not supported by ", f.fs,
                             "; set tier.io.use_direct=false or use another path"));
    }
    return errno_status(err, str("swap file ", f.path, ": switching O_DIRECT ", on ? "on" : "off"));
  }
  f.direct = on;
  if (!on) {
    f.mem_align = f.size_align = 1;
    return Status::Ok();
  }
  // The kernel says what alignment O_DIRECT needs (Linux 6.1+); otherwise assume a 4 KiB sector.
  f.mem_align = f.size_align = 4096;
  struct statx sx {};
  if (statx(f.fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
      sx.stx_dio_mem_align > 0 && sx.stx_dio_offset_align > 0) {
    f.mem_align = sx.stx_dio_mem_align;
    f.size_align = sx.stx_dio_offset_align;
  }
  return Status::Ok();
}

Result<SwapFile> create_swap_file(const std::string& dir, std::uint64_t bytes, bool want_direct) {
  if (dir.empty()) return invalid_argument("swap path is empty; give a directory on the SSD");
  if (const auto nul = dir.find('\0'); nul != std::string::npos) {
    // The system would cut the path at the NUL and put the swap file somewhere else.
    return invalid_argument(str("swap path '", tier::detail::printable(dir.substr(0, 200)),
                                "' holds a NUL byte at offset ", nul, "; give the directory's path without one"));
  }
  if (std::string odd = odd_path(dir); !odd.empty()) {
    return failed_precondition(str("swap path ", dir, " is ", odd));
  }
  std::shared_ptr<FileSystem> fsys = FileSystem::current();
  // Missing, or below something that is not a directory (create_directories says which).
  if (auto there = fsys->stat(dir);
      !there.ok() && (there.status().sys_errno() == ENOENT || there.status().sys_errno() == ENOTDIR)) {
    if (Status made = fsys->create_directories(dir, 0700); !made.ok()) {
      const int err = made.sys_errno();
      if (err == EACCES || err == EPERM || err == EROFS) {
        return errno_status(err, str("swap path ", dir,
                                     ": cannot create the directory; create it writable by this user or choose "
                                     "another path"));
      }
      if (err == ENOTDIR || err == EEXIST) {
        return errno_status(
            err, str("swap path ", dir, ": cannot create the directory: a part of the path is not a directory"));
      }
      return made.with_context(str("swap path ", dir, ": cannot create the directory"));
    }
    // Private whatever the umask: the swap files hold model state.
    fsys->chmod(dir, 0700).ignore();
  }
  SwapFile f;
  f.dir = dir;
  f.bytes = bytes;
  auto opened_dir = fsys->open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (!opened_dir.ok()) {
    const int err = opened_dir.status().sys_errno();
    if (err == EACCES) {
      return errno_status(err, str("swap path ", dir,
                                   ": cannot open the directory; make it readable and writable by "
                                   "this user or choose another path"));
    }
    return opened_dir.status().with_context(str("swap path ", dir, ": cannot open the directory"));
  }
  f.dir_file = std::move(opened_dir).value();
  f.fs = fs_name(f.dir_file->fd());
  const std::vector<FoundSwapFile> others = reclaim_stale_swap_files(*fsys, *f.dir_file, dir);
  const std::string others_note =
      others.empty() ? std::string() : str("; tier swap files of other engines remain here: ", list_files(others));

  // File systems without space accounting (ramfs) report no blocks at all; fallocate decides there.
  struct statvfs vfs {};
  if (fstatvfs(f.dir_file->fd(), &vfs) == 0 && vfs.f_blocks > 0) {
    const std::uint64_t avail = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (avail < bytes) {
      return Status(
          StatusCode::kNoSpace,
          str("swap path ", dir, ": needs ", format_bytes(bytes), " (", bytes, " bytes) for its swap file but ",
              format_bytes(avail), " are free", others_note, "; free space, lower the swap size or add another path"),
          ENOSPC);
    }
  }

  for (int attempt = 0; attempt < 1000 && !f.file; ++attempt) {
    f.name = str(swap_file_prefix(), g_sequence.fetch_add(1), kSwapSuffix);
    auto created = fsys->open(f.name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600, f.dir_file.get());
    if (created.ok()) {
      f.file = std::move(created).value();
      break;
    }
    const int err = created.status().sys_errno();
    if (err == EACCES) {
      return errno_status(err, str("swap path ", dir, ": cannot create ", f.name,
                                   "; make the directory writable by this user or choose another path"));
    }
    if (err != EEXIST) return created.status().with_context(str("swap path ", dir, ": cannot create ", f.name));
  }
  if (!f.file) return already_exists(str("swap path ", dir, ": no fresh swap file name after 1000 tries"));
  f.fd = f.file->fd();
  // Held until the file closes: tells reclaim_stale_swap_files in other processes that it is in use.
  f.file->lock(LockMode::kExclusive, /*wait=*/false).ignore();
  f.path = dir + (dir.back() == '/' ? "" : "/") + f.name;
  auto st = f.file->stat();
  if (!st.ok()) return st.status().with_context(str("swap file ", f.path));
  f.dev = st->st_dev;
  f.ino = st->st_ino;

  Status allocated = bytes > 0 ? f.file->allocate(0, bytes) : Status();
  if (!allocated.ok()) {
    const int err = allocated.sys_errno();
    if (err == ENOSPC || err == EDQUOT) {
      return Status(
          StatusCode::kNoSpace,
          str("swap path ", dir, ": cannot preallocate ", format_bytes(bytes), " (", bytes,
              " bytes): no space left on ", f.fs, others_note, "; free space, lower the swap size or add another path"),
          err);
    }
    if (err != EOPNOTSUPP) {
      return allocated.with_context(str("swap file ", f.path, ": preallocating ", format_bytes(bytes)));
    }
    if (Status s = f.file->truncate(bytes); !s.ok()) {
      return s.with_context(str("swap file ", f.path, ": sizing it to ", format_bytes(bytes)));
    }
    log_once(str("nvme.no_fallocate.", dir), LogLevel::kWarn,
             str("swap path ", dir, ": ", f.fs,
                 " cannot preallocate; the swap file is sparse, so a full disk shows "
                 "only when a write fails"));
  }

  if (want_direct) {
    Status s = set_direct(f, true);
    if (s.code() == StatusCode::kUnsupported) {
      f.direct_refusal = s.message();
    } else if (!s.ok()) {
      return s;
    }
  }
  return f;
}

}  // namespace tier::nvme::detail

namespace tier::nvme {

Result<bool> path_is_in_memory(const std::string& path) {
  struct statfs sf {};
  if (::statfs(path.c_str(), &sf) != 0) return errno_status(errno, str("swap path ", path, ": statfs"));
  const auto type = static_cast<unsigned long>(sf.f_type);
  return type == TMPFS_MAGIC || type == RAMFS_MAGIC;
}

}  // namespace tier::nvme
