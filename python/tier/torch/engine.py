"""TierEngine: a PyTorch model and optimizer whose state lives in tier's tiers.

Parameters live in their home tier (``zero_optimization.offload_param.device``: nvme, cpu or none)
and are brought to the compute device by forward/backward hooks through the engine, ZeRO-3 style,
with the engine's prefetch scheduler replaying the order it recorded in the first micro-step.
Gradients leave the device as soon as they are final (post-accumulate-grad hooks) into the
offloaded optimizer, which keeps fp32 master params and Adam moments on NVMe or in host memory
(``offload_optimizer.device``) and writes the updated low-precision params back into the engine.

The training loop is DeepSpeed's::

    engine, optimizer, loader, lr_scheduler = tier.torch.initialize(model, config)
    for batch in data:
        loss = engine(**batch).loss
        engine.backward(loss)   # scales by 1 / gradient_accumulation_steps (and the fp16 loss scale)
        engine.step()           # applies the update at the accumulation boundary

Without an optimizer (no ``optimizer`` section, none passed) the engine runs inference only, as
DeepSpeed's ZeRO-Inference: ``engine.module.generate(...)`` streams the weights from their home,
each token's forward a step of the access trace that the prefetch scheduler replays.
"""

import atexit
import collections
import json
import os
import time
import warnings
import weakref

import torch

from .. import _tier
from . import activations as _activations
from . import footprint as _footprint
from .grads import EngineGrads as _EngineGrads
from .grads import GradStaging as _GradStaging
from .grads import MicroStepGrads as _MicroStepGrads
from . import saved_params as _saved_params
from . import zero as _zero
from . import zero_init as _zero_init
from . import schedulers as _schedulers

_TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HOME = {"nvme": "nvme", "cpu": "host", "none": "device"}
_NO_OPTIMIZER = (
    'the config has no "optimizer" section and initialize got no optimizer, so the engine runs inference only; '
    'to train, add {"optimizer": {"type": "AdamW", "params": {"lr": ...}}} to the config, or pass '
    "optimizer=torch.optim.AdamW(model.parameters(), lr=...) to tier.torch.initialize"
)


class _Slot:
    """One unique parameter: where it lives in the engine and in the optimizer."""

    __slots__ = (
        "name",
        "param",
        "shape",
        "numel",
        "tid",
        "pid",
        "fetches",
        "backward_fetches",
        "recompute_holds",
        "trainable",
        "zero_shard",
        "zero_start",
        "zero_count",
        "__weakref__",
    )

    def __init__(self, name, param):
        self.name = name
        self.param = param
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        self.tid = None
        self.pid = None
        self.fetches = 0
        self.backward_fetches = 0
        self.recompute_holds = 0  # forward fetches of a recompute, kept until the module's backward
        self.trainable = param.requires_grad
        # Across ranks (tier.torch.zero): the padded shard size and the elements this rank owns.
        self.zero_shard = self.numel
        self.zero_start = 0
        self.zero_count = self.numel


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
    """The ``optimizer`` config section equivalent to a client's torch optimizer (Adam, AdamW or
    Adagrad): tier runs the update itself, offloaded, so it takes the type and hyper-parameters."""
    kinds = {torch.optim.AdamW: "AdamW", torch.optim.Adam: "Adam", torch.optim.Adagrad: "Adagrad"}
    kind = kinds.get(type(optimizer))
    if kind is None:
        raise TypeError(
            f"initialize(optimizer=...): tier runs the optimizer itself and implements torch.optim.Adam, "
            f"torch.optim.AdamW and torch.optim.Adagrad, not {type(optimizer).__name__}; pass one of those, or drop "
            'the argument and add {"optimizer": {"type": "AdamW", "params": {"lr": ...}}} to the config (types '
            "Adam, AdamW, Adagrad, Lion and Lamb run there)"
        )
    g = optimizer.param_groups[0]
    for flag in ("maximize", "amsgrad"):
        if g.get(flag):
            raise ValueError(f"initialize(optimizer=...): {kind} with {flag}=True is not supported by tier's optimizer")
    if kind == "Adagrad":
        # tier's Adagrad is torch's with lr_decay = 0 and a zero initial accumulator.
        for key in ("lr_decay", "initial_accumulator_value"):
            if float(g.get(key, 0.0)) != 0.0:
                raise ValueError(
                    f"initialize(optimizer=...): Adagrad with {key}={g[key]} is not supported by tier's optimizer "
                    f"(it runs {key}=0); set {key}=0"
                )
        params = {"lr": float(g["lr"]), "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"])}
        return {"type": kind, "params": params}
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
    model=None,
    config=None,
    *,
    args=None,
    model_parameters=None,
    optimizer=None,
    lr_scheduler=None,
    training_data=None,
    collate_fn=None,
    config_params=None,
    dist_init_required=None,
    mpu=None,
    total_num_steps=None,
    warmup_num_steps=None,
    progress=None,
    process_group=None,
    checkpoint_activations=None,
    offload_activations=None,
):
    """Wraps ``model`` in a :class:`TierEngine` configured by ``config`` (a dict or a JSON path in
    DeepSpeed's format plus tier's ``tier`` section; ``config_params`` is the same argument under
    DeepSpeed's other name) and returns ``(engine, optimizer, dataloader, lr_scheduler)`` as
    ``deepspeed.initialize`` does:

    - ``optimizer``: a ``torch.optim.Optimizer`` view of the engine's offloaded optimizer
      (``param_groups`` with each group's ``lr``, ``state_dict``/``load_state_dict`` of the
      hyper-parameters, ``zero_grad``); its ``step`` steps the engine in a loop that does not call
      ``engine.step()`` itself (accelerate's standard loop), and does nothing after it.
    - ``dataloader``: a ``torch.utils.data.DataLoader`` over ``training_data`` with the config's
      micro-batch size (shuffled; ``collate_fn`` if given), or None without ``training_data``.
    - ``lr_scheduler``: the config's scheduler, or the client's ``lr_scheduler`` (a torch LR
      scheduler over the returned optimizer or over the client ``optimizer``, or a callable that
      takes the returned optimizer and returns one), stepped by the engine after each applied
      step; None without either.

    ``model_parameters`` may give parameter groups (dicts with ``params`` and overrides of
    ``lr``/``weight_decay``/``betas``/``eps``). ``optimizer``: a ``torch.optim.Adam``, ``AdamW`` or
    ``Adagrad`` (lr_decay and initial_accumulator_value 0) whose type, hyper-parameters and param
    groups tier takes over, for a config without an
    ``optimizer`` section; giving both is an error. ``args``: read only for
    ``args.deepspeed_config`` (a path) when no config is given. ``total_num_steps`` and
    ``warmup_num_steps`` fill the scheduler's ``"auto"`` step counts, as the Hugging Face Trainer
    does. Launched as several processes (``torchrun --nproc-per-node N``, with
    ``torch.distributed`` initialized), the engine partitions its state over the ranks of the
    default process group, or of ``process_group``, by ``zero_optimization.stage`` (1, 2 or 3; see
    docs/distributed.md). ``mpu`` (model parallelism) is refused; ``dist_init_required=True``
    initializes the default group from the environment when it is not yet.

    ``checkpoint_activations=True`` turns on the model's gradient checkpointing
    (``tier.activations.checkpoint``); ``offload_activations="host"`` or ``"nvme"`` keeps the
    checkpoints there between forward and backward (``tier.activations.offload``; DeepSpeed's
    ``activation_checkpointing.cpu_checkpointing`` means ``"host"``)."""
    if model is None:
        raise ValueError("initialize needs model=")
    if config is not None and config_params is not None:
        raise ValueError("initialize got both config= and config_params=; they are the same argument, give one")
    if config is None:
        config = config_params
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None)
        if config is None and from_args:
            config = from_args
        else:
            warnings.warn(
                "tier.torch.initialize(args=...): ignored; tier reads only args.deepspeed_config, and only when "
                "no config is given",
                stacklevel=2,
            )
    if mpu is not None:
        raise NotImplementedError(
            "initialize(mpu=...): tier partitions over data-parallel ranks only; model parallelism is not supported"
        )
    if dist_init_required:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if checkpoint_activations is not None or offload_activations is not None:
        config = _load_config(config)
        acts = config.setdefault("tier", {}).setdefault("activations", {})
        if checkpoint_activations is not None:
            acts["checkpoint"] = bool(checkpoint_activations)
        if offload_activations is not None:
            acts["offload"] = offload_activations
    engine = TierEngine(
        model,
        config,
        model_parameters=model_parameters,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        total_num_steps=total_num_steps,
        warmup_num_steps=warmup_num_steps,
        process_group=process_group,
    )
    loader = None
    if training_data is not None:
        loader = engine.deepspeed_io(training_data, collate_fn=collate_fn)
    return engine, engine.torch_optimizer, loader, engine.lr_scheduler


