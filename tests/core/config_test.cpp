#include "tier/config.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

namespace tier {
namespace {

using json = nlohmann::json;

Result<EngineConfig> parse(const std::string& text, bool strict = false) {
  ConfigOptions o;
  o.apply_env = false;
  o.strict = strict;
  return EngineConfig::from_json(text, o);
}

bool has_note(const EngineConfig& c, const std::string& needle) {
  return std::any_of(c.notes.begin(), c.notes.end(),
                     [&](const std::string& n) { return n.find(needle) != std::string::npos; });
}

bool has_auto(const EngineConfig& c, const std::string& key) {
  return std::find(c.auto_keys.begin(), c.auto_keys.end(), key) != c.auto_keys.end();
}

TEST(EngineConfig, EmptyConfigGivesTheDocumentedDefaults) {
  auto c = parse("{}");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->zero_stage, 0);
  EXPECT_EQ(c->offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(c->offload_param.buffer_count, 5);
  EXPECT_EQ(c->offload_param.buffer_size, 100000000u);
  EXPECT_EQ(c->offload_optimizer.buffer_count, 4);
  EXPECT_EQ(c->aio.block_size, 1u << 20);
  EXPECT_EQ(c->aio.queue_depth, 8);
  EXPECT_EQ(c->aio.intra_op_parallelism, 1);
  EXPECT_EQ(c->optimizer.type, OptimizerType::kAdamW);
  EXPECT_DOUBLE_EQ(c->optimizer.weight_decay, 0.01);
  EXPECT_EQ(c->gradient_accumulation_steps, 1);
  EXPECT_EQ(c->tier.io.engine, IoEngineKind::kAuto);
  EXPECT_EQ(c->tier.device, DeviceKind::kAuto);
  // The one note: without an optimizer section the client must pass one (nothing is guessed).
  ASSERT_EQ(c->notes.size(), 1u) << c->notes[0];
  EXPECT_NE(c->notes[0].find("optimizer: no section"), std::string::npos) << c->notes[0];
}

TEST(EngineConfig, HuggingFaceZero3NvmeConfigCarriesOver) {
  auto c = EngineConfig::from_file(TIER_TEST_DATA_DIR "/hf_zero3_nvme.json", {.apply_env = false});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->zero_stage, 3);
  EXPECT_EQ(c->offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(c->offload_param.nvme_path, "/local_nvme");
  EXPECT_EQ(c->offload_param.buffer_size, 100000000u);
  EXPECT_EQ(c->offload_param.max_in_cpu, 1000000000u);
  EXPECT_TRUE(c->offload_param.pin_memory);
  EXPECT_EQ(c->offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(c->aio.block_size, 262144u);
  EXPECT_EQ(c->aio.queue_depth, 32);
  EXPECT_EQ(c->aio.intra_op_parallelism, 1);
  // "auto" resolves to Hugging Face Trainer's defaults and is listed for the adapter.
  EXPECT_DOUBLE_EQ(c->optimizer.lr, 5e-5);
  EXPECT_DOUBLE_EQ(c->optimizer.beta2, 0.999);
  EXPECT_DOUBLE_EQ(c->optimizer.weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(c->gradient_clipping, 1.0);
  EXPECT_EQ(c->gradient_accumulation_steps, 1);
  EXPECT_FALSE(c->fp16.enabled);
  EXPECT_FALSE(c->bf16);
  for (const char* k : {"optimizer.params.lr", "fp16.enabled", "bf16.enabled", "gradient_clipping",
                        "zero_optimization.stage3_prefetch_bucket_size", "train_batch_size"}) {
    EXPECT_TRUE(has_auto(*c, k)) << k;
  }
  // Keys tier does not act on are accepted with one note each.
  for (const char* k : {"zero_optimization.overlap_comm:", "zero_optimization.stage3_max_reuse_distance:",
                        "steps_per_print:", "zero_optimization.offload_optimizer.fast_init:"}) {
    EXPECT_TRUE(has_note(*c, k)) << k;
  }
  EXPECT_EQ(std::count_if(c->notes.begin(), c->notes.end(),
                          [](const std::string& n) { return n.rfind("zero_optimization.overlap_comm:", 0) == 0; }),
            1);
  // The scheduler is kept as given for the adapter.
  EXPECT_EQ(json::parse(c->scheduler_json)["type"], "WarmupLR");
  EXPECT_EQ(c->resolved_swap_paths(), std::vector<std::string>{"/local_nvme"});
}

TEST(EngineConfig, ThreadCountIsTheOldNameOfIntraOpParallelism) {
  auto c = parse(R"({"aio": {"thread_count": 4}})");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->aio.intra_op_parallelism, 4);
  EXPECT_TRUE(parse(R"({"aio": {"thread_count": 2, "intra_op_parallelism": 2}})").ok());
  auto clash = parse(R"({"aio": {"thread_count": 2, "intra_op_parallelism": 4}})");
  ASSERT_FALSE(clash.ok());
  EXPECT_NE(clash.status().message().find("aio.thread_count"), std::string::npos);
  EXPECT_NE(clash.status().message().find("aio.intra_op_parallelism"), std::string::npos);
}

TEST(EngineConfig, Stage3KnobsAcceptBothNames) {
  auto c = parse(R"({"zero_optimization": {"stage3_max_live_parameters": 1e9, "max_reuse_distance": 5}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(has_note(*c, "zero_optimization.stage3_max_live_parameters:"));
  EXPECT_TRUE(has_note(*c, "zero_optimization.max_reuse_distance:"));
}

TEST(EngineConfig, NvmeOffloadWithoutAPathNamesTheKeyAndTheFix) {
  auto c = parse(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("zero_optimization.offload_param.nvme_path"), std::string::npos);
  EXPECT_NE(c.status().message().find("directory on an SSD"), std::string::npos);
  // tier.swap_paths is an accepted substitute.
  EXPECT_TRUE(parse(R"({"zero_optimization": {"offload_optimizer": {"device": "nvme"}},
                        "tier": {"swap_paths": ["/a", "/b"]}})")
                  .ok());
}

TEST(EngineConfig, Fp16AndBf16ExcludeEachOther) {
  auto c = parse(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("fp16.enabled"), std::string::npos);
  EXPECT_NE(c.status().message().find("bf16.enabled"), std::string::npos);
  auto alias = parse(R"({"bfloat16": {"enabled": true}})");
  ASSERT_TRUE(alias.ok());
  EXPECT_TRUE(alias->bf16);
}

TEST(EngineConfig, AdamAndAdamWWeightDecay) {
  auto adam = parse(R"({"optimizer": {"type": "Adam", "params": {"lr": 0.001}}})");
  ASSERT_TRUE(adam.ok());
  EXPECT_EQ(adam->optimizer.type, OptimizerType::kAdam);
  EXPECT_DOUBLE_EQ(adam->optimizer.weight_decay, 0.0);
  EXPECT_TRUE(adam->optimizer.decoupled_weight_decay) << "DeepSpeed's Adam defaults to adam_w_mode";
  auto l2 = parse(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false, "weight_decay": 0.1}}})");
  ASSERT_TRUE(l2.ok());
  EXPECT_FALSE(l2->optimizer.decoupled_weight_decay);
  EXPECT_DOUBLE_EQ(l2->optimizer.weight_decay, 0.1);
  auto adamw = parse(R"({"optimizer": {"type": "adamw", "params": {"adam_w_mode": false}}})");
  ASSERT_TRUE(adamw.ok());
  EXPECT_TRUE(adamw->optimizer.decoupled_weight_decay);
  EXPECT_TRUE(has_note(*adamw, "adam_w_mode"));
  auto other = parse(R"({"optimizer": {"type": "Shampoo"}})");
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("adam, adamw"), std::string::npos) << other.status();
  auto ams = parse(R"({"optimizer": {"type": "Adam", "params": {"amsgrad": true}}})");
  ASSERT_FALSE(ams.ok());
  EXPECT_NE(ams.status().message().find("AMSGrad"), std::string::npos);
}

