"""Checkpoints of a TierEngine, in the manner of DeepSpeed's save/load_checkpoint.

Layout of ``<dir>`` (format ``tier-checkpoint-2``)::

    <dir>/latest             a file naming the newest tag
    <dir>/<tag>              a symlink to the tag's current version directory
    <dir>/<tag>~<version>/   one save: optimizer.bin, frozen.bin (if any parameter is frozen),
                             meta.json, manifest.json

``optimizer.bin`` is the offloaded optimizer's streamed state (fp32 master params, Adam moments,
step counters, hyper-parameters and loss scale, with per-record checksums); ``frozen.bin`` holds
the parameters without gradients; ``meta.json`` holds parameter names and shapes, the engine's
counters, the scheduler state, the RNG states (base64 of the raw generator bytes: no pickle
anywhere) and the client state. ``manifest.json`` is written last: the size of every other file,
its SHA-256 (``frozen.bin`` and ``meta.json``, taken as they are written) or, for
``optimizer.bin``, its 32-byte trailer, plus a SHA-256 of the manifest's own body. A version
directory without a manifest that verifies is not a checkpoint. Each byte is checked once per
save and once per load: the trailer chains the CRCs of the file's header and of every record
(docs/optimizer.md), and the optimizer's reader checks every byte against them as it loads, so
``optimizer.bin`` (the largest file) is not read a second time to hash it. The trainable parameters come back from their fp32 masters, so
they are not stored twice.

Save protocol. Each save writes a new, uniquely named version directory, so nothing that a reader
may be using is modified in place:

1. write the files into ``<tag>~<version>/`` (mode 0700; files 0600) and fsync each;
2. write ``manifest.json`` last, fsync it, fsync the version directory;
3. point ``<tag>`` at the new version: create a symlink under a temporary name and rename it over
   ``<tag>`` (rename replaces a symlink atomically), fsync ``<dir>``;
4. switch ``latest``: write a temporary file, fsync, rename over ``latest``, fsync ``<dir>``;
5. only now remove versions that no tag points to any more (the tag's previous version, and
   leftovers of saves that were killed).

Killed at any point, ``latest`` names a tag whose symlink points to a complete, fsynced version:
before step 3 the old tag and the old ``latest`` are untouched; after it the tag already names
the new complete version. Leftovers of a killed save are removed by the next successful save.
Only names matching tier's own patterns are ever removed from ``<dir>``, and a ``<dir>/<tag>`` that
is not tier's (a user's file, folder or symlink) is refused, never replaced.

Every write, fsync, rename, symlink, mkdir and removal of a save goes through tier's file layer
(:mod:`tier.fs`; the optimizer's C++ writer uses the same layer), so the crash tests can cut the
power at each sync point of a whole save (tests/python/test_power_loss.py). Creating ``<dir>``
fsyncs its parent, so the first save into a new directory survives a power cut too.

One writer per directory: a save holds an exclusive ``flock`` on ``<dir>/.tier-writer.lock``
(created ``O_NOFOLLOW``, mode 0600; it holds the writer's pid, host and start time) from before
its version directory is made until its garbage collection is done. A second save into the same
directory, from any process, fails at once with ``tier.FailedPrecondition`` naming the holder; the
lock goes with the process that holds it (a killed writer holds nothing). The optimizer's C++
writer takes no lock of its own (it writes one file inside the version directory), so there is
one lock, taken by this outer layer. A reader in another process during a save may find its
version removed. Every file is created ``O_EXCL|O_NOFOLLOW`` (see :mod:`tier.torch.atomic_file`).

Load protocol: every file is read and checked against the manifest and every field of the
metadata is parsed and validated before the engine is touched; then everything is applied. The
values are tried before anything changes: the RNG states on throwaway generators, the scheduler
state on a copy of the scheduler, the learning rates it gives for the saved step count; the
counters must be integers in [0, 2^53), and the optimizer's reader checks every hyper-parameter's
range before it replaces any state. ``latest`` must be a regular file of ``<dir>`` (a symlink is
refused, never followed) holding a plain tag; what it holds otherwise is not shown in the error. A
checksum mismatch raises ``tier.DataLoss``, a checkpoint for another model raises ValueError, and
in both cases the engine is unchanged. If ``<tag>``'s symlink is missing (a directory from the
old format was being moved aside when the process died), the newest version of that tag whose
manifest verifies is used.

Old checkpoints (format ``tier-checkpoint-1``: a plain ``<dir>/<tag>/`` with ``rng.pt``) still
load: they have no checksums, but their metadata is validated before anything is applied and
``rng.pt`` is read with ``torch.load(weights_only=True)``, so it cannot run code. Saving over
such a tag moves the old directory aside as a version of the tag.

The load side (``load``, ``consolidate``, ``latest_tag``) is :mod:`tier.torch.checkpoint_load`.

Offline, :func:`~tier.torch.checkpoint_load.consolidate` (``python -m tier.torch.zero_to_fp32``)
reads a checkpoint without an engine into one fp32 state dict: the trainable masters from ``optimizer.bin`` through the
optimizer's native reader (``tier._tier.read_checkpoint_masters``), the frozen parameters from
``frozen.bin``.
"""

