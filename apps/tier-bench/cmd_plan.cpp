// `tier-bench plan`: will a model fit, and how fast will a step be? From a transformers
// config.json: the parameter count, the bytes each tier holds for each offload choice (as
// DeepSpeed's estimate_zero3_model_states_mem_needs does, plus activations and tier's own
// buffers), a predicted step time from the links' rates and the CPU Adam's, and the config of the
// fastest choice that fits, written out.
//
// Model of a step (single GPU, as tier runs today): forward and backward stream the offloaded
// parameters in (twice: forward and backward) and the gradients out, overlapped with compute, so
// they cost max(compute, transfers); the optimizer pass follows (it waits for backward): every
// byte it moves on the disk beside the CPU Adam, max(I/O, update). Those bytes are the state
// records read and written back, the gradients read (their engine leases) and the updated params
// written back; they share the disk at once, so they are charged at the mixed read+write rate
// (`--measure`: OffloadedOptimizer::measure_io_seconds over a scratch state, tier's own pipeline
// and request shapes), not at each direction's sequential rate.
// Compute is an input (--compute-tflops); without it the predicted time is the offload part only.
// On tier's emulated device (--emulated) the device is host memory and computes on the host's
// cores: there compute and the host->device copies add up instead of overlapping, while the disk
// (DMA, started ahead by the prefetcher) runs beside them.
//
// LoRA (--lora-r): the trainable parameters are the adapters, r x (in + out) per targeted
// projection per layer (what PEFT builds); the base is frozen in the compute dtype, streamed from
// its home like full fine-tuning's params, with no gradient and no optimizer state. Its weights
// are read once in forward and once in backward (the recompute, which keeps each layer's weights
// for that layer's backward; the input embedding is not needed there), less what the device still
// holds when a pass turns around: the blocks a pass ends with are the next one's first, so at each
// forward->backward and backward->forward turn up to the device's room of them are not read again.
// (Full fine-tuning gets the same credit except at the step's own turn: the optimizer has just
// rewritten every param.) Llama-2-7B, r=16, 1.49 GiB device: 2 x 12.6 GiB - 0.24 GiB of embedding
// - 2 x 1.41 GiB = 22.1 GiB streamed, 22.4 GiB read per step with the adapters' state and
// gradients; 22.0 GiB measured (docs/benchmarks.md).
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "io_bench.hpp"
#include "tier/cpu_adam.hpp"
#include "tier/offloaded_optimizer.hpp"
#include "tier/units.hpp"

