"""Hugging Face checkpoints in and out of tier, one tensor at a time.

``from_pretrained(path, config)`` builds the model described by ``path/config.json`` with its
parameters as meta tensors (nothing allocated, no random initialisation) and hands them to a
:class:`~tier.torch.engine.TierEngine` whose registration reads each parameter from the
checkpoint's safetensors files (plain reads into two reused buffers, the next tensor read ahead
while this one is registered) just before registering it: host memory holds two tensors of the
checkpoint at a time, never the model.

``save_pretrained(engine, save_dir)`` (also ``TierEngine.save_pretrained``) writes the trained
weights as a safetensors checkpoint that ``transformers`` loads unchanged: shards of at most
``max_shard_size`` bytes, each written tensor by tensor as it is read from the engine, with
``model.safetensors.index.json`` when there is more than one shard, and the model's
``config.json`` (and ``generation_config.json``). Files appear under their final names only when
complete: each is written under a fresh, unpredictable temporary name created
``O_EXCL|O_NOFOLLOW`` (or in a private folder inside ``save_dir``), fsynced and renamed, so a file
or symlink planted under a predictable name is never written through
(:mod:`tier.torch.atomic_file`).

Reading refuses what does not belong to the model folder or the model: an index entry that is an
absolute path or climbs out with ``..``, and a tensor whose kind (floating point, integer, bool)
differs from the model's parameter or buffer (an integer tensor is not silently made a float).
"""

import contextlib
import json
import os
import re
import struct

import torch

from .. import fs as _fs
from .atomic_file import atomic_write, private_dir, publish, write_bytes

