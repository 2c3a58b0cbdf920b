"""`tier-bench plan`: the parameter count it derives from a config.json is the one transformers
builds (seven families), its memory table is consistent with the limits it is given, and the
config it recommends is one tier accepts."""

import json
import os
import pathlib
import subprocess

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_configs import tier_bench  # noqa: E402

BENCH = tier_bench()
if BENCH is None:
    pytest.fail("tier-bench not found: set TIER_BENCH (scripts/test.sh does)", pytrace=False)

SMALL = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=3, num_attention_heads=4)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, intermediate_size=172, num_key_value_heads=2),
    "llama_tied_bias": lambda: transformers.LlamaConfig(
        **SMALL, intermediate_size=96, tie_word_embeddings=True, attention_bias=True, mlp_bias=True
    ),
    "mistral": lambda: transformers.MistralConfig(**SMALL, intermediate_size=128, num_key_value_heads=1),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, intermediate_size=128, num_key_value_heads=2),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, intermediate_size=128, num_key_value_heads=2, head_dim=32),
    "gemma": lambda: transformers.GemmaConfig(**SMALL, intermediate_size=128, num_key_value_heads=1, head_dim=16),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**SMALL, intermediate_size=256),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=1000, n_embd=64, n_layer=3, n_head=4, n_positions=128),
}


# The optimizer's spare chunks with one copy of its state: a record (12 of the 16 bytes per element
# of a pipeline buffer) per buffer of the default 256 MiB.
SPARES = 256 * 2**20 * 12 // 16


