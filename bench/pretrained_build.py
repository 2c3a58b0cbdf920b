"""Loading a pretrained 7B-shaped checkpoint into the engine, against the disk's write rate
(issue #33: "building the 7B model writes at >= 0.8 of the disk's measured write rate").

The main job builds its models from random weights (``tier.torch.init``), which is bound by torch's
single-threaded random draws (bench/lora_roundtrip.py measures it against torch's own eager init).
A user fine-tuning a 7B model loads pretrained weights instead: ``tier.torch.from_pretrained``
reads the safetensors files and writes each parameter to its home on NVMe. This bench measures
that path:

1. writes a Llama checkpoint of the 7B preset's shape (``--layers K`` of its 32 layers) in bf16:
   ``config.json``, safetensors shards and their index, each tensor with bytes of its own (a normal
   block, varied per tile, so that a deduplicating virtual disk cannot shortcut the writes);
2. measures the disk in ``--swap-dir``, outside the load it judges: the reference is its best rate
   writing the same bytes as the load writes into fresh swap space, as the load does
   (``tier-bench io --rw write --no-prefill --size <checkpoint bytes>``: incompressible bytes,
   O_DIRECT, queue depths 8 and 32, the faster one). ``tier-bench plan --measure``'s rates are
   printed beside it: they time 512 MiB, and a virtual disk with a write-back cache takes such a
   burst several times faster than it sustains (5.4 against 2.7 GB/s here on 2026-12-04), and
   overwrites of written blocks faster than first writes of freshly allocated ones;
3. in a process of its own, with the host budget the 7b-lora preset uses (2 GiB), times
   ``tier.torch.from_pretrained(checkpoint, config)`` with the parameters homed on NVMe
   (DeepSpeed's ``offload_param: nvme``; no optimizer, so only the weights are written), and
   prints the bytes the engine wrote to its swap files per second of the load, as a ratio to the
   disk's write rate. Where the checkpoint sits on the same disk, the load reads it as it writes,
   so the mixed rate is printed beside it.

    TIER_BENCH=build/bin/tier-bench python3 bench/pretrained_build.py --swap-dir /path/on/nvme \\
        [--layers 32] [--checkpoint-dir DIR [--reuse]] [--json]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

SHARD_BYTES = 2 << 30


def write_checkpoint(path, layers):
    """A 7B-shaped Llama checkpoint of ``layers`` layers in bf16 at ``path``; returns its bytes."""
    import torch
    import transformers

    from tier.examples import finetune_llama as job
    from tier.torch.hf import _write_shard

    cfg = job.llama_config(job.resolve_args(["--preset", "7b-lora", "--layers", str(layers)]))
    cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(path)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    tensors = [(n, tuple(p.shape)) for n, p in model.state_dict().items()]
    g = torch.Generator().manual_seed(0)
    block = (torch.randn(1 << 23, generator=g) * 0.02).to(torch.bfloat16).view(torch.int16)

    def values(shape, salt):
        n = 1
        for d in shape:
            n *= d
        out = torch.empty(n, dtype=torch.int16)
        for k, start in enumerate(range(0, n, block.numel())):
            m = min(block.numel(), n - start)
            # The low mantissa bits vary per tile and per tensor: every block of bytes differs.
            torch.bitwise_xor(block[:m], (k * 7 + salt) % 61 + 1, out=out[start:start + m])
        return out.view(torch.bfloat16).view(shape)

    shards, current, size = [], [], 0
    for i, (name, shape) in enumerate(tensors):
        nbytes = 2
        for d in shape:
            nbytes *= d
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, torch.bfloat16, shape, nbytes, lambda s=shape, i=i: values(s, i)))
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for k, entries in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(os.path.join(path, fname), entries)
        for name, _, _, nbytes, _ in entries:
            weight_map[name] = fname
            total += nbytes
        print(f"  shard {k + 1}/{len(shards)} written", flush=True)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def io_write_rate(bench, directory, nbytes, depth):
    """Bytes per second of ``tier-bench io`` writing ``nbytes`` into fresh swap space in ``directory``."""
    run = subprocess.run(
        [bench, "io", "--path", directory, "--rw", "write", "--no-prefill", "--size", str(nbytes), "--queue-depth",
         str(depth), "--quiet", "--json"],
        stdout=subprocess.PIPE, text=True, check=True,
    )
    return json.loads(run.stdout)["bytes_per_second"]


LOAD = r"""
import json, os, resource, sys, time
import torch, tier, tier.torch
ckpt, swap = sys.argv[1], sys.argv[2]
config = {"bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap}},
          "tier": {"budgets": {"host": "2G"}}}
