"""tier.torch.fast_random: random weight initialisation on every core, from tier's counter-based
generator instead of PyTorch's sequential one.

    with tier.torch.fast_random(seed=0):
        model = transformers.AutoModelForCausalLM.from_config(cfg)

Inside the context, ``Tensor.normal_`` and ``Tensor.uniform_`` on a contiguous CPU tensor of
float32, bfloat16 or float16 (and so ``torch.nn.init``'s ``normal_``, ``uniform_``,
``kaiming_*``, ``xavier_*``, ``trunc_normal_``, and every model's default and Hugging Face
initialisation built on them) draw from Philox4x32-10 (``tier/cpu_kernels.hpp``:
``fill_normal``, ``fill_uniform``) on all cores. PyTorch's CPU generator is sequential: a 7B model's
random init takes minutes on one core; here it is bound by memory.

What a draw gives depends on the seed, on which tensor it fills and on how many draws that tensor
has had, never on what else was drawn before it: a parameter is known by the order in which
modules registered parameters (its ordinal), any other tensor by the order of first draws. So a
model built in another order of draws (``tier.torch.init`` initialises each module as its
construction ends, Hugging Face at the end) gets the same values, provided its modules are
constructed in the same order. The values are not those of PyTorch's generator for the same seed;
they are statistically the same distributions (24 random bits per uniform, Box-Muller normals,
``|x - mean| < 5.8 std``).

Calls with an explicit ``generator``, on other devices, dtypes or non-contiguous views, and
``torch.randn``/``torch.rand``-style factories are left to PyTorch. Contexts do not nest.
"""

import threading

import torch
from torch.overrides import TorchFunctionMode

from .. import _tier

# A parameter's stream: its ordinal above the draw count; other tensors in their own half.
_DRAW_BITS = 20
_OTHER = 1 << 63
_FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# torch.nn.init functions whose only effect is one draw over the whole tensor (Tensor.normal_ or
# uniform_), which a deferred draw may stand for; by name, as transformers' guarded versions of
# them (transformers.initialization) stand in torch.nn.init while its models initialise.
_WHOLE_DRAWS = frozenset(
    ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_")
)
_INIT_MODULES = frozenset(("torch.nn.init", "transformers.initialization"))
# What reads a tensor's shape and kind, not its values.
_METADATA = frozenset(
    ("dim", "size", "numel", "stride", "is_contiguous", "element_size", "nelement", "ndimension", "storage_offset",
     "__len__", "is_floating_point", "is_complex", "__hash__", "data_ptr", "untyped_storage")
)
_GETTERS = frozenset(
    ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "layout", "ndim", "is_cpu", "is_cuda",
     "is_meta", "grad", "names", "is_sparse", "is_quantized", "is_nested", "data", "_base")
)


class _Entry:
    """A parameter's key, its draws so far and, when deferred, the draw its values are."""

    __slots__ = ("key", "draws", "pending", "owner", "ptr")

    def __init__(self, key, param):
        # The parameter itself, held until the context ends or it is forgotten (a weak reference
        # would stop torch.utils.swap_tensors, which tier.torch.init uses on it).
        self.key, self.draws, self.pending, self.owner = key, 0, None, param
        self.ptr = _ptr(param)


def _ptr(tensor):
    return tensor.untyped_storage().data_ptr() if tensor.device.type == "cpu" else 0


def _whole(tensor, of):
    return tensor.storage_offset() == 0 and tensor.numel() == of.numel() and tensor.is_contiguous()


