// FaultInjectingFileSystem: faults, power cuts and the durability model (see the header).
#include "tier/ext/fault_injecting_file_system.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

namespace tier {
namespace {

using Key = std::pair<dev_t, ino_t>;

Key key_of(const struct stat& st) {
  return {st.st_dev, st.st_ino};
}

// An absolute, lexically normal spelling, so that one file has one name in the model.
std::string absolute(const std::string& path) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(path, ec);
  if (ec) return path;
  std::string s = p.lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

std::string parent_of(const std::string& abs) {
  const auto slash = abs.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? std::string("/") : abs.substr(0, slash);
}

std::string joined(const File* at, const std::string& path) {
  if (at == nullptr || path.empty() || path.front() == '/') return path;
  return at->path() + "/" + path;
}

bool under(const std::string& path, const std::string& dir) {
  return path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 && path[dir.size()] == '/';
}

// What a name held, to put it back: a regular file with its durable content, a directory (empty:
// what was in it is put back by the changes that removed it) or a symlink with its target.
struct Node {
  enum Kind : std::uint8_t { kNone, kFile, kDir, kLink } kind = kNone;
  std::string data;  // the file's content or the link's target
  mode_t mode = 0;
};

struct Change {
  enum Kind : std::uint8_t { kCreated, kRemoved, kRenamed } kind;
  std::string path;    // created, removed: the name; renamed: the new name
  std::string from;    // renamed: the old name
  Node old;            // removed: what was there; renamed: what the new name held before
  bool dir = false;    // renamed: a directory moved (the names under it moved with it)
  std::set<Key> dirs;  // the directories whose sync makes the change durable
};

struct FileRec {
  std::string path;    // where it is now
  std::string synced;  // its content as of its last sync
  bool dirty = false;  // written since
};

}  // namespace

struct FaultInjectingFileSystem::Model {
  std::mutex mu;
  std::shared_ptr<FileSystem> inner;
  FileSystemCounters c;
  struct Fault {
    FileFault spec;
    std::uint64_t seen = 0;
  };
  std::vector<Fault> faults;
  std::optional<std::uint64_t> syncs_left, mutations_left;
  bool off = false;
  bool drop_file_syncs = false, drop_dir_syncs = false;
  std::map<Key, FileRec> files;
  std::vector<Change> pending;  // oldest first

  explicit Model(std::shared_ptr<FileSystem> fs) : inner(std::move(fs)) {}

  // Whether the call may reach the disk; counts a failure when not. Under mu.
  Status gate(FileOp op, const std::string& path, bool mutation) {
    auto fail = [&](int err, std::string_view why) {
      ++c.failed;
      return errno_status(err, str(file_op_name(op), " ", path, ": ", why));
    };
    if (off) return fail(EIO, "the power is off (FaultInjectingFileSystem)");
    if ((op == FileOp::kSync && syncs_left && *syncs_left == 0) ||
        (mutation && mutations_left && *mutations_left == 0)) {
      off = true;
      return fail(EIO, "the power went off here (FaultInjectingFileSystem)");
    }
    bool hit = false;
    int err = EIO;
    for (Fault& f : faults) {
      if (f.spec.op && *f.spec.op != op) continue;
      if (!f.spec.path_part.empty() && path.find(f.spec.path_part) == std::string::npos) continue;
      ++f.seen;
      if (!hit && f.seen >= f.spec.nth && f.seen - f.spec.nth < f.spec.count) {
        hit = true;
        err = f.spec.err;
      }
    }
    if (hit) return fail(err, "injected fault (FaultInjectingFileSystem)");
    return {};
  }

  // Counts a call that completed. Under mu.
  void passed(FileOp op, bool mutation) {
    ++c.calls[static_cast<int>(op)];
    if (mutation) {
      ++c.mutations;
      if (mutations_left) --*mutations_left;
    }
    if (op == FileOp::kSync) {
      ++c.syncs;
      if (syncs_left) --*syncs_left;
    }
  }

  std::optional<Key> dir_key(const std::string& dir) {
    auto st = inner->stat(dir, /*follow=*/true);
    if (!st.ok()) return std::nullopt;
    return key_of(*st);
  }

