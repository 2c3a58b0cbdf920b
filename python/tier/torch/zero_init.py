"""tier.torch.init: build a model whose parameters go straight into tier's engine, so that the
model never exists whole in host memory (in the manner of DeepSpeed's ``zero.Init``).

    with tier.torch.init(config):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    engine, *_ = tier.torch.initialize(model, config)

Inside the context every ``torch.nn.Module`` subclass's ``__init__`` is wrapped: when a module's
construction ends, each of its parameters that is still a real tensor is copied into the engine
(homed where ``zero_optimization.offload_param.device`` says: NVMe or host) and replaced, in
place (the same ``Parameter`` object, so ties and references hold), by a meta tensor of the same
shape and dtype. At most one module's parameters exist in host memory at a time, plus what the
engine's host budget holds.

Construction runs exactly as it would outside the context, so the random numbers drawn are the
same: PyTorch's default initialisation runs in each module's constructor on real tensors, and
Hugging Face's weight initialisation (``PreTrainedModel._initialize_weights``, called from
``post_init``) is given each module's parameters back from the engine for the call and stores
them again afterwards (as ``transformers.integrations.deepspeed.initialize_weights_zero3`` does
for ZeRO-3). A model built under ``init`` therefore has the same weights as one built eagerly
with the same seed.

``initialize`` then adopts the staged parameters one at a time (each is read back, registered
as a parameter and in the optimizer, and its staging copy dropped) on the same engine; it must be
given the same config. Until then the model's parameters are meta tensors: do not run it.
Buffers (e.g. rotary frequencies) stay ordinary CPU tensors.
"""

import functools
import json
import threading

import torch
from torch.overrides import TorchFunctionMode

from .. import _tier
from . import fast_random as _fast_random
from . import zero as _zero

_DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_HOME = {"nvme": "nvme", "cpu": "host", "none": "host"}


def engine_config(cfg):
    """The config the native engine is created from: the training loop feeds the batches, so
    their "auto" sizes have nothing to resolve against and are dropped."""
    cfg = json.loads(json.dumps(cfg))
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
        if cfg.get(key) == "auto":
            del cfg[key]
    if _zero.default_group_active():
        import torch.distributed as dist

        # Ranks on one machine never share swap files: each takes <dir>/rank<N>.
        cfg = _zero.rank_paths(cfg, dist.get_rank())
    return cfg


def _engine_part(cfg):
    """What of a config decides how the native engine is built (for the same-config check)."""
    zero = cfg.get("zero_optimization", {}) or {}
    # tier.activations is the adapter's (how the model's forward runs), not the engine's.
    tier_section = {k: v for k, v in (cfg.get("tier") or {}).items() if k != "activations"} or None
    return json.dumps(
        {
            "tier": tier_section,
            "aio": cfg.get("aio"),
            "offload_param": zero.get("offload_param"),
            "offload_optimizer": zero.get("offload_optimizer"),
        },
        sort_keys=True,
    )


