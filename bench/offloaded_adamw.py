#!/usr/bin/env python3
"""Time per step of a small Llama trained by a plain PyTorch loop with tier.torch.OffloadedAdamW
(the optimizer-only mode: fp32 masters and moments on NVMe, the model where the loop keeps it),
with the update after backward (overlap "serial") and during the backward that finishes the
gradients ("exact"), beside torch.optim.AdamW in memory and the optimizer's NVMe bytes at the
disk's mixed read/write rate measured outside tier, all in one run.

    python bench/offloaded_adamw.py [--steps 8] [--hidden 512] [--layers 8] [--clip 0] [--json]

--clip C calls torch.nn.utils.clip_grad_norm_(params, C) before each step, as the HF Trainer
does; a coefficient below 1 changes the gradients after backward, so the exact mode redoes the
step serially (reported as committed_fraction).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_offload import batches, mixed_rate  # noqa: E402

import tier.torch  # noqa: E402
from tier.examples import finetune_llama as ex  # noqa: E402


def run(args, data, make_opt):
    """Median seconds per step after the first, and the optimizer."""
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(ex.llama_config(args)).to(args.device)
    opt = make_opt(model)
    times = []
    for ids in batches(args, data, args.steps + 1):
        ids = ids.to(args.device)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    print(type(opt).__name__, getattr(opt, "overlap", ""), [round(t * 1e3) for t in times], file=sys.stderr)
    times = sorted(times[1:])  # the first step pays for allocation (and teaches the exact mode)
    return times[len(times) // 2], opt


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ threshold (0: no clipping)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", action="store_true")
    args = ex.with_job_defaults(p.parse_args())  # what the main job's helpers read besides
    args.steps = max(3, args.steps)
    data = ex.corpus_bytes(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs"))
    swap = tempfile.mkdtemp(prefix="tier-bench-adamw-", dir=os.environ.get("TIER_BENCH_DIR", "."))
    hp = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    result = {"device": args.device, "clip": args.clip}
    try:
        result["adamw_step_seconds"], _ = run(args, data, lambda m: torch.optim.AdamW(m.parameters(), **hp))
        for mode in ("serial", "exact"):
            path = os.path.join(swap, mode)
            secs, opt = run(
                args, data, lambda m: tier.torch.OffloadedAdamW(m.parameters(), nvme_path=path, overlap=mode, **hp)
            )
            result[f"{mode}_step_seconds"] = secs
            if mode == "exact":
                st = opt.stats()["overlap_steps"]
                result["committed_fraction"] = st["committed"] / max(1, st["steps"] - 1)
                result["last_redo_reason"] = st["last_redo_reason"]
                report = opt.last_report
                result["optimizer_bytes_per_step"] = report["read_bytes"] + report["write_bytes"]
                result["parameters"] = opt.stats()["elements"]
            opt.close()
        rate = mixed_rate(swap, result["parameters"])
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    bound = result["optimizer_bytes_per_step"] / rate if rate else None
    result["mixed_rw_bytes_per_second"] = rate
    result["optimizer_io_bound_seconds"] = bound
    result["serial_over_exact"] = result["serial_step_seconds"] / result["exact_step_seconds"]
    result["exact_over_max_adamw_bound"] = result["exact_step_seconds"] / max(result["adamw_step_seconds"], bound or 0)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"model {result['parameters'] / 1e6:.2f} M params on {args.device}, clip {args.clip or 'off'}")
    print(f"torch.optim.AdamW in memory : {result['adamw_step_seconds'] * 1e3:8.1f} ms/step (median)")
    print(f"OffloadedAdamW, serial      : {result['serial_step_seconds'] * 1e3:8.1f} ms/step")
    print(f"OffloadedAdamW, exact       : {result['exact_step_seconds'] * 1e3:8.1f} ms/step; "
          f"serial / exact {result['serial_over_exact']:.2f}; speculation kept in "
          f"{result['committed_fraction']:.0%} of the steps {result['last_redo_reason']!r}")
    if bound is not None:
        print(f"optimizer I/O bound         : {bound * 1e3:8.1f} ms ({result['optimizer_bytes_per_step'] / 2**20:.1f} "
              f"MiB at {rate / 2**20:.0f} MiB/s mixed r/w, outside tier); exact / max(AdamW, bound) "
              f"{result['exact_over_max_adamw_bound']:.2f}")


if __name__ == "__main__":
    main()