import transformers
cls = transformers.LlamaForCausalLM  # (transformers imports its modules lazily: not part of the load)
t0 = time.perf_counter()
engine = tier.torch.from_pretrained(ckpt, config, model_class=cls)
seconds = time.perf_counter() - t0
s = engine.stats()
out = {"seconds": seconds, "written": s["links"]["host_to_nvme"]["bytes"],
       "nvme_allocated": s["metrics"].get("nvme.swap.allocated_bytes", 0.0),
       "compute_dtype": str(engine.compute_dtype),
       "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
print("RESULT " + json.dumps(out), flush=True)
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32, help="K of the 7B shape's 32 layers")
    p.add_argument("--swap-dir", required=True, help="where the engine's swap files go (on the SSD)")
    p.add_argument("--checkpoint-dir", help="where the checkpoint is written (default: a folder in --swap-dir, removed)")
    p.add_argument("--reuse", action="store_true", help="load the checkpoint already in --checkpoint-dir")
    p.add_argument("--tier-bench", help="tier-bench (default: $TIER_BENCH or build/bin/tier-bench)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)

    import scale  # bench/scale.py: tier-bench lookup and plan --measure

    bench = scale.find_tier_bench(a.tier_bench)
    os.makedirs(a.swap_dir, exist_ok=True)
    own_ckpt = a.checkpoint_dir is None
    ckpt = a.checkpoint_dir or tempfile.mkdtemp(prefix="tier-ckpt-", dir=a.swap_dir)
    swap = tempfile.mkdtemp(prefix="tier-swap-", dir=a.swap_dir)
    try:
        index = os.path.join(ckpt, "model.safetensors.index.json")
        if a.reuse and os.path.isfile(index):
            with open(index) as f:
                ckpt_bytes = json.load(f)["metadata"]["total_size"]
            print(f"reusing the checkpoint in {ckpt} ({ckpt_bytes / 1e9:.2f} GB)", flush=True)
        else:
            print(f"writing a 7B-shaped checkpoint ({a.layers} layers, bf16) to {ckpt} ...", flush=True)
            t0 = time.perf_counter()
            ckpt_bytes = write_checkpoint(ckpt, a.layers)
            print(f"  {ckpt_bytes / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
        print(f"measuring the disk in {a.swap_dir} (tier-bench plan --measure) ...", flush=True)
        rates = scale.plan_json(bench, ["--model", ckpt, "--nvme", a.swap_dir, "--measure"])["rates"]
        print(f"measuring the disk's sustained write of {ckpt_bytes / 1e9:.2f} GB into fresh space (tier-bench io) ...",
              flush=True)
        sustained = max(io_write_rate(bench, a.swap_dir, ckpt_bytes, depth) for depth in (8, 32))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(HERE, "..", "python"), env.get("PYTHONPATH")]))
        print("loading it with tier.torch.from_pretrained (parameters homed on NVMe, host budget 2 GiB) ...",
              flush=True)
        run = subprocess.run([sys.executable, "-c", LOAD, ckpt, swap], env=env, stdout=subprocess.PIPE, text=True)
        if run.returncode != 0:
            print(run.stdout[-3000:], file=sys.stderr)
            print(f"pretrained_build: the load failed (exit {run.returncode})", file=sys.stderr)
            return 1
        load = json.loads(next(l for l in run.stdout.splitlines() if l.startswith("RESULT "))[7:])
    finally:
        shutil.rmtree(swap, ignore_errors=True)
        if own_ckpt:
            shutil.rmtree(ckpt, ignore_errors=True)
    rate = load["written"] / load["seconds"]
    result = {
        "disk_write_same_bytes_rate": sustained,
        "load_over_disk_write_same_bytes": rate / sustained,
        "layers": a.layers,
        "checkpoint_bytes": ckpt_bytes,
        "load_seconds": load["seconds"],
        "load_bytes_written": load["written"],
        "load_write_rate": rate,
        "disk_write_rate": rates["nvme_write_bytes_per_second"],
        "disk_read_rate": rates["nvme_read_bytes_per_second"],
        "disk_mixed_rate": rates["nvme_mixed_bytes_per_second"],
        "load_over_disk_write": rate / rates["nvme_write_bytes_per_second"],
        "load_over_disk_mixed": rate / rates["nvme_mixed_bytes_per_second"],
        "compute_dtype": load["compute_dtype"],
        "peak_rss_bytes": load["peak_rss_bytes"],
    }
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"load: {load['written'] / 1e9:.2f} GB written in {load['seconds']:.1f} s = {rate / 1e9:.2f} GB/s; "
              f"the disk's sustained write of the same bytes {sustained / 1e9:.2f} GB/s (ratio "
              f"{result['load_over_disk_write_same_bytes']:.2f}); "
              f"plan --measure's write {rates['nvme_write_bytes_per_second'] / 1e9:.2f} GB/s (ratio "
              f"{result['load_over_disk_write']:.2f}), mixed {rates['nvme_mixed_bytes_per_second'] / 1e9:.2f} GB/s "
              f"(ratio {result['load_over_disk_mixed']:.2f}); peak RSS {load['peak_rss_bytes'] / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
