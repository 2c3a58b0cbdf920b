"""tier.jax.OffloadedAdamW: AdamW for a pytree of JAX arrays, its state offloaded to tier.

The parameters stay JAX arrays where the loop keeps them; their fp32 masters and the two Adam
moments (12 bytes per parameter) live in tier's step driver (tier._tier.StepDriver,
include/tier/step_driver.hpp), on NVMe or in host memory, and tier's CPU Adam updates them. A
step hands the gradients over by DLPack (read in place for CPU arrays), runs one native step
that writes each updated parameter straight into a fresh host buffer, and returns those buffers
as the new parameters. Every input is checked before anything is handed to the driver, so a bad
step changes nothing.

Not thread safe: one thread at a time, as the driver.
"""

import json
import math
import os

import jax
import numpy as np

from .. import _tier
from .._config_input import read_config as _read_config
from . import _arrays


def _checked_lr(lr, context, consequence=""):
    try:
        value = float(lr)
    except (TypeError, ValueError):
        raise _arrays.invalid(f"{context}: lr must be a number, not {type(lr).__name__}{consequence}") from None
    if not math.isfinite(value) or value < 0:
        raise _arrays.invalid(f"{context}: lr {value} is not a finite number >= 0{consequence}")
    return value


def _decay_flags(mask, params, treedef, count):
    """One bool per leaf: whether weight decay applies (optax.adamw's ``mask``)."""
    if mask is None:
        return [True] * count
    tree = mask(params) if callable(mask) else mask
    try:
        full = jax.tree_util.tree_map(lambda flag, sub: jax.tree_util.tree_map(lambda _: bool(flag), sub), tree, params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"OffloadedAdamW: mask must have the params' structure (or a prefix of it): {e}") from None
    flags, full_def = jax.tree_util.tree_flatten(full)
    if full_def != treedef or len(flags) != count:
        raise ValueError("OffloadedAdamW: mask must have the params' structure (or a prefix of it)")
    return flags


