// A checkpoint file is untrusted input: its checksums find damage, not a file crafted with valid
// ones. Crafted values (lr 1e300, eps 0, an unknown decay mode, a step counter of 2^62, a loss
// scale counter past 2^53) are refused with the state unchanged; records spliced under another
// file's header and metadata fail the trailer's chain; files of the previous format version still
// load (with the same range checks).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>

#include "optim/crc32c.hpp"
#include "optim/optim_test_util.hpp"

namespace tier::optim {
namespace {

using json = nlohmann::json;
using test::Reference;
using test::Rig;

constexpr std::size_t kHeader = 64, kRecord = 48, kTrailer = 32;

OffloadedOptimizerOptions opts() {
  OffloadedOptimizerOptions o;
  o.groups = test::three_groups();
  o.chunk_elements = 4096;
  o.buffer_count = 2;
  return o;
}

void step(OffloadedOptimizer& opt, Reference& ref, std::uint64_t s) {
  test::feed(opt, ref, s, 1, DType::kF16, GradMode::kCopy, nullptr, 1e-4f);
  ASSERT_TRUE(ref.step(1.0, 0));
  auto r = opt.step();
  ASSERT_TRUE(r.ok()) << r.status();
}

std::vector<std::uint8_t> slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void dump(const std::string& p, const std::vector<std::uint8_t>& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

template <class T>
T get(const std::vector<std::uint8_t>& b, std::size_t at) {
  T v;
  std::memcpy(&v, b.data() + at, sizeof v);
  return v;
}
template <class T>
void put(std::vector<std::uint8_t>& b, std::size_t at, T v) {
  std::memcpy(b.data() + at, &v, sizeof v);
}

// A checkpoint taken apart (fp32 state: each record's payload is 12 bytes an element) and put
// back together with every checksum valid, as someone crafting a file would (docs/optimizer.md).
struct Parts {
  std::vector<std::uint8_t> header;
  json meta;
  std::vector<std::vector<std::uint8_t>> records;  // 48-byte header and payload
  std::vector<std::uint8_t> trailer;

  static Parts of(const std::vector<std::uint8_t>& b) {
    Parts p;
    p.header.assign(b.begin(), b.begin() + kHeader);
    const auto meta_bytes = get<std::uint64_t>(b, 16);
    p.meta = json::parse(b.begin() + kHeader, b.begin() + static_cast<std::ptrdiff_t>(kHeader + meta_bytes));
    EXPECT_EQ(p.meta["state_dtype"], "fp32");
    std::size_t at = kHeader + meta_bytes;
    while (at + kTrailer < b.size()) {
      const std::size_t len = kRecord + 12 * get<std::uint64_t>(b, at + 16);
      p.records.emplace_back(b.begin() + static_cast<std::ptrdiff_t>(at),
                             b.begin() + static_cast<std::ptrdiff_t>(at + len));
      at += len;
    }
    p.trailer.assign(b.begin() + static_cast<std::ptrdiff_t>(at), b.end());
    EXPECT_EQ(p.trailer.size(), kTrailer);
    return p;
  }

  std::uint32_t version() const { return get<std::uint32_t>(header, 8); }

  // With valid checksums for `version` (the chain seeded with the header from version 4 on).
  std::vector<std::uint8_t> bytes(std::uint32_t version) const {
    std::vector<std::uint8_t> h = header;
    json m = meta;
    m["version"] = version;
    const std::string text = m.dump();
    put<std::uint32_t>(h, 8, version);
    put<std::uint64_t>(h, 16, text.size());
    put<std::uint32_t>(h, 40, detail::crc32c(text.data(), text.size()));
    put<std::uint32_t>(h, 60, detail::crc32c(h.data(), 60));
    std::vector<std::uint8_t> out = h;
    out.insert(out.end(), text.begin(), text.end());
    // Version 4: the header and each record header without their own CRCs; before, whole record
    // headers (a CRC followed by its own CRC is a constant: that chain only counted records).
    std::uint32_t chain = version >= 4 ? detail::crc32c(h.data(), kHeader - 4) : 0;
    for (const auto& r : records) {
      chain = detail::crc32c_extend(chain, r.data(), version >= 4 ? kRecord - 4 : kRecord);
      out.insert(out.end(), r.begin(), r.end());
    }
    std::vector<std::uint8_t> t = trailer;
    put<std::uint32_t>(t, 24, chain);
    put<std::uint32_t>(t, 28, detail::crc32c(t.data(), 28));
    out.insert(out.end(), t.begin(), t.end());
    return out;
  }
  std::vector<std::uint8_t> bytes() const { return bytes(version()); }
};

class OptimizerCheckpointUntrusted : public testing::TestWithParam<test::Home> {
 protected:
  void SetUp() override {
    if (auto why = test::home_unavailable(GetParam()); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(OptimizerCheckpointUntrusted, CraftedValuesWithValidChecksumsAreRefusedAndChangeNothing) {
  Rig a(GetParam(), opts());
  ASSERT_TRUE(a.status().ok()) << a.status();
  Reference ref(test::mixed_model(), test::three_groups(), 71);
  ASSERT_TRUE(a.register_model(ref, 71).ok());
  step(a.opt(), ref, 1);
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt");
  ASSERT_TRUE(dir.ok());
  const std::string good = dir.sub("good.ckpt");
  ASSERT_TRUE(a.opt().save_checkpoint(good).ok());
  step(a.opt(), ref, 2);  // the state moves on; a refused load must leave it here
  const Parts parts = Parts::of(slurp(good));

  const std::vector<std::pair<std::string, std::function<void(json&)>>> edits = {
      {"lr 1e300", [](json& m) { m["groups"][0]["lr"] = 1e300; }},
      {"eps 0", [](json& m) { m["groups"][0]["eps"] = 0.0; }},
      {"unknown decay mode", [](json& m) { m["groups"][1]["decay_mode"] = "sideways"; }},
      {"step 2^62", [](json& m) { m["groups"][2]["step"] = std::int64_t{1} << 62; }},
      {"step 2^64-1", [](json& m) { m["groups"][2]["step"] = ~std::uint64_t{0}; }},
      {"fractional step", [](json& m) { m["groups"][0]["step"] = 1.5; }},
      {"beta2 1", [](json& m) { m["groups"][0]["beta2"] = 1.0; }},
      {"weight decay 1e300", [](json& m) { m["groups"][0]["weight_decay"] = 1e300; }},
      {"loss-scale iteration 2^62", [](json& m) { m["loss_scale"]["iteration"] = std::int64_t{1} << 62; }},
      {"hysteresis 1e300", [](json& m) { m["loss_scale"]["hysteresis_left"] = 1e300; }},
  };
  const std::string bad = dir.sub("crafted.ckpt");
  const std::int64_t iteration = a.opt().loss_scaler().state().iteration;
  for (const auto& [what, edit] : edits) {
    Parts p = parts;
    edit(p.meta);
    dump(bad, p.bytes());
    const Status s = a.opt().load_checkpoint(bad);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << what << ": " << s;
    EXPECT_EQ(*a.opt().group_step(0), 2) << what;
    EXPECT_EQ(*a.opt().group_step(2), 2) << what;
    EXPECT_EQ(a.opt().hyper_params(0)->lr, test::three_groups()[0].lr) << what;
    EXPECT_EQ(a.opt().hyper_params(1)->decay_mode, test::three_groups()[1].decay_mode) << what;
    EXPECT_EQ(a.opt().loss_scaler().state().iteration, iteration) << what;
    ASSERT_TRUE(test::state_matches(a.opt(), ref)) << what;
  }
  // The untouched file, put back together the same way, loads: the rewriting is not the refusal.
  dump(bad, parts.bytes());
  ASSERT_TRUE(a.opt().load_checkpoint(bad).ok());
  EXPECT_EQ(*a.opt().group_step(0), 1);
}

INSTANTIATE_TEST_SUITE_P(Homes, OptimizerCheckpointUntrusted, testing::ValuesIn(test::all_homes()), test::home_name);

const test::Home kHostHome{"host", StateHome::kHost, IoEngineKind::kAuto, false};

// Two checkpoints of one model: the header and metadata (step counters, hyper-parameters) of the
// first over the records and trailer of the second. Every record and the trailer are intact, and
// the old chain only counted the records, so this loaded a mix of the two.
TEST(OptimizerCheckpointChain, RecordsSplicedUnderAnotherFilesHeaderAreRefused) {
  Rig a(kHostHome, opts());
  ASSERT_TRUE(a.status().ok());
  Reference ref(test::mixed_model(), test::three_groups(), 81);
  ASSERT_TRUE(a.register_model(ref, 81).ok());
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt");
  step(a.opt(), ref, 1);
  ASSERT_TRUE(a.opt().save_checkpoint(dir.sub("one.ckpt")).ok());
  step(a.opt(), ref, 2);
  ASSERT_TRUE(a.opt().save_checkpoint(dir.sub("two.ckpt")).ok());
  step(a.opt(), ref, 3);

  const std::vector<std::uint8_t> one = slurp(dir.sub("one.ckpt")), two = slurp(dir.sub("two.ckpt"));
  const auto meta_one = get<std::uint64_t>(one, 16), meta_two = get<std::uint64_t>(two, 16);
  std::vector<std::uint8_t> spliced(one.begin(), one.begin() + static_cast<std::ptrdiff_t>(kHeader + meta_one));
  spliced.insert(spliced.end(), two.begin() + static_cast<std::ptrdiff_t>(kHeader + meta_two), two.end());
  dump(dir.sub("spliced.ckpt"), spliced);
  const Status s = a.opt().load_checkpoint(dir.sub("spliced.ckpt"));
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("chained checksum"), std::string::npos) << s;
  EXPECT_EQ(*a.opt().group_step(0), 3);
  EXPECT_TRUE(test::state_matches(a.opt(), ref));
}

// One record's payload replaced and its section checksums and header checksum redone (what a
// crafted file does): the old chain, which only counted records, let it through.
TEST(OptimizerCheckpointChain, ARecordRewrittenWithValidChecksumsFailsTheChain) {
  Rig a(kHostHome, opts());
  ASSERT_TRUE(a.status().ok());
  Reference ref(test::mixed_model(), test::three_groups(), 85);
  ASSERT_TRUE(a.register_model(ref, 85).ok());
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt");
  step(a.opt(), ref, 1);
  ASSERT_TRUE(a.opt().save_checkpoint(dir.sub("good.ckpt")).ok());
  step(a.opt(), ref, 2);

  const std::vector<std::uint8_t> good = slurp(dir.sub("good.ckpt"));
  Parts p = Parts::of(good);
  ASSERT_GE(p.records.size(), 2u);
  std::vector<std::uint8_t>& r = p.records[1];
  const auto count = get<std::uint64_t>(r, 16);
  for (std::uint64_t i = 0; i < count; ++i) put<float>(r, kRecord + 4 * i, 1e6f);  // its masters
  put<std::uint32_t>(r, 24, detail::crc32c(r.data() + kRecord, 4 * count));
  put<std::uint32_t>(r, 44, detail::crc32c(r.data(), 44));
  std::vector<std::uint8_t> crafted = p.bytes();
  // The trailer as the writer left it: only the record changed.
  std::copy(good.end() - kTrailer, good.end(), crafted.end() - kTrailer);
  dump(dir.sub("crafted.ckpt"), crafted);
  const Status s = a.opt().load_checkpoint(dir.sub("crafted.ckpt"));
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_TRUE(test::state_matches(a.opt(), ref));
}

// Files of version 3 (the chain over the records alone) still load, and get the same range
// checks as new ones.
TEST(OptimizerCheckpointChain, VersionThreeFilesStillLoadWithTheSameChecks) {
  Rig a(kHostHome, opts());
  ASSERT_TRUE(a.status().ok());
  Reference ref(test::mixed_model(), test::three_groups(), 91);
  ASSERT_TRUE(a.register_model(ref, 91).ok());
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt");
  step(a.opt(), ref, 1);
  ASSERT_TRUE(a.opt().save_checkpoint(dir.sub("new.ckpt")).ok());
  Reference saved = ref;
  step(a.opt(), ref, 2);

  Parts p = Parts::of(slurp(dir.sub("new.ckpt")));
  EXPECT_EQ(p.version(), 4u);
  dump(dir.sub("v3.ckpt"), p.bytes(3));
  ASSERT_TRUE(a.opt().load_checkpoint(dir.sub("v3.ckpt")).ok());
  EXPECT_EQ(*a.opt().group_step(0), 1);
  EXPECT_TRUE(test::state_matches(a.opt(), saved));

  p.meta["groups"][0]["lr"] = 1e300;
  dump(dir.sub("v3-crafted.ckpt"), p.bytes(3));
  EXPECT_EQ(a.opt().load_checkpoint(dir.sub("v3-crafted.ckpt")).code(), StatusCode::kDataLoss);
  // A version-4 file is not accepted with a version-3 chain (nor the other way round).
  Parts q = Parts::of(slurp(dir.sub("new.ckpt")));
  std::vector<std::uint8_t> wrong = q.bytes(3);
  put<std::uint32_t>(wrong, 8, 4u);
  put<std::uint32_t>(wrong, 60, detail::crc32c(wrong.data(), 60));
  dump(dir.sub("mixed.ckpt"), wrong);
  EXPECT_EQ(a.opt().load_checkpoint(dir.sub("mixed.ckpt")).code(), StatusCode::kDataLoss);
  EXPECT_TRUE(test::state_matches(a.opt(), saved));
}

// Read alone (read_checkpoint_masters, which tier.torch.zero_to_fp32 uses), a file gets the same
// checks with nothing to compare its partitions with: crafted metadata, partitions that disagree
// with the header or name no group, and records spliced or rewritten with valid checksums are
// kDataLoss; a version-3 file reads alone too.
TEST(OptimizerCheckpointReadAlone, CraftedFilesAreRefused) {
  Rig a(kHostHome, opts());
  ASSERT_TRUE(a.status().ok());
  Reference ref(test::mixed_model(), test::three_groups(), 97);
  ASSERT_TRUE(a.register_model(ref, 97).ok());
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt");
  step(a.opt(), ref, 1);
  ASSERT_TRUE(a.opt().save_checkpoint(dir.sub("good.ckpt")).ok());
  const Parts parts = Parts::of(slurp(dir.sub("good.ckpt")));
  auto read = [&](const std::string& file) {
    return read_checkpoint_masters(file, [](auto&&...) { return Status(); });
  };

  const std::vector<std::pair<std::string, std::function<void(json&)>>> edits = {
      {"lr 1e300", [](json& m) { m["groups"][0]["lr"] = 1e300; }},
      {"step 2^62", [](json& m) { m["groups"][2]["step"] = std::int64_t{1} << 62; }},
      {"hysteresis 1e300", [](json& m) { m["loss_scale"]["hysteresis_left"] = 1e300; }},
      {"group 3 of 3", [](json& m) { m["partitions"][1][1] = 3; }},
      {"group -1", [](json& m) { m["partitions"][1][1] = -1; }},
      {"group 2^40", [](json& m) { m["partitions"][1][1] = std::int64_t{1} << 40; }},
      {"0 elements", [](json& m) { m["partitions"][4][0] = 0; }},
      {"one element more than the header counts", [](json& m) { m["partitions"][4][0] = 6; }},
      {"a partition fewer than the header counts", [](json& m) { m["partitions"].erase(9); }},
      {"malformed partition", [](json& m) { m["partitions"][2] = "p2"; }},
  };
  const std::string bad = dir.sub("crafted.ckpt");
  for (const auto& [what, edit] : edits) {
    Parts p = parts;
    edit(p.meta);
    dump(bad, p.bytes());
    EXPECT_EQ(read_checkpoint_info(bad).status().code(), StatusCode::kDataLoss) << what;
    const Status s = read(bad);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << what << ": " << s;
  }
  // A record's masters rewritten with valid section and header checksums: the chain refuses it.
  Parts p = parts;
  ASSERT_GE(p.records.size(), 2u);
  std::vector<std::uint8_t>& r = p.records[1];
  const auto count = get<std::uint64_t>(r, 16);
  for (std::uint64_t i = 0; i < count; ++i) put<float>(r, kRecord + 4 * i, 1e6f);
  put<std::uint32_t>(r, 24, detail::crc32c(r.data() + kRecord, 4 * count));
  put<std::uint32_t>(r, 44, detail::crc32c(r.data(), 44));
  std::vector<std::uint8_t> crafted = p.bytes();
  const std::vector<std::uint8_t> good = slurp(dir.sub("good.ckpt"));
  std::copy(good.end() - kTrailer, good.end(), crafted.end() - kTrailer);
  dump(bad, crafted);
  EXPECT_EQ(read(bad).code(), StatusCode::kDataLoss);
  // Records out of order (both intact, the chain redone): each must be the next piece.
  p = parts;
  std::swap(p.records[0], p.records[1]);
  dump(bad, p.bytes());
  EXPECT_EQ(read(bad).code(), StatusCode::kDataLoss);

  // The untouched file put back together, and as version 3, read alone to the same masters.
  for (std::uint32_t version : {4u, 3u}) {
    dump(bad, parts.bytes(version));
    std::vector<float> got;
    const Status s =
        read_checkpoint_masters(bad, [&](const CheckpointPartition&, std::uint64_t, const float* v, std::uint64_t n) {
          got.insert(got.end(), v, v + n);
          return Status();
        });
    ASSERT_TRUE(s.ok()) << "version " << version << ": " << s;
    std::vector<float> want;
    for (std::size_t i = 0; i < ref.model().size(); ++i) {
      want.insert(want.end(), ref.master(i).begin(), ref.master(i).end());
    }
    ASSERT_EQ(got.size(), want.size());
    EXPECT_TRUE(test::same_bits(got.data(), want.data(), want.size(), str("version ", version)));
  }
}

}  // namespace
}  // namespace tier::optim
