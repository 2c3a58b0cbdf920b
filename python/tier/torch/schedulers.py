"""Learning-rate schedules from DeepSpeed's ``scheduler`` config section.

Supported types: ``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR``, with DeepSpeed's
parameter names and defaults. ``"auto"`` values are resolved by the caller (or to the defaults).
"""

import math

_WARMUP_DEFAULTS = {
    "warmup_min_lr": 0.0,
    "warmup_max_lr": 0.001,
    "warmup_num_steps": 1000,
    "warmup_type": "log",
}


class Scheduler:
    """lr(step) for step = number of optimizer steps taken so far (0 before the first)."""

    def __init__(self, kind, params):
        self.kind = kind
        self.params = params
        self.last_step = 0

    def lr(self, step):
        p = self.params
        warm = max(1, int(p["warmup_num_steps"]))
        if self.kind == "WarmupCosineLR":
            total = int(p["total_num_steps"])
            if step < warm:
                ratio = p["warmup_min_ratio"] + (1 - p["warmup_min_ratio"]) * (step / warm)
            else:
                progress = min(1.0, (step - warm) / max(1, total - warm))
                cos = 0.5 * (1 + math.cos(math.pi * progress))
                ratio = p["cos_min_ratio"] + (1 - p["cos_min_ratio"]) * cos
            return p["base_lr"] * ratio
        lo, hi = p["warmup_min_lr"], p["warmup_max_lr"]
        if step < warm:
            if p["warmup_type"] == "log":
                gamma = math.log(step + 1) / math.log(warm)
            else:
                gamma = step / warm
            return lo + (hi - lo) * gamma
        if self.kind == "WarmupLR":
            return hi
        total = int(p["total_num_steps"])
        remaining = max(0.0, (total - step) / max(1, total - warm))
        return lo + (hi - lo) * remaining

    def state_dict(self):
        return {"kind": self.kind, "params": dict(self.params), "last_step": self.last_step}

    def load_state_dict(self, state):
        self.last_step = int(state["last_step"])


def from_config(section, base_lr):
    """A Scheduler for the config's ``scheduler`` section, or None when there is none."""
    if not section:
        return None
    kind = section.get("type")
    params = dict(section.get("params", {}))
    for k, v in list(params.items()):
        if v == "auto":
            del params[k]
    if kind in ("WarmupLR", "WarmupDecayLR"):
        merged = dict(_WARMUP_DEFAULTS)
        merged["warmup_max_lr"] = base_lr
        merged.update(params)
        if kind == "WarmupDecayLR" and "total_num_steps" not in merged:
            raise ValueError("config key 'scheduler.params.total_num_steps' is required for WarmupDecayLR")
        if merged["warmup_type"] not in ("log", "linear"):
            raise ValueError(
                f"config key 'scheduler.params.warmup_type': {merged['warmup_type']!r} is not allowed; "
                "allowed: 'log' or 'linear'"
            )
        return Scheduler(kind, merged)
    if kind == "WarmupCosineLR":
        merged = {"warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001, "base_lr": base_lr}
        merged.update(params)
        if "total_num_steps" not in merged:
            raise ValueError("config key 'scheduler.params.total_num_steps' is required for WarmupCosineLR")
        return Scheduler(kind, merged)
    raise ValueError(
        f"config key 'scheduler.type': {kind!r} is not supported by tier; "
        "allowed: WarmupLR, WarmupDecayLR, WarmupCosineLR (or drop the scheduler section)"
    )
