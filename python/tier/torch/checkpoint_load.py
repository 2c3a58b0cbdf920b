"""Loading and reading the checkpoints :mod:`tier.torch.checkpoint` writes: the load protocol of
its docstring (every file checked against the manifest and every field of the metadata parsed
and tried before the engine is touched), the old format, and :func:`consolidate`, which reads a
checkpoint without an engine into one fp32 state dict."""

import base64
import copy
import errno
import hashlib
import json
import math
import os
import stat

import torch

from .. import _tier
from .checkpoint import (  # the layout and helpers of the write side
    FORMAT,
    LATEST,
    MANIFEST,
    MAX_COUNT,
    OLD_FORMAT,
    _TAG_RE,
    _VERSION_RE,
    _link_target,
    _manifest_body_digest,
    _sha256_file,
    reader_checked_entry,
    _short,
    _tags,
    _version_time,
    check_tag,
)

def _available(directory):
    tags = _tags(directory)
    return ", ".join(tags) if tags else "none"


def _resolve(load_dir, tag):
    """The directory holding the checkpoint of ``tag`` (see the module docstring)."""
    p = os.path.join(load_dir, tag)
    target = _link_target(load_dir, tag)
    if target is not None:
        path = os.path.join(load_dir, target)
        if os.path.isdir(path) and not os.path.islink(path):  # tier's versions are directories, never links
            return path
    elif os.path.isdir(p):
        return p
    versions = []
    try:
        names = os.listdir(load_dir)
    except OSError:
        names = []
    for n in names:
        m = _VERSION_RE.fullmatch(n)
        vpath = os.path.join(load_dir, n)
        if m and m.group("tag") == tag and not os.path.islink(vpath) and os.path.isfile(os.path.join(vpath, MANIFEST)):
            versions.append(n)
    for n in sorted(versions, key=_version_time, reverse=True):
        try:
            # Picking among versions, the reader's checks are made now too (a pass over
            # optimizer.bin that a load through the tag's link does not make): a damaged newer
            # version gives way to an older one.
            _verified_files(os.path.join(load_dir, n), read_all=True)
        except (ValueError, _tier.DataLoss, OSError):
            continue
        return os.path.join(load_dir, n)
    raise FileNotFoundError(
        f"checkpoint directory {load_dir}: no checkpoint tagged {tag!r} (available tags: {_available(load_dir)})"
    )


