"""Building a 7B-shaped model from random weights straight into tier's engine, against the disk
(issue #33: the build writes at >= 0.8 of the disk's write rate).

Each build runs in a process of its own: ``tier.torch.init`` (parameters homed on NVMe, 2 GiB
host budget) around ``transformers.LlamaForCausalLM`` of the Llama-2-7B shape (K of its 32
layers) in bf16, with ``--init tier`` (``tier.torch.fast_random``: tier's counter-based generator
on every core, each weight drawn once straight into the engine and written once) or ``--init
torch`` (PyTorch's generator, the same weights as an eager build). The build's time runs from
the context's entry to its exit, whose flush makes every write durable; creating the engine
(committing and pinning the host arena) comes before it and is reported beside it.

The reference is the same tool writing the same bytes into fresh space on the same disk, outside
tier's Python path: ``tier-bench io --rw write --no-prefill --size <model bytes>`` (O_DIRECT,
incompressible bytes, queue depths 8 and 32, the faster). Builds and references alternate
(build, reference, build, reference, ...), and each build is divided by the mean of the
references on either side of it (the first, by the one after it).

    TIER_BENCH=build/bin/tier-bench python3 bench/build_rate.py --swap-dir /path/on/nvme \\
        [--layers 32] [--runs 2] [--init tier] [--json]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

BUILD = r"""
import json, resource, sys, time
import torch, transformers, transformers.modeling_utils, tier, tier.torch
swap, layers, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                               max_position_embeddings=128, tie_word_embeddings=False)
config = {"bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap}},
          "tier": {"budgets": {"host": "2G"}}}
torch.manual_seed(0)
t0 = time.perf_counter()
ctx = tier.torch.init(config, fast_random=(mode == "tier"))  # creates the engine
t1 = time.perf_counter()
with ctx:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
t2 = time.perf_counter()
s = json.loads(ctx.store.native.stats_json())
print("RESULT " + json.dumps({
    "create_seconds": t1 - t0, "build_seconds": t2 - t1,
    "model_bytes": sum(p.numel() * 2 for p in model.parameters()),
    "written": s["links"]["host_to_nvme"]["bytes"],
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)
"""


def build_once(swap_dir, layers, mode):
    swap = tempfile.mkdtemp(prefix="tier-build-", dir=swap_dir)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(HERE, "..", "python"), env.get("PYTHONPATH")]))
    try:
        run = subprocess.run([sys.executable, "-c", BUILD, swap, str(layers), mode], env=env,
                             stdout=subprocess.PIPE, text=True)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    if run.returncode != 0:
        print(run.stdout[-3000:], file=sys.stderr)
        raise SystemExit(f"build_rate: the build failed (exit {run.returncode})")
    return json.loads(next(l for l in run.stdout.splitlines() if l.startswith("RESULT "))[7:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32, help="K of the 7B shape's 32 layers")
    p.add_argument("--runs", type=int, default=2, help="builds, each between two references")
    p.add_argument("--init", choices=["tier", "torch"], default="tier")
    p.add_argument("--swap-dir", required=True, help="where the swap files go (on the SSD)")
    p.add_argument("--tier-bench", help="tier-bench (default: $TIER_BENCH or build/bin/tier-bench)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)

    import scale  # bench/scale.py: tier-bench lookup
    from pretrained_build import io_write_rate  # tier-bench io into fresh space

    bench = scale.find_tier_bench(a.tier_bench)
    os.makedirs(a.swap_dir, exist_ok=True)
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))
    refs, builds = [], []
    for i in range(a.runs):
        say(f"build {i + 1}/{a.runs} ({a.layers} layers, --init {a.init}) ...")
        builds.append(build_once(a.swap_dir, a.layers, a.init))
        nbytes = builds[-1]["model_bytes"]
        say(f"reference: tier-bench io writing {nbytes / 1e9:.2f} GB into fresh space ...")
        refs.append(max(io_write_rate(bench, a.swap_dir, nbytes, depth) for depth in (8, 32)))
    rows = []
    for i, b in enumerate(builds):
        # The references on either side of build i (the first has one after it only).
        ref = statistics.mean(refs[max(0, i - 1): i + 1])
        rate = b["written"] / b["build_seconds"]
        with_create = b["written"] / (b["build_seconds"] + b["create_seconds"])
        rows.append(dict(b, disk_write_rate=ref, build_write_rate=rate, build_over_disk=rate / ref,
                         with_engine_creation_over_disk=with_create / ref))
    result = {"layers": a.layers, "init": a.init, "model_bytes": builds[-1]["model_bytes"], "references": refs, "builds": rows,
              "median_build_over_disk": statistics.median(r["build_over_disk"] for r in rows)}
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        for r in rows:
            print(f"build: {r['written'] / 1e9:.2f} GB written in {r['build_seconds']:.2f} s = "
                  f"{r['build_write_rate'] / 1e9:.2f} GB/s; disk {r['disk_write_rate'] / 1e9:.2f} GB/s; "
                  f"build / disk {r['build_over_disk']:.2f} (engine creation {r['create_seconds']:.2f} s more: "
                  f"{r['with_engine_creation_over_disk']:.2f}); peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
