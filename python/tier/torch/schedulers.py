"""Learning-rate schedules from DeepSpeed's ``scheduler`` config section.

Supported types: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and
``LRRangeTest``, with DeepSpeed's parameter names, defaults and step semantics.

Timing. DeepSpeed builds a scheduler with ``last_batch_iteration = -1`` (which sets the lr of
"iteration -1") and the engine calls ``scheduler.step()`` after every applied optimizer step. So
the n-th optimizer step (n = 1, 2, ...) runs with the lr of iteration n - 2: the first two steps
both run at the bottom of the warmup. :meth:`Scheduler.lrs` takes the number of optimizer steps
applied so far and returns the lrs the next one uses, which is the same thing.

``"auto"`` values are filled as the Hugging Face and accelerate integrations fill them:
``warmup_min_lr`` 0, ``warmup_max_lr`` the optimizer's lr, ``warmup_num_steps`` from
``initialize(warmup_num_steps=...)`` (else 1, what the Trainer writes when there is no warmup) and
``total_num_steps`` from ``initialize(total_num_steps=...)``, which must then be given.
"""

import math

# DeepSpeed's defaults per type; None: required. The warmup peak of WarmupLR defaults to each
# param group's own lr (marked by _GROUP_LR); WarmupDecayLR's to 0.001, as in DeepSpeed.
_GROUP_LR = object()
_DEFAULTS = {
    "WarmupLR": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": _GROUP_LR,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupDecayLR": {
        "total_num_steps": None,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupCosineLR": {
        "total_num_steps": None,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
    },
    "OneCycle": {
        "cycle_min_lr": None,
        "cycle_max_lr": None,
        "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000,
        "cycle_second_step_size": None,
        "cycle_first_stair_count": 0,
        "cycle_second_stair_count": None,
        "decay_step_size": 0,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": 1e-3,
        "lr_range_test_step_size": 2000,
        "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False,
    },
}
_TYPES = {k.lower(): k for k in _DEFAULTS}
# DeepSpeed's OneCycle keeps the second Adam beta at this value while it cycles the first.
_ONECYCLE_BETA2 = 0.99


def _warmup_fraction(it, warm, warmup_type):
    """Fraction of the warmup done at iteration ``it`` (0 <= it < warm)."""
    if warmup_type == "log":
        return math.log(it + 1) / math.log(warm)
    return it / warm


class Scheduler:
    """One of DeepSpeed's schedules. ``last_step`` counts the optimizer steps applied so far."""

    def __init__(self, kind, params, base_lrs):
        self.kind = kind
        self.params = dict(params)
        self.base_lrs = [float(x) for x in base_lrs]
        self.last_step = 0
        if kind in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
            # DeepSpeed clamps the warmup to at least 2 steps (log(1) would divide by zero).
            self.warmup_num_steps = max(2, int(self.params["warmup_num_steps"]))

    # ------------------------------------------------------------------ the schedule
    def lrs(self, step):
        """The lr of each param group for the optimizer step that follows ``step`` applied ones."""
        it = step - 1  # DeepSpeed's last_batch_iteration when that optimizer step runs
        p = self.params
        n = len(self.base_lrs)
        if self.kind in ("WarmupLR", "WarmupDecayLR"):
            lo = float(p["warmup_min_lr"])
            his = self.base_lrs if p["warmup_max_lr"] is _GROUP_LR else [float(p["warmup_max_lr"])] * n
            if it < 0:
                return [lo] * n
            warm = self.warmup_num_steps
            if it < warm:
                gamma = _warmup_fraction(it, warm, p["warmup_type"])
            elif self.kind == "WarmupLR":
                gamma = 1.0
            else:
                total = int(p["total_num_steps"])
                gamma = max(0.0, (total - it) / max(1.0, total - warm))
            return [lo + (hi - lo) * gamma for hi in his]
        if self.kind == "WarmupCosineLR":
            if it < 0:
                return [0.0] * n
            warm = self.warmup_num_steps
            if it < warm:
                lo = float(p["warmup_min_ratio"])
                ratio = lo + (1.0 - lo) * _warmup_fraction(it, warm, p["warmup_type"])
            else:
                done = it - warm + 1
                span = max(1, int(p["total_num_steps"]) - warm)
                progress = min(1.0, done / span)
                floor = float(p["cos_min_ratio"])
                ratio = max(0.0, floor + (1.0 - floor) * (1 + math.cos(math.pi * progress)) / 2)
            return [lr * ratio for lr in self.base_lrs]
        if self.kind == "OneCycle":
            lo, hi = float(p["cycle_min_lr"]), float(p["cycle_max_lr"])
            total = self._cycle_steps()
            if it < total:
                return [lo + (hi - lo) * self._cycle_scale(it + 1)] * n
            if self._skip_lr_decay():
                return [lo] * n
            interval = (it - total + 1) / p["decay_step_size"]
            return [lo / (1 + p["decay_lr_rate"] * interval)] * n
        if self.kind == "LRRangeTest":
            size = int(p["lr_range_test_step_size"])
            interval = (it + 1) / size
            if p["lr_range_test_staircase"]:
                interval = math.floor(interval)
            return [float(p["lr_range_test_min_lr"]) * (1 + p["lr_range_test_step_rate"] * interval)] * n
        raise AssertionError(self.kind)

    def get_last_lr(self):
        """Each group's lr for the next optimizer step (torch's name, which the Trainer reads)."""
        return self.lrs(self.last_step)

    def get_lr(self):
        return self.get_last_lr()

    def lr(self, step):
        return self.lrs(step)[0]

    def betas(self, step):
        """(beta1, beta2) for every group when the schedule cycles momentum (OneCycle), else None."""
        if self.kind != "OneCycle" or not self.params["cycle_momentum"]:
            return None
        p = self.params
        it = step - 1
        lo, hi = float(p["cycle_min_mom"]), float(p["cycle_max_mom"])
        if it < 0:
            mom = lo  # what DeepSpeed's constructor sets, before the first step
        elif it < self._cycle_steps():
            mom = hi - (hi - lo) * self._cycle_scale(it + 1)
        elif p["decay_step_size"] == 0 or p["decay_mom_rate"] == 0:
            mom = hi
        else:
            mom = hi * (1 + p["decay_mom_rate"] * (it - self._cycle_steps() + 1) / p["decay_step_size"])
        return [(mom, _ONECYCLE_BETA2)] * len(self.base_lrs)

    # ------------------------------------------------------------------ OneCycle helpers
    def _cycle_sizes(self):
        first = float(self.params["cycle_first_step_size"])
        second = self.params["cycle_second_step_size"]
        second = first if second is None else float(second)
        return first, second

    def _cycle_steps(self):
        first, second = self._cycle_sizes()
        return first + second

    def _skip_lr_decay(self):
        return self.params["decay_step_size"] == 0 or self.params["decay_lr_rate"] == 0

    def _cycle_scale(self, batch):
        """Where in the cycle ``batch`` (last_batch_iteration + 1) falls: 0 at the bottom, 1 at the top."""
        first, second = self._cycle_sizes()
        total = first + second
        ratio = first / total
        cycle = math.floor(1 + batch / total)
        x = 1.0 + batch / total - cycle
        first_stairs = int(self.params["cycle_first_stair_count"])
        second_stairs = self.params["cycle_second_stair_count"]
        second_stairs = first_stairs if second_stairs is None else int(second_stairs)
        if x <= ratio:
            scale, stairs = x / ratio, first_stairs
        else:
            scale, stairs = (x - 1) / (ratio - 1), second_stairs
        if stairs > 0:
            at = batch % total
            if at <= first:
                position = at * stairs / first
            else:
                position = (total - at) * stairs / second
            scale = math.floor(position) / stairs
        return scale

    # ------------------------------------------------------------------ state
    def state_dict(self):
        params = {k: v for k, v in self.params.items() if v is not _GROUP_LR}
        return {
            "kind": self.kind,
            "params": params,
            "last_step": self.last_step,
            "last_batch_iteration": self.last_step - 1,
        }

    def load_state_dict(self, state):
        self.last_step = int(state["last_step"])


