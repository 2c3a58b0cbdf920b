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

import json
import os
import warnings
import weakref

import torch

from .. import _tier
from .._config_input import read_config as _load_config
from . import footprint as _footprint
from .grads import EngineGrads as _EngineGrads
from .grads import MicroStepGrads as _MicroStepGrads
from . import zero as _zero
from . import zero_init as _zero_init
from . import schedulers as _schedulers
from ._engine_fetch import FetchMixin
from ._engine_setup import SetupMixin
from ._engine_state import _LIVE_ENGINES, StateMixin
from ._engine_step import _NO_OPTIMIZER, StepMixin

_TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HOME = {"nvme": "nvme", "cpu": "host", "none": "device"}


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
        "placeholder_version",
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
        # The parameter's version counter when it last became the empty placeholder: an in-place
        # edit of it while the engine holds the values changes the counter (and nothing else).
        self.placeholder_version = None
        # Across ranks (tier.torch.zero): the padded shard size and the elements this rank owns.
        self.zero_shard = self.numel
        self.zero_start = 0
        self.zero_count = self.numel


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


def _sync_generate(model):
    """Stage 3 across ranks: every forward gathers parameters from all ranks, so a rank whose
    sequences finish first must keep taking part until all have finished. transformers does that
    with ``generate(synced_gpus=True)``, which it turns on by itself for DeepSpeed's stage 3 and
    FSDP; here the model's ``generate`` gets it as its default (an explicit value still wins)."""
    gen = getattr(model, "generate", None)
    if gen is None or getattr(gen, "_tier_synced", False):
        return

    def generate(*args, **kwargs):
        if kwargs.get("synced_gpus") is None:
            kwargs["synced_gpus"] = True
        return gen(*args, **kwargs)

    generate._tier_synced = True
    generate.__doc__ = gen.__doc__
    model.generate = generate


def _refuse_resizing(model):
    """transformers' resize_token_embeddings after initialize would rebuild the embedding from the
    empty placeholder (and fail with "not enough values to unpack"), or, where it did not fail,
    leave the engine holding the old shapes: it is refused with the way that works."""

    def refused(*args, **kwargs):
        raise RuntimeError(
            "resize_token_embeddings after tier.torch.initialize: the engine holds the parameters at the shapes "
            "they were registered with; resize the model before initialize (add the tokens, resize, then "
            "initialize), and set new rows' values afterwards with engine.modify_parameters if need be"
        )

    for module in model.modules():
        if callable(getattr(type(module), "resize_token_embeddings", None)):
            module.resize_token_embeddings = refused


