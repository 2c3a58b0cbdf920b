// Swap files left behind by tier processes that died are reclaimed at the next start; files of
// live owners, look-alikes and symlinks are left alone; odd swap paths get messages that say what
// the path is.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "nvme/swap_file.hpp"
#include "nvme_test_util.hpp"
#include "tier/log.hpp"
#include "tier/ext/swap_space.hpp"

namespace tier::nvme {
namespace {

namespace fs = std::filesystem;

SwapSpaceOptions small_options(const std::string& dir, std::uint64_t bytes = 1 << 20) {
  SwapSpaceOptions o;
  o.paths = {dir};
  o.bytes_per_path = bytes;
  o.engine = IoEngineKind::kPosix;
  o.use_direct = false;
  return o;
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

bool has_name_starting(const std::vector<std::string>& names, const std::string& prefix) {
  return std::any_of(names.begin(), names.end(), [&](const std::string& n) { return n.rfind(prefix, 0) == 0; });
}

void make_file(const std::string& path, std::uint64_t bytes = 4096) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::fallocate(fd, 0, 0, static_cast<off_t>(bytes)), 0);
  ::close(fd);
}

// Collects the log lines written while it lives.
class LogLines {
 public:
  LogLines() {
    set_log_sink([this](LogLevel, std::string_view m) {
      std::lock_guard<std::mutex> lk(mu_);
      lines_.emplace_back(m);
    });
  }
  ~LogLines() { set_log_sink(nullptr); }
  std::vector<std::string> take() {
    std::lock_guard<std::mutex> lk(mu_);
    return lines_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> lines_;
};

// A child process that creates a swap file in `dir` and then either exits without removing it
// (like a killed engine) or waits until killed.
pid_t child_with_swap_file(const std::string& dir, bool stay_alive, int ready_fd) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  auto f = detail::create_swap_file(dir, 1 << 20, false);
  const char byte = f.ok() ? 'y' : 'n';
  if (::write(ready_fd, &byte, 1) != 1) ::_exit(3);
  if (!f.ok()) ::_exit(2);
  if (stay_alive) {
    for (;;) ::pause();
  }
  ::_exit(0);  // no destructors: the file stays, as after a kill -9
}

class SwapReclaim : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(scratch_.ok());
    dir_ = scratch_.sub("swap");
    ASSERT_TRUE(fs::create_directories(dir_));
  }
  // Runs a child that leaves its swap file behind; returns the file's name.
  std::string leave_file_of_dead_process() {
    int p[2];
    EXPECT_EQ(::pipe(p), 0);
    const pid_t pid = child_with_swap_file(dir_, false, p[1]);
    char byte = 0;
    EXPECT_EQ(::read(p[0], &byte, 1), 1);
    ::close(p[0]);
    ::close(p[1]);
    int status = 0;
    EXPECT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_EQ(byte, 'y');
    const auto names = names_in(dir_);
    EXPECT_EQ(names.size(), 1u);
    const std::string want = "tier-swap-" + std::to_string(pid) + "-";
    EXPECT_TRUE(has_name_starting(names, want)) << "the file names its owner's pid";
    return names.empty() ? std::string() : names[0];
  }

  test::ScratchDir scratch_{test::shm_base(), "reclaim"};
  std::string dir_;
};

TEST_F(SwapReclaim, FileOfADeadProcessIsRemovedAtTheNextStartWithOneLogLine) {
  const std::string stale = leave_file_of_dead_process();
  ASSERT_FALSE(stale.empty());
  LogLines log;
  {
    auto sp = SwapSpace::create(small_options(dir_));
    ASSERT_TRUE(sp.ok()) << sp.status();
    const auto names = names_in(dir_);
    EXPECT_EQ(names.size(), 1u) << "only the new engine's file";
    EXPECT_TRUE(std::find(names.begin(), names.end(), stale) == names.end()) << stale << " was not reclaimed";
  }
  const auto lines = log.take();
  const auto n = std::count_if(lines.begin(), lines.end(),
                               [&](const std::string& l) { return l.find(stale) != std::string::npos; });
  EXPECT_EQ(n, 1) << "one log line names the reclaimed file";
  for (const auto& l : lines) {
    if (l.find(stale) != std::string::npos) {
      EXPECT_NE(l.find(dir_), std::string::npos) << l;
      EXPECT_NE(l.find("1.00 MiB"), std::string::npos) << l;
    }
  }
}

