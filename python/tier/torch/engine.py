"""TierEngine: a PyTorch model and optimizer whose state lives in tier's tiers.

Parameters live in their home tier (``zero_optimization.offload_param.device``: nvme, cpu or none)
and are brought to the compute device by forward/backward hooks through the engine, ZeRO-3 style,
with the engine's prefetch scheduler replaying the order it recorded in the first micro-step.
Gradients leave the device as soon as they are final (post-accumulate-grad hooks) into the
offloaded optimizer, which keeps fp32 master params and Adam moments on NVMe or in host memory
(``offload_optimizer.device``) and writes the updated low-precision params back into the engine.

The training loop is DeepSpeed's::

    engine = tier.torch.initialize(model, config)
    for batch in data:
        loss = engine(**batch).loss
        engine.backward(loss)   # scales by 1 / gradient_accumulation_steps (and the fp16 loss scale)
        engine.step()           # applies the update at the accumulation boundary
"""

import collections
import json
import os
import time
import weakref

import torch

from .. import _tier
from . import linear as _linear
from . import schedulers as _schedulers

_TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HOME = {"nvme": "nvme", "cpu": "host", "none": "device"}


class _Slot:
    """One unique parameter: where it lives in the engine and in the optimizer."""

    __slots__ = ("name", "param", "shape", "numel", "tid", "pid", "fetches", "backward_fetches", "trainable", "__weakref__")

    def __init__(self, name, param):
        self.name = name
        self.param = param
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        self.tid = None
        self.pid = None
        self.fetches = 0
        self.backward_fetches = 0
        self.trainable = param.requires_grad


class _GradStaging:
    """Copies CUDA gradients into pinned host buffers asynchronously, then hands them to the optimizer.

    Each gradient is copied with ``non_blocking=True`` on the stream that produced it, into a pinned
    buffer taken from a pool (keyed by dtype and element count, so a model's repeated layer shapes
    reuse a few buffers), and an event is recorded after the copy. ``poll`` passes on the gradients
    whose copies have completed, in order, without waiting; ``drain`` waits for all of them. A buffer
    returns to the pool once ``add_grad`` has consumed it (it copies or accumulates before returning).
    At most ``max_pending_bytes`` of copies are in flight: beyond that, the oldest is waited for.
    """

    def __init__(self, optimizer, native, max_pending_bytes=256 << 20):
        self._optimizer = optimizer
        self._native = native
        self._max_pending = max_pending_bytes
        self._pending = collections.deque()  # (pid, grad, buffer, start event, end event)
        self._pending_bytes = 0
        self._free = {}  # (dtype, numel) -> [pinned buffers]
        self.pinned_bytes = 0  # held by the pool and the copies in flight

    def _buffer(self, dtype, numel):
        free = self._free.get((dtype, numel))
        if free:
            return free.pop()
        buf = torch.empty(numel, dtype=dtype, pin_memory=True)
        self.pinned_bytes += numel * buf.element_size()
        return buf

    def push(self, pid, grad):
        buf = self._buffer(grad.dtype, grad.numel())
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        buf.view(grad.shape).copy_(grad, non_blocking=True)
        end.record()
        # `grad` stays referenced until the copy has completed.
        self._pending.append((pid, grad, buf, start, end))
        self._pending_bytes += buf.numel() * buf.element_size()
        while self._pending_bytes > self._max_pending and len(self._pending) > 1:
            self._consume(wait=True)
        self.poll()

    def poll(self):
        while self._pending and self._pending[0][4].query():
            self._consume(wait=False)

    def drain(self):
        while self._pending:
            self._consume(wait=True)

    def _consume(self, wait):
        pid, _grad, buf, start, end = self._pending.popleft()
        if wait:
            end.synchronize()
        nbytes = buf.numel() * buf.element_size()
        self._pending_bytes -= nbytes
        self._native.note_transfer("device_to_host", nbytes, start.elapsed_time(end) / 1000.0)
        self._optimizer.add_grad(pid, buf)
        self._free.setdefault((buf.dtype, buf.numel()), []).append(buf)


def _load_config(config):
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    if isinstance(config, dict):
        return json.loads(json.dumps(config))  # a deep copy, and a check that it is JSON
    raise TypeError(f"config must be a dict or the path of a JSON file, not {type(config).__name__}")


def _resolve_auto(cfg, key_path, value):
    node = cfg
    parts = key_path.split(".")
    for p in parts[:-1]:
        node = node.get(p)
        if not isinstance(node, dict):
            return
    if node.get(parts[-1]) == "auto":
        node[parts[-1]] = value


