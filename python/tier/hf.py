"""tier.hf: run the Hugging Face ``Trainer`` through tier's engine with a DeepSpeed-format config.

    trainer = tier.hf.TierTrainer(model=model, args=training_args, train_dataset=ds,
                                  tier_config="ds_zero3_nvme.json")
    trainer.train()

The config's ``"auto"`` values are filled from the ``TrainingArguments`` as the DeepSpeed
integration fills them (batch sizes, accumulation, clipping, the optimizer's and scheduler's
hyper-parameters, fp16/bf16, the bucket sizes from the model's hidden size); a value given
explicitly that contradicts the arguments is an error listing every such key, so the two never
disagree silently. The engine owns the model's parameters and the optimizer: the Trainer's
forward and backward go through it, its optimizer ``step()`` is the engine's step (clipping,
fp16 overflow check, the offloaded update), the Trainer's checkpoints hold a tier checkpoint
(``tier/``) beside the model weights and resume from it.
"""

import json
import math
import os

import torch
import transformers

from . import fs as _fs
from . import torch as tier_torch
from .torch.atomic_file import atomic_write

_AUTO = "auto"


def _read(config):
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            return json.load(f)
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    raise TypeError(f"tier_config must be a dict or a path to a JSON file, not {type(config).__name__}")


def fill_auto(config, args, num_training_steps, model=None):
    """Returns ``config`` (a dict, not changed) with its ``"auto"`` values taken from the
    ``TrainingArguments``; raises ValueError listing every explicit value that contradicts them
    and every ``"auto"`` left without a counterpart."""
    cfg = json.loads(json.dumps(config))
    mismatches = []

    def fill(path, value, arg_name):
        node = cfg
        for key in path[:-1]:
            if key not in node:
                return
            node = node[key]
        key = path[-1]
        if key not in node:
            return
        given = node[key]
        if given == _AUTO:
            node[key] = value
        elif arg_name is not None and not _same(given, value):
            mismatches.append(f"- {'.'.join(path)}={given!r} vs TrainingArguments.{arg_name}={value!r}")

    micro = args.per_device_train_batch_size
    gas = args.gradient_accumulation_steps
    world = max(1, int(getattr(args, "world_size", 1) or 1))
    fill(["train_micro_batch_size_per_gpu"], micro, "per_device_train_batch_size")
    fill(["gradient_accumulation_steps"], gas, "gradient_accumulation_steps")
    fill(["train_batch_size"], micro * gas * world, "train_batch_size (per_device_train_batch_size x accumulation x world)")
    fill(["gradient_clipping"], args.max_grad_norm, "max_grad_norm")
    for p, v, a in (
        (["optimizer", "params", "lr"], args.learning_rate, "learning_rate"),
        (["optimizer", "params", "betas"], [args.adam_beta1, args.adam_beta2], "adam_beta1/adam_beta2"),
        (["optimizer", "params", "eps"], args.adam_epsilon, "adam_epsilon"),
        (["optimizer", "params", "weight_decay"], args.weight_decay, "weight_decay"),
    ):
        fill(p, v, a)
    warmup = args.get_warmup_steps(num_training_steps)
    for p, v, a in (
        (["scheduler", "params", "warmup_min_lr"], 0, None),
        (["scheduler", "params", "warmup_max_lr"], args.learning_rate, "learning_rate"),
        (["scheduler", "params", "warmup_num_steps"], warmup, "warmup_steps"),
        (["scheduler", "params", "total_num_steps"], num_training_steps, "max_steps"),
    ):
        fill(p, v, a)
    fill(["fp16", "enabled"], bool(args.fp16), "fp16")
    fill(["bf16", "enabled"], bool(args.bf16), "bf16")
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if hidden:
        fill(["zero_optimization", "reduce_bucket_size"], hidden * hidden, None)
        fill(["zero_optimization", "stage3_prefetch_bucket_size"], int(0.9 * hidden * hidden), None)
        fill(["zero_optimization", "stage3_param_persistence_threshold"], 10 * hidden, None)
    left = sorted(_auto_paths(cfg))
    if mismatches or left:
        lines = []
        if mismatches:
            lines.append("the tier/DeepSpeed config and the TrainingArguments disagree; set these to \"auto\" or to the "
                         "arguments' values:")
            lines += mismatches
        if left:
            lines.append("these \"auto\" values have no TrainingArguments counterpart; give them a value: " + ", ".join(left))
        raise ValueError("\n".join(lines))
    return cfg