TEST(EngineConfig, LegacyCpuOffloadFlags) {
  auto c = parse(R"({"zero_optimization": {"stage": 2, "cpu_offload": true, "cpu_offload_use_pin_memory": true}})");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_TRUE(c->offload_optimizer.pin_memory);
  EXPECT_EQ(c->offload_param.device, OffloadDevice::kNone);
  auto p = parse(R"({"zero_optimization": {"stage": 3, "cpu_offload_params": true}})");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->offload_param.device, OffloadDevice::kCpu);
}

TEST(EngineConfig, ParamOffloadBelowStage3IsNoted) {
  auto c = parse(R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(has_note(*c, "needs stage 3"));
}

TEST(EngineConfig, TierSectionSizesAndChoices) {
  auto c = parse(R"({"tier": {"budgets": {"device": "8G", "host": "16GiB", "nvme": 1000000},
                              "device": "EMULATED", "io_engine": "posix", "swap_paths": "/ssd0",
                              "prefetch": {"lookahead": 3, "max_inflight_bytes": "256M"},
                              "emulated": {"h2d_bytes_per_second": "4GB", "latency_us": 2.5}}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->tier.device_budget, 8ull << 30);
  EXPECT_EQ(c->tier.host_budget, 16ull << 30);
  EXPECT_EQ(c->tier.nvme_budget, 1000000u);
  EXPECT_EQ(c->tier.device, DeviceKind::kEmulated);
  EXPECT_EQ(c->tier.io.engine, IoEngineKind::kPosix);
  EXPECT_EQ(c->tier.swap_paths, std::vector<std::string>{"/ssd0"});
  EXPECT_EQ(c->tier.prefetch.lookahead, 3);
  EXPECT_EQ(c->tier.prefetch.max_inflight_bytes, 256ull << 20);
  EXPECT_EQ(c->tier.emulated.h2d_bytes_per_second, 4000000000ull);
  EXPECT_DOUBLE_EQ(c->tier.emulated.latency_us, 2.5);
}