def _verified_files(path, read_all=False):
    """Checks every file of the checkpoint in ``path`` against its manifest. Returns the bytes of
    meta.json as read for the check and the names the manifest lists. optimizer.bin (listed with
    its trailer) is checked here by its size and trailer only: the optimizer's reader checks every
    byte against the trailer's chain of CRCs as it loads, before it replaces any state (with
    ``read_all``, that reading is done here too). The other files are hashed as they stream by
    and read again when applied: versions are never written in place. Checkpoints from before
    the trailer was listed have optimizer.bin's SHA-256 instead, checked as the others."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, "rb") as f:
            manifest = json.loads(f.read())
        body = {"format": manifest["format"], "files": manifest["files"]}
        ok = manifest["sha256"] == _manifest_body_digest(body) and isinstance(body["files"], dict)
    except (ValueError, KeyError, TypeError) as e:
        raise _tier.DataLoss(f"checkpoint {path}: {MANIFEST} is damaged ({e})") from None
    if not ok:
        raise _tier.DataLoss(f"checkpoint {path}: {MANIFEST} does not match its own checksum")
    if body["format"] != FORMAT:
        raise ValueError(f"checkpoint {path}: unknown format {body['format']!r} (this tier reads {FORMAT})")
    for required in ("meta.json", "optimizer.bin"):
        if required not in body["files"]:
            raise _tier.DataLoss(f"checkpoint {path}: {MANIFEST} does not list {required}")
    kept = {}
    for name, entry in sorted(body["files"].items()):
        fpath = os.path.join(path, name)
        if os.path.basename(name) != name or not os.path.isfile(fpath) or os.path.islink(fpath):
            raise _tier.DataLoss(f"checkpoint {path}: {name} is missing (listed in {MANIFEST})")
        if "trailer" in entry:
            got = reader_checked_entry(fpath)
            if got != {"bytes": entry.get("bytes"), "trailer": entry.get("trailer")}:
                raise _tier.DataLoss(
                    f"checkpoint {path}: {name} does not match the manifest ({got['bytes']} bytes, trailer "
                    f"{got['trailer'][:16]}..., expected {entry.get('bytes')} bytes, {str(entry.get('trailer'))[:16]}...)"
                )
            if read_all:
                _tier.read_checkpoint_masters(fpath, [None] * len(_tier.checkpoint_partitions(fpath)))
            continue
        if name != "meta.json":
            n, digest = _sha256_file(fpath)
        else:
            with open(fpath, "rb") as f:
                data = f.read()
            n, digest = len(data), hashlib.sha256(data).hexdigest()
            kept[name] = data
        if n != entry.get("bytes") or digest != entry.get("sha256"):
            raise _tier.DataLoss(
                f"checkpoint {path}: {name} does not match the manifest ({n} bytes, sha256 {digest[:16]}..., "
                f"expected {entry.get('bytes')} bytes, {str(entry.get('sha256'))[:16]}...)"
            )
    return kept["meta.json"], set(body["files"])


def _verified_meta(path):
    """``_verified_files`` plus meta.json parsed and of this format: (meta, the names listed)."""
    meta_bytes, listed = _verified_files(path)
    try:
        meta = json.loads(meta_bytes)
    except ValueError as e:
        raise ValueError(f"checkpoint {path}: meta.json is not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path}: meta.json is not of format {FORMAT}")
    return meta, listed


def _count(v):
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT


def _int(meta, key, path):
    v = meta.get(key)
    if not _count(v):
        raise ValueError(
            f"checkpoint {path}: meta.json field {key!r} is {_short(v)}, expected a count (an integer in [0, 2^53))"
        )
    return v


def _rng_tensor(b64, expected_len, path, what):
    try:
        raw = base64.b64decode(b64, validate=True)
    except (ValueError, TypeError):
        raise ValueError(f"checkpoint {path}: the {what} RNG state is not base64") from None
    if len(raw) != expected_len:
        raise ValueError(f"checkpoint {path}: the {what} RNG state has {len(raw)} bytes, expected {expected_len}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _tried_rng_state(state, path, what, device="cpu"):
    """``state`` once a throwaway generator on ``device`` accepted it (torch checks more than the
    length, e.g. the mt19937 position), so that applying it later cannot fail."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        raise ValueError(f"checkpoint {path}: the {what} RNG state is not a byte tensor")
    try:
        torch.Generator(device=device).set_state(state)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(
            f"checkpoint {path}: the {what} RNG state is not a valid generator state ({str(e)[:200]}); the "
            "checkpoint is damaged or was not written by tier, and nothing was loaded"
        ) from None
    return state


def _plan_schedule(engine, meta, path):
    """The counters and the scheduler state of ``meta``, checked, with the learning rates (and
    betas) they give tried against what the optimizer accepts; returns them as a dict."""
    plan = {k: _int(meta, k, path) for k in ("global_steps", "micro_steps", "skipped_steps")}
    sched = meta.get("scheduler")
    plan["scheduler"] = None
    if engine.scheduler is None:
        return plan
    if sched:
        if not isinstance(sched, dict) or not _count(sched.get("last_step")):
            raise ValueError(
                f"checkpoint {path}: meta.json has an invalid scheduler state {_short(sched)} (its last_step must be "
                "an integer in [0, 2^53))"
            )
        probe = copy.deepcopy(engine.scheduler)
        try:
            probe.load_state_dict(sched)
        except Exception as e:  # noqa: BLE001 - any refusal of the scheduler is the checkpoint's fault
            raise ValueError(f"checkpoint {path}: the scheduler refuses its saved state ({type(e).__name__}: "
                             f"{str(e)[:200]})") from None
        plan["scheduler"] = sched
    # What the engine's _apply_lr will set for the loaded step count.
    try:
        lrs = [float(x) for x in engine.scheduler.lrs(plan["global_steps"])]
        betas = engine.scheduler.betas(plan["global_steps"])
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"checkpoint {path}: the schedule fails at the saved step {plan['global_steps']} "
                         f"({type(e).__name__}: {str(e)[:200]})") from None
    for lr in lrs:
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"checkpoint {path}: the schedule gives lr {lr} at the saved step {plan['global_steps']}")
    for pair in betas or []:
        if not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in pair):
            raise ValueError(f"checkpoint {path}: the schedule gives betas {_short(pair)} at the saved step "
                             f"{plan['global_steps']}")
    return plan