def plan(*args, check=True):
    r = subprocess.run([BENCH, "plan", *map(str, args), "--json"], capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode in (0, 3), r.stderr
        return json.loads(r.stdout)
    return r


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_count_is_what_transformers_builds(name, tmp_path):
    cfg = CONFIGS[name]()
    cfg.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    expected = sum(p.numel() for p in model.parameters())  # tied weights once
    got = plan("--model", tmp_path, "--nvme-size", "1T")
    assert got["parameters"] == expected, (name, got["parameters"], expected)
    assert got["model_type"] == cfg.model_type


def test_memory_table_follows_the_limits_and_the_config_is_accepted(tmp_path):
    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32
    )
    cfg.save_pretrained(tmp_path / "llama7b")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = tmp_path / "recommended.json"
    got = plan("--model", tmp_path / "llama7b", "--gpu", "24G", "--host", "64G", "--nvme", nvme, "--nvme-size", "2T",
               "--seq", 1024, "--write-config", out, "--compute-tflops", 100)
    n = got["parameters"]
    assert 6.7e9 < n < 6.8e9  # Llama-2-7B
    by = {c["name"]: c for c in got["choices"]}
    gpu = by["all on the GPU"]
    assert gpu["device_bytes"] > 16 * n and not gpu["fits"] and "device" in gpu["why_not"]
    host = by["optimizer in host memory"]
    assert host["host_bytes"] >= 12 * n  # fp32 master and moments
    assert not host["fits"]  # 4 B/param of bf16 params+grads alone (27 GB) exceed 24 GiB
    nv = by["params + optimizer on NVMe"]
    # bf16 params 2, fp32 gradients 4, the state once (tier.optimizer.state_copies 1) 12, and a
    # spare chunk per pipeline buffer.
    assert nv["nvme_bytes"] == pytest.approx(18 * n + SPARES) and nv["fits"] and nv["device_bytes"] < 24 * 2**30
    for c in got["choices"]:
        assert c["fits"] == (c["device_bytes"] <= 24 * 2**30 and c["host_bytes"] <= 64 * 2**30
                             and c["nvme_bytes"] <= 2 * 2**40)
        assert c["step_seconds"] == pytest.approx(c["forward_backward_seconds"] + c["optimizer_seconds"])
        assert c["forward_backward_seconds"] >= 6 * n * 1024 / 100e12 * 0.999  # compute is counted
    fitting = [c for c in got["choices"] if c["fits"]]
    assert got["recommended"] == min(fitting, key=lambda c: c["step_seconds"])["name"]
    written = json.loads(out.read_text())
    assert written["zero_optimization"]["offload_param"]["device"] == by[got["recommended"]]["offload_param"]
    assert written["optimizer"]["type"] == "AdamW"  # an engine built from it can train
    r = subprocess.run([BENCH, "config", "--check", str(out), "--strict"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_bad_input_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    r = plan("--model", tmp_path, check=False)
    assert r.returncode == 2 and "model_type 'mamba'" in r.stderr
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    r = plan("--model", tmp_path, check=False)
    assert r.returncode == 2 and "'vocab_size' is missing" in r.stderr
    r = plan("--model", tmp_path / "nowhere", check=False)
    assert r.returncode == 2 and "cannot read" in r.stderr


def _nvme_row(got):
    return next(c for c in got["choices"] if c["name"] == "params + optimizer on NVMe")


def test_optimizer_pass_is_every_byte_at_the_mixed_rate(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=16,
                                   num_attention_heads=16)
    cfg.save_pretrained(tmp_path)
    common = ("--model", tmp_path, "--dtype", "fp32", "--nvme-size", "1T", "--adam-gparams", 1000)
    # Without a mixed rate, reads and writes are taken as served in turn.
    got = plan(*common, "--nvme-read-gbps", 2, "--nvme-write-gbps", 4)
    n = got["parameters"]
    rates = got["rates"]
    assert rates["nvme_mixed_source"] == "from read and write"
    assert rates["nvme_mixed_bytes_per_second"] == pytest.approx(2 / (1 / 2e9 + 1 / 4e9))
    # An fp32 model's params are its masters: m and v read and written (8 + 8 B), the fp32 gradient
    # read (4 B), the params read as the masters (4 B) and written back (4 B).
    assert _nvme_row(got)["optimizer_seconds"] == pytest.approx(28 * n / rates["nvme_mixed_bytes_per_second"])
    # A given mixed rate replaces it.
    got = plan(*common, "--nvme-read-gbps", 2, "--nvme-write-gbps", 4, "--nvme-mixed-gbps", 1.5)
    assert got["rates"]["nvme_mixed_bytes_per_second"] == pytest.approx(1.5e9)
    assert got["rates"]["nvme_mixed_source"] == "given"
    assert _nvme_row(got)["optimizer_seconds"] == pytest.approx(28 * n / 1.5e9)
    # bf16: the master in the records (12 + 12 B), params written back in 2 bytes.
    got = plan("--model", tmp_path, "--nvme-size", "1T", "--adam-gparams", 1000, "--nvme-mixed-gbps", 1.5)
    assert _nvme_row(got)["optimizer_seconds"] == pytest.approx(30 * n / 1.5e9)


def test_measure_times_the_optimizers_mixed_pass(tmp_path):
    st = os.statvfs(tmp_path)
    if st.f_bavail * st.f_frsize < 6 << 30:
        pytest.skip("--measure writes about 2.5 GiB of scratch files; less than 6 GiB free here")
    cfg = transformers.LlamaConfig(**SMALL, intermediate_size=172)
    cfg.save_pretrained(tmp_path / "model")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    got = plan("--model", tmp_path / "model", "--nvme", nvme, "--measure")
    rates = got["rates"]
    assert rates["source"] == "measured" and rates["nvme_mixed_source"] == "measured"
    assert rates["nvme_mixed_bytes_per_second"] > 0
    assert list(nvme.iterdir()) == []  # the scratch files are gone


def test_a_device_that_holds_only_the_largest_block_fits_without_prefetch(tmp_path):
    """The main job's 1.5b preset at 768 MiB: the engine runs it (the embedding and its gradient
    fit), but with no room to prefetch; the plan says so instead of "nothing fits"."""
    cfg = transformers.LlamaConfig(vocab_size=28000, hidden_size=2560, intermediate_size=6912, num_hidden_layers=20,
                                   num_attention_heads=20)
    cfg.save_pretrained(tmp_path / "m")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    common = ("--model", tmp_path / "m", "--dtype", "fp32", "--batch", 1, "--seq", 64, "--host-budget", "2G",
              "--nvme", nvme, "--nvme-size", "1T")
    got = plan(*common, "--gpu", "768M")
    row = _nvme_row(got)
    largest = got["largest_block_parameters"]
    assert row["device_bytes"] >= 2 * 4 * largest  # the block and its gradient
    assert row["device_prefetch_bytes"] >= 4 * 4 * largest > 768 * 2**20
    assert row["fits"] and row["prefetch_limited"]
    assert got["recommended"] == "params + optimizer on NVMe"
    roomy = _nvme_row(plan(*common, "--gpu", "24G"))
    assert roomy["fits"] and not roomy["prefetch_limited"]
    assert not _nvme_row(plan(*common, "--gpu", "256M"))["fits"]


def test_activation_memory_is_counted_for_each_choice(tmp_path):
    """Kept whole, recomputed, recomputed with the checkpoints in host memory or on NVMe: each
    choice's bytes per tier; the offload table and the recommended config follow --activations."""
    CONFIGS["llama"]().save_pretrained(tmp_path)
    common = ["--model", tmp_path, "--nvme-size", "1T", "--batch", 2, "--seq", 512, "--dtype", "fp32"]
    got = plan(*common, "--activations", "nvme")
    rows = {r["mode"]: r for r in got["activations"]}
    assert list(rows) == ["none", "recompute", "host", "nvme"]
    checkpoints = 3 * 2 * 512 * 64 * 4  # layers x batch x seq x hidden x fp32
    assert rows["none"]["device_bytes"] > rows["recompute"]["device_bytes"] > rows["nvme"]["device_bytes"]
    assert rows["recompute"]["device_bytes"] - rows["host"]["device_bytes"] == pytest.approx(checkpoints / 3)
    assert rows["host"]["host_bytes"] == pytest.approx(checkpoints) and rows["host"]["nvme_bytes"] == 0
    assert rows["nvme"]["nvme_bytes"] == pytest.approx(checkpoints)
    assert rows["nvme"]["moved_bytes_per_micro_step"] == pytest.approx(2 * checkpoints)
    assert rows["recompute"]["moved_bytes_per_micro_step"] == 0
    assert got["activation_mode"] == "nvme" and got["activation_bytes"] == rows["nvme"]["device_bytes"]
    assert got["config"]["tier"]["activations"] == {"checkpoint": True, "offload": "nvme"}
    recompute = plan(*common, "--activations", "recompute")
    for a, b in zip(got["choices"], recompute["choices"]):
        assert a["nvme_bytes"] - b["nvme_bytes"] == pytest.approx(checkpoints)
    assert plan(*common, "--no-checkpointing")["activation_mode"] == "none"
    r = plan(*common, "--activations", "disk", check=False)
    assert r.returncode == 2 and "--activations" in r.stderr


# LoRA (--lora-r, --lora-targets) and --layers K: issue #33.
LLAMA7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32)
DEVICE_7B_LORA = 1595965440  # the main job's device budget at --preset 7b-lora (2 layers + 3 embeddings)


def _peft_trainable(cfg, targets):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets.split(",")))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name,targets", [
    ("llama", "q_proj,k_proj,v_proj,o_proj"),  # the main job's default; k and v narrower (GQA)
    ("llama", "q_proj,v_proj"),
    ("llama", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"),
    ("qwen3", "q_proj,k_proj,v_proj,o_proj,down_proj"),
    ("gpt_neox", "query_key_value,dense,dense_h_to_4h,dense_4h_to_h"),
    ("gpt2", "c_attn,c_proj,c_fc"),  # c_proj: the attention's and the MLP's
])
def test_lora_adapters_are_what_peft_builds(name, targets, tmp_path):
    cfg = CONFIGS[name]()
    cfg.save_pretrained(tmp_path)
    expected = _peft_trainable(cfg, targets)
    got = plan("--model", tmp_path, "--nvme-size", "1T", "--lora-r", 8, "--lora-targets", targets)
    assert got["lora"]["adapter_parameters"] == expected, (name, targets, got["lora"], expected)
    assert got["trainable_parameters"] == expected
    assert got["lora"]["r"] == 8 and got["lora"]["targets"] == targets.split(",")
    full = plan("--model", tmp_path, "--nvme-size", "1T")
    assert full["lora"] is None and full["trainable_parameters"] == full["parameters"] == got["parameters"]


