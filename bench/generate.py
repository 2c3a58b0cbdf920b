#!/usr/bin/env python3
"""Greedy generation with streamed weights (ZeRO-Inference style) through tier.torch, beside the
bound set by reading the weights once per token at the rate the disk gives in the same run.

    python bench/generate.py [--hidden 1024] [--layers 6] [--new-tokens 32] [--home nvme|host] [--json]

A Llama-architecture model is built from a config (random weights, nothing downloaded), run once
in memory with plain transformers (tokens/s of the compute alone, and the reference tokens), then
handed to tier.torch.initialize with an inference-only config (stage 3, offload_param, no
optimizer) whose device budget, and for --home nvme host budget, hold a quarter of the model, so
every token's forward streams the weights. The bound: weight bytes per token over the read rate of
the home, measured outside tier in the same directory (--home nvme: O_DIRECT reads of a file as
large as the weights, --read-threads at a time, or `tier-bench io` when TIER_BENCH names it;
--home host: a copy of as many bytes in memory, or host to GPU when the engine runs on CUDA).
tokens/s / bound tokens/s is the fraction of the bound reached.

Uses the installed package (pip install .) or, failing that, the in-tree build in build/python.
"""

import argparse
import concurrent.futures
import json
import mmap
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

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_model(a):
    torch.manual_seed(a.seed)
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate or int(a.hidden * 11 / 4) // 256 * 256,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.heads,
        max_position_embeddings=max(256, a.prompt + a.new_tokens),
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg).to(_DTYPES[a.dtype]).eval()


def greedy(model, ids, new_tokens):
    with torch.no_grad():
        return model.generate(
            ids, max_new_tokens=new_tokens, do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0
        )


def timed_generate(model, ids, new_tokens):
    greedy(model, ids, 2)  # warm-up: allocations, and for tier the recorded access order
    t0 = time.perf_counter()
    out = greedy(model, ids, new_tokens)
    return out, time.perf_counter() - t0


