"""Checkpoints of an engine partitioned over ranks (tier.torch.zero), loadable at any world size.

Layout of a version directory (format ``tier-checkpoint-zero-1``; the directory protocol, tags,
``latest``, manifests and garbage collection are those of :mod:`tier.torch.checkpoint`)::

    meta.json       (rank 0) names, shapes, counters, scheduler, client state, the world and stage
                    it was saved at
    frozen.bin      (rank 0, if any parameter is frozen) the frozen parameters, whole
    rank<N>.bin     rank N's shards, each trainable parameter's owned range as fp32 master,
                    exp_avg, exp_avg_sq in turn
    rank<N>.json    rank N's partition map: for each parameter its range (start, count) and where
                    its three arrays start in rank<N>.bin; its step counters and RNG state
    manifest.json   (rank 0, last) size and SHA-256 of every file above

Every rank writes its own files in parallel into the directory rank 0 created, hashing them as it
writes; rank 0 gathers the sizes and digests and writes the manifest once all have synced theirs
(no file is read back to hash it), then switches the tag and ``latest``. A save killed on any
rank leaves ``latest`` on the previous complete checkpoint. The directory must be one that every
rank sees (a shared or local file system, as DeepSpeed's checkpoints).

Loading at another world size (or in one process) reshards: each rank reads, from whichever saved
ranks hold them, the elements of its new ranges. Every rank checks the manifest, the small files
and every file it will read (its ranges' saved shards, frozen.bin) before anything changes, and
the ranks agree that all checks passed before any of them applies.
``python -m tier.torch.zero_to_fp32 <checkpoint dir> <out.safetensors|out.pt>`` consolidates one
into a single fp32 state dict.
"""

import base64
import contextlib
import hashlib
import json
import os

import torch

from .. import _tier
from .. import fs as _fs
from . import checkpoint as _ck
from . import checkpoint_load as _load

FORMAT = "tier-checkpoint-zero-1"
_KINDS = ("master", "exp_avg", "exp_avg_sq")


def _rank_world(engine):
    z = engine._zero
    return (0, 1) if z is None else (z.rank, z.world)


def _broadcast(engine, obj):
    if engine._zero is None:
        return obj
    import torch.distributed as dist

    box = [obj]
    engine._zero._run("broadcast", lambda: dist.broadcast_object_list(box, src=0, group=engine._zero.pg))
    return box[0]