_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_NAMED_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def parse_size(size):
    """``max_shard_size`` as bytes: an int, or a string such as "5GB", "500MB", "2GiB"."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size {size!r} is not a size such as 5GB, 500MB or 2GiB")
    unit = m.group(2).upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(float(m.group(1)) * base**power)


# ------------------------------------------------------------------------------------ reading
def _check_shard_name(index, key, filename):
    """An index entry must name a file inside the model folder: a relative path without ``..``.
    (The file itself may be a symlink, as in the Hugging Face hub's cache, whose snapshot folders
    link each file to a blob outside them.)"""
    ok = isinstance(filename, str) and filename and "\0" not in filename
    if ok:
        parts = filename.replace("\\", "/").split("/")
        ok = not os.path.isabs(filename) and ".." not in parts and os.path.normpath(filename) not in (".", "")
    if not ok:
        raise ValueError(
            f"{index}: tensor {str(key)[:200]!r} is mapped to {str(filename)[:200]!r}, which is not a file name inside "
            "the model folder (absolute paths and '..' are refused); the index is damaged or not safe to load"
        )


def _check_kind(where, name, got, want, what):
    """A tensor of the checkpoint must be of the kind (floating point, integer, bool) of the
    model's; floats convert to the model's float dtype, integers only to one that holds them all."""
    def kind(dt):
        return "bool" if dt == torch.bool else "floating point" if dt.is_floating_point else (
            "complex" if dt.is_complex else "integer")

    if kind(got) != kind(want):
        raise ValueError(
            f"{where}: tensor {name!r} is {got} ({kind(got)}) but the model's {what} is {want} ({kind(want)}); tier "
            f"does not convert between kinds (an integer tensor is not silently made a float): the checkpoint is not "
            f"for this model"
        )
    if kind(got) == "integer":
        g, w = torch.iinfo(got), torch.iinfo(want)
        if g.min < w.min or g.max > w.max:
            raise ValueError(
                f"{where}: tensor {name!r} is {got} but the model's {what} is {want}, which cannot hold every {got} "
                "value; refusing to truncate it"
            )


_ST_TORCH = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _ShardFile:
    """One safetensors file, read with plain reads into memory of each tensor's own: a
    memory-mapped shard would count every page touched in the process's resident memory (16 GB
    RSS loading a 7B model with a 2 GiB host budget, bench/pretrained_build.py), where a read
    leaves them to the page cache. The header is parsed here and checked against the file's size
    (a truncated file is refused at open, as safetensors refuses it)."""

    def __init__(self, full):
        self.full = full
        self._f = open(full, "rb", buffering=0)
        try:
            size = os.fstat(self._f.fileno()).st_size
            head = self._f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than its header's length")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                raise ValueError(f"its header's length ({n} bytes) runs past the end of the file ({size} bytes)")
            header = json.loads(self._f.read(n))
            if not isinstance(header, dict):
                raise ValueError("its header is not a JSON object")
            header.pop("__metadata__", None)
            self.start = 8 + n
            self.entries = {}
            for key, e in header.items():
                begin, end = e["data_offsets"]
                if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
                    raise ValueError(f"tensor {key!r} has bad data_offsets {e['data_offsets']}")
                if self.start + end > size:
                    raise ValueError(f"tensor {key!r} ends at byte {self.start + end} of a {size}-byte file")
                self.entries[key] = (e["dtype"], tuple(int(d) for d in e["shape"]), begin, end)
        except BaseException:
            self._f.close()
            raise

    def keys(self):
        return self.entries.keys()

    def shape(self, key):
        return self.entries[key][1]

    def read(self, key, buffer=None):
        """The tensor ``key``, read into its own memory, or into ``buffer`` (a uint8 tensor large
        enough) when given: a loader that reuses one buffer faults its pages in once, where fresh
        memory for each tensor costs a page fault per 4 KiB (11 s of a 7B load's 16)."""
        dtype_name, shape, begin, end = self.entries[key]
        dtype = _ST_TORCH.get(dtype_name)
        if dtype is None:  # rarer dtypes (fp8, ...) through safetensors itself
            from safetensors import safe_open

            with safe_open(self.full, framework="pt") as h:
                return h.get_tensor(key)
        nbytes = self._checked_bytes(key, dtype)
        raw = torch.empty(nbytes, dtype=torch.uint8) if buffer is None else buffer[:nbytes]
        self._pread(key, memoryview(raw.numpy()))
        return raw.view(dtype).reshape(shape)

    def dtype(self, key):
        """The torch dtype of tensor ``key``; None for one safetensors' own reader reads (fp8, ...)."""
        return _ST_TORCH.get(self.entries[key][0])

    def read_into(self, key, out):
        """Tensor ``key``'s bytes straight into ``out`` (a writable buffer of exactly its size, such
        as the engine's host copy of the parameter): no buffer of tier's own in between."""
        view = memoryview(out).cast("B")
        if len(view) != self._checked_bytes(key, self.dtype(key)):
            raise ValueError(f"tensor {key!r}: {self.entries[key][3] - self.entries[key][2]} bytes, not {len(view)}")
        self._pread(key, view)

    def _checked_bytes(self, key, dtype):
        dtype_name, shape, begin, end = self.entries[key]
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * torch.empty(0, dtype=dtype).element_size():
            raise ValueError(f"tensor {key!r}: {end - begin} bytes for {dtype_name} {list(shape)}")
        return end - begin

    def _pread(self, key, view):
        begin = self.entries[key][2]
        nbytes, done = len(view), 0
        while done < nbytes:
            got = os.preadv(self._f.fileno(), [view[done:]], self.start + begin + done)
            if got <= 0:
                raise ValueError(f"tensor {key!r}: the file ends {nbytes - done} bytes short")
            done += got


class _ReadBuffer:
    """Memory reused for tensor after tensor (grown to the largest): its pages are faulted in
    once, where fresh memory for each tensor costs a page fault per 4 KiB (11 s of a 7B load's
    16 on this machine)."""

    def __init__(self):
        self._t = None

    def get(self, nbytes):
        if self._t is None or self._t.numel() < nbytes:
            self._t = None
            self._t = torch.empty(nbytes, dtype=torch.uint8)
        return self._t


class _ReadAhead:
    """Serves a loader that asks for the checkpoint's tensors in a known order, one at a time,
    each used only until the next is asked for: while the loader registers one (the engine copies
    it in; the GIL is released), a thread reads the next into the other of two buffers. A request
    out of the expected order is read on the spot; either way the values are the file's."""

    def __init__(self, reader, order):
        import concurrent.futures

        self._reader = reader
        self._next = {}  # (name, shape) -> the one expected after it
        for a, b in zip(order, order[1:]):
            self._next.setdefault(a, b)
        self._first = order[0] if order else None
        self._buffers = [_ReadBuffer(), _ReadBuffer()]
        self._free = 0  # the buffer the next answer goes into (the other holds the last answer)
        self._pending = None  # (key, future) reading into self._buffers[self._free]
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tier-ckpt-read")

    def _start(self, key):
        buf = self._buffers[self._free]
        self._pending = (key, self._pool.submit(self._reader.tensor, key[0], key[1], buf))

    def tensor(self, name, shape):
        key = (name, tuple(shape))
        if self._pending is None and key == self._first:
            self._start(key)
        got = None
        if self._pending is not None:
            pkey, fut = self._pending
            self._pending = None
            if pkey == key:
                got = fut.result()  # its errors are this request's
            else:
                fut.exception()  # a read nobody asked for: wait it out, ignore how it ended
        if got is None:
            got = self._reader.tensor(name, shape, self._buffers[self._free])
        self._free = 1 - self._free
        nxt = self._next.get(key)
        if nxt is not None:
            self._start(nxt)  # into the other buffer, while the caller uses this one
        return got

    def close(self):
        if self._pending is not None:
            self._pending[1].exception()
            self._pending = None
        self._pool.shutdown(wait=True)


class _StoredValue:
    """A parameter's values as the checkpoint stores them, not read yet: the engine reads them
    straight into its host copy of the parameter (read_into) where it keeps them in the stored
    dtype, or takes them as a tensor (tensor(): read ahead into the loader's two buffers)."""

    def __init__(self, reader, ahead, name, shape, dtype):
        self._reader, self._ahead = reader, ahead
        self.name, self.shape, self.dtype = name, shape, dtype

    def tensor(self):
        return self._ahead.tensor(self.name, self.shape)

    def read_into(self, out):
        self._reader.read_into(self.name, self.shape, out)


class CheckpointReader:
    """The tensors of a transformers safetensors checkpoint (one file or sharded with an index),
    opened lazily and read tensor by tensor (_ShardFile)."""

    def __init__(self, path):
        self.path = path
        single = os.path.join(path, SINGLE_FILE)
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e})") from None
            if not isinstance(self.weight_map, dict):
                raise ValueError(f"{index}: not a safetensors index (its weight_map is not an object)")
            for key, filename in self.weight_map.items():
                _check_shard_name(index, key, filename)
        elif os.path.isfile(single):
            self.weight_map = None
        else:
            raise FileNotFoundError(
                f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; tier.torch.from_pretrained reads safetensors checkpoints "
                "(save one with model.save_pretrained(dir, safe_serialization=True))"
            )
        self._files = {}
        if self.weight_map is None:
            self.weight_map = {k: SINGLE_FILE for k in self._open(SINGLE_FILE).keys()}
        self.key_of = {k: k for k in self.weight_map}  # the model's name -> the checkpoint's
        self.converted = {}  # the model's name -> checkpoint key needing a conversion tier lacks

    def _open(self, filename):
        handle = self._files.get(filename)
        if handle is None:
            full = os.path.join(self.path, filename)
            if not os.path.isfile(full):
                raise FileNotFoundError(f"{full}: listed in {INDEX_FILE} but missing")
            try:
                handle = _ShardFile(full)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{full}: not a readable safetensors file ({e}); is it truncated?") from None
            self._files[filename] = handle
        return handle


    def follow_renamings(self, model):
        """Maps the checkpoint's names onto ``model``'s as transformers does when it loads (v5
        renames legacy names, e.g. GPT-NeoX's ``embed_out`` to ``lm_head``, and adds or strips
        the base model's prefix). Keys that transformers would also convert (split, merge,
        transpose) are refused when the model needs them."""
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightRenaming, rename_source_key
        except ImportError:  # transformers 4: names are the model's
            return
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
        wanted = {n: True for n, _ in model.named_parameters(remove_duplicate=False)}
        wanted.update({n: True for n, _ in model.named_buffers()})
        prefix = getattr(model, "base_model_prefix", None) or None
        for key in self.weight_map:
            new, converter = rename_source_key(key, renamings, converters, prefix, wanted)
            if converter is not None:
                self.converted[new] = key
            elif new != key:
                self.key_of[new] = key

    def __contains__(self, name):
        return name in self.key_of or name in self.converted

    def where(self, name):
        return os.path.join(self.path, self.weight_map[self.key_of.get(name, name)])

    def tensor(self, name, shape, into=None):
        """The model's tensor ``name`` (under its checkpoint name), checked against ``shape``.
        ``into``: a _ReadBuffer to read it into (the result is valid until that buffer is read
        into again), else memory of its own."""
        key, handle = self._located(name, shape)
        with self._reading(name):
            if into is None:
                return handle.read(key)
            start, end = handle.entries[key][2:]
            return handle.read(key, into.get(end - start))

    def dtype(self, name, shape):
        """The dtype the checkpoint stores ``name`` in (checked against ``shape``, as tensor()
        checks it); None for a dtype only safetensors' own reader reads."""
        key, handle = self._located(name, shape)
        return handle.dtype(key)

    def read_into(self, name, shape, out):
        """``name``'s bytes as the file stores them into ``out``, a writable buffer of exactly their
        size (the engine's host copy of the parameter: tier.torch.from_pretrained's loads)."""
        key, handle = self._located(name, shape)
        with self._reading(name):
            handle.read_into(key, out)

    @contextlib.contextmanager
    def _reading(self, name):
        """A failed read of ``name`` as a ValueError naming the file and the tensor."""
        try:
            yield
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.where(name)}: tensor {name!r} cannot be read ({e}); is the file truncated?") from None

    def _located(self, name, shape):
        if name not in self.key_of and name in self.converted:
            raise ValueError(
                f"{os.path.join(self.path, self.weight_map[self.converted[name]])}: tensor "
                f"{self.converted[name]!r} needs a weight conversion (transformers' conversion mapping) that "
                f"tier.torch.from_pretrained does not apply; load with transformers and save it back first"
            )
        key = self.key_of[name]
        handle = self._open(self.weight_map[key])
        if key not in handle.keys():
            raise KeyError(f"{self.where(name)}: tensor {key!r} is listed in the index but not in the file")
        got = handle.shape(key)
        if got != tuple(shape):
            raise ValueError(
                f"{self.where(name)}: tensor {name!r} has shape {list(got)} but the model's parameter has "
                f"{list(shape)}"
            )
        return key, handle


