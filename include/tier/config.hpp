// tier/config.hpp — EngineConfig: everything an engine is told, loaded from JSON.
//
// The JSON is DeepSpeed's configuration format, so existing ZeRO-Offload/ZeRO-Infinity configs
// carry over (`zero_optimization.stage`, `offload_param`, `offload_optimizer`, `aio`, `optimizer`,
// `fp16`/`bf16`, `gradient_clipping`, `gradient_accumulation_steps`, ...), plus tier's own `tier`
// section (budgets per tier, backends, swap paths, prefetch and emulation settings). The full key
// reference with defaults is docs/configuration.md.
//
//  - "auto" (as in the configs Hugging Face users keep) is accepted where DeepSpeed's
//    integrations accept it and resolves to a documented default; the key is listed in
//    `auto_keys` so that an adapter can fill it from the model instead.
//  - DeepSpeed keys tier does not act on are accepted; each adds one line to `notes` saying how
//    tier treats it.
//  - A key neither tier nor DeepSpeed knows is reported in `notes` with a "did you mean"
//    suggestion, or is an error when strict (ConfigOptions::strict or "tier": {"strict": true}).
//    Unknown keys inside the `tier` section are always errors.
//  - An invalid value is an error naming the key, the value and what is allowed.
//  - Environment variables override tier's own keys: tier.io_engine <- TIER_IO_ENGINE,
//    tier.budgets.device <- TIER_BUDGETS_DEVICE, and so on (dots become underscores).
//
// Thread safety: EngineConfig is a plain value.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tier/log.hpp"
#include "tier/status.hpp"

namespace tier {

enum class OffloadDevice : std::uint8_t { kNone = 0, kCpu, kNvme };
const char* offload_device_name(OffloadDevice d) noexcept;  // "none", "cpu", "nvme"

enum class IoEngineKind : std::uint8_t { kAuto = 0, kUring, kAio, kPosix };
const char* io_engine_kind_name(IoEngineKind k) noexcept;  // "auto", "uring", "aio", "posix"

enum class DeviceKind : std::uint8_t { kAuto = 0, kCuda, kEmulated };
const char* device_kind_name(DeviceKind k) noexcept;  // "auto", "cuda", "emulated"

enum class HugePageMode : std::uint8_t { kAuto = 0, kThp, kHugetlbfs, kOff };
const char* huge_page_mode_name(HugePageMode m) noexcept;  // "auto", "thp", "hugetlbfs", "off"

// Adagrad, Lion and Lamb as tier's CPU kernels define them (see tier/cpu_adam.hpp).
enum class OptimizerType : std::uint8_t { kAdam = 0, kAdamW, kAdagrad, kLion, kLamb };

// zero_optimization.offload_param. Sizes are in elements, as in DeepSpeed.
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  int buffer_count = 5;
  std::uint64_t buffer_size = 100'000'000;
  std::uint64_t max_in_cpu = 1'000'000'000;
  bool pin_memory = false;
};

// zero_optimization.offload_optimizer.
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  int buffer_count = 4;
  bool pin_memory = false;
  bool pipeline_read = false;
  bool pipeline_write = false;
  double ratio = 1.0;  // fraction of the optimizer state updated on the CPU
};

// aio: the NVMe engine's request shape.
struct AioConfig {
  std::uint64_t block_size = 1 << 20;  // bytes per request; a multiple of 4096
  int queue_depth = 8;                 // requests in flight per engine
  int intra_op_parallelism = 1;        // engines (rings / contexts) that split one transfer
  bool single_submit = false;          // submit requests one at a time instead of batched
  bool overlap_events = true;
  bool use_gds = false;
};

// optimizer: {"type": ..., "params": {...}}.
struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  bool bias_correction = true;
  // Decoupled (AdamW) weight decay. True for AdamW; for Adam it follows params.adam_w_mode,
  // which defaults to true as in DeepSpeed.
  bool decoupled_weight_decay = true;
  // Lamb: the trust ratio's clamp (DeepSpeed's FusedLamb params and defaults).
  double max_coeff = 10.0;
  double min_coeff = 0.01;
};

// fp16: mixed precision with dynamic (loss_scale == 0) or static loss scaling.
struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0;
  int initial_scale_power = 16;
  int loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1;
};

