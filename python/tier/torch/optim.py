"""tier.torch.OffloadedAdamW: an AdamW for any PyTorch training loop whose fp32 master weights
and moments live in tier (host memory or NVMe) and are updated there by tier's CPU Adam.

The model, its parameters and their gradients stay where the training loop keeps them (on the GPU
or the CPU); only the optimizer's state moves out, which is 12 of the 16 bytes per parameter of
mixed-precision Adam training. It is a real ``torch.optim.Optimizer``: ``param_groups`` carry
each group's hyper-parameters (LR schedulers write ``lr`` there and the next step uses it),
gradients are read from ``p.grad`` after the loop has accumulated, clipped or unscaled them
(``torch.nn.utils.clip_grad_norm_``, ``GradScaler.unscale_``), a parameter whose ``grad`` is None
is skipped as ``torch.optim.AdamW`` skips it, and ``state_dict()`` / ``load_state_dict()`` use
``torch.optim.AdamW``'s format, so Trainer checkpoints and plain AdamW state dicts go both ways.

The step itself is tier's step driver (``_tier.StepDriver``, include/tier/step_driver.hpp), the one
tier.jax and the C ABI train with: it checks each gradient against its parameter, takes them in
place (borrowed, no copy), runs the update (serial, or overlapped with backward), and writes the
updated parameters into the model's memory. What stays here is what is specific to torch: the
hooks that hand gradients over as backward finishes them, the check that the loop did not change
them after that, and torch's state-dict format.
"""

import json
import os
import threading
import weakref

import torch

from .. import _tier
from .._config_input import read_config as _read_config
from . import footprint as _footprint

_OUTPUT_OF = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _flat_fp32(t):
    """A tensor's values as a flat, contiguous fp32 CPU tensor: what the native optimizer reads."""
    return t.detach().to("cpu", torch.float32).contiguous().reshape(-1)