class _EmptyParameters:
    """Parameters are created as meta tensors and no weight initialisation runs (the checkpoint
    provides every value); buffers stay real, so values computed at construction (rotary
    frequencies) survive."""

    def __enter__(self):
        self._register = torch.nn.Module.register_parameter

        def register(module, name, param):
            if param is not None and param.device.type != "meta":
                param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            return self._register(module, name, param)

        torch.nn.Module.register_parameter = register
        self._no_init = None
        try:
            from transformers import initialization

            self._no_init = initialization.no_init_weights()
            self._no_init.__enter__()
        except (ImportError, AttributeError):
            self._no_init = None
        return self

    def __exit__(self, *exc):
        torch.nn.Module.register_parameter = self._register
        if self._no_init is not None:
            self._no_init.__exit__(*exc)
        return False


def from_pretrained(path, config, *, model_class=None, **initialize_kwargs):
    """A :class:`TierEngine` over the transformers model saved in the folder ``path`` (its
    ``config.json`` and safetensors weights; nothing is downloaded), configured by ``config``
    (as ``initialize``'s). ``engine.module`` is the transformers model. ``model_class``: the
    class to build (default ``transformers.AutoModelForCausalLM``). Other keyword arguments go to
    ``initialize``. Errors name the file and the tensor: a missing folder, file or tensor, a
    shape that differs from the model's, a truncated file."""
    import transformers

    from .engine import TierEngine

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a folder; tier.torch.from_pretrained reads a local transformers checkpoint")
    reader = CheckpointReader(path)
    hf_config = transformers.AutoConfig.from_pretrained(path)
    cls = model_class or transformers.AutoModelForCausalLM
    with _EmptyParameters():
        if hasattr(cls, "from_config"):
            model = cls.from_config(hf_config)
        else:
            model = cls(hf_config)
        if hasattr(model, "tie_weights"):
            model.tie_weights()  # the weight initialisation that would tie them did not run

    reader.follow_renamings(model)
    # Every name a parameter is known by (tied weights have several): the checkpoint may hold any.
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)

    def checkpoint_name(name, param):
        return next((a for a in aliases.get(id(param), [name]) if a in reader), None)

    # The engine asks for the parameters in the model's order and copies each one in as it
    # registers it: two buffers reused, the next tensor read while this one is registered.
    order = []
    for name, p in model.named_parameters():
        alias = checkpoint_name(name, p)
        if alias is not None:
            order.append((alias, tuple(p.shape)))
    ahead = _ReadAhead(reader, order)

    def initial_values(name, param):
        for alias in aliases.get(id(param), [name]):
            if alias in reader:
                stored = reader.dtype(alias, param.shape)
                if stored is None:  # a dtype safetensors' own reader reads
                    t = ahead.tensor(alias, param.shape)
                    _check_kind(reader.where(alias), alias, t.dtype, param.dtype, "parameter")
                    return t
                _check_kind(reader.where(alias), alias, stored, param.dtype, "parameter")
                return _StoredValue(reader, ahead, alias, tuple(param.shape), stored)
        files = sorted(set(reader.weight_map.values()))
        raise KeyError(f"{path}: the checkpoint ({', '.join(files)}) has no tensor {name!r}")

    # Persistent buffers saved in the checkpoint (most models have none) are loaded as they are.
    for mod_name, mod in model.named_modules():
        for bname, buf in list(mod._buffers.items()):
            full = f"{mod_name}.{bname}" if mod_name else bname
            if buf is not None and bname not in mod._non_persistent_buffers_set and full in reader:
                t = reader.tensor(full, buf.shape)
                _check_kind(reader.where(full), full, t.dtype, buf.dtype, "buffer")
                mod._buffers[bname] = t.to(buf.dtype)

    try:
        return TierEngine(model, config, initial_values=initial_values, **initialize_kwargs)
    finally:
        ahead.close()


