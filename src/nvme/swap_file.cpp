#include "nvme/swap_file.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

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

}  // namespace

SwapFile& SwapFile::operator=(SwapFile&& o) noexcept {
  if (this != &o) {
    remove();
    dir = std::move(o.dir);
    name = std::move(o.name);
    path = std::move(o.path);
    fs = std::move(o.fs);
    dir_fd = o.dir_fd;
    fd = o.fd;
    bytes = o.bytes;
    direct = o.direct;
    direct_refusal = std::move(o.direct_refusal);
    mem_align = o.mem_align;
    size_align = o.size_align;
    dev = o.dev;
    ino = o.ino;
    o.dir_fd = -1;
    o.fd = -1;
  }
  return *this;
}

void SwapFile::remove() noexcept {
  if (fd >= 0) {
    // Unlink by name only while the name still refers to the file we created.
    struct stat st {};
    if (dir_fd >= 0 && fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_dev == dev &&
        st.st_ino == ino) {
      if (unlinkat(dir_fd, name.c_str(), 0) != 0) {
        TIER_LOG(kWarn, "swap file ", path, ": could not be removed: ", std::strerror(errno));
      }
    }
    ::close(fd);
    fd = -1;
  }
  if (dir_fd >= 0) {
    ::close(dir_fd);
    dir_fd = -1;
  }
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
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) {
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      return errno_status(ec.value(), str("swap path ", dir, ": cannot create the directory"));
    }
    std::filesystem::permissions(dir, std::filesystem::perms::owner_all, ec);
  }
  SwapFile f;
  f.dir = dir;
  f.bytes = bytes;
  f.dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (f.dir_fd < 0) return errno_status(errno, str("swap path ", dir, ": cannot open the directory"));
  f.fs = fs_name(f.dir_fd);

  // File systems without space accounting (ramfs) report no blocks at all; fallocate decides there.
  struct statvfs vfs {};
  if (fstatvfs(f.dir_fd, &vfs) == 0 && vfs.f_blocks > 0) {
    const std::uint64_t avail = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (avail < bytes) {
      return Status(
          StatusCode::kNoSpace,
          str("swap path ", dir, ": needs ", format_bytes(bytes), " (", bytes, " bytes) for its swap file but ",
              format_bytes(avail), " are free; free space, lower the swap size or add another path"),
          ENOSPC);
    }
  }

  for (int attempt = 0; attempt < 1000 && f.fd < 0; ++attempt) {
    f.name = str("tier-swap-", ::getpid(), "-", g_sequence.fetch_add(1), ".bin");
    f.fd = ::openat(f.dir_fd, f.name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (f.fd < 0 && errno != EEXIST) {
      return errno_status(errno, str("swap path ", dir, ": cannot create ", f.name));
    }
  }
  if (f.fd < 0) return already_exists(str("swap path ", dir, ": no fresh swap file name after 1000 tries"));
  f.path = dir + (dir.back() == '/' ? "" : "/") + f.name;
  struct stat st {};
  if (fstat(f.fd, &st) != 0) return errno_status(errno, str("swap file ", f.path, ": fstat"));
  f.dev = st.st_dev;
  f.ino = st.st_ino;

  if (bytes > 0 && fallocate(f.fd, 0, 0, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    if (err == ENOSPC || err == EDQUOT) {
      return Status(StatusCode::kNoSpace,
                    str("swap path ", dir, ": cannot preallocate ", format_bytes(bytes), " (", bytes,
                        " bytes): no space left on ", f.fs, "; free space, lower the swap size or add another path"),
                    err);
    }
    if (err != EOPNOTSUPP) return errno_status(err, str("swap file ", f.path, ": fallocate of ", format_bytes(bytes)));
    if (ftruncate(f.fd, static_cast<off_t>(bytes)) != 0) {
      return errno_status(errno, str("swap file ", f.path, ": ftruncate to ", format_bytes(bytes)));
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
