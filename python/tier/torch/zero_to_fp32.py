"""Consolidates a checkpoint saved by several ranks into one fp32 state dict (as DeepSpeed's
zero_to_fp32.py does for its own checkpoints).

    python -m tier.torch.zero_to_fp32 CHECKPOINT_DIR OUT [--tag TAG] [--dtype fp32|bf16|fp16]

CHECKPOINT_DIR is the directory given to ``engine.save_checkpoint`` (its ``latest`` tag unless
``--tag``); OUT ends in ``.safetensors`` (written with safetensors) or anything else
(``torch.save``); ``--dtype bf16`` or ``fp16`` rounds the fp32 masters to a 16-bit state dict.
Every file is checked against the checkpoint's manifest first.
"""

import argparse
import os
import sys

import torch

from .. import _tier
from . import zero_checkpoint
from .atomic_file import atomic_write, private_dir, publish


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tier.torch.zero_to_fp32", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir")
    p.add_argument("out")
    p.add_argument("--tag", default=None)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    args = p.parse_args(argv)
    try:
        path = zero_checkpoint.resolve(args.checkpoint_dir, args.tag)
        sd = zero_checkpoint.consolidate(path)
    except (FileNotFoundError, ValueError, _tier.DataLoss) as e:
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
