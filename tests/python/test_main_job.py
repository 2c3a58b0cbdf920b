"""The main job's summary (host memory per parameter, phase times), its presets and when it
judges the loss."""

import contextlib
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import tier.torch  # noqa: E402
from tier.examples import finetune_llama  # noqa: E402

TINY = ["--gas", "1", "--batch", "1", "--seq", "16", "--hidden", "64", "--layers", "1", "--heads", "2"]


def test_the_summary_reports_host_memory_per_parameter_and_phase_times(tmp_path, capsys):
    assert finetune_llama.main(TINY + ["--steps", "2", "--swap-dir", str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    result = json.loads(out[out.index("{\n"):])
    summary = result["summary"]
    assert summary["peak_rss_bytes"] > 0
    assert summary["host_bytes_per_param"] == pytest.approx(summary["peak_rss_bytes"] / summary["parameters"], rel=0.2)
    assert set(summary["phase_seconds"]) == {"forward", "backward", "step"}
    # The swap files grew to what the model holds: params, gradients and the optimizer's two
    # slots of fp32 state (28 bytes per parameter at least), in 32 MiB steps, not the NVMe budget.
    assert summary["nvme_allocated_peak_bytes"] >= 28 * summary["parameters"]
    assert summary["nvme_allocated_peak_bytes"] <= 4 * (32 << 20)
    assert summary["nvme_bytes_per_param"] == pytest.approx(
        summary["nvme_allocated_peak_bytes"] / summary["parameters"])
    assert summary["prefetch_dropped_unused"] >= 0
    assert all(v > 0 for v in summary["phase_seconds"].values())
    # Each step's own split (bench/scale.py takes the steady state from it), adding up to the whole.
    history = result["history"]
    assert [h["step"] for h in history] == [1, 2]
    for phase, total in summary["phase_seconds"].items():
        assert all(h["phase_seconds"][phase] > 0 for h in history)
        assert sum(h["phase_seconds"][phase] for h in history) == pytest.approx(total, rel=1e-6)
    assert "too few to judge the loss" in captured.err


def test_a_long_enough_run_judges_the_loss(tmp_path, monkeypatch, capsys):
    # Ten steps at a learning rate that makes Adam diverge: the loss goes up, and the run must say so.
    code = finetune_llama.main(TINY + ["--steps", "10", "--lr", "50", "--swap-dir", str(tmp_path)])
    assert code == 1
    assert "the loss did not go down" in capsys.readouterr().err


def test_the_held_out_loss_falls_as_the_model_learns_and_rises_as_it_diverges(tmp_path, capsys):
    # One fixed batch, scored before the first step and after the last: at a sane learning rate
    # the tiny model learns the corpus's byte statistics within a few steps; at lr 50 it diverges.
    def held_out(lr, sub):
        assert finetune_llama.main(TINY + ["--steps", "3", "--lr", lr, "--swap-dir", str(tmp_path / sub),
                                           "--json"]) == 0
        out = capsys.readouterr().out
        s = json.loads(out[out.index("{\n"):])["summary"]
        assert "fixed held-out batch" not in out  # --json prints the summary as JSON only
        return s["held_out_loss_before"], s["held_out_loss_after"]

    before, after = held_out("3e-3", "a")
    assert 0 < after < before
    before_again, diverged = held_out("50", "b")
    assert before_again == pytest.approx(before)  # the same batch and the same initial model
    assert diverged > before


def test_presets_set_the_shape_unless_given(monkeypatch, tmp_path):
    seen = {}

    def fake_run(args, swap_dir):
        seen.update(vars(args))
        return 0

    monkeypatch.setattr(finetune_llama, "run", fake_run)
    finetune_llama.main(["--preset", "737m", "--layers", "2", "--swap-dir", str(tmp_path)])
    assert seen["hidden"] == 2048 and seen["heads"] == 16 and seen["steps"] == 3
    assert seen["layers"] == 2  # given on the command line: the preset does not override it
    assert seen["device_budget"] == finetune_llama.PRESETS["737m"]["device_budget"]
    n, *_ = finetune_llama.model_shape(finetune_llama.argparse.Namespace(**dict(seen, layers=16)))
    assert 700e6 < n < 760e6


def test_checkpointed_activations_offloaded_to_nvme_are_reported(tmp_path, capsys):
    args = ["--gas", "2", "--batch", "2", "--seq", "16", "--hidden", "64", "--layers", "2", "--heads", "2"]
    code = finetune_llama.main(args + ["--steps", "2", "--swap-dir", str(tmp_path), "--json",
                                       "--checkpoint-activations", "--offload-activations", "nvme"])
    assert code == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{\n"):])["summary"]
    assert summary["activations_offloaded"] == 2 * 2 * 2  # layers x steps x micro-steps
    checkpoint = 2 * 16 * 64 * 4  # one layer's input
    peak = summary["activation_peak_bytes"]
    assert peak["nvme"] == 2 * checkpoint and 0 < peak["device"] <= 2 * checkpoint


def test_offloading_activations_without_checkpointing_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        finetune_llama.main(TINY + ["--steps", "1", "--swap-dir", str(tmp_path), "--offload-activations", "host"])
    assert "needs --checkpoint-activations" in capsys.readouterr().err


@pytest.mark.parametrize("init", ["torch", "tier"])
def test_lora_in_bf16_with_checkpointing_trains_and_saves_an_adapter_plain_peft_loads(tmp_path, capsys, init):
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    shape = ["--vocab", "320", "--kv-heads", "1", "--intermediate", "96", "--dtype", "bf16", "--lora-r", "4"]
    adapter = tmp_path / "adapter"
    argv = TINY + shape + ["--checkpoint-activations", "--steps", "4", "--lr", "1e-2", "--swap-dir",
                           str(tmp_path / "swap"), "--save-adapter", str(adapter), "--json", "--init", init]
    assert finetune_llama.main(argv) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{\n"):])["summary"]
    args = finetune_llama.main.__globals__["argparse"].Namespace(
        hidden=64, layers=1, heads=2, kv_heads=1, intermediate=96, vocab=320, seq=16, dtype="bf16", lora_r=4, seed=0,
        lora_targets="q_proj,k_proj,v_proj,o_proj", init=init)
    n_params, _, _, trainable = finetune_llama.model_shape(args)
    assert summary["parameters"] == n_params
    assert trainable == 4 * 4 * (64 + 64) - 2 * 4 * (64 - 32)  # k and v project to one kv head of 32
    # The build wrote every bf16 weight at least once, at most twice (only changed values again);
    # with tier's generator the base exactly once (each drawn as its module's construction ends),
    # the adapters twice (PEFT redraws A and zeroes B after building them).
    assert summary["init"] == init
    if init == "tier":
        assert summary["build_bytes_written"] == 2 * n_params + 2 * trainable
    else:
        assert 2 * n_params <= summary["build_bytes_written"] <= 2 * 2 * n_params
    assert summary["build_seconds"] > 0
    # Plain PEFT loads the adapter onto the same base (built eagerly with the same seed and
    # generator) and computes the trained model's logits, saved by the run beside the adapter.
    probe = torch.load(adapter / finetune_llama.PROBE_FILE)
    assert probe["input_ids"].shape == (1, 16)  # min(32, --seq)
    plain = finetune_llama.plain_peft_logits(args, adapter, probe["input_ids"])
    assert plain.shape == probe["logits"].shape == (1, 16, 320)
    assert torch.allclose(plain, probe["logits"], rtol=1e-5, atol=1e-5), (plain - probe["logits"]).abs().max()
    # The trained adapter differs from a fresh one (LoRA's B starts at zero, as PEFT makes it,
    # and the first step's warmup lr is 0): its logits are not the base's.
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with tier.torch.fast_random(0) if init == "tier" else contextlib.nullcontext():
            base = transformers.LlamaForCausalLM(finetune_llama.llama_config(args))
    finally:
        torch.set_default_dtype(previous)
    model = peft.PeftModel.from_pretrained(base, str(adapter), autocast_adapter_dtype=False)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 4
    assert all(p.abs().max() > 0 for p in lora_b)
    with torch.no_grad(), model.disable_adapter():
        untrained = model(input_ids=probe["input_ids"]).logits.float()
    assert not torch.allclose(untrained, plain, rtol=1e-3, atol=1e-3)


def test_a_preset_the_disk_cannot_hold_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    import os

    from tier.torch import footprint

    real = os.statvfs

    class Disk:  # 50 GB free, whatever this machine has
        def __init__(self, st):
            self.f_blocks, self.f_frsize, self.f_bavail = st.f_blocks, 4096, 50_000_000_000 // 4096

    monkeypatch.setattr(footprint.os, "statvfs", lambda p: Disk(real(p)))
    swap = tmp_path / "swap"
    assert finetune_llama.main(["--preset", "7b", "--swap-dir", str(swap)]) == 2
    err = capsys.readouterr().err
    # 12 B x 6.74 B parameters: the state once (tier.optimizer.state_copies 1, the default)
    assert "optimizer state 75.3" in err, err
    assert "parameters 12.5" in err, err  # bf16
    assert "are free" in err
    assert not swap.exists() or not any(swap.iterdir()), "nothing written"
