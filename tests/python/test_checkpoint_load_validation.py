"""A checkpoint load is all or nothing (issue #31, item 3): a checkpoint whose manifest verifies
but whose RNG state, counters or scheduler state are invalid is refused before anything is
applied. The old code checked the RNG state's length only, so a state torch refuses ("Invalid
mt19937 state") failed after the weights, counters and scheduler were applied; counters of 2^62
and a negative scheduler step were applied as they were."""

import base64
import hashlib
import json
import os
import struct
import sys

import pytest

torch = pytest.importorskip("torch")

import tier  # noqa: E402
import tier.torch  # noqa: E402
from tier.torch import zero_checkpoint  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt_kill_child as kc  # noqa: E402


@pytest.fixture
def engine(swap_dir):
    e = kc.new_engine(swap_dir)
    yield e
    e.close()


def snapshot(engine):
    """Everything a load would change."""
    return {
        "params": engine.state_dict_fp32(),
        "steps": (engine.global_steps, engine.micro_steps, engine.skipped_steps),
        "lr": engine.get_lr(),
        "sched": engine.scheduler.last_step,
        "rng": torch.get_rng_state(),
    }


def assert_same(a, b):
    assert a["steps"] == b["steps"]
    assert a["lr"] == b["lr"]
    assert a["sched"] == b["sched"]
    assert torch.equal(a["rng"], b["rng"])
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name


def resign(path, fmt):
    """Rewrites manifest.json for the files as they are now: a consistent but altered checkpoint,
    as anyone who can write the folder can make (the manifest is a checksum, not a signature)."""
    files = {}
    for name in sorted(os.listdir(path)):
        if name == "manifest.json":
            continue
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    body = {"format": fmt, "files": files}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    os.chmod(os.path.join(path, "manifest.json"), 0o600)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(dict(body, sha256=digest), f)


def edit_json(path, name, edit):
    p = os.path.join(path, name)
    with open(p) as f:
        doc = json.load(f)
    edit(doc)
    os.chmod(p, 0o600)
    with open(p, "w") as f:
        json.dump(doc, f)


def broken_rng(b64):
    """The saved CPU generator state with its mt19937 position (the int after the seed) set to 0:
    the right length, but a state torch refuses."""
    raw = bytearray(base64.b64decode(b64))
    struct.pack_into("<i", raw, 8, 0)
    return base64.b64encode(bytes(raw)).decode()


def saved_then_moved_on(engine, ckpt, save=None):
    """Trains 2 steps, saves, trains 1 more: the state then differs from the checkpoint in params,
    counters, lr, scheduler and RNG, so anything applied by a refused load would show."""
    kc.train_step(engine)
    kc.train_step(engine)
    path = (save or engine.save_checkpoint)(ckpt)
    kc.train_step(engine)
    return os.path.realpath(path)


EDITS = {
    "rng-invalid-state": lambda m: m["rng"].update(cpu=broken_rng(m["rng"]["cpu"])),
    "global-steps-2^62": lambda m: m.update(global_steps=1 << 62),
    "micro-steps-negative": lambda m: m.update(micro_steps=-1),
    "skipped-steps-bool": lambda m: m.update(skipped_steps=True),
    "scheduler-step-negative": lambda m: m["scheduler"].update(last_step=-5),
    "scheduler-step-2^62": lambda m: m["scheduler"].update(last_step=1 << 62),
    "scheduler-step-float": lambda m: m["scheduler"].update(last_step=2.5),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_verified_checkpoint_with_invalid_state_changes_nothing(engine, tmp_path, edit):
    ckpt = str(tmp_path / "ckpt")
    path = saved_then_moved_on(engine, ckpt)
    edit_json(path, "meta.json", EDITS[edit])
    resign(path, "tier-checkpoint-2")
    before = snapshot(engine)
    with pytest.raises(ValueError) as info:
        engine.load_checkpoint(ckpt)
    assert path in str(info.value)
    assert_same(before, snapshot(engine))


def test_the_rng_refusal_says_what_is_wrong(engine, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    path = saved_then_moved_on(engine, ckpt)
    edit_json(path, "meta.json", EDITS["rng-invalid-state"])
    resign(path, "tier-checkpoint-2")
    with pytest.raises(ValueError, match="CPU RNG state is not a valid generator state.*nothing was loaded"):
        engine.load_checkpoint(ckpt)


def test_an_unchanged_checkpoint_still_loads_whole(engine, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    kc.train_step(engine)
    kc.train_step(engine)
    engine.save_checkpoint(ckpt)
    saved = snapshot(engine)
    kc.train_step(engine)
    path = os.path.realpath(os.path.join(ckpt, "global_step2"))
    resign(path, "tier-checkpoint-2")  # re-signing alone changes nothing
    engine.load_checkpoint(ckpt)
    assert_same(saved, snapshot(engine))


# The checkpoints saved by ranks (tier.torch.zero_checkpoint), loaded here by one process.
def _save_ranks(engine):
    return lambda ckpt: zero_checkpoint.save(engine, ckpt, None, {})


RANK_EDITS = {
    "rng-invalid-state": ("rank0.json", lambda p: p.update(rng_cpu=broken_rng(p["rng_cpu"]))),
    "group-step-negative": ("rank0.json", lambda p: p.update(group_steps=[-1] * len(p["group_steps"]))),
    "global-steps-string": ("meta.json", lambda m: m.update(global_steps="3")),
    "scheduler-step-negative": ("meta.json", lambda m: m["scheduler"].update(last_step=-5)),
}


@pytest.mark.parametrize("edit", sorted(RANK_EDITS))
def test_a_rank_checkpoint_with_invalid_state_changes_nothing(engine, tmp_path, edit):
    ckpt = str(tmp_path / "ckpt")
    path = saved_then_moved_on(engine, ckpt, save=_save_ranks(engine))
    assert zero_checkpoint.is_rank_checkpoint(ckpt, None)
    name, change = RANK_EDITS[edit]
    edit_json(path, name, change)
    resign(path, zero_checkpoint.FORMAT)
    before = snapshot(engine)
    with pytest.raises(ValueError):
        engine.load_checkpoint(ckpt)
    assert_same(before, snapshot(engine))


def test_a_good_rank_checkpoint_loads_whole(engine, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    kc.train_step(engine)
    kc.train_step(engine)
    zero_checkpoint.save(engine, ckpt, None, {"k": 1})
    saved = snapshot(engine)
    kc.train_step(engine)
    _, client = engine.load_checkpoint(ckpt)
    assert client == {"k": 1}
    assert_same(saved, snapshot(engine))


def test_a_refused_load_keeps_the_gradients_taken_so_far(engine, tmp_path):
    """A load applies everything or nothing, gradients included: the micro-steps accumulated
    before a refused load are still there, and the step they make is the one they would make."""
    ckpt = str(tmp_path / "ckpt")
    path = saved_then_moved_on(engine, ckpt)
    edit_json(path, "meta.json", EDITS["rng-invalid-state"])
    resign(path, "tier-checkpoint-2")
    x = torch.randn(8, 16)
    loss = torch.nn.functional.mse_loss(engine(x), torch.sin(x[:, :4] * 2.0))
    engine.backward(loss)
    engine.step()  # a micro-step off the boundary: its gradients are held
    held = {pid: t.clone() for pid, t in engine._grads.held.items()}
    assert held
    with pytest.raises(ValueError):
        engine.load_checkpoint(ckpt)
    assert engine._grads.held.keys() == held.keys()
    assert all(torch.equal(engine._grads.held[pid], t) for pid, t in held.items())
