#!/usr/bin/env python3
"""Step time and bytes per link per rank with tier.torch across ranks, beside one process.

    python3 bench/multirank.py --world 2 [--stage 3] [--hidden 256 --layers 4] [--steps 6] [--json]

Runs the same Llama (built from a transformers config) with the same global batch twice in this
run: in one process, then as --world Gloo ranks (processes on this machine) partitioned by
--stage. Each rank reports its mean step time after --warmup steps, the bytes it moved per step
on each of tier's links (NVMe -> host, host -> NVMe, host <-> device), the bytes it sent through
the collectives (reduce-scatter of gradients, all-gather of params or updated shards) and its
optimizer's NVMe bytes. Ratios are to the one-process run measured here: on one machine the ranks
share the CPU cores and the disk, so the step-time ratio says what partitioning costs in
communication and contention, not what separate machines would gain; the byte ratios should be
1/world for the optimizer and, per rank, fall with the stage.
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

LINKS = ("nvme_to_host", "host_to_nvme", "host_to_device", "device_to_host")


def _config(args, swap):
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "gradient_accumulation_steps": args.gas,
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": args.stage,
            "reduce_bucket_size": args.bucket,
            "offload_param": {"device": "nvme", "nvme_path": swap},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 16},
        "tier": {"device": "emulated", "budgets": {"device": "256M", "host": "512M", "nvme": "8G"}},
    }


def _model(args):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def _rank(rank, world, args, port, outdir):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    import tier.torch

    if world > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=600),
        )
    swap = os.path.join(outdir, f"swap-w{world}")
    engine, *_ = tier.torch.initialize(_model(args), _config(args, swap))
    per = args.batch // world
    g = torch.Generator().manual_seed(1)
    times, moved = [], []
    comm0 = (0, 0)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            before = engine.stats()["links"]
            z = engine._zero
            comm0 = (z.bytes_reduced, z.bytes_gathered) if z else (0, 0)
        t0 = time.perf_counter()
        for _ in range(args.gas):
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)[rank * per : (rank + 1) * per]
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
        if world > 1:
            torch.distributed.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    after = engine.stats()
    z = engine._zero
    comm = (z.bytes_reduced - comm0[0], z.bytes_gathered - comm0[1]) if z else (0, 0)
    moved = {k: (after["links"][k]["bytes"] - before[k]["bytes"]) / args.steps for k in LINKS}
    report = {
        "rank": rank,
        "world": world,
        "step_seconds": statistics.median(times),
        "link_bytes_per_step": moved,
        "reduce_scatter_bytes_per_step": comm[0] / args.steps,
        "all_gather_bytes_per_step": comm[1] / args.steps,
        # The state's share (each rank's optimizer keeps a few spare chunks too: state_copies 1).
        "optimizer_nvme_bytes": after["optimizer"]["nvme_bytes"] - after["optimizer"].get("spare_bytes", 0),
        "optimizer_elements": after["optimizer"]["elements"],
        "parameters": sum(s.numel for s in engine._slots),
    }
    with open(os.path.join(outdir, f"w{world}-r{rank}.json"), "w") as f:
        json.dump(report, f)
    engine.destroy()
    if world > 1:
        torch.distributed.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="global micro-batch (split over the ranks)")
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--bucket", type=int, default=50_000_000)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dir", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.batch % args.world:
        p.error("--batch must be a multiple of --world")
    outdir = tempfile.mkdtemp(prefix="tier-multirank-", dir=args.dir)
    results = {}
    for world in (1, args.world):
        print(f"multirank: {world} rank(s), stage {args.stage} ...", file=sys.stderr, flush=True)
        mp.start_processes(_rank, args=(world, args, _free_port(), outdir), nprocs=world, start_method="spawn")
        results[world] = [json.load(open(os.path.join(outdir, f"w{world}-r{r}.json"))) for r in range(world)]
    one = results[1][0]
    ranks = results[args.world]
    summary = {
        "world": args.world,
        "stage": args.stage,
        "parameters": one["parameters"],
        "single_step_seconds": one["step_seconds"],
        "step_seconds": max(r["step_seconds"] for r in ranks),
        "step_ratio": max(r["step_seconds"] for r in ranks) / one["step_seconds"],
        "optimizer_nvme_bytes_ratio": max(r["optimizer_nvme_bytes"] for r in ranks) / one["optimizer_nvme_bytes"],
        "link_bytes_ratio": {
            k: (max(r["link_bytes_per_step"][k] for r in ranks) / one["link_bytes_per_step"][k])
            if one["link_bytes_per_step"][k]
            else None
            for k in LINKS
        },
        "ranks": ranks,
        "single": one,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"tier across {args.world} Gloo ranks on one machine, stage {args.stage}, {one['parameters'] / 1e6:.1f} M "
          f"params, global batch {args.batch} x {args.gas} micro-steps, {args.steps} steps")
    print(f"{'':>22} {'1 process':>12} " + " ".join(f"{'rank ' + str(r['rank']):>12}" for r in ranks) + f" {'ratio':>7}")
    print(f"{'step s':>22} {one['step_seconds']:12.3f} " + " ".join(f"{r['step_seconds']:12.3f}" for r in ranks)
          + f" {summary['step_ratio']:7.2f}")
    for k in LINKS:
        ratio = summary["link_bytes_ratio"][k]
        print(f"{k + ' /step':>22} {_fmt(one['link_bytes_per_step'][k]):>12} "
              + " ".join(f"{_fmt(r['link_bytes_per_step'][k]):>12}" for r in ranks)
              + (f" {ratio:7.2f}" if ratio is not None else f" {'-':>7}"))
    for k, label in (("reduce_scatter_bytes_per_step", "reduce-scatter /step"), ("all_gather_bytes_per_step", "all-gather /step")):
        print(f"{label:>22} {'-':>12} " + " ".join(f"{_fmt(r[k]):>12}" for r in ranks))
    print(f"{'optimizer on NVMe':>22} {_fmt(one['optimizer_nvme_bytes']):>12} "
          + " ".join(f"{_fmt(r['optimizer_nvme_bytes']):>12}" for r in ranks)
          + f" {summary['optimizer_nvme_bytes_ratio']:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
