"""tier's file layer, from Python.

Every durable file tier writes from Python (the checkpoints of :mod:`tier.torch.checkpoint` and
:mod:`tier.torch.zero_checkpoint`, ``save_pretrained``'s shards and index, ``save_16bit_model``,
``zero_to_fp32``'s output) is created, written, synced, renamed and removed through the same C++
layer as the optimizer's checkpoint and the trace (``include/tier/ext/file_system.hpp``). One
installed implementation therefore sees every file operation of a save, from both languages: tests
install the fault-injecting one (``tier._tier._install_fault_fs()``) to fail any call or cut the
power at any sync point. Reads stay on Python's ``open()``: a read returns what the disk holds,
whichever layer wrote it.

Errors are ``OSError`` with the system's errno (``FileExistsError``, ``FileNotFoundError``, ...).
"""

import io
import os
import stat

from . import _tier

_CREATE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class _Raw(io.RawIOBase):
    """The unbuffered end of :class:`File`: each write goes to the layer whole."""

    def __init__(self, native):
        super().__init__()
        self._native = native

    def writable(self):
        return True

    def write(self, b):
        return self._native.write(b)

    def fileno(self):
        return self._native.fileno()

    def close(self):
        if not self.closed:
            try:
                self._native.close()
            finally:
                super().close()


class File(io.BufferedWriter):
    """A binary file written through the layer (buffered): ``write()``, then :meth:`sync` (flush
    and fsync) to make it durable; ``close()``. A context manager, like any Python file."""

    def __init__(self, native, buffer_size=1 << 20):
        super().__init__(_Raw(native), buffer_size)
        self._native = native

    @property
    def path(self):
        return self._native.path

    def sync(self):
        """Flushes the buffer and fsyncs the file: its data is durable when this returns."""
        self.flush()
        self._native.sync()


def open_file(path, flags, mode=0o666):
    """``open(2)`` through the layer: the native file (``write``, ``pwrite``, ``sync``,
    ``truncate``, ``lock``, ``unlock``, ``fileno``, ``close``). ``O_CLOEXEC`` is added."""
    return _tier.fs_open(os.fspath(path), flags, mode)


def create_new(path, mode=0o600):
    """A fresh file at exactly ``path`` (``O_CREAT|O_EXCL|O_NOFOLLOW``: refused if anything, even
    a dangling symlink, is there), as a :class:`File`."""
    return File(open_file(path, _CREATE_NEW, mode))


def write_new(path, data, mode=0o600):
    """Creates ``path`` (must not exist), writes ``data`` and fsyncs it."""
    with create_new(path, mode) as f:
        f.write(data)
        f.sync()


def rename(src, dst):
    """``rename(2)``: replaces ``dst`` atomically (a symlink there is replaced, not followed)."""
    _tier.fs_rename(os.fspath(src), os.fspath(dst))


replace = rename


def unlink(path):
    _tier.fs_unlink(os.fspath(path))


def mkdir(path, mode=0o777):
    _tier.fs_mkdir(os.fspath(path), mode)


def rmdir(path):
    _tier.fs_rmdir(os.fspath(path))


def symlink(target, link):
    _tier.fs_symlink(os.fspath(target), os.fspath(link))


def readlink(path):
    return _tier.fs_readlink(os.fspath(path))


def chmod(path, mode):
    _tier.fs_chmod(os.fspath(path), mode)


def fsync_dir(path):
    """Makes the entries of folder ``path`` (a file created or renamed into it) durable."""
    _tier.fs_sync_dir(os.fspath(path))


def makedirs(path, mode=0o777, exist_ok=False):
    """``os.makedirs`` through the layer, durably: each folder it creates is made with ``mode``
    (the last; the others 0o777, each less the umask) and its parent is fsynced, so that what is
    saved into the new folder cannot vanish with it in a power cut."""
    path = os.path.abspath(os.fspath(path))
    missing = []
    p = path
    while not os.path.isdir(p):
        if os.path.lexists(p):
            if p == path:
                raise FileExistsError(f"{path} exists and is not a folder")
            raise NotADirectoryError(f"{p} is not a folder (making {path})")
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    if not missing:
        if not exist_ok:
            raise FileExistsError(f"{path} exists")
        return
    for p in reversed(missing):
        try:
            mkdir(p, mode if p == path else 0o777)
        except FileExistsError:
            if not os.path.isdir(p):
                raise
            continue  # made meanwhile by someone else, who syncs it
        fsync_dir(os.path.dirname(p))


def rmtree(path, ignore_errors=False):
    """``shutil.rmtree`` through the layer: removes ``path`` and everything under it, never
    following a symlink (a symlink inside is removed, its target left alone; ``path`` itself must
    be a folder)."""
    path = os.fspath(path)

    def onerror(e):
        if not ignore_errors:
            raise e

    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise OSError(f"{path} is a symbolic link; rmtree removes folders only")
        entries = list(os.scandir(path))
    except OSError as e:
        onerror(e)
        return
    for entry in entries:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            is_dir = False
        if is_dir:
            rmtree(entry.path, ignore_errors)
            continue
        try:
            unlink(entry.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            onerror(e)
    try:
        rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        onerror(e)


__all__ = [
    "File", "open_file", "create_new", "write_new", "rename", "replace", "unlink", "mkdir", "rmdir", "symlink",
    "readlink", "chmod", "fsync_dir", "makedirs", "rmtree",
]