  // A change pending on the directories of `paths` (their parents).
  void record(Change ch, std::initializer_list<std::string> parents_of) {
    for (const std::string& p : parents_of) {
      if (auto k = dir_key(parent_of(p))) ch.dirs.insert(*k);
    }
    // A directory that cannot be found cannot be synced: the change stays pending.
    if (ch.dirs.empty()) ch.dirs.insert(Key{0, 0});
    pending.push_back(std::move(ch));
  }

  Result<std::string> read_all(const std::string& path, int flags) {
    TIER_ASSIGN_OR_RETURN(std::unique_ptr<File> f, inner->open(path, flags | O_RDONLY));
    std::string out;
    char buf[1 << 16];
    for (;;) {
      TIER_ASSIGN_OR_RETURN(std::size_t n, f->pread(buf, sizeof buf, out.size()));
      if (n == 0) return out;
      out.append(buf, n);
    }
  }

  // What `path` holds now, as it would come back after a power loss; `gone` gets the key of a
  // tracked file there (its record ends when the name goes).
  Result<Node> capture(const std::string& path, std::optional<Key>* gone) {
    Node n;
    auto st = inner->stat(path, /*follow=*/false);
    if (!st.ok()) {
      if (st.status().sys_errno() == ENOENT || st.status().sys_errno() == ENOTDIR) return n;
      return st.status();
    }
    n.mode = st->st_mode & 07777;
    if (S_ISDIR(st->st_mode)) {
      n.kind = Node::kDir;
    } else if (S_ISLNK(st->st_mode)) {
      n.kind = Node::kLink;
      TIER_ASSIGN_OR_RETURN(n.data, inner->readlink(path));
    } else if (S_ISREG(st->st_mode)) {
      n.kind = Node::kFile;
      auto it = files.find(key_of(*st));
      if (it != files.end()) {
        n.data = it->second.synced;
        *gone = it->first;
      } else {
        TIER_ASSIGN_OR_RETURN(n.data, read_all(path, O_NOFOLLOW | O_NONBLOCK));
      }
    } else {
      return unsupported(str("FaultInjectingFileSystem: ", path, " is neither a file, a directory nor a symlink"));
    }
    return n;
  }

  Status put_back(const std::string& path, const Node& n) {
    switch (n.kind) {
      case Node::kNone: return {};
      case Node::kDir: return inner->mkdir(path, n.mode);
      case Node::kLink: return inner->symlink(n.data, path);
      case Node::kFile: {
        TIER_ASSIGN_OR_RETURN(std::unique_ptr<File> f,
                              inner->open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, n.mode));
        TIER_RETURN_IF_ERROR(f->write_all(n.data.data(), n.data.size()));
        return f->close();
      }
    }
    return {};
  }

  Status remove_tree(const std::string& path) {
    auto st = inner->stat(path, /*follow=*/false);
    if (!st.ok()) return st.status().sys_errno() == ENOENT ? Status() : st.status();
    if (!S_ISDIR(st->st_mode)) return inner->unlink(path);
    TIER_ASSIGN_OR_RETURN(std::vector<std::string> names, inner->list(path));
    for (const std::string& n : names) TIER_RETURN_IF_ERROR(remove_tree(path + "/" + n));
    return inner->rmdir(path);
  }

  // Names under `from` in changes [0, end) are under `to` from now on.
  void rebase(const std::string& from, const std::string& to, std::size_t end) {
    auto move = [&](std::string& p) {
      if (p == from || under(p, from)) p = to + p.substr(from.size());
    };
    for (std::size_t i = 0; i < end; ++i) {
      move(pending[i].path);
      move(pending[i].from);
    }
  }

  Status undo(std::size_t i) {
    Change& ch = pending[i];
    // A change in a directory whose own removal was durable is moot: it went with the directory.
    if (auto parent = inner->stat(parent_of(ch.path), /*follow=*/false);
        !parent.ok() && parent.status().sys_errno() == ENOENT) {
      return {};
    }
    switch (ch.kind) {
      case Change::kCreated: return remove_tree(ch.path);
      case Change::kRemoved: return put_back(ch.path, ch.old);
      case Change::kRenamed:
        TIER_RETURN_IF_ERROR(inner->rename(ch.path, ch.from));
        if (ch.dir) rebase(ch.path, ch.from, i);
        return put_back(ch.path, ch.old);
    }
    return {};
  }

