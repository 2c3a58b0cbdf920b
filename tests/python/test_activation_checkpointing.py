"""Activation checkpointing (gradient checkpointing) under tier.torch, in every offload mode.

transformers' ``gradient_checkpointing_enable()`` (reentrant and non-reentrant) and
``torch.utils.checkpoint`` used directly train to the same losses as plain PyTorch with the same
checkpointing (1e-6 relative, fp32). The recompute fetches the streamed parameters through the
engine again, in the same order every step, so the access trace holds and the prefetcher serves
it."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tier.torch  # noqa: E402
from test_torch_llama import (  # noqa: E402
    baseline_losses,
    batch,
    make_model,
    max_rel_diff,
    tier_config,
    tier_losses,
)

import os
STEPS = int(os.environ.get("AC_STEPS", 3))
GAS = 2
# The recompute of a checkpointed layer holds that layer's parameters until their backward, as
# it holds its activations: the device must fit one layer (144 KiB here) beside what is streaming.
LAYER_BUDGET = "320K"


def _checkpointed(make, reentrant):
    def build():
        model = make()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        return model

    return build


def _qwen2_tied():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    return transformers.Qwen2ForCausalLM(cfg)


def _gpt_neox():
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.GPTNeoXForCausalLM(cfg)


def _mode_config(swap_dir, mode, overlap):
    """stage3-nvme: params and optimizer state on NVMe (the params stream); stage3-host: both in
    host memory; stage2-device: params on the device, optimizer on NVMe; stage1-host: optimizer
    state in host memory."""
    cfg = tier_config(swap_dir, gas=GAS, device_budget=LAYER_BUDGET)
    cfg["tier"]["optimizer"]["overlap"] = overlap
    zero = cfg["zero_optimization"]
    if mode == "stage3-host":
        zero["offload_param"]["device"] = "cpu"
        zero["offload_optimizer"]["device"] = "cpu"
    elif mode == "stage2-device":
        zero["stage"] = 2
        del zero["offload_param"]
        cfg["tier"]["budgets"]["device"] = "8M"
    elif mode == "stage1-host":
        zero["stage"] = 1
        del zero["offload_param"]
        zero["offload_optimizer"]["device"] = "cpu"
        cfg["tier"]["budgets"]["device"] = "8M"
    return cfg


def _run(swap_dir, make, mode="stage3-nvme", overlap="serial"):
    engine, *_ = tier.torch.initialize(make(), _mode_config(swap_dir, mode, overlap))
    losses = tier_losses(engine, STEPS, gas=GAS)
    metrics = engine.stats()["metrics"]
    engine.destroy()
    return losses, metrics


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("overlap", ["serial", "exact"])
def test_transformers_checkpointing_matches_pytorch_with_params_streaming(swap_dir, reentrant, overlap):
    make = _checkpointed(make_model, reentrant)
    expected = baseline_losses(STEPS, gas=GAS, make=make)
    got, metrics = _run(swap_dir, make, overlap=overlap)
    assert max_rel_diff(got, expected) <= 1e-6, (got, expected)
    # The recompute's fetches are part of the recorded order: it never changes, and the
    # prefetcher serves the steps after the first.
    assert metrics["prefetch.order_changes"] == 0
    assert metrics["prefetch.hits"] > 0


def test_the_recompute_fetches_the_params_again_through_the_engine(tmp_path):
    plain = tmp_path / "plain"
    ckpt = tmp_path / "ckpt"
    plain.mkdir()
    ckpt.mkdir()

    def counted(swap_dir, make):
        engine, *_ = tier.torch.initialize(make(), _mode_config(swap_dir, "stage3-nvme", "serial"))
        in_backward = []
        fetch = engine._fetch

        def traced_fetch(module):
            in_backward.append(torch._C._current_graph_task_id() != -1)
            return fetch(module)

        engine._fetch = traced_fetch
        tier_losses(engine, STEPS, gas=GAS)
        metrics = engine.stats()["metrics"]
        engine.destroy()
        return sum(in_backward), metrics

    recomputed_plain, without = counted(str(plain), make_model)
    recomputed, with_ckpt = counted(str(ckpt), _checkpointed(make_model, False))
    # Every micro-step recomputes both layers in backward: their 7 linear modules (and 2 norms)
    # fetch through the engine once more, from inside the backward.
    assert recomputed_plain == 0
    assert recomputed >= STEPS * GAS * 2 * 7, recomputed
    # The recompute's fetch is the one the layer's backward uses: the trace and the acquires are
    # those of the run without checkpointing, no parameter is read twice.
    assert with_ckpt["prefetch.trace_length"] == without["prefetch.trace_length"]
    assert with_ckpt["engine.acquires"] == without["engine.acquires"]
    assert with_ckpt["prefetch.order_changes"] == 0


@pytest.mark.parametrize("mode", ["stage3-host", "stage2-device", "stage1-host"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_checkpointing_in_the_other_offload_modes(swap_dir, mode, reentrant):
    make = _checkpointed(make_model, reentrant)
    expected = baseline_losses(STEPS, gas=GAS, make=make)
    got, metrics = _run(swap_dir, make, mode=mode, overlap="exact")
    assert max_rel_diff(got, expected) <= 1e-6, (mode, got, expected)
    assert metrics["prefetch.order_changes"] == 0


def test_checkpointing_with_the_delayed_update_equals_delayed_without(tmp_path):
    # The delayed update's reference is tier's own run without checkpointing (recomputing changes
    # no value): the losses are the same bit for bit.
    losses = {}
    for name, make in (("plain", make_model), ("ckpt", _checkpointed(make_model, False))):
        d = tmp_path / name
        d.mkdir()
        losses[name], metrics = _run(str(d), make, overlap="delayed")
        assert metrics["prefetch.order_changes"] == 0
    assert losses["ckpt"] == losses["plain"]


@pytest.mark.parametrize("family", ["qwen2_tied", "gpt_neox"])
def test_other_families_with_checkpointing(swap_dir, family):
    """Qwen2 with its embedding tied to the head (a parameter used by two modules, its gradient
    final last) and GPT-NeoX (fused QKV, parallel attention and MLP)."""
    make = _checkpointed({"qwen2_tied": _qwen2_tied, "gpt_neox": _gpt_neox}[family], False)
    expected = baseline_losses(STEPS, gas=GAS, make=make)
    got, metrics = _run(swap_dir, make, overlap="exact")
    assert max_rel_diff(got, expected) <= 1e-6, (family, got, expected)
    assert metrics["prefetch.order_changes"] == 0


class _Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _CheckpointedMLP(torch.nn.Module):
    """A model of its own that calls torch.utils.checkpoint on each block (no transformers)."""

    def __init__(self, reentrant, width=64, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.embed = torch.nn.Embedding(256, width)
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 256, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        logits = self.head(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_torch_utils_checkpoint_used_directly(swap_dir, reentrant):
    def make():
        return _CheckpointedMLP(reentrant)

    expected = baseline_losses(STEPS, gas=GAS, make=make)
    got, metrics = _run(swap_dir, make, overlap="exact")
    assert max_rel_diff(got, expected) <= 1e-6, (got, expected)
    assert metrics["prefetch.order_changes"] == 0


def test_saved_weight_views_are_references_not_device_memory(swap_dir):
    """Without checkpointing, what autograd saves of a streamed weight (F.linear's weight.t()) is
    a reference: the device holds no layer's parameters between its forward and its backward, so
    a budget of a few modules trains a model several times its size."""
    engine, *_ = tier.torch.initialize(make_model(), tier_config(swap_dir, gas=GAS, device_budget="160K"))
    out = engine(**batch(0))
    device = engine.stats()["tiers"]["device"]
    model_bytes = sum(slot.numel * 4 for slot in engine._slots)
    assert engine._saved_params.references >= 14, "each linear's saved weight view is a reference"
    # Between forward and backward only what the prefetcher staged for backward is in place.
    assert device["resident_bytes"] <= 160 * 1024 < model_bytes
    engine.backward(out.loss)
    engine.step()
    engine.destroy()


def test_no_process_wide_patch_of_functional_linear(swap_dir):
    """tier's forward leaves torch.nn.functional.linear alone: another engine or thread calling it
    meanwhile gets torch's own."""
    import torch.nn.functional as F

    original = F.linear
    engine, *_ = tier.torch.initialize(make_model(), tier_config(swap_dir, gas=GAS))
    seen = []
    engine.module.model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(F.linear))
    out = engine(**batch(0))
    engine.backward(out.loss)
    engine.destroy()
    assert seen and all(f is original for f in seen)


