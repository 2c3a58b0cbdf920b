"""Bytes a ZeRO checkpoint reads back at save and at load, per rank, against its size.

    python3 bench/zero_checkpoint_io.py --world 2 --dir /work/sd-scratch/zck [--hidden 512 --layers 8]

Starts --world Gloo ranks on this machine. Each builds the same Llama (hidden, layers, vocab 8192),
initializes a tier.torch engine (ZeRO stage 2, optimizer state in host memory, so that the only
files the process reads during a save or a load are the checkpoint's), takes one step,
saves a checkpoint and loads it back. Each rank reports the seconds of the save and of the load and
the bytes its process read meanwhile (/proc/self/io rchar: every read() the process made, cached
or not). The reference is the checkpoint's own size (the files on disk, outside the code measured):
reads at save per checkpoint byte, and reads at load per byte of the rank's share.
"""

import argparse
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time


def rchar():
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


def rank_main(args):
    import torch
    import torch.distributed as dist
    import transformers

    import tier.torch

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=600),
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg)
    ds = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "tier": {"device": "emulated"},
    }
    engine = tier.torch.initialize(model, ds)[0]
    ids = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(args.rank))
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    engine.step()
    ckpt = os.path.join(args.dir, "ckpt")
    dist.barrier()
    r0, t0 = rchar(), time.perf_counter()
    path = engine.save_checkpoint(ckpt)
    save_s, save_read = time.perf_counter() - t0, rchar() - r0
    dist.barrier()
    r0, t0 = rchar(), time.perf_counter()
    engine.load_checkpoint(ckpt)
    load_s, load_read = time.perf_counter() - t0, rchar() - r0
    files = {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)}
    engine.close()
    dist.destroy_process_group()
    with open(os.path.join(args.dir, f"report{args.rank}.json"), "w") as f:
        json.dump({"save_s": save_s, "save_read": save_read, "load_s": load_s, "load_read": load_read, "files": files}, f)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dir", required=True, help="scratch folder (removed and made again)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank >= 0:
        return rank_main(args)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [sys.executable, os.path.abspath(__file__), "--world", str(args.world), "--dir", args.dir]
    base += ["--hidden", str(args.hidden), "--layers", str(args.layers), "--port", str(port)]
    procs = [subprocess.Popen(base + ["--rank", str(r)]) for r in range(args.world)]
    if any(q.wait() != 0 for q in procs):
        raise SystemExit("a rank failed")
    reps = [json.load(open(os.path.join(args.dir, f"report{r}.json"))) for r in range(args.world)]
    total = sum(reps[0]["files"].values())
    shards = sum(v for n, v in reps[0]["files"].items() if n.startswith("rank") and n.endswith(".bin"))
    print(f"checkpoint: {total / 2**20:.1f} MiB, of which rank shards {shards / 2**20:.1f} MiB, world {args.world}")
    print("rank | save s | read at save / checkpoint | load s | read at load / (checkpoint / world)")
    for r, rep in enumerate(reps):
        print(
            f"{r} | {rep['save_s']:.2f} | {rep['save_read'] / total:.2f} | {rep['load_s']:.2f} | "
            f"{rep['load_read'] / (total / args.world):.2f}"
        )
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