namespace tier::bench {
namespace {

using json = nlohmann::json;

struct Shape {
  std::string family;
  std::uint64_t vocab = 0, hidden = 0, layers = 0, inter = 0, heads = 0, kv_heads = 0, head_dim = 0, positions = 0;
  bool tied = false;
  bool qkv_bias = false;
  std::uint64_t params = 0;
  std::uint64_t largest_layer = 0;  // parameters of the largest block (a decoder layer or the embedding)
  // Parameters only gathered in forward (the input embedding unless tied to the output, gpt2's
  // positions): no matmul flops, and not needed in backward when they are frozen.
  std::uint64_t input_embedding = 0;
};

// The per-layer projections PEFT's LoRA can adapt, by the name target_modules matches. A name
// matches every module whose path ends in it: gpt2's c_proj is the attention's and the MLP's.
struct Projection {
  const char* name;
  std::uint64_t in = 0, out = 0;
};

std::vector<Projection> projections_of(const Shape& s) {
  const std::uint64_t h = s.hidden, i = s.inter;
  if (s.family == "gpt_neox") {
    return {{"query_key_value", h, 3 * h}, {"dense", h, h}, {"dense_h_to_4h", h, i}, {"dense_4h_to_h", i, h}};
  }
  if (s.family == "gpt2") return {{"c_attn", h, 3 * h}, {"c_proj", h, h}, {"c_fc", h, i}, {"c_proj", i, h}};
  const std::uint64_t q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
  return {{"q_proj", h, q},    {"k_proj", h, kv}, {"v_proj", h, kv},  {"o_proj", q, h},
          {"gate_proj", h, i}, {"up_proj", h, i}, {"down_proj", i, h}};
}

// LoRA's trainable parameters per layer: r x (in + out) for each projection a target names (A is
// r x in, B is out x r; no bias). An unknown name is refused with the ones this family has.
Result<std::uint64_t> lora_per_layer(const Shape& s, std::uint64_t r, const std::vector<std::string>& targets) {
  if (targets.empty()) return invalid_argument("--lora-targets: no module named (e.g. q_proj,v_proj)");
  const std::vector<Projection> ps = projections_of(s);
  std::vector<std::string> seen;
  std::uint64_t n = 0;
  for (const std::string& t : targets) {
    if (std::find(seen.begin(), seen.end(), t) != seen.end()) continue;  // a set, as in PEFT
    seen.push_back(t);
    bool found = false;
    for (const Projection& p : ps) {
      if (t != p.name) continue;
      n += r * (p.in + p.out);
      found = true;
    }
    if (!found) {
      std::string names;
      for (const Projection& p : ps) {
        if (names.find(p.name) == std::string::npos) names += names.empty() ? p.name : str(", ", p.name);
      }
      return invalid_argument(
          str("--lora-targets: '", t, "' is not a projection of a ", s.family, " layer; choose among ", names));
    }
  }
  return n;
}

std::uint64_t get_u(const json& j, const char* key, std::uint64_t fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_number_integer() ? it->get<std::uint64_t>() : fallback;
}

// Parameter counts as transformers builds them (checked against it in tests/python/test_plan.py).
Result<Shape> shape_of(const json& c, const std::string& where) {
  Shape s;
  s.family = c.value("model_type", "");
  const auto need = [&](const char* key) -> Result<std::uint64_t> {
    auto it = c.find(key);
    if (it == c.end() || !it->is_number_integer() || it->get<long long>() <= 0) {
      return invalid_argument(
          str(where, ": '", key, "' is missing or not a positive integer (model_type '", s.family, "')"));
    }
    return it->get<std::uint64_t>();
  };
  if (s.family == "llama" || s.family == "mistral" || s.family == "qwen2" || s.family == "qwen3" ||
      s.family == "gemma" || s.family == "gemma2") {
    TIER_ASSIGN_OR_RETURN(s.vocab, need("vocab_size"));
    TIER_ASSIGN_OR_RETURN(s.hidden, need("hidden_size"));
    TIER_ASSIGN_OR_RETURN(s.layers, need("num_hidden_layers"));
    TIER_ASSIGN_OR_RETURN(s.inter, need("intermediate_size"));
    TIER_ASSIGN_OR_RETURN(s.heads, need("num_attention_heads"));
    s.kv_heads = get_u(c, "num_key_value_heads", s.heads);
    s.head_dim = c.contains("head_dim") && c["head_dim"].is_number_integer() ? c["head_dim"].get<std::uint64_t>()
                                                                             : s.hidden / s.heads;
    const bool gemma = s.family == "gemma" || s.family == "gemma2";
    s.tied = c.value("tie_word_embeddings", gemma);
    s.qkv_bias = s.family == "qwen2" || c.value("attention_bias", false);
    const std::uint64_t q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
    std::uint64_t attn = s.hidden * q + 2 * s.hidden * kv + q * s.hidden;
    if (s.qkv_bias) attn += q + 2 * kv;
    if (c.value("attention_bias", false)) attn += s.hidden;  // o_proj's bias (llama/mistral attention_bias)
    std::uint64_t norms = 2 * s.hidden;
    if (s.family == "qwen3") norms += 2 * s.head_dim;  // q_norm, k_norm
    if (s.family == "gemma2") norms += 2 * s.hidden;   // pre/post feed-forward norms
    const std::uint64_t mlp = 3 * s.hidden * s.inter + (c.value("mlp_bias", false) ? 2 * s.inter + s.hidden : 0);
    const std::uint64_t layer = attn + mlp + norms;
    s.params = s.vocab * s.hidden + s.layers * layer + s.hidden + (s.tied ? 0 : s.vocab * s.hidden);
    s.largest_layer = std::max(layer, s.vocab * s.hidden);
    s.input_embedding = s.tied ? 0 : s.vocab * s.hidden;
  } else if (s.family == "gpt_neox") {
    TIER_ASSIGN_OR_RETURN(s.vocab, need("vocab_size"));
    TIER_ASSIGN_OR_RETURN(s.hidden, need("hidden_size"));
    TIER_ASSIGN_OR_RETURN(s.layers, need("num_hidden_layers"));
    TIER_ASSIGN_OR_RETURN(s.inter, need("intermediate_size"));
    TIER_ASSIGN_OR_RETURN(s.heads, need("num_attention_heads"));
    s.tied = c.value("tie_word_embeddings", false);
    const bool bias = c.value("attention_bias", true);
    const std::uint64_t h = s.hidden;
    const std::uint64_t layer =
        3 * h * h + (bias ? 3 * h : 0) + h * h + (bias ? h : 0) + h * s.inter + s.inter + s.inter * h + h + 4 * h;
    s.params = s.vocab * h + s.layers * layer + 2 * h + (s.tied ? 0 : s.vocab * h);
    s.largest_layer = std::max(layer, s.vocab * h);
    s.input_embedding = s.tied ? 0 : s.vocab * h;
  } else if (s.family == "gpt2") {
    TIER_ASSIGN_OR_RETURN(s.vocab, need("vocab_size"));
    TIER_ASSIGN_OR_RETURN(s.hidden, need("n_embd"));
    TIER_ASSIGN_OR_RETURN(s.layers, need("n_layer"));
    TIER_ASSIGN_OR_RETURN(s.heads, need("n_head"));
    TIER_ASSIGN_OR_RETURN(s.positions, need("n_positions"));
    const std::uint64_t h = s.hidden, i = get_u(c, "n_inner", 4 * h);
    s.inter = i;
    s.tied = true;
    const std::uint64_t layer = h * 3 * h + 3 * h + h * h + h + h * i + i + i * h + h + 4 * h;
    s.params = s.vocab * h + s.positions * h + s.layers * layer + 2 * h;
    s.largest_layer = std::max(layer, s.vocab * h);
    s.input_embedding = s.positions * h;  // the token embedding is also the output layer
  } else {
    return unsupported(str(where, ": model_type '", s.family,
                           "' is not one tier-bench plan counts (llama, mistral, qwen2, qwen3, gemma, gemma2, "
                           "gpt_neox, gpt2)"));
  }
  return s;
}

struct Rates {
  double nvme_read = 3.0e9, nvme_write = 2.5e9;  // bytes/s
  // Bytes/s, read and written together, of a pass that reads and writes at once (the optimizer's);
  // 0: not known, taken as the two directions served in turn (see mixed_rate).
  double nvme_mixed = 0;
  std::string mixed_source = "from read and write";  // or "given", "measured"
  double h2d = 20e9, d2h = 20e9;                     // bytes/s
  double adam = 1.0e9;                               // parameters/s
  double compute = 0;                                // FLOP/s; 0: unknown
  std::string source = "assumed";
};

struct Choice {
  std::string name, params_home, optimizer_home;
  double device = 0, host = 0, nvme = 0;  // bytes
  // What the device holds at its peak when its size is --gpu: streamed blocks stay cached up to
  // it (the engine's budget), so between `device` and --gpu.
  double device_peak = 0;
  double h2d_per_step = 0, nvme_read_per_step = 0;  // bytes
  // Streamed params: the device bytes with room to prefetch two blocks ahead (`device` is the
  // least the engine can run in: the largest block and its gradient, no prefetch).
  double device_prefetch = 0;
  bool prefetch_limited = false;  // fits in device, not in device_prefetch: transfers stall compute
  double fwd_bwd = 0, optimizer = 0, step = 0;
  bool fits = false;
  std::string why_not;
};

double gib(double b) {
  return b / double(1ull << 30);
}

// The rate a 1:1 read+write pass is charged at: the measured one, else each direction's
// sequential rate for half the bytes (what a disk that never overlaps the two would do).
double mixed_rate(const Rates& r) {
  return r.nvme_mixed > 0 ? r.nvme_mixed : 2.0 / (1.0 / r.nvme_read + 1.0 / r.nvme_write);
}

// The optimizer's own mixed pass (measure_io_seconds: every chunk record read from its committed
// slot and written to its shadow through the pipeline) over a scratch state of `elements` in
// `dir`: bytes read + written per second. One untimed pass first (a file system may convert
// preallocated extents on their first write); the mean of two timed passes.
Result<double> measure_mixed(const std::string& dir, std::uint64_t elements) {
  optim::OffloadedOptimizerOptions o;
  o.home = optim::StateHome::kNvme;
  o.max_elements = elements;
  o.max_partitions = 1;
  o.groups = {cpu::AdamHyperParams{}};
  o.swap_options.paths = {dir};
  TIER_ASSIGN_OR_RETURN(auto opt, optim::OffloadedOptimizer::create(o));
  optim::PartitionSpec ps;
  ps.numel = elements;
  TIER_RETURN_IF_ERROR(opt->add_partition(ps).status());
  TIER_RETURN_IF_ERROR(opt->finish_registration());
  TIER_RETURN_IF_ERROR(opt->measure_io_seconds().status());
  double bytes = 0, seconds = 0;
  for (int k = 0; k < 2; ++k) {
    TIER_ASSIGN_OR_RETURN(optim::PassReport r, opt->measure_io_seconds());
    bytes += static_cast<double>(r.bytes_read + r.bytes_written);
    seconds += r.seconds;
  }
  if (seconds <= 0) return internal_error("the mixed pass took no time");
  return bytes / seconds;
}

int run_plan(Args& args) {
  Status s;
  auto take = [&](auto r, auto& into) { take_option(s, std::move(r), into); };
  std::string model = args.get("model", "");
  std::uint64_t gpu = 24ull << 30, host = 0, nvme_bytes = 0, batch = 1, seq = 2048, gas = 1, host_budget = 0;
  take(args.size("gpu", gpu), gpu);
  take(args.size("host", host), host);
  take(args.size("nvme-size", nvme_bytes), nvme_bytes);
  take(args.size("host-budget", host_budget), host_budget);
  take(args.count("batch", batch), batch);
  take(args.count("seq", seq), seq);
  take(args.count("gas", gas), gas);
  // tier.optimizer.state_copies: the optimizer's NVMe state once (and spare chunks) or twice.
  long long state_copies = 1;
  take(args.integer("state-copies", 1), state_copies);
  std::string nvme_dir = args.get("nvme", "");
  std::string dtype = "bf16";
  take(args.choice("dtype", {"bf16", "fp16", "fp32"}, "bf16"), dtype);
  // Activations: kept whole (none), recomputed from each layer's checkpointed input (recompute),
  // or recomputed with the checkpoints offloaded to host memory or NVMe (tier.activations.offload).
  const bool no_checkpointing = args.flag("no-checkpointing");
  std::string act_mode = "recompute";
  take(args.choice("activations", {"none", "recompute", "host", "nvme"}, no_checkpointing ? "none" : "recompute"),
       act_mode);
  Rates rates;
  double tflops = 0, nvme_read = 0, nvme_write = 0, nvme_mixed = 0, h2d = 0, adam = 0;
  take(args.number("compute-tflops", 0), tflops);
  take(args.number("nvme-read-gbps", 0), nvme_read);
  take(args.number("nvme-write-gbps", 0), nvme_write);
  take(args.number("nvme-mixed-gbps", 0), nvme_mixed);
  take(args.number("h2d-gbps", 0), h2d);
  take(args.number("adam-gparams", 0), adam);
  // LoRA over a frozen base, and K of the model's layers (a layer-sampled run's shape).
  long long lora_r = 0, layers_k = 0;
  take(args.integer("lora-r", 0), lora_r);
  const bool targets_given = args.has("lora-targets");
  const std::vector<std::string> lora_targets = split_list(args.get("lora-targets", "q_proj,k_proj,v_proj,o_proj"));
  take(args.integer("layers", 0), layers_k);
  const bool emulated = args.flag("emulated");
  const bool measure = args.flag("measure");
  // The bytes --measure moves each way: a virtual disk's write-back cache takes a short burst
  // faster than it sustains a step's traffic, so a bench judging runs of gigabytes measures as many.
  std::uint64_t measure_bytes = 512ull << 20;
  take(args.size("measure-bytes", measure_bytes), measure_bytes);
  const bool json_out = args.flag("json");
  const std::string write_config = args.get("write-config", "");
  if (Status f = args.finish(); s.ok() && !f.ok()) s = f;
  if (s.ok() && model.empty()) s = invalid_argument("--model: a transformers config.json or a model directory");
  if (s.ok() && state_copies != 1 && state_copies != 2) {
    s = invalid_argument(str("--state-copies ", state_copies, ": 1 (the default) or 2 (tier.optimizer.state_copies)"));
  }
  if (s.ok() && measure && nvme_dir.empty())
    s = invalid_argument("--measure needs --nvme DIR (where to time the disk)");
  if (s.ok() && lora_r < 0) {
    s = invalid_argument(
        str("--lora-r ", lora_r, ": the adapters' rank is a positive integer (0, the default: a full ", "fine-tune)"));
  }
  if (s.ok() && targets_given && lora_r == 0)
    s = invalid_argument("--lora-targets needs --lora-r (the adapters' rank)");
  if (s.ok() && args.has("layers") && layers_k <= 0) {
    s = invalid_argument(
        str("--layers ", layers_k, ": the number of decoder layers to plan for is a positive integer"));
  }
  if (!s.ok()) {
    std::fprintf(stderr, "tier-bench plan: %s\n", s.message().c_str());
    return 2;
  }
  std::string path = model;
  if (std::filesystem::is_directory(path)) path += "/config.json";
  std::ifstream f(path);
  if (!f) {
    std::fprintf(stderr, "tier-bench plan: cannot read %s\n", path.c_str());
    return 2;
  }
  json cfg = json::parse(f, nullptr, false);
  if (cfg.is_discarded() || !cfg.is_object()) {
    std::fprintf(stderr, "tier-bench plan: %s is not a JSON object\n", path.c_str());
    return 2;
  }
  std::uint64_t config_layers = 0;
  if (layers_k > 0) {
    // The same widths with K layers: what a layer-sampled run (finetune_llama --layers K) builds.
    const char* key = cfg.value("model_type", "") == "gpt2" ? "n_layer" : "num_hidden_layers";
    config_layers = get_u(cfg, key, 0);
    cfg[key] = static_cast<std::uint64_t>(layers_k);
  }
  auto shape_r = shape_of(cfg, path);
  if (!shape_r.ok()) {
    std::fprintf(stderr, "tier-bench plan: %s\n", shape_r.status().message().c_str());
    return 2;
  }
  const Shape sh = *shape_r;
  std::uint64_t adapters = 0;  // LoRA's trainable parameters
  if (lora_r > 0) {
    auto per_layer = lora_per_layer(sh, static_cast<std::uint64_t>(lora_r), lora_targets);
    if (!per_layer.ok()) {
      std::fprintf(stderr, "tier-bench plan: %s\n", per_layer.status().message().c_str());
      return 2;
    }
    adapters = *per_layer * sh.layers;
  }
  const bool lora = lora_r > 0;
  if (host == 0)
    host = static_cast<std::uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
  if (nvme_bytes == 0 && !nvme_dir.empty()) {
    struct statvfs v {};
    if (statvfs(nvme_dir.c_str(), &v) == 0) nvme_bytes = static_cast<std::uint64_t>(v.f_bavail) * v.f_frsize;
  }

  // Rates: measured (--measure), given, or assumed.
  if (nvme_read > 0) rates.nvme_read = nvme_read * 1e9, rates.source = "given";
  if (nvme_write > 0) rates.nvme_write = nvme_write * 1e9, rates.source = "given";
  if (nvme_mixed > 0) rates.nvme_mixed = nvme_mixed * 1e9, rates.source = rates.mixed_source = "given";
  if (h2d > 0) rates.h2d = rates.d2h = h2d * 1e9, rates.source = "given";
  if (adam > 0) rates.adam = adam * 1e9, rates.source = "given";
  rates.compute = tflops * 1e12;
  if (measure) {
    for (bool write : {false, true}) {
      IoBenchSpec spec;
      spec.paths = {nvme_dir};
      spec.size = measure_bytes;
      spec.block_size = 1 << 20;
      spec.queue_depth = 32;
      spec.write = write;
      spec.progress = false;
      auto r = run_io_bench(spec);
      if (!r.ok()) {
        std::fprintf(stderr, "tier-bench plan: measuring %s: %s\n", nvme_dir.c_str(), r.status().message().c_str());
        return 1;
      }
      (write ? rates.nvme_write : rates.nvme_read) = r->bytes_per_second;
    }
    if (nvme_mixed <= 0) {
      // 1.5x --measure-bytes of fp32 records each way per pass (12 bytes an element): by default
      // 64 Mi elements, 768 MiB each way, 1.5 GiB of files (removed).
      auto m = measure_mixed(nvme_dir, std::max<std::uint64_t>(measure_bytes / 8, 1ull << 20));
      if (!m.ok()) {
        std::fprintf(stderr, "tier-bench plan: measuring the optimizer's mixed pass in %s: %s\n", nvme_dir.c_str(),
                     m.status().message().c_str());
        return 1;
      }
      rates.nvme_mixed = *m;
      rates.mixed_source = "measured";
    }
    const std::uint64_t n = 16u << 20;
    std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f), g(n, 1e-3f);
    auto step = cpu::AdamStep::make(cpu::AdamHyperParams{}, 1).value();
    const cpu::AdamTensors t{{p.data(), DType::kF32, n},
                             {m.data(), DType::kF32, n},
                             {v.data(), DType::kF32, n},
                             cpu::ConstTensorRef(g.data(), DType::kF32, n),
                             {}};
    cpu::adam_update(step, t).ignore();  // warm-up (pages, threads)
    const auto t0 = std::chrono::steady_clock::now();
    Status st = cpu::adam_update(step, t);
    st = st.ok() ? cpu::adam_update(step, t) : st;
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!st.ok()) {
      std::fprintf(stderr, "tier-bench plan: measuring the CPU Adam: %s\n", st.message().c_str());
      return 1;
    }
    rates.adam = 2.0 * n / sec;
    rates.source = rates.source == "given" ? "measured and given" : "measured";
  }