# ---------------------------------------------------------------------------------------------
# Checkpoints offloaded (tier.activations.offload / activation_checkpointing.cpu_checkpointing)

CHECKPOINT_BYTES = 2 * 32 * 64 * 4  # one layer's input: batch 2, sequence 32, hidden 64, fp32


def _offload_run(swap_dir, make, acts=None, extra=None, **initialize_kwargs):
    cfg = tier_config(swap_dir, gas=GAS, device_budget=LAYER_BUDGET)
    if acts is not None:
        cfg["tier"]["activations"] = acts
    cfg.update(extra or {})
    engine, *_ = tier.torch.initialize(make(), cfg, **initialize_kwargs)
    losses = tier_losses(engine, STEPS, gas=GAS)
    metrics = engine.stats()["metrics"]
    offload = engine._activations
    counts = (offload.offloaded, offload.bytes_registered) if offload is not None else (0, 0)
    engine.destroy()
    return losses, metrics, counts


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("home", ["host", "nvme"])
def test_offloaded_checkpoints_match_pytorch_and_leave_the_device(swap_dir, home, reentrant):
    make = _checkpointed(make_model, reentrant)
    expected = baseline_losses(STEPS, gas=GAS, make=make)
    got, metrics, (offloaded, pool_bytes) = _offload_run(swap_dir, make, {"offload": home})
    assert max_rel_diff(got, expected) <= 1e-6, (got, expected)
    layers = 2
    assert offloaded == layers * STEPS * GAS, "every layer's checkpoint of every micro-step goes to the engine"
    assert pool_bytes == layers * CHECKPOINT_BYTES, "one engine tensor per layer, reused every step"
    # On the device at most the checkpoint being recomputed and the one prefetched for the next.
    assert metrics["activations.device.peak_bytes"] <= 2 * CHECKPOINT_BYTES
    # Afterwards at most the last one read stays cached there (evictable; with the fp32 params as
    # the optimizer's masters nothing after the step needs its room).
    assert metrics["activations.device.resident_bytes"] <= CHECKPOINT_BYTES
    if home == "nvme":
        assert metrics["activations.nvme.resident_bytes"] == pool_bytes
    else:
        assert metrics["activations.nvme.peak_bytes"] == 0
    # The checkpoints' acquires are in the trace, in backward order: it holds, the prefetcher serves.
    assert metrics["prefetch.order_changes"] == 0 and metrics["prefetch.hits"] > 0


