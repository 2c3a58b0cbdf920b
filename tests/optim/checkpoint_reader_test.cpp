// Reading a checkpoint without an optimizer (read_checkpoint_info, read_checkpoint_masters, what
// tier.torch.zero_to_fp32 uses): the partitions and the master params come back exactly as the
// optimizer that saved them holds them, for every state dtype and home; truncation, a flipped
// bit or trailing bytes anywhere are kDataLoss, as for load_checkpoint; a visitor's error stops
// the read.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <tuple>

#include "optim/optim_test_util.hpp"

namespace tier::optim {
namespace {

using cpu::StateDType;
using test::Home;
using test::Reference;

OffloadedOptimizerOptions opts(StateDType sd) {
  OffloadedOptimizerOptions o;
  o.groups = test::three_groups();
  o.chunk_elements = 4096;  // the 20000-element partition spans several records
  o.buffer_count = 2;
  o.state_dtype = sd;
  return o;
}

void train(OffloadedOptimizer& opt, Reference& ref, std::uint64_t steps) {
  for (std::uint64_t step = 1; step <= steps; ++step) {
    test::feed(opt, ref, step, 1, DType::kBF16, GradMode::kCopy);
    ASSERT_TRUE(ref.step(1.0, 0));
    auto r = opt.step();
    ASSERT_TRUE(r.ok()) << r.status();
  }
}

// Every partition's masters as read_checkpoint_masters hands them over, checking that the pieces
// come in order and cover each partition once.
Status read_all(const std::string& path, const CheckpointInfo& info, std::vector<std::vector<float>>* out) {
  out->assign(info.partitions.size(), {});
  PartitionId expect_pid = 0;
  std::uint64_t expect_off = 0;
  Status s = read_checkpoint_masters(
      path, [&](const CheckpointPartition& part, std::uint64_t offset, const float* values, std::uint64_t count) {
        if (expect_off == info.partitions.at(expect_pid).numel) {
          ++expect_pid;
          expect_off = 0;
        }
        if (part.id != expect_pid || offset != expect_off || count == 0 ||
            count > info.partitions[part.id].numel - offset || part.numel != info.partitions[part.id].numel) {
          return internal_error(
              str("piece of partition ", part.id, " at ", offset, " (", count, " elements) out of order"));
        }
        (*out)[part.id].insert((*out)[part.id].end(), values, values + count);
        expect_off += count;
        return Status();
      });
  return s;
}

class CheckpointReader : public testing::TestWithParam<std::tuple<Home, StateDType>> {
 protected:
  void SetUp() override {
    if (auto why = test::home_unavailable(home()); !why.empty()) GTEST_SKIP() << why;
  }
  const Home& home() const { return std::get<0>(GetParam()); }
  StateDType sd() const { return std::get<1>(GetParam()); }
};

TEST_P(CheckpointReader, MastersReadAloneAreTheOptimizers) {
  const auto model = test::mixed_model();
  Reference ref(model, test::three_groups(), 11, sd());  // make_rig registers seed 11
  auto rig = test::make_rig(home(), opts(sd()), ref);
  ASSERT_TRUE(rig->status().ok());
  train(rig->opt(), ref, 2);
  if (HasFatalFailure()) return;
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt-reader");
  ASSERT_TRUE(dir.ok());
  const std::string file = dir.sub("opt.ckpt");
  ASSERT_TRUE(rig->opt().save_checkpoint(file).ok());

  auto info = read_checkpoint_info(file);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version, 4u);
  EXPECT_EQ(info->state_dtype, sd());
  EXPECT_EQ(info->elements, test::total_elements(model));
  ASSERT_EQ(info->partitions.size(), model.size());
  for (std::size_t i = 0; i < model.size(); ++i) {
    EXPECT_EQ(info->partitions[i].id, i);
    EXPECT_EQ(info->partitions[i].numel, model[i].numel);
    EXPECT_EQ(info->partitions[i].group, model[i].group);
    EXPECT_EQ(info->partitions[i].name, str("p", i));
  }

