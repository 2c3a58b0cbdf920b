#!/usr/bin/env python3
"""Forward, backward and step time of tier.torch beside DeepSpeed ZeRO-3 on the same Llama, the same
batches and the same DeepSpeed config (params and optimizer state on NVMe), each in processes of
its own, interleaved (tier, DeepSpeed, DeepSpeed, tier, ...): DeepSpeed is the reference, measured
in the same run, and the figures are tier / DeepSpeed ratios of the medians over the timed steps
(the first step of each process, which builds and warms up, is left out).

tier streams its parameters through a device budget below the model (``--device-fraction``),
as DeepSpeed streams its partitioned parameters from NVMe. On a machine without a GPU both run on
the CPU: tier on its emulated device, DeepSpeed on its CPU accelerator (DS_ACCELERATOR=cpu, gloo;
its async_io op is built on first use, which takes a minute once).

    python bench/ds_side_by_side.py [--hidden 512] [--layers 8] [--steps 6] [--rounds 2]
                                    [--swap-dir DIR] [--json]

Needs deepspeed (bench/ds_side_by_side.sh installs it into the project's .venv when missing).
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="steps per process (the first is not timed)")
    p.add_argument("--rounds", type=int, default=2, help="processes per side, interleaved")
    p.add_argument("--device-fraction", type=float, default=0.25,
                   help="tier's device budget as a share of the model's bytes (parameters stream through it)")
    p.add_argument("--swap-dir", default=None, help="folder on the SSD for both sides' files (default: a temp folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line of figures at the end")
    p.add_argument("--child", choices=["tier", "deepspeed"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def ds_config(args, swap_dir):
    """The DeepSpeed ZeRO-3 config both sides are given (tier reads DeepSpeed's keys)."""
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap_dir, "pin_memory": True, "buffer_count": 5,
                              "buffer_size": 100_000_000},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap_dir, "pin_memory": True},
        },
        "aio": {"block_size": 1048576, "queue_depth": 16, "single_submit": False, "overlap_events": True},
    }


def model_and_batches(args):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=args.seq, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = [torch.randint(0, 256, (args.batch, args.seq), generator=g) for _ in range(args.steps)]
    return cfg, batches


def child_tier(args, swap_dir):
    import torch
    import transformers

    import tier.torch

    cfg, batches = model_and_batches(args)
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    config = ds_config(args, swap_dir)
    config["tier"] = {"budgets": {"device": max(int(4 * n * args.device_fraction), 3 * 4 * largest)}}
    engine, *_ = tier.torch.initialize(model, config)
    return n, engine, batches, lambda: None


def streamed_bytes(engine):
    """Bytes tier copied to its device so far (None for DeepSpeed)."""
    stats = getattr(engine, "stats", None)
    if stats is None or not callable(stats):
        return None
    try:
        return stats()["links"]["host_to_device"]["bytes"]
    except (KeyError, TypeError):
        return None


def child_deepspeed(args, swap_dir):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import torch
    import torch._dynamo  # noqa: F401 (imported here, not first under zero.Init's patched constructors)
    import transformers
    from transformers.models.llama import modeling_llama  # noqa: F401 (likewise)

    deepspeed.init_distributed(dist_backend="gloo")
    cfg, batches = model_and_batches(args)
    config = ds_config(args, swap_dir)
    torch.manual_seed(args.seed)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = transformers.LlamaForCausalLM(cfg)
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def end():
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    return n, engine, batches, end