  // N: the model's parameters; stored: with LoRA's adapters; trained: what has gradients and
  // optimizer state (the adapters, or every parameter).
  const double N = static_cast<double>(sh.params), T = static_cast<double>(adapters);
  const double stored = N + T, trained = lora ? T : N;
  const double pb = dtype == "fp32" ? 4 : 2;  // bytes per parameter on the device (params, grads)
  const double tokens = static_cast<double>(batch * seq);
  // Activations per micro-batch (Megatron's estimate for one layer, S*B*H*(34 + 5*a*S/H) bytes in
  // 16-bit): with checkpointing, one layer's full set plus each layer's 2-byte input; the logits
  // and their gradient in fp32.
  const double H = static_cast<double>(sh.hidden), L = static_cast<double>(sh.layers);
  const double a = static_cast<double>(sh.heads), S = static_cast<double>(seq), B = static_cast<double>(batch);
  const double per_layer = S * B * H * (34.0 + 5.0 * a * S / H) * (pb / 2.0);
  const double logits = 2.0 * tokens * static_cast<double>(sh.vocab) * 4.0;
  const double checkpoint = S * B * H * pb;  // one layer's input, what recomputing it starts from
  struct ActivationChoice {
    std::string mode;
    double device = 0, host = 0, nvme = 0;
    double moved = 0;    // bytes per micro-step between the device and the checkpoints' home
    double seconds = 0;  // the time those transfers take, per step (overlapped with compute)
  };
  auto activation_choice = [&](const std::string& mode) {
    ActivationChoice c;
    c.mode = mode;
    if (mode == "none") {
      c.device = L * per_layer + logits;
      return c;
    }
    // Recompute: one layer's full set during its backward, plus the checkpoints. Offloaded, the
    // device holds the one being recomputed and the one prefetched for the next.
    c.device = per_layer + logits + (mode == "recompute" ? L * checkpoint : std::min(L, 2.0) * checkpoint);
    if (mode == "host") c.host = L * checkpoint;
    if (mode == "nvme") {
      c.host = std::min(L, 2.0) * checkpoint;  // staged on their way
      c.nvme = L * checkpoint;
    }
    if (mode != "recompute") {
      c.moved = 2.0 * L * checkpoint;  // out in forward, back in backward
      const double g = static_cast<double>(gas);
      c.seconds = L * checkpoint * g / rates.d2h + L * checkpoint * g / rates.h2d;
      if (mode == "nvme") {
        c.seconds = std::max(c.seconds, L * checkpoint * g / rates.nvme_write + L * checkpoint * g / rates.nvme_read);
      }
    }
    return c;
  };
  std::vector<ActivationChoice> act_choices;
  for (const char* m : {"none", "recompute", "host", "nvme"}) act_choices.push_back(activation_choice(m));
  const ActivationChoice act = activation_choice(act_mode);
  const double acts = act.device;
  // Streaming working set: the largest block in flight and its gradient at least (LoRA: the
  // frozen block and its adapters' share); with the next two prefetched, twice that.
  const double largest = static_cast<double>(sh.largest_layer);
  const double working_min = lora ? largest * pb + 2.0 * pb * T / L : 2.0 * largest * pb;
  const double working = 2.0 * working_min;
  const double buffers = 256.0 * (1 << 20);  // the optimizer's pipeline buffers (tier.optimizer.buffer_bytes)
  const double hb = host_budget ? static_cast<double>(host_budget) : std::max(2.0 * (1ull << 30), 6.0 * largest * 4.0);
  // Flops per step: forward 2 per matmul parameter and token; backward 2 for the activations'
  // gradients and 2 more for the weights' (LoRA: the adapters' only); recomputing repeats the
  // forward. The input embedding is a gather, not a matmul (the 6N rule counts it: 20% too many
  // for Llama-7B's shape at 2 layers).
  const double g = static_cast<double>(gas);
  const double matmul = stored - static_cast<double>(sh.input_embedding);
  const double fwd_flops = 2.0 * matmul * tokens;
  const double flops =
      g * (fwd_flops * (act_mode == "none" ? 1.0 : 2.0) + 2.0 * matmul * tokens + 2.0 * (lora ? T : matmul) * tokens);
  const double compute = rates.compute > 0 ? flops / rates.compute : 0.0;
  // Weights each pass reads (bytes): forward all of them; backward all but a frozen input
  // embedding (full fine-tuning's is counted: its gradient is accumulated in place).
  const double fwd_bytes = pb * stored;
  const double bwd_bytes = pb * (stored - (lora ? static_cast<double>(sh.input_embedding) : 0.0));