def _client_optimizer_section(optimizer):
    """The ``optimizer`` config section equivalent to a client's torch optimizer (Adam or AdamW):
    tier runs the update itself, offloaded, so it takes the type and hyper-parameters."""
    kinds = {torch.optim.AdamW: "AdamW", torch.optim.Adam: "Adam"}
    kind = kinds.get(type(optimizer))
    if kind is None:
        raise TypeError(
            f"initialize(optimizer=...): tier runs the optimizer itself and implements torch.optim.Adam and "
            f"torch.optim.AdamW, not {type(optimizer).__name__}; pass one of those, or drop the argument and add "
            '{"optimizer": {"type": "AdamW", "params": {"lr": ...}}} to the config'
        )
    g = optimizer.param_groups[0]
    for flag in ("maximize", "amsgrad"):
        if g.get(flag):
            raise ValueError(f"initialize(optimizer=...): {kind} with {flag}=True is not supported by tier's optimizer")
    params = {
        "lr": float(g["lr"]),
        "betas": [float(b) for b in g["betas"]],
        "eps": float(g["eps"]),
        "weight_decay": float(g["weight_decay"]),
    }
    if kind == "Adam":
        params["adam_w_mode"] = False  # torch's Adam adds weight decay to the gradient (L2)
    return {"type": kind, "params": params}


def initialize(
    model,
    config=None,
    *,
    model_parameters=None,
    optimizer=None,
    total_num_steps=None,
    warmup_num_steps=None,
    progress=None,
):
    """Wraps ``model`` in a :class:`TierEngine` configured by ``config`` (a dict or a JSON path in
    DeepSpeed's format plus tier's ``tier`` section). ``model_parameters`` may give parameter groups
    (dicts with ``params`` and overrides of ``lr``/``weight_decay``/``betas``/``eps``), as
    ``deepspeed.initialize`` accepts them.

    ``optimizer``: a ``torch.optim.Adam`` or ``AdamW`` whose type, hyper-parameters and param groups
    tier takes over, for a config without an ``optimizer`` section (as DeepSpeed takes a client
    optimizer); giving both is an error. ``total_num_steps`` and ``warmup_num_steps`` fill the
    scheduler's ``"auto"`` step counts, as the Hugging Face Trainer does."""
    return TierEngine(
        model,
        config,
        model_parameters=model_parameters,
        optimizer=optimizer,
        total_num_steps=total_num_steps,
        warmup_num_steps=warmup_num_steps,
    )