def test_lora_keeps_no_gradients_or_optimizer_state_for_the_base(tmp_path):
    transformers.LlamaConfig(**LLAMA7B).save_pretrained(tmp_path)
    common = ("--model", tmp_path, "--seq", 128, "--gpu", "24G", "--host", "64G", "--nvme-size", "1T",
              "--nvme-mixed-gbps", 2, "--adam-gparams", 1)
    full = plan(*common)
    lora = plan(*common, "--lora-r", 16)
    n, t = lora["parameters"], lora["lora"]["adapter_parameters"]
    assert t == 16 * (4096 + 4096) * 4 * 32  # Llama-2-7B, r=16 on q, k, v, o: 16.78 M
    f, lo = _nvme_row(full), _nvme_row(lora)
    # NVMe: the bf16 base and adapters; the adapters' gradients and state only (once, and the spares).
    assert lo["nvme_bytes"] == pytest.approx(2 * (n + t) + 16 * t + SPARES)
    assert f["nvme_bytes"] == pytest.approx(18 * n + SPARES)
    # Two copies of the state: 12 bytes more per trained parameter, no spares.
    two = _nvme_row(plan(*common, "--state-copies", 2))
    assert two["nvme_bytes"] == pytest.approx(30 * n)
    with pytest.raises(AssertionError):
        plan(*common, "--state-copies", 3)
    assert lo["nvme_bytes"] - 2 * (n + t) - SPARES < 0.01 * f["nvme_bytes"]
    # The optimizer pass moves the adapters' bytes only (24 B of state, 4 B gradient, 2 B param).
    assert lo["optimizer_seconds"] == pytest.approx(30 * t / 2e9)
    # Everything on the device: base, adapters and their gradients, the adapters' state.
    by = {c["name"]: c for c in lora["choices"]}
    gpu = by["all on the GPU"]
    assert gpu["device_bytes"] - lora["activation_bytes"] == pytest.approx(2 * (n + t) + 2 * t + 12 * t)
    assert by["optimizer in host memory"]["host_bytes"] == pytest.approx(12 * t + 4 * t + 256 * 2**20)
    # The base is streamed without its gradients: the working set is the largest block alone.
    assert lo["device_bytes"] < f["device_bytes"]
    # Fewer flops: no weight gradients for the base.
    assert lora["flops_per_step"] < 0.8 * full["flops_per_step"]


