"""Pytrees and arrays between JAX and tier's step driver.

The driver reads its inputs in place through DLPack (a CPU ``jax.Array`` is handed over as it is:
no copy) and writes the updated parameters into numpy arrays this module allocates; those become
the returned ``jax.Array`` s without a copy where XLA accepts the memory (a 64-byte aligned buffer
on the CPU), else with one. Arrays on another device (a GPU) are copied to the host first and
back after the step.
"""

import jax
import ml_dtypes
import numpy as np

from .. import _tier

# The dtypes tier keeps parameters in (the master is fp32 whatever the parameter's dtype).
PARAM_DTYPES = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float16): "float16",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
}

_ALIGN = 64  # what XLA's CPU client wants to alias host memory instead of copying it

_Tracer = getattr(getattr(jax, "core", None), "Tracer", ())


def invalid(message):
    """tier.InvalidArgument (a ValueError), as the native module raises for bad inputs."""
    return _tier.InvalidArgument(message)


def cpu_device():
    return jax.devices("cpu")[0]


def flatten(tree):
    """(names, leaves, treedef): each leaf's name is ``jax.tree_util.keystr`` of its path."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [jax.tree_util.keystr(path) for path, _ in with_path]
    return names, [leaf for _, leaf in with_path], treedef


def _listing(what, names, limit=6):
    shown = ", ".join(f"{what}{n}" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def flatten_like(tree, what, names, treedef, context):
    """The leaves of ``tree``, which must have the structure ``treedef`` (whose leaf names are
    ``names``); otherwise tier.InvalidArgument naming the leaves missing or unexpected."""
    their_names, leaves, their_def = flatten(tree)
    if their_def == treedef:
        return leaves
    theirs, ours = set(their_names), set(names)
    parts = []
    missing = [n for n in names if n not in theirs]
    extra = [n for n in their_names if n not in ours]
    if missing:
        parts.append("missing " + _listing(what, missing))
    if extra:
        parts.append("unexpected " + _listing(what, extra))
    if not parts:  # the same leaves under other containers (a tuple for a list, ...)
        parts.append(f"it is {their_def}, the params are {treedef}")
    raise invalid(f"{context}: {what} does not have the params' tree structure: " + "; ".join(parts))


def shape_dtype(leaf, label, context):
    """A leaf's (shape, numpy dtype); tier.InvalidArgument for a traced value or a non-array."""
    if isinstance(leaf, _Tracer):
        raise invalid(
            f"{context}: {label} is a traced value: the offloaded step runs on the host, outside "
            "jax.jit / jax.grad; call it on concrete arrays"
        )
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        leaf = np.asarray(leaf)
        shape, dtype = leaf.shape, leaf.dtype
    return tuple(int(d) for d in shape), np.dtype(dtype)


def host_input(leaf):
    """An object the driver reads in place (C-contiguous, CPU, with the leaf's dtype): a CPU
    jax.Array as it is (DLPack), anything else copied to the host first. Numpy cannot hand a
    bfloat16 array over by DLPack, so such arrays go through a CPU jax.Array."""
    if isinstance(leaf, jax.Array):
        devices = leaf.devices()
        if len(devices) == 1 and next(iter(devices)).platform == "cpu":
            leaf.block_until_ready()
            return leaf
        return jax.device_put(leaf, cpu_device()).block_until_ready()
    a = np.ascontiguousarray(np.asarray(leaf))
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return jax.device_put(a, cpu_device()).block_until_ready()
    return a


def fp32_flat(leaf):
    """A leaf's values as a flat, contiguous float32 numpy array (a copy unless already so)."""
    return np.ascontiguousarray(np.asarray(leaf, dtype=np.float32)).reshape(-1)


def output_buffer(shape, dtype):
    """A writable, 64-byte aligned numpy array of ``shape`` and ``dtype``: alignment lets XLA's
    CPU client take the memory over instead of copying it."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def driver_view(buf):
    """What the driver writes into: a bfloat16 buffer as its raw bits (uint16)."""
    return buf.view(np.uint16) if buf.dtype == np.dtype(ml_dtypes.bfloat16) else buf


def to_jax(buf, like):
    """``buf`` as a jax.Array placed as ``like`` is (its sharding when ``like`` is a jax.Array,
    else the CPU). The numpy buffer must not be written again: the array may share its memory."""
    target = like.sharding if isinstance(like, jax.Array) else cpu_device()
    return jax.device_put(buf, target)