# ------------------------------------------------------------------------------------ writing
def _persistent_buffers(model):
    out = []
    for mod_name, mod in model.named_modules():
        for bname, buf in mod._buffers.items():
            if buf is not None and bname not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{bname}" if mod_name else bname, buf))
    return out


def _write_shard(path, entries):
    """Writes one safetensors file at ``path`` (under a temporary name, then renamed): ``entries``
    is a list of (name, dtype, shape, nbytes, fetch), fetch() returning the CPU tensor."""
    header, offset = {}, 0
    for name, dtype, shape, nbytes, _ in entries:
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with atomic_write(path) as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, dtype, shape, nbytes, fetch in entries:
            t = fetch()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise RuntimeError(f"save_pretrained: {name!r} came back as {t.dtype} {list(t.shape)}")
            data = t.contiguous().view(torch.uint8).numpy().tobytes()
            if len(data) != nbytes:
                raise RuntimeError(f"save_pretrained: {name!r} has {len(data)} bytes, expected {nbytes}")
            f.write(data)


def save_pretrained(engine, save_dir, *, max_shard_size="5GB", dtype=None, save_config=True):
    """Writes ``engine``'s current weights to ``save_dir`` as a transformers safetensors
    checkpoint, one tensor in memory at a time. ``dtype``: None for the compute dtype (what the
    model computes with), or "fp32" for the optimizer's fp32 master weights (frozen parameters are
    widened), "bf16" or "fp16". Tied weights are written once, under their first name, as
    transformers does. Returns the list of files written."""
    want = _NAMED_DTYPE.get(dtype, engine.compute_dtype) if dtype is not None else engine.compute_dtype
    if dtype is not None and dtype not in _NAMED_DTYPE:
        raise ValueError(f"save_pretrained: dtype {dtype!r} is not one of None, fp32, bf16, fp16")
    limit = parse_size(max_shard_size)
    _fs.makedirs(save_dir, exist_ok=True)

    def param_fetch(slot):
        def fetch():
            if engine._zero is not None:
                # Across ranks: gathered from the owners (a collective every rank makes).
                if want == torch.float32 and slot.trainable and engine.compute_dtype != torch.float32:
                    return engine._gathered_master(slot)
                return engine.parameter(slot.name).to(want)
            if want == torch.float32 and slot.pid is not None:
                t = torch.empty(slot.shape, dtype=torch.float32)
                engine.native_optimizer.read_param(slot.pid, t.view(-1))
                return t
            t = torch.empty(slot.shape, dtype=engine.compute_dtype)
            engine.native.read(slot.tid, t)
            return t.to(want)

        return fetch

    esize = torch.empty(0, dtype=want).element_size()
    if engine._zero is not None and engine._zero.rank != 0:
        # Every rank takes part in the gathers; rank 0 writes.
        for s in engine._slots:
            param_fetch(s)()
        return []
    items = [(s.name, want, s.shape, s.numel * esize, param_fetch(s)) for s in engine._slots]
    for name, buf in _persistent_buffers(engine.module):
        b = buf.detach().cpu()
        if b.dtype in _ST_DTYPE:
            items.append((name, b.dtype, tuple(b.shape), b.numel() * b.element_size(), lambda b=b: b))

    shards, current, size = [], [], 0
    for item in items:
        if current and size + item[3] > limit:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += item[3]
    if current or not shards:
        shards.append(current)

    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, entries in zip(names, shards):
        _write_shard(os.path.join(save_dir, name), entries)
    written = list(names)
    index_path = os.path.join(save_dir, INDEX_FILE)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(e[3] for s in shards for e in s)},
            "weight_map": {e[0]: n for n, s in zip(names, shards) for e in s},
        }
        write_bytes(index_path, json.dumps(index, indent=2, sort_keys=True).encode())
        written.append(INDEX_FILE)
    # Shards of an earlier save that this one does not use would confuse a loader: remove them.
    keep = set(written)
    removed = False
    for old in os.listdir(save_dir):
        stale_shard = re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", old)
        if stale_shard and old not in keep:
            _fs.unlink(os.path.join(save_dir, old))
            removed = True
    if removed:
        # Durable before this returns: a stale index that came back after a power cut would make a
        # loader read the old shards instead of the new file.
        _fs.fsync_dir(save_dir)
    module = engine.module
    if save_config and hasattr(module, "config") and hasattr(module.config, "save_pretrained"):
        # transformers writes into a folder with plain open(): into a private one here, then each
        # file is moved over its final name.
        with private_dir(save_dir) as private:
            module.config.save_pretrained(private)
            gen = getattr(module, "generation_config", None)
            if gen is not None and hasattr(gen, "save_pretrained"):
                gen.save_pretrained(private)
            for name in sorted(os.listdir(private)):
                if os.path.isfile(os.path.join(private, name)):
                    publish(private, name, save_dir)
                    written.append(name)
    return written