class _OptimizerView(torch.optim.Optimizer):
    """What ``initialize`` returns as the optimizer: torch's optimizer surface over the engine's
    offloaded one. ``param_groups`` hold the model's parameters and each group's hyper-parameters;
    an ``lr`` written into a group (by a client LR scheduler, say) is the one the next step uses,
    and the engine writes its own scheduler's lr back. The state (fp32 masters and moments) lives
    in the engine: ``state_dict`` carries the hyper-parameters only; checkpoints go through
    ``engine.save_checkpoint``."""

    def __init__(self, engine, groups, shared_groups=None):
        super().__init__(groups, {})
        if shared_groups is not None:
            # A client optimizer's own groups: its scheduler then drives this view too.
            self.param_groups = shared_groups
        self._engine = weakref.ref(engine)

    def __getattr__(self, name):
        # tier's own optimizer methods (stats(), kind(), group_count, ...) reach through to the
        # engine's offloaded optimizer, so engine.optimizer serves both surfaces.
        if name == "_engine":
            raise AttributeError(name)
        engine = self._engine()
        native = engine.native_optimizer if engine is not None else None
        if native is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return getattr(native, name)

    def step(self, closure=None):
        """Steps the engine when gradients came in since its last ``step()`` without it being
        called: a loop of the caller's own (plain ``loss.backward()``, accelerate's
        ``accelerator.backward`` and ``optimizer.step()`` at each accumulation boundary) gets its
        update here, with every gradient taken since the last step. After ``engine.step()``
        (DeepSpeed's loop, the Trainer) there is nothing left and this does nothing."""
        loss = closure() if closure is not None else None
        engine = self._engine()
        if engine is not None and engine._grads_since_step:
            engine._step_now()
        return loss

    def zero_grad(self, set_to_none=True):
        engine = self._engine()
        if engine is not None:
            engine.zero_grad()

    @property
    def overflow(self):
        """Whether the last boundary step was skipped (fp16 overflow), as accelerate reads it."""
        engine = self._engine()
        return bool(engine is not None and engine.last_report is not None and not engine.last_report["applied"])

    def state_dict(self):
        groups = []
        index = 0
        for g in self.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(entry)
        return {"state": {}, "param_groups": groups}

    def load_state_dict(self, state_dict):
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(groups)} param groups, the engine's optimizer {len(self.param_groups)}"
            )
        for g, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        engine = self._engine()
        if engine is not None:
            engine._apply_lr()


_LIVE_ENGINES = weakref.WeakSet()

_ENGINE_GONE = (
    "this model's parameters are managed by a tier engine that {what}; they are empty placeholders now. Keep the "
    "engine returned by tier.torch.initialize referenced (and not destroyed) while the model runs, e.g. "
    "engine, *_ = tier.torch.initialize(model, config); engine.module.generate(...); write the weights out "
    "first (engine.save_pretrained) if you need them after the engine"
)


def _alive(ref):
    """The engine a hook serves; a clear error when it was freed (only the model was kept)."""
    engine = ref()
    if engine is None:
        raise RuntimeError(_ENGINE_GONE.format(what="was freed (nothing referenced it any more)"))
    return engine


def _tensors(obj, depth=0):
    """The tensors in a module's inputs or outputs (tuples, lists, dicts, ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o, depth + 1)


def _hook_backward(ref, module, args, out):
    """One use of a module's backward, bracketed by hooks on the tensors of its forward: the first
    gradient to reach one of its outputs (their total gradient, so every consumer's backward is
    done) starts it, which fetches its parameters; the gradient reaching its inputs ends it, which
    releases them (without inputs that take a gradient: the parameter's final gradient, or the end
    of backward, does). Tensor hooks stay with a tensor modified in place, so model code may do
    that to a module's output."""
    if not torch.is_grad_enabled():
        return
    outs = [t for t in _tensors(out) if t.requires_grad]
    if not outs:
        return
    started = [False]

    def start(_grad):
        engine = ref()
        if engine is not None and not started[0]:
            started[0] = True
            engine._fetch_for_backward(module)

    for t in outs:
        t.register_hook(start)
    ended = [False]

    def end(_grad):
        engine = ref()
        if engine is not None and started[0] and not ended[0]:
            ended[0] = True
            engine._after_module_backward(module)

    for t in _tensors(args):
        if t.requires_grad:
            t.register_hook(end)


def _release(ref, module):
    engine = ref()
    if engine is not None:
        engine._release(module)


def _exit_forward(ref):
    engine = ref()
    if engine is not None:  # a freed engine was reported by _alive already
        engine._exit_forward()


_DESTROYED_GUARDS = weakref.WeakKeyDictionary()  # module -> handle of its _destroyed_guard hook


def _destroyed_guard(params):
    """A forward pre-hook for a module whose parameters a destroyed engine emptied: a clear error
    instead of a shape error from deep inside torch (unless they got real values again)."""

    def hook(module, args):
        if any(p.numel() != n for p, n in params):
            raise RuntimeError(_ENGINE_GONE.format(what="has been destroyed (engine.destroy())"))

    return hook


@atexit.register
def _destroy_live_engines():
    # The native engines must go before the interpreter tears the extension down, or nanobind
    # reports them as leaked (an engine kept alive by a reference cycle or a global).
    for engine in list(_LIVE_ENGINES):
        try:
            engine.destroy()
        except Exception:  # noqa: BLE001 - at exit, nothing is left to report to
            pass