def test_deepspeed_cpu_checkpointing_offloads_to_host(swap_dir):
    make = _checkpointed(make_model, False)
    expected = baseline_losses(STEPS, gas=GAS, make=make)
    ds = {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                       "contiguous_memory_optimization": True, "number_checkpoints": 2,
                                       "synchronize_checkpoint_boundary": False, "profile": False}}
    got, metrics, (offloaded, _) = _offload_run(swap_dir, make, extra=ds)
    assert max_rel_diff(got, expected) <= 1e-6
    assert offloaded == 2 * STEPS * GAS
    assert metrics["activations.host.peak_bytes"] > 0 and metrics["activations.nvme.peak_bytes"] == 0


def test_initialize_turns_checkpointing_on_and_offloads_without_a_deepspeed_section(swap_dir):
    expected = baseline_losses(STEPS, gas=GAS, make=_checkpointed(make_model, False))
    got, metrics, (offloaded, _) = _offload_run(
        swap_dir, make_model, checkpoint_activations=True, offload_activations="nvme"
    )
    assert max_rel_diff(got, expected) <= 1e-6
    assert offloaded == 2 * STEPS * GAS
    assert metrics["activations.nvme.peak_bytes"] > 0


def test_tier_checkpoint_in_a_model_of_ones_own_is_offloaded(swap_dir):
    class Model(_CheckpointedMLP):
        def forward(self, input_ids, labels):
            x = self.embed(input_ids)
            for block in self.blocks:
                x = tier.torch.activations.checkpoint(block, x)
            logits = self.head(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)

    def make():
        return Model(reentrant=False)

    expected = baseline_losses(STEPS, gas=GAS, make=make)
    got, _, (offloaded, _) = _offload_run(swap_dir, make, {"offload": "host"})
    assert max_rel_diff(got, expected) <= 1e-6
    assert offloaded == 3 * STEPS * GAS


def test_offload_without_checkpointing_is_a_clear_error(swap_dir):
    cfg = tier_config(swap_dir, gas=GAS)
    cfg["tier"]["activations"] = {"offload": "host"}
    engine, *_ = tier.torch.initialize(make_model(), cfg)
    with pytest.raises(ValueError, match="offloading needs activation checkpointing"):
        engine(**batch(0))
    engine.destroy()


@pytest.mark.parametrize(
    "section,key",
    [
        ({"tier": {"activations": {"offload": "disk"}}}, "tier.activations.offload"),
        ({"activation_checkpointing": {"cpu_checkpointing": "yes"}}, "activation_checkpointing.cpu_checkpointing"),
        ({"activation_checkpointing": {"number_checkpoints": -1}}, "activation_checkpointing.number_checkpoints"),
    ],
)
def test_activation_values_tier_does_not_take_are_refused_naming_the_key(swap_dir, section, key):
    cfg = tier_config(swap_dir, gas=GAS)
    for k, v in section.items():
        cfg.setdefault(k, {})
        cfg[k].update(v) if k != "tier" else cfg["tier"].update(v)
    with pytest.raises(tier.InvalidArgument, match=key.replace(".", r"\.")):
        tier.torch.initialize(make_model(), cfg)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_lora_with_checkpointing_matches_plain_peft(swap_dir, reentrant):
    """Frozen base weights: a recompute saves a frozen parameter as it is (not detached), so it must
    stay in place until the module's backward; LoRA's adapters train as in plain PEFT."""
    peft = pytest.importorskip("peft")

    def make():
        model = make_model()
        torch.manual_seed(1)
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0)
        )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.enable_input_require_grads()
        model.train()
        return model

    expected = baseline_losses(STEPS, gas=GAS, make=make)
    got, metrics = _run(swap_dir, make, overlap="exact")
    assert max_rel_diff(got, expected) <= 1e-6, (got, expected)
    assert metrics["prefetch.order_changes"] == 0
