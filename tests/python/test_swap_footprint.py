"""The NVMe tier's footprint: swap files grow with what they hold, so a small model on a DeepSpeed
config with no tier section (auto NVMe budget) takes megabytes of disk, and a model its disks
cannot hold is refused at initialize with the numbers, before anything is written."""

import errno
import gc
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tier  # noqa: E402
import tier.torch  # noqa: E402
import tier.torch.footprint as footprint  # noqa: E402


def _llama_3m():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


def _deepspeed_config(swap_dir):
    # As DeepSpeed's docs publish it: no tier section, so every tier budget is "auto".
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap_dir},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap_dir},
        },
    }


def _blocks_under(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def test_a_small_model_with_the_auto_budget_takes_megabytes_of_disk(swap_dir):
    model = _llama_3m()
    numel = sum(p.numel() for p in model.parameters())
    assert 2_500_000 < numel < 3_500_000
    engine, *_ = tier.torch.initialize(model, _deepspeed_config(swap_dir))
    try:
        ids = torch.randint(0, 1024, (1, 32))
        for _ in range(2):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        assert engine.global_steps == 2
        on_disk = _blocks_under(swap_dir)  # measured from outside: the swap files' blocks
        metrics = engine.stats()["metrics"]
        # The auto budget is a cap (the disk's free space), not a reservation.
        assert metrics["nvme.swap.capacity_bytes"] > 1 << 30
        # One storage stack: the optimizer's state is in the engine's swap files (one per path), its
        # room reserved in the engine's NVMe budget; it has no files or I/O threads of its own.
        assert not any(k.startswith("optim.swap.") for k in metrics), sorted(k for k in metrics if "swap" in k)
        opt_stats = engine.native_optimizer.stats()
        assert opt_stats["shared_swap"] and opt_stats["nvme_allocated_bytes"] == 0
        assert len([f for _, _, fs in os.walk(swap_dir) for f in fs]) == 1
        # Every chunk's two slots are in the engine's files.
        assert metrics["nvme.swap.used_bytes"] >= opt_stats["nvme_bytes"] + 4 * numel
        assert opt_stats["nvme_capacity_bytes"] >= opt_stats["nvme_bytes"]
        allocated = metrics["nvme.swap.allocated_bytes"]
        assert 0 < allocated <= on_disk + (1 << 20)
        # fp32 params (4 B, also the optimizer's masters), their gradients (4 B) and m and v once
        # (8 B), with 32 MiB growth steps.
        assert engine._engine_masters
        assert on_disk < 200 << 20, on_disk
        assert on_disk >= 16 * numel
    finally:
        engine.destroy()
    assert _blocks_under(swap_dir) == 0, "the swap files are removed at close"


def test_a_model_the_disk_cannot_hold_is_refused_before_anything_is_written(swap_dir, monkeypatch):
    real_statvfs = os.statvfs

    class Small:
        def __init__(self, st):
            self.f_blocks = st.f_blocks
            self.f_frsize = 4096
            self.f_bavail = 1000  # 4 MB free

    monkeypatch.setattr(footprint.os, "statvfs", lambda p: Small(real_statvfs(p)))
    with pytest.raises(tier.NoSpace) as caught:
        tier.torch.initialize(_llama_3m(), _deepspeed_config(swap_dir))
    err = caught.value
    assert err.errno == errno.ENOSPC
    message = str(err)
    assert "parameters" in message and "optimizer state" in message, message
    assert swap_dir in message and "4096000 bytes) are free" in message, message
    assert "tier.swap_paths" in message
    gc.collect()
    assert _blocks_under(swap_dir) < 1 << 20, "nothing was written before the refusal"


def test_preallocate_reserves_the_budget_up_front(swap_dir):
    cfg = _deepspeed_config(swap_dir)
    cfg["tier"] = {"budgets": {"nvme": "96M"}, "io": {"preallocate": True}}
    engine, *_ = tier.torch.initialize(_llama_3m(), cfg)
    try:
        metrics = engine.stats()["metrics"]
        assert metrics["nvme.swap.allocated_bytes"] == metrics["nvme.swap.capacity_bytes"] == 96 << 20
    finally:
        engine.destroy()


def test_a_small_host_budget_sizes_the_optimizer_buffers(swap_dir):
    """With tier.budgets.host "16M" and no tier.optimizer.buffer_bytes, the optimizer's pipeline
    buffers take an eighth of the budget (the default chunk's 4 x 4 MiB would fill it, and
    initialize refused the budget), and the model trains."""
    cfg = _deepspeed_config(swap_dir)
    cfg["tier"] = {"budgets": {"host": "16M"}}
    engine, *_ = tier.torch.initialize(_llama_3m(), cfg)
    assert engine.native_optimizer.stats()["pinned_bytes"] <= 2 << 20
    x = torch.randint(0, 1024, (1, 16))
    losses = []
    for _ in range(2):
        out = engine(input_ids=x, labels=x)
        losses.append(out.loss.item())
        engine.backward(out.loss)
        engine.step()
    assert engine.global_steps == 2 and losses[1] < losses[0]
    engine.destroy()


def test_a_nvme_budget_without_room_for_the_optimizer_state_is_refused_at_initialize(swap_dir):
    """The optimizer's state is in the engine's swap files and counts in tier.budgets.nvme: a
    budget that holds the parameters but not the state (m and v, 8 bytes per parameter, and the
    spare chunks: 32 MiB here) is refused when the optimizer is made, naming the key and the
    bytes, and leaves no swap file behind."""
    cfg = _deepspeed_config(swap_dir)
    cfg["tier"] = {"budgets": {"nvme": "24M"}}
    with pytest.raises(tier.ResourceExhausted) as caught:
        tier.torch.initialize(_llama_3m(), cfg)
    message = str(caught.value)
    assert "tier/optimizer/state" in message and "inside tier.budgets.nvme (24.00 MiB)" in message, message
    assert "raise tier.budgets.nvme" in message, message
    gc.collect()
    assert _blocks_under(swap_dir) == 0, "the engine's swap file went with the refused engine"
    cfg["tier"] = {"budgets": {"nvme": "112M"}}  # 12 MB of params, 72 MB of state, room to stage
    engine, *_ = tier.torch.initialize(_llama_3m(), cfg)
    engine.destroy()