class TierEngine(torch.nn.Module):
    """The model with its parameters and optimizer state managed by tier. Call it like the model."""

    def __init__(
        self,
        model,
        config=None,
        *,
        model_parameters=None,
        optimizer=None,
        lr_scheduler=None,
        total_num_steps=None,
        warmup_num_steps=None,
        initial_values=None,
        process_group=None,
    ):
        super().__init__()
        cfg = _load_config(config)
        client_optimizer = optimizer
        if optimizer is not None:
            if "optimizer" in cfg:
                raise ValueError(
                    "initialize got an optimizer and the config has an \"optimizer\" section; keep one, "
                    "so that there is no doubt which hyper-parameters run"
                )
            cfg["optimizer"] = _client_optimizer_section(optimizer)
            if model_parameters is None:
                model_parameters = optimizer.param_groups
        if model_parameters is not None:
            # Read once, kept: a generator (model.parameters(), a generator of groups) is read by
            # more than one step of the setup.
            model_parameters = [
                dict(g, params=list(g["params"])) if isinstance(g, dict) else g for g in model_parameters
            ]

        cfg = _zero_init.engine_config(cfg)
        self._raw_config = cfg
        self.config = _tier.Config.from_json(json.dumps(cfg))
        # No optimizer section and no client optimizer: an inference-only engine, as DeepSpeed's
        # ZeRO-Inference (stage 3 with offload_param and no optimizer). No default optimizer is
        # guessed: backward() and step() refuse with the fix.
        self.inference_only = "optimizer" not in cfg
        if self.inference_only:
            extra = [
                name
                for name, given in (
                    ("model_parameters", model_parameters is not None),
                    ("lr_scheduler", lr_scheduler is not None),
                    ('a "scheduler" section', "scheduler" in cfg),
                )
                if given
            ]
            if extra:
                raise ValueError(f"initialize got {' and '.join(extra)} but no optimizer: {_NO_OPTIMIZER}")
        resolved = json.loads(self.config.to_json())
        self._resolved = resolved
        self._gas = int(resolved.get("gradient_accumulation_steps", 1))
        self._clip = float(resolved.get("gradient_clipping", 0.0))
        self._boundary = None  # set from outside: the caller decides where a step ends
        self._step_applied = False
        if resolved.get("bf16", {}).get("enabled"):
            self.compute_dtype_name = "bf16"
        elif resolved.get("fp16", {}).get("enabled"):
            self.compute_dtype_name = "fp16"
        else:
            self.compute_dtype_name = "fp32"
        self.compute_dtype = _TORCH_DTYPE[self.compute_dtype_name]
        zero = resolved.get("zero_optimization", {})
        param_home = _HOME[zero.get("offload_param", {}).get("device", "none")]
        self._param_home = param_home

        # A model built under tier.torch.init has its parameters staged in an engine already.
        stores = {id(st): st for st in map(_zero_init.staged_store, model.parameters()) if st is not None}
        if len(stores) > 1:
            raise ValueError("the model's parameters were staged by more than one tier.torch.init context")
        store = next(iter(stores.values()), None)
        if store is not None:
            if not store.same_engine_config(cfg):
                raise ValueError(
                    "initialize got a config whose engine settings (tier, aio, offload_param, offload_optimizer) "
                    "differ from those tier.torch.init built the model with; pass the same config to both"
                )
            self.native = store.native
        else:
            self.native = _tier.Engine.create(self.config)
        if self.native.device_kind == "cuda":
            self.device = torch.device("cuda", self.native.device_id)
        else:
            self.device = torch.device("cpu")
        self._zero = self._zero_group(process_group, zero, model)

        self.module = model
        self.global_steps = 0
        self.micro_steps = 0
        self._grads_since_step = False  # a gradient came in since the last step() (see _OptimizerView.step)
        self._grads_in_window = False  # a gradient came in since the last applied step or zero_grad()
        self._engine_backward = False  # engine.backward() is handing gradients over
        self._failed_step = None  # "pending" after a failed boundary step, "withdrawn" once gradients moved on
        self._delayed_retry = False  # overlap "delayed": the pending update failed and runs again
        self._params_behind = False  # an applied step could not deliver its params (see _repair_params)
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
        self._excluded_grad_hooks = []
        if model_parameters:
            # As DeepSpeed, the optimizer takes the parameters given and only those: the others are
            # not updated (their gradients, if autograd makes any, are dropped).
            listed = set()
            for g in model_parameters:
                for p in g["params"] if isinstance(g, dict) else [g]:
                    listed.add(id(p))
            for slot in self._slots:
                if slot.trainable and id(slot.param) not in listed:
                    slot.trainable = False
                    self._excluded_grad_hooks.append(
                        slot.param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
                    )
        if self._zero is not None:
            for slot in self._slots:
                slot.zero_shard, slot.zero_start, slot.zero_count = _zero.shard_range(
                    slot.numel, self._zero.world, self._zero.rank
                )

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

        if self.inference_only:
            # Nothing trains: no gradients, no fp32 masters, and a forward outside no_grad builds no
            # graph over the streamed weights.
            for slot in self._slots:
                slot.param.requires_grad_(False)
                slot.trainable = False
            self.native_optimizer = None
            groups = {}
        else:
            # Across ranks, this rank's shards only.
            trainable_numel = sum(s.zero_count for s in self._slots if s.trainable)
            # Micro-steps are summed here (_MicroStepGrads), so the native optimizer takes one
            # gradient per partition and step, however many micro-steps the caller makes.
            opt_cfg = dict(cfg, gradient_accumulation_steps=1)
            opt_cfg.pop("train_batch_size", None)
            opt_config = _tier.Config.from_json(json.dumps(opt_cfg))
            self.native_optimizer = _tier.Optimizer.create(
                opt_config,
                trainable_numel,
                self.native,
                max_partitions=sum(1 for s in self._slots if s.trainable and s.zero_count > 0),
                # Tests only: TIER_FAULT_INJECTION=1 lets optimizer._inject_io_fault fail its I/O.
                fault_injection=os.environ.get("TIER_FAULT_INJECTION") == "1",
            )
            groups = self._build_groups(model_parameters)

        self._check_host_working_set()

        # The swap files grow with what they hold: a model its disks cannot hold is refused now.
        parts = {}
        if param_home == "nvme" and store is None:
            esize = torch.empty(0, dtype=self.compute_dtype).element_size()
            stage3 = self._zero is not None and self._zero.stage == 3
            parts["parameters"] = sum(
                _footprint.padded((s.zero_shard if stage3 else s.numel) * esize) for s in self._slots
            )
        if self.native_optimizer is not None:
            parts["optimizer state"] = self.native_optimizer.stats()["nvme_capacity_bytes"]
        _footprint.check_nvme_room(self.config.swap_paths, parts)

        for index, slot in enumerate(self._slots):
            if self._adoptable(slot, store, initial_values):
                # Staged by tier.torch.init in the compute dtype, where the parameter lives: the
                # staging tensor becomes the parameter's (a 7B model is not written twice); only a
                # trainable one is read, for its fp32 master.
                slot.tid = store.adopt(slot.param, slot.name, index)
                if slot.trainable and slot.zero_count > 0:
                    master = torch.empty(slot.numel, dtype=self.compute_dtype)
                    self.native.read(slot.tid, master)
                    group = groups.get(id(slot.param), 0)
                    slot.pid = self.native_optimizer.add_partition(
                        slot.zero_count, group, self.compute_dtype_name, master.float(), slot.name
                    )
                    del master
                _zero_init.swap_data(slot.param, torch.empty(0, dtype=self.compute_dtype, device=self.device))
                continue
            data = self._initial_value(slot, store, initial_values)
            owned = data.reshape(-1)[slot.zero_start : slot.zero_start + slot.zero_count]
            if self._zero is not None and self._zero.stage == 3:
                # The engine homes this rank's shard (padded); fetches all-gather the parameter.
                low = torch.zeros(slot.zero_shard, dtype=self.compute_dtype)
                low[: slot.zero_count] = owned
                numel = slot.zero_shard
            else:
                low = data.to(self.compute_dtype).contiguous()
                numel = slot.numel
            slot.tid = self.native.register(slot.name, self.compute_dtype_name, numel, "param", index, param_home, low)
            if slot.trainable and slot.zero_count > 0:
                master = owned.float().contiguous()
                group = groups.get(id(slot.param), 0)
                slot.pid = self.native_optimizer.add_partition(
                    slot.zero_count, group, self.compute_dtype_name, master, slot.name
                )
            placeholder = torch.empty(0, dtype=self.compute_dtype, device=self.device)
            if slot.param.device.type == "meta":
                _zero_init.swap_data(slot.param, placeholder)
            else:
                slot.param.data = placeholder
            del data, low, owned
        if store is not None:
            store.drop_rest()
        if self.inference_only:
            self._grads_in_engine = False
            self._grads = _MicroStepGrads(self)  # stays empty
            self._overlap = False
            self._delayed = False
            self._tensor_of_partition = []
            self.scheduler = None
            self.torch_optimizer = None
            self.client_lr_scheduler = None
            self.lr_scheduler = None
        else:
            self.native_optimizer.finish_registration()
            # With the optimizer state on NVMe, gradients are summed in engine tensors homed there too;
            # otherwise (host-resident state) in host memory beside it.
            self._grads_in_engine = zero.get("offload_optimizer", {}).get("device") == "nvme"
            if self._grads_in_engine:
                self._grads = _EngineGrads(self, self.native_optimizer.partition_count)
                for slot in self._slots:
                    if slot.pid is not None:
                        self._grads.register(self.native, slot.pid, slot.name, slot.zero_count, "nvme")
            else:
                self._grads = _MicroStepGrads(self)
            # tier.optimizer.overlap: "exact" (default) runs the step's update during the boundary
            # micro-step's backward (NVMe-resident state; see docs/optimizer.md), "serial" after it.
            overlap = resolved.get("tier", {}).get("optimizer", {}).get("overlap", "exact")
            opt_type = str(resolved.get("optimizer", {}).get("type", "")).lower()
            # "delayed": the update of step k runs while step k+1's forward and backward compute
            # on the params of step k (ZeRO-Offload's delayed parameter update; docs/optimizer.md).
            self._delayed = overlap == "delayed"
            self._delayed_pending = None  # (the gradients it reads, lr_kwargs) while it runs
            self._spare_grads = None  # the other set of gradient tensors (NVMe state)
            if self._delayed:
                why = None
                if self.compute_dtype_name == "fp16":
                    why = (
                        "fp16 loss scaling is not supported with it (the next step's loss scale would depend on the "
                        "overflow check of an update that has not run yet); use bf16 or fp32"
                    )
                elif opt_type == "lamb":
                    why = "Lamb is not supported with it (its trust ratios need a second pass); use Adam or AdamW"
                elif self._zero is not None:
                    why = f"it is not supported across ranks yet (this run has {self._zero.world}); use \"exact\""
                if why:
                    raise ValueError(f'tier.optimizer.overlap: "delayed": {why}')
                if self._grads_in_engine:
                    self._spare_grads = self._register_spare_grads()
            self._overlap = overlap == "exact" and self._grads_in_engine and opt_type != "lamb"
            self._tensor_of_partition = [-1] * self.native_optimizer.partition_count
            # Where each partition's updated params go in its tensor: a rank's shard of a whole
            # parameter (stages 1 and 2) sits at its offset; a stage-3 shard is its own tensor.
            self._partition_offsets = [0] * self.native_optimizer.partition_count
            for slot in self._slots:
                if slot.pid is not None:
                    self._tensor_of_partition[slot.pid] = slot.tid
                    if self._zero is not None and self._zero.stage < 3:
                        self._partition_offsets[slot.pid] = slot.zero_start
            self._reduce_sumsq = self._zero.all_reduce_sum if self._zero is not None else None
            if self._zero is not None:
                ref = weakref.ref(self)
                self._reducer = _zero.GradReducer(
                    self._zero,
                    self._slots,
                    lambda s, shard, r=ref: r()._grads.add_grad(s.pid, shard),
                    lambda n, sec, r=ref: r().native.note_transfer("device_to_host", n, sec),
                )
                if self._zero.stage == 3:
                    # stage3_prefetch_bucket_size: elements of params gathered ahead of use.
                    budget = zero.get("stage3_prefetch_bucket_size", zero.get("prefetch_bucket_size", 50_000_000))
                    self._prefetcher = _zero.GatherPrefetcher(
                        self._zero, budget, lambda s, r=ref: r()._shard_of(s, r()._zero.device)
                    )

            base_lr = float(resolved.get("optimizer", {}).get("params", {}).get("lr", 1e-3))
            self.scheduler = _schedulers.from_config(
                cfg.get("scheduler"),
                [self.native_optimizer.lr(g) for g in range(self.native_optimizer.group_count)],
                base_lr,
                total_num_steps=total_num_steps,
                warmup_num_steps=warmup_num_steps,
            )
            self.torch_optimizer = self._make_optimizer_view(model_parameters, client_optimizer)
            self.client_lr_scheduler = self._take_client_scheduler(lr_scheduler, client_optimizer)
            self.lr_scheduler = self.client_lr_scheduler if self.client_lr_scheduler is not None else self.scheduler
        self._param_version = 0
        self._apply_lr()
        self._install_hooks(model)
        self._install_state_dict_hooks(model)
        self._setup_activations(model, resolved)
        _LIVE_ENGINES.add(self)

    @property
    def optimizer(self):
        """The optimizer ``initialize`` returned, as DeepSpeed's ``engine.optimizer``: torch's surface
        (``param_groups``, ``step``, ``zero_grad``, ``state_dict``) plus the offloaded optimizer's own
        methods (``stats()``, ``kind()``, ...). None when the engine has no optimizer."""
        if self.__dict__.get("native_optimizer") is None:
            return None
        return self.__dict__.get("torch_optimizer")

    def _setup_activations(self, model, resolved):
        """tier.activations (and activation_checkpointing.cpu_checkpointing): the model's gradient
        checkpointing turned on, and its checkpoints offloaded (see tier.torch.activations)."""
        acts = resolved.get("tier", {}).get("activations", {})
        self._activations = None
        self._activations_checked = False
        if acts.get("checkpoint"):
            enable = getattr(model, "gradient_checkpointing_enable", None)
            if enable is None:
                raise ValueError(
                    "tier.activations.checkpoint is true but the model has no gradient_checkpointing_enable(); call "
                    "tier.torch.activations.checkpoint(fn, *args) around its blocks in its forward instead"
                )
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        home = acts.get("offload", "none")
        if home == "none":
            return
        if self.inference_only:
            raise ValueError(
                f"tier.activations.offload is {home!r} but the engine runs inference only (no optimizer): there is no "
                "backward to keep checkpoints for; remove it"
            )
        self._activations = _activations.ActivationOffload(self.native, home)
        self._saved_params.offload = self._activations
        _activations.mark_model_checkpoints(model)

    # ------------------------------------------------------------------ setup helpers
    def _zero_group(self, process_group, zero, model):
        """The ranks to partition over (None in one process), checked: a supported stage, a backend
        that carries the engine's tensors, and the same config and model on every rank."""
        import torch.distributed as dist

        self._reducer = None
        self._prefetcher = None
        if process_group is None and not _zero.default_group_active():
            return None
        if not dist.is_initialized():
            raise ValueError("initialize(process_group=...): torch.distributed is not initialized")
        pg = process_group if process_group is not None else dist.group.WORLD
        if dist.get_world_size(pg) == 1:
            return None
        stage = int(zero.get("stage", 0))
        world = dist.get_world_size(pg)
        if self.inference_only:
            raise NotImplementedError(
                f"tier.torch.initialize: an inference-only engine across {world} ranks is not supported yet; run "
                "generation in one process per model copy (without torch.distributed) or add an optimizer"
            )
        if stage not in (1, 2, 3):
            raise ValueError(
                f"zero_optimization.stage: {stage} across {world} ranks is not supported; tier partitions with "
                "stage 1 (optimizer state), 2 (also gradients) or 3 (also parameters): set one of them"
            )
        bucket = zero.get("reduce_bucket_size", 500_000_000)
        group = _zero.ZeroGroup(pg, stage, bucket, self.device)
        digest = [(n, tuple(p.shape), bool(p.requires_grad), str(p.dtype)) for n, p in model.named_parameters()]
        group.check_same_config(self._raw_config, digest)
        return group

    def _adoptable(self, slot, store, initial_values):
        """Whether the parameter's tier.torch.init staging tensor can be its engine tensor as it is:
        staged by this engine's store in the compute dtype, whole (one process), and not replaced
        by initial values."""
        if store is None or _zero_init.staged_store(slot.param) is not store or self._zero is not None:
            return False
        if initial_values is not None:  # (values from a checkpoint being loaded)
            return False
        return slot.param.dtype == self.compute_dtype and store.home == self._param_home

    @staticmethod
    def _initial_value(slot, store, initial_values):
        """A parameter's starting values as a CPU tensor: from ``initial_values`` (a checkpoint
        being loaded), from the tier.torch.init staging copy, or the parameter itself."""
        if initial_values is not None:
            value = initial_values(slot.name, slot.param)
            if value is not None:
                return value
        if store is not None and _zero_init.staged_store(slot.param) is store:
            return store.take(slot.param)
        if slot.param.device.type == "meta":
            raise ValueError(
                f"parameter {slot.name!r} is a meta tensor with no values: build the model under "
                "tier.torch.init(config), load it with tier.torch.from_pretrained, or give it real weights"
            )
        return slot.param.detach().to("cpu")

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
                    self.native_optimizer.set_group(0, **self._group_kwargs(base, g))
            else:
                gid = self.native_optimizer.add_group(**self._group_kwargs(base, g), decoupled=decoupled)
                self._group_hparams.append(self._group_kwargs(base, g))
            for p in params:
                owner[id(p)] = gid
        return owner

    def _make_optimizer_view(self, model_parameters, client_optimizer):
        """The torch optimizer handed back by initialize: one param group per native group."""
        owner = {}
        if model_parameters:
            listed = list(model_parameters)
            if listed and isinstance(listed[0], dict):
                for gid, g in enumerate(listed):
                    for p in g["params"]:
                        owner[id(p)] = gid
        groups = [dict(params=[]) for _ in range(self.native_optimizer.group_count)]
        for slot in self._slots:
            if slot.trainable:
                groups[owner.get(id(slot.param), 0)]["params"].append(slot.param)
        for g, h in zip(groups, self._group_hparams):
            g.update(lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"])
        groups = [g for g in groups if g["params"]] or [dict(groups[0], params=[torch.zeros(0, requires_grad=True)])]
        shared = None
        if client_optimizer is not None and len(client_optimizer.param_groups) == self.native_optimizer.group_count:
            shared = client_optimizer.param_groups
        return _OptimizerView(self, groups, shared)

    def _take_client_scheduler(self, lr_scheduler, client_optimizer):
        if lr_scheduler is None:
            return None
        if self.scheduler is not None:
            raise ValueError(
                "initialize got an lr_scheduler and the config has a \"scheduler\" section; keep one, so that "
                "there is no doubt which schedule runs"
            )
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            lr_scheduler = lr_scheduler(self.torch_optimizer)
        if not (hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "optimizer")):
            raise TypeError(
                f"initialize(lr_scheduler=...): expected a torch LR scheduler (or a callable returning one), not "
                f"{type(lr_scheduler).__name__}"
            )
        ok = lr_scheduler.optimizer is self.torch_optimizer or (
            client_optimizer is not None
            and lr_scheduler.optimizer is client_optimizer
            and self.torch_optimizer.param_groups is client_optimizer.param_groups
        )
        if not ok:
            raise ValueError(
                "initialize(lr_scheduler=...): the scheduler drives another optimizer than the one tier runs; build it "
                "over the optimizer passed to initialize, or pass a callable that takes the returned optimizer and "
                "returns the scheduler"
            )
        return lr_scheduler

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
        self._forward_fetches = {}  # module -> forward fetches not yet released
        self._hook_handles = []
        self._forward_depth = 0
        self._inference_step = False
        self._in_backward = False  # engine.backward() is running (recomputed forwards run inside it)
        ref = weakref.ref(self)
        # Saved views of streamed parameters become references for the duration of a training
        # forward (the hooks are entered by the outermost module call and exited after it).
        self._saved_params = _saved_params.SavedParams(lambda slot, r=ref: r()._bring_for_unpack(slot))
        self._saved_hooks = None
        # A parameter used outside its module's forward is brought for the call that uses it.
        self._fetch_on_use = _saved_params.FetchOnUse(
            self._slot_of, lambda slots, r=ref: r()._bring_all(slots), lambda slot, r=ref: r()._drop(slot)
        )
        self._fetch_on_use_active = False
        for mod in model.modules():
            guard = _DESTROYED_GUARDS.pop(mod, None)  # the model is managed again
            if guard is not None:
                guard.remove()
            owned = [self._slot_of[id(p)] for p in mod.parameters(recurse=False)]
            # Every module brackets the access-trace step (_enter_forward/_exit_forward): its
            # pre-hook runs before the module's fetch, its forward hook after the release.
            self._hook_handles.append(mod.register_forward_pre_hook(lambda m, args, r=ref: _alive(r)._enter_forward()))
            if owned:
                self._module_slots[mod] = owned
                self._hook_handles.append(mod.register_forward_pre_hook(lambda m, args, r=ref: r()._fetch(m)))
                # always_call: a forward that raises (or a recompute stopped early by activation
                # checkpointing, which raises once it has what backward needs) still releases.
                self._hook_handles.append(
                    mod.register_forward_hook(lambda m, args, out, r=ref: _release(r, m), always_call=True)
                )
            self._hook_handles.append(
                mod.register_forward_hook(lambda m, args, out, r=ref: _exit_forward(r), always_call=True)
            )
            if not owned or self.inference_only:
                continue
            # Backward brackets, as hooks on the forward's own tensors (see _hook_backward) rather
            # than full backward hooks, whose wrapping of outputs breaks models that modify a
            # module's output in place (Falcon's mlp_output += attention_output).
            self._hook_handles.append(
                mod.register_forward_hook(lambda m, args, out, r=ref: _hook_backward(r, m, args, out))
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
            if self._zero is not None and self._zero.stage == 3:
                self._gather_params([slot])
            else:
                lease = self.native.acquire(slot.tid, "device", "read")
                # The view owns the lease: it ends when nothing references the memory any more.
                slot.param.data = torch.from_dlpack(lease.as_tensor(list(slot.shape)))
                self._saved_params.placed(slot)
        slot.fetches += 1

    def _shard_of(self, slot, device):
        """This rank's stage-3 shard of a parameter (padded), on ``device``."""
        lease = self.native.acquire(slot.tid, "device", "read")
        view = torch.from_dlpack(lease.as_tensor())
        out = view.to(device, copy=True)
        del view, lease
        return out

    def _gather_params(self, slots):
        """Stage 3: all-gathers the parameters of ``slots`` (one collective) into their ``.data``."""
        full = self._prefetcher.gather(slots)
        for s in slots:
            s.param.data = full[id(s)].view(s.shape).to(self.device)
            self._saved_params.placed(s)

    def _gather_updated_params(self):
        """Stages 1 and 2, after an applied step: every rank's updated shards into every rank's
        whole parameters, in buckets of ``reduce_bucket_size`` elements."""
        group = self._zero
        trainable = [s for s in self._slots if s.trainable]

        def mine(s):
            out = torch.zeros(s.zero_shard, dtype=self.compute_dtype)
            if s.zero_count > 0:
                lease = self.native.acquire(s.tid, "host", "read")
                flat = torch.from_dlpack(lease.as_tensor())
                out[: s.zero_count] = flat[s.zero_start : s.zero_start + s.zero_count]
                del flat, lease
            return out.to(group.device)

        for bucket in _zero.gather_buckets(group, trainable):
            full = _zero.gather_full(group, bucket, mine)
            for s in bucket:
                self.native.write(s.tid, full[id(s)].to("cpu").contiguous())

    def _drop(self, slot):
        slot.fetches -= 1
        if slot.fetches == 0:
            self._saved_params.removed(slot)
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

    def _enter_forward(self):
        # A forward that is not part of a training micro-step (under no_grad, or in an
        # inference-only engine) is one step of the access trace on its own: the per-token forwards
        # of generate() replay the order the first one recorded, so the scheduler streams the next
        # layers while the current ones compute, and at the end of a forward the first layers of
        # the next. The outermost module called brackets the step (a PEFT model's generate() calls
        # the base model's).
        self._forward_depth += 1
        if self._forward_depth > 1 or self._in_backward or torch._C._current_graph_task_id() != -1:
            # An inner module, or a forward recomputed during backward (activation checkpointing):
            # part of the micro-step already running, and under the recompute's own saved-tensor
            # hooks, which must stay the innermost.
            return
        if torch.is_grad_enabled() and not self.inference_only and self._saved_hooks is None:
            if self._activations is not None:
                _activations.mark_model_checkpoints(self.module)  # (enabled after initialize?)
                self._activations.begin_step()
            self._saved_hooks = self._saved_params.hooks()
            self._saved_hooks.__enter__()
            self._fetch_on_use.__enter__()
            self._fetch_on_use_active = True
        # A forward of the model itself (engine.module.generate, say) between the boundary backward
        # and step() must see the committed params, as engine(...) does.
        self._cancel_overlap()
        if self._prefetcher is not None:
            self._prefetcher.begin()
        if not self._in_step and (self.inference_only or not torch.is_grad_enabled()):
            self.native.begin_step()
            self._inference_step = True

    def _exit_forward(self):
        self._forward_depth -= 1
        if self._forward_depth == 0 and self._saved_hooks is not None:
            if self._fetch_on_use_active:
                self._fetch_on_use_active = False
                self._fetch_on_use.__exit__(None, None, None)
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)
            if self._activations is not None and not self._activations_checked:
                self._activations_checked = True
                if self._activations.seen_in_step == 0:
                    raise ValueError(
                        f"tier.activations.offload is {self._activations.home!r} but the forward checkpointed nothing: "
                        "offloading needs activation checkpointing; turn it on (tier.activations.checkpoint: true, "
                        "model.gradient_checkpointing_enable(), or tier.torch.activations.checkpoint(fn, *args) in the model's "
                        "forward)"
                    )
        if self._forward_depth == 0 and self._inference_step:
            self._inference_step = False
            self.native.end_step()

    def _bring_all(self, slots):
        if self._zero is not None and self._zero.stage == 3:
            # Stage 3: one all-gather for those that are not here yet.
            need = list({id(s): s for s in slots if s.fetches == 0}.values())
            if need:
                self._gather_params(need)
            for slot in slots:
                slot.fetches += 1
            return
        brought = []
        try:
            for slot in slots:
                self._bring(slot)
                brought.append(slot)
        except BaseException:
            for slot in brought:  # all or nothing: a failed fetch holds nothing
                self._drop(slot)
            raise

    def _fetch(self, module):
        self._bring_all(self._module_slots[module])
        self._forward_fetches[module] = self._forward_fetches.get(module, 0) + 1

    def _release(self, module):
        held = self._forward_fetches.get(module, 0)
        if held == 0:  # the fetch itself failed
            return
        self._forward_fetches[module] = held - 1
        if torch._C._current_graph_task_id() != -1:
            # A forward recomputed in backward (activation checkpointing): what it saves for the
            # module's backward may be the parameter itself (a frozen one is saved as it is, not
            # detached), so the parameter stays in place until that backward is done.
            for slot in self._module_slots[module]:
                slot.recompute_holds += 1
            return
        for slot in self._module_slots[module]:
            self._drop(slot)

    def _fetch_for_backward(self, module):
        self._bring_all(self._module_slots[module])
        for slot in self._module_slots[module]:
            slot.backward_fetches += 1

    def _end_recompute_holds(self, slot):
        while slot.recompute_holds > 0:
            slot.recompute_holds -= 1
            self._drop(slot)

    def _bring_for_unpack(self, slot):
        # A saved view of a parameter whose module's backward pre-hook did not bring it (a module
        # using another's weight): brought now, released when its gradient is final or at the end
        # of backward, as a module's backward fetch is.
        self._bring_all([slot])
        slot.backward_fetches += 1

    def _after_module_backward(self, module):
        # One use of the module has its backward done (the gradient reached its inputs): the fetch
        # that use made ends. A module run several times in a step (ALBERT's shared layer) so
        # holds its parameters during each use's backward only, not from the last use's to the
        # first's, where a trainable parameter's gradient is final (_grad_ready ends what is left).
        for slot in self._module_slots[module]:
            if slot.backward_fetches > 0:
                slot.backward_fetches -= 1
                self._drop(slot)
            self._end_recompute_holds(slot)

    def _grad_ready(self, param):
        slot = self._slot_of[id(param)]
        self._grads_since_step = True
        self._grads_in_window = True
        grad = param.grad
        if grad is not None:
            if self._reducer is not None:
                # Across ranks: reduce-scattered in buckets; this rank's shard goes on to _grads.
                self._reducer.add(slot, grad)
            elif grad.device.type == "cuda":
                # Queued behind the backward kernels on the current stream; the optimizer takes it
                # once the copy's event has completed (at the latest at the end of backward).
                self._grad_staging().push(slot.pid, grad.detach())
            else:
                t0 = time.perf_counter()
                host = grad.detach().contiguous()
                self.native.note_transfer(
                    "device_to_host", host.numel() * host.element_size(), time.perf_counter() - t0
                )
                self._grads.add_grad(slot.pid, host)
            param.grad = None
        while slot.backward_fetches > 0:
            slot.backward_fetches -= 1
            self._drop(slot)
        self._end_recompute_holds(slot)

    def _grad_staging(self):
        staging = self.__dict__.get("_grad_staging_state")
        if staging is None:
            staging = _GradStaging(self._grads, self.native)
            self._grad_staging_state = staging
        return staging

    def _drain_grads(self):
        staging = self.__dict__.get("_grad_staging_state")
        if staging is not None:
            staging.drain()

    # ------------------------------------------------------------------ the training loop
    def _span(self, name, t0_ns):
        """A compute span on the timeline (tier.trace_file or start_trace), from t0_ns to now."""
        if self.native.tracing:
            self.native.trace_span("compute", name, t0_ns, time.monotonic_ns())

    def start_trace(self, max_events=1_000_000):
        """Starts recording the timeline (as ``"tier": {"trace_file": ...}`` does from the start):
        each transfer per link, stalls, forward/backward/optimizer spans."""
        self.native.start_trace(max_events)

    def save_trace(self, path):
        """Writes the timeline recorded so far as Chrome trace-event JSON (open it in
        ui.perfetto.dev or chrome://tracing); recording goes on."""
        self.native.write_trace(os.fspath(path))

    def _cancel_overlap(self):
        """Drops the overlapped step in flight, if any: the params it delivered go back to the
        committed ones, its declarations are forgotten (the gradients stay in their engine tensors,
        and step() declares them again) and the step will run serially. Anything that reads the
        params or changes the gradients between the boundary backward and step() calls this."""
        if self.native_optimizer is None or not self.native_optimizer.overlap_running:
            return
        self.native_optimizer.cancel_overlap()
        self.native_optimizer.clear_grads()
        self._grads.declared.clear()

    def forward(self, *args, **kwargs):
        # A forward between the boundary backward and step() must see the committed params.
        self._cancel_overlap()
        self._repair_params()
        t0 = time.perf_counter()
        t0_ns = time.monotonic_ns()
        if not self._in_step and torch.is_grad_enabled() and not self.inference_only:
            # One micro-step (forward + backward) is one step of the access trace.
            self.native.begin_step()
            self._in_step = True
        out = self.module(*args, **kwargs)
        self._timers["forward"] += time.perf_counter() - t0
        self._span("forward", t0_ns)
        return out

    def backward(self, loss, allreduce_gradients=True, release_loss=False, retain_graph=False, scale_wrt_gas=True):
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale); with
        ``scale_wrt_gas=False`` the loss is not divided. ``allreduce_gradients`` and
        ``release_loss`` are DeepSpeed's: across ranks, gradients are always reduced (tier.torch.zero)."""
        self._require_optimizer("backward")
        t0 = time.perf_counter()
        t0_ns = time.monotonic_ns()
        scaled = loss
        if scale_wrt_gas and self._gas > 1:
            scaled = scaled / self._gas
        if self.native_optimizer.loss_scale != 1.0:
            scaled = scaled * self.native_optimizer.loss_scale
        self._withdraw_failed_step()
        if self.native_optimizer.overlap_running:
            # A second backward on the boundary adds to gradients the pass may have used already.
            self._cancel_overlap()
        elif self._overlap and self.is_gradient_accumulation_boundary():
            # The step's update starts now and takes each chunk of the state as backward finishes
            # its gradients; step() validates it (and redoes it when clipping or an overflow says so).
            self._apply_lr()
            self.native_optimizer.start_overlap_into(
                self.native,
                self._tensor_of_partition,
                self._grads.tensors,
                self._partition_offsets,
                self._reduce_sumsq,
            )
        self._in_backward = True
        self._engine_backward = True  # until its gradients are all handed over (drain, reduce)
        try:
            try:
                scaled.backward(retain_graph=retain_graph)
            except BaseException:
                self.native_optimizer.cancel_overlap()
                raise
            finally:
                self._in_backward = False
            self._drain_grads()
            if self._reducer is not None:
                self._reducer.flush(self.is_gradient_accumulation_boundary())
        finally:
            self._engine_backward = False
        if self._prefetcher is not None:
            self._prefetcher.drop()
        # Parameters that took part in forward but got no gradient still hold a fetch: end it.
        for slot in self._slots:
            self._end_recompute_holds(slot)
            while slot.backward_fetches > 0:
                slot.backward_fetches -= 1
                self._drop(slot)
        self._end_finished_leases(wait=True)
        if self._in_step:
            self.native.end_step()
            self._in_step = False
        self._timers["backward"] += time.perf_counter() - t0
        self._span("backward", t0_ns)
        return loss

    def is_gradient_accumulation_boundary(self):
        """Whether the current micro-step ends a step: the value set by
        ``set_gradient_accumulation_boundary`` if any, else every ``gradient_accumulation_steps``-th
        micro-step by the engine's counter."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self._gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary):
        """Lets the caller decide where a step ends (accelerate does, before each backward): from now
        on the gradients of every micro-step are summed until one runs with ``is_boundary=True``,
        whatever ``gradient_accumulation_steps`` says; ``step()`` then applies the update."""
        self._boundary = bool(is_boundary)

    def step(self, lr_kwargs=None):
        """Counts a micro-step; at the accumulation boundary runs the offloaded optimizer (clipping,
        fp16 overflow check, Adam/AdamW) and then the LR scheduler. Returns the optimizer's report,
        or None off the boundary."""
        self._require_optimizer("step")
        self._grads_since_step = False
        boundary = self.is_gradient_accumulation_boundary()
        if self._reducer is not None:
            self._reducer.flush(boundary)  # a backward run outside engine.backward()
        if self._prefetcher is not None:
            self._prefetcher.drop()
        self._step_applied = False
        if not boundary:
            self.micro_steps += 1
            return None
        if not self._grads_in_window and self._failed_step is None and not self._delayed_retry:
            # No backward since the last step: as torch's optimizers skip a parameter without a
            # gradient, nothing is updated (no weight decay), and no step is counted.
            if not self.__dict__.get("_warned_empty_step"):
                self._warned_empty_step = True
                warnings.warn(
                    "engine.step() at an accumulation boundary with no backward() since the last step: nothing to "
                    "apply; the parameters, the optimizer state and the step count are left as they are",
                    stacklevel=2,
                )
            return None
        t0 = time.perf_counter()
        t0_ns = time.monotonic_ns()
        self._drain_grads()  # gradients of a backward run outside engine.backward()
        if self._delayed:
            report = self._start_delayed(lr_kwargs)
            self._grads_in_window = False
            self.micro_steps += 1
        else:
            report = self._boundary_step(lr_kwargs)
        self._timers["step"] += time.perf_counter() - t0
        self._span("step", t0_ns)
        return report

    def _step_now(self):
        """The optimizer view's step() for a loop that does not call engine.step(): the gradients
        taken since the last step make one, whatever the micro-step counter says."""
        saved = self._boundary
        self._boundary = True
        try:
            return self.step()
        finally:
            self._boundary = saved

    def _boundary_step(self, lr_kwargs):
        """The optimizer step of an accumulation boundary (serial, or finishing the overlapped one).

        A step that fails (an I/O error, a full disk) leaves one state, whatever comes next: the
        optimizer state and the params are the previous step's (the optimizer puts back the params
        it had delivered), the step's gradients are kept, and the micro-step is not counted, so
        the boundary is still the current micro-step. From there:

        - ``step()`` again retries the step with the kept gradients;
        - another ``backward()`` adds to the kept gradients (its micro-step is part of this step),
          and ``step()`` steps with the sum;
        - ``zero_grad()`` drops the gradients and starts the accumulation window again: the next
          ``gradient_accumulation_steps`` micro-steps make the step.

        A step that was applied but whose updated params could not all be delivered is counted;
        the params are rewritten from the fp32 masters before the next forward or step.
        """
        applied_before = self.native_optimizer.stats()["steps_applied"]
        try:
            self._grads.flush(self.native_optimizer)
            if self.native_optimizer.overlap_running:
                report = self.native_optimizer.finish_overlap()
            else:
                self._apply_lr()
                grad_tensors = self._grads.tensors if self._grads_in_engine else []
                report = self.native_optimizer.step_into(
                    self.native,
                    self._tensor_of_partition,
                    grad_tensors,
                    self._partition_offsets,
                    self._reduce_sumsq,
                )
        except BaseException:
            self._grads.after_step(False)
            if self.native_optimizer.stats()["steps_applied"] == applied_before:
                self._failed_step = "pending"
                raise
            # Applied (the state moved on, the gradients were consumed), its outputs not all
            # delivered: counted, and the params are rewritten from the masters before use.
            self._failed_step = None
            self._grads.clear()
            self._params_behind = True
            self.micro_steps += 1
            applied = {"applied": True, "step": self.native_optimizer.stats()["step"], "grad_norm": float("nan"), "overflow": False}
            self._after_report(applied, lr_kwargs)
            raise
        self._grads.after_step(True)
        self._failed_step = None
        self._grads_in_window = False
        self.micro_steps += 1
        self._after_report(report, lr_kwargs)
        return report

    def _withdraw_failed_step(self):
        """A gradient is about to change after a failed step: what the optimizer was told about the
        kept gradients (declared engine tensors, lent sums) is withdrawn, as it would be stale; the
        gradients themselves stay, and the next step hands them over again."""
        if self.__dict__.get("_failed_step") != "pending":
            return
        if isinstance(self._grads, _MicroStepGrads) and not self._grads.held:
            # One micro-step per step: the gradients went into the optimizer's own accumulators,
            # which cannot take a second one.
            raise RuntimeError(
                "the last step failed and its gradients are inside the optimizer, which cannot add another "
                "backward to them: call step() to retry it, or zero_grad() to drop them and start the step again"
            )
        self.native_optimizer.cancel_overlap()
        self.native_optimizer.clear_grads()
        self._grads.withdraw()
        self._failed_step = "withdrawn"

    def _repair_params(self):
        """Params that an applied step could not deliver (or a failed one could not put back) are
        rewritten from the fp32 masters before the next forward reads them."""
        if self.native_optimizer is None:
            return
        behind = self.__dict__.get("_params_behind", False) or self.native_optimizer.outputs_stale
        if not behind:
            return
        if self._zero is not None:
            raise RuntimeError(
                "an optimizer step could not deliver its updated params across ranks; load the last checkpoint "
                "(engine.load_checkpoint) to go on"
            )
        self._params_from_masters()
        self._params_behind = False
        self.native_optimizer.outputs_rewritten()

    def _start_delayed(self, lr_kwargs):
        """overlap "delayed": waits for the previous step's update (and puts its params in place),
        then starts this step's on a thread of its own, reading this step's gradients while the
        next micro-steps gather theirs in the other set. Returns the previous step's report (None
        at the first)."""
        report = self._join_delayed()
        self._grads.flush(self.native_optimizer)
        grad_tensors = self._grads.tensors if self._grads_in_engine else []
        self._apply_lr()
        self._optimizer_stats = self.native_optimizer.stats()
        self.native_optimizer.start_step_async(self.native, [-1] * len(self._tensor_of_partition), grad_tensors)
        self._delayed_pending = (self._grads, lr_kwargs)
        if self._grads_in_engine:
            spare = self._spare_grads
            if spare is None:  # (made at initialize)
                spare = self._register_spare_grads()
            self._grads = spare
            self._spare_grads = None
        else:
            self._grads = _MicroStepGrads(self)
        return report

    def _register_spare_grads(self):
        """overlap "delayed" with NVMe state: the second set of gradient tensors, which the next
        micro-steps fill while an update reads the first. Checked against tier.budgets.nvme first,
        so that a budget without room for it is an error at initialize, not a timeout mid-run."""
        need = sum(4 * slot.zero_count for slot in self._slots if slot.pid is not None)
        nvme = json.loads(self.native.stats_json())["tiers"]["nvme"]
        # The NVMe figures include the optimizer's own files, which have no part in the budget.
        held = nvme["resident_bytes"] - self.native_optimizer.stats()["nvme_bytes"]
        if held + need > nvme["budget_bytes"]:
            raise ValueError(
                f'tier.optimizer.overlap: "delayed" keeps a second set of fp32 gradients on NVMe ({need} bytes) '
                f"beside the {held} bytes of tensors there; tier.budgets.nvme is {nvme['budget_bytes']}: "
                f"raise it to at least {held + need} (plus room to stage transfers)"
            )
        spare = _EngineGrads(self, self.native_optimizer.partition_count)
        for slot in self._slots:
            if slot.pid is not None:
                spare.tensors[slot.pid] = self.native.register(
                    f"grad.next/{slot.name}", "fp32", slot.zero_count, "grad", 0, "nvme"
                )
        return spare

    def _join_delayed(self):
        """Waits for the update started by the last boundary step() in "delayed" mode, writes the
        params it produced into the engine and books the step. Returns its report, or None.

        An update that fails (an I/O error, a full disk) stays pending with its gradients (the
        other set) and the state of the step before: the next call runs it again, with the same lr,
        before anything else, so whatever the caller does meanwhile (retry step(), zero_grad() and
        a new window, or another backward into this window) the updates are the same."""
        pending = self.__dict__.get("_delayed_pending")
        if pending is None:
            return None
        grads, lr_kwargs = pending
        if self.__dict__.get("_delayed_retry"):
            self._apply_lr()  # the scheduler has not moved since the update first started
            grad_tensors = grads.tensors if self._grads_in_engine else []
            self.native_optimizer.start_step_async(self.native, [-1] * len(self._tensor_of_partition), grad_tensors)
            self._delayed_retry = False
        try:
            report = self.native_optimizer.finish_step_async()
        except BaseException:
            grads.after_step(False)
            self._delayed_retry = True
            raise
        self._delayed_pending = None
        grads.after_step(True)
        if self._grads_in_engine:
            grads.clear()
            self._spare_grads = grads
        if not report["applied"]:
            self._after_report(report, lr_kwargs)
            return report
        # The update wrote the masters only (the params were in use meanwhile): derive them. If
        # that fails, the step still counts and the params are rewritten before the next forward.
        self._params_behind = True
        try:
            self._params_from_masters()
            self._params_behind = False
        finally:
            self._after_report(report, lr_kwargs)
        return report

    def _params_from_masters(self):
        """Writes every trainable parameter (one process: whole partitions) from its fp32 master,
        converted as the optimizer converts its outputs."""
        for slot in self._slots:
            if slot.pid is None:
                continue
            low = torch.empty(slot.shape, dtype=self.compute_dtype)
            self.native_optimizer.read_params(slot.pid, self.compute_dtype_name, low)
            self.native.write(slot.tid, low)

    def _settle(self):
        """The params and state as the steps so far leave them: no overlapped pass in flight, the
        delayed update (if any) done. Anything that reads them from outside the training loop
        calls this."""
        self._cancel_overlap()
        if self.native_optimizer is not None:
            self._join_delayed()

    def _after_report(self, report, lr_kwargs):
        """Books a finished optimizer step: counters, the schedulers, the next lr."""
        self._param_version += 1
        self.last_report = report
        if report["applied"] and self._zero is not None and self._zero.stage < 3:
            self._gather_updated_params()
        if report["applied"]:
            self.global_steps += 1
            self._step_applied = True
            if self.client_lr_scheduler is not None:
                with warnings.catch_warnings():
                    # torch warns when the scheduler steps before its optimizer did; here the
                    # engine's step is the optimizer's.
                    warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
                    self.client_lr_scheduler.step(**(lr_kwargs or {}))
            elif self.scheduler is not None:
                # DeepSpeed steps the scheduler after each applied step (not after a skipped one).
                self.scheduler.last_step = self.global_steps
            self._apply_lr()
        else:
            self.skipped_steps += 1

    def zero_grad(self, set_to_none=True):
        """Forgets every gradient taken since the last step: the micro-steps' sums held for the
        boundary and what the optimizer took already (``set_to_none`` is accepted and moot: the
        model's ``.grad`` are freed as soon as they are final)."""
        self._drain_grads()
        self._grads.clear()
        self._grads_in_window = False
        if self.__dict__.get("_failed_step") is not None or self.__dict__.get("_delayed_retry"):
            # After a failed step the whole accumulation window is dropped with its gradients: the
            # next gradient_accumulation_steps micro-steps make the step again.
            if self._boundary is None:
                self.micro_steps -= self.micro_steps % self._gas
            self._failed_step = None
        if self._reducer is not None:
            self._reducer.clear()
        if self.native_optimizer is not None:
            self.native_optimizer.cancel_overlap()
            # (A delayed update, running or failed and pending a retry, reads its own gradients.)
            if not self.native_optimizer.step_async_running and not self.__dict__.get("_delayed_retry"):
                self.native_optimizer.clear_grads()
        for slot in self._slots:
            slot.param.grad = None

    def _check_host_working_set(self):
        """A host budget that cannot hold what a step moves through host memory at once is refused
        now, with the numbers, not met as a TimedOut after tier.acquire_timeout_ms mid-step. Inside
        the budget: the optimizer's pinned buffers, then one chunk's gradients (fp32) and updated
        parameters (compute dtype) as the optimizer reads and delivers them, or the largest
        parameter's fp32 master and its update, whichever is more."""
        if self.native_optimizer is None:
            return
        budget = json.loads(self.native.stats_json())["tiers"]["host"]["budget_bytes"]
        st = self.native_optimizer.stats()
        esize = torch.empty(0, dtype=self.compute_dtype).element_size()
        elements = sum(s.zero_count for s in self._slots if s.trainable)  # (partitions come later)
        chunk = min(st["chunk_elements"], elements) * (4 + esize)
        largest = max((s.zero_count for s in self._slots if s.trainable), default=0) * (4 + esize)
        moving = max(chunk, largest)
        need = st["pinned_bytes"] + moving
        if need > budget:
            fmt = _tier.format_bytes
            raise _tier.ResourceExhausted(
                f"tier.budgets.host is {fmt(budget)} ({budget} bytes): the optimizer's pinned buffers take "
                f"{fmt(st['pinned_bytes'])} and a step moves up to {fmt(moving)} of gradients and updated parameters "
                f"through host memory at once (a chunk of {st['chunk_elements']} elements, or the largest parameter); "
                f"raise tier.budgets.host to at least {fmt(need)} ({need} bytes), or lower tier.optimizer.buffer_bytes"
            )

    def _require_optimizer(self, what):
        if self.native_optimizer is None:
            if self.native is None:
                raise RuntimeError(f"engine.{what}(): the engine has been destroyed")
            raise ValueError(f"engine.{what}(): {_NO_OPTIMIZER}")

    def _apply_lr(self):
        if self.native_optimizer is None:
            return
        view = self.__dict__.get("torch_optimizer")
        if self.scheduler is None:
            if view is None:
                return
            # The groups' lr (a client scheduler's, or the caller's own) is the next step's.
            for g, group in enumerate(view.param_groups[: self.native_optimizer.group_count]):
                self.native_optimizer.set_lr(g, float(group["lr"]))
            return
        lrs = self.scheduler.lrs(self.global_steps)
        betas = self.scheduler.betas(self.global_steps)
        for g in range(self.native_optimizer.group_count):
            lr = lrs[min(g, len(lrs) - 1)]
            if betas is None:
                self.native_optimizer.set_lr(g, lr)
            else:
                h = self._group_hparams[g]
                beta1, beta2 = betas[min(g, len(betas) - 1)]
                self.native_optimizer.set_group(g, lr, beta1, beta2, h["eps"], h["weight_decay"])
            if view is not None and g < len(view.param_groups):
                view.param_groups[g]["lr"] = lr
                if betas is not None:
                    view.param_groups[g]["betas"] = tuple(betas[min(g, len(betas) - 1)])

    def get_lr(self):
        if self.native_optimizer is None:
            return []
        return [self.native_optimizer.lr(g) for g in range(self.native_optimizer.group_count)]

    @property
    def loss_scale(self):
        return 1.0 if self.native_optimizer is None else self.native_optimizer.loss_scale

    # ------------------------------------------------------------------ state
    def stats(self):
        """The engine's snapshot (tiers, links, metrics) with the optimizer's figures."""
        s = json.loads(self.native.stats_json())
        if self.native_optimizer is not None:
            if self.native_optimizer.step_async_running:
                # A delayed update is running: the figures as it found them (it owns the optimizer).
                s["optimizer"] = dict(self.__dict__.get("_optimizer_stats") or {}, update_running=True)
            else:
                s["optimizer"] = self._optimizer_stats = self.native_optimizer.stats()
        z = self.__dict__.get("_zero")
        if z is not None:
            pf = self.__dict__.get("_prefetcher")
            s["zero"] = {
                "rank": z.rank,
                "world": z.world,
                "stage": z.stage,
                "reduce_scatter_bytes": z.bytes_reduced,
                "all_gather_bytes": z.bytes_gathered,
                "gather_prefetch_hits": pf.hits if pf else 0,
                "gather_prefetch_misses": pf.misses if pf else 0,
            }
        return s

    def timers(self):
        """Seconds spent so far in forward, backward and step (the optimizer), as a new dict."""
        return dict(self._timers)

    def parameter(self, name):
        """The current value of a parameter, as a CPU tensor of the compute dtype."""
        slot = next((s for s in self._slots if s.name == name), None)
        if slot is None:
            raise KeyError(f"no parameter named {name!r}")
        self._settle()
        if self._zero is not None and self._zero.stage == 3:
            # A collective: every rank asks for the same parameters in the same order.
            if slot.fetches > 0:
                return slot.param.data.detach().to("cpu", copy=True)
            shard = torch.empty(slot.zero_shard, dtype=self.compute_dtype)
            self.native.read(slot.tid, shard)
            full = _zero.gather_full(self._zero, [slot], lambda s: shard.to(self._zero.device))
            return full[id(slot)].view(slot.shape).to("cpu", copy=True)
        out = torch.empty(slot.shape, dtype=self.compute_dtype)
        self.native.read(slot.tid, out)
        return out

    def _gathered_master(self, slot):
        """Across ranks: the fp32 master of one trainable parameter, gathered (a collective)."""

        def master(s):
            m = torch.zeros(s.zero_shard, dtype=torch.float32)
            if s.pid is not None:
                self.native_optimizer.read_params(s.pid, "fp32", m[: s.zero_count])
            return m.to(self._zero.device)

        return _zero.gather_full(self._zero, [slot], master)[id(slot)].view(slot.shape).to("cpu", copy=True)

    def state_dict_fp32(self):
        """Every trainable parameter's fp32 master value, by name (CPU tensors)."""
        self._settle()
        out = {}
        if self._zero is not None:
            # Collectives: the masters' shards gathered from their owners.
            def master(s):
                m = torch.zeros(s.zero_shard, dtype=torch.float32)
                if s.pid is not None:
                    self.native_optimizer.read_params(s.pid, "fp32", m[: s.zero_count])
                return m.to(self._zero.device)

            trainable = [s for s in self._slots if s.trainable]
            for bucket in _zero.gather_buckets(self._zero, trainable):
                full = _zero.gather_full(self._zero, bucket, master)
                for s in bucket:
                    out[s.name] = full[id(s)].view(s.shape).to("cpu", copy=True)
            for s in self._slots:
                if not s.trainable:
                    out[s.name] = self.parameter(s.name).float()
            return {s.name: out[s.name] for s in self._slots}
        for slot in self._slots:
            if slot.pid is None:
                out[slot.name] = self.parameter(slot.name).float()
                continue
            t = torch.empty(slot.shape, dtype=torch.float32)
            self.native_optimizer.read_params(slot.pid, "fp32", t)
            out[slot.name] = t
        return out

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """Saves everything needed to resume as ``save_dir/<tag>`` (default ``global_step<N>``) and,
        with ``save_latest``, makes it ``latest``; a process killed meanwhile leaves the previous
        checkpoint loadable. ``client_state`` must be JSON-serializable. Returns the checkpoint's
        path. ``exclude_frozen_parameters=True`` is refused: a tier checkpoint is always complete."""
        from .checkpoint import save

        if self.native_optimizer is None:
            raise ValueError(
                "engine.save_checkpoint(): the engine runs inference only (no optimizer) and a tier checkpoint holds "
                "training state; write the weights with engine.save_pretrained(dir)"
            )
        if exclude_frozen_parameters:
            raise NotImplementedError(
                "save_checkpoint(exclude_frozen_parameters=True): tier checkpoints always hold the frozen "
                "parameters (load checks them against the model); drop the argument"
            )
        self._settle()
        if self._zero is not None:
            from .zero_checkpoint import save as save_ranks

            return save_ranks(self, save_dir, tag, client_state or {}, save_latest=save_latest)
        return save(self, save_dir, tag, client_state or {}, save_latest=save_latest)

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
        custom_load_fn=None,
    ):
        """Restores the checkpoint ``tag`` (default: the one ``load_dir/latest`` names), all or
        nothing: every file is checked against its manifest (``tier.DataLoss`` if damaged) and all
        metadata against the model (ValueError) before the engine changes. Returns the directory
        loaded and the client state.

        The keyword arguments are DeepSpeed's; tier restores module, optimizer and scheduler
        together, so only their defaults (what the Hugging Face Trainer passes) are accepted, and a
        partial load is refused with the reason."""
        from .checkpoint import load

        if self.native_optimizer is None:
            raise ValueError(
                "engine.load_checkpoint(): the engine runs inference only (no optimizer) and a tier checkpoint holds "
                "training state; load weights with tier.torch.from_pretrained(dir, config)"
            )
        partial = {
            "load_module_strict": (load_module_strict, True),
            "load_optimizer_states": (load_optimizer_states, True),
            "load_lr_scheduler_states": (load_lr_scheduler_states, True),
            "load_module_only": (load_module_only, False),
            "custom_load_fn": (custom_load_fn, None),
        }
        for key, (value, default) in partial.items():
            if value != default if default is not None else value is not None:
                raise NotImplementedError(
                    f"load_checkpoint({key}={value!r}): a tier checkpoint is restored whole (module, optimizer and "
                    f"scheduler state together, names checked strictly); leave {key} at {default!r}"
                )
        self._settle()
        from .zero_checkpoint import is_rank_checkpoint

        if self._zero is not None or is_rank_checkpoint(load_dir, tag):
            from .zero_checkpoint import load as load_ranks

            out = load_ranks(self, load_dir, tag)
        else:
            out = load(self, load_dir, tag)
        # The gradients taken so far belong to the params before the load; a refused load (which
        # applies nothing) keeps them.
        self.zero_grad()
        self._param_version += 1
        return out

    # ------------------------------------------------------------------ DeepSpeed's engine surface
    def gradient_accumulation_steps(self):
        """Micro-steps per step, from the config (the boundary set from outside may differ)."""
        return self._gas

    def gradient_clipping(self):
        """The global-norm clipping threshold (0: none)."""
        return self._clip

    def get_global_grad_norm(self):
        """The global L2 norm of the last boundary step's gradient, before clipping (inf or nan
        when it overflowed); None before the first step."""
        if self.last_report is None:
            return None
        return float(self.last_report["grad_norm"])

    def was_step_applied(self):
        """Whether the last ``step()`` updated the parameters (False off the boundary and when an
        fp16 overflow skipped the update)."""
        return self._step_applied

    def fp16_enabled(self):
        return self.compute_dtype_name == "fp16"

    def bfloat16_enabled(self):
        return self.compute_dtype_name == "bf16"

    def zero_optimization_stage(self):
        return int(self._resolved.get("zero_optimization", {}).get("stage", 0))

    def zero_optimization(self):
        return self.zero_optimization_stage() > 0

    def train_micro_batch_size_per_gpu(self):
        """The config's micro-batch size; from ``train_batch_size / (gradient_accumulation_steps x
        ranks)`` when only that is given; 1 when neither is."""
        micro = self._raw_config.get("train_micro_batch_size_per_gpu")
        if micro is not None:
            return int(micro)
        total = self._raw_config.get("train_batch_size")
        if total is not None:
            return max(1, int(total) // (self._gas * self._world()))
        return 1

    def train_batch_size(self):
        """Samples per step over all ranks: the config's ``train_batch_size``, else micro-batch
        size x gradient_accumulation_steps x ranks."""
        total = self._raw_config.get("train_batch_size")
        if total is not None:
            return int(total)
        return self.train_micro_batch_size_per_gpu() * self._gas * self._world()

    def _world(self):
        return 1 if self.__dict__.get("_zero") is None else self._zero.world

    def get_global_step(self):
        return self.global_steps

    def deepspeed_io(self, dataset, batch_size=None, shuffle=True, collate_fn=None, num_workers=0):
        """A DataLoader over ``dataset`` with the micro-batch size (what initialize returns)."""
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            shuffle=shuffle,
            collate_fn=collate_fn,
            num_workers=num_workers,
        )

    # ------------------------------------------------------------------ gathered weights
    def _install_state_dict_hooks(self, model):
        """``module.state_dict()`` (and so ``save_pretrained``) returns the engine's current values
        instead of the empty placeholders the parameters hold between forwards."""
        ref = weakref.ref(self)
        for mod in model.modules():
            if mod._parameters:
                self._hook_handles.append(
                    mod._register_state_dict_hook(
                        lambda m, sd, prefix, meta, r=ref: r()._fill_state_dict(m, sd, prefix)
                    )
                )

    def _gathered(self, slot, memo):
        t = memo.get(slot.name)
        if t is None:
            t = self.parameter(slot.name)
            memo[slot.name] = t
        return t

    def _fill_state_dict(self, module, state_dict, prefix):
        if self.__dict__.get("native") is None:
            return
        self._settle()
        key = (id(state_dict), self._param_version)
        memo_key, memo = self.__dict__.get("_gather_memo", (None, None))
        if memo_key != key:
            memo = {}
            self._gather_memo = (key, memo)
        for name, p in module._parameters.items():
            slot = self._slot_of.get(id(p)) if p is not None else None
            full = prefix + name
            if slot is None or full not in state_dict or p.numel() == slot.numel:
                continue  # not ours, not saved, or fetched right now (the view is current)
            t = self._gathered(slot, memo)
            state_dict[full] = t.requires_grad_(p.requires_grad) if state_dict[full].requires_grad else t

    def module_state_dict(self, exclude_frozen_parameters=False):
        """The model's state dict with every parameter gathered from the engine (compute dtype, CPU).
        With ``exclude_frozen_parameters`` only the trainable parameters (and the buffers) are
        gathered: a LoRA adapter's state dict reads megabytes, not the frozen base."""
        if not exclude_frozen_parameters:
            return self.module.state_dict()
        sd = {}
        for name, p in self.module.named_parameters():
            if p.requires_grad:
                slot = self._slot_of.get(id(p))
                sd[name] = self.parameter(slot.name) if slot is not None else p.detach().cpu()
        for prefix, mod in self.module.named_modules():
            for name, b in mod._buffers.items():
                if b is not None and name not in mod._non_persistent_buffers_set:  # as state_dict()
                    sd[f"{prefix}.{name}" if prefix else name] = b.detach().cpu()
        return sd

    def save_pretrained(self, save_dir, *, max_shard_size="5GB", dtype=None, save_config=True):
        """Writes the current weights to ``save_dir`` as a transformers safetensors checkpoint
        (sharded, with its index and the model's ``config.json``), one tensor in host memory at a
        time; see :func:`tier.torch.hf.save_pretrained`. Returns the files written."""
        from . import hf

        return hf.save_pretrained(self, save_dir, max_shard_size=max_shard_size, dtype=dtype, save_config=save_config)

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
        """Writes the gathered weights (and persistent buffers) as ``save_dir/save_filename`` with
        ``torch.save``, in the compute dtype: bf16 or fp16 when enabled, else fp32 (as DeepSpeed
        saves what the model computes in). The file is written under a fresh temporary name
        (``O_EXCL|O_NOFOLLOW``: nothing planted in ``save_dir`` is written through) and renamed.
        Returns True."""
        from .. import fs as _fs
        from .atomic_file import atomic_write

        _fs.makedirs(save_dir, exist_ok=True)
        sd = {k: v.detach().cpu() for k, v in self.module_state_dict(exclude_frozen_parameters).items()}
        with atomic_write(os.path.join(save_dir, save_filename)) as f:
            torch.save(sd, f)
        return True

    def close(self):
        """Removes the hooks; the engine's files are removed when it is destroyed."""
        for h in self._hook_handles + self.__dict__.get("_excluded_grad_hooks", []):
            h.remove()
        self._hook_handles = []
        self._excluded_grad_hooks = []

    def destroy(self):
        """Ends the engine: removes the hooks and releases the native optimizer and engine (their
        swap files go with them). The model's parameters keep their empty placeholders; read what
        you need (``module_state_dict``, ``save_16bit_model``) before. Calling it twice is harmless."""
        if self.__dict__.get("native") is None:
            return
        self._drain_grads()
        if self.native_optimizer is not None:
            try:
                self._join_delayed()
            except Exception as e:  # noqa: BLE001 (the engine goes anyway; say what was lost)
                warnings.warn(f"engine.destroy(): the last delayed update failed and is dropped: {e}", stacklevel=2)
        self._end_finished_leases(wait=True)
        self.close()
        for mod, owned in self._module_slots.items():
            guard = _destroyed_guard([(s.param, s.numel) for s in owned])
            _DESTROYED_GUARDS[mod] = mod.register_forward_pre_hook(guard)
        self._grads.clear()
        self.__dict__.pop("_grad_staging_state", None)
        self._deferred.clear()
        self._saved_params.offload = None
        self._saved_params.clear()
        self._activations = None
        for slot in self._slots:
            slot.param.grad = None
            slot.param.data = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        if self.native_optimizer is not None:
            self.native_optimizer.close()
        self.native_optimizer = None
        self.native = None
        self.config = None  # a native object too: nothing of tier's may outlive the interpreter
        _LIVE_ENGINES.discard(self)
