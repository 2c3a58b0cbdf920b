// The table of configuration keys. Order matters only for docs and error suggestions.
#include "core/config_schema.hpp"

#include <cmath>
#include <cstdio>
#include <map>

#include "core/text.hpp"

namespace tier::detail {

using json = nlohmann::json;

namespace {

// Fluent builder for one KeySpec.
struct K {
  KeySpec k;
  K(std::string path, ValueKind kind) {
    k.path = std::move(path);
    k.kind = kind;
  }
  K& range(double lo, double hi) {
    k.min = lo;
    k.max = hi;
    return *this;
  }
  K& multiple_of(std::uint64_t m) {
    k.multiple_of = m;
    return *this;
  }
  K& choices(std::vector<std::string> c) {
    k.choices = std::move(c);
    return *this;
  }
  K& auto_is(json v) {
    k.auto_ok = true;
    k.auto_value = std::move(v);
    return *this;
  }
  K& noted(std::string note) {
    k.treatment = Treatment::kNoted;
    k.note = std::move(note);
    return *this;
  }
  K& alias_of(std::string canonical) {
    k.canonical = std::move(canonical);
    return *this;
  }
  K& check(std::function<std::string(const json&)> f) {
    k.check = std::move(f);
    return *this;
  }
  K& set(std::function<void(EngineConfig&, const json&)> f) {
    k.set = std::move(f);
    return *this;
  }
  K& get(std::function<json(const EngineConfig&)> f) {
    k.get = std::move(f);
    return *this;
  }
  K& context(json ctx) {
    k.sample_context = std::move(ctx);
    return *this;
  }
  K& sample(json valid, json invalid, json expected = nullptr) {
    k.sample_valid = std::move(valid);
    k.sample_invalid = std::move(invalid);
    k.sample_expected = std::move(expected);
    return *this;
  }
};

// set/get pair for a plain field.
#define TIER_FIELD(member)                               \
  set([](EngineConfig& c, const json& v) {               \
    c.member = v.get<decltype(EngineConfig{}.member)>(); \
  }).get([](const EngineConfig& c) { return json(c.member); })

template <class E>
int enum_index(const std::vector<std::string>& choices, const json& v) {
  const std::string s = v.get<std::string>();
  for (std::size_t i = 0; i < choices.size(); ++i) {
    if (choices[i] == s) return static_cast<int>(i);
  }
  return 0;
}

#define TIER_ENUM_FIELD(member, EnumT, ...)                                                                            \
  choices({__VA_ARGS__})                                                                                               \
      .set([](EngineConfig& c, const json& v) { c.member = static_cast<EnumT>(enum_index<EnumT>({__VA_ARGS__}, v)); }) \
      .get([](const EngineConfig& c) {                                                                                 \
        static const std::vector<std::string> names = {__VA_ARGS__};                                                   \
        return json(names[static_cast<std::size_t>(c.member)]);                                                        \
      })

constexpr double kBig = 9.0e18;

std::vector<KeySpec> build_schema() {
  using VK = ValueKind;
  std::vector<KeySpec> s;
  auto add = [&](const K& spec) { s.push_back(spec.k); };

  const std::string kNotPartitioned =
      "tier.torch partitions across ranks by its own scheme (docs/distributed.md): gradients are "
      "reduce-scattered in buckets of reduce_bucket_size elements as backward finishes them, "
      "stage-3 parameters all-gathered one module at a time; this knob changes nothing";

  // Keys DeepSpeed acts on and tier accepts without acting on: each note says what governs the
  // same thing in tier.
  const std::string kParamBuffersNote =
      "tier moves each parameter whole through the pinned host arena, with no fixed pool of swap "
      "buffers; tier.budgets.host bounds that staging";
  const std::string kPinNote =
      "the engine's host arena is always pinned (locked and registered with the device and as "
      "io_uring fixed buffers): whole at start when tier.budgets.host is given, in 64 MiB extents "
      "as it fills under the auto budget; the optimizer's chunk buffers are always locked; this "
      "flag changes neither";
  const std::string kPipelineNote =
      "the NVMe optimizer always overlaps chunk reads and writes with the update when "
      "offload_optimizer.buffer_count is 3 or more (the default is 4); 1 or 2 buffers serialize";

  // ---------------------------------------------------------------- top level (DeepSpeed)
  add(K("", VK::kObject));
  // The engine takes whatever batch the training loop feeds; the adapters read the batch keys.
  static const std::string kBatchNote =
      "the engine takes whatever batch the training loop feeds; tier.torch reads it for the DataLoader "
      "initialize(training_data=...) builds and for train_batch_size()";
  add(K("train_batch_size", VK::kInt)
          .range(1, kBig)
          .auto_is(0)
          .noted(kBatchNote)
          .set([](EngineConfig& c, const json& v) { c.train_batch_size = v.get<std::uint64_t>(); })
          .get([](const EngineConfig& c) { return c.train_batch_size ? json(c.train_batch_size) : json(nullptr); })
          .sample(32, 0));
  add(K("train_micro_batch_size_per_gpu", VK::kInt)
          .range(1, kBig)
          .auto_is(0)
          .noted(kBatchNote)
          .set([](EngineConfig& c, const json& v) { c.train_micro_batch_size_per_gpu = v.get<std::uint64_t>(); })
          .get([](const EngineConfig& c) {
            return c.train_micro_batch_size_per_gpu ? json(c.train_micro_batch_size_per_gpu) : json(nullptr);
          })
          .sample(4, -1));
  add(K("gradient_accumulation_steps", VK::kInt)
          .range(1, 1e9)
          .auto_is(1)
          .TIER_FIELD(gradient_accumulation_steps)
          .sample(8, 0));
  add(K("gradient_clipping", VK::kNumber).range(0, 1e30).auto_is(1.0).TIER_FIELD(gradient_clipping).sample(1.0, -1.0));
  add(K("steps_per_print", VK::kInt)
          .range(0, kBig)
          .noted("tier's adapters print progress every step and the stats snapshot on request")
          .sample(10, "often"));
  add(K("wall_clock_breakdown", VK::kBool).noted("timings are always in the stats snapshot").sample(true, "yes"));
  add(K("memory_breakdown", VK::kBool).noted("memory per tier is always in the stats snapshot").sample(false, 3));
  add(K("dump_state", VK::kBool).noted("use the stats snapshot (Engine::stats().to_json())").sample(false, "x"));
  add(K("prescale_gradients", VK::kBool).noted(kNotPartitioned).sample(false, 1.5));
  add(K("gradient_predivide_factor", VK::kNumber).range(0, 1e30).noted(kNotPartitioned).sample(1.0, "x"));
  add(K("sparse_gradients", VK::kBool).noted("gradients are dense in tier").sample(false, "no"));
  add(K("zero_allow_untested_optimizer", VK::kBool)
          .noted("tier runs its own CPU optimizers (Adam, AdamW, Adagrad, Lion, Lamb); other optimizers are rejected "
                 "by optimizer.type")
          .sample(true, 2));
  add(K("zero_force_ds_cpu_optimizer", VK::kBool)
          .noted("tier always uses its own CPU optimizer for offloaded state")
          .sample(true, 2));
  add(K("communication_data_type", VK::kString).noted(kNotPartitioned).sample("fp16", 5));
  add(K("seq_parallel_communication_data_type", VK::kString).noted(kNotPartitioned).sample("fp32", 5));
  add(K("disable_allgather", VK::kBool).noted(kNotPartitioned).sample(false, "x"));
  add(K("graph_harvesting", VK::kBool).noted("tier does not capture CUDA graphs").sample(false, "x"));
  // activation_checkpointing: tier.torch checkpoints where the model does and can offload the
  // checkpoints (tier.activations); DeepSpeed's other knobs are reported with what tier does.
  add(K("activation_checkpointing", VK::kObject));
  add(K("activation_checkpointing.cpu_checkpointing", VK::kBool)
          .set([](EngineConfig& c, const json& v) {
            // DeepSpeed's switch for offloading checkpoints to host memory: the default of
            // tier.activations.offload (an explicit tier.activations.offload, set later, wins).
            c.tier.activations.cpu_checkpointing = v.get<bool>();
            if (c.tier.activations.cpu_checkpointing) c.tier.activations.offload = ActivationOffload::kHost;
          })
          .get([](const EngineConfig& c) { return json(c.tier.activations.cpu_checkpointing); })
          .sample(true, "yes"));
  add(K("activation_checkpointing.partition_activations", VK::kBool)
          .noted("each rank keeps the checkpoints of its own micro-batch; with tier.activations.offload they leave "
                 "the device, which is what partitioning them across ranks saves")
          .sample(true, 2));
  add(K("activation_checkpointing.contiguous_memory_optimization", VK::kBool)
          .noted("offloaded checkpoints are engine tensors reused from step to step, so they do not fragment the "
                 "device's memory")
          .sample(true, "x"));
  add(K("activation_checkpointing.number_checkpoints", VK::kInt)
          .range(0, 1e9)
          .noted("tier checkpoints where the model does (gradient_checkpointing_enable: every layer)")
          .sample(4, -1));
  add(K("activation_checkpointing.synchronize_checkpoint_boundary", VK::kBool)
          .noted("the engine orders each checkpoint's copy itself")
          .sample(false, "x"));
  add(K("activation_checkpointing.profile", VK::kBool)
          .noted("activation bytes per tier are always in the stats snapshot (activations.* metrics)")
          .sample(true, "x"));
  for (const char* section : {"amp",
                              "flops_profiler",
                              "tensorboard",
                              "wandb",
                              "csv_monitor",
                              "comet",
                              "comms_logger",
                              "monitor_config",
                              "elasticity",
                              "autotuning",
                              "checkpoint",
                              "data_types",
                              "data_efficiency",
                              "curriculum_learning",
                              "compression_training",
                              "pipeline",
                              "nebula",
                              "hybrid_engine",
                              "sparse_attention",
                              "eigenvalue",
                              "progressive_layer_drop",
                              "quantize_training",
                              "weight_quantization",
                              "timers",
                              "aio_config"}) {
    add(K(section, VK::kOpaque)
            .noted(std::string(section) == "checkpoint"
                       ? "tier writes its own checkpoint format for offloaded state"
                       : "accepted for compatibility; tier leaves this to the training framework")
            .sample(json::object({{"enabled", false}}), 7));
  }

  // optimizer / scheduler
  add(K("optimizer", VK::kObject));
  add(K("optimizer.type", VK::kEnum)
          .TIER_ENUM_FIELD(optimizer.type, OptimizerType, "adam", "adamw", "adagrad", "lion", "lamb")
          .check([](const json& v) -> std::string {
            // Called with the lower-cased name when it is not a choice: name what tier lacks.
            const std::string t = v.get<std::string>();
            static const char* const kKnown[] = {"onebitlamb", "onebitadam", "zerooneadam", "muadam",
                                                 "muadamw",    "musgd",      "sgd",         "cpuadam"};
            for (const char* k : kKnown) {
              if (t == k) {
                return str("adam, adamw, adagrad, lion or lamb (any case); tier's offloaded CPU optimizer ",
                           "implements only these, so '", t,
                           "' cannot run; use one of them, or leave out the optimizer section and pass a ",
                           "torch.optim.Adam, AdamW or Adagrad to initialize(optimizer=...)");
              }
            }
            return "";
          })
          .sample("AdamW", "OneBitLamb", "adamw"));
  add(K("optimizer.params", VK::kObject));
  add(K("optimizer.params.lr", VK::kNumber).range(0, 1e6).auto_is(5e-5).TIER_FIELD(optimizer.lr).sample(3e-4, -1));
  add(K("optimizer.params.betas", VK::kPair)
          .range(0, 0.999999999)
          .auto_is(json::array({0.9, 0.999}))
          .set([](EngineConfig& c, const json& v) {
            c.optimizer.beta1 = v[0].get<double>();
            c.optimizer.beta2 = v[1].get<double>();
          })
          .get([](const EngineConfig& c) {
            return json::array({c.optimizer.beta1, c.optimizer.beta2});
          })
          .sample(json::array({0.8, 0.95}), json::array({0.9, 1.5})));
  add(K("optimizer.params.eps", VK::kNumber).range(0, 1).auto_is(1e-8).TIER_FIELD(optimizer.eps).sample(1e-6, 0.0 - 1));
  add(K("optimizer.params.weight_decay", VK::kNumber)
          .range(0, 1e6)
          .auto_is(0.0)
          .TIER_FIELD(optimizer.weight_decay)
          .sample(0.1, -0.5));
  add(K("optimizer.params.bias_correction", VK::kBool).TIER_FIELD(optimizer.bias_correction).sample(false, "no"));
  add(K("optimizer.params.adam_w_mode", VK::kBool)
          .TIER_FIELD(optimizer.decoupled_weight_decay)
          .sample(false, 0.5)
          .context({{"optimizer", {{"type", "Adam"}}}}));
  const json kLambContext = {{"optimizer", {{"type", "Lamb"}}}};
  add(K("optimizer.params.max_coeff", VK::kNumber)
          .range(0, 1e6)
          .TIER_FIELD(optimizer.max_coeff)
          .sample(0.3, -1)
          .context(kLambContext));
  add(K("optimizer.params.min_coeff", VK::kNumber)
          .range(0, 1e6)
          .TIER_FIELD(optimizer.min_coeff)
          .sample(0.01, -1)
          .context(kLambContext));
  // FusedLamb's other params: tier runs their defaults only, and says so instead of ignoring them.
  add(K("optimizer.params.eps_inside_sqrt", VK::kBool)
          .check([](const json& v) {
            return v.get<bool>() ? "false (tier's Lamb adds eps outside the square root, FusedLamb's default)" : "";
          })
          .noted("only false is accepted; tier's Lamb adds eps outside the square root")
          .sample(false, true)
          .context(kLambContext));
  add(K("optimizer.params.max_grad_norm", VK::kNumber)
          .range(0, 1e30)
          .check([](const json& v) {
            return v.get<double>() > 0 ? "0 (clip with the top-level gradient_clipping key instead)" : "";
          })
          .noted("only 0 is accepted; clip with the top-level gradient_clipping")
          .sample(0.0, 1.0)
          .context(kLambContext));
  add(K("optimizer.params.amsgrad", VK::kBool)
          .check([](const json& v) { return v.get<bool>() ? "false (tier's Adam has no AMSGrad variant)" : ""; })
          .noted("only false is accepted; tier's Adam has no AMSGrad variant")
          .sample(false, true));
  add(K("optimizer.params.torch_adam", VK::kBool)
          .noted("tier always runs its own SIMD CPU Adam for offloaded state")
          .sample(true, "x"));
  add(K("optimizer.params.fused", VK::kBool).noted("tier's CPU Adam is always fused").sample(true, "x"));
  // The scheduler section is kept as given (the adapters run the schedule, and fill the "auto"s
  // from the trainer); its keys are checked here so that `config --check` and initialize agree.
  add(K("scheduler", VK::kObject)
          .set([](EngineConfig& c, const json& v) { c.scheduler_json = v.dump(); })
          .get([](const EngineConfig& c) {
            return c.scheduler_json.empty() ? json(nullptr) : json::parse(c.scheduler_json);
          }));
  add(K("scheduler.type", VK::kEnum)
          .choices({"warmuplr", "warmupdecaylr", "warmupcosinelr", "onecycle", "lrrangetest"})
          .sample("WarmupLR", "CosineAnnealing"));
  add(K("scheduler.params", VK::kObject));
  // Contexts must not hold the key they serve (the test merges them over the sample).
  const json kDecayContext = {{"scheduler", {{"type", "WarmupDecayLR"}}}};
  const json kCosineContext = {{"scheduler", {{"type", "WarmupCosineLR"}, {"params", {{"total_num_steps", 100}}}}}};
  const json kOneCycleContext = {
      {"scheduler", {{"type", "OneCycle"}, {"params", {{"cycle_min_lr", 1e-4}, {"cycle_max_lr", 1e-3}}}}}};
  const json kOneCycleMaxContext = {{"scheduler", {{"type", "OneCycle"}, {"params", {{"cycle_max_lr", 1e-3}}}}}};
  const json kOneCycleMinContext = {{"scheduler", {{"type", "OneCycle"}, {"params", {{"cycle_min_lr", 1e-4}}}}}};
  const json kRangeContext = {{"scheduler", {{"type", "LRRangeTest"}}}};
  // Filled by the Hugging Face and accelerate integrations when "auto": the lr bounds from the
  // trainer, the step counts from the training length.
  add(K("scheduler.params.warmup_min_lr", VK::kNumber).range(0, 1e6).auto_is(0.0).sample(1e-6, -1));
  add(K("scheduler.params.warmup_max_lr", VK::kNumber).range(0, 1e6).auto_is("auto").sample(1e-3, "fast"));
  add(K("scheduler.params.warmup_num_steps", VK::kInt).range(0, kBig).auto_is(1).sample(100, -3));
  add(K("scheduler.params.warmup_type", VK::kEnum).choices({"log", "linear"}).sample("linear", "cubic"));
  add(K("scheduler.params.total_num_steps", VK::kInt)
          .range(1, kBig)
          .auto_is("auto")
          .sample(1000, 0)
          .context(kDecayContext));
  add(K("scheduler.params.warmup_min_ratio", VK::kNumber).range(0, 1).sample(0.1, 2).context(kCosineContext));
  add(K("scheduler.params.cos_min_ratio", VK::kNumber).range(0, 1).sample(0.01, -1).context(kCosineContext));
  add(K("scheduler.params.cycle_min_lr", VK::kNumber).range(0, 1e6).sample(1e-5, -1).context(kOneCycleMaxContext));
  add(K("scheduler.params.cycle_max_lr", VK::kNumber).range(0, 1e6).sample(1e-2, "x").context(kOneCycleMinContext));
  add(K("scheduler.params.decay_lr_rate", VK::kNumber).range(0, 1e6).sample(0.1, "x").context(kOneCycleContext));
  add(K("scheduler.params.cycle_first_step_size", VK::kInt).range(1, kBig).sample(100, 0).context(kOneCycleContext));
  add(K("scheduler.params.cycle_second_step_size", VK::kInt).range(0, kBig).sample(50, -1).context(kOneCycleContext));
  add(K("scheduler.params.cycle_first_stair_count", VK::kInt).range(0, kBig).sample(4, -1).context(kOneCycleContext));
  add(K("scheduler.params.cycle_second_stair_count", VK::kInt).range(0, kBig).sample(4, -1).context(kOneCycleContext));
  add(K("scheduler.params.decay_step_size", VK::kInt).range(0, kBig).sample(10, -1).context(kOneCycleContext));
  add(K("scheduler.params.cycle_momentum", VK::kBool).sample(false, "no").context(kOneCycleContext));
  add(K("scheduler.params.cycle_min_mom", VK::kNumber).range(0, 1).sample(0.85, 2).context(kOneCycleContext));
  add(K("scheduler.params.cycle_max_mom", VK::kNumber).range(0, 1).sample(0.95, 2).context(kOneCycleContext));
  add(K("scheduler.params.decay_mom_rate", VK::kNumber).range(0, 1e6).sample(0.1, "x").context(kOneCycleContext));
  add(K("scheduler.params.lr_range_test_min_lr", VK::kNumber).range(0, 1e6).sample(1e-5, -1).context(kRangeContext));
  add(K("scheduler.params.lr_range_test_step_size", VK::kInt).range(1, kBig).sample(100, 0).context(kRangeContext));
  add(K("scheduler.params.lr_range_test_step_rate", VK::kNumber).range(0, 1e6).sample(2.0, -1).context(kRangeContext));
  add(K("scheduler.params.lr_range_test_staircase", VK::kBool).sample(true, "x").context(kRangeContext));
  add(K("scheduler.params.last_batch_iteration", VK::kInt)
          .range(-1, -1)  // resume with load_checkpoint instead
          .sample(-1, 5));

  // fp16 / bf16
  add(K("fp16", VK::kObject));
  add(K("fp16.enabled", VK::kBool).auto_is(false).TIER_FIELD(fp16.enabled).sample(true, "yes"));
  add(K("fp16.loss_scale", VK::kNumber).range(0, 1e30).TIER_FIELD(fp16.loss_scale).sample(128.0, -1));
  add(K("fp16.initial_scale_power", VK::kInt).range(0, 64).TIER_FIELD(fp16.initial_scale_power).sample(12, 100));
  add(K("fp16.loss_scale_window", VK::kInt).range(1, 1e9).TIER_FIELD(fp16.loss_scale_window).sample(500, 0));
  add(K("fp16.hysteresis", VK::kInt).range(1, 1e9).TIER_FIELD(fp16.hysteresis).sample(4, 0));
  add(K("fp16.consecutive_hysteresis", VK::kBool).TIER_FIELD(fp16.consecutive_hysteresis).sample(true, 1.5));
  add(K("fp16.min_loss_scale", VK::kNumber).range(0, 1e30).TIER_FIELD(fp16.min_loss_scale).sample(0.5, -2));
  add(K("fp16.auto_cast", VK::kBool).noted("tier leaves autocasting to the framework").sample(false, "x"));
  add(K("fp16.fp16_master_weights_and_grads", VK::kBool)
          .noted("tier always keeps fp32 master weights for offloaded optimizer state")
          .sample(false, "x"));
  add(K("bf16", VK::kObject));
  add(K("bf16.enabled", VK::kBool).auto_is(false).TIER_FIELD(bf16).sample(true, "on"));
  add(K("bf16.immediate_grad_update", VK::kBool)
          .noted("tier moves each gradient off the device as soon as it is final")
          .sample(true, 3));
  add(K("bfloat16", VK::kObject).alias_of("bf16"));
  add(K("bfloat16.enabled", VK::kBool)
          .alias_of("bf16.enabled")
          .auto_is(false)
          .set([](EngineConfig& c, const json& v) { c.bf16 = v.get<bool>(); })
          .sample(true, "on"));

  // ---------------------------------------------------------------- zero_optimization
  add(K("zero_optimization", VK::kObject));
  add(K("zero_optimization.stage", VK::kInt).range(0, 3).auto_is(0).TIER_FIELD(zero_stage).sample(3, 4));
  add(K("zero_optimization.sub_group_size", VK::kInt)
          .range(1, kBig)
          .TIER_FIELD(sub_group_size)
          .sample(1e8, 0, 100000000));
  const std::string kZeroNote = "tier decides this from its budgets and recorded access trace";
  for (const char* key : {"contiguous_gradients", "overlap_comm", "reduce_scatter", "allgather_partitions",
                          "round_robin_gradients", "elastic_checkpoint", "ignore_unused_parameters", "legacy_stage1",
                          "load_from_fp32_weights", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
                          "zero_quantized_gradients", "mics_hierarchical_params_gather", "memory_efficient_linear",
                          "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
                          "use_multi_rank_bucket_allreduce", "stage3_use_all_reduce_for_fetch_params"}) {
    add(K(std::string("zero_optimization.") + key, VK::kBool).noted(kNotPartitioned).sample(true, "yes"));
  }
  for (const char* key :
       {"allgather_bucket_size", "zero_hpz_partition_size", "mics_shard_size", "stage3_module_granularity_threshold"}) {
    add(K(std::string("zero_optimization.") + key, VK::kInt)
            .range(-1, kBig)
            .noted(kNotPartitioned)
            .sample(500000000, "big"));
  }
  // Across ranks (tier.torch): elements per gradient reduce-scatter and per all-gather of the
  // updated shards.
  add(K("zero_optimization.reduce_bucket_size", VK::kInt)
          .range(0, kBig)
          .auto_is(500000000)
          .TIER_FIELD(reduce_bucket_size)
          .sample(5e8, "huge"));
  // stage3_* knobs and their newer names without the prefix.
  struct Stage3 {
    const char* name;
    bool auto_ok;
    double auto_value;
    const char* note;
  };
  for (const Stage3& k3 : {
           // Acted on across ranks (stage 3): the elements tier.torch all-gathers ahead of use. (In
           // one process the prefetch window is tier.prefetch.lookahead and max_inflight_bytes.)
           Stage3{"prefetch_bucket_size", true, 50000000, nullptr},
           Stage3{"param_persistence_threshold", true, 100000,
                  "tier keeps a parameter on the device when its budget allows and the trace says it is reused"},
           Stage3{"model_persistence_threshold", false, 0, "tier sizes persistence from tier.budgets.device"},
           Stage3{"max_live_parameters", false, 0, "the device budget (tier.budgets.device) bounds live parameters"},
           Stage3{"max_reuse_distance", false, 0,
                  "tier evicts by next use in the recorded trace (Belady), which subsumes a reuse distance"},
       }) {
    for (const std::string& name : {std::string("stage3_") + k3.name, std::string(k3.name)}) {
      K key("zero_optimization." + name, VK::kInt);
      key.range(0, kBig).sample(1000000, "many");
      if (k3.note) key.noted(k3.note);
      if (k3.auto_ok) key.auto_is(static_cast<std::int64_t>(k3.auto_value));
      if (std::string(k3.name) == "prefetch_bucket_size") {
        // Both names set it; the resolved config writes the stage3_ one.
        if (name.rfind("stage3_", 0) == 0) {
          key.TIER_FIELD(prefetch_bucket_size);
        } else {
          key.set([](EngineConfig& c, const json& v) { c.prefetch_bucket_size = v.get<std::uint64_t>(); });
        }
      }
      add(std::move(key));
    }
  }
  for (const char* key : {"stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                          "gather_16bit_weights_on_model_save"}) {
    add(K(std::string("zero_optimization.") + key, VK::kBool)
            .auto_is(false)  // accelerate fills it from zero3_save_16bit_model, false by default
            .noted("tier's checkpoints always hold whole tensors; there is nothing to gather")
            .sample(true, 1.0));
  }
  add(K("zero_optimization.cpu_offload", VK::kBool)
          .set([](EngineConfig& c, const json& v) {
            if (v.get<bool>()) c.offload_optimizer.device = OffloadDevice::kCpu;
          })
          .sample(true, "yes"));
  add(K("zero_optimization.cpu_offload_params", VK::kBool)
          .set([](EngineConfig& c, const json& v) {
            if (v.get<bool>()) c.offload_param.device = OffloadDevice::kCpu;
          })
          .sample(true, "yes"));
  add(K("zero_optimization.cpu_offload_use_pin_memory", VK::kBool)
          .noted(kPinNote)
          .set([](EngineConfig& c, const json& v) {
            c.offload_param.pin_memory = c.offload_optimizer.pin_memory = v.get<bool>();
          })
          .sample(true, "yes"));

  add(K("zero_optimization.offload_param", VK::kObject));
  // Parameters move whole, through the engine's host arena: DeepSpeed's fixed pool of parameter
  // swap buffers has no counterpart, so its sizes are kept only for to_json and the record.
  add(K("zero_optimization.offload_param.device", VK::kEnum)
          .auto_is("none")
          .TIER_ENUM_FIELD(offload_param.device, OffloadDevice, "none", "cpu", "nvme")
          .sample("CPU", "gpu", "cpu"));
  add(K("zero_optimization.offload_param.nvme_path", VK::kString)
          .TIER_FIELD(offload_param.nvme_path)
          .sample("/local_nvme", 42));
  add(K("zero_optimization.offload_param.buffer_count", VK::kInt)
          .range(1, 1e6)
          .TIER_FIELD(offload_param.buffer_count)
          .noted(kParamBuffersNote)
          .sample(6, 0));
  add(K("zero_optimization.offload_param.buffer_size", VK::kInt)
          .range(1, kBig)
          .TIER_FIELD(offload_param.buffer_size)
          .noted(kParamBuffersNote)
          .sample(1e8, -5, 100000000));
  add(K("zero_optimization.offload_param.max_in_cpu", VK::kInt)
          .range(0, kBig)
          .TIER_FIELD(offload_param.max_in_cpu)
          .noted("tier.budgets.host bounds the bytes kept in host memory; an element count has no byte size "
                 "until the dtypes are known, so set tier.budgets.host instead")
          .sample(2e9, "lots", 2000000000));
  add(K("zero_optimization.offload_param.pin_memory", VK::kBool)
          .TIER_FIELD(offload_param.pin_memory)
          .noted(kPinNote)
          .sample(true, "true"));

  add(K("zero_optimization.offload_optimizer", VK::kObject));
  add(K("zero_optimization.offload_optimizer.device", VK::kEnum)
          .auto_is("none")
          .TIER_ENUM_FIELD(offload_optimizer.device, OffloadDevice, "none", "cpu", "nvme")
          .sample("cpu", "tpu"));
  add(K("zero_optimization.offload_optimizer.nvme_path", VK::kString)
          .TIER_FIELD(offload_optimizer.nvme_path)
          .sample("/local_nvme", json::array()));
  add(K("zero_optimization.offload_optimizer.buffer_count", VK::kInt)
          .range(1, 1e6)
          .TIER_FIELD(offload_optimizer.buffer_count)
          .sample(8, 0.5));
  add(K("zero_optimization.offload_optimizer.pin_memory", VK::kBool)
          .TIER_FIELD(offload_optimizer.pin_memory)
          .noted(kPinNote)
          .sample(true, 1));
  add(K("zero_optimization.offload_optimizer.pipeline_read", VK::kBool)
          .TIER_FIELD(offload_optimizer.pipeline_read)
          .noted(kPipelineNote)
          .sample(true, "yes"));
  add(K("zero_optimization.offload_optimizer.pipeline_write", VK::kBool)
          .TIER_FIELD(offload_optimizer.pipeline_write)
          .noted(kPipelineNote)
          .sample(true, "yes"));
  add(K("zero_optimization.offload_optimizer.pipeline", VK::kBool)
          .noted("deprecated in DeepSpeed; tier always pipelines reads, updates and writes")
          .sample(true, "yes"));
  add(K("zero_optimization.offload_optimizer.fast_init", VK::kBool)
          .noted("tier initializes swap files with fallocate, which is already fast")
          .sample(true, "x"));
  add(K("zero_optimization.offload_optimizer.ratio", VK::kNumber)
          .range(0, 1)
          .TIER_FIELD(offload_optimizer.ratio)
          .noted("tier updates all offloaded optimizer state on the CPU (as ratio 1.0); a partial "
                 "offload is not implemented")
          .sample(0.3, 1.5));

  // ---------------------------------------------------------------- aio
  add(K("aio", VK::kObject));
  add(K("aio.block_size", VK::kInt)
          .range(4096, 1 << 30)
          .multiple_of(4096)
          .TIER_FIELD(aio.block_size)
          .sample(262144, 1000));
  add(K("aio.queue_depth", VK::kInt).range(1, 4096).TIER_FIELD(aio.queue_depth).sample(32, 0));
  add(K("aio.intra_op_parallelism", VK::kInt).range(1, 256).TIER_FIELD(aio.intra_op_parallelism).sample(4, 0));
  add(K("aio.thread_count", VK::kInt)
          .range(1, 256)
          .alias_of("aio.intra_op_parallelism")
          .set([](EngineConfig& c, const json& v) { c.aio.intra_op_parallelism = v.get<int>(); })
          .sample(2, -1));
  add(K("aio.single_submit", VK::kBool).TIER_FIELD(aio.single_submit).sample(true, "no"));
  add(K("aio.overlap_events", VK::kBool)
          .TIER_FIELD(aio.overlap_events)
          .noted("tier always reaps completions while keeping the queue full; the value is kept for "
                 "the record")
          .sample(false, "no"));
  add(K("aio.use_gds", VK::kBool)
          .TIER_FIELD(aio.use_gds)
          .noted("tier does not use GPUDirect Storage; NVMe data moves through the pinned host arena")
          .sample(false, "no"));

  // transformers' NVMe example nests the aio section in zero_optimization: the same keys.
  add(K("zero_optimization.aio", VK::kObject)
          .alias_of("aio")
          .noted("read as the top-level aio section (where transformers' NVMe example puts it)"));
  const std::size_t n_before_alias = s.size();
  for (std::size_t i = 0; i < n_before_alias; ++i) {
    if (s[i].path.rfind("aio.", 0) != 0) continue;
    KeySpec alias = s[i];
    alias.canonical = s[i].canonical_path();
    alias.path = "zero_optimization." + s[i].path;
    alias.get = nullptr;
    s.push_back(std::move(alias));
  }

  // ---------------------------------------------------------------- tier (tier's own)
  add(K("tier", VK::kObject));
  add(K("tier.budgets", VK::kObject));
  add(K("tier.budgets.device", VK::kSize)
          .auto_is(0)
          .TIER_FIELD(tier.device_budget)
          .sample("8G", "8 apples", 8589934592ull));
  add(K("tier.budgets.host", VK::kSize).auto_is(0).TIER_FIELD(tier.host_budget).sample("16GiB", -3, 17179869184ull));
  add(K("tier.budgets.nvme", VK::kSize)
          .auto_is(0)
          .TIER_FIELD(tier.nvme_budget)
          .sample("1TB", "1.5", 1000000000000ull)
          .context({{"tier", {{"swap_paths", {"/nvme/tier"}}}}}));
  add(K("tier.device", VK::kEnum)
          .auto_is("auto")
          .TIER_ENUM_FIELD(tier.device, DeviceKind, "auto", "cuda", "emulated")
          .sample("emulated", "rocm"));
  add(K("tier.device_id", VK::kInt).range(0, 1024).TIER_FIELD(tier.device_id).sample(1, -1));
  add(K("tier.device_alloc_timeout_ms", VK::kInt)
          .range(0, 3'600'000)
          .TIER_FIELD(tier.device_alloc_timeout_ms)
          .sample(2000, -5));
  add(K("tier.swap_paths", VK::kStringList)
          .check([](const json& v) {
            for (const auto& p : v) {
              if (p.get<std::string>().empty()) return "non-empty directory paths";
            }
            return "";
          })
          .TIER_FIELD(tier.swap_paths)
          .sample(json::array({"/nvme0/tier", "/nvme1/tier"}), json::array({"/a", 3})));
  add(K("tier.pinned_arena_bytes", VK::kSize)
          .auto_is(0)
          .TIER_FIELD(tier.pinned_arena_bytes)
          .noted("the engine's pinned arena is its host tier, sized by tier.budgets.host (set that "
                 "instead); the offloaded optimizer sizes its own buffers from tier.optimizer.buffer_bytes")
          .sample("1G", "big", 1073741824));
  add(K("tier.huge_pages", VK::kEnum)
          .auto_is("auto")
          .TIER_ENUM_FIELD(tier.huge_pages, HugePageMode, "auto", "thp", "hugetlbfs", "off")
          .sample("thp", "1G"));
  add(K("tier.io_engine", VK::kEnum)
          .auto_is("auto")
          .TIER_ENUM_FIELD(tier.io.engine, IoEngineKind, "auto", "uring", "aio", "posix")
          .sample("posix", "spdk"));
  add(K("tier.io", VK::kObject));
  add(K("tier.io.use_direct", VK::kBool).TIER_FIELD(tier.io.use_direct).sample(false, "sometimes"));
  add(K("tier.io.sqpoll", VK::kBool).TIER_FIELD(tier.io.sqpoll).sample(true, 2));
  add(K("tier.io.fixed_buffers", VK::kBool).TIER_FIELD(tier.io.fixed_buffers).sample(false, "x"));
  add(K("tier.io.bounce_unaligned", VK::kBool).TIER_FIELD(tier.io.bounce_unaligned).sample(true, "maybe"));
  add(K("tier.io.preallocate", VK::kBool).TIER_FIELD(tier.io.preallocate).sample(true, "all"));
  add(K("tier.prefetch", VK::kObject));
  add(K("tier.prefetch.enabled", VK::kBool).TIER_FIELD(tier.prefetch.enabled).sample(false, "x"));
  add(K("tier.prefetch.lookahead", VK::kInt)
          .range(0, 4096)
          .auto_is(0)
          .TIER_FIELD(tier.prefetch.lookahead)
          .sample(6, -2));
  add(K("tier.prefetch.max_inflight_bytes", VK::kSize)
          .auto_is(0)
          .TIER_FIELD(tier.prefetch.max_inflight_bytes)
          .sample("512M", "half", 536870912));
  add(K("tier.emulated", VK::kObject));
  add(K("tier.emulated.h2d_bytes_per_second", VK::kSize)
          .TIER_FIELD(tier.emulated.h2d_bytes_per_second)
          .sample("4GB", "fast", 4000000000ull));
  add(K("tier.emulated.d2h_bytes_per_second", VK::kSize)
          .TIER_FIELD(tier.emulated.d2h_bytes_per_second)
          .sample(1000000, "slow"));
  add(K("tier.emulated.latency_us", VK::kNumber).range(0, 1e9).TIER_FIELD(tier.emulated.latency_us).sample(5.0, -1.0));
  add(K("tier.emulated.delayed_streams", VK::kBool).TIER_FIELD(tier.emulated.delayed_streams).sample(true, "later"));
  add(K("tier.optimizer_threads", VK::kInt).range(0, 4096).auto_is(0).TIER_FIELD(tier.optimizer_threads).sample(2, -1));
  add(K("tier.trace_file", VK::kString).TIER_FIELD(tier.trace_file).sample("step-trace.json", 5));
  add(K("tier.optimizer", VK::kObject));
  add(K("tier.optimizer.buffer_bytes", VK::kSize)
          .auto_is(0)
          .TIER_FIELD(tier.optimizer.buffer_bytes)
          .sample("512M", "lots", 536870912));
  add(K("tier.optimizer.chunk_elements", VK::kInt)
          .range(0, kBig)
          .multiple_of(1024)
          .auto_is(0)
          .TIER_FIELD(tier.optimizer.chunk_elements)
          .sample(4194304, 1000));
  add(K("tier.optimizer.state_copies", VK::kInt)
          .range(1, 2)
          .auto_is(1)
          .TIER_FIELD(tier.optimizer.state_copies)
          .sample(2, 3));
  add(K("tier.optimizer.speculation_chunks", VK::kInt)
          .range(0, 1 << 20)
          .auto_is(0)
          .TIER_FIELD(tier.optimizer.speculation_chunks)
          .sample(16, -1));
  add(K("tier.optimizer.params_are_masters", VK::kBool)
          .auto_is(true)
          .TIER_FIELD(tier.optimizer.params_are_masters)
          .sample(false, "sometimes"));
  add(K("tier.optimizer.state_dtype", VK::kEnum)
          .TIER_ENUM_FIELD(tier.optimizer.state_dtype, OptimizerStateDType, "fp32", "bf16", "int8")
          .sample("int8", "fp8"));
  add(K("tier.optimizer.overlap", VK::kEnum)
          .TIER_ENUM_FIELD(tier.optimizer.overlap, OptimizerOverlap, "serial", "exact", "delayed")
          .sample("serial", "sometimes"));
  add(K("tier.activations", VK::kObject));
  add(K("tier.activations.checkpoint", VK::kBool).TIER_FIELD(tier.activations.checkpoint).sample(true, "x"));
  add(K("tier.activations.offload", VK::kEnum)
          .auto_is("none")
          .TIER_ENUM_FIELD(tier.activations.offload, ActivationOffload, "none", "host", "nvme")
          .sample("NVMe", "disk", "nvme"));
  add(K("tier.log_level", VK::kEnum)
          .TIER_ENUM_FIELD(tier.log_level, LogLevel, "trace", "debug", "info", "warn", "error", "off")
          .sample("debug", "loud"));
  add(K("tier.strict", VK::kBool).TIER_FIELD(tier.strict).sample(true, "x"));
  add(K("tier.acquire_timeout_ms", VK::kInt).range(1, 1e12).TIER_FIELD(tier.acquire_timeout_ms).sample(5000, 0));
  add(K("tier.debug_checks", VK::kBool).TIER_FIELD(tier.debug_checks).sample(true, "always"));
  return s;
}

std::string fmt_number(double v) {
  char buf[64];
  if (v >= kBig) return "any size";
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  } else {
    std::snprintf(buf, sizeof buf, "%g", v);
  }
  return buf;
}

}  // namespace

std::string KeySpec::allowed() const {
  std::string out;
  auto bounds = [&](const char* what) {
    out = what;
    if (std::isfinite(min) && max < kBig) {
      out += str(" from ", fmt_number(min), " to ", fmt_number(max));
    } else if (std::isfinite(min)) {
      out += str(" of at least ", fmt_number(min));
    }
    if (multiple_of) out += str(", a multiple of ", multiple_of);
  };
  switch (kind) {
    case ValueKind::kObject:
    case ValueKind::kOpaque: out = "a JSON object"; break;
    case ValueKind::kBool: out = "true or false"; break;
    case ValueKind::kInt: bounds("an integer"); break;
    case ValueKind::kNumber: bounds("a number"); break;
    case ValueKind::kSize:
      out = "a byte count: an integer or a string with a unit such as \"512M\", \"4G\", \"2GiB\"";
      break;
    case ValueKind::kString: out = "a string"; break;
    case ValueKind::kEnum: {
      out = "one of: ";
      for (std::size_t i = 0; i < choices.size(); ++i) out += (i ? ", " : "") + choices[i];
      break;
    }
    case ValueKind::kStringList: out = "a list of strings (or one string)"; break;
    case ValueKind::kPair: bounds("two numbers, each"); break;
  }
  if (auto_ok) out += ", or \"auto\"";
  return out;
}

const std::vector<KeySpec>& config_schema() {
  static const std::vector<KeySpec> schema = build_schema();
  return schema;
}

const KeySpec* find_key_spec(std::string_view path) {
  static const std::map<std::string, const KeySpec*, std::less<>> index = [] {
    std::map<std::string, const KeySpec*, std::less<>> m;
    for (const auto& k : config_schema()) m[k.path] = &k;
    return m;
  }();
  auto it = index.find(path);
  return it == index.end() ? nullptr : it->second;
}

std::string env_name_for(const KeySpec& spec) {
  if (spec.path.rfind("tier.", 0) != 0) return {};
  std::string name = "TIER_";
  for (char c : spec.path.substr(5))
    name.push_back(c == '.' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c))));
  return name;
}

}  // namespace tier::detail