TEST_F(SwapReclaim, FileOfALiveProcessIsLeftAlone) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  const pid_t pid = child_with_swap_file(dir_, true, p[1]);
  char byte = 0;
  ASSERT_EQ(::read(p[0], &byte, 1), 1);
  ::close(p[0]);
  ::close(p[1]);
  const std::string theirs = "tier-swap-" + std::to_string(pid) + "-";
  {
    auto sp = SwapSpace::create(small_options(dir_));
    EXPECT_TRUE(sp.ok()) << sp.status();
    EXPECT_TRUE(has_name_starting(names_in(dir_), theirs)) << "a live engine's file was removed";
  }
  ::kill(pid, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_EQ(byte, 'y');
  // Now that it is gone, the next start reclaims it.
  auto sp = SwapSpace::create(small_options(dir_));
  ASSERT_TRUE(sp.ok()) << sp.status();
  EXPECT_FALSE(has_name_starting(names_in(dir_), theirs));
}

TEST_F(SwapReclaim, RecycledPidWithAnotherStartTimeCountsAsGone) {
  // Our own pid is alive, but not with this start time (nor on this boot): the pid was recycled.
  const std::string prefix = detail::swap_file_prefix();  // tier-swap-<pid>-<start>-<boot>-
  const std::string pid_part = "tier-swap-" + std::to_string(::getpid()) + "-";
  ASSERT_EQ(prefix.rfind(pid_part, 0), 0u) << prefix;
  const std::string rest = prefix.substr(pid_part.size());  // <start>-<boot>-
  const std::string start = rest.substr(0, rest.find('-'));
  const std::string boot = rest.substr(rest.find('-') + 1, 8);
  const std::string other_start = pid_part + std::to_string(std::stoull(start) + 1) + "-" + boot + "-7.bin";
  const std::string other_boot = pid_part + start + "-" + (boot == "00000000" ? "11111111" : "00000000") + "-8.bin";
  const std::string same = prefix + "999999.bin";  // this very process: alive
  make_file(dir_ + "/" + other_start);
  make_file(dir_ + "/" + other_boot);
  make_file(dir_ + "/" + same);
  auto sp = SwapSpace::create(small_options(dir_));
  ASSERT_TRUE(sp.ok()) << sp.status();
  const auto names = names_in(dir_);
  EXPECT_TRUE(std::find(names.begin(), names.end(), other_start) == names.end()) << other_start;
  EXPECT_TRUE(std::find(names.begin(), names.end(), other_boot) == names.end()) << other_boot;
  EXPECT_TRUE(std::find(names.begin(), names.end(), same) != names.end()) << same;
}

TEST_F(SwapReclaim, LockedFileIsLeftAloneWhateverItsNameSays) {
  // An owner in another pid namespace is invisible in /proc, but it holds its file locked.
  const std::string name = "tier-swap-999999998-1-0000abcd-0.bin";
  make_file(dir_ + "/" + name);
  const int fd = ::open((dir_ + "/" + name).c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  {
    auto sp = SwapSpace::create(small_options(dir_));
    ASSERT_TRUE(sp.ok()) << sp.status();
  }
  EXPECT_TRUE(fs::exists(dir_ + "/" + name));
  ::close(fd);
  auto sp = SwapSpace::create(small_options(dir_));
  ASSERT_TRUE(sp.ok()) << sp.status();
  EXPECT_FALSE(fs::exists(dir_ + "/" + name)) << "unlocked and its owner gone: reclaimed";
}

TEST_F(SwapReclaim, OnlyTiersExactNamesAreEverRemoved) {
  const std::string victim = scratch_.sub("victim");
  make_file(victim);
  const std::vector<std::string> keep = {"tier-swap-999999997-3.bin.bak",        "tier-swap-abc-3.bin",
                                         "tier-swap-999999997-3.binx",           "tier-swap-999999997-3-0000abcd.bin",
                                         "tier-swap-999999997-1-0000ABCD-0.bin", "notes.txt",
                                         "xtier-swap-999999997-3.bin",           "tier-swap--3.bin"};
  for (const auto& n : keep) make_file(dir_ + "/" + n);
  ASSERT_EQ(::mkdir((dir_ + "/tier-swap-999999997-4.bin").c_str(), 0700), 0);
  // A symlink with a stale swap file's name: neither followed nor removed.
  ASSERT_EQ(::symlink(victim.c_str(), (dir_ + "/tier-swap-999999997-5.bin").c_str()), 0);
  // A real stale legacy-named file (pid that does not exist) is removed.
  make_file(dir_ + "/tier-swap-999999997-6.bin");
  auto sp = SwapSpace::create(small_options(dir_));
  ASSERT_TRUE(sp.ok()) << sp.status();
  for (const auto& n : keep) EXPECT_TRUE(fs::exists(dir_ + "/" + n)) << n;
  EXPECT_TRUE(fs::is_directory(dir_ + "/tier-swap-999999997-4.bin"));
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(dir_ + "/tier-swap-999999997-5.bin")));
  EXPECT_TRUE(fs::exists(victim));
  EXPECT_EQ(fs::file_size(victim), 4096u);
  EXPECT_FALSE(fs::exists(dir_ + "/tier-swap-999999997-6.bin"));
}

