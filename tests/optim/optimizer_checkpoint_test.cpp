// Checkpoints: a loaded checkpoint continues with bit-identical results, also into another chunk
// size, buffer count or state home; truncation and corruption anywhere are kDataLoss and leave the
// current state alone; a checkpoint of another model is refused; hyper-parameters, step counters
// and the loss scale come back.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "optim/optim_test_util.hpp"

namespace tier::optim {
namespace {

using test::feed;
using test::Home;
using test::Reference;
using test::Rig;

OffloadedOptimizerOptions opts(std::uint64_t chunk, unsigned buffers) {
  OffloadedOptimizerOptions o;
  o.groups = test::three_groups();
  o.chunk_elements = chunk;
  o.buffer_count = buffers;
  o.loss_scale.enabled = true;
  o.loss_scale.initial_scale = 1024;
  o.loss_scale.window = 3;
  return o;
}

void run_steps(OffloadedOptimizer& opt, Reference& ref, std::uint64_t first, std::uint64_t last) {
  for (std::uint64_t step = first; step <= last; ++step) {
    const double scale = opt.loss_scale();
    feed(opt, ref, step, 1, DType::kF16, GradMode::kCopy, nullptr, static_cast<float>(1e-4 * scale));
    ASSERT_TRUE(ref.step(scale, 0));
    auto r = opt.step();
    ASSERT_TRUE(r.ok()) << r.status();
  }
}

class OptimizerCheckpoint : public testing::TestWithParam<Home> {
 protected:
  void SetUp() override {
    if (auto why = test::home_unavailable(GetParam()); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(OptimizerCheckpoint, LoadedCheckpointContinuesBitIdentical) {
  const auto model = test::mixed_model();
  Rig a(GetParam(), opts(2048, 3));
  ASSERT_TRUE(a.status().ok()) << a.status();
  Reference ref(model, test::three_groups(), 31);
  ASSERT_TRUE(a.register_model(ref, 31).ok());
  run_steps(a.opt(), ref, 1, 4);  // the loss scale grows after 3 clean steps
  ASSERT_TRUE(a.opt().set_lr(2, 7e-4).ok());
  ref.set_lr(2, 7e-4);
  const std::string path = test::ScratchDir(nvme::test::shm_base(), "ck").path();  // removed at once
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt");
  ASSERT_TRUE(dir.ok());
  const std::string file = dir.sub("opt.ckpt");
  ASSERT_TRUE(a.opt().save_checkpoint(file).ok());
  EXPECT_FALSE(std::filesystem::exists(file + ".tmp"));
  // Private to its owner (as the swap files), whatever the umask lets through.
  EXPECT_EQ(std::filesystem::status(file).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  const double scale = a.opt().loss_scale();
  EXPECT_EQ(scale, 2048);

  // Into every home and other layouts: same state, counters, lr, loss scale; same next steps.
  for (const Home& h : test::all_homes()) {
    if (!test::home_unavailable(h).empty()) continue;
    for (auto [chunk, buffers] : {std::pair<std::uint64_t, unsigned>{1024, 1}, {8192, 4}}) {
      Rig b(h, opts(chunk, buffers));
      ASSERT_TRUE(b.status().ok()) << b.status();
      Reference fresh(model, test::three_groups(), 99);  // other initial values: all must be replaced
      ASSERT_TRUE(b.register_model(fresh, 99).ok());
      ASSERT_TRUE(b.opt().load_checkpoint(file).ok()) << h.name;
      EXPECT_EQ(*b.opt().group_step(0), 4);
      EXPECT_EQ(b.opt().hyper_params(2)->lr, 7e-4);
      EXPECT_EQ(b.opt().hyper_params(1)->decay_mode, cpu::WeightDecayMode::kL2);
      EXPECT_EQ(b.opt().loss_scale(), scale);
      EXPECT_EQ(b.opt().loss_scaler().state().iteration, 4);
      ASSERT_TRUE(test::state_matches(b.opt(), ref)) << h.name << " chunk " << chunk;
      Reference cont = ref;
      run_steps(b.opt(), cont, 5, 7);
      ASSERT_TRUE(test::state_matches(b.opt(), cont)) << h.name << " chunk " << chunk;
    }
  }
  // And the original continues the same way.
  run_steps(a.opt(), ref, 5, 7);
  ASSERT_TRUE(test::state_matches(a.opt(), ref));
}

TEST_P(OptimizerCheckpoint, DamagedFilesAreDataLossAndChangeNothing) {
  const auto model = test::mixed_model();
  Rig a(GetParam(), opts(4096, 2));
  ASSERT_TRUE(a.status().ok()) << a.status();
  Reference ref(model, test::three_groups(), 41);
  ASSERT_TRUE(a.register_model(ref, 41).ok());
  run_steps(a.opt(), ref, 1, 1);
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt");
  ASSERT_TRUE(dir.ok());
  const std::string good = dir.sub("good.ckpt");
  ASSERT_TRUE(a.opt().save_checkpoint(good).ok());
  run_steps(a.opt(), ref, 2, 2);  // the state moves on; loading a bad file must not disturb it

  std::vector<char> bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::uint64_t n = bytes.size();
  ASSERT_GT(n, 12 * test::total_elements(model));
  auto write_file = [&](const std::string& p, const std::vector<char>& b) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(b.data(), static_cast<std::streamsize>(b.size()));
  };
  const std::string bad = dir.sub("bad.ckpt");
  // Truncations: inside the header, the metadata, a record header, a payload, the trailer.
  for (std::uint64_t cut : {std::uint64_t{10}, std::uint64_t{100}, n / 3, n / 2 + 7, n - 40, n - 1}) {
    write_file(bad, std::vector<char>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(cut)));
    const Status s = a.opt().load_checkpoint(bad);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << "cut at " << cut << ": " << s;
    ASSERT_TRUE(test::state_matches(a.opt(), ref)) << "cut at " << cut;
  }
  // Single flipped bits anywhere.
  for (std::uint64_t at : {std::uint64_t{3}, std::uint64_t{70}, n / 4, n / 2, n - 100, n - 5}) {
    auto b = bytes;
    b[at] = static_cast<char>(b[at] ^ 0x10);
    write_file(bad, b);
    const Status s = a.opt().load_checkpoint(bad);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << "flip at " << at << ": " << s;
    ASSERT_TRUE(test::state_matches(a.opt(), ref)) << "flip at " << at;
  }
  // Extra bytes after the trailer.
  auto longer = bytes;
  longer.push_back('x');
  write_file(bad, longer);
  EXPECT_EQ(a.opt().load_checkpoint(bad).code(), StatusCode::kDataLoss);
  EXPECT_EQ(*a.opt().group_step(0), 2);
  // The good one still loads.
  ASSERT_TRUE(a.opt().load_checkpoint(good).ok());
  EXPECT_EQ(*a.opt().group_step(0), 1);
  EXPECT_EQ(a.opt().load_checkpoint(dir.sub("missing")).code(), StatusCode::kNotFound);
}

TEST_P(OptimizerCheckpoint, OtherModelsAreRefused) {
  auto model = test::mixed_model();
  Rig a(GetParam(), opts(4096, 2));
  ASSERT_TRUE(a.status().ok());
  Reference ref(model, test::three_groups(), 51);
  ASSERT_TRUE(a.register_model(ref, 51).ok());
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt");
  const std::string file = dir.sub("a.ckpt");
  ASSERT_TRUE(a.opt().save_checkpoint(file).ok());

  model[4].numel += 1;  // one partition of another size
  Rig b(GetParam(), opts(4096, 2));
  ASSERT_TRUE(b.status().ok());
  Reference other(model, test::three_groups(), 51);
  ASSERT_TRUE(b.register_model(other, 51).ok());
  const Status s = b.opt().load_checkpoint(file);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("another model"), std::string::npos) << s;
  EXPECT_TRUE(test::state_matches(b.opt(), other));
}

INSTANTIATE_TEST_SUITE_P(Homes, OptimizerCheckpoint, testing::ValuesIn(test::all_homes()), test::home_name);

// A file under the old temporary name "<path>.tmp" (a crash of an older tier, or anyone's file)
// neither counts as the checkpoint nor is touched: saves write a fresh, unpredictably named file.
TEST(OptimizerCheckpointFiles, StaleTemporaryFileDoesNotCount) {
  OffloadedOptimizerOptions o = opts(4096, 2);
  Rig a({"host", StateHome::kHost, IoEngineKind::kAuto, false}, o);
  ASSERT_TRUE(a.status().ok());
  Reference ref(test::mixed_model(), o.groups, 61);
  ASSERT_TRUE(a.register_model(ref, 61).ok());
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt");
  const std::string file = dir.sub("c.ckpt");
  {
    std::ofstream junk(file + ".tmp");
    junk << "half a checkpoint";
  }
  EXPECT_EQ(a.opt().load_checkpoint(file).code(), StatusCode::kNotFound);
  ASSERT_TRUE(a.opt().save_checkpoint(file).ok());
  std::ifstream stale(file + ".tmp");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(stale), {}), "half a checkpoint");
  ASSERT_TRUE(a.opt().load_checkpoint(file).ok());
  EXPECT_TRUE(test::state_matches(a.opt(), ref));
  // Nothing else is left beside it: the temporary file was renamed.
  int entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 2);
  // A save into a directory that does not exist fails cleanly.
  EXPECT_FALSE(a.opt().save_checkpoint(dir.sub("nope/c.ckpt")).ok());
}