// tier.prefetch.
struct PrefetchConfig {
  bool enabled = true;
  int lookahead = 0;                     // most upcoming acquires prefetched; 0: as many as fit the host budget
  std::uint64_t max_inflight_bytes = 0;  // 0: auto
};

// tier.emulated: the emulated device used when there is no GPU (or when asked for).
struct EmulatedDeviceConfig {
  std::uint64_t h2d_bytes_per_second = 0;  // 0: unlimited
  std::uint64_t d2h_bytes_per_second = 0;  // 0: unlimited
  double latency_us = 0;                   // added to every copy
  // Compute streams that really run later: each DeviceStream handle is a worker thread running
  // the stream's work (stream_wait, record_event, enqueue_host) in order, as a GPU stream does,
  // instead of the caller's thread running it at once. For tests: a consumer that ends a lease
  // before its stream has finished with the memory reads or writes the wrong bytes here too.
  bool delayed_streams = false;
};

// tier.io: NVMe engine choices beyond DeepSpeed's aio section.
struct IoOptions {
  IoEngineKind engine = IoEngineKind::kAuto;
  bool use_direct = true;     // O_DIRECT; refused file systems fall back to posix with a log line
  bool sqpoll = false;        // io_uring kernel submission thread
  bool fixed_buffers = true;  // register the pinned arena with io_uring
  // Copy buffers or sizes that O_DIRECT cannot take (misaligned, not a multiple of the sector
  // size) through bounce buffers instead of failing the transfer.
  bool bounce_unaligned = false;
  // Reserve each swap file's whole capacity (tier.budgets.nvme) at creation instead of growing it
  // with what it holds.
  bool preallocate = false;
};

// tier.optimizer: the offloaded optimizer's pipeline (see tier/offloaded_optimizer.hpp).
// The format of the moments the offloaded optimizer keeps (tier/state_codec.hpp has the formats).
enum class OptimizerStateDType : std::uint8_t { kFp32 = 0, kBf16 = 1, kInt8 = 2 };
// When the offloaded optimizer's update runs: after backward (serial), during the boundary
// micro-step's backward with the same result (exact), or one step late (delayed; not implemented).
enum class OptimizerOverlap : std::uint8_t { kSerial = 0, kExact = 1, kDelayed = 2 };

struct OptimizerPipelineConfig {
  std::uint64_t buffer_bytes = 0;    // pinned bytes for all chunk buffers together; 0: auto (256 MiB)
  std::uint64_t chunk_elements = 0;  // elements per chunk (a multiple of 1024); 0: from buffer_bytes
  // exp_avg and exp_avg_sq as fp32, bf16 or block-quantized int8 (tier.optimizer.state_dtype).
  OptimizerStateDType state_dtype = OptimizerStateDType::kFp32;
  // tier.optimizer.overlap; acted on by the adapters (tier.torch), which drive backward.
  OptimizerOverlap overlap = OptimizerOverlap::kExact;
  // Copies of the NVMe-homed state: 2 (committed and shadow; a failed step applies nothing) or 1
  // (one copy and a few spare chunks; a failed step is finished by the next step). See
  // OffloadedOptimizerOptions::state_copies.
  int state_copies = 1;
  // state_copies 1: spare chunks beyond the pipeline's buffers that an overlapped pass may update
  // ahead of the gradient norm.
  int speculation_chunks = 0;
  // An fp32 model whose parameters and state are on NVMe: each parameter's engine tensor is its fp32
  // master, which the optimizer does not keep again (4 bytes per parameter less on disk and
  // written per step). Acted on by the adapters where it applies (state_copies 1, no
  // speculation_chunks, overlap not "delayed", not Lamb); false keeps a master of the optimizer's
  // own.
  bool params_are_masters = true;
};

// Where checkpointed activations go (tier.activations.offload): left on the device (none), or
// into engine tensors homed in host memory or on NVMe.
enum class ActivationOffload : std::uint8_t { kNone = 0, kHost = 1, kNvme = 2 };

