// detail::AtomicFile: whatever another user planted in the folder (a "<name>.tmp" symlink to their
// victim, a symlink at the target's name) is never written through; the target is the old file
// or the new one, never half of one; the temporary name is fresh each time; a NUL is refused.
#include "core/atomic_file.hpp"
#include "core/scratch.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace tier::detail {
namespace {

namespace fs = std::filesystem;
using test::Scratch;
using test::slurp;

void put(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

Status write_whole(const std::string& path, const std::string& text, mode_t mode = 0644) {
  auto f = AtomicFile::create(path, mode, "test file");
  if (!f.ok()) return f.status();
  TIER_RETURN_IF_ERROR(f->write(text.data(), text.size()));
  return f->commit();
}

TEST(AtomicFile, APlantedTmpSymlinkIsNotWrittenThrough) {
  Scratch d;
  const fs::path victim = d.path / "victim";
  put(victim, "the victim's data");
  const fs::path target = d.path / "out.json";
  fs::create_symlink(victim, target.string() + ".tmp");  // what the old writers opened with O_TRUNC

  ASSERT_TRUE(write_whole(target, "new content").ok());
  EXPECT_EQ(slurp(victim), "the victim's data");
  EXPECT_EQ(slurp(target), "new content");
  EXPECT_FALSE(fs::is_symlink(target));
  EXPECT_TRUE(fs::is_symlink(target.string() + ".tmp")) << "someone else's file is left alone";
}

TEST(AtomicFile, ASymlinkAtTheTargetIsReplacedNotFollowed) {
  Scratch d;
  const fs::path victim = d.path / "victim";
  put(victim, "the victim's data");
  const fs::path target = d.path / "trace.json";
  fs::create_symlink(victim, target);

  ASSERT_TRUE(write_whole(target, "mine").ok());
  EXPECT_EQ(slurp(victim), "the victim's data");
  EXPECT_FALSE(fs::is_symlink(target));
  EXPECT_EQ(slurp(target), "mine");
}

TEST(AtomicFile, WithoutCommitTheTargetKeepsItsContentAndNoTemporaryFileRemains) {
  Scratch d;
  const fs::path target = d.path / "ckpt";
  put(target, "old");
  {
    auto f = AtomicFile::create(target, 0600, "test file");
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_TRUE(f->write("new, half", 9).ok());
    EXPECT_TRUE(fs::exists(f->temp_path()));
  }
  EXPECT_EQ(slurp(target), "old");
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(d.path)) ++entries;
  EXPECT_EQ(entries, 1);
}

TEST(AtomicFile, TemporaryNamesAreFreshHiddenAndBesideTheTarget) {
  Scratch d;
  const std::string target = (d.path / "model.bin").string();
  auto a = AtomicFile::create(target, 0600, "test file");
  auto b = AtomicFile::create(target, 0600, "test file");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->temp_path(), b->temp_path());
  for (const std::string& t : {a->temp_path(), b->temp_path()}) {
    EXPECT_EQ(fs::path(t).parent_path(), d.path) << t;
    EXPECT_EQ(fs::path(t).filename().string().rfind(".model.bin." + std::to_string(::getpid()) + ".", 0), 0u) << t;
  }
}

TEST(AtomicFile, ModeIsTheOneAsked) {
  Scratch d;
  const fs::path target = d.path / "private";
  const mode_t old = ::umask(022);
  ASSERT_TRUE(write_whole(target, "x", 0600).ok());
  ::umask(old);
  struct stat st {};
  ASSERT_EQ(::stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST(AtomicFile, PathsWithANulByteOrNoFileNameAreRefused) {
  Scratch d;
  const std::string with_nul = (d.path / "a").string() + std::string("\0b", 2);
  auto f = AtomicFile::create(with_nul, 0600, "trace");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("NUL"), std::string::npos) << f.status();
  EXPECT_FALSE(fs::exists(d.path / "a"));
  EXPECT_EQ(AtomicFile::create("", 0600, "trace").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(AtomicFile::create(d.path.string() + "/", 0600, "trace").status().code(), StatusCode::kInvalidArgument);
}

TEST(AtomicFile, AMissingFolderIsAnErrorNamingThePath) {
  const Status s = write_whole("/nonexistent-tier-dir/x/out.json", "x");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("/nonexistent-tier-dir/x/out.json"), std::string::npos) << s;
}

}  // namespace
}  // namespace tier::detail
