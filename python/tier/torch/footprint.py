"""What a model will hold on the NVMe tier, checked against the disks before anything is written.

The swap files grow with what they hold (the NVMe budget is a cap, not a reservation), so a model
that cannot fit its disks would otherwise fill them first and fail halfway through initialize.
``check_nvme_room`` refuses it up front with the bytes needed per part and the bytes free."""

import errno
import os

from .. import _tier

_PAGE = 4096


def params_are_masters(resolved, compute_dtype_name):
    """Whether a config (resolved by the schema) makes an fp32 model's parameters the optimizer's
    masters (tier.optimizer.params_are_masters, docs/optimizer.md): its parameters and state on
    NVMe, the state kept once without speculation chunks, overlap not "delayed", not Lamb. The
    optimizer then keeps m and v only (8 bytes per trained element with fp32 moments, not 12)."""
    opt = resolved["tier"]["optimizer"]
    zero = resolved.get("zero_optimization", {})
    return (
        bool(opt.get("params_are_masters", True))
        and compute_dtype_name == "fp32"
        and zero.get("offload_param", {}).get("device") == "nvme"
        and zero.get("offload_optimizer", {}).get("device") == "nvme"
        and int(opt.get("state_copies", 1)) == 1
        and int(opt.get("speculation_chunks", 0)) == 0
        and opt.get("overlap") != "delayed"
        and str(resolved.get("optimizer", {}).get("type", "")).lower() != "lamb"
    )


def padded(nbytes):
    """Bytes an extent of ``nbytes`` holds on disk (4 KiB pages)."""
    return (int(nbytes) + _PAGE - 1) // _PAGE * _PAGE


def _existing(path):
    # The swap directory may not exist yet (the engine creates it): its nearest existing parent
    # is on the same file system.
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def free_bytes(paths):
    """Bytes free to this user on the file systems holding ``paths`` (each file system once), and
    the paths named per file system."""
    seen = {}
    for p in paths:
        where = _existing(p)
        try:
            st = os.statvfs(where)
            dev = os.stat(where).st_dev
        except OSError:
            continue
        if st.f_blocks == 0:  # no space accounting (ramfs): nothing to check
            return None, []
        seen.setdefault(dev, [st.f_bavail * st.f_frsize, []])[1].append(p)
    total = sum(v[0] for v in seen.values())
    return total, [p for v in seen.values() for p in v[1]]


def check_nvme_room(paths, parts):
    """Raises tier.NoSpace when ``parts`` (a dict: what -> bytes still to be written to the swap
    files) exceed the free space of the file systems holding ``paths``."""
    need = sum(parts.values())
    if need == 0 or not paths:
        return
    free, named = free_bytes(paths)
    if free is None or need <= free:
        return
    detail = ", ".join(f"{what} {_tier.format_bytes(n)}" for what, n in parts.items() if n)
    error = _tier.NoSpace(
        f"the NVMe tier needs {_tier.format_bytes(need)} ({need} bytes: {detail}) on {', '.join(named)} but "
        f"{_tier.format_bytes(free)} ({free} bytes) are free; free space, add a path (tier.swap_paths), keep less "
        "on NVMe (offload_param.device or offload_optimizer.device \"cpu\"), or compress the optimizer state "
        "(tier.optimizer.state_dtype)"
    )
    error.errno = errno.ENOSPC  # as the native module's errors carry it (str() stays the message)
    raise error