// Another user who can write the folder plants "<path>.tmp" as a symlink to a file of the user
// running tier: the old writer opened it with O_TRUNC|O_NOFOLLOW, so the save failed (ELOOP),
// and a regular file or hard link planted there was truncated and written.
TEST(OptimizerCheckpointFiles, APlantedTemporaryNameIsNeitherFollowedNorTruncated) {
  OffloadedOptimizerOptions o = opts(4096, 2);
  Rig a({"host", StateHome::kHost, IoEngineKind::kAuto, false}, o);
  ASSERT_TRUE(a.status().ok());
  Reference ref(test::mixed_model(), o.groups, 95);
  ASSERT_TRUE(a.register_model(ref, 95).ok());
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt");
  const std::string file = dir.sub("opt.ckpt"), victim = dir.sub("victim");
  std::ofstream(victim) << "the victim's data";
  std::filesystem::create_symlink(victim, file + ".tmp");
  ASSERT_TRUE(a.opt().save_checkpoint(file).ok());
  std::ifstream v(victim);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(v), {}), "the victim's data");
  EXPECT_TRUE(std::filesystem::is_symlink(file + ".tmp"));
  // A regular file under the old temporary name (someone else's) is not truncated either.
  std::filesystem::remove(file + ".tmp");
  std::ofstream(file + ".tmp") << "someone else's";
  ASSERT_TRUE(a.opt().save_checkpoint(file).ok());
  std::ifstream other(file + ".tmp");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(other), {}), "someone else's");
  ASSERT_TRUE(a.opt().load_checkpoint(file).ok());
  EXPECT_TRUE(test::state_matches(a.opt(), ref));
  // A NUL byte would cut the path short: refused both ways.
  EXPECT_EQ(a.opt().save_checkpoint(file + std::string("\0x", 2)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a.opt().load_checkpoint(file + std::string("\0x", 2)).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tier::optim