def _host(t):
    """A tensor (a parameter or its gradient) as a contiguous CPU tensor of its shape and dtype,
    the tensor itself when it is one already: what the step driver reads in place."""
    return t.detach().to("cpu").contiguous()


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with its state offloaded to tier.

    ``config`` is a tier / DeepSpeed-format config (a dict or a JSON path); what it says under
    ``zero_optimization.offload_optimizer`` decides where the state lives (``"device": "nvme"``
    with ``nvme_path``, or ``"cpu"``), and its ``tier``/``aio`` sections tune the pipeline.
    ``nvme_path`` is a shortcut for ``{"offload_optimizer": {"device": "nvme", "nvme_path": ...}}``.
    Without either, the state is kept in host memory. ``amsgrad`` and ``maximize`` are not
    supported and are refused. The per-parameter ``step`` of ``torch.optim.AdamW`` is a per-group
    counter here: a parameter that missed a step's gradient keeps its values and moments, but its
    next bias correction uses the group's count.

    ``overlap`` (or the config's ``tier.optimizer.overlap``): ``"exact"`` runs the step's update
    during the backward that finishes the step's gradients, ``"serial"`` runs it in ``step()``.
    Default: ``"exact"`` when the state is on NVMe and a parameter is on a GPU (its gradient is
    copied to host memory during backward instead of in ``step()``), ``"serial"`` otherwise. The
    exact mode learns how many backward passes make a step (gradient accumulation) from the steps
    so far; at the last one each gradient is copied as backward finishes it and the update of
    its chunks starts at once, writing into staging. ``step()`` then checks that every gradient
    is bit for bit the one the update took: if the loop clipped (a coefficient below 1), unscaled
    or edited the gradients after backward, or changed a hyper-parameter or a parameter, the
    speculative update is dropped and the step runs serially, so the result is always the serial
    step's. It costs host memory for one copy of the gradients and one of the parameters. See
    ``overlap_stats``.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        *,
        amsgrad=False,
        maximize=False,
        config=None,
        nvme_path=None,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
        overlap=None,
    ):
        if amsgrad:
            raise ValueError("OffloadedAdamW: amsgrad=True is not supported (tier's CPU Adam keeps no max of v)")
        if maximize:
            raise ValueError("OffloadedAdamW: maximize=True is not supported; negate the loss instead")
        if capturable or differentiable:
            raise ValueError("OffloadedAdamW: capturable and differentiable are not supported (the update runs on the CPU)")
        del foreach, fused  # accepted for signature compatibility; the CPU kernel is always fused
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False)
        super().__init__(params, defaults)

        cfg = _read_config(config)
        zero = cfg.setdefault("zero_optimization", {})
        off = zero.setdefault("offload_optimizer", {})
        if nvme_path is not None:
            off["device"] = "nvme"
            off["nvme_path"] = os.fspath(nvme_path)
        off.setdefault("device", "cpu")
        # The training loop sums micro-steps into p.grad and clips it: the native optimizer takes
        # one finished gradient per parameter and step.
        cfg["gradient_accumulation_steps"] = 1
        cfg.pop("train_batch_size", None)
        cfg.pop("gradient_clipping", None)
        for key in ("fp16", "bf16"):
            cfg.pop(key, None)  # loss scaling belongs to the loop (torch.amp.GradScaler)
        g0 = self.param_groups[0]
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": g0["lr"],
                "betas": list(g0["betas"]),
                "eps": g0["eps"],
                "weight_decay": g0["weight_decay"],
            },
        }
        self._home = off["device"]

        self._params = [p for g in self.param_groups for p in g["params"]]
        for p in self._params:
            if p.dtype not in _OUTPUT_OF:
                raise TypeError(f"OffloadedAdamW: parameters must be fp32, fp16 or bf16, not {p.dtype}")
            if p.is_sparse:
                raise TypeError("OffloadedAdamW: sparse parameters are not supported")
        total = sum(p.numel() for p in self._params)
        if total == 0:
            raise ValueError("OffloadedAdamW got no parameters with elements")
        native_config = _tier.Config.from_json(json.dumps(cfg))
        self._native = _tier.StepDriver(native_config, total, len(self._params))
        # Its swap files grow with the state: a disk that cannot hold it is refused now.
        _footprint.check_nvme_room(
            native_config.swap_paths, {"optimizer state": self._native.stats()["nvme_capacity_bytes"]}
        )
        for gi, g in enumerate(self.param_groups):
            if gi > 0:
                self._native.add_group(
                    lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"], weight_decay=g["weight_decay"]
                )
        self._pid = {}
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                # (The names are those of the checkpoints written before the step driver.)
                self._pid[p] = self._native.add_param(f"param{len(self._pid)}", _host(p), gi)
        # Updated params land here (a serial step writes contiguous CPU params in place; the
        # exact overlap stages every parameter, since backward still reads them), and each
        # parameter's version after the write: a parameter changed since (model.load_state_dict,
        # an in-place edit) is re-read into the master before the next step.
        self._staging = {}
        self._seen = {}
        self.last_report = None
        for p in self._params:
            self._note_version(p)
        self._setup_overlap(overlap if overlap is not None else cfg.get("tier", {}).get("optimizer", {}).get("overlap"))

    # ------------------------------------------------------------------ helpers
    def _note_version(self, p):
        self._seen[p] = (p.data_ptr(), p._version)

    def _resync_changed(self):
        changed = False
        for p in self._params:
            if self._seen.get(p) != (p.data_ptr(), p._version):
                master = _flat_fp32(p)
                self._native.write_state(self._pid[p], "master", master)
                self._note_version(p)
                changed = True
        return changed

    def _hyper_params(self):
        return [(float(g["lr"]), *map(float, g["betas"]), float(g["eps"]), float(g["weight_decay"])) for g in self.param_groups]

    # ------------------------------------------------------------------ the overlapped step
    def _setup_overlap(self, overlap):
        if overlap is None:
            on_gpu = any(p.device.type != "cpu" for p in self._params)
            overlap = "exact" if self._home == "nvme" and on_gpu else "serial"
        if overlap not in ("serial", "exact", "delayed"):
            raise ValueError(f"OffloadedAdamW: overlap must be 'serial' or 'exact', not {overlap!r}")
        if overlap == "delayed":
            raise ValueError(
                "OffloadedAdamW: overlap 'delayed' is not supported: a torch optimizer's step() must leave the "
                "updated parameters in place; use tier.torch.initialize for the delayed update"
            )
        # The host home updates the state in place: a speculative update could not be undone.
        self.overlap = "exact" if overlap == "exact" and self._home == "nvme" else "serial"
        self.overlap_stats = {
            "steps": 0,
            "overlapped": 0,
            "committed": 0,
            "redone": 0,
            "backed_off": 0,
            "last_redo_reason": "",
        }
        self._hooks = []
        if self.overlap != "exact":
            return
        self._lock = threading.Lock()
        self._counts = {}  # parameter -> gradients accumulated into it since the last step
        self._micro = None  # backward passes per step, learned from the last step
        self._spec = None  # the running overlapped step: parameter -> the gradient copy it took
        self._spec_hp = None
        self._spec_off = False  # given up for this step
        self._started = False  # an overlapped update was started for this step
        # After a speculation that failed, the next `backoff` steps run serially (1, 2, 4, ... up
        # to overlap_max_backoff; a kept one resets it): a loop that clips every step pays for a
        # wasted pass only now and then.
        self.overlap_max_backoff = 64
        self._backoff = 1
        self._skip_left = 0
        self._skip_this = False
        self._snap = {}  # parameter -> host buffer for its gradient copy (kept across steps)
        ref = weakref.ref(self)

        def hook(p, ref=ref):
            opt = ref()
            if opt is not None:
                opt._grad_ready(p)

        for p in self._params:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _grad_ready(self, p):
        """A backward pass has accumulated p's gradient (the post-accumulate-grad hook)."""
        with self._lock:
            n = self._counts.get(p, 0) + 1
            self._counts[p] = n
            if self._spec is not None:
                if p in self._spec:
                    self._abandon("a gradient was accumulated again after the update had taken it")
                elif n == self._micro:
                    try:
                        self._take(p)
                    except Exception as e:  # never fail the user's backward: the step runs serially
                        self._abandon(f"a gradient could not be handed over: {e}")
                return
            if self._spec_off or self._skip_this or self._micro is None or n != self._micro:
                return
            try:
                self._start_spec()
                self._take(p)
            except Exception as e:  # never fail the user's backward: the step runs serially
                self._abandon(f"the overlapped update could not start: {e}")

    def _buffer(self, table, p, dtype):
        buf = table.get(p)
        if buf is None or buf.dtype != dtype:
            buf = torch.empty(p.shape, dtype=dtype, pin_memory=torch.cuda.is_available() and p.device.type == "cuda")
            table[p] = buf
        return buf

    def _start_spec(self):
        self._resync_changed()
        self._push_hyper_params()
        self._spec_hp = self._hyper_params()
        dests = [None] * len(self._params)
        for p in self._params:
            if p.requires_grad:
                dests[self._pid[p]] = self._buffer(self._staging, p, p.dtype)
        self._native.start_overlap(outputs=dests, skip_missing=True)
        self._spec = {}
        self._started = True
        self.overlap_stats["overlapped"] += 1

    def _take(self, p):
        g = p.grad
        if g is None or g.is_sparse or g.dtype not in _OUTPUT_OF or g.shape != p.shape:
            return  # step() takes it, or says what is wrong with it
        snap = self._buffer(self._snap, p, g.dtype)
        snap.copy_(g.detach())
        self._native.add_grad(self._pid[p], snap, borrow=True)
        self._spec[p] = snap

    def _abandon(self, reason):
        """Drops the running overlapped step (nothing was committed); step() runs serially."""
        if self._spec is not None:
            self._native.cancel_overlap()
            self._native.clear_grads()
            self._spec = None
        self._spec_off = True
        self.overlap_stats["last_redo_reason"] = reason

    def _quiesce(self):
        """Drops an overlapped step in flight (before reading or replacing the state)."""
        if self.overlap == "exact":
            with self._lock:
                if self._spec is not None:
                    self._abandon("the state was read or replaced between backward and step()")

    def _finish_spec(self):
        """step() of an overlapped step: its report, or None when the step must run serially."""
        spec = self._spec
        reason = None
        if self._hyper_params() != self._spec_hp:
            reason = "a hyper-parameter changed after backward"
        elif any(self._seen.get(p) != (p.data_ptr(), p._version) for p in self._params):
            reason = "a parameter changed after backward"
        for p in self._params:
            if reason is not None:
                break
            g = p.grad
            snap = spec.get(p)
            if snap is None:
                if g is None:
                    continue
                if g.is_sparse:
                    reason = "a sparse gradient"
                    break
                self._native.add_grad(self._pid[p], _host(g), borrow=True)  # one backward did not announce
            elif g is None or g.is_sparse or g.dtype != snap.dtype:
                reason = "a gradient was dropped or replaced after backward"
            else:
                ints = {2: torch.int16, 4: torch.int32}[snap.element_size()]
                if not torch.equal(_host(g).view(ints), snap.view(ints)):
                    reason = "the gradients changed after backward (clipped, unscaled or edited)"
        if reason is not None:
            self._abandon(reason)
            return None
        self._spec = None
        try:
            report = self._native.finish_overlap()
        except BaseException:
            self._native.clear_grads()
            raise
        if report.get("redone"):
            self.overlap_stats["redone"] += 1
            self.overlap_stats["last_redo_reason"] = report.get("redo_reason", "")
        else:
            self.overlap_stats["committed"] += 1
        for p in self._params:
            if p.grad is not None:
                p.data.copy_(self._staging[p].view_as(p))
                self._note_version(p)
        return report

    def _destination(self, p):
        if p.device.type == "cpu" and p.is_contiguous():
            return p.data
        return self._buffer(self._staging, p, p.dtype)

    def _push_hyper_params(self):
        for gi, g in enumerate(self.param_groups):
            b1, b2 = g["betas"]
            self._native.set_group(gi, float(g["lr"]), float(b1), float(b2), float(g["eps"]), float(g["weight_decay"]))

    # ------------------------------------------------------------------ torch.optim.Optimizer
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.overlap_stats["steps"] += 1
        if self.overlap == "exact":
            with self._lock:
                try:
                    report = self._finish_spec() if self._spec is not None else None
                except BaseException:
                    self._abandon("step() failed")
                    raise
                failed = (report is None and self._started) or (report is not None and report.get("redone"))
                if report is None and self._started:
                    self.overlap_stats["redone"] += 1  # given up during backward or at step()
                if self._skip_this:
                    self.overlap_stats["backed_off"] += 1
                if failed and self.overlap_max_backoff > 0:
                    self._skip_left = min(self._backoff, self.overlap_max_backoff)
                    self._backoff = min(2 * self._backoff, self.overlap_max_backoff)
                elif report is not None:
                    self._backoff = 1
                self._skip_this = self._skip_left > 0
                self._skip_left -= 1 if self._skip_this else 0
                counts = [n for n in self._counts.values() if n > 0]
                self._micro = max(counts) if counts else None
                self._counts.clear()
                self._spec_off = False
                self._started = False
            if report is not None:
                self.last_report = report
                return loss
        self._resync_changed()
        self._push_hyper_params()
        dests = [None] * len(self._params)
        for p in self._params:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("OffloadedAdamW does not support sparse gradients")
            pid = self._pid[p]
            # Borrowed (read in place by the update; the driver holds the CPU tensor until then).
            self._native.add_grad(pid, _host(p.grad), borrow=True)
            dests[pid] = self._destination(p)
        if all(d is None for d in dests):
            return loss
        try:
            self.last_report = self._native.step(outputs=dests, skip_missing=True)
        except BaseException:
            self._native.clear_grads()
            raise
        for p in self._params:
            if p.grad is None:
                continue
            buf = self._staging.get(p)
            if buf is not None and (p.device.type != "cpu" or not p.is_contiguous()):
                p.data.copy_(buf.view_as(p))
            self._note_version(p)
        return loss

    def zero_grad(self, set_to_none=True):
        if self.overlap == "exact":
            with self._lock:
                if self._spec is not None:  # backward without a step (e.g. a skipped fp16 step)
                    self._abandon("zero_grad() before step()")
                self._counts.clear()
                self._spec_off = False
                self._started = False
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ state dicts
    def _index(self):
        return {p: i for i, p in enumerate(self._params)}

    def state_dict(self):
        """``torch.optim.AdamW``'s format: per parameter ``step``, ``exp_avg`` and
        ``exp_avg_sq`` (fp32, the parameter's shape), plus ``master`` (the fp32 master weights)
        for fp16/bf16 parameters. It gathers the whole state in host memory, as torch's does; for
        a streamed checkpoint use ``save_checkpoint``."""
        self._quiesce()
        state = {}
        groups = []
        index = 0
        for gi, g in enumerate(self.param_groups):
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = list(range(index, index + len(g["params"])))
            groups.append(entry)
            step = self._native.group_step(gi)
            for p in g["params"]:
                if step > 0:
                    pid = self._pid[p]
                    s = {"step": torch.tensor(float(step))}
                    for kind in ("exp_avg", "exp_avg_sq") + (("master",) if p.dtype != torch.float32 else ()):
                        out = torch.empty(p.numel(), dtype=torch.float32)
                        self._native.read_state(pid, kind, out)
                        s[kind] = out.view(p.shape)
                    state[index] = s
                index += 1
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        self._quiesce()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(groups)} parameter groups but the optimizer has {len(self.param_groups)}"
            )
        for mine, theirs in zip(self.param_groups, groups):
            if len(mine["params"]) != len(theirs["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size of optimizer's group: "
                    f"{len(theirs['params'])} vs {len(mine['params'])}"
                )
        saved = state_dict["state"]
        # Check everything before writing anything: a bad dict leaves the state as it was.
        plan = []
        for gi, (mine, theirs) in enumerate(zip(self.param_groups, groups)):
            steps = set()
            for p, key in zip(mine["params"], theirs["params"]):
                s = saved.get(key)
                if s is None:
                    continue
                for kind in ("exp_avg", "exp_avg_sq", "master"):
                    if kind in s and s[kind].numel() != p.numel():
                        raise ValueError(
                            f"state of parameter {key}: {kind} has {s[kind].numel()} elements, the parameter {p.numel()}"
                        )
                if "exp_avg" not in s or "exp_avg_sq" not in s:
                    raise ValueError(f"state of parameter {key} lacks exp_avg or exp_avg_sq (not an Adam state dict)")
                steps.add(int(float(s.get("step", 0))))
                plan.append((p, s))
            if len(steps) > 1:
                raise ValueError(
                    f"parameter group {gi}: the loaded state has different step counts {sorted(steps)}; OffloadedAdamW "
                    "keeps one step count per group"
                )
            plan.append((gi, steps.pop() if steps else 0))
        for item in plan:
            if isinstance(item[0], int):
                self._native.set_group_step(item[0], item[1])
                continue
            p, s = item
            pid = self._pid[p]
            for kind in ("exp_avg", "exp_avg_sq"):
                self._native.write_state(pid, kind, _flat_fp32(s[kind]))
            master = s.get("master")
            if master is None:
                master = p.detach()  # torch's AdamW keeps no separate master: the parameter is it
            self._native.write_state(pid, "master", _flat_fp32(master))
            self._note_version(p)
        for mine, theirs in zip(self.param_groups, groups):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = tuple(v) if k == "betas" else v
        self._push_hyper_params()

    # ------------------------------------------------------------------ tier extras
    def save_checkpoint(self, path):
        """Streams the whole native state (masters, moments, step counters, hyper-parameters) to
        one checksummed file without gathering it in host memory."""
        self._quiesce()
        self._native.save(os.fspath(path))

    def load_checkpoint(self, path):
        self._quiesce()
        self._native.load(os.fspath(path))
        for gi, g in enumerate(self.param_groups):
            g["lr"] = self._native.hyper_params(gi)["lr"]
        for p in self._params:
            out = torch.empty(p.shape, dtype=p.dtype)
            self._native.read_param(self._pid[p], out)
            p.data.copy_(out)
            self._note_version(p)

    def stats(self):
        """The native optimizer's figures (where the state lives, chunks, bytes), with ``overlap``
        (the mode in effect) and ``overlap_steps`` (``overlap_stats``)."""
        self._quiesce()
        d = dict(self._native.stats())
        d["overlap"] = self.overlap
        d["overlap_steps"] = dict(self.overlap_stats)
        return d

    @property
    def home(self):
        """Where the state lives: ``"nvme"`` or ``"cpu"`` (host memory)."""
        return self._home

    def close(self):
        """Frees the native optimizer (its files and buffers) now rather than at garbage collection."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._native.close()
