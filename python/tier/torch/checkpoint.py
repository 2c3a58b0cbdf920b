"""Checkpoints of a TierEngine, in the manner of DeepSpeed's save/load_checkpoint.

Layout: ``<dir>/<tag>/`` holds ``optimizer.bin`` (the offloaded optimizer's streamed state: fp32
master params, Adam moments, step counters, hyper-parameters and loss scale, with per-record
checksums), ``frozen.bin`` (parameters without gradients, if any) and ``meta.json`` (parameter
names, shapes and dtypes, the engine's counters, scheduler state, RNG states, client state).
``<dir>/latest`` names the newest tag. A tag directory is written under a temporary name and
renamed when complete, so a crash never leaves a half checkpoint that looks whole. The trainable
parameters are restored from their fp32 masters, so they are not stored twice.
"""

import json
import os
import shutil

import torch


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(engine, save_dir, tag, client_state):
    tag = tag or f"global_step{engine.global_steps}"
    if "/" in str(tag) or str(tag) in ("", ".", ".."):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name")
    os.makedirs(save_dir, exist_ok=True)
    final = os.path.join(save_dir, str(tag))
    tmp = final + ".partial"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    engine.optimizer.save_checkpoint(os.path.join(tmp, "optimizer.bin"))
    frozen = [s for s in engine._slots if s.pid is None]
    if frozen:
        with open(os.path.join(tmp, "frozen.bin"), "wb") as f:
            for s in frozen:
                f.write(engine.parameter(s.name).contiguous().view(torch.uint8).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
    meta = {
        "format": "tier-checkpoint-1",
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "compute_dtype": engine.compute_dtype_name,
        "params": [
            {"name": s.name, "shape": list(s.shape), "trainable": s.pid is not None, "partition": s.pid} for s in engine._slots
        ],
        "scheduler": engine.scheduler.state_dict() if engine.scheduler else None,
        "client_state": client_state,
    }
    _write_atomic(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
    torch.save({"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
               os.path.join(tmp, "rng.pt"))
    _fsync_dir(tmp)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(save_dir)
    _write_atomic(os.path.join(save_dir, "latest"), str(tag))
    return final


def load(engine, load_dir, tag):
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.exists(latest):
            raise FileNotFoundError(f"checkpoint directory {load_dir!r} has no 'latest' file; pass tag=")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(load_dir, str(tag))
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("format") != "tier-checkpoint-1":
        raise ValueError(f"{path}: not a tier checkpoint (format {meta.get('format')!r})")
    names = [(p["name"], tuple(p["shape"]), p["trainable"]) for p in meta["params"]]
    mine = [(s.name, tuple(s.shape), s.pid is not None) for s in engine._slots]
    if names != mine:
        diff = next(((a, b) for a, b in zip(names, mine) if a != b), None)
        raise ValueError(
            f"{path}: the checkpoint's parameters do not match the model's "
            f"(first difference: checkpoint {diff[0] if diff else len(names)} vs model {diff[1] if diff else len(mine)})"
        )
    if meta["compute_dtype"] != engine.compute_dtype_name:
        raise ValueError(
            f"{path}: saved with compute dtype {meta['compute_dtype']}, the engine uses {engine.compute_dtype_name}"
        )
    engine.optimizer.load_checkpoint(os.path.join(path, "optimizer.bin"))
    # Trainable parameters come back from their fp32 masters.
    for s in engine._slots:
        if s.pid is None:
            continue
        low = torch.empty(s.shape, dtype=engine.compute_dtype)
        engine.optimizer.read_params(s.pid, engine.compute_dtype_name, low)
        engine.native.write(s.tid, low)
    frozen = [s for s in engine._slots if s.pid is None]
    if frozen:
        with open(os.path.join(path, "frozen.bin"), "rb") as f:
            for s in frozen:
                nbytes = s.numel * torch.empty(0, dtype=engine.compute_dtype).element_size()
                raw = f.read(nbytes)
                if len(raw) != nbytes:
                    raise ValueError(f"{path}/frozen.bin is truncated at parameter {s.name!r}")
                t = torch.frombuffer(bytearray(raw), dtype=engine.compute_dtype).reshape(s.shape)
                engine.native.write(s.tid, t)
    engine.native.flush()
    engine.global_steps = meta["global_steps"]
    engine.micro_steps = meta["micro_steps"]
    engine.skipped_steps = meta["skipped_steps"]
    if engine.scheduler is not None and meta.get("scheduler"):
        engine.scheduler.load_state_dict(meta["scheduler"])
    engine._apply_lr()
    rng = torch.load(os.path.join(path, "rng.pt"), weights_only=False)
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available() and rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])
    return path, meta["client_state"]
