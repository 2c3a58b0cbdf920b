"""tier.torch's lr schedules against DeepSpeed's, step for step.

The reference below restates DeepSpeed's documented schedules (deepspeed/runtime/lr_schedules.py)
as functions of DeepSpeed's ``last_batch_iteration`` (``it``). DeepSpeed constructs a scheduler at
``it = -1`` and its engine calls ``scheduler.step()`` after each applied optimizer step, so the
n-th optimizer step runs at ``it = n - 2``. ``drive_reference`` replays that loop."""

import json
import math

import pytest

torch = pytest.importorskip("torch")

import tier  # noqa: E402
import tier.torch  # noqa: E402
from tier.torch import schedulers  # noqa: E402

STEPS = 40


# ----------------------------------------------------------------------------------- reference
def ref_warm_fraction(it, warm, kind):
    warm = max(2, warm)  # DeepSpeed never warms up over fewer than 2 steps
    return math.log(it + 1) / math.log(warm) if kind == "log" else it / warm


def ref_warmup_lr(it, lo=0.0, hi=0.001, warm=1000, kind="log"):
    if it < 0:
        return lo
    if it < max(2, warm):
        return lo + (hi - lo) * ref_warm_fraction(it, warm, kind)
    return hi


def ref_warmup_decay_lr(it, total, lo=0.0, hi=0.001, warm=1000, kind="log"):
    if it < 0:
        return lo
    w = max(2, warm)
    if it < w:
        return lo + (hi - lo) * ref_warm_fraction(it, warm, kind)
    return lo + (hi - lo) * max(0.0, (total - it) / max(1.0, total - w))


def ref_warmup_cosine_lr(it, base, total, min_ratio=0.0, warm=1000, cos_min=0.0001, kind="log"):
    if it < 0:
        return 0.0
    w = max(2, warm)
    if it < w:
        return base * (min_ratio + (1 - min_ratio) * ref_warm_fraction(it, warm, kind))
    progress = min(1.0, (it - w + 1) / max(1, total - w))
    return base * max(0.0, cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress)))


def ref_onecycle(it, lo, hi, first=2000, second=None, stairs1=0, stairs2=None, decay_size=0, decay_rate=0.0):
    second = first if second is None else second
    stairs2 = stairs1 if stairs2 is None else stairs2
    size = first + second
    if it < size:
        b = it + 1
        x = 1 + b / size - math.floor(1 + b / size)
        up = first / size
        if x <= up:
            scale, stairs = x / up, stairs1
        else:
            scale, stairs = (x - 1) / (up - 1), stairs2
        if stairs > 0:
            at = b % size
            pos = at * stairs / first if at <= first else (size - at) * stairs / second
            scale = math.floor(pos) / stairs
        return lo + (hi - lo) * scale
    if decay_size == 0 or decay_rate == 0:
        return lo
    return lo / (1 + decay_rate * (it - size + 1) / decay_size)


def ref_range_test(it, lo=1e-3, size=2000, rate=1.0, stair=False):
    interval = (it + 1) / size
    if stair:
        interval = math.floor(interval)
    return lo * (1 + rate * interval)


def drive_reference(fn, steps=STEPS):
    """The lr each optimizer step 1..steps runs with under DeepSpeed's engine loop."""
    it = -1
    used = []
    for _ in range(steps):
        used.append(fn(it))
        it += 1  # engine: lr_scheduler.step() after the optimizer step
    return used


def drive_tier(sched, steps=STEPS):
    return [sched.lrs(n)[0] for n in range(steps)]


def close(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x == pytest.approx(y, rel=1e-12, abs=1e-15), f"optimizer step {i + 1}: tier {x} vs DeepSpeed {y}"


# ----------------------------------------------------------------------------------- per type
@pytest.mark.parametrize("warm", [0, 1, 2, 3, 10])
@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_matches_deepspeed(warm, kind):
    sec = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": warm,
                                          "warmup_type": kind}}
    got = drive_tier(schedulers.from_config(sec, [5e-4]))
    close(got, drive_reference(lambda it: ref_warmup_lr(it, 1e-5, 1e-3, warm, kind)))


def test_warmup_lr_peak_defaults_to_each_groups_lr():
    sec = {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}}
    s = schedulers.from_config(sec, [1e-3, 2e-3])
    assert s.lrs(10) == pytest.approx([1e-3, 2e-3])
    assert s.lrs(3) == pytest.approx([ref_warmup_lr(2, 0, 1e-3, 4, "linear"), ref_warmup_lr(2, 0, 2e-3, 4, "linear")])