def _same(a, b):
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)), abs(float(b)))
    return a == b


def _auto_paths(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _auto_paths(v, f"{prefix}.{k}" if prefix else k)
    elif node == _AUTO:
        yield prefix


class _StepOptimizer(torch.optim.Optimizer):
    """What the Trainer holds as its optimizer: the engine's param groups (an LR scheduler writes
    ``lr`` there and the engine's next step uses it); ``step()`` runs the engine's step once per
    accumulation boundary, unless the Trainer already ran it to read the gradient norm."""

    def __init__(self, trainer, engine):
        view = engine.torch_optimizer
        super().__init__([{"params": [torch.zeros(0, requires_grad=True)]}], {})
        self.param_groups = view.param_groups
        self._trainer = trainer

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self._trainer._tier_step()
        return loss

    def zero_grad(self, set_to_none=True):
        self._trainer.tier_engine.zero_grad()

    def state_dict(self):
        return self._trainer.tier_engine.torch_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._trainer.tier_engine.torch_optimizer.load_state_dict(state_dict)


class _EngineScheduler:
    """The config's scheduler runs inside the engine; the Trainer gets this stand-in."""

    def __init__(self, engine):
        self._engine = engine

    def step(self, *args, **kwargs):
        pass

    def get_last_lr(self):
        lr = self._engine.get_lr()
        return list(lr) if isinstance(lr, (list, tuple)) else [lr]

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


class TierTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose model and optimizer run in tier's engine. ``tier_config``:
    a DeepSpeed-format config (dict or JSON path) with tier's ``"tier"`` section; ``"auto"``
    values come from ``args``. Do not pass ``optimizers``: the config's optimizer is the one that
    runs (as with DeepSpeed). The engine is ``trainer.tier_engine`` once training starts."""

    TIER_CHECKPOINT = "tier"

    def __init__(self, *args, tier_config=None, **kwargs):
        if tier_config is None:
            raise ValueError("TierTrainer needs tier_config (a DeepSpeed-format config with a \"tier\" section)")
        opts = kwargs.get("optimizers")
        if opts is not None and any(o is not None for o in opts):
            raise ValueError("TierTrainer runs the config's optimizer; drop optimizers=(...) and set \"optimizer\" there")
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled:
            raise ValueError("TierTrainer replaces DeepSpeed: drop --deepspeed / TrainingArguments.deepspeed")
        if self.args.save_only_model and self.args.load_best_model_at_end:
            # As the Trainer refuses it for DeepSpeed and FSDP: the best model is restored from the
            # engine's checkpoint, which save_only_model leaves out.
            raise ValueError(
                "TierTrainer can't be used with save_only_model=True along with load_best_model_at_end=True: "
                "the best model is restored from the tier checkpoint that save_only_model leaves out"
            )
        self._tier_config = _read(tier_config)
        self.tier_engine = None
        self._engine_scheduler = False
        self._stepped = False

    def _move_model_to_device(self, model, device):
        # A model built under tier.torch.init holds its parameters in the engine (meta tensors
        # here): the engine places them when training starts; moved whole, it would fail.
        from .torch import zero_init

        if any(zero_init.staged_store(p) is not None for p in model.parameters()):
            return
        super()._move_model_to_device(model, device)

    # ------------------------------------------------------------------ setup
    def _training_steps(self):
        if self.args.max_steps > 0:
            return self.args.max_steps
        per_epoch = max(len(self.get_train_dataloader()) // self.args.gradient_accumulation_steps, 1)
        return math.ceil(self.args.num_train_epochs * per_epoch)

    def _ensure_engine(self, num_training_steps=None):
        """Builds the engine over the model, with the config's "auto" values filled, once."""
        if self.tier_engine is not None:
            return
        steps = num_training_steps if num_training_steps is not None else self._training_steps()
        cfg = fill_auto(self._tier_config, self.args, steps, self.model)
        self.tier_config_resolved = cfg
        if "optimizer" not in cfg:
            # Without one, initialize builds an inference-only engine; the Trainer trains.
            raise ValueError(
                'TierTrainer: the config has no "optimizer" section; add {"optimizer": {"type": "AdamW", "params": '
                '{"lr": "auto", "weight_decay": "auto"}}} (the "auto" values come from TrainingArguments)'
            )
        engine, _, _, sched = tier_torch.initialize(self.model, cfg)
        # The Trainer decides where a step ends: every backward's gradient is summed until the
        # optimizer step at its accumulation boundary.
        engine.set_gradient_accumulation_boundary(False)
        self.tier_engine = engine
        self.optimizer = _StepOptimizer(self, engine)
        self._engine_scheduler = sched is not None

    def create_optimizer_and_scheduler(self, num_training_steps):
        self._ensure_engine(num_training_steps)
        self.create_scheduler(num_training_steps=num_training_steps, optimizer=self.optimizer)

    def create_optimizer(self, model=None):
        self._ensure_engine()
        return self.optimizer

    def create_scheduler(self, num_training_steps, optimizer=None):
        self._ensure_engine(num_training_steps)
        if self._engine_scheduler:
            # The config's "scheduler" runs inside the engine (as DeepSpeed's does).
            self.lr_scheduler = _EngineScheduler(self.tier_engine)
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer=self.optimizer)

    def _wrap_model(self, model, training=True, dataloader=None):
        # The engine is the training wrapper, as DeepSpeed's engine is: across ranks it reduces
        # the gradients itself (ZeRO), so the model must not also go into accelerate's
        # DistributedDataParallel, whose hooks would see the partitioned parameters' placeholders.
        if training and self.tier_engine is not None:
            return self.tier_engine
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    # ------------------------------------------------------------------ one micro-step
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        target = self.tier_engine if self.tier_engine is not None else model
        return super().compute_loss(target, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def training_step(self, model, inputs, num_items_in_batch=None):
        engine = self.tier_engine
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        if not scaled:
            loss = loss / getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        engine.backward(loss, scale_wrt_gas=False)  # the fp16 loss scale is the engine's
        self._stepped = False
        return loss.detach()

    def _tier_step(self):
        """The engine's step at an accumulation boundary, once."""
        if self._stepped:
            return
        engine = self.tier_engine
        engine.set_gradient_accumulation_boundary(True)
        try:
            engine.step()
        finally:
            engine.set_gradient_accumulation_boundary(False)
        self._stepped = True

    # The gradients are in the engine, not in p.grad: the norm (and the clipping) is its step's.
    def _clip_grad_norm(self, model):
        self._tier_step()
        return self.tier_engine.get_global_grad_norm()

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            self._tier_step()
            grad_norm = self.tier_engine.get_global_grad_norm()
        return float(grad_norm) if grad_norm is not None else None

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir):
        self.tier_engine.save_checkpoint(os.path.join(output_dir, self.TIER_CHECKPOINT), tag="state")
        # Every rank saves its part of the engine's state (a collective); the files of the Trainer's
        # own, the same on every rank, are written by the one that writes the Trainer's state.
        if not self.args.should_save:
            return
        if not isinstance(self.lr_scheduler, _EngineScheduler) and self.lr_scheduler is not None:
            with atomic_write(os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME)) as f:
                torch.save(self.lr_scheduler.state_dict(), f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, self.TIER_CHECKPOINT)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{checkpoint} has no tier checkpoint ({self.TIER_CHECKPOINT}/): not saved by TierTrainer")
        self.tier_engine.load_checkpoint(path, tag="state")
        sched = os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME)
        if not isinstance(self.lr_scheduler, _EngineScheduler) and os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))
            # A torch scheduler's state holds the lr it last set; the groups (which the engine's
            # next step reads) get it back as the optimizer's state_dict would have given it.
            for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
                group["lr"] = lr

    def _load_best_model(self):
        """``load_best_model_at_end``: the engine restores the best checkpoint's tier state (params,
        fp32 masters, moments, counters), as the DeepSpeed integration restores its engine's; the
        Trainer's own path would copy the weights into the model's parameters, which the engine
        holds (under ZeRO-3 they are empty placeholders)."""
        if self.tier_engine is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        path = os.path.join(best, self.TIER_CHECKPOINT)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"load_best_model_at_end: {best} has no tier checkpoint ({self.TIER_CHECKPOINT}/); TierTrainer "
                "saves one in every checkpoint unless save_only_model=True, which cannot be combined with "
                "load_best_model_at_end"
            )
        self.tier_engine.load_checkpoint(path, tag="state")

    def _save(self, output_dir=None, state_dict=None):
        # The model's weights, gathered from the engine tensor by tensor by its state-dict hooks.
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        _fs.makedirs(output_dir, exist_ok=True)
        if self.tier_engine is not None:
            self.tier_engine.save_pretrained(output_dir)  # across ranks a collective; rank 0 writes
        else:
            super()._save(output_dir, state_dict)
        if not self.args.should_save:
            return
        with atomic_write(os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME)) as f:
            torch.save(self.args, f)
