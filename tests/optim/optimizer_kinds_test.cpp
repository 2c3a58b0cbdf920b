// Adagrad, Lion and Lamb through the offloaded optimizer: every home gives the in-RAM reference's
// state bit for bit (Lamb's two passes with partitions that span chunks and norm blocks), a
// checkpoint brings each group's kind back, and a version 1 checkpoint still loads, as Adam.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "optim/crc32c.hpp"
#include "optim/optim_test_util.hpp"

namespace tier::optim {
namespace {

using test::feed;
using test::Home;
using test::PartDesc;
using test::Reference;
using test::Rig;

// Group 0 Lamb (its partitions span chunks, one spans two 64 Ki norm blocks), 1 Lion, 2 Adagrad,
// 3 Lamb without bias correction and with a tight clamp.
std::vector<cpu::AdamHyperParams> kind_groups() {
  cpu::AdamHyperParams lamb = cpu::default_hyper_params(cpu::OptimizerKind::kLamb);
  lamb.lr = 1e-2;
  lamb.weight_decay = 0.01;
  cpu::AdamHyperParams lion = cpu::default_hyper_params(cpu::OptimizerKind::kLion);
  lion.lr = 1e-3;
  lion.weight_decay = 0.1;
  cpu::AdamHyperParams adagrad = cpu::default_hyper_params(cpu::OptimizerKind::kAdagrad);
  adagrad.weight_decay = 0.05;
  cpu::AdamHyperParams lamb2 = lamb;
  lamb2.bias_correction = false;
  lamb2.min_coeff = 0.2;
  lamb2.max_coeff = 0.3;
  return {lamb, lion, adagrad, lamb2};
}

std::vector<PartDesc> kind_model() {
  return {{3000, 0, ParamOutput::kBF16}, {17, 1, ParamOutput::kF16},     {140000, 0, ParamOutput::kF16},
          {5, 2, ParamOutput::kNone},    {1024, 3, ParamOutput::kF32},   {7777, 2, ParamOutput::kBF16},
          {3, 0, ParamOutput::kBF16},    {20000, 1, ParamOutput::kNone}, {9000, 3, ParamOutput::kBF16},
          {1, 3, ParamOutput::kNone},    {2500, 0, ParamOutput::kNone}};
}

OffloadedOptimizerOptions opts(std::uint64_t chunk, unsigned buffers) {
  OffloadedOptimizerOptions o;
  o.groups = kind_groups();
  o.chunk_elements = chunk;
  o.buffer_count = buffers;
  o.max_grad_norm = 0.5;
  return o;
}

// Steps first..last; partition 10 gets no gradient in odd steps (a zero-gradient Lamb update).
void run_steps(OffloadedOptimizer& opt, Reference& ref, std::uint64_t first, std::uint64_t last) {
  for (std::uint64_t step = first; step <= last; ++step) {
    for (std::size_t i = 0; i < ref.model().size(); ++i) {
      if (i == 10 && step % 2 == 1) continue;
      const std::uint64_t n = ref.model()[i].numel;
      auto g = test::make_grad(n, DType::kBF16, test::grad_seed(step, 0, i));
      ASSERT_TRUE(opt.add_grad(static_cast<PartitionId>(i), cpu::ConstTensorRef(g.data(), DType::kBF16, n)).ok());
      ref.add_grad(i, g.data(), DType::kBF16);
    }
    ASSERT_TRUE(ref.step(1.0, 0.5));
    auto r = opt.step();
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(r->applied);
  }
}

class OptimizerKinds : public testing::TestWithParam<Home> {
 protected:
  void SetUp() override {
    if (auto why = test::home_unavailable(GetParam()); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(OptimizerKinds, EveryKindMatchesTheInRamReferenceForAnyChunking) {
  for (auto [chunk, buffers] : {std::pair<std::uint64_t, unsigned>{2048, 3}, {7168, 1}, {65536, 4}}) {
    SCOPED_TRACE(str("chunk ", chunk, ", buffers ", buffers));
    Rig rig(GetParam(), opts(chunk, buffers));
    ASSERT_TRUE(rig.status().ok()) << rig.status();
    Reference ref(kind_model(), kind_groups(), 5);
    ASSERT_TRUE(rig.register_model(ref, 5).ok());
    run_steps(rig.opt(), ref, 1, 4);
    ASSERT_TRUE(test::state_matches(rig.opt(), ref));
  }
}

TEST_P(OptimizerKinds, LambReadsTheStateTwicePerStep) {
  if (GetParam().home != StateHome::kNvme) GTEST_SKIP() << "host home has no reads";
  Rig rig(GetParam(), opts(4096, 3));
  ASSERT_TRUE(rig.status().ok()) << rig.status();
  Reference ref(kind_model(), kind_groups(), 5);
  ASSERT_TRUE(rig.register_model(ref, 5).ok());
  for (std::size_t i = 0; i < ref.model().size(); ++i) {
    auto g = test::make_grad(ref.model()[i].numel, DType::kF32, i);
    ASSERT_TRUE(
        rig.opt()
            .add_grad(static_cast<PartitionId>(i), cpu::ConstTensorRef(g.data(), DType::kF32, ref.model()[i].numel))
            .ok());
  }
  auto r = rig.opt().step();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->read.bytes, 2 * r->write.bytes);
}

TEST_P(OptimizerKinds, CheckpointRoundTripKeepsEveryKind) {
  Rig a(GetParam(), opts(2048, 3));
  ASSERT_TRUE(a.status().ok()) << a.status();
  Reference ref(kind_model(), kind_groups(), 11);
  ASSERT_TRUE(a.register_model(ref, 11).ok());
  run_steps(a.opt(), ref, 1, 3);
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt-kinds");
  ASSERT_TRUE(dir.ok());
  const std::string file = dir.sub("opt.ckpt");
  ASSERT_TRUE(a.opt().save_checkpoint(file).ok());

  // Into an optimizer whose groups are all plain Adam: the file's kinds replace them.
  OffloadedOptimizerOptions o = opts(4096, 2);
  o.groups.assign(4, cpu::AdamHyperParams{});
  Rig b(GetParam(), o);
  ASSERT_TRUE(b.status().ok()) << b.status();
  Reference fresh(kind_model(), o.groups, 99);
  ASSERT_TRUE(b.register_model(fresh, 99).ok());
  ASSERT_TRUE(b.opt().load_checkpoint(file).ok());
  const auto want = kind_groups();
  for (int g = 0; g < 4; ++g) {
    const auto hp = b.opt().hyper_params(g).value();
    EXPECT_EQ(hp.kind, want[static_cast<std::size_t>(g)].kind) << "group " << g;
    EXPECT_EQ(hp.min_coeff, want[static_cast<std::size_t>(g)].min_coeff) << "group " << g;
    EXPECT_EQ(hp.max_coeff, want[static_cast<std::size_t>(g)].max_coeff) << "group " << g;
    EXPECT_EQ(hp.eps, want[static_cast<std::size_t>(g)].eps) << "group " << g;
    EXPECT_EQ(*b.opt().group_step(g), 3);
  }
  ASSERT_TRUE(test::state_matches(b.opt(), ref));
  Reference cont = ref;
  run_steps(b.opt(), cont, 4, 5);
  ASSERT_TRUE(test::state_matches(b.opt(), cont));
}

// A failed read in Lamb's norms pass, or a failed write in its update pass: the step is not
// applied, the state and gradients stay, and the retry equals the reference's step.
TEST_P(OptimizerKinds, LambStepFailingInEitherPassKeepsTheStateAndRetries) {
  if (GetParam().home != StateHome::kNvme) GTEST_SKIP() << "host home has no I/O to fail";
  Rig rig(GetParam(), opts(2048, 3));
  ASSERT_TRUE(rig.status().ok()) << rig.status();
  Reference ref(kind_model(), kind_groups(), 13);
  ASSERT_TRUE(rig.register_model(ref, 13).ok());
  run_steps(rig.opt(), ref, 1, 1);
  std::uint64_t failed = 0;
  for (nvme::IoOp op : {nvme::IoOp::kRead, nvme::IoOp::kWrite}) {
    SCOPED_TRACE(op == nvme::IoOp::kRead ? "read in pass 1" : "write in pass 2");
    const std::uint64_t step = failed + 2;
    for (std::size_t i = 0; i < ref.model().size(); ++i) {
      const std::uint64_t n = ref.model()[i].numel;
      auto g = test::make_grad(n, DType::kF32, test::grad_seed(step, 0, i));
      ASSERT_TRUE(rig.opt().add_grad(static_cast<PartitionId>(i), cpu::ConstTensorRef(g.data(), DType::kF32, n)).ok());
      ref.add_grad(i, g.data(), DType::kF32);
    }
    rig.faults()->fail_nth(3, EIO, op);  // pass 1 only reads, so a failed write is in pass 2
    auto r = rig.opt().step();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kIoError) << r.status();
    EXPECT_NE(r.status().message().find("was not applied"), std::string::npos) << r.status();
    EXPECT_EQ(r.status().message().find("lamb norms pass") != std::string::npos, op == nvme::IoOp::kRead) << r.status();
    EXPECT_EQ(*rig.opt().group_step(0), static_cast<std::int64_t>(step - 1));
    EXPECT_EQ(rig.opt().stats().steps_failed, ++failed);
    EXPECT_EQ(rig.opt().partitions_with_grads(), ref.model().size());
    rig.faults()->clear_faults();
    ASSERT_TRUE(test::state_matches(rig.opt(), ref));  // the reference has not stepped yet
    ASSERT_TRUE(ref.step(1.0, 0.5));
    auto again = rig.opt().step();
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_TRUE(test::state_matches(rig.opt(), ref));
  }
}

INSTANTIATE_TEST_SUITE_P(Homes, OptimizerKinds, testing::ValuesIn(test::all_homes()), test::home_name);

// Rewrites a checkpoint of fp32 state as version 1 wrote it: no kind or coefficients in the
// groups and no state dtype (blanked to JSON whitespace), version 1, records with 40-byte headers
// (three section checksums; an fp32 payload is the same), checksums and the trailer's chain redone.
void make_version_1(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  ASSERT_GT(bytes.size(), 64u);
  std::uint64_t meta_size = 0;
  std::memcpy(&meta_size, bytes.data() + 16, 8);
  std::string meta = bytes.substr(64, meta_size);
  auto blank_key = [&](const std::string& key) {
    for (std::size_t at = meta.find("\"" + key + "\":"); at != std::string::npos; at = meta.find("\"" + key + "\":")) {
      std::size_t end = meta.find_first_of(",}", at);
      if (meta[end] == ',') ++end;
      for (std::size_t k = at; k < end; ++k) meta[k] = ' ';
    }
  };
  ASSERT_NE(meta.find("\"state_dtype\":\"fp32\""), std::string::npos) << meta;
  blank_key("kind");
  blank_key("max_coeff");
  blank_key("min_coeff");
  blank_key("state_dtype");
  const std::size_t v = meta.find("\"version\":4");
  ASSERT_NE(v, std::string::npos) << meta;
  meta[v + 10] = '1';
  std::string out = bytes.substr(0, 64) + meta;
  const std::uint32_t one = 1, meta_crc = detail::crc32c(meta.data(), meta.size());
  std::memcpy(out.data() + 8, &one, 4);
  std::memcpy(out.data() + 40, &meta_crc, 4);
  const std::uint32_t header_crc = detail::crc32c(out.data(), 60);
  std::memcpy(out.data() + 60, &header_crc, 4);
  std::size_t pos = 64 + meta_size;
  std::uint32_t chain = 0;
  while (pos + 32 < bytes.size()) {
    ASSERT_EQ(bytes.compare(pos, 4, "TREC"), 0) << "record at byte " << pos;
    std::uint64_t count = 0;
    std::memcpy(&count, bytes.data() + pos + 16, 8);
    std::string h = bytes.substr(pos, 36);
    const std::uint32_t crc = detail::crc32c(h.data(), 36);
    h.append(reinterpret_cast<const char*>(&crc), 4);
    chain = detail::crc32c_extend(chain, h.data(), h.size());
    out += h;
    out += bytes.substr(pos + 48, 12 * count);
    pos += 48 + 12 * count;
  }
  std::string trailer = bytes.substr(pos, 32);
  ASSERT_EQ(trailer.size(), 32u);
  std::memcpy(trailer.data() + 24, &chain, 4);
  const std::uint32_t tcrc = detail::crc32c(trailer.data(), 28);
  std::memcpy(trailer.data() + 28, &tcrc, 4);
  out += trailer;
  std::ofstream o(file, std::ios::binary | std::ios::trunc);
  o.write(out.data(), static_cast<std::streamsize>(out.size()));
}

TEST(OptimizerKindsCheckpoint, Version1CheckpointLoadsAsAdam) {
  const Home host{"host", StateHome::kHost, IoEngineKind::kAuto, false};
  OffloadedOptimizerOptions o;
  o.groups = test::three_groups();
  o.chunk_elements = 2048;
  Rig a(host, o);
  ASSERT_TRUE(a.status().ok()) << a.status();
  Reference ref(test::mixed_model(), test::three_groups(), 3);
  ASSERT_TRUE(a.register_model(ref, 3).ok());
  for (std::uint64_t step = 1; step <= 2; ++step) {
    feed(a.opt(), ref, step, 1, DType::kF32, GradMode::kCopy);
    ASSERT_TRUE(ref.step(1.0, 0));
    ASSERT_TRUE(a.opt().step().ok());
  }
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt-v1");
  ASSERT_TRUE(dir.ok());
  const std::string file = dir.sub("opt.ckpt");
  ASSERT_TRUE(a.opt().save_checkpoint(file).ok());
  make_version_1(file);
  if (HasFatalFailure()) return;

  // Loaded into an optimizer whose groups are Lamb: a version 1 file says Adam.
  o.groups.assign(3, cpu::default_hyper_params(cpu::OptimizerKind::kLamb));
  Rig b(host, o);
  ASSERT_TRUE(b.status().ok()) << b.status();
  Reference fresh(test::mixed_model(), o.groups, 8);
  ASSERT_TRUE(b.register_model(fresh, 8).ok());
  const Status s = b.opt().load_checkpoint(file);
  ASSERT_TRUE(s.ok()) << s;
  for (int g = 0; g < 3; ++g) EXPECT_EQ(b.opt().hyper_params(g)->kind, cpu::OptimizerKind::kAdam) << "group " << g;
  EXPECT_EQ(b.opt().hyper_params(1)->decay_mode, cpu::WeightDecayMode::kL2);
  ASSERT_TRUE(test::state_matches(b.opt(), ref));
  feed(b.opt(), ref, 3, 1, DType::kF32, GradMode::kCopy);
  ASSERT_TRUE(ref.step(1.0, 0));
  ASSERT_TRUE(b.opt().step().ok());
  ASSERT_TRUE(test::state_matches(b.opt(), ref));
}

TEST(OptimizerKindsOptions, FromConfigSelectsTheKindAndItsParams) {
  auto cfg = EngineConfig::from_json(R"({"optimizer": {"type": "Lamb", "params": {"lr": 2e-3, "betas": [0.8, 0.9],
                                          "weight_decay": 0.01, "max_coeff": 0.3, "min_coeff": 0.05,
                                          "bias_correction": false}}})",
                                     {false, false});
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto o = OffloadedOptimizerOptions::from_config(*cfg);
  ASSERT_TRUE(o.ok()) << o.status();
  const cpu::AdamHyperParams& hp = o->groups[0];
  EXPECT_EQ(hp.kind, cpu::OptimizerKind::kLamb);
  EXPECT_EQ(hp.lr, 2e-3);
  EXPECT_EQ(hp.beta2, 0.9);
  EXPECT_EQ(hp.max_coeff, 0.3);
  EXPECT_EQ(hp.min_coeff, 0.05);
  EXPECT_FALSE(hp.bias_correction);
  for (auto [type, kind, mode] : {std::tuple{"Adagrad", cpu::OptimizerKind::kAdagrad, cpu::WeightDecayMode::kL2},
                                  std::tuple{"lion", cpu::OptimizerKind::kLion, cpu::WeightDecayMode::kDecoupled},
                                  std::tuple{"AdamW", cpu::OptimizerKind::kAdam, cpu::WeightDecayMode::kDecoupled}}) {
    auto c = EngineConfig::from_json(str(R"({"optimizer": {"type": ")", type, R"("}})"), {false, false});
    ASSERT_TRUE(c.ok()) << c.status();
    auto k = OffloadedOptimizerOptions::from_config(*c);
    ASSERT_TRUE(k.ok()) << k.status();
    EXPECT_EQ(k->groups[0].kind, kind) << type;
    EXPECT_EQ(k->groups[0].decay_mode, mode) << type;
    EXPECT_TRUE(k->groups[0].validate().ok()) << type;
  }
}

}  // namespace
}  // namespace tier::optim