  std::vector<Choice> choices;
  auto add = [&](std::string name, std::string ph, std::string oh) {
    Choice c;
    c.name = std::move(name);
    c.params_home = std::move(ph);
    c.optimizer_home = std::move(oh);
    const bool p_off = c.params_home != "none", o_off = c.optimizer_home != "none";
    const bool p_nvme = c.params_home == "nvme", o_nvme = c.optimizer_home == "nvme";
    const double state_on_device = o_off ? 0.0 : 12.0 * trained;
    // Device: every param and its gradient where they stay, else the streaming working set.
    const double everything = pb * stored + pb * trained + acts + state_on_device;
    c.device = p_off ? working_min + acts + state_on_device : everything;
    c.device_prefetch = p_off ? working + acts + state_on_device : c.device;
    // Streamed, the gradients leave as they are made (measured: a 1-layer 7B full fine-tune
    // peaked at its params and activations); the params stay cached up to --gpu.
    const double cached = p_off ? pb * stored + acts + state_on_device : everything;
    c.device_peak = std::max(c.device, std::min(cached, static_cast<double>(gpu)));
    // Host: what lives there, or (for NVMe homes) what the host budget stages, up to the budget.
    if (p_nvme || o_nvme) {
      const double staged =
          (p_nvme ? pb * stored + 4.0 * trained : 0.0) + (o_nvme ? std::min(buffers, 12.0 * trained) : 0.0);
      c.host = std::min(hb, staged);
    }
    c.host += act.host;
    c.nvme += act.nvme;
    if (c.params_home == "cpu") c.host += pb * stored + 4.0 * trained;  // params and fp32 gradient sums
    if (c.optimizer_home == "cpu") c.host += 12.0 * trained + (p_off ? 0.0 : 4.0 * trained) + buffers;
    // NVMe: the optimizer's state (once and a spare chunk per pipeline buffer, or a committed and a
    // next copy: tier.optimizer.state_copies), params (and room to stage them), gradients.
    // An fp32 model on NVMe with the state once: its parameters are the masters
    // (tier.optimizer.params_are_masters), so the records hold m and v only.
    const bool masters_in_params = p_nvme && o_nvme && dtype == "fp32" && state_copies == 1;
    const double record = masters_in_params ? 8.0 : 12.0;  // bytes per element of a chunk record
    if (o_nvme) {
      // A record per pipeline buffer, whose bytes hold a record and 4 B per element (the staging,
      // or the master section).
      const double spares = state_copies == 1 ? buffers * record / (record + 4.0) : 0.0;
      c.nvme += record * static_cast<double>(state_copies) * trained + spares + 4.0 * trained;
    }
    if (p_nvme) c.nvme += pb * stored;
    // Streamed weights per step: each micro-step's forward and backward read them, less what the
    // device still holds at each turn between passes (its room beside activations and state).
    // LoRA's frozen base is the same at every turn; full fine-tuning's step rewrites every param,
    // so its own turn gets nothing, and what fits whole is read once per step.
    if (p_off) {
      const double room = std::max(0.0, static_cast<double>(gpu) - acts - state_on_device);
      if (lora && fwd_bytes <= room) {
        c.h2d_per_step = 0;  // the whole model stays on the device
      } else {
        const double turns = lora ? 2.0 * g : 2.0 * g - 1.0;
        c.h2d_per_step = std::max(0.0, g * (fwd_bytes + bwd_bytes) - turns * std::min({room, fwd_bytes, bwd_bytes}));
      }
    }
    if (p_nvme) c.nvme_read_per_step = c.h2d_per_step;
    if (o_nvme) c.nvme_read_per_step += 16.0 * trained;  // the state records and the fp32 gradients
    if (act.mode == "nvme") c.nvme_read_per_step += L * checkpoint * g;
    // Time: the streamed weights, gradients out, overlapped with compute on a GPU; on the emulated
    // device everything shares the host's cores and adds up.
    const double h2d_s = c.h2d_per_step / rates.h2d;
    // The disk in forward and backward: the streamed weights read, and the fp32 gradient sums
    // written to their NVMe home as backward makes them.
    const double nvme_s =
        (p_nvme ? c.h2d_per_step / rates.nvme_read : 0.0) + (o_nvme ? 4.0 * trained * g / rates.nvme_write : 0.0);
    const double grads_s = o_off ? pb * trained * g / rates.d2h : 0.0;
    if (emulated) {
      // The host's cores compute, copy to the "device" and take the gradients back, one after
      // another; the disk's reads and writes are DMA (io_uring), which the prefetcher starts ahead
      // of use, so they run beside them.
      c.fwd_bwd = std::max(compute + h2d_s + grads_s + act.seconds, nvme_s);
    } else {
      c.fwd_bwd = std::max(compute, std::max(h2d_s, nvme_s) + grads_s + act.seconds);
    }
    if (o_nvme) {
      // Every byte the pass moves, per trained parameter: 12 B of state records read and 12 B
      // written back, the 4 B fp32 gradient read (p_nvme: from the engine's NVMe file, through its
      // lease), and the updated params written (pb B; p_nvme: to the engine's file). They go at
      // once, so all at the mixed rate.
      // With the params as masters: 8 B of records each way, the master read through the
      // parameter's lease (4 B) and written home once (pb).
      const double io =
          (masters_in_params ? 8.0 + 8.0 + 4.0 + 4.0 + pb : 12.0 + 12.0 + 4.0 + pb) * trained / mixed_rate(rates);
      c.optimizer = std::max(io, trained / rates.adam);
    } else if (o_off) {
      c.optimizer = trained / rates.adam;
    }
    c.step = c.fwd_bwd + c.optimizer;
    std::vector<std::string> over;
    if (c.device > static_cast<double>(gpu))
      over.push_back(str("device ", fmt(gib(c.device), 1), " GiB > ", fmt(gib(gpu), 1)));
    if (c.host > static_cast<double>(host))
      over.push_back(str("host ", fmt(gib(c.host), 1), " GiB > ", fmt(gib(host), 1)));
    if (c.nvme > 0 && c.nvme > static_cast<double>(nvme_bytes)) {
      over.push_back(nvme_bytes ? str("NVMe ", fmt(gib(c.nvme), 1), " GiB > ", fmt(gib(nvme_bytes), 1))
                                : "no --nvme given");
    }
    c.fits = over.empty();
    c.prefetch_limited = c.fits && c.device_prefetch > static_cast<double>(gpu);
    for (std::size_t i = 0; i < over.size(); ++i) c.why_not += (i ? "; " : "") + over[i];
    choices.push_back(c);
  };
  add("all on the GPU", "none", "none");
  add("optimizer in host memory", "none", "cpu");
  add("optimizer on NVMe", "none", "nvme");
  add("params + optimizer in host memory", "cpu", "cpu");
  add("params + optimizer on NVMe", "nvme", "nvme");