def test_lora_reads_the_base_twice_less_what_the_device_keeps(tmp_path):
    """The 7b-lora run of docs/benchmarks.md: 22.0 GiB read from NVMe per steady step, with the
    main job's device budget; on a device that holds the whole base nothing is read again."""
    transformers.LlamaConfig(**LLAMA7B).save_pretrained(tmp_path)
    common = ("--model", tmp_path, "--seq", 128, "--lora-r", 16, "--host-budget", "2G", "--nvme-size", "1T")
    got = plan(*common, "--gpu", DEVICE_7B_LORA)
    row = _nvme_row(got)
    base = 2 * (got["parameters"] + got["lora"]["adapter_parameters"])
    assert row["nvme_read_bytes_per_step"] == pytest.approx(22.0 * 2**30, rel=0.02)
    assert 1.7 * base < row["host_to_device_bytes_per_step"] < 2 * base
    assert row["device_peak_bytes"] == pytest.approx(DEVICE_7B_LORA)  # the budget fills with cached blocks
    assert row["host_bytes"] == pytest.approx(2 * 2**30)
    roomy = _nvme_row(plan(*common, "--gpu", "24G"))
    assert roomy["host_to_device_bytes_per_step"] == 0
    assert roomy["nvme_read_bytes_per_step"] == pytest.approx(16 * got["lora"]["adapter_parameters"])


