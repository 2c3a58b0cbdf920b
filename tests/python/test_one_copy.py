"""``tier.optimizer.state_copies: 1``: the optimizer state is kept once on NVMe (plus a few spare
chunks) instead of a committed and a shadow copy. Training is the same bit for bit; the files hold
about half; and a step that fails after part of the state took its update is finished, not
undone: whatever the loop does next (``step()``, a forward, ``backward()``, ``zero_grad()``), the
step owed is finished first with the gradients and the lr it began with, so the run trains as a
clean one does. Faults come from the FaultInjectingEngine under the optimizer's swap space
(``TIER_FAULT_INJECTION=1``)."""

import errno

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tier  # noqa: E402
import tier.torch  # noqa: E402
from test_failed_step import _assert_same, _micro, _result  # noqa: E402
from test_torch_llama import make_model, tier_config  # noqa: E402

CHUNK = 8192  # elements: several chunks for the tiny model


@pytest.fixture(autouse=True)
def _fault_injection(monkeypatch):
    monkeypatch.setenv("TIER_FAULT_INJECTION", "1")


def _engine(tmp_path, name, copies=1, overlap="serial"):
    d = tmp_path / name
    d.mkdir()
    cfg = tier_config(str(d), gas=2)
    cfg["tier"]["optimizer"].update({"state_copies": copies, "chunk_elements": CHUNK, "overlap": overlap})
    engine, *_ = tier.torch.initialize(make_model(), cfg)
    return engine


def _clean(tmp_path, copies=1, overlap="serial"):
    engine = _engine(tmp_path, f"clean-{copies}-{overlap}", copies, overlap)
    for i in range(6):
        _micro(engine, i)
        engine.step()
    return engine


def test_one_copy_trains_as_two_copies_with_half_the_files(tmp_path):
    one = _clean(tmp_path, 1)
    two = _clean(tmp_path, 2)
    s1, s2 = one.native_optimizer.stats(), two.native_optimizer.stats()
    assert (s1["state_copies"], s2["state_copies"]) == (1, 2)
    assert s1["chunks"] == s2["chunks"] >= 6, s1
    # The fp32 parameters are their own masters with one copy (tier.optimizer.params_are_masters):
    # its records hold m and v; two copies keep a master in the record too. Slots and spares hold a
    # whole chunk. The two train alike (below).
    assert one._engine_masters and not two._engine_masters
    record = s1["chunk_elements"] * 8
    # One slot per chunk plus buffer_count + speculation_chunks (0) spares, against two per chunk.
    assert s1["spare_slots"] == s1["buffer_count"], s1
    assert s1["nvme_bytes"] == (s1["chunks"] + s1["spare_slots"]) * record, s1
    assert s2["nvme_bytes"] >= 2 * s2["record_bytes"], s2
    _assert_same(_result(one), _result(two))


def _fail_second_step(engine):
    """Micro-steps 0..3; the second window's step fails once its third chunk's write has begun
    (a disk filling up): two chunks took the update. The disk has room again afterwards."""
    chunk_bytes = engine.native_optimizer.stats()["record_bytes"] // engine.native_optimizer.stats()["chunks"]
    for i in range(4):
        _micro(engine, i)
        if i == 3:
            engine.optimizer._inject_io_fault("write", errno.ENOSPC, after_bytes=2 * chunk_bytes + 4096)
            with pytest.raises(tier.NoSpace) as info:
                engine.step()
            engine.optimizer._clear_io_faults()
        else:
            engine.step()
    msg = str(info.value)
    assert "chunks took their update" in msg and "finish" in msg, msg
    assert engine.native_optimizer.stats()["failed_step_owed"]
    assert engine.global_steps == 1
    assert engine.micro_steps == 3, "the failed boundary micro-step is not counted yet"


@pytest.mark.parametrize("then", ["step", "forward", "backward", "zero_grad"])
def test_a_step_failing_part_way_is_finished_by_whatever_comes_next(tmp_path, then):
    want = _result(_clean(tmp_path))
    engine = _engine(tmp_path, "run")
    _fail_second_step(engine)
    if then == "step":
        engine.step()
    elif then == "forward":
        engine.eval()
        with torch.no_grad():
            engine(**__import__("test_torch_llama").batch(0))
        engine.train()
    elif then == "backward":
        pass  # micro-step 4's forward and backward come next
    else:
        engine.zero_grad()
    if then != "backward":
        assert not engine.native_optimizer.stats()["failed_step_owed"]
        assert engine.global_steps == 2 and engine.micro_steps == 4
    for i in (4, 5):
        _micro(engine, i)
        engine.step()
    _assert_same(_result(engine), want)


def test_a_checkpoint_waits_for_the_step_owed(tmp_path):
    engine = _engine(tmp_path, "run")
    _fail_second_step(engine)
    with pytest.raises(Exception) as info:
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert "call step() to finish it" in str(info.value), str(info.value)
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.destroy()