TEST(EngineConfig, UnknownKeysAreReportedAndStrictMakesThemErrors) {
  auto c = parse(R"({"zero_optimisation": {"stage": 3}})");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(has_note(*c, "did you mean 'zero_optimization'?"));
  auto strict = parse(R"({"tier": {"strict": true}, "zero_optimisation": {}})");
  ASSERT_FALSE(strict.ok());
  EXPECT_NE(strict.status().message().find("zero_optimisation"), std::string::npos);
  auto in_tier = parse(R"({"tier": {"budgets": {"devcie": "1G"}}})");
  ASSERT_FALSE(in_tier.ok());
  EXPECT_NE(in_tier.status().message().find("did you mean 'tier.budgets.device'?"), std::string::npos);
  auto far = parse(R"({"completely_unrelated": 1})");
  ASSERT_TRUE(far.ok());
  EXPECT_TRUE(has_note(*far, "'completely_unrelated' is not known"));
}

TEST(EngineConfig, BadJsonAndBadFilesSayWhere) {
  auto c = parse(R"({"aio": {"block_size": 4096,}})");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("not valid JSON"), std::string::npos);
  EXPECT_NE(c.status().message().find("line 1"), std::string::npos) << c.status();
  auto f = EngineConfig::from_file("/nonexistent/tier.json");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
  EXPECT_NE(f.status().message().find("/nonexistent/tier.json"), std::string::npos);
  EXPECT_FALSE(parse("42").ok());
  // Comments are tolerated, as many hand-kept configs have them.
  EXPECT_TRUE(parse("{ // a comment\n \"zero_optimization\": {\"stage\": 1}}").ok());
}

TEST(EngineConfig, ToJsonRoundTrips) {
  auto c = EngineConfig::from_file(TIER_TEST_DATA_DIR "/hf_zero3_nvme.json", {.apply_env = false});
  ASSERT_TRUE(c.ok());
  const std::string once = c->to_json();
  auto again = parse(once, /*strict=*/true);
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << once;
  EXPECT_EQ(again->to_json(), once);
}

TEST(EngineConfig, EnvironmentOverridesTheFile) {
  setenv("TIER_IO_ENGINE", "aio", 1);
  setenv("TIER_BUDGETS_DEVICE", "2G", 1);
  auto c = EngineConfig::from_json(R"({"tier": {"io_engine": "uring"}})");
  unsetenv("TIER_IO_ENGINE");
  unsetenv("TIER_BUDGETS_DEVICE");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->tier.io.engine, IoEngineKind::kAio);
  EXPECT_EQ(c->tier.device_budget, 2ull << 30);
  EXPECT_TRUE(has_note(*c, "TIER_IO_ENGINE"));

  setenv("TIER_PREFETCH_LOOKAHEAD", "lots", 1);
  auto bad = EngineConfig::from_json("{}");
  unsetenv("TIER_PREFETCH_LOOKAHEAD");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("TIER_PREFETCH_LOOKAHEAD"), std::string::npos);
}

TEST(EngineConfig, ValidateCatchesHandEditedFields) {
  auto c = parse("{}");
  ASSERT_TRUE(c.ok());
  EngineConfig cfg = *c;
  cfg.aio.block_size = 1000;
  EXPECT_FALSE(cfg.validate().ok());
  cfg = *c;
  cfg.optimizer.beta1 = 1.0;
  EXPECT_FALSE(cfg.validate().ok());
  cfg = *c;
  cfg.offload_optimizer.device = OffloadDevice::kNvme;
  EXPECT_FALSE(cfg.validate().ok());
  cfg.offload_optimizer.nvme_path = "/x";
  EXPECT_TRUE(cfg.validate().ok());
}