  void sync_dir(const Key& k) {
    std::vector<Change> still;
    still.reserve(pending.size());
    for (Change& ch : pending) {
      ch.dirs.erase(k);
      if (!ch.dirs.empty()) still.push_back(std::move(ch));
    }
    pending = std::move(still);
  }
};

namespace {

class FaultFile final : public File {
 public:
  using Model = FaultInjectingFileSystem::Model;

  FaultFile(std::string path, std::shared_ptr<Model> m, std::unique_ptr<File> inner, Key key, bool dir)
      : File(std::move(path)), m_(std::move(m)), inner_(std::move(inner)), key_(key), dir_(dir) {}

  int fd() const noexcept override { return inner_->fd(); }

  Result<std::size_t> pread(void* dst, std::size_t bytes, std::uint64_t offset) override {
    std::lock_guard<std::mutex> lock(m_->mu);
    TIER_RETURN_IF_ERROR(m_->gate(FileOp::kRead, path(), false));
    auto r = inner_->pread(dst, bytes, offset);
    if (r.ok()) m_->passed(FileOp::kRead, false);
    return r;
  }

  Result<std::size_t> pwrite(const void* src, std::size_t bytes, std::uint64_t offset) override {
    std::lock_guard<std::mutex> lock(m_->mu);
    TIER_RETURN_IF_ERROR(m_->gate(FileOp::kWrite, path(), true));
    auto r = inner_->pwrite(src, bytes, offset);
    if (r.ok()) changed(FileOp::kWrite);
    return r;
  }

  Result<std::size_t> writev(const struct iovec* iov, int count) override {
    std::lock_guard<std::mutex> lock(m_->mu);
    TIER_RETURN_IF_ERROR(m_->gate(FileOp::kWrite, path(), true));
    auto r = inner_->writev(iov, count);
    if (r.ok()) changed(FileOp::kWrite);
    return r;
  }

  Status sync() override { return synced(false); }
  Status data_sync() override { return synced(true); }

  Status allocate(std::uint64_t offset, std::uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(m_->mu);
    TIER_RETURN_IF_ERROR(m_->gate(FileOp::kAllocate, path(), true));
    TIER_RETURN_IF_ERROR(inner_->allocate(offset, bytes));
    changed(FileOp::kAllocate);
    return {};
  }

  Status truncate(std::uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(m_->mu);
    TIER_RETURN_IF_ERROR(m_->gate(FileOp::kTruncate, path(), true));
    TIER_RETURN_IF_ERROR(inner_->truncate(bytes));
    changed(FileOp::kTruncate);
    return {};
  }

  Result<struct stat> stat() override {
    std::lock_guard<std::mutex> lock(m_->mu);
    TIER_RETURN_IF_ERROR(m_->gate(FileOp::kStat, path(), false));
    auto r = inner_->stat();
    if (r.ok()) m_->passed(FileOp::kStat, false);
    return r;
  }

  Status lock(LockMode mode, bool wait) override {
    {
      std::lock_guard<std::mutex> lock(m_->mu);
      TIER_RETURN_IF_ERROR(m_->gate(FileOp::kLock, path(), false));
    }
    // Outside the model's lock: a waiting flock must not stop every other call.
    TIER_RETURN_IF_ERROR(inner_->lock(mode, wait));
    std::lock_guard<std::mutex> lock(m_->mu);
    m_->passed(FileOp::kLock, false);
    return {};
  }

  Status close() override {
    std::lock_guard<std::mutex> lock(m_->mu);
    Status gate = m_->gate(FileOp::kClose, path(), false);
    Status s = inner_->close();  // the descriptor goes either way, as a dead process's would
    if (!gate.ok()) return gate;
    if (s.ok()) m_->passed(FileOp::kClose, false);
    return s;
  }

 private:
  void changed(FileOp op) {
    auto it = m_->files.find(key_);
    if (it != m_->files.end()) it->second.dirty = true;
    m_->passed(op, true);
  }