import base64
import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import socket
import stat
import time
import warnings

import torch

from .. import _tier
from .. import fs as _fs
from .atomic_file import fsync_dir

FORMAT = "tier-checkpoint-2"
OLD_FORMAT = "tier-checkpoint-1"
MANIFEST = "manifest.json"
LATEST = "latest"
LOCK = ".tier-writer.lock"
MAX_COUNT = (1 << 53) - 1  # counters survive a round trip through a JSON double

_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,127}"
_TAG_RE = re.compile(_TAG)
_VERSION_RE = re.compile(rf"(?P<tag>{_TAG})~(?P<ns>[0-9a-f]{{1,16}})-(?P<pid>[0-9]+)-(?P<rand>[0-9a-f]{{8}})")
_TEMP_RE = re.compile(r"\.(?:link|latest)~" + _VERSION_RE.pattern)
_CHUNK = 1 << 20


def check_tag(tag, what="checkpoint tag"):
    """Returns ``tag`` as a str if it is a plain name (letters, digits, ``_ . + = -``, not starting
    with a dot, no ``..``, at most 128 characters, not ``latest``); else raises ValueError."""
    s = str(tag)
    if not _TAG_RE.fullmatch(s) or ".." in s or s == LATEST:
        raise ValueError(
            f"{what} {_short(s)}: not a plain name; use 1-128 of A-Z a-z 0-9 _ . + = -, not starting with "
            f"'.', without '..', path separators or absolute paths, and not {LATEST!r}"
        )
    return s


def _short(value, limit=80):
    """``repr(value)`` cut to ``limit`` characters, for quoting untrusted input in a message."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


# ---------------------------------------------------------------------------- small file helpers
_fsync_dir = fsync_dir


def _write_new(path, data):
    """Creates ``path`` (0600, must not exist: ``O_EXCL|O_NOFOLLOW``), writes ``data`` and fsyncs it."""
    _fs.write_new(path, data, 0o600)


# ---------------------------------------------------------------------------- one writer per directory
def _holder(fd):
    """Who holds the lock, from what it wrote into the lock file (sanitised: never raw content)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        pid, host, since = info["pid"], info["host"], info["since"]
        if not isinstance(pid, int) or not 0 < pid < 1 << 32 or not isinstance(host, str) or not isinstance(since, str):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        return "a writer that has not said who it is yet"
    host = re.sub(r"[^A-Za-z0-9_.:-]", "?", host)[:64]
    since = re.sub(r"[^0-9A-Za-z:+.-]", "?", since)[:40]
    return f"pid {pid} on host {host}, saving since {since}"