class StagedParameters:
    """The engine a model was built into and its staged parameters (``param -> tensor id``)."""

    def __init__(self, cfg):
        from .engine import _load_config

        self.raw_config = engine_config(_load_config(cfg))
        self.config = _tier.Config.from_json(json.dumps(self.raw_config))
        resolved = json.loads(self.config.to_json())
        zero = resolved.get("zero_optimization", {})
        self.home = _HOME[zero.get("offload_param", {}).get("device", "none")]
        self.native = _tier.Engine.create(self.config)
        self.count = 0
        self.staged_bytes = 0
        self.written_bytes = 0  # into the engine so far, a parameter initialized twice counted twice
        self.live = {}  # staged tensor id -> bytes, for those not yet taken

    def same_engine_config(self, cfg):
        return _engine_part(engine_config(cfg)) == _engine_part(self.raw_config)

    def stage(self, param, fill=None):
        """Copies ``param`` into the engine and turns it into a meta tensor of its shape. ``fill``
        (a deferred random draw, fast_random.take_pending): writes its values into the engine's
        memory instead, ``param``'s own never read."""
        dtype = _DTYPE_NAME.get(param.dtype)
        if dtype is None:
            raise TypeError(
                f"tier.torch.init: a parameter of dtype {param.dtype} cannot be staged; tier holds fp32, bf16 and "
                "fp16 parameters"
            )
        numel, nbytes = param.numel(), param.numel() * param.element_size()
        name = f"init/{self.count}"
        # Homed on NVMe, the write home overlaps the construction of the next module (init's exit
        # and initialize flush: durable, and a failed write reported).
        durable = self.home != "nvme"
        if fill is not None:
            tid = self.native.register(name, dtype, numel, "user", 0, self.home, fill=fill, durable=durable)
        else:
            data = param.detach()
            if data.device.type != "cpu":
                data = data.cpu()
            data = data.contiguous()
            tid = self.native.register(name, dtype, numel, "user", 0, self.home, data, durable=durable)
        self.count += 1
        self.live[tid] = nbytes
        self.staged_bytes += nbytes
        self.written_bytes += nbytes
        swap_data(param, torch.empty(param.shape, dtype=param.dtype, device="meta"))
        param._tier_staged = (self, tid)

    def materialize(self, param):
        """Gives a staged parameter its values back as a CPU tensor (until ``restage``)."""
        _, tid = param._tier_staged
        real = torch.empty(param.shape, dtype=param.dtype)
        self.native.read(tid, real)
        swap_data(param, real)

    def restage(self, param, changed=True):
        """Stores a materialized parameter's values (when ``changed``) and makes it meta again."""
        _, tid = param._tier_staged
        if changed:
            data = param.detach().contiguous()
            self.native.write(tid, data)
            self.written_bytes += data.numel() * data.element_size()
        swap_data(param, torch.empty(param.shape, dtype=param.dtype, device="meta"))

    def take(self, param):
        """The staged values of ``param`` as a CPU tensor, and drops the staging copy."""
        _, tid = param._tier_staged
        out = torch.empty(param.shape, dtype=param.dtype)
        self.native.read(tid, out)
        self.native.unregister(tid)
        self.staged_bytes -= self.live.pop(tid)
        del param._tier_staged
        return out


    def adopt(self, param, name, index):
        """The staging tensor of ``param`` becomes the engine's tensor of that parameter as it is
        (renamed ``name``, role param): no byte moves. Returns its id."""
        _, tid = param._tier_staged
        self.native.retag(tid, name, "param", index)
        self.staged_bytes -= self.live.pop(tid)
        del param._tier_staged
        return tid

    def drop_rest(self):
        """Drops the staging copies no parameter of the adopted model took (e.g. a weight replaced
        by a tied one after its module was built)."""
        for tid in sorted(self.live):
            self.native.unregister(tid)
            self.staged_bytes -= self.live[tid]
        self.live.clear()


def swap_data(param, tensor):
    """Gives ``param`` (the same object) the contents of ``tensor``, keeping its attributes
    (``torch.utils.swap_tensors`` swaps the objects' ``__dict__`` too)."""
    attrs = dict(param.__dict__)
    new = torch.nn.Parameter(tensor, param.requires_grad)
    torch.utils.swap_tensors(param, new)
    param.__dict__.clear()
    param.__dict__.update(attrs)


def staged_store(param):
    staged = getattr(param, "_tier_staged", None)
    return staged[0] if staged is not None else None


def _is_hf_model(module):
    hf = _hf_pretrained_model()
    return hf is not None and isinstance(module, hf)


def _hf_pretrained_model():
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return PreTrainedModel


def _params_init_may_touch(module):
    """A module's own parameters and its direct children's (those of a child that is a model of
    its own excepted), once each: what Hugging Face's _init_weights of the module may write."""
    hf = _hf_pretrained_model()
    params = list(module.parameters(recurse=False))
    for child in module.children():
        if hf is None or not isinstance(child, hf):
            params.extend(child.parameters(recurse=False))
    out, seen = [], set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


# In-place methods that change a tensor's flags, not its values.
_FLAG_METHODS = frozenset(("requires_grad_", "retain_grad", "share_memory_"))