  Status synced(bool data_only) {
    std::lock_guard<std::mutex> lock(m_->mu);
    TIER_RETURN_IF_ERROR(m_->gate(FileOp::kSync, path(), true));
    TIER_RETURN_IF_ERROR(data_only ? inner_->data_sync() : inner_->sync());
    if (dir_) {
      if (!m_->drop_dir_syncs) m_->sync_dir(key_);
    } else if (auto it = m_->files.find(key_); it != m_->files.end() && !m_->drop_file_syncs) {
      // What the disk holds now is durable: read it back through this descriptor's file (it may
      // have been opened write-only, renamed or unlinked since).
      auto now = m_->read_all(str("/proc/self/fd/", inner_->fd()), 0);
      if (!now.ok()) return now.status().with_context("FaultInjectingFileSystem: reading back a synced file");
      it->second.synced = std::move(now).value();
      it->second.dirty = false;
    }
    m_->passed(FileOp::kSync, true);
    return {};
  }

  std::shared_ptr<Model> m_;
  std::unique_ptr<File> inner_;
  Key key_;
  bool dir_;
};

}  // namespace

FaultInjectingFileSystem::FaultInjectingFileSystem(std::shared_ptr<FileSystem> inner)
    : m_(std::make_shared<Model>(inner ? std::move(inner) : FileSystem::posix())) {}

FaultInjectingFileSystem::~FaultInjectingFileSystem() = default;

void FaultInjectingFileSystem::add_fault(const FileFault& fault) {
  std::lock_guard<std::mutex> lock(m_->mu);
  m_->faults.push_back({fault, 0});
}

void FaultInjectingFileSystem::clear_faults() {
  std::lock_guard<std::mutex> lock(m_->mu);
  m_->faults.clear();
}

void FaultInjectingFileSystem::cut_power_after_syncs(std::uint64_t n) {
  std::lock_guard<std::mutex> lock(m_->mu);
  m_->syncs_left = n;
}

void FaultInjectingFileSystem::cut_power_after_mutations(std::uint64_t n) {
  std::lock_guard<std::mutex> lock(m_->mu);
  m_->mutations_left = n;
}

void FaultInjectingFileSystem::cut_power_now() {
  std::lock_guard<std::mutex> lock(m_->mu);
  m_->off = true;
}

bool FaultInjectingFileSystem::powered_off() const {
  std::lock_guard<std::mutex> lock(m_->mu);
  return m_->off;
}

void FaultInjectingFileSystem::restore_power() {
  std::lock_guard<std::mutex> lock(m_->mu);
  m_->off = false;
  m_->syncs_left.reset();
  m_->mutations_left.reset();
}

void FaultInjectingFileSystem::drop_syncs(bool files, bool dirs) {
  std::lock_guard<std::mutex> lock(m_->mu);
  m_->drop_file_syncs = files;
  m_->drop_dir_syncs = dirs;
}

Status FaultInjectingFileSystem::simulate_power_loss() {
  std::lock_guard<std::mutex> lock(m_->mu);
  Model& m = *m_;
  std::string problems;
  auto note = [&](const Status& s) {
    if (!s.ok()) problems += str(problems.empty() ? "" : "; ", s.message());
  };
  // File data first, where the files are now; then the names, newest change first.
  for (auto& [key, rec] : m.files) {
    if (!rec.dirty) continue;
    auto st = m.inner->stat(rec.path, /*follow=*/false);
    if (!st.ok() || key_of(*st) != key) {
      note(internal_error(str(rec.path, " is no longer the file written through the layer")));
      continue;
    }
    auto f = m.inner->open(rec.path, O_WRONLY | O_NOFOLLOW);
    if (!f.ok()) {
      note(f.status());
      continue;
    }
    Status s = (*f)->truncate(rec.synced.size());
    if (s.ok()) s = (*f)->pwrite_all(rec.synced.data(), rec.synced.size(), 0);
    if (s.ok()) s = (*f)->close();
    note(s);
  }
  for (std::size_t i = m.pending.size(); i-- > 0;) note(m.undo(i));
  m.files.clear();
  m.pending.clear();
  m.off = false;
  m.syncs_left.reset();
  m.mutations_left.reset();
  if (!problems.empty()) {
    return internal_error(str("simulate_power_loss: could not put everything back: ", problems));
  }
  return {};
}

