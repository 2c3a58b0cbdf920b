"""TierEngine's construction helpers: activation offload, the ZeRO group, initial values,
parameter groups, the optimizer view and the client scheduler (mixed into TierEngine, engine.py)."""

import json

import torch

from . import activations as _activations
from . import zero as _zero
from . import zero_init as _zero_init
from ._optimizer_view import _OptimizerView


class SetupMixin:
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
        self._activations = _activations.ActivationOffload(self.native, home, self.device)
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
        bucket = zero["reduce_bucket_size"]  # (the resolved config's: its default is the C++ schema's)
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

    def _add_engine_param(self, slot, groups):
        """Registers a trainable fp32 parameter whose engine tensor is its master (engine masters):
        this rank's elements of it, which are its slice of the whole tensor (stages 1 and 2: they
        are all-gathered from there after each step) or the front of its shard's (stage 3)."""
        whole = self._zero is None or self._zero.stage < 3
        offset = slot.zero_start if whole else 0
        return self.native_optimizer.add_engine_param(
            slot.name, [slot.zero_count], slot.tid, groups.get(id(slot.param), 0), offset
        )

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