TEST(EngineConfig, OtherDeepSpeedOptimizersAreRefusedNamingWhatIsSupported) {
  for (const char* type : {"OneBitLamb", "OneBitAdam", "ZeroOneAdam", "SGD"}) {
    auto c = parse(std::string(R"({"optimizer": {"type": ")") + type + R"(", "params": {"lr": 0.001}}})");
    ASSERT_FALSE(c.ok()) << type;
    const std::string& m = c.status().message();
    EXPECT_NE(m.find("'optimizer.type'"), std::string::npos) << m;
    EXPECT_NE(m.find("adam, adamw, adagrad, lion or lamb"), std::string::npos) << m;
    EXPECT_NE(m.find("cannot run"), std::string::npos) << m;
  }
}

TEST(EngineConfig, AdagradLionAndLambAreAcceptedInAnyCaseWithTheirDefaults) {
  auto lamb = parse(R"({"optimizer": {"type": "LAMB", "params": {"lr": 0.002, "weight_decay": 0.01,
                       "bias_correction": false, "max_coeff": 0.3, "min_coeff": 0.02}}})");
  ASSERT_TRUE(lamb.ok()) << lamb.status();
  EXPECT_EQ(lamb->optimizer.type, OptimizerType::kLamb);
  EXPECT_EQ(lamb->optimizer.max_coeff, 0.3);
  EXPECT_EQ(lamb->optimizer.min_coeff, 0.02);
  EXPECT_FALSE(lamb->optimizer.bias_correction);
  auto lamb_defaults = parse(R"({"optimizer": {"type": "Lamb"}})");
  ASSERT_TRUE(lamb_defaults.ok()) << lamb_defaults.status();
  EXPECT_EQ(lamb_defaults->optimizer.max_coeff, 10.0);
  EXPECT_EQ(lamb_defaults->optimizer.min_coeff, 0.01);
  EXPECT_EQ(lamb_defaults->optimizer.weight_decay, 0.0);

  auto adagrad = parse(R"({"optimizer": {"type": "adagrad", "params": {"lr": 0.01}}})");
  ASSERT_TRUE(adagrad.ok()) << adagrad.status();
  EXPECT_EQ(adagrad->optimizer.type, OptimizerType::kAdagrad);
  EXPECT_EQ(adagrad->optimizer.eps, 1e-10);  // DeepSpeed's and torch's default
  auto adagrad_eps = parse(R"({"optimizer": {"type": "Adagrad", "params": {"eps": 1e-8}}})");
  ASSERT_TRUE(adagrad_eps.ok());
  EXPECT_EQ(adagrad_eps->optimizer.eps, 1e-8);

  auto lion = parse(R"({"optimizer": {"type": "Lion", "params": {"lr": 1e-4, "weight_decay": 0.1}}})");
  ASSERT_TRUE(lion.ok()) << lion.status();
  EXPECT_EQ(lion->optimizer.type, OptimizerType::kLion);
  EXPECT_EQ(lion->optimizer.beta2, 0.99);
  auto lion_betas = parse(R"({"optimizer": {"type": "Lion", "params": {"betas": [0.95, 0.98]}}})");
  ASSERT_TRUE(lion_betas.ok());
  EXPECT_EQ(lion_betas->optimizer.beta1, 0.95);
  EXPECT_EQ(lion_betas->optimizer.beta2, 0.98);

  auto inverted = parse(R"({"optimizer": {"type": "Lamb", "params": {"max_coeff": 0.1, "min_coeff": 0.5}}})");
  ASSERT_FALSE(inverted.ok());
  EXPECT_NE(inverted.status().message().find("min_coeff"), std::string::npos) << inverted.status();
}

TEST(EngineConfig, AConfigWithoutAnOptimizerSaysTheClientMustPassOne) {
  auto none = parse(R"({"zero_optimization": {"stage": 2}})");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(has_note(*none, "initialize(model, config, optimizer=")) << none->notes[0];
  auto given = parse(R"({"optimizer": {"type": "AdamW"}})");
  ASSERT_TRUE(given.ok());
  EXPECT_FALSE(has_note(*given, "optimizer: no section"));
}