  const Choice* best = nullptr;
  for (const Choice& c : choices) {
    if (c.fits && (best == nullptr || c.step < best->step)) best = &c;
  }
  json out_cfg;
  if (best != nullptr) {
    out_cfg["train_micro_batch_size_per_gpu"] = batch;
    out_cfg["gradient_accumulation_steps"] = gas;
    out_cfg["zero_optimization"]["stage"] = 3;
    // A config the engine can train with as written: AdamW at a common fine-tuning rate, to edit.
    out_cfg["optimizer"] = {{"type", "AdamW"},
                            {"params", {{"lr", 2e-5}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}, {"weight_decay", 0.0}}}};
    auto home = [&](const std::string& h) {
      json j{{"device", h == "cpu" ? "cpu" : h == "nvme" ? "nvme" : "none"}};
      if (h == "nvme") j["nvme_path"] = nvme_dir.empty() ? "/path/to/nvme" : nvme_dir;
      return j;
    };
    out_cfg["zero_optimization"]["offload_param"] = home(best->params_home);
    out_cfg["zero_optimization"]["offload_optimizer"] = home(best->optimizer_home);
    if (dtype != "fp32") out_cfg[dtype]["enabled"] = true;
    if (act_mode != "none") out_cfg["tier"]["activations"]["checkpoint"] = true;
    if (act_mode == "host" || act_mode == "nvme") out_cfg["tier"]["activations"]["offload"] = act_mode;
    if (best->params_home == "nvme" || best->optimizer_home == "nvme") {
      out_cfg["tier"]["budgets"]["host"] = static_cast<std::uint64_t>(hb);
    }
    if (!write_config.empty()) {
      if (Status s = write_file_atomically(write_config, out_cfg.dump(2) + "\n"); !s.ok()) {
        std::fprintf(stderr, "tier-bench plan: cannot write %s: %s\n", write_config.c_str(), s.to_string().c_str());
        return 1;
      }
    }
  }

  if (json_out) {
    nlohmann::ordered_json j;
    j["model"] = path;
    j["model_type"] = sh.family;
    j["parameters"] = sh.params;
    j["largest_block_parameters"] = sh.largest_layer;
    j["layers"] = sh.layers;
    j["config_layers"] = config_layers ? config_layers : sh.layers;
    j["trainable_parameters"] = static_cast<std::uint64_t>(trained);
    if (lora) {
      j["lora"] = {{"r", lora_r}, {"targets", lora_targets}, {"adapter_parameters", adapters}};
    } else {
      j["lora"] = nullptr;
    }
    j["dtype"] = dtype;
    j["device_kind"] = emulated ? "emulated" : "gpu";
    j["flops_per_step"] = flops;
    j["activation_bytes"] = acts;
    j["activation_mode"] = act_mode;
    j["activations"] = json::array();
    for (const ActivationChoice& c : act_choices) {
      j["activations"].push_back({{"mode", c.mode},
                                  {"device_bytes", c.device},
                                  {"host_bytes", c.host},
                                  {"nvme_bytes", c.nvme},
                                  {"moved_bytes_per_micro_step", c.moved},
                                  {"transfer_seconds", c.seconds}});
    }
    j["rates"] = {{"source", rates.source},
                  {"nvme_read_bytes_per_second", rates.nvme_read},
                  {"nvme_write_bytes_per_second", rates.nvme_write},
                  {"nvme_mixed_bytes_per_second", mixed_rate(rates)},
                  {"nvme_mixed_source", rates.mixed_source},
                  {"h2d_bytes_per_second", rates.h2d},
                  {"adam_params_per_second", rates.adam},
                  {"compute_flops_per_second", rates.compute}};
    j["choices"] = json::array();
    for (const Choice& c : choices) {
      j["choices"].push_back({{"name", c.name},
                              {"offload_param", c.params_home},
                              {"offload_optimizer", c.optimizer_home},
                              {"device_bytes", c.device},
                              {"device_prefetch_bytes", c.device_prefetch},
                              {"prefetch_limited", c.prefetch_limited},
                              {"device_peak_bytes", c.device_peak},
                              {"host_bytes", c.host},
                              {"nvme_bytes", c.nvme},
                              {"host_to_device_bytes_per_step", c.h2d_per_step},
                              {"nvme_read_bytes_per_step", c.nvme_read_per_step},
                              {"forward_backward_seconds", c.fwd_bwd},
                              {"optimizer_seconds", c.optimizer},
                              {"step_seconds", c.step},
                              {"fits", c.fits},
                              {"why_not", c.why_not}});
    }
    j["recommended"] = best ? json(best->name) : json(nullptr);
    j["config"] = best ? out_cfg : json(nullptr);
    std::printf("%s\n", j.dump(2).c_str());
    return best ? 0 : 3;
  }
  std::printf(
      "%s (%s%s): %.3f B parameters, %s; batch %llu x %llu tokens, accumulation %llu%s\n", path.c_str(),
      sh.family.c_str(), config_layers ? str(", ", sh.layers, " of its ", config_layers, " layers").c_str() : "",
      N / 1e9, dtype.c_str(), static_cast<unsigned long long>(batch), static_cast<unsigned long long>(seq),
      static_cast<unsigned long long>(gas),
      act_mode == "none"        ? ""
      : act_mode == "recompute" ? ", activation checkpointing"
                                : str(", activation checkpointing, checkpoints offloaded to ", act_mode).c_str());
  if (lora) {
    std::string names;
    for (const std::string& t : lora_targets) names += (names.empty() ? "" : ",") + t;
    std::printf(
        "LoRA r=%lld on %s: %.2f M trained parameters (fp32 masters and Adam state) over the frozen base "
        "(%s, no gradients, no optimizer state)\n",
        lora_r, names.c_str(), T / 1e6, dtype.c_str());
  }
  if (emulated) {
    std::printf(
        "emulated device: compute and host->device copies share the host's cores (added up); the disk runs "
        "beside them\n");
  }
  std::printf(
      "rates (%s): NVMe read %s, write %s, mixed %s%s; host->device %s; CPU Adam %.2f G params/s; compute %s\n\n",
      rates.source.c_str(), format_rate(rates.nvme_read).c_str(), format_rate(rates.nvme_write).c_str(),
      format_rate(mixed_rate(rates)).c_str(),
      rates.mixed_source == "from read and write" ? " (from read and write)" : "", format_rate(rates.h2d).c_str(),
      rates.adam / 1e9,
      rates.compute > 0 ? str(fmt(rates.compute / 1e12, 1), " TFLOP/s").c_str() : "not given (times exclude it)");
  Table table({"offload", "device", "device peak", "host", "NVMe", "NVMe read/step", "fwd+bwd s", "optimizer s",
               "step s", "fits"});
  for (const Choice& c : choices) {
    table.add({c.name, str(fmt(gib(c.device), 2), " GiB"), str(fmt(gib(c.device_peak), 2), " GiB"),
               str(fmt(gib(c.host), 2), " GiB"), c.nvme > 0 ? str(fmt(gib(c.nvme), 2), " GiB") : "-",
               c.nvme_read_per_step > 0 ? str(fmt(gib(c.nvme_read_per_step), 2), " GiB") : "-", fmt(c.fwd_bwd, 2),
               fmt(c.optimizer, 2), fmt(c.step, 2),
               c.fits
                   ? (c.prefetch_limited ? str("yes, without prefetch (", fmt(gib(c.device_prefetch), 2), " GiB with)")
                                         : std::string("yes"))
                   : str("no: ", c.why_not)});
  }
  table.print();
  std::printf("\nactivations per micro-batch (the offload table above uses --activations %s):\n", act_mode.c_str());
  Table at({"activations", "device", "host", "NVMe", "moved per micro-step", "transfer s per step"});
  for (const ActivationChoice& c : act_choices) {
    const char* label = c.mode == "none"        ? "kept (no checkpointing)"
                        : c.mode == "recompute" ? "recomputed"
                        : c.mode == "host"      ? "recomputed, checkpoints in host memory"
                                                : "recomputed, checkpoints on NVMe";
    at.add({label, str(fmt(gib(c.device), 2), " GiB"), c.host > 0 ? str(fmt(gib(c.host), 2), " GiB") : "-",
            c.nvme > 0 ? str(fmt(gib(c.nvme), 2), " GiB") : "-", c.moved > 0 ? str(fmt(gib(c.moved), 2), " GiB") : "-",
            c.seconds > 0 ? fmt(c.seconds, 2) : "-"});
  }
  at.print();
  if (best == nullptr) {
    std::printf("\nnothing fits: give a larger --gpu, --host or an --nvme directory with room\n");
    return 3;
  }
  std::printf("\nrecommended: %s\n%s\n", best->name.c_str(), out_cfg.dump(2).c_str());
  if (!write_config.empty()) std::printf("(written to %s)\n", write_config.c_str());
  return 0;
}