def _plan(engine, path, meta, old_rng, listed):
    """Validates everything in the checkpoint against the engine; returns what to apply."""
    if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, OLD_FORMAT):
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"checkpoint {path}: not a tier checkpoint (format {fmt!r})")
    params = meta.get("params")
    try:
        names = [(p["name"], tuple(p["shape"]), p["trainable"]) for p in params]
    except (TypeError, KeyError):
        raise ValueError(f"checkpoint {path}: meta.json has no valid parameter list") from None
    mine = [(s.name, tuple(s.shape), s.pid is not None) for s in engine._slots]
    if names != mine:
        diff = next(((a, b) for a, b in zip(names, mine) if a != b), None)
        raise ValueError(
            f"{path}: the checkpoint's parameters do not match the model's "
            f"(first difference: checkpoint {diff[0] if diff else len(names)} vs model {diff[1] if diff else len(mine)})"
        )
    if meta.get("compute_dtype") != engine.compute_dtype_name:
        raise ValueError(
            f"{path}: saved with compute dtype {meta.get('compute_dtype')}, the engine uses {engine.compute_dtype_name}"
        )
    plan = _plan_schedule(engine, meta, path)
    if "client_state" not in meta:
        raise ValueError(f"checkpoint {path}: meta.json has no client_state")
    plan["client_state"] = meta["client_state"]

    cpu_len = torch.get_rng_state().numel()
    if old_rng is not None:
        cpu, cuda = old_rng
        if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8 or cpu.numel() != cpu_len:
            raise ValueError(f"checkpoint {path}: rng.pt holds no valid CPU RNG state")
    else:
        rng = meta.get("rng")
        if not isinstance(rng, dict) or not isinstance(rng.get("cuda"), list):
            raise ValueError(f"checkpoint {path}: meta.json has no valid RNG state")
        cpu = _rng_tensor(rng.get("cpu"), cpu_len, path, "CPU")
        cuda = []
        if torch.cuda.is_available() and rng["cuda"]:
            cuda_len = torch.cuda.get_rng_state().numel()
            cuda = [_rng_tensor(s, cuda_len, path, f"CUDA {i}") for i, s in enumerate(rng["cuda"])]
    plan["rng_cpu"] = _tried_rng_state(cpu, path, "CPU")
    # States for another number of GPUs are not applied (the CUDA generators keep their state).
    cuda = cuda if torch.cuda.is_available() and len(cuda) == torch.cuda.device_count() else []
    plan["rng_cuda"] = [_tried_rng_state(c, path, f"CUDA {i}", f"cuda:{i}") for i, c in enumerate(cuda)]

    frozen = [s for s in engine._slots if s.pid is None]
    esize = torch.empty(0, dtype=engine.compute_dtype).element_size()
    want = sum(s.numel for s in frozen) * esize
    fpath = os.path.join(path, "frozen.bin")
    if frozen:
        if listed is not None and "frozen.bin" not in listed:
            raise _tier.DataLoss(
                f"checkpoint {path}: the model has frozen parameters but {MANIFEST} lists no frozen.bin")
        if not os.path.isfile(fpath):
            raise ValueError(f"checkpoint {path}: frozen.bin is missing but the model has frozen parameters")
        have = os.path.getsize(fpath)
        if have != want:
            raise ValueError(f"checkpoint {path}: frozen.bin has {have} bytes, expected {want}")
    plan["frozen"] = [(s, s.numel * esize) for s in frozen]
    plan["frozen_path"] = fpath
    return plan