def test_emulated_device_adds_compute_and_copies_beside_the_disk(tmp_path):
    transformers.LlamaConfig(**LLAMA7B).save_pretrained(tmp_path)
    common = ("--model", tmp_path, "--seq", 128, "--lora-r", 16, "--gpu", DEVICE_7B_LORA, "--host-budget", "2G",
              "--nvme-size", "1T", "--compute-tflops", 1, "--nvme-read-gbps", 2, "--h2d-gbps", 10)
    gpu, emu = plan(*common), plan(*common, "--emulated")
    assert gpu["device_kind"] == "gpu" and emu["device_kind"] == "emulated"
    g, e = _nvme_row(gpu), _nvme_row(emu)
    t = emu["lora"]["adapter_parameters"]
    compute = emu["flops_per_step"] / 1e12
    moved = e["host_to_device_bytes_per_step"]
    disk = moved / 2e9 + 4 * t / 2.5e9  # the base read, the adapters' fp32 gradients written (assumed rate)
    # The host's cores compute and copy one after another; the disk's DMA runs beside them.
    assert e["forward_backward_seconds"] == pytest.approx(max(compute + moved / 10e9 + 2 * t / 10e9, disk))
    assert g["forward_backward_seconds"] == pytest.approx(max(compute, disk + 2 * t / 10e9))


def test_layers_plans_k_of_the_models_layers(tmp_path):
    cfg = transformers.LlamaConfig(**LLAMA7B)
    cfg.save_pretrained(tmp_path / "m")
    common = ("--model", tmp_path / "m", "--seq", 128, "--nvme-size", "1T", "--nvme-mixed-gbps", 2)
    by_k = {k: plan(*common, "--layers", k) for k in (1, 2, 4)}
    whole = plan(*common)
    for k, got in by_k.items():
        assert got["layers"] == k and got["config_layers"] == 32
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.LlamaConfig(**dict(LLAMA7B, num_hidden_layers=k)))
        assert got["parameters"] == sum(p.numel() for p in model.parameters())
    layer = by_k[2]["parameters"] - by_k[1]["parameters"]
    assert by_k[4]["parameters"] - by_k[2]["parameters"] == 2 * layer
    assert whole["parameters"] - by_k[4]["parameters"] == 28 * layer and whole["layers"] == 32
    # Memory and the optimizer's time follow the parameters; the LoRA adapters the layers.
    r2, r4 = _nvme_row(by_k[2]), _nvme_row(by_k[4])
    assert r4["nvme_bytes"] - r2["nvme_bytes"] == pytest.approx(18 * 2 * layer)  # bf16 2, gradients 4, state 12
    assert r4["optimizer_seconds"] / r2["optimizer_seconds"] == pytest.approx(
        by_k[4]["parameters"] / by_k[2]["parameters"])
    lora = {k: plan(*common, "--layers", k, "--lora-r", 16)["lora"]["adapter_parameters"] for k in (2, 4)}
    assert lora[4] == 2 * lora[2] == 4 * 16 * (4096 + 4096) * 4


def test_bad_lora_and_layers_input_is_refused(tmp_path):
    CONFIGS["llama"]().save_pretrained(tmp_path)
    r = plan("--model", tmp_path, "--lora-r=-4", check=False)
    assert r.returncode == 2 and "--lora-r -4" in r.stderr and "positive integer" in r.stderr
    r = plan("--model", tmp_path, "--lora-r", 8, "--lora-targets", "q_proj,qkv_proj", check=False)
    assert r.returncode == 2 and "'qkv_proj' is not a projection of a llama layer" in r.stderr
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in r.stderr
    r = plan("--model", tmp_path, "--lora-targets", "q_proj", check=False)
    assert r.returncode == 2 and "--lora-targets needs --lora-r" in r.stderr
    r = plan("--model", tmp_path, "--lora-r", "two", check=False)
    assert r.returncode == 2 and "--lora-r" in r.stderr
    r = plan("--model", tmp_path, "--layers", 0, check=False)
    assert r.returncode == 2 and "--layers 0" in r.stderr
