#!/usr/bin/env python3
"""Time per step of a small Llama with full NVMe offload through tier.torch versus the same model
trained in memory with torch.optim.AdamW, measured in one run, plus tier's stall fraction.

    python bench/torch_offload.py [--steps 8] [--hidden 256] [--layers 4] [--json]

Uses the installed package (pip install .) or, failing that, the in-tree build in build/python.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

# The installed package when there is one (pip install .), else the in-tree build.
try:
    import tier  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "python"))
import tier.torch  # noqa: E402
from tier.examples import finetune_llama as ex  # noqa: E402


def batches(args, data, n):
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(n):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=g)
        out.append(torch.stack([data[s:s + args.seq] for s in starts]))
    return out


def run_baseline(args, data):
    model = ex.make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    times = []
    for ids in batches(args, data, args.steps + 1):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first step pays for allocation


def run_tier(args, data, swap):
    model = ex.make_model(args)
    args.swap_dir = swap
    args.gas = 1
    engine, *_ = tier.torch.initialize(model, ex.default_config(args, model))
    times = []
    before = None
    for i, ids in enumerate(batches(args, data, args.steps + 1)):
        if i == 1:
            before = engine.stats()
            timers_before = engine.timers()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    after = engine.stats()
    stall = after["metrics"]["engine.stall_seconds"] - before["metrics"]["engine.stall_seconds"]
    moved = {k: after["links"][k]["bytes"] - before["links"][k]["bytes"] for k in after["links"]}
    timers = {k: v - timers_before[k] for k, v in engine.timers().items()}
    engine.close()
    return times[1:], stall, moved, after, timers


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device-fraction", type=float, default=0.4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    args.steps = max(2, args.steps)
    data = ex.corpus_bytes(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs"))
    swap = tempfile.mkdtemp(prefix="tier-bench-torch-", dir=os.environ.get("TIER_BENCH_DIR", "."))
    try:
        base = run_baseline(args, data)
        tier_times, stall, moved, stats, timers = run_tier(args, data, swap)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    result = {
        "parameters": sum(p.numel() for p in ex.make_model(args).parameters()),
        "baseline_step_seconds": med(base),
        "tier_step_seconds": med(tier_times),
        "ratio": med(tier_times) / med(base),
        "stall_fraction": stall / sum(tier_times),
        "bytes_per_step": {k: v / len(tier_times) for k, v in moved.items()},
        "tier_seconds_per_step": {k: v / len(tier_times) for k, v in timers.items()},
        "device": stats["info"].get("device"),
        "io_engine": stats["info"].get("io_engine"),
        "device_budget": stats["tiers"]["device"]["budget_bytes"],
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"model {result['parameters'] / 1e6:.2f} M params, device {result['device']}, io {result['io_engine']}")
        print(f"in-memory PyTorch AdamW : {result['baseline_step_seconds'] * 1e3:8.1f} ms/step (median)")
        print(f"tier, params+optimizer on NVMe: {result['tier_step_seconds'] * 1e3:8.1f} ms/step (median)")
        print(f"ratio tier / baseline   : {result['ratio']:.2f}")
        split = result["tier_seconds_per_step"]
        print("tier time per step      : " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in split.items()))
        moved = result["bytes_per_step"]
        print("tier bytes per step     : " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in moved.items() if v))
        print(f"stall fraction (stall / step time): {result['stall_fraction']:.3f}")


if __name__ == "__main__":
    main()
