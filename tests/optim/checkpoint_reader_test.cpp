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

// A copy of the file at `from` with the byte at `at` flipped by `mask`, written to `to`.
void write_flipped(const std::string& from, const std::string& to, std::uint64_t at, char mask) {
  std::vector<char> bytes;
  {
    std::ifstream in(from, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  bytes.at(at) ^= mask;
  std::ofstream(to, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::uint64_t file_size(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  return static_cast<std::uint64_t>(in.tellg());
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

// read_checkpoint_state: per record its master, then exp_avg, then exp_avg_sq, each in order and
// each partition covered once per kind; the moments decoded to fp32 equal what the optimizer's
// read_state gives (its own decoding of the same bytes), bit for bit.
TEST_P(CheckpointReader, StateReadAloneIsTheOptimizers) {
  const auto model = test::mixed_model();
  Reference ref(model, test::three_groups(), 13, sd());
  auto rig = test::make_rig(home(), opts(sd()), ref);
  ASSERT_TRUE(rig->status().ok());
  train(rig->opt(), ref, 2);
  if (HasFatalFailure()) return;
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt-reader");
  ASSERT_TRUE(dir.ok());
  const std::string file = dir.sub("opt.ckpt");
  ASSERT_TRUE(rig->opt().save_checkpoint(file).ok());

  std::vector<std::vector<float>> got[3];
  for (auto& g : got) g.assign(model.size(), {});
  int last_kind = 2;
  std::uint64_t record_start = 0, record_count = 0;
  const Status s = read_checkpoint_state(file, [&](const CheckpointPartition& part, StateKind kind,
                                                   std::uint64_t offset, const float* values, std::uint64_t count) {
    const int k = static_cast<int>(kind);
    std::vector<float>& dst = got[k].at(part.id);
    if (offset != dst.size() || count == 0 || offset + count > part.numel) {
      return internal_error(
          str(state_kind_name(kind), " piece of partition ", part.id, " at ", offset, " out of order"));
    }
    // Allowed: more of the same kind, the record's next kind once the last one covered the
    // record, or a new record's master after its exp_avg_sq.
    const bool next_kind = k == last_kind + 1 && got[last_kind][part.id].size() == record_start + record_count;
    if (k == 0 && last_kind == 2) {  // a new record
      record_start = offset;
      record_count = 0;
    } else if (k != last_kind && !next_kind) {
      return internal_error(str(state_kind_name(kind), " of partition ", part.id, " after kind ", last_kind));
    }
    if (k == 0) record_count += count;
    if (k != 0 && (offset < record_start || offset + count > record_start + record_count)) {
      return internal_error(str(state_kind_name(kind), " of partition ", part.id, " outside its record"));
    }
    last_kind = k;
    dst.insert(dst.end(), values, values + count);
    return Status();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (std::size_t i = 0; i < model.size(); ++i) {
    const std::uint64_t n = model[i].numel;
    for (int k = 0; k < 3; ++k) {
      ASSERT_EQ(got[k][i].size(), n) << "partition " << i << " kind " << k;
      std::vector<float> want(n);
      ASSERT_TRUE(
          rig->opt().read_state(static_cast<PartitionId>(i), static_cast<StateKind>(k), want.data(), 0, n).ok());
      EXPECT_TRUE(test::same_bits(got[k][i].data(), want.data(), n, str("partition ", i, " kind ", k)));
    }
  }
  // A flipped bit in a moment is found: the read fails.
  const std::string bad = dir.sub("bad.ckpt");
  write_flipped(file, bad, file_size(file) - 64, 0x10);  // the last record's last section
  EXPECT_EQ(read_checkpoint_state(bad, [](auto&&...) { return Status(); }).code(), StatusCode::kDataLoss);
}

// load_checkpoint's before_commit: called once, after the whole file verified (not for a damaged
// file), before anything changes; declining leaves the state as it was, accepting loads it.
TEST_P(CheckpointReader, BeforeCommitSeesAVerifiedFileAndItsRefusalChangesNothing) {
  const auto model = test::mixed_model();
  for (unsigned copies : {1u, 2u}) {
    SCOPED_TRACE(str("state_copies ", copies));
    Reference ref(model, test::three_groups(), 17, sd());
    OffloadedOptimizerOptions o = opts(sd());
    o.state_copies = copies;
    auto rig = test::make_rig(home(), o, ref);
    ASSERT_TRUE(rig->status().ok());
    train(rig->opt(), ref, 1);
    if (HasFatalFailure()) return;
    test::ScratchDir dir(nvme::test::shm_base(), "ckpt-reader");
    ASSERT_TRUE(dir.ok());
    const std::string file = dir.sub("opt.ckpt");
    ASSERT_TRUE(rig->opt().save_checkpoint(file).ok());
    const auto snapshot = [&] {
      std::vector<std::vector<float>> all;
      for (std::size_t i = 0; i < model.size(); ++i) {
        for (int k = 0; k < 3; ++k) {
          all.emplace_back(model[i].numel);
          EXPECT_TRUE(rig->opt()
                          .read_state(static_cast<PartitionId>(i), static_cast<StateKind>(k), all.back().data(), 0,
                                      model[i].numel)
                          .ok());
        }
      }
      return all;
    };
    const auto saved = snapshot();
    train(rig->opt(), ref, 1);
    if (HasFatalFailure()) return;
    const auto stepped = snapshot();
    ASSERT_NE(saved, stepped);

    int calls = 0;
    Status s = rig->opt().load_checkpoint(file, [&] {
      ++calls;
      return cancelled("another rank refused");
    });
    EXPECT_EQ(s.code(), StatusCode::kCancelled) << s;
    EXPECT_EQ(calls, 1);
    EXPECT_EQ(snapshot(), stepped);

    const std::string bad = dir.sub("bad.ckpt");
    write_flipped(file, bad, file_size(file) / 2, 0x01);
    calls = 0;
    s = rig->opt().load_checkpoint(bad, [&] {
      ++calls;
      return Status();
    });
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
    EXPECT_EQ(calls, 0);
    EXPECT_EQ(snapshot(), stepped);

    s = rig->opt().load_checkpoint(file, [&] {
      ++calls;
      return Status();
    });
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(calls, 1);
    EXPECT_EQ(snapshot(), saved);
  }
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