TEST(EngineConfig, AioNestedInZeroOptimizationIsTheAioSection) {
  // transformers' documented NVMe example puts aio here.
  auto c = parse(R"({"zero_optimization": {"stage": 3, "aio": {"block_size": 262144, "queue_depth": 32,
                     "thread_count": 2, "single_submit": true, "overlap_events": true}}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->aio.block_size, 262144u);
  EXPECT_EQ(c->aio.queue_depth, 32);
  EXPECT_EQ(c->aio.intra_op_parallelism, 2);
  EXPECT_TRUE(c->aio.single_submit);
  EXPECT_TRUE(has_note(*c, "zero_optimization.aio: read as the top-level aio section"));
  EXPECT_FALSE(has_note(*c, "not known")) << "nothing may be dropped";
  const json resolved = json::parse(c->to_json());
  EXPECT_EQ(resolved["aio"]["block_size"], 262144);
}

TEST(EngineConfig, NestedAndTopLevelAioMayAgreeButNotDiffer) {
  auto same = parse(R"({"aio": {"queue_depth": 16}, "zero_optimization": {"aio": {"queue_depth": 16}}})");
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->aio.queue_depth, 16);
  auto differ = parse(R"({"aio": {"queue_depth": 16}, "zero_optimization": {"aio": {"queue_depth": 32}}})");
  ASSERT_FALSE(differ.ok());
  const std::string& m = differ.status().message();
  EXPECT_NE(m.find("'zero_optimization.aio.queue_depth'"), std::string::npos) << m;
  EXPECT_NE(m.find("'aio.queue_depth'"), std::string::npos) << m;
  EXPECT_NE(m.find("keep one"), std::string::npos) << m;
}

TEST(EngineConfig, AcceleratesAutoValuesAreAccepted) {
  auto c = parse(R"({
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                  "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"}, "offload_param": {"device": "auto"},
                          "stage3_gather_16bit_weights_on_model_save": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"})");
  ASSERT_TRUE(c.ok()) << c.status();
  for (const char* k : {"scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps",
                        "zero_optimization.stage3_gather_16bit_weights_on_model_save", "zero_optimization.stage",
                        "zero_optimization.offload_optimizer.device"}) {
    EXPECT_TRUE(has_auto(*c, k)) << k;
  }
  EXPECT_EQ(c->offload_optimizer.device, OffloadDevice::kNone);
  // The scheduler section reaches the adapter as given, its "auto"s to be filled there.
  EXPECT_EQ(json::parse(c->scheduler_json)["params"]["total_num_steps"], "auto");
}

TEST(EngineConfig, SchedulerParametersAreCheckedAgainstTheirType) {
  auto wrong =
      parse(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 9, "cos_min_ratio": 0.1}}})");
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("'scheduler.params.cos_min_ratio' does not apply to WarmupDecayLR"),
            std::string::npos)
      << wrong.status();
  auto missing = parse(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5}}})");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("'scheduler.params.total_num_steps' is missing"), std::string::npos);
  auto kind = parse(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}})");
  ASSERT_FALSE(kind.ok());
  EXPECT_NE(kind.status().message().find("log, linear"), std::string::npos) << kind.status();
  auto bad_type = parse(R"({"scheduler": {"type": "CosineAnnealingLR"}})");
  ASSERT_FALSE(bad_type.ok());
  EXPECT_NE(bad_type.status().message().find("onecycle"), std::string::npos) << bad_type.status();
  auto one = parse(R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.0001, "cycle_max_lr": 0.01,
                       "cycle_first_step_size": 100}}})");
  EXPECT_TRUE(one.ok()) << one.status();
  auto untyped = parse(R"({"scheduler": {"params": {"warmup_num_steps": 5}}})");
  ASSERT_TRUE(untyped.ok()) << untyped.status();
  EXPECT_TRUE(has_note(*untyped, "no type given"));
}

TEST(EngineConfig, AnNvmeBudgetWithoutADirectoryIsRefusedAsTheEngineWouldRefuseIt) {
  auto c = parse(R"({"tier": {"budgets": {"nvme": "1G"}}})");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("'tier.budgets.nvme'"), std::string::npos) << c.status();
  EXPECT_TRUE(parse(R"({"tier": {"budgets": {"nvme": "1G"}, "swap_paths": ["/nvme/tier"]}})").ok());
}

TEST(EngineConfig, WarmupOfZeroAndOneStepsIsAccepted) {
  // The Hugging Face Trainer writes max(1, warmup_steps) and accelerate's DummyScheduler 0;
  // DeepSpeed warms up over at least 2 steps either way.
  for (const char* n : {"0", "1"}) {
    auto c = parse(std::string(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": )") + n + "}}}");
    EXPECT_TRUE(c.ok()) << n << ": " << c.status();
  }
}

}  // namespace
}  // namespace tier
