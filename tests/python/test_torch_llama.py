"""tier.torch on a small Hugging Face Llama: the same losses as plain PyTorch AdamW, with params and
optimizer state on NVMe and a device budget smaller than the model."""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tier  # noqa: E402
import tier.torch  # noqa: E402

# TIER_TEST_DEVICE=cuda runs tier on the GPU (and the PyTorch baseline there too); the default is
# the emulated device, which runs everywhere.
TEST_DEVICE = os.environ.get("TIER_TEST_DEVICE", "emulated")
TORCH_DEVICE = torch.device("cuda" if TEST_DEVICE == "cuda" else "cpu")
if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TIER_TEST_DEVICE=cuda but torch sees no GPU", allow_module_level=True)

VOCAB = 256
SEQ = 32
BATCH = 2
LR = 3e-3


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ * 2,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype)


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(TORCH_DEVICE)
    return {"input_ids": ids, "labels": ids.clone()}


def tier_config(swap_dir, gas=2, clip=1.0, device_budget="160K", dtype=None, **extra):
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap_dir, "pin_memory": True},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap_dir, "pin_memory": True},
        },
        "aio": {"block_size": 65536, "queue_depth": 8},
        "tier": {
            "device": TEST_DEVICE,
            "budgets": {"device": device_budget, "host": "16M", "nvme": "64M"},
            "optimizer": {"buffer_bytes": "4M"},
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    cfg.update(extra)
    return cfg


def baseline_losses(steps, gas=2, clip=1.0, make=make_model, batch_of=batch):
    model = make().to(TORCH_DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    for step in range(steps):
        for micro in range(gas):
            out = model(**batch_of(step * gas + micro))
            losses.append(out.loss.item())
            (out.loss / gas).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses


def tier_losses(engine, steps, gas=2, start=0, batch_of=batch):
    losses = []
    for step in range(start, steps):
        for micro in range(gas):
            out = engine(**batch_of(step * gas + micro))
            losses.append(out.loss.item())
            engine.backward(out.loss)
            engine.step()
    return losses


def max_rel_diff(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def test_fp32_losses_match_pytorch_adamw_with_clipping_and_accumulation(swap_dir):
    steps = 20
    expected = baseline_losses(steps)
    engine, *_ = tier.torch.initialize(make_model(), tier_config(swap_dir))
    got = tier_losses(engine, steps)
    assert len(got) == len(expected) == 2 * steps
    assert max_rel_diff(got, expected) <= 1e-5, (got[-3:], expected[-3:])
    s = engine.stats()
    budget = s["tiers"]["device"]["budget_bytes"]
    model_bytes = sum(slot.numel * 4 for slot in engine._slots)
    assert budget < model_bytes, "the device budget must be smaller than the model"
    assert s["tiers"]["device"]["peak_bytes"] <= budget
    assert s["metrics"]["engine.evictions.device"] > 0, "eviction must happen every step"
    assert s["links"]["nvme_to_host"]["bytes"] > 0
    assert engine.global_steps == steps


def test_gradients_leave_the_device_as_the_device_allows(swap_dir):
    # On CUDA a step's first gradient of each tensor is DMA'd straight into its engine tensor, the
    # second micro-step's (added to it) goes through an asynchronous copy into pinned staging, all
    # of it consumed by the end of backward; on the CPU there is nothing to stage.
    engine, *_ = tier.torch.initialize(make_model(), tier_config(swap_dir))
    losses = tier_losses(engine, 2)
    expected = baseline_losses(2)
    assert max_rel_diff(losses, expected) <= 1e-5, (losses, expected)
    d2h = engine.stats()["links"]["device_to_host"]
    grad_bytes = sum(slot.numel * 4 for slot in engine._slots if slot.trainable)
    assert d2h["bytes"] >= 4 * grad_bytes, "every gradient of the 4 micro-steps is counted on the link"
    staging = engine.__dict__.get("_grad_staging_state")
    if TEST_DEVICE != "cuda":
        assert staging is None, "CPU gradients are handed over directly, with no pinned staging"
        assert engine._grads.direct == 0, "only device gradients are DMA'd"
        return
    trained = sum(1 for slot in engine._slots if slot.pid is not None)
    assert engine._grads.direct == 2 * trained, "each step's first micro-step goes straight into the engine"
    assert not engine._grads._pending, "every device sum of squares was taken in by the step"
    assert staging is not None, "CUDA gradients must go through the pinned staging"
    assert not staging._pending, "backward must leave no gradient copy in flight"
    buffers = [b for free in staging._free.values() for b in free]
    assert buffers and all(b.is_pinned() for b in buffers), "staging buffers must be pinned host memory"
    assert staging.pinned_bytes <= grad_bytes, "buffers are reused across steps, not one per gradient per step"


def test_bf16_tracks_fp32_within_bf16_tolerance(swap_dir, tmp_path):
    steps = 8
    fp32 = tier_losses(tier.torch.initialize(make_model(), tier_config(swap_dir))[0], steps)
    other = str(tmp_path / "swap-bf16")
    os.makedirs(other)
    bf16 = tier_losses(tier.torch.initialize(make_model(), tier_config(other, dtype="bf16"))[0], steps)
    assert max_rel_diff(bf16, fp32) <= 2e-2, (bf16[-3:], fp32[-3:])
    assert bf16 != fp32, "bf16 really computed in bf16"


_RESUME_SCRIPT = r"""
import json, sys
sys.path[:0] = json.loads(sys.argv[1])
import test_torch_llama as t
import tier.torch
cfg, ckpt, start, steps = json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
engine, *_ = tier.torch.initialize(t.make_model(seed=123), cfg)  # another init: everything must come from the checkpoint
engine.load_checkpoint(ckpt)
print(json.dumps(t.tier_losses(engine, steps, start=start)))
"""


@pytest.mark.slow
def test_save_kill_load_continue_gives_identical_losses(swap_dir, tmp_path):
    steps, split = 12, 6
    cfg = tier_config(swap_dir)
    engine, *_ = tier.torch.initialize(make_model(), cfg)
    first = tier_losses(engine, split)
    ckpt = str(tmp_path / "ckpt")
    engine.save_checkpoint(ckpt)
    uninterrupted = tier_losses(engine, steps, start=split)
    # A fresh process (the first one is gone as far as the second knows) continues from the file.
    other = str(tmp_path / "swap2")
    os.makedirs(other)
    cfg2 = tier_config(other)
    paths = [os.path.dirname(__file__)] + [p for p in sys.path if p]
    out = subprocess.run(
        [sys.executable, "-c", _RESUME_SCRIPT, json.dumps(paths), json.dumps(cfg2), ckpt, str(split), str(steps)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    resumed = json.loads(out.stdout.strip().splitlines()[-1])
    assert resumed == uninterrupted
    assert len(first) == 2 * split


def test_corrupt_checkpoint_is_refused_and_state_kept(swap_dir, tmp_path):
    engine, *_ = tier.torch.initialize(make_model(), tier_config(swap_dir))
    tier_losses(engine, 2)
    ckpt = str(tmp_path / "ckpt")
    path = engine.save_checkpoint(ckpt)
    before = engine.state_dict_fp32()
    opt_file = os.path.join(path, "optimizer.bin")
    with open(opt_file, "r+b") as f:
        f.seek(os.path.getsize(opt_file) // 2)
        f.write(b"\xde\xad\xbe\xef" * 16)
    with pytest.raises(tier.DataLoss):
        engine.load_checkpoint(ckpt)
    after = engine.state_dict_fp32()
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_bad_configs_name_the_key_and_the_fix(swap_dir):
    with pytest.raises(tier.InvalidArgument) as e:
        tier.torch.initialize(make_model(), {"optimizer": {"type": "OneBitLamb"}})
    assert "optimizer.type" in str(e.value) and "adamw" in str(e.value)
    with pytest.raises(tier.InvalidArgument) as e:
        tier.torch.initialize(make_model(), {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert "nvme_path" in str(e.value)
    with pytest.raises(tier.ResourceExhausted) as e:
        tier.torch.initialize(make_model(), tier_config(swap_dir, device_budget="16K"))
    assert "tier.budgets.device" in str(e.value)


def test_a_host_budget_too_small_for_a_step_is_refused_at_initialize(swap_dir):
    """4.3 MB of host budget beside 4 MiB of optimizer buffers: a step could never move a chunk of
    gradients and updated params through host memory and would time out mid-step (TimedOut after
    tier.acquire_timeout_ms); it is refused at initialize with the numbers. The least it asks
    for trains."""
    cfg = tier_config(swap_dir, gas=1)
    cfg["tier"]["budgets"]["host"] = "4300K"
    with pytest.raises(tier.ResourceExhausted) as e:
        tier.torch.initialize(make_model(), cfg)
    message = str(e.value)
    assert "tier.budgets.host is 4.20 MiB" in message, message
    # (4 MiB of buffer_bytes, less the page rounding of chunks sized to fit them)
    pinned = float(message.split("pinned buffers take ")[1].split(" MiB")[0])
    assert 3.9 <= pinned <= 4.0, message
    need = int(message.split("raise tier.budgets.host to at least ")[1].split("(")[1].split(" bytes")[0])
    cfg["tier"]["budgets"]["host"] = need
    cfg["tier"]["acquire_timeout_ms"] = 20000
    engine, *_ = tier.torch.initialize(make_model(), cfg)
    losses = tier_losses(engine, 2, gas=1)
    engine.destroy()
    assert max_rel_diff(losses, baseline_losses(2, gas=1)) <= 1e-5
