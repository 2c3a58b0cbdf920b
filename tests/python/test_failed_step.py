"""A step that fails in the optimizer pass (a full disk, an I/O error) leaves one documented state
from which every natural continuation trains exactly as a clean run does, bit for bit:

- retry: ``step()`` again once the disk has room;
- restart the window: ``zero_grad()``, then the window's micro-steps again and ``step()``;
- continue: another ``backward()`` adds to the kept gradients, and ``step()`` steps with the sum.

Faults come from the FaultInjectingEngine under the optimizer's swap space
(``TIER_FAULT_INJECTION=1`` and ``optimizer._inject_io_fault``)."""

import errno

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tier  # noqa: E402
import tier.torch  # noqa: E402
from test_torch_llama import batch, make_model, tier_config  # noqa: E402

GAS = 2
FAULTS = {"enospc-write": ("write", errno.ENOSPC, tier.NoSpace), "eio-read": ("read", errno.EIO, tier.IoError)}


@pytest.fixture(autouse=True)
def _fault_injection(monkeypatch):
    monkeypatch.setenv("TIER_FAULT_INJECTION", "1")


def _engine(tmp_path, overlap, name):
    d = tmp_path / name
    d.mkdir()
    cfg = tier_config(str(d), gas=GAS)
    cfg["tier"]["optimizer"]["overlap"] = overlap
    engine, *_ = tier.torch.initialize(make_model(), cfg)
    return engine


def _micro(engine, i, boundary=None):
    if boundary is not None:
        engine.set_gradient_accumulation_boundary(boundary)
    out = engine(**batch(i))
    engine.backward(out.loss)


def _result(engine):
    """The fp32 masters, the params the model computes with and the applied steps."""
    engine._settle()
    masters = {k: v.clone() for k, v in engine.state_dict_fp32().items()}
    params = {k: v.clone() for k, v in engine.module_state_dict().items()}
    steps = engine.global_steps
    engine.destroy()
    return masters, params, steps


def _assert_same(got, want):
    assert got[2] == want[2], f"applied steps: {got[2]} against {want[2]}"
    for part in (0, 1):
        assert got[part].keys() == want[part].keys()
        for k in want[part]:
            assert torch.equal(got[part][k], want[part][k]), f"{k} differs from the clean run"


def _clean(tmp_path, overlap, plan=None):
    """A run without faults: micro-steps 0..5 with a step after each (3 applied steps), or the
    boundaries given by `plan` (micro-step -> boundary)."""
    engine = _engine(tmp_path, overlap, f"clean-{overlap}-{bool(plan)}")
    for i in range(6):
        _micro(engine, i, None if plan is None else plan.get(i))
        engine.step()
    return _result(engine)


def _fail_second_step(engine, overlap, fault):
    """Micro-steps 0..3; the step of the second window (its update, for "delayed") fails. Returns
    the exception. The fault is gone afterwards (the disk has room again)."""
    op, err, kind = FAULTS[fault]
    raised = None
    for i in range(4):
        # Exact: the step's update starts during micro-step 3's backward, and may have read every
        # chunk by the time backward returns; so the fault is in place before that backward
        # (serial: the same, its update runs in step()). Delayed: the update started at
        # micro-step 1's step runs meanwhile and fails; its join at micro-step 3's step reports it.
        if overlap != "delayed" and i == 3:
            engine.optimizer._inject_io_fault(op, err, nth=1, count=10**9)
        _micro(engine, i)
        if overlap == "delayed" and i == 1:
            engine.optimizer._inject_io_fault(op, err, nth=1, count=10**9)
        if i == 3:
            with pytest.raises(kind) as info:
                engine.step()
            raised = info.value
            engine.optimizer._clear_io_faults()
        else:
            engine.step()
    assert raised.errno == err
    assert "not applied" in str(raised) and "kept" in str(raised), str(raised)
    assert engine.global_steps == (0 if overlap == "delayed" else 1)
    return raised


CASES = [(o, f) for o in ("serial", "exact") for f in FAULTS] + [("delayed", "enospc-write")]


@pytest.mark.parametrize("overlap,fault", CASES)
def test_retrying_the_failed_step_trains_as_a_clean_run(tmp_path, overlap, fault):
    want = _clean(tmp_path, overlap)
    engine = _engine(tmp_path, overlap, "run")
    _fail_second_step(engine, overlap, fault)
    engine.step()  # the retry
    for i in (4, 5):
        _micro(engine, i)
        engine.step()
    _assert_same(_result(engine), want)


@pytest.mark.parametrize("overlap,fault", CASES)
def test_zero_grad_after_a_failed_step_restarts_its_window(tmp_path, overlap, fault):
    want = _clean(tmp_path, overlap)
    engine = _engine(tmp_path, overlap, "run")
    _fail_second_step(engine, overlap, fault)
    engine.zero_grad()
    for i in (2, 3, 4, 5):  # the failed window's micro-steps again, then the third window
        _micro(engine, i)
        engine.step()
    _assert_same(_result(engine), want)


@pytest.mark.parametrize("overlap,fault", CASES)
def test_another_backward_after_a_failed_step_adds_to_its_gradients(tmp_path, overlap, fault):
    # The loop goes on as if nothing happened: micro-step 4's gradients join the failed window
    # (2, 3), which the next step applies; micro-step 5 starts the next window.
    want = _clean(tmp_path, overlap, plan={0: None, 1: None, 2: False, 3: False, 4: True, 5: False})
    engine = _engine(tmp_path, overlap, "run")
    _fail_second_step(engine, overlap, fault)
    for i in (4, 5):
        _micro(engine, i)
        engine.step()
    _assert_same(_result(engine), want)


def test_the_failed_step_keeps_the_params_and_the_state_of_the_step_before(tmp_path):
    """Right after the failure, before any continuation: params and masters are those after the
    first step (the serial pass had delivered part of the failed update; it is put back)."""
    engine = _engine(tmp_path, "serial", "one")
    for i in range(2):
        _micro(engine, i)
        engine.step()
    masters = {k: v.clone() for k, v in engine.state_dict_fp32().items()}
    params = {k: v.clone() for k, v in engine.module_state_dict().items()}
    _micro(engine, 2)
    engine.step()
    _micro(engine, 3)
    engine.optimizer._inject_io_fault("write", errno.ENOSPC, nth=1, count=10**9)  # after chunk 0 is out
    with pytest.raises(tier.NoSpace):
        engine.step()
    engine.optimizer._clear_io_faults()
    assert engine.micro_steps == 3, "the failed boundary micro-step is not counted"
    assert engine.is_gradient_accumulation_boundary()
    for k, v in engine.module_state_dict().items():
        assert torch.equal(v, params[k]), k
    for k, v in engine.state_dict_fp32().items():
        assert torch.equal(v, masters[k]), k
    engine.destroy()
