"""Activation checkpoints offloaded to host memory or NVMe through the engine.

With activation checkpointing the device keeps, between forward and backward, only what each
checkpointed region needs to be recomputed: its inputs (the "checkpoints", one hidden-state
tensor per layer for a transformer). With ``tier.activations.offload`` (or DeepSpeed's
``activation_checkpointing.cpu_checkpointing``) those go into engine tensors of role
``activation`` homed in host memory or on NVMe as forward produces them, and come back to the
device when the recompute asks for them. The engine's access trace records those acquires in
backward order, so from the second step on the prefetcher brings each checkpoint back ahead of
its recompute, and the device holds about one layer's checkpoint at a time.

The checkpoints are recognised by where they are saved: torch.utils.checkpoint saves a region's
inputs (``save_for_backward``) just before the region runs, under the hooks that are active
outside it, i.e. tier's (:mod:`tier.torch.saved_params`). tier wraps the checkpoint function the
model calls (transformers' ``_gradient_checkpointing_func``; :func:`checkpoint` for a model of
one's own) so that the tensors saved while it sets up the region are the ones offloaded.

The engine tensors are a pool keyed by dtype and size, registered in the first step and reused:
an entry goes back to the pool when autograd lets go of what it saved (after its backward, or
when the graph is dropped), so the same layer gets the same tensor every step and the trace
holds.

Thread safety: pack runs on the forward's thread, unpack and the release of entries on
autograd's; the pool is guarded by a lock.
"""

import contextlib
import functools
import threading
import weakref

import torch

_DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_boundary = threading.local()


@contextlib.contextmanager
def boundary():
    """Tensors saved for backward while this is active (on this thread, outside any checkpointed
    region's own hooks) are checkpoints to offload."""
    _boundary.depth = getattr(_boundary, "depth", 0) + 1
    try:
        yield
    finally:
        _boundary.depth -= 1


def in_boundary():
    return getattr(_boundary, "depth", 0) > 0


def checkpoint(function, *args, use_reentrant=False, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` whose inputs tier may offload (as DeepSpeed's
    ``deepspeed.checkpointing.checkpoint``): for models of one's own under ``tier.torch``."""
    with boundary():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)


def _marking(fn):
    @functools.wraps(fn)
    def marked(*args, **kwargs):
        with boundary():
            return fn(*args, **kwargs)

    marked._tier_boundary = True
    return marked


def mark_model_checkpoints(model):
    """Wraps the checkpoint function of every transformers layer that checkpoints (after
    ``gradient_checkpointing_enable()``, whenever it was called) so that its inputs are known as
    checkpoints. Returns how many layers checkpoint."""
    layers = 0
    for mod in model.modules():
        if not getattr(mod, "gradient_checkpointing", False):
            continue
        fn = getattr(mod, "_gradient_checkpointing_func", None)
        if fn is None:
            continue
        layers += 1
        if not getattr(fn, "_tier_boundary", False):
            mod._gradient_checkpointing_func = _marking(fn)
    return layers


class _Offloaded:
    """What autograd keeps for an offloaded checkpoint."""

    __slots__ = ("tid", "shape", "dtype", "__weakref__")

    def __init__(self, tid, shape, dtype):
        self.tid = tid
        self.shape = shape
        self.dtype = dtype


class _Pool:
    """Free engine tensors by (dtype name, numel). Apart from ActivationOffload so that the
    finalizers of saved handles, which may outlive the engine, hold no engine."""

    def __init__(self):
        self.lock = threading.Lock()
        self.free = {}  # (dtype name, numel) -> [engine tensor ids]

    def give_back(self, key, tid):
        with self.lock:
            self.free.setdefault(key, []).append(tid)


def lease_stream(device):
    """The stream a device lease taken now must end after: on CUDA the current stream's
    ``cudaStream_t`` (an int), so a view's lease ends only once the kernels queued on it before the
    view was freed have run (``Lease.as_tensor(stream=...)``); None elsewhere (the CPU computes as
    it goes, the lease ends when the view is freed)."""
    if device is None or device.type != "cuda":
        return None
    return torch.cuda.current_stream(device).cuda_stream


class ActivationOffload:
    """The pool of engine tensors that hold offloaded checkpoints, and the pack/unpack of one."""

    def __init__(self, native, home, device=None):
        self._native = native
        self._device = device  # where the checkpoints come back (leases end in its stream order)
        self.home = home  # "host" or "nvme"
        self._pool = _Pool()
        self._registered = 0
        self.offloaded = 0  # checkpoints offloaded since the engine started
        self.offloaded_bytes = 0
        self.seen_in_step = 0  # checkpoints offloaded since the last begin_step()
        self.bytes_registered = 0  # what the pool's tensors hold at most (one step's checkpoints)

    def begin_step(self):
        self.seen_in_step = 0

    def _take(self, dtype_name, numel):
        key = (dtype_name, numel)
        with self._pool.lock:
            free = self._pool.free.get(key)
            if free:
                return free.pop()
            n = self._registered
            self._registered += 1
        tid = self._native.register(f"activation/{n}", dtype_name, numel, "activation", 0, self.home)
        self.bytes_registered += numel * _ELEMENT_BYTES[dtype_name]
        return tid

    def pack(self, t):
        """An _Offloaded for a checkpoint worth offloading, else None."""
        if not in_boundary() or t.dtype not in _DTYPE_NAME or t.numel() == 0 or t.is_sparse:
            return None
        name = _DTYPE_NAME[t.dtype]
        numel = t.numel()
        tid = self._take(name, numel)
        lease = self._native.acquire(tid, "host", "write")
        flat = torch.from_dlpack(lease.as_tensor())
        flat.copy_(t.detach().reshape(-1))  # device -> host; the lease ends with the view
        del flat, lease
        handle = _Offloaded(tid, tuple(t.shape), t.dtype)
        weakref.finalize(handle, self._pool.give_back, (name, numel), tid)
        self.offloaded += 1
        self.seen_in_step += 1
        self.offloaded_bytes += numel * t.element_size()
        return handle

    def unpack(self, handle):
        # Traced: recorded in backward order, so the prefetcher brings it back ahead of the
        # recompute from the second step on. The tensor owns the device lease. On CUDA it is
        # granted once its copy is queued, the current stream waiting for it (stream-ordered).
        stream = lease_stream(self._device)
        lease = self._native.acquire(handle.tid, "device", "read", stream=stream)
        return torch.from_dlpack(lease.as_tensor(list(handle.shape), stream=stream))

