#!/usr/bin/env python3
"""Time per step of a small Llama with full NVMe offload through tier.torch versus the same model
trained in memory with torch.optim.AdamW, measured in one run, plus tier's stall fraction; tier
runs in three modes (two rounds, in opposite orders), with the optimizer overlapped with backward (tier.optimizer.overlap "exact",
the default), after it ("serial") and one step delayed ("delayed", which changes the training),
and the optimizer's NVMe traffic is set beside the disk's
mixed read/write rate measured outside tier (tier-bench step's plain pread/pwrite reference).

    python bench/torch_offload.py [--steps 8] [--hidden 256] [--layers 4] [--clip 1.0]
                                  [--param-home nvme|cpu] [--device auto|cpu|cuda] [--json]

Uses the installed package (pip install .) or, failing that, the in-tree build in build/python.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import transformers

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


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_baseline(args, data):
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(ex.llama_config(args)).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    times = []
    for ids in batches(args, data, args.steps + 1):
        ids = ids.to(args.device)
        sync(args.device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sync(args.device)
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first step pays for allocation


def run_tier(args, data, swap, overlap):
    args.swap_dir = swap
    args.gas = 1
    cfg = ex.default_config(args, ex.model_shape(args))
    cfg["gradient_clipping"] = args.clip
    cfg["tier"]["optimizer"] = {"overlap": overlap}
    cfg["tier"]["device"] = "cuda" if args.device == "cuda" else "emulated"
    if overlap == "delayed":  # its second set of fp32 gradients on NVMe
        cfg["tier"]["budgets"]["nvme"] += 4 * ex.model_shape(args)[0]
    if args.param_home != "nvme":
        cfg["zero_optimization"]["offload_param"] = {"device": args.param_home, "pin_memory": True}
    model = ex.make_model(args, cfg)  # built into the engine (the same weights as the baseline's)
    engine, *_ = tier.torch.initialize(model, cfg)
    times, reports = [], []
    before = None
    for i, ids in enumerate(batches(args, data, args.steps + 1)):
        ids = ids.to(engine.device)
        if i == 1:
            before = engine.stats()
            timers_before = engine.timers()
        sync(args.device)
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        reports.append(engine.step())
        sync(args.device)
        times.append(time.perf_counter() - t0)
    after = engine.stats()
    stall = after["metrics"]["engine.stall_seconds"] - before["metrics"]["engine.stall_seconds"]
    moved = {k: after["links"][k]["bytes"] - before["links"][k]["bytes"] for k in after["links"]}
    timers = {k: v - timers_before[k] for k, v in engine.timers().items()}
    engine.destroy()
    return {"times": times[1:], "stall": stall, "moved": moved, "stats": after, "timers": timers,
            "reports": reports[1:]}


MODES = ("exact", "serial", "delayed")


def merge(rs):
    """One mode's rounds as one run: all their steps; counters and timers summed over them."""
    return {
        "times": [t for r in rs for t in r["times"]],
        "reports": [x for r in rs for x in r["reports"]],
        "stall": sum(r["stall"] for r in rs),
        "moved": {k: sum(r["moved"][k] for r in rs) for k in rs[0]["moved"]},
        "timers": {k: sum(r["timers"].get(k, 0) for r in rs) for k in rs[0]["timers"]},
        "stats": rs[-1]["stats"],
    }