FileSystemCounters FaultInjectingFileSystem::counters() const {
  std::lock_guard<std::mutex> lock(m_->mu);
  FileSystemCounters c = m_->c;
  c.powered_off = m_->off;
  c.pending_entries = m_->pending.size();
  c.unsynced_files = 0;
  for (const auto& [key, rec] : m_->files) c.unsynced_files += rec.dirty ? 1 : 0;
  return c;
}

Result<std::unique_ptr<File>> FaultInjectingFileSystem::open(const std::string& path, int flags, mode_t mode,
                                                             const File* at) {
  Model& m = *m_;
  const std::string abs = absolute(joined(at, path));
  const bool writable = (flags & O_ACCMODE) != O_RDONLY;
  const bool mutation = (flags & (O_CREAT | O_TRUNC)) != 0;
  std::lock_guard<std::mutex> lock(m.mu);
  TIER_RETURN_IF_ERROR(m.gate(FileOp::kOpen, abs, mutation));
  auto before = m.inner->stat(abs, /*follow=*/(flags & O_NOFOLLOW) == 0);
  std::optional<std::string> snapshot;  // a file met for the first time: durable as it is
  if (writable && before.ok() && S_ISREG(before->st_mode) && !m.files.contains(key_of(*before))) {
    auto content = m.read_all(abs, O_NONBLOCK);
    if (content.ok()) snapshot = std::move(content).value();
  }
  TIER_ASSIGN_OR_RETURN(std::unique_ptr<File> f, m.inner->open(path, flags, mode, at));
  auto st = f->stat();
  if (!st.ok()) return st.status();
  const Key key = key_of(*st);
  if (!before.ok() && (flags & O_CREAT)) {
    m.record(Change{Change::kCreated, abs, {}, {}, false, {}}, {abs});
    m.files[key] = FileRec{abs, {}, false};
  } else if (writable && S_ISREG(st->st_mode)) {
    auto it = m.files.find(key);
    if (it == m.files.end()) it = m.files.emplace(key, FileRec{abs, snapshot.value_or(std::string()), false}).first;
    it->second.path = abs;
    if (flags & O_TRUNC) it->second.dirty = true;
  }
  m.passed(FileOp::kOpen, mutation);
  return std::unique_ptr<File>(new FaultFile(abs, m_, std::move(f), key, S_ISDIR(st->st_mode)));
}

Status FaultInjectingFileSystem::rename(const std::string& from, const std::string& to) {
  Model& m = *m_;
  const std::string a = absolute(from), b = absolute(to);
  std::lock_guard<std::mutex> lock(m.mu);
  TIER_RETURN_IF_ERROR(m.gate(FileOp::kRename, a, true));
  auto src = m.inner->stat(a, /*follow=*/false);
  std::optional<Key> gone;
  Node old;
  if (src.ok()) {
    auto captured = m.capture(b, &gone);
    if (!captured.ok()) return captured.status().with_context("FaultInjectingFileSystem: rename");
    old = std::move(captured).value();
  }
  TIER_RETURN_IF_ERROR(m.inner->rename(from, to));
  if (gone && src.ok() && *gone != key_of(*src)) m.files.erase(*gone);
  const bool dir = src.ok() && S_ISDIR(src->st_mode);
  if (src.ok() && S_ISREG(src->st_mode)) {
    if (auto it = m.files.find(key_of(*src)); it != m.files.end()) it->second.path = b;
  }
  if (dir) {
    for (auto& [k, rec] : m.files) {
      if (under(rec.path, a)) rec.path = b + rec.path.substr(a.size());
    }
    m.rebase(a, b, m.pending.size());
  }
  m.record(Change{Change::kRenamed, b, a, std::move(old), dir, {}}, {a, b});
  m.passed(FileOp::kRename, true);
  return {};
}

