#!/usr/bin/env python3
"""Soak: many training steps of tier.torch with params and optimizer state on NVMe, a checkpoint
now and then, and the process's resident memory and open file descriptors sampled as it goes.

A leak shows as growth after the warm-up: RSS that keeps climbing, descriptors that are never
closed. The script prints a line per sample and a summary, and exits 1 when the descriptors grew
at all after the warm-up or RSS grew by more than --rss-slack (default 10%) from the first sample
after warm-up to the last. Nightly length: the default 1000 steps (a few minutes on 2 cores).

    python3 bench/soak.py [--steps 1000] [--every 100] [--swap-dir DIR] [--json]
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=100, help="steps between samples")
    p.add_argument("--warmup", type=int, default=100, help="steps before the reference sample")
    p.add_argument("--checkpoint-every", type=int, default=250)
    p.add_argument("--swap-dir", default=None, help="a folder for tier's files (default: a new temporary one)")
    p.add_argument("--rss-slack", type=float, default=0.10)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.steps <= args.warmup or args.every <= 0:
        p.error("--steps must exceed --warmup, and --every must be positive")

    import torch
    import tier.torch

    work = tempfile.mkdtemp(prefix="tier-soak-", dir=args.swap_dir)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                    torch.nn.GELU(), torch.nn.Linear(512, 16))
        swap = os.path.join(work, "swap")
        os.makedirs(swap)
        cfg = {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0,
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": swap},
                "offload_optimizer": {"device": "nvme", "nvme_path": swap},
            },
            "tier": {"device": "emulated", "budgets": {"device": "2M", "host": "16M", "nvme": "64M"}},
        }
        engine = tier.torch.initialize(model, cfg)[0]
        samples = []
        t0 = time.monotonic()
        for step in range(1, args.steps + 1):
            for _ in range(2):
                x = torch.randn(16, 256)
                loss = torch.nn.functional.mse_loss(engine(x), torch.tanh(x[:, :16]))
                engine.backward(loss)
                engine.step()
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                engine.save_checkpoint(os.path.join(work, "ckpt"), tag=f"s{step}")
            if step % args.every == 0:
                s = {"step": step, "seconds": round(time.monotonic() - t0, 2), "rss_bytes": rss_bytes(),
                     "open_fds": open_fds(), "loss": round(loss.item(), 5)}
                samples.append(s)
                if not args.json:
                    print(f"step {step:6d}  {s['seconds']:8.1f} s  rss {s['rss_bytes'] / 2**20:8.1f} MiB  "
                          f"fds {s['open_fds']:4d}  loss {s['loss']:.5f}", flush=True)
        engine.destroy()
    finally:
        shutil.rmtree(work, ignore_errors=True)  # a folder this script created, by its own name

    ref = next(s for s in samples if s["step"] >= args.warmup)
    last = samples[-1]
    rss_growth = (last["rss_bytes"] - ref["rss_bytes"]) / max(1, ref["rss_bytes"])
    fd_growth = last["open_fds"] - ref["open_fds"]
    ok = fd_growth <= 0 and rss_growth <= args.rss_slack
    summary = {"steps": args.steps, "seconds": last["seconds"], "rss_reference_bytes": ref["rss_bytes"],
               "rss_last_bytes": last["rss_bytes"], "rss_growth": round(rss_growth, 4),
               "fds_reference": ref["open_fds"], "fds_last": last["open_fds"], "fd_growth": fd_growth,
               "ok": ok, "samples": samples}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"soak: {args.steps} steps in {last['seconds']:.1f} s; RSS {ref['rss_bytes'] / 2**20:.1f} -> "
              f"{last['rss_bytes'] / 2**20:.1f} MiB ({rss_growth * 100:+.1f}%, slack {args.rss_slack * 100:.0f}%), "
              f"fds {ref['open_fds']} -> {last['open_fds']}: {'no leak seen' if ok else 'LEAK SUSPECTED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