class TierEngine(torch.nn.Module):
    """The model with its parameters and optimizer state managed by tier. Call it like the model."""

    def __init__(
        self, model, config=None, *, model_parameters=None, optimizer=None, total_num_steps=None, warmup_num_steps=None
    ):
        super().__init__()
        cfg = _load_config(config)
        if optimizer is not None:
            if "optimizer" in cfg:
                raise ValueError(
                    "initialize got an optimizer and the config has an \"optimizer\" section; keep one, "
                    "so that there is no doubt which hyper-parameters run"
                )
            cfg["optimizer"] = _client_optimizer_section(optimizer)
            if model_parameters is None:
                model_parameters = optimizer.param_groups

        # The training loop feeds the batches; these "auto"s have nothing to resolve against.
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            if cfg.get(key) == "auto":
                del cfg[key]
        self._raw_config = cfg
        self.config = _tier.Config.from_json(json.dumps(cfg))
        if "optimizer" not in cfg:
            # DeepSpeed reads a missing section as "the client passes one"; never guess a default.
            raise ValueError(
                "the config has no \"optimizer\" section and initialize got no optimizer: add "
                '{"optimizer": {"type": "AdamW", "params": {"lr": ...}}} to the config, or pass '
                "optimizer=torch.optim.AdamW(model.parameters(), lr=...) to tier.torch.initialize"
            )
        resolved = json.loads(self.config.to_json())
        self._resolved = resolved
        self.gradient_accumulation_steps = int(resolved.get("gradient_accumulation_steps", 1))
        self.gradient_clipping = float(resolved.get("gradient_clipping", 0.0))
        if resolved.get("bf16", {}).get("enabled"):
            self.compute_dtype_name = "bf16"
        elif resolved.get("fp16", {}).get("enabled"):
            self.compute_dtype_name = "fp16"
        else:
            self.compute_dtype_name = "fp32"
        self.compute_dtype = _TORCH_DTYPE[self.compute_dtype_name]
        zero = resolved.get("zero_optimization", {})
        param_home = _HOME[zero.get("offload_param", {}).get("device", "none")]

        self.native = _tier.Engine.create(self.config)
        if self.native.device_kind == "cuda":
            self.device = torch.device("cuda", self.native.device_id)
        else:
            self.device = torch.device("cpu")

        self.module = model
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.last_report = None
        self._in_step = False
        self._deferred = collections.deque()  # (CUDA event, view) whose leases end after the event
        self._timers = {"forward": 0.0, "backward": 0.0, "step": 0.0}

        # Buffers (e.g. rotary frequencies) stay on the compute device for good; parameters move.
        for mod in model.modules():
            for bname, buf in list(mod._buffers.items()):
                if buf is not None:
                    mod._buffers[bname] = buf.to(self.device)

        # Unique parameters (tied weights appear once), in model order.
        self._slots = []
        self._slot_of = {}
        for name, p in model.named_parameters():
            if id(p) in self._slot_of:
                continue
            slot = _Slot(name, p)
            self._slots.append(slot)
            self._slot_of[id(p)] = slot
        if not self._slots:
            raise ValueError("the model has no parameters to manage")

        # Each layer's parameters must fit on the device at once: say so now, not mid-forward.
        budget = json.loads(self.native.stats_json())["tiers"]["device"]["budget_bytes"]
        esize = torch.empty(0, dtype=self.compute_dtype).element_size()
        for mod in model.modules():
            need = sum(p.numel() * esize for p in mod.parameters(recurse=False))
            if budget and need > budget:
                raise _tier.ResourceExhausted(
                    f"module {type(mod).__name__} holds {need} bytes of parameters but the device budget is "
                    f"{budget} bytes; raise tier.budgets.device to at least {need} (and to a few layers' worth for "
                    "prefetching)"
                )

        trainable_numel = sum(s.numel for s in self._slots if s.trainable)
        self.optimizer = _tier.Optimizer.create(self.config, trainable_numel, self.native)
        groups = self._build_groups(model_parameters)

        for index, slot in enumerate(self._slots):
            data = slot.param.detach().to("cpu")
            low = data.to(self.compute_dtype).contiguous()
            slot.tid = self.native.register(slot.name, self.compute_dtype_name, slot.numel, "param", index, param_home, low)
            if slot.trainable:
                master = data.float().contiguous()
                group = groups.get(id(slot.param), 0)
                slot.pid = self.optimizer.add_partition(slot.numel, group, self.compute_dtype_name, master, slot.name)
            slot.param.data = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        self.optimizer.finish_registration()
        self._tensor_of_partition = [-1] * self.optimizer.partition_count
        for slot in self._slots:
            if slot.pid is not None:
                self._tensor_of_partition[slot.pid] = slot.tid

        base_lr = float(resolved.get("optimizer", {}).get("params", {}).get("lr", 1e-3))
        self.scheduler = _schedulers.from_config(
            cfg.get("scheduler"),
            [self.optimizer.lr(g) for g in range(self.optimizer.group_count)],
            base_lr,
            total_num_steps=total_num_steps,
            warmup_num_steps=warmup_num_steps,
        )
        self._apply_lr()
        self._install_hooks(model)

    # ------------------------------------------------------------------ setup helpers
    def _build_groups(self, model_parameters):
        """Parameter groups: group 0 is the config's optimizer; each extra group overrides it."""
        base = json.loads(self.config.to_json()).get("optimizer", {}).get("params", {})
        self._group_hparams = [self._group_kwargs(base, {})]
        if not model_parameters:
            return {}
        groups = list(model_parameters)
        if groups and isinstance(groups[0], torch.Tensor):
            return {}
        owner = {}
        decoupled = bool(base.get("adam_w_mode", True))
        for i, g in enumerate(groups):
            params = list(g["params"])
            if i == 0:
                gid = 0
                self._group_hparams[0] = self._group_kwargs(base, g)
                if any(k in g for k in ("lr", "weight_decay", "betas", "eps")):
                    self.optimizer.set_group(0, **self._group_kwargs(base, g))
            else:
                gid = self.optimizer.add_group(**self._group_kwargs(base, g), decoupled=decoupled)
                self._group_hparams.append(self._group_kwargs(base, g))
            for p in params:
                owner[id(p)] = gid
        return owner

    @staticmethod
    def _group_kwargs(base, g):
        betas = g.get("betas", base.get("betas", [0.9, 0.999]))
        return {
            "lr": float(g.get("lr", base.get("lr", 1e-3))),
            "beta1": float(betas[0]),
            "beta2": float(betas[1]),
            "eps": float(g.get("eps", base.get("eps", 1e-8))),
            "weight_decay": float(g.get("weight_decay", base.get("weight_decay", 0.0))),
        }

    def _install_hooks(self, model):
        self._module_slots = {}
        self._hook_handles = []
        for mod in model.modules():
            owned = [self._slot_of[id(p)] for p in mod.parameters(recurse=False)]
            if not owned:
                continue
            self._module_slots[mod] = owned
            ref = weakref.ref(self)
            self._hook_handles.append(mod.register_forward_pre_hook(lambda m, args, r=ref: r()._fetch(m)))
            self._hook_handles.append(mod.register_forward_hook(lambda m, args, out, r=ref: r()._release(m)))
            self._hook_handles.append(
                mod.register_full_backward_pre_hook(lambda m, grad_out, r=ref: r()._fetch_for_backward(m))
            )
            if any(not s.trainable for s in owned):
                # Only parameters without gradients need the end of the module's backward.
                self._hook_handles.append(
                    mod.register_full_backward_hook(lambda m, gin, gout, r=ref: r()._after_module_backward(m))
                )
        for slot in self._slots:
            if slot.trainable:
                ref = weakref.ref(self)
                self._hook_handles.append(
                    slot.param.register_post_accumulate_grad_hook(lambda p, r=ref: r()._grad_ready(p))
                )

    # ------------------------------------------------------------------ parameter movement
    def _bring(self, slot):
        if slot.fetches == 0:
            lease = self.native.acquire(slot.tid, "device", "read")
            # The view owns the lease: it ends when nothing references the memory any more.
            slot.param.data = torch.from_dlpack(lease.as_tensor(list(slot.shape)))
        slot.fetches += 1

    def _drop(self, slot):
        slot.fetches -= 1
        if slot.fetches == 0:
            if self.device.type == "cuda":
                # Kernels queued on the stream may still read the memory: keep the view (and so the
                # lease) until an event recorded after them has completed.
                event = torch.cuda.Event()
                event.record()
                self._deferred.append((event, slot.param.data))
            slot.param.data = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        self._end_finished_leases()

    def _end_finished_leases(self, wait=False):
        while self._deferred and (wait or self._deferred[0][0].query()):
            event, _ = self._deferred.popleft()
            if wait:
                event.synchronize()

    def _fetch(self, module):
        for slot in self._module_slots[module]:
            self._bring(slot)

    def _release(self, module):
        for slot in self._module_slots[module]:
            self._drop(slot)

    def _fetch_for_backward(self, module):
        for slot in self._module_slots[module]:
            self._bring(slot)
            slot.backward_fetches += 1

    def _after_module_backward(self, module):
        # Parameters without gradients end their backward fetch here; trainable ones when their
        # gradient is final (_grad_ready), which can come later for tied weights.
        for slot in self._module_slots[module]:
            if not slot.trainable and slot.backward_fetches > 0:
                slot.backward_fetches -= 1
                self._drop(slot)

    def _grad_ready(self, param):
        slot = self._slot_of[id(param)]
        grad = param.grad
        if grad is not None:
            if grad.device.type == "cuda":
                # Queued behind the backward kernels on the current stream; the optimizer takes it
                # once the copy's event has completed (at the latest at the end of backward).
                self._grad_staging().push(slot.pid, grad.detach())
            else:
                t0 = time.perf_counter()
                host = grad.detach().contiguous()
                self.native.note_transfer(
                    "device_to_host", host.numel() * host.element_size(), time.perf_counter() - t0
                )
                self.optimizer.add_grad(slot.pid, host)
            param.grad = None
        while slot.backward_fetches > 0:
            slot.backward_fetches -= 1
            self._drop(slot)

    def _grad_staging(self):
        staging = self.__dict__.get("_grad_staging_state")
        if staging is None:
            staging = _GradStaging(self.optimizer, self.native)
            self._grad_staging_state = staging
        return staging

    def _drain_grads(self):
        staging = self.__dict__.get("_grad_staging_state")
        if staging is not None:
            staging.drain()

    # ------------------------------------------------------------------ the training loop
    def forward(self, *args, **kwargs):
        t0 = time.perf_counter()
        if not self._in_step and torch.is_grad_enabled():
            # One micro-step (forward + backward) is one step of the access trace.
            self.native.begin_step()
            self._in_step = True
        with _linear.patched_linear():
            out = self.module(*args, **kwargs)
        self._timers["forward"] += time.perf_counter() - t0
        return out

    def backward(self, loss, retain_graph=False):
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale)."""
        t0 = time.perf_counter()
        scaled = loss
        if self.gradient_accumulation_steps > 1:
            scaled = scaled / self.gradient_accumulation_steps
        if self.optimizer.loss_scale != 1.0:
            scaled = scaled * self.optimizer.loss_scale
        scaled.backward(retain_graph=retain_graph)
        self._drain_grads()
        # Parameters that took part in forward but got no gradient still hold a fetch: end it.
        for slot in self._slots:
            while slot.backward_fetches > 0:
                slot.backward_fetches -= 1
                self._drop(slot)
        self._end_finished_leases(wait=True)
        if self._in_step:
            self.native.end_step()
            self._in_step = False
        self._timers["backward"] += time.perf_counter() - t0
        return loss

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def step(self):
        """Counts a micro-step; at the accumulation boundary runs the offloaded optimizer."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return None
        t0 = time.perf_counter()
        self._drain_grads()  # gradients of a backward run outside engine.backward()
        self._apply_lr()
        report = self.optimizer.step_into(self.native, self._tensor_of_partition)
        self.last_report = report
        if report["applied"]:
            self.global_steps += 1
            if self.scheduler is not None:
                # DeepSpeed steps the scheduler after each applied step (not after a skipped one).
                self.scheduler.last_step = self.global_steps
                self._apply_lr()
        else:
            self.skipped_steps += 1
        self._timers["step"] += time.perf_counter() - t0
        return report

    def zero_grad(self, set_to_none=True):
        """Gradients leave the model as soon as they are final; nothing is left to zero."""

    def _apply_lr(self):
        if self.scheduler is None:
            return
        lrs = self.scheduler.lrs(self.global_steps)
        betas = self.scheduler.betas(self.global_steps)
        for g in range(self.optimizer.group_count):
            lr = lrs[min(g, len(lrs) - 1)]
            if betas is None:
                self.optimizer.set_lr(g, lr)
            else:
                h = self._group_hparams[g]
                beta1, beta2 = betas[min(g, len(betas) - 1)]
                self.optimizer.set_group(g, lr, beta1, beta2, h["eps"], h["weight_decay"])

    def get_lr(self):
        return [self.optimizer.lr(g) for g in range(self.optimizer.group_count)]

    @property
    def loss_scale(self):
        return self.optimizer.loss_scale

    # ------------------------------------------------------------------ state
    def stats(self):
        """The engine's snapshot (tiers, links, metrics) with the optimizer's figures."""
        s = json.loads(self.native.stats_json())
        s["optimizer"] = self.optimizer.stats()
        return s

    def timers(self):
        """Seconds spent so far in forward, backward and step (the optimizer), as a new dict."""
        return dict(self._timers)

    def parameter(self, name):
        """The current value of a parameter, as a CPU tensor of the compute dtype."""
        slot = next((s for s in self._slots if s.name == name), None)
        if slot is None:
            raise KeyError(f"no parameter named {name!r}")
        out = torch.empty(slot.shape, dtype=self.compute_dtype)
        self.native.read(slot.tid, out)
        return out

    def state_dict_fp32(self):
        """Every trainable parameter's fp32 master value, by name (CPU tensors)."""
        out = {}
        for slot in self._slots:
            if slot.pid is None:
                out[slot.name] = self.parameter(slot.name).float()
                continue
            t = torch.empty(slot.shape, dtype=torch.float32)
            self.optimizer.read_params(slot.pid, "fp32", t)
            out[slot.name] = t
        return out

    def save_checkpoint(self, save_dir, tag=None, client_state=None):
        """Saves everything needed to resume as ``save_dir/<tag>`` (default ``global_step<N>``) and
        makes it ``latest``; a process killed meanwhile leaves the previous checkpoint loadable.
        ``client_state`` must be JSON-serializable. Returns the checkpoint's path."""
        from .checkpoint import save

        return save(self, save_dir, tag, client_state or {})

    def load_checkpoint(self, load_dir, tag=None):
        """Restores the checkpoint ``tag`` (default: the one ``load_dir/latest`` names), all or
        nothing: every file is checked against its manifest (``tier.DataLoss`` if damaged) and all
        metadata against the model (ValueError) before the engine changes. Returns the directory
        loaded and the client state."""
        from .checkpoint import load

        return load(self, load_dir, tag)

    def close(self):
        """Removes the hooks; the engine's files are removed when it is destroyed."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