def run_child(args):
    swap_dir = tempfile.mkdtemp(prefix=f"{args.child}-", dir=args.swap_dir)
    try:
        make = child_tier if args.child == "tier" else child_deepspeed
        n, engine, batches, end = make(args, swap_dir)
        rows = []
        for ids in batches:
            before = streamed_bytes(engine)
            t0 = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            after = streamed_bytes(engine)
            rows.append({"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "loss": float(loss),
                         "to_device_bytes": None if before is None else after - before})
            print(f"  {args.child}: forward {t1 - t0:.3f} s, backward {t2 - t1:.3f} s, step {t3 - t2:.3f} s, "
                  f"loss {float(loss):.4f}", flush=True)
        model_bytes = 4 * n
        with open(args.out, "w") as f:
            json.dump({"parameters": n, "model_bytes": model_bytes, "rows": rows}, f)
        end()
    finally:
        shutil.rmtree(swap_dir, ignore_errors=True)


def main(argv=None):
    args = parse(argv)
    if args.child:
        return run_child(args)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise SystemExit("ds_side_by_side: deepspeed is not installed (bench/ds_side_by_side.sh installs it)")
    load = os.getloadavg()[0]
    if load > 2:
        print(f"ds_side_by_side: load average {load:.1f}: the machine is busy, the timings will say little",
              file=sys.stderr)
    base = args.swap_dir or tempfile.mkdtemp(prefix="ds-side-by-side-")
    own_base = args.swap_dir is None
    order = []
    for r in range(args.rounds):
        order += ["tier", "deepspeed"] if r % 2 == 0 else ["deepspeed", "tier"]
    results = {"tier": [], "deepspeed": []}
    params = {}
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    try:
        for i, side in enumerate(order):
            out = os.path.join(base, f"{side}-{i}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", side, "--out", out, "--swap-dir", base]
            for k in ("hidden", "layers", "heads", "vocab", "seq", "batch", "steps", "seed"):
                cmd += [f"--{k}", str(getattr(args, k))]
            cmd += ["--device-fraction", str(args.device_fraction)]
            print(f"run {i + 1}/{len(order)}: {side}", flush=True)
            subprocess.run(cmd, check=True, env=env)
            with open(out) as f:
                got = json.load(f)
            params[side] = got["parameters"]
            results[side].append(got["rows"])
    finally:
        if own_base:
            shutil.rmtree(base, ignore_errors=True)

    def med(side, key):
        return statistics.median(r[key] for rows in results[side] for r in rows[1:])

    fig = {"parameters": params, "steps_timed_per_side": sum(len(rows) - 1 for rows in results["tier"]),
           "load_average_start": load}
    print(f"\nLlama {params.get('tier', 0) / 1e6:.1f} M parameters, batch {args.batch} x {args.seq}; medians over "
          f"steps 2..{args.steps} of {args.rounds} process(es) per side, interleaved")
    print(f"{'phase':<18} {'tier (s)':>10} {'DeepSpeed (s)':>14} {'tier / DS':>10}")
    for key in ("forward", "backward", "forward+backward", "step", "total"):
        if key == "forward+backward":
            t, d = (med("tier", "forward") + med("tier", "backward"),
                    med("deepspeed", "forward") + med("deepspeed", "backward"))
        elif key == "total":
            t = sum(med("tier", k) for k in ("forward", "backward", "step"))
            d = sum(med("deepspeed", k) for k in ("forward", "backward", "step"))
        else:
            t, d = med("tier", key), med("deepspeed", key)
        fig[key] = {"tier": t, "deepspeed": d, "ratio": t / d}
        print(f"{key:<18} {t:>10.3f} {d:>14.3f} {t / d:>10.2f}")
    fig["losses"] = {side: [r["loss"] for r in results[side][0]] for side in results}
    moved = [r["to_device_bytes"] for rows in results["tier"] for r in rows[1:] if r.get("to_device_bytes") is not None]
    if moved:
        fig["tier_to_device_bytes_per_step"] = statistics.median(moved)
        print(f"tier copied {statistics.median(moved) / 2**20:.0f} MiB to its device per step (model "
              f"{4 * params['tier'] / 2**20:.0f} MiB, device budget {args.device_fraction:.0%} of it or 3 of the "
              "largest tensor): its parameters stream")
    if args.json:
        print(json.dumps(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