class OffloadedAdamW:
    """AdamW (decoupled weight decay, bias correction: optax.adamw's and torch.optim.AdamW's
    update) over a pytree of JAX arrays, with its fp32 masters and moments in tier.

    ``params``: a pytree of float32, bfloat16 or float16 arrays (other leaves are refused: keep
    them out of the tree handed to the optimizer). A bfloat16/float16 parameter keeps an fp32
    master in tier and gets its updated values back in its own dtype.

    ``lr``: a number, or a schedule (a callable from the number of steps taken so far to the lr,
    as optax's schedules). ``nvme_path``: keep the state on NVMe there; None: in host memory.
    ``mask``: as optax.adamw's, a pytree of bools (or a prefix of one, or a callable from the
    params to one) saying which leaves weight decay applies to. ``max_grad_norm``: clip the
    gradients by their global norm first (tier's ``gradient_clipping``). ``config``: a
    tier/DeepSpeed config (dict or JSON path) for the rest (``tier.optimizer`` tuning, ``aio``,
    ``fp16`` dynamic loss scaling, ``zero_optimization.offload_optimizer``); ``nvme_path`` and
    the arguments above override what it says.

    Params and optimizer state are one thing in tier: the masters are the truth, and each step
    returns the parameters made from them. A leaf handed to ``step`` that is not the array the
    optimizer last returned for it (or was built with) was changed outside the optimizer; its
    values are written into the master first, as optax would start from them.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.01,
        nvme_path=None,
        *,
        mask=None,
        max_grad_norm=None,
        config=None,
    ):
        context = "OffloadedAdamW"
        self._schedule = lr if callable(lr) else None
        first_lr = _checked_lr(self._schedule(0) if self._schedule else lr, context)
        beta1, beta2 = (float(b) for b in betas)
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"{context}: betas must be in [0, 1), got {tuple(betas)}")
        eps, weight_decay = float(eps), float(weight_decay)
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"{context}: eps must be a finite number >= 0, got {eps}")
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"{context}: weight_decay must be a finite number >= 0, got {weight_decay}")
        self._lr = first_lr

        names, leaves, treedef = _arrays.flatten(params)
        if not leaves:
            raise ValueError(f"{context}: params has no array leaves")
        self._names, self._treedef = names, treedef
        self._shapes, self._dtypes = [], []
        for name, leaf in zip(names, leaves):
            shape, dtype = _arrays.shape_dtype(leaf, f"params{name}", context)
            if dtype not in _arrays.PARAM_DTYPES:
                raise TypeError(
                    f"{context}: params{name} is {dtype}; parameters must be float32, bfloat16 or float16 "
                    "(keep integer and other leaves out of the tree handed to the optimizer)"
                )
            self._shapes.append(shape)
            self._dtypes.append(dtype)
        decay = _decay_flags(mask, params, treedef, len(leaves))
        numels = [int(np.prod(s, dtype=np.int64)) for s in self._shapes]
        total = sum(numels)
        if total == 0:
            raise ValueError(f"{context}: params has no elements")

        cfg = _read_config(config)
        off = cfg.setdefault("zero_optimization", {}).setdefault("offload_optimizer", {})
        if nvme_path is not None:
            off["device"] = "nvme"
            off["nvme_path"] = os.fspath(nvme_path)
        off.setdefault("device", "cpu")
        # One gradient per parameter and step: the loop sums micro-batches itself.
        cfg["gradient_accumulation_steps"] = 1
        cfg.pop("train_batch_size", None)
        if max_grad_norm is not None:
            cfg["gradient_clipping"] = float(max_grad_norm)
        decayed = any(d for d, n in zip(decay, numels) if n)
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": first_lr,
                "betas": [beta1, beta2],
                "eps": eps,
                "weight_decay": weight_decay if decayed else 0.0,
            },
        }
        self._home = off["device"]

        native_config = _tier.Config.from_json(json.dumps(cfg))
        self._driver = _tier.StepDriver(native_config, total, sum(1 for n in numels if n))
        no_decay_group = 0
        if decayed and not all(d for d, n in zip(decay, numels) if n):
            no_decay_group = self._driver.add_group(first_lr, beta1, beta2, eps, 0.0)
        self._groups = sorted({0, no_decay_group})
        # Driver index per leaf; None for a leaf without elements (returned as it is).
        self._index = []
        for name, leaf, n, d in zip(names, leaves, numels, decay):
            if n == 0:
                self._index.append(None)
                continue
            group = 0 if (d or not decayed) else no_decay_group
            self._index.append(self._driver.add_param(name or "<root>", _arrays.host_input(leaf), group))
        self._known = list(leaves)  # the arrays the masters stand for (see the class docstring)
        self.last_report = None

    # ------------------------------------------------------------------ properties
    @property
    def lr(self):
        """The learning rate the next step uses (a schedule's value at the current step)."""
        return self._schedule(self.step_count) if self._schedule else self._lr

    @lr.setter
    def lr(self, value):
        """A number (for this step and after) or a schedule (a callable of the step count)."""
        if callable(value):
            _checked_lr(value(self.step_count), "OffloadedAdamW.lr")
            self._schedule = value
        else:
            self._lr = _checked_lr(value, "OffloadedAdamW.lr")
            self._schedule = None

    @property
    def step_count(self):
        """Steps applied so far (the bias correction's count)."""
        return self._driver.group_step(0)

    @property
    def home(self):
        """Where the state lives: ``"nvme"`` or ``"cpu"`` (host memory)."""
        return self._home

    @property
    def param_names(self):
        """The leaves' names (``jax.tree_util.keystr`` of their paths), in flattening order."""
        return list(self._names)

    @property
    def loss_scale(self):
        """The factor to multiply the loss by: 1 unless the config enables fp16 loss scaling."""
        return self._driver.loss_scale

    # ------------------------------------------------------------------ the step
    def step(self, params, grads, lr=None):
        """One AdamW step: returns the updated params (a pytree of the params' structure, each
        leaf of its param's shape and dtype, placed where the param was). ``grads`` must have
        the params' structure, each leaf the shape of its param and a float32, bfloat16 or
        float16 dtype. ``lr``: the learning rate for this step and after (as setting ``lr``).
        Any bad input raises before anything changes; when the step is skipped (an fp16
        overflow, see ``last_report``) ``params`` comes back as it was."""
        context = "OffloadedAdamW.step"
        if lr is not None and callable(lr):
            raise _arrays.invalid(f"{context}: lr must be a number here; assign a schedule to opt.lr")
        step_lr = _checked_lr(lr if lr is not None else self.lr, context, "; nothing was applied")
        p_leaves = _arrays.flatten_like(params, "params", self._names, self._treedef, context)
        g_leaves = _arrays.flatten_like(grads, "grads", self._names, self._treedef, context)
        inputs = []
        for i, (name, p, g) in enumerate(zip(self._names, p_leaves, g_leaves)):
            p_shape, p_dtype = _arrays.shape_dtype(p, f"params{name}", context)
            if p_shape != self._shapes[i] or p_dtype != self._dtypes[i]:
                raise _arrays.invalid(
                    f"{context}: params{name} is {p_dtype}{list(p_shape)}; the optimizer was built with "
                    f"{self._dtypes[i]}{list(self._shapes[i])}; nothing was applied"
                )
            g_shape, g_dtype = _arrays.shape_dtype(g, f"grads{name}", context)
            if g_shape != self._shapes[i]:
                raise _arrays.invalid(
                    f"{context}: grads{name} has shape {g_shape}; its param's is {self._shapes[i]}; nothing was applied"
                )
            if g_dtype not in _arrays.PARAM_DTYPES:
                raise TypeError(
                    f"{context}: grads{name} is {g_dtype}; gradients must be float32, bfloat16 or float16; "
                    "nothing was applied"
                )
            if self._index[i] is not None:
                inputs.append((self._index[i], _arrays.host_input(g)))
        # Parameters changed outside the optimizer become the masters (see the class docstring).
        for i, p in enumerate(p_leaves):
            if p is not self._known[i]:
                if self._index[i] is not None:
                    self._driver.write_state(self._index[i], "master", _arrays.fp32_flat(p))
                self._known[i] = p
        buffers = [
            None if idx is None else _arrays.output_buffer(shape, dtype)
            for idx, shape, dtype in zip(self._index, self._shapes, self._dtypes)
        ]
        outputs = [None] * self._driver.param_count
        for idx, buf in zip(self._index, buffers):
            if idx is not None:
                outputs[idx] = _arrays.driver_view(buf)
        try:
            for idx, g in inputs:
                self._driver.add_grad(idx, g)
            report = self._driver.step(lr=step_lr, outputs=outputs)
        except BaseException:
            self._driver.clear_grads()
            raise
        finally:
            del inputs
        if lr is not None:
            self._lr, self._schedule = step_lr, None
        self.last_report = report
        if not report["applied"]:
            return params
        new = [p if buf is None else _arrays.to_jax(buf, p) for p, buf in zip(p_leaves, buffers)]
        self._known = new
        return self._treedef.unflatten(new)

    # ------------------------------------------------------------------ reading the state
    def params(self):
        """The current params, made from the masters (each in its param's dtype and placement):
        what to train on after ``load_state_dict`` or ``load``."""
        new = []
        for i, known in enumerate(self._known):
            idx = self._index[i]
            if idx is None:
                new.append(known)
                continue
            buf = _arrays.output_buffer(self._shapes[i], self._dtypes[i])
            self._driver.read_param(idx, _arrays.driver_view(buf))
            new.append(_arrays.to_jax(buf, known))
        self._known = new
        return self._treedef.unflatten(new)

    def _state_tree(self, kind):
        leaves = []
        for idx, shape in zip(self._index, self._shapes):
            out = np.zeros(shape, np.float32)
            if idx is not None:
                self._driver.read_state(idx, kind, out)
            leaves.append(out)
        return self._treedef.unflatten(leaves)

    def state_dict(self):
        """``{"step", "master", "exp_avg", "exp_avg_sq"}``: the step count and three pytrees of
        the params' structure holding float32 numpy arrays of the params' shapes (``exp_avg`` /
        ``exp_avg_sq`` are optax's ``mu`` / ``nu``). It gathers the whole state in host memory;
        ``save(path)`` streams it to a file instead. The hyper-parameters are not in it: as with
        optax they belong to the optimizer, and a schedule resumes from ``step``."""
        return {
            "step": int(self.step_count),
            "master": self._state_tree("master"),
            "exp_avg": self._state_tree("exp_avg"),
            "exp_avg_sq": self._state_tree("exp_avg_sq"),
        }

    def load_state_dict(self, state_dict):
        """Loads what ``state_dict()`` returned (``master`` may be left out: the masters then stay
        as they are). The whole dict is checked before any of it is written. Take the params to
        train on from ``params()`` afterwards (the next step starts from the loaded masters)."""
        context = "OffloadedAdamW.load_state_dict"
        if not isinstance(state_dict, dict):
            raise TypeError(f"{context}: expected a dict, not {type(state_dict).__name__}")
        unknown = set(state_dict) - {"step", "master", "exp_avg", "exp_avg_sq"}
        if unknown:
            raise _arrays.invalid(f"{context}: unknown keys {sorted(unknown)}")
        for key in ("step", "exp_avg", "exp_avg_sq"):
            if key not in state_dict:
                raise _arrays.invalid(f"{context}: the state dict lacks '{key}'")
        try:
            step = int(state_dict["step"])
        except (TypeError, ValueError):
            raise _arrays.invalid(f"{context}: step must be an integer, not {state_dict['step']!r}") from None
        if step < 0 or step != float(state_dict["step"]):
            raise _arrays.invalid(f"{context}: step must be an integer >= 0, not {state_dict['step']!r}")
        writes = []
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            if kind not in state_dict:
                continue
            leaves = _arrays.flatten_like(state_dict[kind], kind, self._names, self._treedef, context)
            for i, (name, leaf) in enumerate(zip(self._names, leaves)):
                shape, dtype = _arrays.shape_dtype(leaf, f"{kind}{name}", context)
                if shape != self._shapes[i]:
                    raise _arrays.invalid(f"{context}: {kind}{name} has shape {shape}; its param's is {self._shapes[i]}")
                if dtype.kind != "f" and dtype not in _arrays.PARAM_DTYPES:
                    raise TypeError(f"{context}: {kind}{name} is {dtype}, not a float array")
                if self._index[i] is not None:
                    writes.append((self._index[i], kind, _arrays.fp32_flat(leaf)))
        for idx, kind, values in writes:
            self._driver.write_state(idx, kind, values)
        for group in self._groups:
            self._driver.set_group_step(group, step)

    # ------------------------------------------------------------------ checkpoints and stats
    def save(self, path):
        """Streams the whole state (masters, moments, step counts) to one checksummed file
        without gathering it in host memory (the driver's checkpoint, docs/optimizer.md)."""
        self._driver.save(os.fspath(path))

    def load(self, path):
        """Loads a ``save`` file of an optimizer over the same params (names, shapes, groups);
        the masters and moments are the file's from then on: take the params from ``params()``.
        The learning rate stays this optimizer's (``lr``), as with ``load_state_dict``."""
        self._driver.load(os.fspath(path))

    def stats(self):
        """The driver's figures: where the state lives, bytes per tier, steps applied/skipped."""
        return self._driver.stats()

    def close(self):
        """Frees the driver (its buffers and swap files) now rather than at garbage collection."""
        self._driver.close()
