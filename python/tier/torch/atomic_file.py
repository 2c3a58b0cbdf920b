"""Files written whole or not at all, through no path that another user controls.

Every file tier writes from Python (``save_pretrained``'s shards, index and configs,
``save_16bit_model``, ``zero_to_fp32``'s output, the checkpoints) is created by one of these:

* :func:`atomic_write` opens a fresh temporary file in the target's folder, named
  ``.<name>.<pid>.<random>.tmp`` and created with ``O_CREAT|O_EXCL|O_NOFOLLOW``: a file or symlink
  that someone planted under a predictable name (``<name>.tmp``) is never opened, so it can
  neither redirect the write nor be truncated. On success the file is fsynced, renamed over the
  target (a rename replaces a symlink at the target; it does not follow it) and the folder is
  fsynced; on an error the temporary file is removed and the target is untouched.
* :func:`private_dir` makes a fresh folder (mode 0700, unpredictable name) inside the target
  folder for writers that take a folder (``transformers``' ``save_pretrained`` of a config);
  :func:`publish` moves a finished file from there over its final name the same way.

The C++ side has the same helper (``src/core/atomic_file.hpp``) for the trace and the optimizer's
checkpoint. Both go through tier's file layer (:mod:`tier.fs`): every create, write, fsync, rename
and removal here is one a test can fail or cut the power at.
"""

import contextlib
import os
import secrets

from .. import fs as _fs
from ..fs import fsync_dir


def _temp_name(path):
    directory, name = os.path.split(os.fspath(path))
    if not name:
        raise ValueError(f"{path!r} names a folder, not a file; give a file name")
    stem = name[:160]  # keeps the temporary name within NAME_MAX
    return directory or ".", os.path.join(directory, f".{stem}.{os.getpid()}.{secrets.token_hex(8)}.tmp")


def create_new(path, mode=0o600):
    """A fresh file at exactly ``path`` (``O_CREAT|O_EXCL|O_NOFOLLOW``: refused if anything, even
    a dangling symlink, is there), opened for binary writing (a :class:`tier.fs.File`: ``sync()``
    makes it durable). For files inside a folder tier just made itself; :func:`atomic_write` for
    anything else."""
    return _fs.create_new(path, mode)


@contextlib.contextmanager
def atomic_write(path, mode=0o666):
    """``with atomic_write(path) as f: f.write(...)``: ``f`` is a binary file; ``path`` gets its
    content only when the block ends without an error (fsynced, renamed, the folder fsynced).
    ``mode``: the permission bits of the new file, less the umask (0o666: as ``open()`` makes it;
    0o600 for private data)."""
    path = os.fspath(path)
    directory, tmp = _temp_name(path)
    for _ in range(100):
        try:
            f = _fs.create_new(tmp, mode)
            break
        except FileExistsError:
            directory, tmp = _temp_name(path)
    else:
        raise FileExistsError(f"{path}: no fresh temporary file name in {directory} after 100 tries")
    try:
        with f:
            yield f
            f.sync()
        _fs.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            _fs.unlink(tmp)
        raise
    fsync_dir(directory)


def write_bytes(path, data, mode=0o666):
    """Writes ``data`` as ``path`` with :func:`atomic_write`."""
    with atomic_write(path, mode) as f:
        f.write(data)


@contextlib.contextmanager
def private_dir(parent):
    """A fresh folder (0700, unpredictable name, created with ``mkdir``'s own exclusivity) inside
    ``parent``, removed with whatever is left in it when the block ends. Files written there by
    code that only takes a folder are moved out with :func:`publish`."""
    parent = os.fspath(parent)
    for _ in range(100):
        d = os.path.join(parent, f".tier-{secrets.token_hex(8)}.tmp")
        try:
            _fs.mkdir(d, 0o700)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"{parent}: no fresh private folder name after 100 tries")
    try:
        yield d
    finally:
        _fs.rmtree(d, ignore_errors=True)


def publish(private, name, directory):
    """Moves ``private/name`` (a regular file written in a :func:`private_dir`) over
    ``directory/name``: fsynced first, then renamed, then both folders fsynced."""
    src = os.path.join(private, name)
    f = _fs.open_file(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        f.sync()
    finally:
        f.close()
    _fs.rename(src, os.path.join(directory, name))
    # A rename between folders is durable once both are synced (POSIX promises no less; ext4 and
    # xfs need only the target's, but other file systems may bring the name back in the old one).
    fsync_dir(directory)
    fsync_dir(private)


__all__ = ["atomic_write", "write_bytes", "create_new", "private_dir", "publish", "fsync_dir"]