def _fill_auto(kind, params, optimizer_lr, total_num_steps, warmup_num_steps):
    for key, value in list(params.items()):
        if value != "auto":
            continue
        if key == "warmup_min_lr":
            params[key] = 0.0
        elif key == "warmup_max_lr":
            params[key] = float(optimizer_lr)
        elif key == "warmup_num_steps":
            params[key] = max(1, int(warmup_num_steps)) if warmup_num_steps is not None else 1
        elif key == "total_num_steps":
            if total_num_steps is None:
                raise ValueError(
                    f"config key 'scheduler.params.total_num_steps' is \"auto\" ({kind} needs the length of the run): "
                    "pass tier.torch.initialize(..., total_num_steps=N) with the number of optimizer steps, "
                    "or write the number into the config"
                )
            params[key] = int(total_num_steps)
        else:
            raise ValueError(f"config key 'scheduler.params.{key}': \"auto\" is not allowed here; give a value")


def from_config(section, base_lrs, optimizer_lr=None, *, total_num_steps=None, warmup_num_steps=None):
    """A Scheduler for the config's ``scheduler`` section, or None when there is none.

    ``base_lrs``: each param group's lr (a number stands for one group); ``optimizer_lr``: what
    ``warmup_max_lr: "auto"`` becomes (default: the first group's lr)."""
    if not section or section.get("type") is None:
        return None
    if isinstance(base_lrs, (int, float)):
        base_lrs = [base_lrs]
    base_lrs = list(base_lrs)
    if optimizer_lr is None:
        optimizer_lr = base_lrs[0]
    kind = _TYPES.get(str(section["type"]).lower())
    if kind is None:
        raise ValueError(
            f"config key 'scheduler.type': {section['type']!r} is not supported by tier; "
            f"allowed: {', '.join(_DEFAULTS)} (or drop the scheduler section)"
        )
    params = dict(section.get("params") or {})
    params.pop("last_batch_iteration", None)  # -1 (the only value accepted): start from the beginning
    _fill_auto(kind, params, optimizer_lr, total_num_steps, warmup_num_steps)
    merged = dict(_DEFAULTS[kind])
    known = {k for defaults in _DEFAULTS.values() for k in defaults}
    for key, value in params.items():
        if key not in known:
            continue  # unknown to DeepSpeed too: the config check noted it as ignored (or refused it, strict)
        if key not in merged:
            raise ValueError(
                f"config key 'scheduler.params.{key}' does not apply to {kind}; "
                f"its parameters are: {', '.join(_DEFAULTS[kind])}"
            )
        merged[key] = value
    for key, value in merged.items():
        if value is None and key not in ("cycle_second_step_size", "cycle_second_stair_count"):
            raise ValueError(f"config key 'scheduler.params.{key}' is missing: {kind} needs it")
    if "warmup_type" in merged:
        merged["warmup_type"] = str(merged["warmup_type"]).lower()
        if merged["warmup_type"] not in ("log", "linear"):
            raise ValueError(
                f"config key 'scheduler.params.warmup_type': {merged['warmup_type']!r} is not allowed; "
                "allowed: one of: log, linear"
            )
    if "warmup_num_steps" in merged and int(merged["warmup_num_steps"]) < 0:
        raise ValueError("config key 'scheduler.params.warmup_num_steps' must be at least 0")
    return Scheduler(kind, merged, base_lrs)
