"""Checkpoints of an engine partitioned over ranks (tier.torch.zero), loadable at any world size.

Layout of a version directory (format ``tier-checkpoint-zero-2``; the directory protocol, tags,
``latest``, manifests and garbage collection are those of :mod:`tier.torch.checkpoint`)::

    meta.json       (rank 0) names, shapes, counters, scheduler, client state, the world and stage
                    it was saved at
    frozen.bin      (rank 0, if any parameter is frozen) the frozen parameters, whole
    rank<N>.bin     rank N's optimizer state, written by the optimizer's own checkpoint writer
                    (C++, the format of a one-process optimizer.bin: docs/optimizer.md): one
                    partition per trainable parameter's owned range, its fp32 master and moments
                    in checksummed records, a trailer chaining their checksums
    rank<N>.json    rank N's partition map: for each partition, in order, the parameter's name and
                    the range it owns (start, count); its step counters and RNG state
    manifest.json   (rank 0, last) every file's size, and its SHA-256 (``frozen.bin`` and the JSON
                    files, hashed as they are written) or, for ``rank<N>.bin``, its trailer

Every rank writes its own files in parallel into the directory rank 0 created; rank 0 gathers
the sizes and digests and writes the manifest once all have synced theirs (no file is read back
to hash it), then switches the tag and ``latest``. A save killed on any rank leaves ``latest`` on
the previous complete checkpoint. The directory must be one that every rank sees (a shared or
local file system, as DeepSpeed's checkpoints).

Loading at the world size and partitioning it was saved with, each rank loads its own
``rank<N>.bin`` with the optimizer's loader (the one a one-process ``optimizer.bin`` goes
through): it checks every record's checksums and the trailer, and calls back once the whole file
has verified, before anything changes; there the ranks agree that every rank's file verified,
and only then does any of them apply its state. How many passes that reads is the loader's: one,
into the shadow slots, with two state copies on NVMe; a verifying pass and then a copying one
with one copy or host-resident state (docs/optimizer.md). Loading at another world size (or in
one process) reshards: each rank reads, from whichever saved ranks hold them, the elements of its
new ranges; it first verifies every file it will read (the readers' checksums), the ranks agree
that all checks passed, and then each reads them again to apply them, a few MiB at a time. Before
either, every rank checks the manifest, the small files, ``frozen.bin`` and the trailers of the
files it reads.
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

FORMAT = "tier-checkpoint-zero-2"
# Shards as raw fp32 arrays, hashed by SHA-256 (before the optimizer's own writer wrote them).
OLD_FORMAT = "tier-checkpoint-zero-1"


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
    """Writes this rank's two files; returns their manifest entries. rank<N>.bin is the
    optimizer's own checkpoint (written, fsynced and renamed into place by its C++ writer), listed
    by its size and trailer, which chains the checksums of all its records: no byte is hashed twice."""
    index = []
    for s in engine._slots:
        if s.pid is None:
            continue
        if s.pid != len(index):
            raise RuntimeError(f"save_checkpoint: parameter {s.name} is partition {s.pid}, expected {len(index)}")
        index.append({"name": s.name, "start": s.zero_start, "count": s.zero_count})
    state = os.path.join(vdir, f"rank{rank}.bin")
    engine.native_optimizer.save(state)
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
    return {f"rank{rank}.bin": _ck.reader_checked_entry(state), f"rank{rank}.json": _entry(part_bytes)}


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
            return json.loads(f.read()).get("format") in (FORMAT, OLD_FORMAT)
    except (OSError, ValueError):
        return False


def resolve(load_dir, tag):
    load_dir = os.fspath(load_dir)
    tag = _load.latest_tag(load_dir) if tag is None else _ck.check_tag(tag)
    return _load._resolve(load_dir, tag)


def read_verified(path, wanted=None):
    """The checkpoint in ``path``: its meta and rank maps, checked against the manifest
    (``tier.DataLoss`` when a file does not match). The small files (meta and rank maps) are
    always checked, and every ``rank<N>.bin``'s size and trailer (32 bytes read); of the other
    ``.bin`` files (``frozen.bin``), those ``wanted(meta, parts)`` names (None: all) are hashed.
    (A file the manifest lists by its SHA-256 instead of its trailer is hashed.)
    The records of a ``rank<N>.bin`` are checked by the optimizer's reader as they are read."""
    try:
        with open(os.path.join(path, _ck.MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
        body = {"format": manifest["format"], "files": manifest["files"]}
        ok = manifest["sha256"] == _ck._manifest_body_digest(body)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _tier.DataLoss(f"checkpoint {path}: {_ck.MANIFEST} is missing or damaged ({e})") from None
    if not ok:
        raise _tier.DataLoss(f"checkpoint {path}: {_ck.MANIFEST} does not match its own checksum")
    if body["format"] == OLD_FORMAT:
        raise ValueError(
            f"checkpoint {path} has format {OLD_FORMAT}, whose shards this tier no longer reads (it reads "
            f"{FORMAT}, written by the optimizer's own checkpoint writer); load it with the tier that saved it and "
            "consolidate it (python -m tier.torch.zero_to_fp32), or keep training with that tier"
        )
    if body["format"] != FORMAT:
        raise ValueError(f"checkpoint {path}: format {body['format']!r} is not {FORMAT} (the one this tier reads)")
    for name in body["files"]:
        fpath = os.path.join(path, name)
        if os.path.basename(name) != name or not os.path.isfile(fpath) or os.path.islink(fpath):
            raise _tier.DataLoss(f"checkpoint {path}: {name} is missing (listed in {_ck.MANIFEST})")

    def verify(name):
        entry = body["files"][name]
        if "trailer" in entry:
            got = _ck.reader_checked_entry(os.path.join(path, name))
            ok = got == {"bytes": entry.get("bytes"), "trailer": entry.get("trailer")}
        else:
            n, digest = _ck._sha256_file(os.path.join(path, name))
            ok = n == entry.get("bytes") and digest == entry.get("sha256")
        if not ok:
            raise _tier.DataLoss(f"checkpoint {path}: {name} does not match the manifest")

    hashed = sorted(n for n in body["files"] if n.endswith(".bin") and "trailer" not in body["files"][n])
    for name in sorted(body["files"]):
        if name not in hashed:
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
    # (A rank<N>.bin listed by its SHA-256, as a re-signed manifest lists it, is hashed too.)
    need = set(hashed) if wanted is None else (set(wanted(meta, parts)) | {n for n in hashed if n.startswith("rank")})
    for name in hashed:
        if name in need:
            verify(name)
    return meta, parts


def _check_partitions(path, rank, part):
    """rank<N>.bin's partitions (from its checked header and metadata) must be its map's ranges."""
    fpath = os.path.join(path, f"rank{rank}.bin")
    got = [(name, numel) for name, numel, _ in _tier.checkpoint_partitions(fpath)]
    want = [(e["name"], e["count"]) for e in part["params"]]
    if got != want:
        raise _tier.DataLoss(
            f"checkpoint {path}: rank{rank}.bin holds {len(got)} partitions that are not the {len(want)} ranges "
            f"rank{rank}.json lists"
        )
    return fpath


def _ranks_read_by(engine, parts):
    """The saved ranks whose ranges overlap this rank's (the files it reads to reshard)."""
    ranges = {s.name: (s.zero_start, s.zero_start + s.zero_count) for s in engine._slots if s.pid is not None}
    out = []
    for r, p in enumerate(parts):
        for e in p["params"]:
            lo_hi = ranges.get(e["name"])
            if lo_hi is not None and max(lo_hi[0], e["start"]) < min(lo_hi[1], e["start"] + e["count"]):
                out.append(r)
                break
    return out


def _reshard_into(engine, fpath, part):
    """Writes the elements of this rank's ranges that saved file ``fpath`` (with map ``part``)
    holds into the optimizer's state, streamed piece by piece (a few MiB at a time)."""
    entries = part["params"]
    mine = {s.name: s for s in engine._slots if s.pid is not None}
    write = engine.native_optimizer.write_state

    def visit(pid, kind, offset, values):
        e = entries[pid]
        s = mine.get(e["name"])
        if s is None:
            return
        lo = e["start"] + offset
        a, b = max(lo, s.zero_start), min(lo + len(values), s.zero_start + s.zero_count)
        if a < b:
            write(s.pid, kind, values[a - lo : b - lo], offset=a - s.zero_start)

    _tier.read_checkpoint_state(fpath, visit)


def load(engine, load_dir, tag):
    rank, world = _rank_world(engine)
    error = None
    same = False
    try:
        path = resolve(load_dir, tag)
        meta, parts = read_verified(path, lambda meta, parts: {"frozen.bin"})
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
            if not all(_load._count(e.get(k)) for k in ("start", "count")):
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
        owned = [(s.name, s.zero_start, s.zero_count) for s in engine._slots if s.pid is not None]
        same = len(parts) == world and [(e["name"], e["start"], e["count"]) for e in parts[rank]["params"]] == owned
        if same:
            own = _check_partitions(path, rank, parts[rank])
        else:
            # Resharding: every file this rank reads, verified whole (the optimizer's reader
            # checks every record and the trailer) before any rank changes anything.
            files = [(_check_partitions(path, r, parts[r]), parts[r]) for r in _ranks_read_by(engine, parts)]
            for fpath, _ in files:
                _tier.read_checkpoint_masters(fpath, [None] * len(_tier.checkpoint_partitions(fpath)))
    except Exception as e:  # noqa: BLE001 (every rank must hear of it before anyone changes)
        error = e
    _all_ok(engine, error)

    if same:
        # This rank's own file, read and checked once: the ranks agree once each has verified its
        # file, before any of them commits it.
        agreeing = []

        def before_commit():
            agreeing.append(True)
            _all_ok(engine, None)  # raises (out of load, nothing changed) when another rank refused
            return True

        try:
            engine.native_optimizer.load(own, before_commit=before_commit)
        except Exception as e:
            if not agreeing:
                _all_ok(engine, e)  # the other ranks wait in their before_commit: they hear of it
            raise
    else:
        for fpath, part in files:
            _reshard_into(engine, fpath, part)
        for g, step in enumerate(steps):
            engine.native_optimizer.set_group_step(g, int(step))
    # The low-precision params from the masters, as the optimizer writes them.
    stage3 = engine._zero is not None and engine._zero.stage == 3
    for s in engine._slots:
        if s.pid is not None:
            engine._param_from_master(s)
    frozen = [s for s in engine._slots if not s.trainable]
    if frozen:
        esize = torch.empty(0, dtype=engine.compute_dtype).element_size()
        with open(os.path.join(path, "frozen.bin"), "rb") as f:
            for s in frozen:
                raw = f.read(s.numel * esize)
                if len(raw) != s.numel * esize:
                    raise _tier.DataLoss(f"checkpoint {path}: frozen.bin is shorter than the model needs ({s.name})")
                engine._write_frozen(s, torch.frombuffer(bytearray(raw), dtype=engine.compute_dtype))
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
    out = {}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[meta["compute_dtype"]]
    flat = {}
    for p in meta["params"]:
        if p["trainable"]:
            numel = 1
            for d in p["shape"]:
                numel *= int(d)
            flat[p["name"]] = torch.empty(numel, dtype=torch.float32)
    for r, part in enumerate(parts):
        fpath = _check_partitions(path, r, part)
        views = []
        for e in part["params"]:
            whole = flat.get(e["name"])
            if whole is None or not (_load._count(e.get("start")) and _load._count(e.get("count"))):
                raise _tier.DataLoss(
                    f"checkpoint {path}: rank{r}.json lists {_ck._short(e.get('name'))}, not a trainable parameter's range"
                )
            if e["start"] + e["count"] > whole.numel():
                raise _tier.DataLoss(f"checkpoint {path}: rank{r}.json's range of {e['name']} runs past it")
            views.append(whole[e["start"] : e["start"] + e["count"]])
        _tier.read_checkpoint_masters(fpath, views)
    frozen_f = None
    try:
        for p in meta["params"]:
            if p["trainable"]:
                out[p["name"]] = flat[p["name"]].view(p["shape"])
            else:
                if frozen_f is None:
                    frozen_f = open(os.path.join(path, "frozen.bin"), "rb")
                esize = torch.empty(0, dtype=dtype).element_size()
                numel = 1
                for d in p["shape"]:
                    numel *= int(d)
                raw = frozen_f.read(numel * esize)
                if len(raw) != numel * esize:
                    raise _tier.DataLoss(f"checkpoint {path}: frozen.bin is shorter than the model needs ({p['name']})")
                out[p["name"]] = torch.frombuffer(bytearray(raw), dtype=dtype).float().view(p["shape"])
    finally:
        if frozen_f is not None:
            frozen_f.close()
    return out


__all__ = ["save", "load", "consolidate", "is_rank_checkpoint", "FORMAT"]
