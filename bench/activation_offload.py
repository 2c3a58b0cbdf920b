#!/usr/bin/env python3
"""Activation checkpoints offloaded to NVMe against recompute only, side by side.

Runs the main job (python -m tier.examples.finetune_llama) with gradient checkpointing, once with
the checkpoints kept on the device (recompute only) and once with them offloaded to NVMe
(--offload-activations nvme), in separate processes, interleaved (A B A B ...), and prints for
each pair:

- the step time of the offloaded run over the recompute-only one (steady state: steps 2+, the
  first records the access trace), target <= 1.15;
- the peak RSS of the recompute-only run minus the offloaded one, over the checkpoints' bytes
  (layers x batch x sequence x hidden x 4): the memory the offload gave back, measured from
  outside the engine; target >= 0.8 (on the emulated device, device memory is host memory);
- the most checkpoint bytes the engine held on the device at once, in layers' checkpoints
  (target <= 2).

The default shape is the issue's: a Llama of hidden 1024, 16 layers, sequence 4096, batch 1 (on
2 CPU cores each step takes minutes). Example:

    python3 bench/activation_offload.py --swap-dir /work/sd-scratch --pairs 2
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def run_job(args, offload, swap_dir):
    cmd = [sys.executable, "-m", "tier.examples.finetune_llama", "--json", "--checkpoint-activations",
           "--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads),
           "--seq", str(args.seq), "--batch", str(args.batch), "--gas", "1", "--steps", str(args.steps),
           "--swap-dir", swap_dir, "--corpus", args.corpus]
    if offload:
        cmd += ["--offload-activations", offload]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: the loss did not go down (too few steps to judge here)
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"the main job failed ({done.returncode}): {' '.join(cmd)}")
    out = done.stdout
    result = json.loads(out[out.index("{\n"):])
    result["wall"] = time.perf_counter() - t0
    return result


def steady(history):
    later = history[1:] or history
    return sum(h["seconds"] for h in later) / len(later)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--pairs", type=int, default=2, help="recompute-only / offloaded pairs, interleaved")
    p.add_argument("--swap-dir", default=None, help="where the NVMe files go (default: a temporary directory)")
    p.add_argument("--corpus", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    checkpoint_bytes = args.batch * args.seq * args.hidden * 4  # one layer's input, fp32
    all_checkpoints = args.layers * checkpoint_bytes
    base = args.swap_dir or tempfile.mkdtemp(prefix="tier-act-")
    print(f"Llama hidden {args.hidden}, {args.layers} layers, sequence {args.seq}, batch {args.batch}: "
          f"{all_checkpoints / 2**20:.0f} MiB of checkpoints per micro-step; load {os.getloadavg()[0]:.2f}",
          flush=True)
    rows = []
    for pair in range(args.pairs):
        runs = {}
        for mode in ("recompute", "nvme"):
            d = os.path.join(base, f"{mode}-{pair}")
            runs[mode] = run_job(args, None if mode == "recompute" else "nvme", d)
            shutil.rmtree(d, ignore_errors=True)
            s = runs[mode]["summary"]
            print(f"  pair {pair + 1} {mode:>9}: step {steady(runs[mode]['history']):7.2f} s, peak RSS "
                  f"{s['peak_rss_bytes'] / 2**20:8.0f} MiB, checkpoints offloaded {s['activations_offloaded']}, "
                  f"on the device at most {s['activation_peak_bytes']['device'] / 2**20:.0f} MiB", flush=True)
        a, b = runs["recompute"]["summary"], runs["nvme"]["summary"]
        rows.append({
            "step_ratio": steady(runs["nvme"]["history"]) / steady(runs["recompute"]["history"]),
            "rss_saved_over_checkpoints": (a["peak_rss_bytes"] - b["peak_rss_bytes"]) / all_checkpoints,
            "device_checkpoints_at_most": b["activation_peak_bytes"]["device"] / checkpoint_bytes,
            "recompute_step_seconds": steady(runs["recompute"]["history"]),
            "offload_step_seconds": steady(runs["nvme"]["history"]),
            "recompute_peak_rss": a["peak_rss_bytes"],
            "offload_peak_rss": b["peak_rss_bytes"],
        })
    print()
    print("pair  offload/recompute step (<= 1.15)  RSS saved / checkpoints (>= 0.8)  device checkpoints (<= 2)")
    for i, r in enumerate(rows):
        print(f"{i + 1:>4}  {r['step_ratio']:>33.3f}  {r['rss_saved_over_checkpoints']:>32.3f}  "
              f"{r['device_checkpoints_at_most']:>25.1f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps({"checkpoint_bytes": checkpoint_bytes, "pairs": rows}, indent=1))
    if not args.swap_dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
