"""Consolidates a tier checkpoint into one fp32 state dict (as DeepSpeed's zero_to_fp32.py does for
its own checkpoints), whether one process saved it or several ranks did.

    python -m tier.torch.zero_to_fp32 CHECKPOINT_DIR OUT [--tag TAG] [--dtype fp32|bf16|fp16]

CHECKPOINT_DIR is the directory given to ``engine.save_checkpoint`` (its ``latest`` tag unless
``--tag``); OUT ends in ``.safetensors`` (written with safetensors) or anything else
(``torch.save``); ``--dtype bf16`` or ``fp16`` rounds the fp32 masters to a 16-bit state dict.
Every file is checked against the checkpoint's manifest first.

A checkpoint saved by ranks (format ``tier-checkpoint-zero-2``) gives each trainable parameter's
fp32 master from the ranks' ``rank<N>.bin``; one saved by one process (``tier-checkpoint-2``) from
``optimizer.bin``. Both are the optimizer's own files, read by tier's native reader (every
record's checksums and the trailer verified, whatever the optimizer's state dtype). Frozen parameters come from
``frozen.bin``, widened to fp32 from the compute dtype. Checkpoints of the first format
(``tier-checkpoint-1``, without checksums) are refused: load one with ``engine.load_checkpoint``
and save it again. Exit status 2, with the reason on stderr, when the checkpoint is missing,
damaged or not one of these.
"""

import argparse
import json
import os
import sys

import torch

from .. import _tier
from . import checkpoint, checkpoint_load, zero_checkpoint
from .atomic_file import atomic_write, private_dir, publish


def _saved_format(path):
    """The format the checkpoint in ``path`` declares (its manifest's, or an old one's meta.json);
    only to choose the reader, which checks everything itself."""
    try:
        with open(os.path.join(path, checkpoint.MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        if checkpoint._is_old_checkpoint(path):
            return checkpoint.OLD_FORMAT
        raise _tier.DataLoss(f"checkpoint {path}: {checkpoint.MANIFEST} is missing; it is incomplete") from None
    except ValueError as e:
        raise _tier.DataLoss(f"checkpoint {path}: {checkpoint.MANIFEST} is damaged ({e})") from None
    return manifest.get("format") if isinstance(manifest, dict) else None


def consolidate(path):
    """The fp32 state dict of the checkpoint in ``path`` (a version directory), whichever format."""
    fmt = _saved_format(path)
    if fmt in (zero_checkpoint.FORMAT, zero_checkpoint.OLD_FORMAT):
        return zero_checkpoint.consolidate(path)
    if fmt == checkpoint.OLD_FORMAT:
        raise ValueError(
            f"checkpoint {path} has the first tier format ({checkpoint.OLD_FORMAT}, without checksums), which "
            "zero_to_fp32 does not read: load it with engine.load_checkpoint and save it again"
        )
    return checkpoint_load.consolidate(path)  # tier-checkpoint-2; any other format is refused there


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tier.torch.zero_to_fp32", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir")
    p.add_argument("out")
    p.add_argument("--tag", default=None)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    args = p.parse_args(argv)
    try:
        path = zero_checkpoint.resolve(args.checkpoint_dir, args.tag)
        sd = consolidate(path)
    except (OSError, ValueError, _tier.TierError) as e:  # tier.DataLoss is an OSError
        print(f"zero_to_fp32: {e}", file=sys.stderr)
        return 2
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if dtype is not torch.float32:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    # Written fresh beside OUT (nothing planted there is written through) and renamed over it once
    # complete: torch.save into an O_EXCL|O_NOFOLLOW temporary file; safetensors, which writes by
    # name, into a private folder made there (not into memory first: the state dict is the model).
    if args.out.endswith(".safetensors"):
        from safetensors.torch import save_file

        out_dir, name = os.path.split(os.path.abspath(args.out))
        with private_dir(out_dir) as private:
            save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(private, name))
            publish(private, name, out_dir)
    else:
        with atomic_write(args.out) as f:
            torch.save(sd, f)
    n = sum(t.numel() for t in sd.values())
    print(f"zero_to_fp32: {len(sd)} tensors, {n} parameters in {args.dtype} from {path} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