@pytest.mark.parametrize("warm", [0, 1, 2, 5])
@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("total", [1, 12, 30])
def test_warmup_decay_lr_matches_deepspeed(warm, kind, total):
    sec = {"type": "WarmupDecayLR", "params": {"total_num_steps": total, "warmup_min_lr": 0.0, "warmup_max_lr": 2e-3,
                                               "warmup_num_steps": warm, "warmup_type": kind}}
    got = drive_tier(schedulers.from_config(sec, [1.0]))
    close(got, drive_reference(lambda it: ref_warmup_decay_lr(it, total, 0.0, 2e-3, warm, kind)))


def test_warmup_decay_lr_peak_defaults_to_deepspeeds_0_001_not_the_optimizer_lr():
    sec = {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 2}}
    s = schedulers.from_config(sec, [0.5])
    assert s.lr(51) == pytest.approx(ref_warmup_decay_lr(50, 100, 0.0, 0.001, 2))
    assert s.lr(51) == pytest.approx(0.001 * 50 / 98)


@pytest.mark.parametrize("warm", [0, 1, 2, 6])
@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_matches_deepspeed_including_warmup_type(warm, kind):
    sec = {"type": "WarmupCosineLR", "params": {"total_num_steps": 25, "warmup_min_ratio": 0.1,
                                                "warmup_num_steps": warm, "cos_min_ratio": 0.01, "warmup_type": kind}}
    got = drive_tier(schedulers.from_config(sec, [3e-4]))
    close(got, drive_reference(lambda it: ref_warmup_cosine_lr(it, 3e-4, 25, 0.1, warm, 0.01, kind)))


def test_warmup_cosine_linear_and_log_warmups_differ():
    def lrs(kind):
        sec = {"type": "WarmupCosineLR", "params": {"total_num_steps": 50, "warmup_num_steps": 10, "warmup_type": kind}}
        return drive_tier(schedulers.from_config(sec, [1e-3]), 12)

    assert lrs("log")[4] != pytest.approx(lrs("linear")[4])


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"cycle_second_step_size": 3},
        {"cycle_first_stair_count": 2},
        {"cycle_first_stair_count": 2, "cycle_second_stair_count": 3, "cycle_second_step_size": 6},
        {"decay_step_size": 2, "decay_lr_rate": 0.5},
        {"decay_step_size": 2, "decay_lr_rate": 0.0},
    ],
)
def test_onecycle_matches_deepspeed(params):
    sec = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 5,
                                          **params}}
    got = drive_tier(schedulers.from_config(sec, [1.0]))
    ref = drive_reference(
        lambda it: ref_onecycle(
            it, 1e-4, 1e-3, 5, params.get("cycle_second_step_size"), params.get("cycle_first_stair_count", 0),
            params.get("cycle_second_stair_count"), params.get("decay_step_size", 0), params.get("decay_lr_rate", 0.0)
        )
    )
    close(got, ref)


def test_onecycle_cycles_beta1_inversely_and_pins_beta2_as_deepspeed_does():
    sec = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 4,
                                          "cycle_min_mom": 0.8, "cycle_max_mom": 0.9}}
    s = schedulers.from_config(sec, [1.0])
    assert s.betas(0) == [(0.8, 0.99)]  # the constructor's value, before any step
    # After n steps DeepSpeed is at batch n of an 8-step cycle rising over 4: scale n / 4.
    assert s.betas(1)[0] == pytest.approx((0.9 - 0.1 * 0.25, 0.99))
    assert s.betas(3)[0][0] == pytest.approx(0.9 - 0.1 * 0.75)
    assert s.betas(6)[0][0] == pytest.approx(0.9 - 0.1 * 0.5)  # on the way down
    sec["params"]["cycle_momentum"] = False
    assert schedulers.from_config(sec, [1.0]).betas(3) is None


@pytest.mark.parametrize("stair", [False, True])
def test_lr_range_test_matches_deepspeed(stair):
    sec = {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-5, "lr_range_test_step_size": 3,
                                             "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": stair}}
    got = drive_tier(schedulers.from_config(sec, [1.0]))
    close(got, drive_reference(lambda it: ref_range_test(it, 1e-5, 3, 2.0, stair)))


def test_type_names_are_case_insensitive_and_unknown_types_list_the_supported_ones():
    assert schedulers.from_config({"type": "warmuplr", "params": {}}, [1e-3]).kind == "WarmupLR"
    with pytest.raises(ValueError, match="OneCycle"):
        schedulers.from_config({"type": "CosineAnnealing"}, [1e-3])