Status FaultInjectingFileSystem::unlink(const std::string& path, const File* at) {
  Model& m = *m_;
  const std::string abs = absolute(joined(at, path));
  std::lock_guard<std::mutex> lock(m.mu);
  TIER_RETURN_IF_ERROR(m.gate(FileOp::kUnlink, abs, true));
  std::optional<Key> gone;
  auto old = m.capture(abs, &gone);
  if (!old.ok()) return old.status().with_context("FaultInjectingFileSystem: unlink");
  TIER_RETURN_IF_ERROR(m.inner->unlink(path, at));
  if (gone) m.files.erase(*gone);
  m.record(Change{Change::kRemoved, abs, {}, std::move(old).value(), false, {}}, {abs});
  m.passed(FileOp::kUnlink, true);
  return {};
}

Status FaultInjectingFileSystem::mkdir(const std::string& path, mode_t mode) {
  Model& m = *m_;
  const std::string abs = absolute(path);
  std::lock_guard<std::mutex> lock(m.mu);
  TIER_RETURN_IF_ERROR(m.gate(FileOp::kMkdir, abs, true));
  TIER_RETURN_IF_ERROR(m.inner->mkdir(path, mode));
  m.record(Change{Change::kCreated, abs, {}, {}, false, {}}, {abs});
  m.passed(FileOp::kMkdir, true);
  return {};
}

Status FaultInjectingFileSystem::rmdir(const std::string& path) {
  Model& m = *m_;
  const std::string abs = absolute(path);
  std::lock_guard<std::mutex> lock(m.mu);
  TIER_RETURN_IF_ERROR(m.gate(FileOp::kRmdir, abs, true));
  std::optional<Key> gone;
  auto old = m.capture(abs, &gone);
  if (!old.ok()) return old.status().with_context("FaultInjectingFileSystem: rmdir");
  TIER_RETURN_IF_ERROR(m.inner->rmdir(path));
  m.record(Change{Change::kRemoved, abs, {}, std::move(old).value(), false, {}}, {abs});
  m.passed(FileOp::kRmdir, true);
  return {};
}

Status FaultInjectingFileSystem::symlink(const std::string& target, const std::string& link) {
  Model& m = *m_;
  const std::string abs = absolute(link);
  std::lock_guard<std::mutex> lock(m.mu);
  TIER_RETURN_IF_ERROR(m.gate(FileOp::kSymlink, abs, true));
  TIER_RETURN_IF_ERROR(m.inner->symlink(target, link));
  m.record(Change{Change::kCreated, abs, {}, {}, false, {}}, {abs});
  m.passed(FileOp::kSymlink, true);
  return {};
}

Result<std::string> FaultInjectingFileSystem::readlink(const std::string& path) {
  std::lock_guard<std::mutex> lock(m_->mu);
  TIER_RETURN_IF_ERROR(m_->gate(FileOp::kReadlink, path, false));
  auto r = m_->inner->readlink(path);
  if (r.ok()) m_->passed(FileOp::kReadlink, false);
  return r;
}

Result<struct stat> FaultInjectingFileSystem::stat(const std::string& path, bool follow, const File* at) {
  std::lock_guard<std::mutex> lock(m_->mu);
  TIER_RETURN_IF_ERROR(m_->gate(FileOp::kStat, joined(at, path), false));
  auto r = m_->inner->stat(path, follow, at);
  if (r.ok()) m_->passed(FileOp::kStat, false);
  return r;
}

Status FaultInjectingFileSystem::chmod(const std::string& path, mode_t mode) {
  std::lock_guard<std::mutex> lock(m_->mu);
  TIER_RETURN_IF_ERROR(m_->gate(FileOp::kChmod, path, true));
  TIER_RETURN_IF_ERROR(m_->inner->chmod(path, mode));
  m_->passed(FileOp::kChmod, true);
  return {};
}

Result<std::vector<std::string>> FaultInjectingFileSystem::list(const std::string& dir, const File* at) {
  std::lock_guard<std::mutex> lock(m_->mu);
  TIER_RETURN_IF_ERROR(m_->gate(FileOp::kList, joined(at, dir), false));
  auto r = m_->inner->list(dir, at);
  if (r.ok()) m_->passed(FileOp::kList, false);
  return r;
}

}  // namespace tier