class TierEngine(FetchMixin, StepMixin, StateMixin, SetupMixin, torch.nn.Module):
    """The model with its parameters and optimizer state managed by tier. Call it like the model."""

    # accelerate's prepare() hands the engine back as it is, as it does a model it prepared
    # already: the engine places its tensors itself (setup moves the buffers to the compute
    # device), takes its dtype from the config, and reduces the gradients across ranks itself, so
    # it must not go into DistributedDataParallel. DDP's reducer would hold the gradient
    # accumulators of the parameters' placeholders, and backward would then fail with "TBackward0
    # returned an invalid gradient ... expected shape compatible with [0]".
    _is_accelerate_prepared = True

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
        if self._zero is not None and self._zero.stage == 3 and self._zero.world > 1:
            _sync_generate(model)
        _refuse_resizing(model)

        self.module = model
        self.global_steps = 0
        self.micro_steps = 0
        self._grads_since_step = False  # a gradient came in since the last step() (see _OptimizerView.step)
        self._grads_in_window = False  # a gradient came in since the last applied step or zero_grad()
        self._engine_backward = False  # engine.backward() is handing gradients over
        # "pending" after a failed boundary step, "withdrawn" once gradients moved on, "owed" when it
        # failed part-way with state_copies 1 (finished before anything else)
        self._failed_step = None
        self._delayed_retry = False  # overlap "delayed": the pending update failed and runs again
        self._params_behind = False  # an applied step could not deliver its params (see _repair_params)
        self.skipped_steps = 0
        self.last_report = None
        self._in_step = False
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

        self._engine_masters = False
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
            # The step driver (include/tier/step_driver.hpp): the step over the engine's tensors,
            # its buffers in the engine's host budget.
            # An fp32 model with its parameters and state on NVMe: each parameter's engine tensor
            # is its master (tier.optimizer.params_are_masters; docs/optimizer.md), not kept twice.
            self._engine_masters = _footprint.params_are_masters(resolved, self.compute_dtype_name)
            self.native_optimizer = _tier.StepDriver(
                opt_config,
                trainable_numel,
                max_params=sum(1 for s in self._slots if s.trainable and s.zero_count > 0),
                engine=self.native,
                # Tests only: TIER_FAULT_INJECTION=1 lets optimizer._inject_io_fault fail its I/O.
                fault_injection=os.environ.get("TIER_FAULT_INJECTION") == "1",
                engine_masters=self._engine_masters,
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
                if slot.trainable and slot.zero_count > 0 and self._engine_masters:
                    slot.pid = self._add_engine_param(slot, groups)
                elif slot.trainable and slot.zero_count > 0:
                    master = torch.empty(slot.numel, dtype=self.compute_dtype)
                    self.native.read(slot.tid, master)
                    group = groups.get(id(slot.param), 0)
                    slot.pid = self.native_optimizer.add_param(
                        slot.name, master.float(), group, dtype=self.compute_dtype_name
                    )
                    del master
                _zero_init.swap_data(slot.param, torch.empty(0, dtype=self.compute_dtype, device=self.device))
                slot.placeholder_version = slot.param._version
                continue
            data = self._initial_value(slot, store, initial_values)
            # A checkpoint's tensor not read yet (hf._StoredValue) is read into the engine, or taken.
            stored = not isinstance(data, torch.Tensor)
            read_into = getattr(data, "read_into", None) if stored else None
            if read_into is not None and data.dtype == self.compute_dtype and self._zero is None:
                # Read from the file straight into the engine's host copy (no copy in between);
                # homed on NVMe, its write home overlaps the next parameter's read.
                slot.tid = self.native.register(
                    slot.name, self.compute_dtype_name, slot.numel, "param", index, param_home,
                    fill=read_into, durable=param_home != "nvme",
                )
                owned = low = None
            else:
                if stored:
                    data = data.tensor()
                owned = data.reshape(-1)[slot.zero_start : slot.zero_start + slot.zero_count]
                if self._zero is not None and self._zero.stage == 3:
                    # The engine homes this rank's shard (padded); fetches all-gather the parameter.
                    if slot.zero_count == slot.zero_shard and owned.dtype == self.compute_dtype:
                        low = owned.contiguous()  # the whole shard, unpadded: no copy
                    else:
                        low = torch.empty(slot.zero_shard, dtype=self.compute_dtype)
                        low[: slot.zero_count] = owned
                        low[slot.zero_count :].zero_()
                    numel = slot.zero_shard
                else:
                    low = data.to(self.compute_dtype).contiguous()
                    numel = slot.numel
                # Homed on NVMe: the write home overlaps the next parameter's read and copy (made
                # durable by the flush below), instead of each registration waiting for its own.
                slot.tid = self.native.register(
                    slot.name, self.compute_dtype_name, numel, "param", index, param_home, low,
                    durable=param_home != "nvme",
                )
            if slot.trainable and slot.zero_count > 0 and self._engine_masters:
                slot.pid = self._add_engine_param(slot, groups)
            elif slot.trainable and slot.zero_count > 0:
                if owned is None:  # read into the engine: the master from the engine's copy
                    owned = torch.empty(slot.numel, dtype=self.compute_dtype)
                    self.native.read(slot.tid, owned)
                master = owned.float().contiguous()
                group = groups.get(id(slot.param), 0)
                slot.pid = self.native_optimizer.add_param(slot.name, master, group, dtype=self.compute_dtype_name)
            placeholder = torch.empty(0, dtype=self.compute_dtype, device=self.device)
            if slot.param.device.type == "meta":
                _zero_init.swap_data(slot.param, placeholder)
            else:
                slot.param.data = placeholder
            slot.placeholder_version = slot.param._version
            del data, low, owned
        if store is not None:
            store.drop_rest()
        if param_home == "nvme":
            self.native.flush()  # the registrations' writes home, durable (raises if one failed)
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
            # Bytes matched to dtypes: a model trained in bf16/fp16 with one micro-step per step
            # (nothing to sum across micro-steps) keeps its gradients as backward makes them, in
            # one process (across ranks the reduced shards are summed in fp32).
            self._grad_dtype = (
                self.compute_dtype_name
                if self.compute_dtype_name != "fp32" and self._gas == 1 and self._zero is None
                else "fp32"
            )
            if self._grads_in_engine:
                self._grads = _EngineGrads(self, self.native_optimizer.param_count)
                for slot in self._slots:
                    if slot.pid is not None:
                        self._grads.register(
                            self.native, slot.pid, slot.name, slot.zero_count, "nvme", self._grad_dtype
                        )
            else:
                self._grads = _MicroStepGrads(self)
            # tier.optimizer.overlap: "exact" (default) runs the step's update during the boundary
            # micro-step's backward (NVMe-resident state; see docs/optimizer.md), "serial" after it.
            overlap = resolved["tier"]["optimizer"]["overlap"]
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
            self._tensor_of_partition = [-1] * self.native_optimizer.param_count
            # Where each partition's updated params go in its tensor: a rank's shard of a whole
            # parameter (stages 1 and 2) sits at its offset; a stage-3 shard is its own tensor.
            self._partition_offsets = [0] * self.native_optimizer.param_count
            for slot in self._slots:
                if slot.pid is not None:
                    self._tensor_of_partition[slot.pid] = slot.tid
                    if self._zero is not None and self._zero.stage < 3:
                        self._partition_offsets[slot.pid] = slot.zero_start
            self._comm = self._zero.comm if self._zero is not None else None
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
                    budget = zero["stage3_prefetch_bucket_size"]
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