const CommandRegistrar kRegister(
    {"plan", "memory per tier and predicted step time of a transformers model for each offload choice",
     "  --model PATH          a transformers config.json, or a model directory holding one (required)\n"
     "  --gpu N               device memory (default 24G)\n"
     "  --host N              host memory for tier (default: physical memory)\n"
     "  --host-budget N       tier.budgets.host for NVMe homes (default: max(2G, 6 largest blocks))\n"
     "  --nvme DIR            the swap directory (its free space; --measure times it)\n"
     "  --nvme-size N         NVMe bytes available, instead of DIR's free space\n"
     "  --batch N --seq N --gas N   micro-batch, sequence length, accumulation (default 1, 2048, 1)\n"
     "  --dtype D             bf16|fp16|fp32 compute dtype (default bf16)\n"
     "  --state-copies N      the optimizer's NVMe state kept once (1, the default, with a spare chunk per\n"
     "                        pipeline buffer) or twice (2): tier.optimizer.state_copies\n"
     "  --activations M       none|recompute|host|nvme: activations kept whole, recomputed from checkpointed\n"
     "                        layer inputs (default), or recomputed with those inputs offloaded\n"
     "  --no-checkpointing    the same as --activations none\n"
     "  --compute-tflops F    the device's sustained TFLOP/s (default: not counted)\n"
     "  --emulated            tier's emulated device: it computes on the host's cores, so compute and copies\n"
     "                        add up instead of overlapping (the disk runs beside them)\n"
     "  --lora-r R            LoRA adapters of rank R over the frozen base (default 0: a full fine-tune)\n"
     "  --lora-targets LIST   the projections LoRA adapts (default q_proj,k_proj,v_proj,o_proj)\n"
     "  --layers K            plan for K decoder layers of the model (a layer-sampled run's shape)\n"
     "  --measure             time the NVMe (in --nvme: sequential reads, writes, and the optimizer's mixed\n"
     "                        read+write pass over 1.5 GiB of scratch files) and the CPU Adam here\n"
     "  --measure-bytes N     bytes --measure reads and writes (default 512M; the mixed pass 1.5x that each\n"
     "                        way): a short burst can run faster than the disk sustains\n"
     "  --nvme-read-gbps F --nvme-write-gbps F --nvme-mixed-gbps F --h2d-gbps F --adam-gparams F\n"
     "                        rates to assume (mixed: read and written bytes together per second;\n"
     "                        default: the read and write rates served in turn)\n"
     "  --write-config FILE   write the recommended config\n"
     "  --json                print one JSON object",
     run_plan});

}  // namespace
}  // namespace tier::bench