// tier.activations and DeepSpeed's activation_checkpointing; acted on by the adapters (tier.torch),
// which own the model's forward.
struct ActivationConfig {
  bool checkpoint = false;  // tier.activations.checkpoint: turn on the model's gradient checkpointing
  // tier.activations.offload; "auto": host when activation_checkpointing.cpu_checkpointing is
  // true, else none.
  ActivationOffload offload = ActivationOffload::kNone;
  bool cpu_checkpointing = false;  // activation_checkpointing.cpu_checkpointing
};

// tier: tier's own section.
struct TierConfig {
  // Byte budgets per tier; 0 means auto (device: half of the GPU's free memory at creation, a
  // quarter of physical memory on the emulated device; host: a quarter of physical memory, as an
  // unpinned cap; nvme: 4 x the host budget, at most 64 GiB). docs/configuration.md has the details.
  std::uint64_t device_budget = 0;
  std::uint64_t host_budget = 0;
  std::uint64_t nvme_budget = 0;
  DeviceKind device = DeviceKind::kAuto;
  int device_id = 0;
  int device_alloc_timeout_ms = 0;       // device allocation waits this long when the budget is full; 0: fail at once
  std::vector<std::string> swap_paths;   // empty: the offload nvme_path(s)
  std::uint64_t pinned_arena_bytes = 0;  // accepted, not acted on: tier.budgets.host sizes the arena
  HugePageMode huge_pages = HugePageMode::kAuto;
  IoOptions io;
  PrefetchConfig prefetch;
  EmulatedDeviceConfig emulated;
  int optimizer_threads = 0;  // 0: all cores
  OptimizerPipelineConfig optimizer;
  ActivationConfig activations;
  LogLevel log_level = LogLevel::kInfo;
  bool strict = false;
  // Engine: how long an acquire may wait for room on a tier whose copies are all pinned.
  std::uint64_t acquire_timeout_ms = 60'000;
  // Engine: check every invariant after every state change (slow; for tests and debugging).
  bool debug_checks = false;
  // Engine: record a timeline of every transfer, stall and adapter span and write it here as
  // Chrome trace-event JSON when the engine closes (Perfetto, chrome://tracing); "": off.
  std::string trace_file;
};

struct ConfigOptions {
  bool apply_env = true;  // apply TIER_* environment overrides
  bool strict = false;    // unknown keys are errors
};

struct EngineConfig {
  int zero_stage = 0;
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;
  AioConfig aio;
  OptimizerConfig optimizer;
  std::string scheduler_json;  // the "scheduler" object as given (applied by adapters), or ""
  int gradient_accumulation_steps = 1;
  double gradient_clipping = 0;                      // 0: off
  std::uint64_t train_batch_size = 0;                // 0: not given
  std::uint64_t train_micro_batch_size_per_gpu = 0;  // 0: not given
  Fp16Config fp16;
  bool bf16 = false;
  std::uint64_t sub_group_size = 1'000'000'000;  // elements per optimizer chunk, at most
  // Across ranks (tier.torch): elements per gradient reduce-scatter bucket, and of params
  // all-gathered ahead of use at stage 3 (zero_optimization.stage3_prefetch_bucket_size).
  std::uint64_t reduce_bucket_size = 500'000'000;
  std::uint64_t prefetch_bucket_size = 50'000'000;
  TierConfig tier;

  // One line per key accepted but not acted on, per unknown key, per environment override.
  std::vector<std::string> notes;
  // Keys given as "auto", resolved to their documented defaults.
  std::vector<std::string> auto_keys;

  static Result<EngineConfig> from_json(std::string_view json_text, const ConfigOptions& options = {});
  static Result<EngineConfig> from_file(const std::string& path, const ConfigOptions& options = {});

  // Checks relations between keys (an nvme offload needs a path, fp16 and bf16 exclude each
  // other, ...). from_json calls it; call it again after changing fields by hand.
  Status validate() const;

  // The resolved configuration in the same shape as the input (DeepSpeed keys plus "tier").
  std::string to_json(int indent = 2) const;

  // Directories that hold swap files: tier.swap_paths, else the offload nvme_paths (deduplicated).
  std::vector<std::string> resolved_swap_paths() const;
};

// The reference of every key tier reads, as a markdown table (key, allowed values, default, how
// tier treats it, its environment override); docs/configuration.md ends with it.
std::string config_reference_markdown();

}  // namespace tier