@contextlib.contextmanager
def writer_lock(directory):
    """Holds ``<directory>/.tier-writer.lock`` exclusively (``flock``) for the block; raises
    ``tier.FailedPrecondition`` at once, naming the holder, if another writer holds it."""
    path = os.path.join(directory, LOCK)
    try:
        lock = _fs.open_file(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FileExistsError(
                f"checkpoint directory {directory}: {LOCK} is a symbolic link, not tier's lock file; remove it"
            ) from None
        raise
    held = False
    fd = lock.fileno()
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileExistsError(f"checkpoint directory {directory}: {LOCK} is not a regular file; remove it")
        try:
            lock.lock(exclusive=True, wait=False)
        except BlockingIOError:
            raise _tier.FailedPrecondition(
                f"checkpoint directory {directory} is being saved into by another writer ({_holder(fd)}; see {path}); "
                "one process saves into a checkpoint directory at a time: wait for that save to end, or save into "
                "another directory"
            ) from None
        held = True
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        lock.truncate(0)
        lock.pwrite(json.dumps(me).encode(), 0)
        yield
    finally:
        if held:
            with contextlib.suppress(OSError):
                lock.truncate(0)  # released: nobody is named any more
        # Closing the last descriptor releases the flock (an error closing it still closes it).
        with contextlib.suppress(OSError):
            lock.close()


def _sha256_file(path):
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                break
            h.update(b)
            n += len(b)
    return n, h.hexdigest()


TRAILER_BYTES = 32  # optimizer.bin's trailer (docs/optimizer.md)


def reader_checked_entry(path):
    """The manifest entry of a file the optimizer's reader checks byte by byte as it loads
    (optimizer.bin): its size and its trailer, which chains the CRCs of the file's header and of
    every record, so that a file with other contents has another trailer. Reads 32 bytes."""
    with open(path, "rb") as f:
        n = f.seek(0, os.SEEK_END)
        if n < TRAILER_BYTES:
            raise _tier.DataLoss(f"{path}: {n} bytes, shorter than its trailer")
        f.seek(n - TRAILER_BYTES)
        tail = f.read(TRAILER_BYTES)
    return {"bytes": n, "trailer": tail.hex()}


def _manifest_body_digest(body):
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _new_version(tag):
    return f"{tag}~{time.time_ns():016x}-{os.getpid()}-{secrets.token_hex(4)}"


def _version_time(name):
    return int(_VERSION_RE.fullmatch(name).group("ns"), 16)


def _tags(directory):
    """The tags in ``directory``: valid names that are symlinks or plain directories."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    out = []
    for n in sorted(names):
        try:
            check_tag(n)
        except ValueError:
            continue
        p = os.path.join(directory, n)
        if os.path.islink(p) or os.path.isdir(p):
            out.append(n)
    return out


def _link_target(directory, tag):
    """The version directory name ``<dir>/<tag>`` points to, validated, or None if not a symlink."""
    p = os.path.join(directory, tag)
    if not os.path.islink(p):
        return None
    target = os.readlink(p)
    m = _VERSION_RE.fullmatch(target)
    if m is None or m.group("tag") != tag:
        raise ValueError(f"checkpoint {p} is a symlink to {target!r}, which is not a version of tag {tag!r}")
    return target


# ---------------------------------------------------------------------------- save
def save(engine, save_dir, tag, client_state, save_latest=True):
    tag = check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    save_dir = os.fspath(save_dir)
    meta = {
        "format": FORMAT,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "compute_dtype": engine.compute_dtype_name,
        "params": [
            {"name": s.name, "shape": list(s.shape), "trainable": s.pid is not None, "partition": s.pid}
            for s in engine._slots
        ],
        "scheduler": engine.scheduler.state_dict() if engine.scheduler else None,
        "rng": {
            "cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
            "cuda": [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
            if torch.cuda.is_available() else [],
        },
        "client_state": client_state,
    }
    # Fails here, before anything is written, if the client state is not JSON.
    meta_bytes = json.dumps(meta, indent=1, allow_nan=True).encode()

    _fs.makedirs(save_dir, mode=0o700, exist_ok=True)
    final = os.path.join(save_dir, tag)
    _check_replaceable(final, tag)  # before the lock too: a refused tag leaves the directory as it was
    with writer_lock(save_dir):
        _check_replaceable(final, tag)
        collect_garbage_first(save_dir)
        _save_locked(engine, save_dir, tag, final, meta_bytes, save_latest)
    return final


def collect_garbage_first(save_dir):
    """Before a save writes anything: what earlier killed saves left goes now, not only once a
    save completes, so saves killed one after another leave no more than the last one's debris.
    A failure here is reported and the save goes on (the end of the save collects again)."""
    try:
        _collect_garbage(save_dir)
    except OSError as e:
        warnings.warn(f"tier: could not remove the leftovers of earlier saves in {save_dir}: {e}", stacklevel=3)


def _save_locked(engine, save_dir, tag, final, meta_bytes, save_latest):
    version = _new_version(tag)
    vdir = os.path.join(save_dir, version)
    _fs.mkdir(vdir, 0o700)
    try:
        opt = os.path.join(vdir, "optimizer.bin")
        engine.native_optimizer.save(opt)  # fsyncs the file and the directory entry itself
        _fs.chmod(opt, 0o600)
        files = {"optimizer.bin": reader_checked_entry(opt)}
        frozen = [s for s in engine._slots if s.pid is None]
        if frozen:
            # One parameter at a time: a frozen base model may not fit in host memory at once.
            with _fs.create_new(os.path.join(vdir, "frozen.bin")) as f:
                h, n = hashlib.sha256(), 0
                for s in frozen:
                    raw = engine.parameter(s.name).contiguous().view(torch.uint8).numpy().tobytes()
                    h.update(raw)
                    n += len(raw)
                    f.write(raw)
                f.sync()
            files["frozen.bin"] = {"bytes": n, "sha256": h.hexdigest()}
        _write_new(os.path.join(vdir, "meta.json"), meta_bytes)
        files["meta.json"] = {"bytes": len(meta_bytes), "sha256": hashlib.sha256(meta_bytes).hexdigest()}
        body = {"format": FORMAT, "files": dict(sorted(files.items()))}
        manifest = dict(body, sha256=_manifest_body_digest(body))
        _write_new(os.path.join(vdir, MANIFEST), json.dumps(manifest, indent=1).encode())
        _fsync_dir(vdir)
    except BaseException:
        _fs.rmtree(vdir, ignore_errors=True)
        raise
    publish(save_dir, tag, version, save_latest)


def publish(save_dir, tag, version, save_latest):
    """Steps 3 to 5 of the save protocol: points ``<tag>`` at the complete, fsynced ``version``,
    then ``latest`` at the tag (each made durable by an fsync of ``save_dir``), then collects the
    garbage. Shared by the per-rank checkpoints (:mod:`tier.torch.zero_checkpoint`)."""
    # A plain directory of the old format is moved aside first (as a version of the tag, which
    # load falls back to) since rename cannot replace it.
    final = os.path.join(save_dir, tag)
    link_tmp = os.path.join(save_dir, f".link~{version}")
    _fs.symlink(version, link_tmp)
    if os.path.isdir(final) and not os.path.islink(final):
        _fs.rename(final, os.path.join(save_dir, _new_version(tag)))
    _fs.replace(link_tmp, final)
    _fsync_dir(save_dir)

    if save_latest:
        latest_tmp = os.path.join(save_dir, f".latest~{version}")
        _write_new(latest_tmp, tag.encode())
        _fs.replace(latest_tmp, os.path.join(save_dir, LATEST))
        _fsync_dir(save_dir)

    _collect_garbage(save_dir)


def _is_old_checkpoint(path):
    try:
        with open(os.path.join(path, "meta.json"), "rb") as f:
            return json.loads(f.read()).get("format") == OLD_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _check_replaceable(final, tag):
    """A save may replace ``<dir>/<tag>`` only if it is tier's: a symlink to a version of the tag
    or a checkpoint directory of the old format. Anything else may be the user's: refuse."""
    if os.path.islink(final):
        _link_target(os.path.dirname(final), tag)  # ValueError if it points anywhere else
    elif os.path.lexists(final) and not (os.path.isdir(final) and _is_old_checkpoint(final)):
        raise FileExistsError(
            f"{final} exists and is not a tier checkpoint; tier will not replace it: choose another tag or move it"
        )


def _collect_garbage(directory):
    """Removes tier's own leftovers: versions that their tag's symlink does not point to (only
    when that symlink exists and resolves) and temporary names of killed saves."""
    names = os.listdir(directory)
    current = {}
    for n in names:
        try:
            check_tag(n)
            target = _link_target(directory, n)
        except ValueError:
            continue
        if target is not None and os.path.isdir(os.path.join(directory, target)):
            current[n] = target
    for n in names:
        p = os.path.join(directory, n)
        m = _VERSION_RE.fullmatch(n)
        if m is not None:
            tag = m.group("tag")
            if tag in current and current[tag] != n and not os.path.islink(p):
                _fs.rmtree(p, ignore_errors=True)
        elif _TEMP_RE.fullmatch(n) and (os.path.islink(p) or os.path.isfile(p)):
            try:
                _fs.unlink(p)
            except FileNotFoundError:
                pass