  std::vector<std::vector<float>> got;
  const Status s = read_all(file, *info, &got);
  ASSERT_TRUE(s.ok()) << s;
  for (std::size_t i = 0; i < model.size(); ++i) {
    const std::uint64_t n = model[i].numel;
    ASSERT_EQ(got[i].size(), n) << "partition " << i;
    std::vector<float> want(n);
    ASSERT_TRUE(rig->opt().read_state(static_cast<PartitionId>(i), StateKind::kMaster, want.data(), 0, n).ok());
    EXPECT_TRUE(test::same_bits(got[i].data(), want.data(), n, str("partition ", i)));
    EXPECT_TRUE(test::same_bits(got[i].data(), ref.master(i).data(), n, str("reference partition ", i)));
  }
}

TEST_P(CheckpointReader, DamagedFilesAreDataLoss) {
  const auto model = test::mixed_model();
  Reference ref(model, test::three_groups(), 23, sd());
  auto rig = test::make_rig(home(), opts(sd()), ref);
  ASSERT_TRUE(rig->status().ok());
  train(rig->opt(), ref, 1);
  if (HasFatalFailure()) return;
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt-reader");
  ASSERT_TRUE(dir.ok());
  const std::string good = dir.sub("good.ckpt");
  ASSERT_TRUE(rig->opt().save_checkpoint(good).ok());
  auto info = read_checkpoint_info(good);
  ASSERT_TRUE(info.ok()) << info.status();

  std::vector<char> bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::uint64_t n = bytes.size();
  ASSERT_GT(n, 4 * test::total_elements(model));
  const std::string bad = dir.sub("bad.ckpt");
  auto write_file = [&](const std::vector<char>& b) {
    std::ofstream out(bad, std::ios::binary | std::ios::trunc);
    out.write(b.data(), static_cast<std::streamsize>(b.size()));
  };
  auto expect_data_loss = [&](const std::string& what) {
    std::vector<std::vector<float>> got;
    const Status s = read_all(bad, *info, &got);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << what << ": " << s;
  };
  // Truncations: inside the header, the metadata, a record header, a payload, the trailer.
  for (std::uint64_t cut : {std::uint64_t{10}, std::uint64_t{100}, n / 3, n / 2 + 7, n - 40, n - 1}) {
    write_file(std::vector<char>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(cut)));
    expect_data_loss(str("cut at ", cut));
  }
  // Single flipped bits: the magic, the header, the metadata, masters and moments of records
  // (a moment's damage counts though only the masters are handed over), the trailer.
  for (std::uint64_t at :
       {std::uint64_t{3}, std::uint64_t{20}, std::uint64_t{70}, n / 4, n / 2, 3 * n / 4, n - 100, n - 5}) {
    auto b = bytes;
    b[at] = static_cast<char>(b[at] ^ 0x10);
    write_file(b);
    expect_data_loss(str("flip at ", at));
  }
  // Every byte of the last record's moments (the last sections before the trailer) is checked.
  for (std::uint64_t back : {std::uint64_t{33}, std::uint64_t{32 + 4 * 256}}) {
    auto b = bytes;
    b[n - back] = static_cast<char>(b[n - back] ^ 0x01);
    write_file(b);
    expect_data_loss(str("flip ", back, " bytes before the end"));
  }
  auto longer = bytes;
  longer.push_back('x');
  write_file(longer);
  expect_data_loss("a byte after the trailer");
  // The metadata's damage already fails read_checkpoint_info.
  auto meta = bytes;
  meta[70] = static_cast<char>(meta[70] ^ 0x10);
  write_file(meta);
  EXPECT_EQ(read_checkpoint_info(bad).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(read_checkpoint_info(dir.sub("missing")).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(read_checkpoint_masters(dir.sub("missing"), [](auto&&...) { return Status(); }).code(),
            StatusCode::kNotFound);
  // The good file still reads.
  std::vector<std::vector<float>> got;
  EXPECT_TRUE(read_all(good, *info, &got).ok());
}

TEST_P(CheckpointReader, AVisitorsErrorStopsTheRead) {
  Reference ref(test::mixed_model(), test::three_groups(), 25, sd());
  auto rig = test::make_rig(home(), opts(sd()), ref);
  ASSERT_TRUE(rig->status().ok());
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt-reader");
  ASSERT_TRUE(dir.ok());
  const std::string file = dir.sub("opt.ckpt");
  ASSERT_TRUE(rig->opt().save_checkpoint(file).ok());
  int calls = 0;
  const Status s =
      read_checkpoint_masters(file, [&](const CheckpointPartition& part, std::uint64_t, const float*, std::uint64_t) {
        ++calls;
        return part.id == 3 ? cancelled("enough") : Status();
      });
  EXPECT_EQ(s.code(), StatusCode::kCancelled) << s;
  EXPECT_EQ(calls, 4);
}

INSTANTIATE_TEST_SUITE_P(Homes, CheckpointReader,
                         testing::Combine(testing::ValuesIn(test::all_homes()),
                                          testing::Values(StateDType::kF32, StateDType::kBF16, StateDType::kInt8)),
                         [](const testing::TestParamInfo<std::tuple<Home, StateDType>>& info) {
                           return str(std::get<0>(info.param).name, "_",
                                      cpu::state_dtype_name(std::get<1>(info.param)));
                         });

}  // namespace
}  // namespace tier::optim