def mixed_rate(swap, params):
    """The disk's rate for reads and writes mixed 1:1, measured outside tier's pipeline: tier-bench
    step's reference pass (plain pread/pwrite, 1 MiB requests, 32 in flight) on a state of the
    model's size in the same directory. None without a tier-bench binary."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    bench = os.environ.get("TIER_BENCH") or os.path.join(root, "build", "bin", "tier-bench")
    if not os.access(bench, os.X_OK):
        return None
    out = subprocess.run(
        [bench, "step", "--params", str(max(params, 1 << 22)), "--nvme", swap, "--steps", "1", "--json"],
        capture_output=True, text=True, timeout=3600,
    )
    if out.returncode != 0:
        print(f"torch_offload.py: tier-bench step failed: {out.stderr[-500:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout)["io_reference_bytes_per_second"]


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
    p.add_argument("--device-budget", type=int, default=0)
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0: off)")
    p.add_argument("--param-home", choices=("nvme", "cpu"), default="nvme",
                   help="offload_param device (the optimizer state is on NVMe either way)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the baseline and tier compute (auto: cuda when torch sees a GPU; cpu: tier's "
                   "emulated device)")
    p.add_argument("--json", action="store_true")
    args = ex.with_job_defaults(p.parse_args())  # what the main job's helpers read besides
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.steps = max(2, args.steps)
    data = ex.corpus_bytes(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs"))
    swap = tempfile.mkdtemp(prefix="tier-bench-torch-", dir=os.environ.get("TIER_BENCH_DIR", "."))
    params = ex.model_shape(args)[0]
    try:
        base = run_baseline(args, data)
        # Two rounds in opposite orders, so that no mode always runs first (warm-up) or last.
        runs = {m: [] for m in MODES}
        for order in (MODES, MODES[::-1]):
            for m in order:
                runs[m].append(run_tier(args, data, swap, m))
        exact, serial, delayed = (merge(runs[m]) for m in MODES)
        rate = mixed_rate(swap, params)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    tier_times, stats = exact["times"], exact["stats"]
    opt_bytes = med([r["read_bytes"] + r["write_bytes"] for r in exact["reports"]])
    io_bound = opt_bytes / rate if rate else None
    serial_opt = serial["timers"].get("step", 0) / len(serial["times"])
    reports = exact["reports"]
    result = {
        "parameters": params,
        "param_home": args.param_home,
        "compute_device": args.device,
        "baseline_step_seconds": med(base),
        "tier_step_seconds": med(tier_times),
        "ratio": med(tier_times) / med(base),
        "serial_step_seconds": med(serial["times"]),
        "serial_over_exact": med(serial["times"]) / med(tier_times),
        # overlap "delayed" (changes the training: each step's gradients are one update behind).
        "delayed_step_seconds": med(delayed["times"]),
        "serial_over_delayed": med(serial["times"]) / med(delayed["times"]),
        "optimizer_bytes_per_step": opt_bytes,
        "mixed_rw_bytes_per_second": rate,
        "optimizer_io_bound_seconds": io_bound,
        "ratio_to_bound": med(tier_times) / max(med(base), io_bound or 0),
        # How much of the serial run's optimizer wait the overlap removed from the step.
        "optimizer_hidden_fraction": (med(serial["times"]) - med(tier_times)) / serial_opt if serial_opt else None,
        "redone_fraction": sum(1 for r in reports if r["redone"]) / len(reports),
        "redo_reasons": sorted({r["redo_reason"] for r in reports if r["redone"]}),
        # Of the redone steps' chunks, those the abandoned pass had already read (not read again).
        "reused_chunk_fraction": sum(r.get("reused_chunks", 0) for r in reports if r["redone"])
        / max(1, sum(r["chunks"] for r in reports if r["redone"])),
        # Chunks the pass updated before backward had finished, of all chunks of the exact run's steps.
        "speculated_chunk_fraction": sum(r["speculated_chunks"] for r in reports) / max(1, sum(r["chunks"] for r in reports)),
        "stall_fraction": exact["stall"] / sum(tier_times),
        "bytes_per_step": {k: v / len(tier_times) for k, v in exact["moved"].items()},
        "tier_seconds_per_step": {k: v / len(tier_times) for k, v in exact["timers"].items()},
        "serial_seconds_per_step": {k: v / len(serial["times"]) for k, v in serial["timers"].items()},
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
        print(f"tier, overlap serial    : {result['serial_step_seconds'] * 1e3:8.1f} ms/step (median); "
              f"serial / exact {result['serial_over_exact']:.2f}")
        print(f"tier, overlap delayed   : {result['delayed_step_seconds'] * 1e3:8.1f} ms/step (median); "
              f"serial / delayed {result['serial_over_delayed']:.2f} (changes the training: one update behind)")
        if result["optimizer_io_bound_seconds"] is not None:
            print(f"optimizer I/O bound     : {result['optimizer_io_bound_seconds'] * 1e3:8.1f} ms "
                  f"({result['optimizer_bytes_per_step'] / 2**20:.1f} MiB at "
                  f"{result['mixed_rw_bytes_per_second'] / 2**20:.0f} MiB/s mixed r/w, outside tier); "
                  f"step / max(baseline, bound) {result['ratio_to_bound']:.2f}")
        print(f"steps redone (clipping/overflow): {result['redone_fraction']:.2f} {result['redo_reasons']}")
        split = result["tier_seconds_per_step"]
        print("tier time per step      : " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in split.items()))
        moved = result["bytes_per_step"]
        print("tier bytes per step     : " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in moved.items() if v))
        print(f"stall fraction (stall / step time): {result['stall_fraction']:.3f}")


if __name__ == "__main__":
    main()