def disk_read_rate(directory, nbytes, threads, block=4 << 20):
    """Bytes/s of O_DIRECT reads of a fresh file of `nbytes` in `directory`, `threads` blocks in
    flight (the page cache is bypassed, as tier's swap files are). Buffered when the file system
    refuses O_DIRECT."""
    nbytes = max(block, nbytes // block * block)
    path = os.path.join(directory, "read-rate.bin")
    chunk = os.urandom(block)
    with open(path, "wb") as f:
        for _ in range(nbytes // block):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        direct = True
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        direct = False
    try:
        offsets = list(range(0, nbytes, block))

        def reader(k):
            buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
            view = memoryview(buf)
            for off in offsets[k::threads]:
                if os.preadv(fd, [view], off) != block:
                    raise OSError(f"short read of {path} at {off}")
            view.release()
            buf.close()

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(reader, range(threads)))
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.remove(path)
    return nbytes / seconds, direct


def tier_bench_read_rate(directory, nbytes, block_size, queue_depth):
    exe = os.environ.get("TIER_BENCH")
    if not exe:
        return None
    size = str(max(nbytes, 64 << 20))
    out = subprocess.run(
        [exe, "io", "--path", directory, "--size", size, "--block-size", str(block_size), "--queue-depth",
         str(queue_depth), "--json", "--quiet"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)["bytes_per_second"]


def copy_rate(nbytes, device):
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda").fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src)  # first touch
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - t0)


def home_rate(a, swap, weight_bytes, device):
    """(bytes/s the bound uses, what it is, O_DIRECT rate, tier-bench io rate) for the home."""
    if a.home == "host":
        rate = copy_rate(weight_bytes, device if device is not None else torch.device("cpu"))
        return rate, "host-to-GPU copy" if device is not None and device.type == "cuda" else "memory copy", None, None
    rate, direct = disk_read_rate(swap, weight_bytes, a.read_threads)
    bench_rate = tier_bench_read_rate(swap, weight_bytes, a.block_size, a.queue_depth)
    if bench_rate:
        what = f"tier-bench io, {a.block_size >> 10} KiB x {a.queue_depth}, mean of before and after"
        return bench_rate, what, rate, bench_rate
    how = "O_DIRECT" if direct else "buffered (O_DIRECT refused)"
    return rate, f"{how} read, {a.read_threads} x 4 MiB in flight, mean of before and after", rate, None


def config(a, swap, weight_bytes, largest):
    quarter = max(weight_bytes // 4, 2 * largest)  # and room for two of the largest tensors
    budgets = {"device": a.device_budget or quarter, "host": a.host_budget or (quarter if a.home == "nvme" else 0)}
    if not budgets["host"]:
        budgets["host"] = weight_bytes + quarter  # the home, plus room to stage
    offload = {"device": "nvme" if a.home == "nvme" else "cpu", "pin_memory": True}
    if a.home == "nvme":
        offload["nvme_path"] = swap
    cfg = {
        "zero_optimization": {"stage": 3, "offload_param": offload},
        "aio": {"block_size": a.block_size, "queue_depth": a.queue_depth},
        "tier": {"budgets": budgets},
    }
    if a.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=0, help="default: 11/4 of --hidden, rounded to 256")
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--home", choices=["nvme", "host"], default="nvme")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    p.add_argument(
        "--device-budget", type=int, default=0, help="bytes (default: a quarter of the weights, >= 2 largest tensors)"
    )
    p.add_argument("--host-budget", type=int, default=0, help="bytes (default: as the device's for nvme)")
    p.add_argument("--swap-dir", default=os.path.join(os.getcwd(), "tier-gen-swap"))
    p.add_argument("--block-size", type=int, default=1 << 20, help="aio.block_size, for tier and tier-bench io")
    p.add_argument("--queue-depth", type=int, default=8, help="aio.queue_depth (DeepSpeed's default), for both")
    p.add_argument("--read-threads", type=int, default=16, help="O_DIRECT reads in flight for the disk rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    created = not os.path.exists(a.swap_dir)
    os.makedirs(a.swap_dir, exist_ok=True)
    swap = tempfile.mkdtemp(prefix="tier-gen-", dir=a.swap_dir)
    try:
        ids = torch.randint(0, a.vocab, (1, a.prompt), generator=torch.Generator().manual_seed(a.seed))
        model = make_model(a)
        weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
        largest = max(t.numel() * t.element_size() for t in model.parameters())
        expected, plain_s = timed_generate(model, ids, a.new_tokens)

        # The home's read rate, measured outside tier in the same directory, before and after the
        # generate (the disk drifts; the bound takes the mean).
        first = home_rate(a, swap, weight_bytes, None) if a.home == "nvme" else None
        engine, *_ = tier.torch.initialize(model, config(a, swap, weight_bytes, largest))
        greedy(engine.module, ids, 2)
        before = engine.stats()
        t0 = time.perf_counter()
        got = greedy(engine.module, ids, a.new_tokens)
        tier_s = time.perf_counter() - t0
        after = engine.stats()
        moved = {k: after["links"][k]["bytes"] - before["links"][k]["bytes"] for k in after["links"]}
        metric = {k: after["metrics"][k] - before["metrics"].get(k, 0.0) for k in after["metrics"]}
        forwards = a.new_tokens  # the prompt's forward, then one per further token

        second = home_rate(a, swap, weight_bytes, engine.device)
        rates = [r for r in (first, second) if r is not None]
        bound_rate = sum(r[0] for r in rates) / len(rates)
        reference = second[1]
        rate = [r[2] for r in rates] if a.home == "nvme" else None
        bench_rate = [r[3] for r in rates] if a.home == "nvme" and second[3] else None
        engine.destroy()

        tokens_per_s = a.new_tokens / tier_s
        bound = bound_rate / weight_bytes
        row = {
            "home": a.home,
            "dtype": a.dtype,
            "hidden": a.hidden,
            "layers": a.layers,
            "weight_bytes": weight_bytes,
            "new_tokens": a.new_tokens,
            "tokens_match": bool(torch.equal(got, expected)),
            "seconds": tier_s,
            "tokens_per_s": tokens_per_s,
            "in_memory_tokens_per_s": a.new_tokens / plain_s,
            "home_read_bytes_per_s": bound_rate,
            "home_read_reference": reference,
            "o_direct_read_bytes_per_s": rate,  # before, after
            "tier_bench_io_bytes_per_s": bench_rate,  # before, after
            "bound_tokens_per_s": bound,
            "ratio": tokens_per_s / bound,
            "nvme_read_per_token": moved["nvme_to_host"] / forwards / weight_bytes,
            "nvme_read_bytes_per_s": moved["nvme_to_host"] / tier_s,  # what tier drew from the disk
            "to_device_per_token": moved["host_to_device"] / forwards / weight_bytes,
            "stall_seconds": metric.get("engine.stall_seconds", 0.0),
            "prefetch_hits": metric.get("prefetch.hits", 0.0),
            "device_budget": after["tiers"]["device"]["budget_bytes"],
            "host_budget": after["tiers"]["host"]["budget_bytes"],
        }
    finally:
        shutil.rmtree(swap, ignore_errors=True)
        if created:
            try:
                os.rmdir(a.swap_dir)
            except OSError:
                pass

    if a.json:
        print(json.dumps(row, indent=1))
        return 0 if row["tokens_match"] else 1
    mb = 1e6
    size = f"{weight_bytes / mb:.0f} MB of {a.dtype} weights"
    print(f"model: hidden {a.hidden}, {a.layers} layers, {size}, home {a.home}")
    print(f"budgets: device {row['device_budget'] / mb:.0f} MB, host {row['host_budget'] / mb:.0f} MB")
    print(f"{'':34}{'tokens/s':>10}")
    print(f"{'tier, streamed':34}{tokens_per_s:10.2f}   ({a.new_tokens} tokens in {tier_s:.2f} s)")
    print(f"{'bound: one read of the weights':34}{bound:10.2f}   ({bound_rate / mb:.0f} MB/s, {reference})")
    print(f"{'in memory, plain transformers':34}{row['in_memory_tokens_per_s']:10.2f}")
    print(f"ratio tokens/s / bound: {row['ratio']:.2f}")
    if a.home == "nvme":
        print(f"tier read the disk at {row['nvme_read_bytes_per_s'] / mb:.0f} MB/s during generate")
    print(
        f"per token: NVMe read {row['nvme_read_per_token']:.2f}x, to device {row['to_device_per_token']:.2f}x the "
        f"weights; stalls {row['stall_seconds']:.2f} s; tokens {'match' if row['tokens_match'] else 'DIFFER from'} "
        "plain transformers"
    )
    return 0 if row["tokens_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