TEST_F(SwapReclaim, NoSpaceErrorNamesTheSwapFilesOfLiveOwners) {
  const std::string live = detail::swap_file_prefix() + "999998.bin";
  make_file(dir_ + "/" + live, 2 << 20);
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(dir_.c_str(), &vfs), 0);
  if (vfs.f_blocks == 0) GTEST_SKIP() << dir_ << " has no space accounting";
  const std::uint64_t avail = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  auto o = small_options(dir_, avail + (std::uint64_t{1} << 40));
  o.preallocate = true;
  auto sp = SwapSpace::create(o);
  ASSERT_FALSE(sp.ok());
  EXPECT_EQ(sp.status().code(), StatusCode::kNoSpace);
  const std::string& m = sp.status().message();
  EXPECT_NE(m.find(live + " (2.00 MiB, pid " + std::to_string(::getpid()) + " running)"), std::string::npos) << m;
  EXPECT_NE(m.find("free space, lower the swap size"), std::string::npos) << m;
  EXPECT_TRUE(fs::exists(dir_ + "/" + live));
}

TEST_F(SwapReclaim, DanglingSymlinkPathSaysWhereItPoints) {
  const std::string link = scratch_.sub("nvme-link");
  const std::string target = scratch_.sub("not-there");
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  auto sp = SwapSpace::create(small_options(link));
  ASSERT_FALSE(sp.ok());
  EXPECT_EQ(sp.status().code(), StatusCode::kFailedPrecondition) << sp.status();
  const std::string& m = sp.status().message();
  EXPECT_NE(m.find("swap path " + link + " is a symbolic link to " + target), std::string::npos) << m;
  EXPECT_NE(m.find("does not resolve"), std::string::npos) << m;
  EXPECT_EQ(m.find("File exists"), std::string::npos) << m;
}

TEST_F(SwapReclaim, SymlinkToADirectoryIsFollowed) {
  const std::string link = scratch_.sub("nvme-link");
  ASSERT_EQ(::symlink(dir_.c_str(), link.c_str()), 0);
  auto sp = SwapSpace::create(small_options(link));
  ASSERT_TRUE(sp.ok()) << sp.status();
  EXPECT_EQ(names_in(dir_).size(), 1u);
}

TEST_F(SwapReclaim, FileOrSymlinkToAFileSaysItIsNotADirectory) {
  const std::string file = scratch_.sub("plain");
  make_file(file);
  auto sp = SwapSpace::create(small_options(file));
  ASSERT_FALSE(sp.ok());
  EXPECT_NE(sp.status().message().find("is a regular file, not a directory"), std::string::npos) << sp.status();
  const std::string link = scratch_.sub("link-to-file");
  ASSERT_EQ(::symlink(file.c_str(), link.c_str()), 0);
  sp = SwapSpace::create(small_options(link));
  ASSERT_FALSE(sp.ok());
  EXPECT_NE(sp.status().message().find("is a symbolic link to " + file + ", which is a regular file, not a directory"),
            std::string::npos)
      << sp.status();
  sp = SwapSpace::create(small_options(file + "/sub"));
  ASSERT_FALSE(sp.ok());
  EXPECT_NE(sp.status().message().find("a part of the path is not a directory"), std::string::npos) << sp.status();
}

// A NUL byte cut the path short where the system read it: "<dir>\0/elsewhere" put the swap file
// in <dir> without a word (issue #31). The options are refused, naming the byte.
TEST_F(SwapReclaim, APathWithANulByteIsRefused) {
  auto sp = SwapSpace::create(small_options(dir_ + std::string("\0/elsewhere", 11)));
  ASSERT_FALSE(sp.ok());
  EXPECT_EQ(sp.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(sp.status().message().find("NUL byte at offset " + std::to_string(dir_.size())), std::string::npos)
      << sp.status();
  EXPECT_TRUE(names_in(dir_).empty());
}

TEST_F(SwapReclaim, UnwritableDirectorySaysSoAndHowToFix) {
  if (::geteuid() == 0) GTEST_SKIP() << "root writes anywhere; run as another user to check permission messages";
  ASSERT_EQ(::chmod(dir_.c_str(), 0500), 0);
  auto sp = SwapSpace::create(small_options(dir_));
  ::chmod(dir_.c_str(), 0700);
  ASSERT_FALSE(sp.ok());
  EXPECT_NE(sp.status().message().find("writable by this user"), std::string::npos) << sp.status();
}

}  // namespace
}  // namespace tier::nvme