def _writes(func, kwargs):
    """Whether ``func`` writes a tensor's values: an in-place method (flag methods excepted),
    item assignment or ``out=``."""
    name = getattr(func, "__name__", "")
    if name in _FLAG_METHODS:
        return False
    return (name.endswith("_") and not name.startswith("__")) or name == "__setitem__" or (
        kwargs.get("out") is not None
    )


class _StagedWrites(TorchFunctionMode):
    """Inside init: an in-place operation on a staged parameter after its module was built (PEFT
    zeroing a LoRA B matrix, a user's own init) is run on its values, read back from the engine,
    and stored again, instead of doing nothing to a meta tensor. A write into part of one (a view
    made while it is staged) cannot reach it and is refused."""

    def __init__(self, store):
        super().__init__()
        self.store = store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _writes(func, kwargs):
            return func(*args, **kwargs)
        staged, seen = [], set()
        for t in _fast_random._tensors(args, kwargs):
            if staged_store(t) is self.store and t.device.type == "meta" and id(t) not in seen:
                seen.add(id(t))
                staged.append(t)
            elif t.device.type == "meta" and t._base is not None and staged_store(t._base) is self.store:
                raise RuntimeError(
                    f"tier.torch.init: {getattr(func, '__name__', func)} writes into part of a parameter already "
                    "staged in the engine (a view of it); write the whole parameter, or make the change "
                    "inside the module's constructor or its transformers _init_weights"
                )
        if not staged:
            return func(*args, **kwargs)
        for p in staged:
            self.store.materialize(p)
        try:
            return func(*args, **kwargs)
        finally:
            for p in staged:
                self.store.restage(p)


class _Touched(Exception):
    pass


