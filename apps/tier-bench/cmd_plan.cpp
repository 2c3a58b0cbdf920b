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
};

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
  const bool measure = args.flag("measure");
  const bool json_out = args.flag("json");
  const std::string write_config = args.get("write-config", "");
  if (Status f = args.finish(); s.ok() && !f.ok()) s = f;
  if (s.ok() && model.empty()) s = invalid_argument("--model: a transformers config.json or a model directory");
  if (s.ok() && measure && nvme_dir.empty())
    s = invalid_argument("--measure needs --nvme DIR (where to time the disk)");
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
  auto shape_r = shape_of(cfg, path);
  if (!shape_r.ok()) {
    std::fprintf(stderr, "tier-bench plan: %s\n", shape_r.status().message().c_str());
    return 2;
  }
  const Shape sh = *shape_r;
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
      spec.size = 512ull << 20;
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
      // 64 Mi elements: 768 MiB of fp32 records each way per pass, 1.5 GiB of files (removed).
      auto m = measure_mixed(nvme_dir, 64ull << 20);
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

  const double N = static_cast<double>(sh.params);
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
  // Streaming working set: the largest block in flight and its gradient at least; with the next
  // two prefetched (and their gradients' room), twice that.
  const double working_min = 2.0 * static_cast<double>(sh.largest_layer) * pb;
  const double working = 2.0 * working_min;
  const double buffers = 256.0 * (1 << 20);  // the optimizer's pipeline buffers (tier.optimizer.buffer_bytes)
  const double hb = host_budget ? static_cast<double>(host_budget)
                                : std::max(2.0 * (1ull << 30), 6.0 * static_cast<double>(sh.largest_layer) * 4.0);
  const double flops = 6.0 * N * tokens * static_cast<double>(gas);
  const double compute = rates.compute > 0 ? flops / rates.compute : 0.0;

  std::vector<Choice> choices;
  auto add = [&](std::string name, std::string ph, std::string oh) {
    Choice c;
    c.name = std::move(name);
    c.params_home = std::move(ph);
    c.optimizer_home = std::move(oh);
    const bool p_off = c.params_home != "none", o_off = c.optimizer_home != "none";
    const bool p_nvme = c.params_home == "nvme", o_nvme = c.optimizer_home == "nvme";
    // Device.
    c.device = (p_off ? working_min : 2.0 * pb * N) + acts + (o_off ? 0.0 : 12.0 * N);
    c.device_prefetch = p_off ? working + acts + (o_off ? 0.0 : 12.0 * N) : c.device;
    // Host: what lives there, or (for NVMe homes) the host budget that stages it.
    if (p_nvme || o_nvme) c.host = hb;
    c.host += act.host;
    c.nvme += act.nvme;
    if (c.params_home == "cpu") c.host += pb * N + 4.0 * N;  // params and fp32 gradient sums
    if (c.optimizer_home == "cpu") c.host += 12.0 * N + (p_off ? 0.0 : 4.0 * N) + buffers;
    // NVMe: the optimizer's committed and next state, params (and room to stage them), gradients.
    if (o_nvme) c.nvme += 24.0 * N + 4.0 * N;
    if (p_nvme) c.nvme += pb * N;
    // Time: streaming in forward and backward, gradients out, overlapped with compute.
    double stream = 0;
    if (p_off) stream += 2.0 * pb * N / rates.h2d * static_cast<double>(gas);
    if (p_nvme) stream = std::max(stream, 2.0 * pb * N / rates.nvme_read * static_cast<double>(gas));
    if (o_off) stream += pb * N / rates.d2h * static_cast<double>(gas);
    stream += act.seconds;
    // Recomputing costs one more forward (2 of the 6 N flops per token).
    c.fwd_bwd = std::max(compute * (act_mode == "none" ? 1.0 : 4.0 / 3.0), stream);
    if (o_nvme) {
      // Every byte the pass moves, per parameter: 12 B of state records read and 12 B written
      // back, the 4 B fp32 gradient read (p_nvme: from the engine's NVMe file, through its lease),
      // and the updated params written (pb B; p_nvme: to the engine's file). They go at once, so
      // all at the mixed rate.
      const double io = (12.0 + 12.0 + 4.0 + pb) * N / mixed_rate(rates);
      c.optimizer = std::max(io, N / rates.adam);
    } else if (o_off) {
      c.optimizer = N / rates.adam;
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
    j["dtype"] = dtype;
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
                              {"host_bytes", c.host},
                              {"nvme_bytes", c.nvme},
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
  std::printf("%s (%s): %.3f B parameters, %s; batch %llu x %llu tokens, accumulation %llu%s\n", path.c_str(),
              sh.family.c_str(), N / 1e9, dtype.c_str(), static_cast<unsigned long long>(batch),
              static_cast<unsigned long long>(seq), static_cast<unsigned long long>(gas),
              act_mode == "none" ? ""
              : act_mode == "recompute"
                  ? ", activation checkpointing"
                  : str(", activation checkpointing, checkpoints offloaded to ", act_mode).c_str());
  std::printf(
      "rates (%s): NVMe read %s, write %s, mixed %s%s; host->device %s; CPU Adam %.2f G params/s; compute %s\n\n",
      rates.source.c_str(), format_rate(rates.nvme_read).c_str(), format_rate(rates.nvme_write).c_str(),
      format_rate(mixed_rate(rates)).c_str(),
      rates.mixed_source == "from read and write" ? " (from read and write)" : "", format_rate(rates.h2d).c_str(),
      rates.adam / 1e9,
      rates.compute > 0 ? str(fmt(rates.compute / 1e12, 1), " TFLOP/s").c_str() : "not given (times exclude it)");
  Table table({"offload", "device", "host", "NVMe", "fwd+bwd s", "optimizer s", "step s", "fits"});
  for (const Choice& c : choices) {
    table.add(
        {c.name, str(fmt(gib(c.device), 2), " GiB"), str(fmt(gib(c.host), 2), " GiB"),
         c.nvme > 0 ? str(fmt(gib(c.nvme), 2), " GiB") : "-", fmt(c.fwd_bwd, 2), fmt(c.optimizer, 2), fmt(c.step, 2),
         c.fits ? (c.prefetch_limited ? str("yes, without prefetch (", fmt(gib(c.device_prefetch), 2), " GiB with)")
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
     "  --activations M       none|recompute|host|nvme: activations kept whole, recomputed from checkpointed\n"
     "                        layer inputs (default), or recomputed with those inputs offloaded\n"
     "  --no-checkpointing    the same as --activations none\n"
     "  --compute-tflops F    the device's sustained TFLOP/s (default: not counted)\n"
     "  --measure             time the NVMe (in --nvme: sequential reads, writes, and the optimizer's mixed\n"
     "                        read+write pass over 1.5 GiB of scratch files) and the CPU Adam here\n"
     "  --nvme-read-gbps F --nvme-write-gbps F --nvme-mixed-gbps F --h2d-gbps F --adam-gparams F\n"
     "                        rates to assume (mixed: read and written bytes together per second;\n"
     "                        default: the read and write rates served in turn)\n"
     "  --write-config FILE   write the recommended config\n"
     "  --json                print one JSON object",
     run_plan});

}  // namespace
}  // namespace tier::bench