def _entry(data):
    """A manifest entry for bytes written."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _gather_entries(engine, entries, error):
    """Every rank's manifest entries (name -> entry), merged, on every rank; with every rank's
    error, as ``_all_ok``: a rank that failed sends its error instead and all raise."""
    if engine._zero is None:
        if error is not None:
            raise error
        return dict(entries)
    import torch.distributed as dist

    got = [None] * engine._zero.world
    mine = {"error": None if error is None else f"{type(error).__name__}: {error}", "files": entries}
    engine._zero._run(
        "gathering the checkpoint's digests", lambda: dist.all_gather_object(got, mine, group=engine._zero.pg)
    )
    if error is not None:
        raise error
    bad = [(r, g["error"]) for r, g in enumerate(got) if g["error"] is not None]
    if bad:
        raise ValueError(f"checkpoint: rank {bad[0][0]} could not write its part, so none is published: {bad[0][1]}")
    merged = {}
    for g in got:
        merged.update(g["files"])
    return merged


def _all_ok(engine, error):
    """Every rank's check result: raises this rank's error, or says which rank failed."""
    if engine._zero is None:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    got = [None] * engine._zero.world
    mine = None if error is None else f"{type(error).__name__}: {error}"
    engine._zero._run("agreeing on the checkpoint", lambda: dist.all_gather_object(got, mine, group=engine._zero.pg))
    if error is not None:
        raise error
    bad = [(r, e) for r, e in enumerate(got) if e is not None]
    if bad:
        raise ValueError(f"checkpoint: rank {bad[0][0]} refused it, so no rank loads it: {bad[0][1]}")


def save(engine, save_dir, tag, client_state, save_latest=True):
    if engine.compute_dtype_name == "fp16":
        raise NotImplementedError(
            "save_checkpoint across ranks with fp16: the dynamic loss scale cannot be restored yet; use bf16 or fp32"
        )
    rank, world = _rank_world(engine)
    tag = _ck.check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    save_dir = os.fspath(save_dir)
    error = None
    version = None
    # Rank 0 holds the directory's writer lock (checkpoint.writer_lock) for the whole save: the
    # other ranks write only into the version directory it made.
    lock = contextlib.ExitStack()
    if rank == 0:
        try:
            _fs.makedirs(save_dir, mode=0o700, exist_ok=True)
            _ck._check_replaceable(os.path.join(save_dir, tag), tag)
            lock.enter_context(_ck.writer_lock(save_dir))
            _ck._check_replaceable(os.path.join(save_dir, tag), tag)
            _ck.collect_garbage_first(save_dir)
            version = _ck._new_version(tag)
            _fs.mkdir(os.path.join(save_dir, version), 0o700)
        except Exception as e:  # noqa: BLE001 (every rank must hear of it)
            error = e
    with lock:
        return _save_rest(engine, save_dir, tag, version, error, rank, world, client_state, save_latest)


def _save_rest(engine, save_dir, tag, version, error, rank, world, client_state, save_latest):
    version = _broadcast(engine, version)
    _all_ok(engine, error)
    vdir = os.path.join(save_dir, version)
    entries = {}
    try:
        entries = _write_rank(engine, vdir, rank, world)
        error = None
    except Exception as e:  # noqa: BLE001
        error = e
    frozen = [s for s in engine._slots if not s.trainable]
    try:
        _all_ok(engine, error)
        # Frozen parameters: gathered (stage 3) by every rank, written by rank 0.
        values = [(s, engine.parameter(s.name)) for s in frozen] if frozen else []
        error = None
        if rank == 0:
            try:
                if values:
                    with _fs.create_new(os.path.join(vdir, "frozen.bin")) as f:
                        h, n = hashlib.sha256(), 0
                        for _, v in values:
                            raw = v.contiguous().view(torch.uint8).numpy().tobytes()
                            h.update(raw)
                            n += len(raw)
                            f.write(raw)
                        f.sync()
                    entries["frozen.bin"] = {"bytes": n, "sha256": h.hexdigest()}
                del values
                entries["meta.json"] = _write_meta(engine, vdir, world, client_state)
            except Exception as e:  # noqa: BLE001
                error = e
        files = _gather_entries(engine, entries, error)
        error = None
        if rank == 0:
            try:
                present = sorted(os.listdir(vdir))
                if present != sorted(files):
                    raise _tier.DataLoss(
                        f"checkpoint {vdir}: the files written ({sorted(files)}) are not the files there ({present})"
                    )
                body = {"format": FORMAT, "files": dict(sorted(files.items()))}
                manifest = dict(body, sha256=_ck._manifest_body_digest(body))
                _ck._write_new(os.path.join(vdir, _ck.MANIFEST), json.dumps(manifest, indent=1).encode())
                _ck._fsync_dir(vdir)
                _ck.publish(save_dir, tag, version, save_latest)
            except Exception as e:  # noqa: BLE001
                error = e
        _all_ok(engine, error)
    except BaseException:
        if rank == 0:
            _fs.rmtree(vdir, ignore_errors=True)
        raise
    return os.path.join(save_dir, tag)


def _write_rank(engine, vdir, rank, world):
    """Writes this rank's two files; returns their manifest entries (hashed as they were written)."""
    index = []
    offset = 0
    h = hashlib.sha256()
    with _fs.create_new(os.path.join(vdir, f"rank{rank}.bin")) as f:
        for s in engine._slots:
            if s.pid is None:
                continue
            buf = torch.empty(s.zero_count, dtype=torch.float32)
            for kind in _KINDS:
                if kind == "master":
                    engine.native_optimizer.read_param(s.pid, buf)
                else:
                    engine.native_optimizer.read_state(s.pid, kind, buf)
                raw = buf.numpy().tobytes()
                h.update(raw)
                f.write(raw)
            index.append({"name": s.name, "start": s.zero_start, "count": s.zero_count, "offset": offset})
            offset += 3 * 4 * s.zero_count
        f.sync()
    part = {
        "format": FORMAT,
        "rank": rank,
        "world": world,
        "params": index,
        "group_steps": [engine.native_optimizer.group_step(g) for g in range(engine.native_optimizer.group_count)],
        "rng_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    part_bytes = json.dumps(part, indent=1).encode()
    _ck._write_new(os.path.join(vdir, f"rank{rank}.json"), part_bytes)
    return {
        f"rank{rank}.bin": {"bytes": offset, "sha256": h.hexdigest()},
        f"rank{rank}.json": _entry(part_bytes),
    }


def _write_meta(engine, vdir, world, client_state):
    meta = {
        "format": FORMAT,
        "world": world,
        "stage": engine._zero.stage if engine._zero is not None else 0,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "compute_dtype": engine.compute_dtype_name,
        "params": [{"name": s.name, "shape": list(s.shape), "trainable": s.trainable} for s in engine._slots],
        "scheduler": engine.scheduler.state_dict() if engine.scheduler else None,
        "client_state": client_state,
    }
    data = json.dumps(meta, indent=1, allow_nan=True).encode()
    _ck._write_new(os.path.join(vdir, "meta.json"), data)
    return _entry(data)


def is_rank_checkpoint(load_dir, tag):
    """Whether ``load_dir``'s checkpoint ``tag`` (None: latest) was saved by ranks."""
    try:
        path = resolve(load_dir, tag)
        with open(os.path.join(path, "meta.json"), "rb") as f:
            return json.loads(f.read()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def resolve(load_dir, tag):
    load_dir = os.fspath(load_dir)
    tag = _load.latest_tag(load_dir) if tag is None else _ck.check_tag(tag)
    return _load._resolve(load_dir, tag)


def read_verified(path, wanted=None):
    """The checkpoint in ``path``: its meta and rank maps, checked against the manifest
    (``tier.DataLoss`` when a file does not match). The small files (meta and rank maps) are
    always checked; of the ``.bin`` files, those ``wanted(meta, parts)`` names (None: all)."""
    try:
        with open(os.path.join(path, _ck.MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
        body = {"format": manifest["format"], "files": manifest["files"]}
        ok = manifest["sha256"] == _ck._manifest_body_digest(body)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _tier.DataLoss(f"checkpoint {path}: {_ck.MANIFEST} is missing or damaged ({e})") from None
    if not ok:
        raise _tier.DataLoss(f"checkpoint {path}: {_ck.MANIFEST} does not match its own checksum")
    if body["format"] != FORMAT:
        raise ValueError(f"checkpoint {path}: format {body['format']!r} is not {FORMAT}")
    for name in body["files"]:
        fpath = os.path.join(path, name)
        if os.path.basename(name) != name or not os.path.isfile(fpath):
            raise _tier.DataLoss(f"checkpoint {path}: {name} is missing (listed in {_ck.MANIFEST})")

    def verify(name):
        entry = body["files"][name]
        n, digest = _ck._sha256_file(os.path.join(path, name))
        if n != entry.get("bytes") or digest != entry.get("sha256"):
            raise _tier.DataLoss(f"checkpoint {path}: {name} does not match the manifest")

    bins = sorted(n for n in body["files"] if n.endswith(".bin"))
    for name in sorted(body["files"]):
        if name not in bins:
            verify(name)
    with open(os.path.join(path, "meta.json"), "rb") as f:
        meta = json.loads(f.read())
    world = int(meta["world"])
    parts = []
    for r in range(world):
        if f"rank{r}.json" not in body["files"] or f"rank{r}.bin" not in body["files"]:
            raise _tier.DataLoss(f"checkpoint {path}: rank {r}'s files are not listed (saved at world {world})")
        with open(os.path.join(path, f"rank{r}.json"), "rb") as f:
            parts.append(json.loads(f.read()))
    need = set(bins) if wanted is None else set(wanted(meta, parts)) & set(bins)
    for name in bins:
        if name in need:
            verify(name)
    return meta, parts


def _files_read_by(engine):
    """``read_verified``'s ``wanted`` for a rank that loads: the saved ranks' files that hold part
    of its ranges, and frozen.bin. Every file some rank reads is checked by that rank before any
    rank applies anything (the ranks agree on it first), and none is hashed by every rank."""
    ranges = {s.name: (s.zero_start, s.zero_start + s.zero_count) for s in engine._slots if s.pid is not None}

    def wanted(meta, parts):
        out = {"frozen.bin"}
        for p in parts:
            for e in p["params"]:
                r = ranges.get(e["name"])
                if r is not None and max(r[0], int(e["start"])) < min(r[1], int(e["start"]) + int(e["count"])):
                    out.add(f"rank{int(p['rank'])}.bin")
        return out

    return wanted


class _Pieces:
    """Reads ranges of a parameter's saved arrays, whichever saved ranks hold them."""

    def __init__(self, path, parts):
        self.path = path
        self.by_name = {}
        for part in parts:
            for e in part["params"]:
                self.by_name.setdefault(e["name"], []).append((part["rank"], e))
        self.files = {}

    def read(self, name, kind, start, count):
        out = torch.zeros(count, dtype=torch.float32)
        k = _KINDS.index(kind)
        for rank, e in self.by_name.get(name, []):
            lo, hi = max(start, e["start"]), min(start + count, e["start"] + e["count"])
            if lo >= hi:
                continue
            f = self.files.get(rank)
            if f is None:
                f = self.files[rank] = open(os.path.join(self.path, f"rank{rank}.bin"), "rb")
            f.seek(e["offset"] + (k * e["count"] + lo - e["start"]) * 4)
            raw = f.read((hi - lo) * 4)
            if len(raw) != (hi - lo) * 4:
                raise _tier.DataLoss(f"checkpoint {self.path}: rank{rank}.bin is shorter than its map says ({name})")
            out[lo - start : hi - start] = torch.frombuffer(bytearray(raw), dtype=torch.float32)
        return out

    def close(self):
        for f in self.files.values():
            f.close()


def load(engine, load_dir, tag):
    rank, world = _rank_world(engine)
    error = None
    try:
        path = resolve(load_dir, tag)
        meta, parts = read_verified(path, _files_read_by(engine))
        mine = [(s.name, list(s.shape), s.trainable) for s in engine._slots]
        theirs = [(p["name"], list(p["shape"]), p["trainable"]) for p in meta["params"]]
        if mine != theirs:
            raise ValueError(
                f"checkpoint {path} is for another model (its parameters' names, shapes or trainable flags differ)"
            )
        if meta["compute_dtype"] != engine.compute_dtype_name:
            raise ValueError(
                f"checkpoint {path} was saved with compute dtype {meta['compute_dtype']}, this engine computes in "
                f"{engine.compute_dtype_name}"
            )
        for e in (e for p in parts for e in p["params"]):
            if not all(_load._count(e.get(k)) for k in ("start", "count", "offset")):
                raise ValueError(f"checkpoint {path}: the range of {_ck._short(e.get('name'))} is not made of counts")
        covered = {}
        for p in parts:
            for e in p["params"]:
                covered[e["name"]] = covered.get(e["name"], 0) + e["count"]
        for s in engine._slots:
            if s.trainable and covered.get(s.name, 0) != s.numel:
                raise _tier.DataLoss(f"checkpoint {path}: the saved shards of {s.name} do not cover it")
        steps = parts[0]["group_steps"]
        if len(steps) != engine.native_optimizer.group_count:
            raise ValueError(
                f"checkpoint {path} has {len(steps)} parameter groups, this engine {engine.native_optimizer.group_count}"
            )
        if not all(_load._count(x) for x in steps):
            raise ValueError(f"checkpoint {path}: the step counters {_ck._short(steps)} are not counts")
        # Counters, scheduler state, the schedule's lr at the saved step and this rank's RNG state:
        # all tried before any rank changes anything.
        plan = _load._plan_schedule(engine, meta, path)
        if "client_state" not in meta:
            raise ValueError(f"checkpoint {path}: meta.json has no client_state")
        source = parts[rank] if rank < len(parts) else parts[0]
        rng_cpu = _load._tried_rng_state(
            _load._rng_tensor(source.get("rng_cpu"), torch.get_rng_state().numel(), path, "CPU"), path, "CPU"
        )
    except Exception as e:  # noqa: BLE001 (every rank must hear of it before anyone changes)
        error = e
    _all_ok(engine, error)

    pieces = _Pieces(path, parts)
    try:
        for s in engine._slots:
            if s.pid is None:
                continue
            for kind in _KINDS:
                engine.native_optimizer.write_state(s.pid, kind, pieces.read(s.name, kind, s.zero_start, s.zero_count))
    finally:
        pieces.close()
    for g, step in enumerate(steps):
        engine.native_optimizer.set_group_step(g, int(step))
    # The low-precision params from the masters, as the optimizer writes them.
    stage3 = engine._zero is not None and engine._zero.stage == 3
    for s in engine._slots:
        if s.pid is None:
            continue
        low = torch.empty(s.zero_count, dtype=engine.compute_dtype)
        engine.native_optimizer.read_param(s.pid, low)
        lease = engine.native.acquire(s.tid, "host", "read_write")
        flat = torch.from_dlpack(lease.as_tensor())
        at = 0 if stage3 else s.zero_start
        flat[at : at + s.zero_count] = low
        del flat, lease
    frozen = [s for s in engine._slots if not s.trainable]
    if frozen:
        esize = torch.empty(0, dtype=engine.compute_dtype).element_size()
        with open(os.path.join(path, "frozen.bin"), "rb") as f:
            for s in frozen:
                raw = f.read(s.numel * esize)
                if len(raw) != s.numel * esize:
                    raise _tier.DataLoss(f"checkpoint {path}: frozen.bin is shorter than the model needs ({s.name})")
                t = torch.frombuffer(bytearray(raw), dtype=engine.compute_dtype)
                if stage3:
                    shard = torch.zeros(s.zero_shard, dtype=engine.compute_dtype)
                    shard[: s.zero_count] = t[s.zero_start : s.zero_start + s.zero_count]
                    engine.native.write(s.tid, shard)
                else:
                    engine.native.write(s.tid, t)
    if engine._zero is not None and not stage3:
        engine._gather_updated_params()
    engine.native.flush()
    _load.restore_progress(engine, plan)
    torch.set_rng_state(rng_cpu)
    return path, meta["client_state"]


def consolidate(path):
    """Every trainable parameter's fp32 master (and every frozen one, widened) from a checkpoint
    saved by ranks, as one state dict of CPU tensors."""
    meta, parts = read_verified(path)
    pieces = _Pieces(path, parts)
    out = {}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[meta["compute_dtype"]]
    frozen_f = None
    try:
        for p in meta["params"]:
            numel = 1
            for d in p["shape"]:
                numel *= int(d)
            if p["trainable"]:
                out[p["name"]] = pieces.read(p["name"], "master", 0, numel).view(p["shape"])
            else:
                if frozen_f is None:
                    frozen_f = open(os.path.join(path, "frozen.bin"), "rb")
                esize = torch.empty(0, dtype=dtype).element_size()
                raw = frozen_f.read(numel * esize)
                out[p["name"]] = torch.frombuffer(bytearray(raw), dtype=dtype).float().view(p["shape"])
    finally:
        pieces.close()
        if frozen_f is not None:
            frozen_f.close()
    return out


__all__ = ["save", "load", "consolidate", "is_rank_checkpoint", "FORMAT"]