def test_parameters_are_judged_as_the_config_check_judges_them():
    # Unknown anywhere: the config check notes and ignores it, so the schedule does too.
    s = schedulers.from_config({"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_stepz": 9}}, [1e-3])
    assert s.warmup_num_steps == 3
    cfg_notes = tier.Config.from_json(json.dumps({"scheduler": {"type": "WarmupLR", "params": {"warmup_stepz": 9}}}))
    assert any("warmup_stepz" in n for n in cfg_notes.notes)
    # Another type's parameter: refused by both.
    sec = {"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}
    with pytest.raises(ValueError, match="does not apply to WarmupLR"):
        schedulers.from_config(sec, [1e-3])
    with pytest.raises(tier.InvalidArgument, match="does not apply to WarmupLR"):
        tier.Config.from_json(json.dumps({"scheduler": sec}))


# ----------------------------------------------------------------------------------- "auto"
def test_auto_values_fill_as_the_hugging_face_trainer_fills_them():
    sec = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                               "warmup_num_steps": "auto", "total_num_steps": "auto"}}
    s = schedulers.from_config(sec, [2e-5], 2e-5, total_num_steps=30)
    # The Trainer writes max(1, warmup_steps) = 1 without warmup; DeepSpeed then warms up over 2.
    close(drive_tier(s), drive_reference(lambda it: ref_warmup_decay_lr(it, 30, 0.0, 2e-5, 1)))
    s = schedulers.from_config(sec, [2e-5], 2e-5, total_num_steps=30, warmup_num_steps=7)
    assert s.params["warmup_num_steps"] == 7


def test_auto_total_num_steps_without_the_argument_names_what_to_pass():
    sec = {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}
    with pytest.raises(ValueError, match=r"total_num_steps=N"):
        schedulers.from_config(sec, [1e-3])


# ----------------------------------------------------------------------------------- engine
def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def engine_config(scheduler, **extra):
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "scheduler": scheduler,
        "tier": {"device": "emulated", "budgets": {"device": "4M", "host": "16M"}, "optimizer": {"buffer_bytes": "2M"}},
    }
    cfg.update(extra)
    return cfg


class RecordingOptimizer:
    """Stands in for the engine's optimizer and records the lr each update runs with."""

    def __init__(self, inner):
        self._inner = inner
        self.used = []

    def step(self, *args, **kwargs):
        self.used.append(self._inner.lr(0))
        return self._inner.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def lrs_used_by_engine(engine, steps):
    """The lr each optimizer step ran with."""
    engine.native_optimizer = RecordingOptimizer(engine.native_optimizer)
    x = torch.randn(4, 8)
    for _ in range(steps):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    assert engine.global_steps == steps
    return engine.native_optimizer.used


def test_engine_runs_deepspeeds_schedule_without_running_a_step_ahead():
    sec = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
                                          "warmup_type": "linear"}}
    engine, *_ = tier.torch.initialize(tiny_model(), engine_config(sec))
    used = lrs_used_by_engine(engine, 6)
    expected = drive_reference(lambda it: ref_warmup_lr(it, 0.0, 1e-3, 10, "linear"), 6)
    assert expected[:3] == pytest.approx([0.0, 0.0, 1e-4])
    assert used == pytest.approx(expected, abs=1e-12)
    # After a step, get_lr() reports the lr of the next step, as DeepSpeed's does.
    assert engine.get_lr()[0] == pytest.approx(ref_warmup_lr(5, 0.0, 1e-3, 10, "linear"))


def test_engine_initializes_the_hugging_face_auto_warmup_of_one_step():
    sec = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 1}}
    engine, *_ = tier.torch.initialize(tiny_model(), engine_config(sec))
    used = lrs_used_by_engine(engine, 4)
    assert used == pytest.approx(drive_reference(lambda it: ref_warmup_lr(it, 0.0, 1e-3, 1), 4), abs=1e-12)


def test_engine_fills_auto_total_num_steps_from_initialize():
    sec = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto",
                                               "warmup_max_lr": "auto"}}
    with pytest.raises(ValueError, match="total_num_steps"):
        tier.torch.initialize(tiny_model(), engine_config(sec))
    engine, *_ = tier.torch.initialize(tiny_model(), engine_config(sec), total_num_steps=4, warmup_num_steps=2)
    used = lrs_used_by_engine(engine, 6)
    assert used == pytest.approx(drive_reference(lambda it: ref_warmup_decay_lr(it, 4, 0.0, 1e-3, 2), 6), abs=1e-12)


def test_engine_runs_onecycle_with_its_momentum_cycle():
    sec = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2}}
    engine, *_ = tier.torch.initialize(tiny_model(), engine_config(sec))
    used = lrs_used_by_engine(engine, 5)
    assert used == pytest.approx(drive_reference(lambda it: ref_onecycle(it, 1e-4, 1e-3, 2), 5), abs=1e-12)
