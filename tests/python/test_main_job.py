"""The main job's summary (host memory per parameter, phase times), its presets and when it
judges the loss."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

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