class fast_random:
    """Context manager: see the module's documentation. ``seed`` defaults to
    ``torch.initial_seed()`` (what ``torch.manual_seed`` set). ``defer`` (tier.torch.init's):
    a whole-tensor draw into a parameter is only recorded (``pending``) until its values are
    needed, by an operation on it or by ``take_pending``, so that a constructor's draw that the
    model's initialisation then replaces is never made, and the last one is made straight into the
    engine's memory."""

    _active = threading.local()

    def __init__(self, seed=None, *, defer=False):
        self.seed = (torch.initial_seed() if seed is None else int(seed)) & ((1 << 64) - 1)
        self.defer = defer
        self._params = 0
        self._others = 0
        self._entries = []
        self._by_ptr = {}  # storage address -> _Entry of the parameter holding it
        self._pending = {}  # id(entry) -> entry, for the deferred draws not made yet
        self._nested = 0  # inside a torch function other than a whole-tensor draw: nothing deferred
        self._saved = []
        self._mode = None
        self.draws = 0  # fills made by tier's generator (for tests and summaries)
        self.deferred = 0  # draws recorded and then replaced or made elsewhere

    # ------------------------------------------------------------------ keys

    def _entry(self, param):
        entry = param.__dict__.get("_tier_random_entry")
        if entry is None:
            entry = _Entry(self._params, param)
            self._params += 1
            self._entries.append(entry)
            param._tier_random_entry = entry
            if entry.ptr:
                self._by_ptr[entry.ptr] = entry
        return entry

    def _entry_of(self, tensor):
        """The entry of the parameter `tensor` is, or whose whole storage it views (``.data``)."""
        entry = tensor.__dict__.get("_tier_random_entry")
        if entry is not None or tensor.device.type != "cpu":
            return entry
        entry = self._by_ptr.get(_ptr(tensor))
        if entry is None:
            return None
        owner = entry.owner
        if owner is None or _ptr(owner) != entry.ptr:  # forgotten or moved, its address reused
            del self._by_ptr[entry.ptr]
            return None
        return entry

    def forget(self, param):
        """``param``'s storage is given up (tier.torch.init staged it): its address may be reused."""
        entry = param.__dict__.get("_tier_random_entry")
        if entry is not None:
            if self._by_ptr.get(entry.ptr) is entry:
                del self._by_ptr[entry.ptr]
            entry.owner = None

    def snapshot(self, params):
        """The draw counts and deferred draws of ``params``, for rollback()."""
        entries = (p.__dict__.get("_tier_random_entry") for p in params)
        return [(e, e.draws, e.pending) for e in entries if e is not None]

    def rollback(self, snapshot):
        """Puts back what snapshot() saw: draws made since then count as not made (a deferred
        one is dropped; one made into memory is not undone, the next draw overwrites it)."""
        for entry, draws, pending in snapshot:
            entry.draws, entry.pending = draws, pending
            if pending is None:
                self._pending.pop(id(entry), None)
            else:
                self._pending[id(entry)] = entry

    def _stream(self, tensor, entry):
        if entry is None:
            key = tensor.__dict__.get("_tier_random_key")
            if key is None:
                key, self._others = self._others, self._others + 1
                tensor._tier_random_key = key
            n = tensor.__dict__.get("_tier_random_draws", 0)
            tensor._tier_random_draws = n + 1
            return _OTHER | (key << _DRAW_BITS) | (n & ((1 << _DRAW_BITS) - 1))
        n = entry.draws
        entry.draws += 1
        return (entry.key << _DRAW_BITS) | (n & ((1 << _DRAW_BITS) - 1))

    # ------------------------------------------------------------------ draws

    def _takes(self, tensor, generator):
        return (
            generator is None
            and tensor.device.type == "cpu"
            and tensor.dtype in _FAST_DTYPES
            and tensor.is_contiguous()
            and not (torch.is_grad_enabled() and tensor.requires_grad)
        )

    def _draw(self, tensor, kind, a, b):
        entry = self._entry_of(tensor)
        owner = entry.owner if entry is not None else None
        if entry is not None and entry.pending is not None and not (owner is not None and _whole(tensor, owner)):
            self._make(entry)  # a draw into part of a deferred parameter: its values first
        stream = self._stream(tensor, entry)
        if self.defer and self._nested == 0 and owner is not None and _whole(tensor, owner):
            if entry.pending is not None:
                self.deferred += 1
            entry.pending = (kind, float(a), float(b), stream)
            self._pending[id(entry)] = entry
            return tensor
        if entry is not None and entry.pending is not None:  # replaced whole: never made
            self.deferred += 1
            self._pending.pop(id(entry), None)
            entry.pending = None
        _tier.fill_random(tensor.detach(), kind, float(a), float(b), self.seed, stream)
        self.draws += 1
        return tensor

    def _make(self, entry):
        kind, a, b, stream = entry.pending
        entry.pending = None
        self._pending.pop(id(entry), None)
        owner = entry.owner
        if owner is not None and owner.device.type == "cpu":
            _tier.fill_random(owner.detach(), kind, a, b, self.seed, stream)
            self.draws += 1

    def take_pending(self, param):
        """The deferred draw ``param``'s values are, as ``fill(array)`` writing them into a
        uint8 numpy array of its bytes; None when its values are in its memory."""
        entry = param.__dict__.get("_tier_random_entry")
        if entry is None or entry.pending is None:
            return None
        kind, a, b, stream = entry.pending
        entry.pending = None
        self._pending.pop(id(entry), None)
        dtype, seed = param.dtype, self.seed

        def fill(array):
            _tier.fill_random(torch.from_numpy(array).view(dtype), kind, a, b, seed, stream)

        self.draws += 1
        return fill

    def _settle(self, args, kwargs):
        """Makes the deferred draws of any parameter among the arguments (or viewed by one)."""
        for t in _tensors(args, kwargs):
            entry = self._entry_of(t)
            if entry is not None and entry.pending is not None:
                self._make(entry)

    # ------------------------------------------------------------------ context

    def __enter__(self):
        if getattr(fast_random._active, "on", False):
            raise RuntimeError("tier.torch.fast_random: contexts do not nest")
        fast_random._active.on = True
        ctx = self
        base_normal = torch.Tensor.normal_
        base_uniform = torch.Tensor.uniform_
        base_register = torch.nn.Module.register_parameter

        def normal_(tensor, mean=0.0, std=1.0, *, generator=None):
            if not ctx._takes(tensor, generator) or not tensor.numel():
                return base_normal(tensor, mean, std, generator=generator)
            return ctx._draw(tensor, "normal", mean, std)

        def uniform_(tensor, *args, generator=None, **kwargs):
            low, high = _uniform_range(args, kwargs)
            if not ctx._takes(tensor, generator) or not tensor.numel():
                return base_uniform(tensor, low, high, generator=generator)
            return ctx._draw(tensor, "uniform", low, high)

        def register_parameter(module, name, param):
            base_register(module, name, param)
            if param is not None:
                ctx._entry(param)

        self._saved = [
            (torch.Tensor, "normal_", torch.Tensor.__dict__.get("normal_")),
            (torch.Tensor, "uniform_", torch.Tensor.__dict__.get("uniform_")),
            (torch.nn.Module, "register_parameter", torch.nn.Module.__dict__["register_parameter"]),
        ]
        torch.Tensor.normal_ = normal_
        torch.Tensor.uniform_ = uniform_
        torch.nn.Module.register_parameter = register_parameter
        if self.defer:
            self._mode = _SettleMode(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
                self._mode = None
            for entry in list(self._pending.values()):
                self._make(entry)  # a deferred draw nobody took: into the parameter's memory
        finally:
            for cls, name, original in reversed(self._saved):
                if original is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, original)
            self._saved = []
            self._by_ptr.clear()
            for entry in self._entries:
                entry.owner = None  # no parameter kept alive by its own entry
            self._entries = []
            fast_random._active.on = False
        return False


class _SettleMode(TorchFunctionMode):
    """With deferred draws: any torch operation other than a whole-tensor draw or a look at
    shapes makes the deferred draws of the parameters it is given first, and defers nothing
    inside it."""

    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ctx = self.ctx
        name = getattr(func, "__name__", "")
        if name in _WHOLE_DRAWS and getattr(func, "__module__", None) in _INIT_MODULES:
            return func(*args, **kwargs)
        if name in ("__get__", "__set__"):
            if name == "__get__" and getattr(func.__self__, "__name__", "") in _GETTERS:
                return func(*args, **kwargs)
        elif name in _METADATA:
            return func(*args, **kwargs)
        if ctx._pending:
            ctx._settle(args, kwargs)
        ctx._nested += 1
        try:
            return func(*args, **kwargs)
        finally:
            ctx._nested -= 1


def _tensors(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _uniform_range(args, kwargs):
    """uniform_'s (from, to): positional, or keywords ``from``/``to`` (PyTorch's names)."""
    low = args[0] if len(args) > 0 else kwargs.get("from", kwargs.get("a", 0.0))
    high = args[1] if len(args) > 1 else kwargs.get("to", kwargs.get("b", 1.0))
    return low, high
