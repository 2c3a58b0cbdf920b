"""Autograd's saved tensors that are streamed parameters, kept as references instead of memory.

Operators save what their backward needs: ``F.linear`` saves ``weight.t()``, a view of the
parameter's memory at forward time. tier ends a parameter's device lease after the module's forward
and brings it back before its backward, possibly at another address; a saved view would keep the
lease (and the device memory) alive from forward to backward, for every layer at once.

:class:`SavedParams` installs ``torch.autograd.graph.saved_tensors_hooks`` for the duration of a
training forward (entered by the outermost module call, on the calling thread only: nothing is
patched process-wide). Its pack hook recognises a saved tensor that lies in the memory of a
parameter the engine has in place and keeps ``(parameter, size, stride, offset)`` instead; its
unpack hook, during backward, returns the same view of the parameter's memory as it is then, when
the module's backward pre-hook has brought it back (or brings it itself, for a parameter used
outside the module that owns it). Every other saved tensor passes through untouched.

Activation checkpointing composes with this: inside a checkpointed region, torch's own hooks are
the innermost ones in forward (nothing is saved) and in the recompute, which runs the ordinary
operators again under the module hooks, so the engine fetches the region's parameters once more
(traced, hence prefetched like the rest) and the recomputed tensors hold them until their backward.

With an activation offload (:mod:`tier.torch.activations`) the checkpoints a checkpointed region
saves at its boundary go to engine tensors in host memory or on NVMe instead.

Thread safety: pack runs on the forward's thread, unpack on autograd's; both only read the map of
parameters in place, which the engine changes from hooks on those same threads.
"""

import torch

from . import activations as _activations


class _ParamRef:
    """What autograd keeps for a saved view of a streamed parameter."""

    __slots__ = ("slot", "size", "stride", "offset")

    def __init__(self, slot, size, stride, offset):
        self.slot = slot
        self.size = size
        self.stride = stride
        self.offset = offset


class SavedParams:
    """The map from device memory to the parameters in place there, and the hooks that use it.

    ``bring(slot)`` is called by unpack for a parameter whose memory is not in place: it must put
    the parameter's ``.data`` back and arrange for its release (the engine counts it as a backward
    fetch).
    """

    def __init__(self, bring, offload=None):
        self._bring = bring
        self._live = {}  # storage address -> [slots whose .data lies in that storage]
        self.references = 0  # saved tensors kept as references (observability, tests)
        # tier.torch.activations.ActivationOffload: checkpoints saved at a checkpointed region's
        # boundary go to engine tensors (host memory or NVMe) instead of staying on the device.
        self.offload = offload

    # -- the engine tells where parameters are -------------------------------------------------
    def placed(self, slot):
        key = _storage_key(slot.param.data)
        if key:
            self._live.setdefault(key, []).append(slot)

    def removed(self, slot):
        key = _storage_key(slot.param.data)
        slots = self._live.get(key)
        if slots is None:
            return
        try:
            slots.remove(slot)
        except ValueError:
            return
        if not slots:
            del self._live[key]

    def clear(self):
        self._live.clear()

    # -- the hooks -------------------------------------------------------------------------------
    def hooks(self):
        """A ``saved_tensors_hooks`` context (enter it for one forward, exit it after)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t):
        key = _storage_key(t) if self._live else 0
        slots = self._live.get(key) if key else None
        if slots:
            off = t.storage_offset()
            for slot in slots:
                data = slot.param.data
                base = data.storage_offset()
                if data.dtype == t.dtype and base <= off < base + data.numel():
                    self.references += 1
                    return _ParamRef(slot, tuple(t.size()), tuple(t.stride()), off - base)
        if self.offload is not None:
            handle = self.offload.pack(t)
            if handle is not None:
                return handle
        return t

    def _unpack(self, saved):
        if type(saved) is not _ParamRef:
            if self.offload is not None and type(saved) is _activations._Offloaded:
                return self.offload.unpack(saved)
            return saved
        slot = saved.slot
        if slot.fetches == 0:
            self._bring(slot)
        data = slot.param.data
        return data.as_strided(saved.size, saved.stride, data.storage_offset() + saved.offset)


class FetchOnUse(torch.overrides.TorchFunctionMode):
    """During a training forward: a streamed parameter handed to a torch function while it is not
    in place (a module using another module's weight, `F.linear(h, self.emb.weight)`, outside that
    module's forward) is brought for the call and released after it. What the call saves of it
    for backward is a reference (SavedParams), brought again then. ``used(slots, out)`` is told of
    each such call and its result, so that backward can bring a trainable one back before its
    gradient is accumulated (a call that saves nothing of it, `weight.squeeze(1)`, brings nothing
    at unpack)."""

    def __init__(self, slot_of, bring, drop, used=None):
        super().__init__()
        self._slot_of = slot_of  # id(Parameter) -> slot
        self._bring = bring
        self._drop = drop
        self._used = used
        self.brought = 0  # parameters brought this way (observability, tests)

    def _absent(self, obj, out):
        if type(obj) is torch.nn.Parameter:
            slot = self._slot_of.get(id(obj))
            if slot is not None and slot.fetches == 0:
                out.append(slot)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                if type(o) is torch.nn.Parameter:
                    self._absent(o, out)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in ("__get__", "__set__"):
            # A property (.data, .shape, .grad, ...): not a use of the values, and the engine's
            # own hooks set .data while this mode is active.
            return func(*args, **kwargs)
        absent = []
        for a in args:
            self._absent(a, absent)
        for a in kwargs.values():
            self._absent(a, absent)
        if not absent:
            return func(*args, **kwargs)
        absent = list({id(s): s for s in absent}.values())
        self._bring(absent)
        self.brought += len(absent)
        try:
            out = func(*args, **kwargs)
            if self._used is not None:
                self._used(absent, out)
            return out
        finally:
            for slot in absent:
                self._drop(slot)


def _storage_key(t):
    try:
        if t.numel() == 0:
            return 0
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # no storage (meta, sparse, subclasses)
        return 0