class _InPlaceProbe(TorchFunctionMode):
    """Raises _Touched at the first operation that writes a tensor (an in-place method, a
    setter, ``out=``), before it runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _writes(func, kwargs) or name in _FLAG_METHODS or name == "__set__":
            raise _Touched(name)
        return func(*args, **kwargs)


def _all_module_classes():
    seen, stack = set(), [torch.nn.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
    seen.add(torch.nn.Module)
    return seen


class init:
    """Context manager: modules built inside it put their parameters into tier's engine as their
    construction ends (see the module's documentation). ``config`` is the config that
    ``initialize`` will be given. ``enabled=False`` makes it a no-op (as DeepSpeed's)."""

    _active = threading.local()

    def __init__(self, config=None, *, enabled=True, fast_random=False, seed=None):
        self.enabled = enabled
        self.store = StagedParameters(config) if enabled else None
        self._patched = []
        self._depth = {}
        self._models = []  # the Hugging Face models under construction, outermost first
        self.fast_random = _fast_random.fast_random(seed, defer=True) if enabled and fast_random else None

    def _stage_module(self, module):
        for p in module._parameters.values():
            if p is None or p.device.type == "meta" or p.numel() == 0 or staged_store(p) is not None:
                continue
            if self.fast_random is None:
                self.store.stage(p)
                continue
            self.store.stage(p, self.fast_random.take_pending(p))
            self.fast_random.forget(p)

    def _wrap_init(self, cls):
        original = cls.__dict__["__init__"]
        ctx = self

        @functools.wraps(original)
        def wrapped(module, *args, **kwargs):
            key = id(module)
            ctx._depth[key] = ctx._depth.get(key, 0) + 1
            hf_model = ctx._depth[key] == 1 and _is_hf_model(module)
            if hf_model:
                ctx._models.append(module)
            try:
                original(module, *args, **kwargs)
            finally:
                ctx._depth[key] -= 1
                if ctx._depth[key] == 0:
                    del ctx._depth[key]
                if hf_model:
                    ctx._models.pop()
            if key not in ctx._depth:
                if ctx.fast_random is not None:
                    ctx._initialize_now(module)
                ctx._stage_module(module)

        wrapped._tier_original = original
        cls.__init__ = wrapped
        self._patched.append((cls, "__init__", original))

    def _initialize_now(self, module):
        """With fast_random: gives a module built inside a Hugging Face model its weight
        initialisation as its construction ends, while its parameters are still in memory, so
        each is written to the engine once (post_init then finds it done). Draws depend on the
        tensor and its draw count only (fast_random), so the values are those post_init would
        give. A model without the attributes its _init_weights needs yet is left to post_init."""
        if _is_hf_model(module) or getattr(module, "_is_hf_initialized", False):
            return
        model = next((m for m in reversed(self._models) if "config" in m.__dict__), None)
        if model is None:
            return
        from transformers import initialization as hf_init

        before = self.fast_random.snapshot(_params_init_may_touch(module))
        custom = model.is_custom_code() if hasattr(model, "is_custom_code") else False
        try:
            with torch.no_grad(), hf_init.guard_torch_init_functions():
                model._initialize_weights(module, custom)
        except (AttributeError, KeyError, TypeError):
            # Left to post_init as it would be without this context: the draws not counted.
            self.fast_random.rollback(before)
            module.__dict__.pop("_is_hf_initialized", None)

    def __enter__(self):
        if not self.enabled:
            return self
        if getattr(init._active, "on", False):
            raise RuntimeError("tier.torch.init: contexts do not nest")
        init._active.on = True
        if self.fast_random is not None:
            self.fast_random.__enter__()
        self._writes_mode = _StagedWrites(self.store)
        self._writes_mode.__enter__()
        for cls in _all_module_classes():
            if "__init__" in cls.__dict__:
                self._wrap_init(cls)
        ctx = self
        previous_subclass_hook = torch.nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls, **kwargs):
            if previous_subclass_hook is not None:
                previous_subclass_hook.__func__(cls, **kwargs)
            else:
                super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            if "__init__" in cls.__dict__:
                ctx._wrap_init(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._patched.append((torch.nn.Module, "__init_subclass__", previous_subclass_hook))
        self._patch_hf_init()
        return self

    def _patch_hf_init(self):
        try:
            from transformers import PreTrainedModel
        except ImportError:
            return
        original = PreTrainedModel.__dict__.get("_initialize_weights")
        if original is None:
            return
        store = self.store

        @functools.wraps(original)
        def initialize_weights(model, module, *args, **kwargs):
            if getattr(module, "_is_hf_initialized", False):
                return original(model, module, *args, **kwargs)  # returns at once: nothing to bring
            # As initialize_weights_zero3: _init_weights may touch the direct children's parameters.
            params = [p for p in _params_init_may_touch(module) if staged_store(p) is store]
            if params:
                # First with the staged parameters as they are (meta tensors): most modules' init
                # (a decoder layer's, an attention block's) writes none of them, and then nothing
                # is read back. The probe stops the call at its first in-place write, before it
                # runs (no random draw is made twice), and the call is made again on real values.
                try:
                    with _InPlaceProbe():
                        return original(model, module, *args, **kwargs)
                except Exception:  # noqa: BLE001 - any failure on meta tensors: run it on real ones
                    pass
            staged, seen = [], set()
            for p in params:
                if id(p) not in seen:
                    seen.add(id(p))
                    store.materialize(p)
                    staged.append((p, p.detach().clone()))
            try:
                return original(model, module, *args, **kwargs)
            finally:
                # A parent's visit brings its children's parameters again (post-order: they were
                # initialized already) and mostly leaves them as they are: only a parameter whose
                # values changed is written back (a 7B model is not rewritten once per level).
                for p, before in staged:
                    store.restage(p, changed=not torch.equal(p.detach(), before))

        PreTrainedModel._initialize_weights = initialize_weights
        self._patched.append((PreTrainedModel, "_initialize_weights", original))

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        try:
            if exc[0] is None and self.store.home == "nvme":
                # The staged writes home, durable (raises if one failed): a build that returns is
                # on the disk, and its time includes the writing.
                self.store.native.flush()
        finally:
            self._restore()
        return False

    def _restore(self):
        if getattr(self, "_writes_mode", None) is not None:
            self._writes_mode.__exit__(None, None, None)
            self._writes_mode = None
        for cls, name, original in reversed(self._patched):
            if original is None:
                try:
                    delattr(cls, name)
                except AttributeError:
                    pass
            else:
                setattr(cls, name, original)
        self._patched.clear()
        if self.fast_random is not None:
            self.fast_random.__exit__(None, None, None)
        init._active.on = False