def _read_old_format(path):
    """meta.json and rng.pt of a tier-checkpoint-1 directory, read without running pickled code."""
    try:
        with open(os.path.join(path, "meta.json"), "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {path}: no readable meta.json ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != OLD_FORMAT:
        raise _tier.DataLoss(f"checkpoint {path}: incomplete ({MANIFEST} is missing)")
    try:
        rng = torch.load(os.path.join(path, "rng.pt"), weights_only=True)
        old_rng = (rng["cpu"], list(rng["cuda"]))
    except Exception as e:  # noqa: BLE001 - any failure of the restricted unpickler is a refusal
        raise ValueError(f"checkpoint {path}: rng.pt cannot be read safely ({type(e).__name__}: {e})") from None
    return meta, old_rng


def latest_tag(load_dir):
    """The tag that ``<load_dir>/latest`` names. ``latest`` must be a regular file of the directory
    (a symlink is refused, not followed: it may lead anywhere) holding a plain tag; what it holds
    otherwise is never quoted in the error (it may be someone else's file)."""
    latest = os.path.join(load_dir, LATEST)
    try:
        fd = os.open(latest, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"checkpoint directory {load_dir} has no '{LATEST}' file; pass tag= (available tags: {_available(load_dir)})"
        ) from None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise ValueError(
            f"checkpoint directory {load_dir}: '{LATEST}' is a symbolic link; tier writes it as a plain file and does "
            f"not follow links out of the directory: remove it, or pass tag= (available tags: {_available(load_dir)})"
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(
                f"checkpoint directory {load_dir}: '{LATEST}' is not a regular file; remove it, or pass tag= "
                f"(available tags: {_available(load_dir)})"
            )
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    text = raw.decode("utf-8", errors="replace").strip()
    if not _TAG_RE.fullmatch(text) or ".." in text or text == LATEST:
        raise ValueError(
            f"checkpoint directory {load_dir}: '{LATEST}' does not hold a tag ({len(raw)} bytes that are not a plain "
            f"name; not shown); rewrite it with one of the tags, or pass tag= (available tags: {_available(load_dir)})"
        )
    return text


def load(engine, load_dir, tag):
    load_dir = os.fspath(load_dir)
    tag = latest_tag(load_dir) if tag is None else check_tag(tag)
    path = _resolve(load_dir, tag)

    if os.path.isfile(os.path.join(path, MANIFEST)):
        meta, listed = _verified_meta(path)
        old_rng = None
    else:
        meta, old_rng = _read_old_format(path)
        listed = None
    plan = _plan(engine, path, meta, old_rng, listed)

    # Everything is checked; from here on the engine changes. The optimizer's reader checks its
    # records before it replaces any state, so a failure there still leaves the engine as it was.
    engine.native_optimizer.load(os.path.join(path, "optimizer.bin"))
    engine._params_from_masters()
    if plan["frozen"]:
        with open(plan["frozen_path"], "rb") as f:
            for s, nbytes in plan["frozen"]:
                raw = f.read(nbytes)
                if len(raw) != nbytes:  # only if the file changed after it was verified
                    raise _tier.DataLoss(f"checkpoint {plan['frozen_path']}: shrank while loading ({s.name})")
                t = torch.frombuffer(bytearray(raw), dtype=engine.compute_dtype).reshape(s.shape)
                engine.native.write(s.tid, t)
    engine.native.flush()
    restore_progress(engine, plan)
    torch.set_rng_state(plan["rng_cpu"])
    if plan["rng_cuda"]:
        torch.cuda.set_rng_state_all(plan["rng_cuda"])
    return path, plan["client_state"]


# ---------------------------------------------------------------------------- offline consolidation
_COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _param_entries(meta, path):
    """meta.json's parameters as (name, shape, numel, partition or None), checked."""
    params = meta.get("params")
    if not isinstance(params, list):
        raise ValueError(f"checkpoint {path}: meta.json has no valid parameter list")
    out, names = [], set()
    for i, p in enumerate(params):
        try:
            name, shape, trainable, pid = p["name"], p["shape"], p["trainable"], p.get("partition")
        except (TypeError, KeyError):
            raise ValueError(f"checkpoint {path}: meta.json parameter {i} is malformed") from None
        if (
            not isinstance(name, str)
            or name in names
            or not isinstance(shape, list)
            or not all(_count(d) for d in shape)
            or not isinstance(trainable, bool)
            or (trainable and not _count(pid))
            or (not trainable and pid is not None)
        ):
            raise ValueError(
                f"checkpoint {path}: meta.json parameter {i} ({_short(name)}) is malformed (a unique name, a shape of "
                "counts, trainable with its optimizer partition or frozen without one)"
            )
        names.add(name)
        numel = math.prod(shape)
        if numel > MAX_COUNT:
            raise ValueError(f"checkpoint {path}: meta.json parameter {_short(name)} has {numel} elements")
        out.append((name, shape, numel, pid if trainable else None))
    return out


def consolidate(path):
    """Every parameter of the one-process checkpoint (format ``tier-checkpoint-2``) in ``path`` as
    one state dict of fp32 CPU tensors, in the model's order: each trainable parameter's fp32
    master from optimizer.bin (meta.json's ``partition`` names its partition there), each frozen
    one from frozen.bin, widened from the compute dtype. Every file is checked against the
    manifest first (optimizer.bin by its size and trailer), and optimizer.bin's reader checks each
    record against the trailer as it reads (``tier.DataLoss`` when anything is damaged; ValueError
    when the files disagree)."""
    meta, listed = _verified_meta(path)
    dtype = _COMPUTE_DTYPES.get(meta.get("compute_dtype"))
    if dtype is None:
        raise ValueError(
            f"checkpoint {path}: meta.json has an unknown compute dtype {_short(meta.get('compute_dtype'))}"
        )
    entries = _param_entries(meta, path)

    # The trainable ones: one fp32 tensor per partition, filled by the native reader (GIL released).
    opt_path = os.path.join(path, "optimizer.bin")
    parts = _tier.checkpoint_partitions(opt_path)
    masters = [None] * len(parts)
    for name, _, numel, pid in entries:
        if pid is None:
            continue
        if pid >= len(parts) or masters[pid] is not None:
            raise ValueError(
                f"checkpoint {path}: parameter {_short(name)} names partition {pid}, which optimizer.bin "
                f"{'does not have' if pid >= len(parts) else 'gives to another parameter too'}"
            )
        pname, pnumel, _ = parts[pid]
        if pnumel != numel or (pname and pname != name):
            raise ValueError(
                f"checkpoint {path}: parameter {_short(name)} ({numel} elements) and partition {pid} of "
                f"optimizer.bin ({_short(pname)}, {pnumel} elements) disagree"
            )
        masters[pid] = torch.empty(numel, dtype=torch.float32)
    if any(m is None for m in masters):
        raise ValueError(f"checkpoint {path}: optimizer.bin has partitions that no parameter of meta.json names")
    _tier.read_checkpoint_masters(opt_path, masters)

    # The frozen ones, in the model's order, from frozen.bin.
    esize = torch.empty(0, dtype=dtype).element_size()
    frozen = [(name, numel) for name, _, numel, pid in entries if pid is None]
    want = sum(numel for _, numel in frozen) * esize
    fpath = os.path.join(path, "frozen.bin")
    values = {}
    if want:
        if "frozen.bin" not in listed:
            raise _tier.DataLoss(
                f"checkpoint {path}: meta.json lists frozen parameters but {MANIFEST} lists no frozen.bin"
            )
        have = os.path.getsize(fpath)
        if have != want:
            raise ValueError(f"checkpoint {path}: frozen.bin has {have} bytes, meta.json's frozen parameters {want}")
        with open(fpath, "rb") as f:
            for name, numel in frozen:
                raw = f.read(numel * esize)
                if len(raw) != numel * esize:  # only if the file changed after it was verified
                    raise _tier.DataLoss(f"checkpoint {fpath}: shrank while it was read ({name})")
                if numel:
                    values[name] = torch.frombuffer(bytearray(raw), dtype=dtype).float()
    out = {}
    for name, shape, numel, pid in entries:
        if pid is not None:
            out[name] = masters[pid].view(shape)
        else:
            out[name] = values[name].view(shape) if numel else torch.empty(shape, dtype=torch.float32)
    return out


def restore_progress(engine, plan):
    """The step counters and the LR schedule of a verified checkpoint's plan, and the lr they give
    (after its state and params are in place; one process or across ranks alike)."""
    engine.global_steps = plan["global_steps"]
    engine.micro_steps = plan["micro_steps"]
    engine.skipped_steps = plan["skipped_steps"]
    if plan["scheduler"] is not None:
        engine.scheduler.load_state_dict(plan["scheduler"])
    engine._apply_lr()
