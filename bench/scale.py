#!/usr/bin/env python3
"""Host memory at scale: runs tier's main job at large presets with a fixed host budget and
prints, per size, the parameters, peak RSS, host bytes per parameter, NVMe bytes and the time of
a step split into forward, backward and the optimizer (also over the steps after the first, the
steady state that `tier-bench plan` predicts). Host memory should be flat in the model's
size: the last line prints RSS(largest) / RSS(smallest), the issue's target being <= 1.3.

    python3 bench/scale.py [--presets 737m,1.5b] [--host 2G] [--swap-dir DIR] [--steps 3] [--plan]

Each run is a separate process (`python -m tier.examples.finetune_llama --preset P --json`) with
TIER_BUDGETS_HOST set; `P:K` runs K of the preset's layers (`--layers K`). A preset whose files
would not fit in the free space of --swap-dir (the params in their dtype, the trained ones'
gradients and the optimizer's committed and next state, and a quarter more) is skipped with a note.
Not a CI test: minutes per size.

`--plan` prints each run beside `tier-bench plan`'s prediction for the same shape (the row "params
+ optimizer on NVMe", with the run's device and host budgets, LoRA rank and targets, dtype and
activation checkpointing): memory per tier, NVMe read per step and the steady step's time, with
the ratios measured / predicted; a run of K layers also gets the plan's figures for the preset's
whole depth. The plan's inputs are measured here before the first run, outside the runs judged:
the disk (`tier-bench plan --measure` in --swap-dir), the compute rate (torch matmuls of the
preset's own shapes, in its dtype, in the mix a step runs: forward, recompute, the activations'
and, when trained, the weights' gradients) and the host->device copy (memcpy on the emulated
device, a pinned copy on a GPU). Issue #33's check:

    python3 bench/scale.py --presets 7b-lora,7b:2,7b:4 --plan --swap-dir DIR
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

# The installed package when there is one (pip install .), else the in-tree build.
try:
    import tier  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "python"))
from tier.examples import finetune_llama as job  # noqa: E402

import torch  # noqa: E402

# The plan row a run is compared with: tier's main job homes params and optimizer state on NVMe.
PLAN_ROW = "params + optimizer on NVMe"


def job_defaults():
    """The main job's option defaults (finetune_llama's argparse), for the fields its shape reads."""
    return argparse.Namespace(hidden=256, layers=4, heads=8, kv_heads=0, intermediate=0, vocab=256, seq=128, batch=4,
                              gas=2, lr=2e-3, seed=0, dtype="fp32", lora_r=0, lora_targets="q_proj,k_proj,v_proj,o_proj",
                              checkpoint_activations=False, device_fraction=0.4, device_budget=0)


def parse_run(spec):
    """"P" or "P:K" (K of the preset's layers) -> (preset, K or None)."""
    preset, _, k = spec.partition(":")
    if preset not in job.PRESETS:
        sys.exit(f"unknown preset {preset!r}; the main job has {', '.join(sorted(job.PRESETS))}")
    if k and not (k.isdigit() and int(k) > 0):
        sys.exit(f"{spec}: the layers after ':' are a positive integer")
    return preset, int(k) if k else None


def run_args(preset, layers=None):
    """The main job's options for a preset (and --layers K)."""
    a = argparse.Namespace(**dict(vars(job_defaults()), **job.PRESETS[preset]))
    if layers:
        a.layers = layers
    return a


def disk_bytes(args):
    """What the run's files take: the params in their dtype, the trained ones' fp32 gradients and
    the optimizer's state (master, m, v; committed and next), and a quarter more."""
    n, _, _, trained = job.model_shape(args)
    return 1.25 * (n * job._esize(args) + 28 * trained)


def _timed(fn, min_seconds=0.3):
    fn()  # warm-up (oneDNN picks its kernels, pages)
    reps, t0 = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        dt = time.perf_counter() - t0
        if dt >= min_seconds and reps >= 2:
            return dt / reps


def compute_rate(args):
    """FLOP/s of the preset's matmuls here, in its dtype, for 1 micro-batch of tokens: one
    layer's projections and the output layer, each as forward (x W^T), the activations' gradient
    (g W) and the weights' gradient (g^T x), combined in the mix a step runs (forward twice with
    checkpointing; the weights' gradients only when they are trained). On the GPU when there is
    one (the main job computes there), else on the host's cores (the emulated device)."""
    cfg = job.llama_config(args)
    dt = job._dtype(args)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hd = h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    m = args.batch * args.seq
    weights = {"fwd": 2 if args.checkpoint_activations else 1, "dgrad": 1, "wgrad": 0 if args.lora_r else 1}
    flops = seconds = 0.0
    with torch.no_grad():
        for shapes, count in ((layer, args.layers), ([(h, v)], 1)):
            ws = [torch.randn(o, n, dtype=dt, device=dev) * 0.02 for n, o in shapes]
            xs = [torch.randn(m, n, dtype=dt, device=dev) for n, _ in shapes]
            gs = [torch.randn(m, o, dtype=dt, device=dev) for _, o in shapes]
            kinds = {
                "fwd": lambda: ([torch.nn.functional.linear(x, w) for x, w in zip(xs, ws)], sync()),
                "dgrad": lambda: ([g @ w for g, w in zip(gs, ws)], sync()),
                "wgrad": lambda: ([g.t() @ x for g, x in zip(gs, xs)], sync()),
            }
            f = sum(2.0 * m * n * o for n, o in shapes)
            for kind, fn in kinds.items():
                if weights[kind]:
                    flops += weights[kind] * count * f
                    seconds += weights[kind] * count * _timed(fn)
            del ws, xs, gs
    return flops / seconds


def copy_rate():
    """Bytes/s of the host->device copy: a pinned copy to the GPU, or, on the emulated device (host
    memory), a memcpy of 256 MiB."""
    n = 256 << 20
    if torch.cuda.is_available():
        src = torch.empty(n, dtype=torch.uint8).pin_memory()
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        sec = _timed(lambda: (dst.copy_(src, non_blocking=True), torch.cuda.synchronize()))
    else:
        src = torch.ones(n, dtype=torch.uint8)
        dst = torch.empty(n, dtype=torch.uint8)
        sec = _timed(lambda: dst.copy_(src))
    return n / sec


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def find_tier_bench(given):
    here = os.path.dirname(os.path.abspath(__file__))
    for c in (given, os.environ.get("TIER_BENCH"), os.path.join(here, "..", "build", "bin", "tier-bench"),
              shutil.which("tier-bench")):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit("--plan needs tier-bench: give --tier-bench PATH or set TIER_BENCH")


def plan_json(bench, argv):
    r = subprocess.run([bench, "plan", *map(str, argv), "--json"], capture_output=True, text=True)
    if r.returncode not in (0, 3):  # 3: nothing fits (the rows are still computed)
        sys.exit(f"tier-bench plan {' '.join(map(str, argv))}: exit {r.returncode}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def measure_inputs(bench, swap_dir, specs, measure_bytes="4G"):
    """The plan's rates, measured before the runs: the disk and the CPU Adam by tier-bench plan
    --measure (moving ``measure_bytes`` each way: the runs move gigabytes a step, and a virtual
    disk takes a short burst faster than it sustains that), the host->device copy, and each run's
    compute rate."""
    with tempfile.TemporaryDirectory() as d:
        job.llama_config(run_args(specs[0][0], 1)).save_pretrained(d)
        print(f"measuring the disk in {swap_dir} ({measure_bytes} each way) and the CPU Adam (tier-bench plan "
              "--measure) ...", flush=True)
        rates = plan_json(
            bench, ["--model", d, "--nvme", swap_dir, "--measure", "--measure-bytes", measure_bytes]
        )["rates"]
    inputs = {"rates": rates, "h2d_bytes_per_second": copy_rate(), "compute_flops_per_second": {}}
    for preset, k in specs:
        # A run of K layers is compared with the plan for K layers and for the preset's whole depth
        # (the output layer's share of the matmuls differs): a rate for each.
        for key, layers in ((f"{preset}:{k}", k), (preset, None)) if k else ((preset, None),):
            inputs["compute_flops_per_second"][key] = compute_rate(run_args(preset, layers))
    r = inputs["rates"]
    print(f"  NVMe read {r['nvme_read_bytes_per_second'] / 1e9:.2f} GB/s, write "
          f"{r['nvme_write_bytes_per_second'] / 1e9:.2f}, mixed {r['nvme_mixed_bytes_per_second'] / 1e9:.2f}; CPU Adam "
          f"{r['adam_params_per_second'] / 1e9:.2f} G params/s; host->device {inputs['h2d_bytes_per_second'] / 1e9:.2f}"
          " GB/s; compute " + ", ".join(f"{k} {v / 1e12:.2f} TFLOP/s"
                                        for k, v in inputs["compute_flops_per_second"].items()), flush=True)
    return inputs


def plan_for(bench, args, layers, summary, host, swap_dir, inputs, compute):
    """tier-bench plan's row for the run's shape (`layers`: --layers K, None: the config's own)."""
    r = inputs["rates"]
    with tempfile.TemporaryDirectory() as d:
        job.llama_config(args).save_pretrained(d)
        argv = ["--model", d, "--dtype", args.dtype, "--batch", args.batch, "--seq", args.seq, "--gas", args.gas,
                "--gpu", summary["device_budget"], "--host-budget", host, "--nvme", swap_dir,
                "--activations", "recompute" if args.checkpoint_activations else "none",
                "--nvme-read-gbps", r["nvme_read_bytes_per_second"] / 1e9,
                "--nvme-write-gbps", r["nvme_write_bytes_per_second"] / 1e9,
                "--nvme-mixed-gbps", r["nvme_mixed_bytes_per_second"] / 1e9,
                "--adam-gparams", r["adam_params_per_second"] / 1e9,
                "--h2d-gbps", inputs["h2d_bytes_per_second"] / 1e9, "--compute-tflops", compute / 1e12]
        if layers:
            argv += ["--layers", layers]
        if args.lora_r:
            argv += ["--lora-r", args.lora_r, "--lora-targets", args.lora_targets]
        if summary.get("device") == "emulated":
            argv.append("--emulated")
        got = plan_json(bench, argv)
    return next(c for c in got["choices"] if c["name"] == PLAN_ROW)


def print_comparison(row):
    m, p, whole = row["measured"], row["plan"], row.get("plan_whole")
    items = [("device peak", "device", "device_peak_bytes", gib, "GiB"),
             ("host peak", "host", "host_bytes", gib, "GiB"),
             ("NVMe peak", "nvme", "nvme_bytes", gib, "GiB"),
             ("NVMe read / step", "nvme_read_per_step", "nvme_read_bytes_per_step", gib, "GiB"),
             ("fwd+bwd s", "forward_backward_seconds", "forward_backward_seconds", float, "s"),
             ("optimizer s", "optimizer_seconds", "optimizer_seconds", float, "s"),
             ("step s", "step_seconds", "step_seconds", float, "s")]
    head = f"plan, {row['layers']} layers" if row.get("sampled") else "plan"
    print(f"\n{row['run']} (steady steps 2+ against the plan's steady state)")
    print(f"  {'':18} {'measured':>10} {head:>16} {'ratio':>7}" + (f" {'plan, ' + str(row['whole_layers']) + ' layers':>17}" if whole else ""))
    for label, mk, pk, conv, unit in items:
        mv, pv = m.get(mk), p[pk]
        ratio = f"{mv / pv:7.2f}" if mv is not None and pv else "      -"
        ms = f"{conv(mv):9.2f}{unit[0]}" if mv is not None else "         -"
        line = f"  {label:18} {ms:>10} {conv(pv):15.2f}{unit[0]} {ratio}"
        if whole:
            line += f" {conv(whole[pk]):16.2f}{unit[0]}"
        print(line)


def gib(n):
    return n / (1 << 30)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="737m,1.5b")
    p.add_argument("--host", default="2G", help="TIER_BUDGETS_HOST for every run")
    p.add_argument("--swap-dir", default=os.path.join(os.getcwd(), "tier-scale-swap"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--plan", action="store_true", help="print each run beside tier-bench plan's prediction")
    p.add_argument("--tier-bench", help="the tier-bench binary for --plan (default: $TIER_BENCH, build/bin)")
    p.add_argument("--measure-bytes", default="4G", help="bytes the plan's disk measurement moves each way")
    a = p.parse_args()
    os.makedirs(a.swap_dir, exist_ok=True)
    specs = [parse_run(s) for s in a.presets.split(",") if s]
    bench = find_tier_bench(a.tier_bench) if a.plan else None
    inputs = measure_inputs(bench, a.swap_dir, specs, a.measure_bytes) if a.plan else None
    rows = []
    failed = []
    for preset, k in specs:
        name = f"{preset}:{k}" if k else preset
        args = run_args(preset, k)
        n = job.model_shape(args)[0]
        need = disk_bytes(args)
        st = os.statvfs(a.swap_dir)
        free = st.f_bavail * st.f_frsize
        if need > free:
            print(f"{name}: skipped, {n / 1e9:.2f} B parameters need about {gib(need):.0f} GiB "
                  f"in {a.swap_dir}, {gib(free):.0f} GiB free", flush=True)
            continue
        print(f"{name}: {n / 1e9:.2f} B parameters, host budget {a.host} ...", flush=True)
        env = dict(os.environ, TIER_BUDGETS_HOST=a.host)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "tier.examples.finetune_llama", "--preset", preset, "--steps", str(a.steps),
               "--swap-dir", a.swap_dir, "--json"] + (["--layers", str(k)] if k else [])
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            # Said loudly, and the runs before and after it still get their rows.
            print(r.stdout[-2000:], r.stderr[-3000:], sep="\n")
            print(f"{name}: the main job failed (exit {r.returncode})", flush=True)
            failed.append(name)
            continue
        out = r.stdout
        result = json.loads(out[out.index("{\n"):])
        summary = result["summary"]
        ph = summary["phase_seconds"]
        # Steady state: the steps after the first (which records the access trace, so nothing is
        # prefetched in it); what `tier-bench plan` predicts.
        later = [h["phase_seconds"] for h in result["history"][1:]]
        steady = result["history"][1:]
        rows.append({
            "preset": name,
            "parameters": summary["parameters"],
            "peak_rss_bytes": summary["peak_rss_bytes"],
            "host_bytes_per_param": summary["host_bytes_per_param"],
            "host_budget": summary["host_budget"],
            "nvme_peak_bytes": summary["peak_bytes"]["nvme"],
            "seconds_per_step": summary["seconds"] / a.steps,
            "forward_per_step": ph["forward"] / a.steps,
            "backward_per_step": ph["backward"] / a.steps,
            "optimizer_per_step": ph["step"] / a.steps,
            "optimizer_per_later_step": sum(h["step"] for h in later) / len(later) if later else None,
            "wall_seconds": time.perf_counter() - t0,
        })
        if a.plan:
            measured = {
                "device": summary["peak_bytes"]["device"],
                "host": summary["peak_bytes"]["host"],
                "nvme": summary["peak_bytes"]["nvme"],
                "nvme_read_per_step": mean([h["bytes"]["nvme_to_host"] for h in steady]),
                "forward_backward_seconds": mean([h["phase_seconds"]["forward"] + h["phase_seconds"]["backward"]
                                                  for h in steady]),
                "optimizer_seconds": mean([h["phase_seconds"]["step"] for h in steady]),
                "step_seconds": mean([h["seconds"] for h in steady]),
            }
            compute = inputs["compute_flops_per_second"][name]
            cmp = {"run": name, "layers": args.layers, "whole_layers": run_args(preset).layers, "sampled": bool(k),
                   "measured": measured,
                   "compute_flops_per_second": compute,
                   "plan": plan_for(bench, run_args(preset), k, summary, a.host, a.swap_dir, inputs, compute)}
            if k:
                # The preset's whole depth, at the same rates and budgets.
                cmp["plan_whole"] = plan_for(bench, run_args(preset), None, summary, a.host, a.swap_dir, inputs,
                                             inputs["compute_flops_per_second"][preset])
            rows[-1]["against_plan"] = cmp
    if not rows:
        sys.exit("no run completed" + (f" (failed: {', '.join(failed)})" if failed else ": no preset fits the free space"))
    print()
    print(f"{'preset':>6} {'params':>8} {'peak RSS':>9} {'B/param':>8} {'NVMe':>8} {'s/step':>7} {'fwd':>6} "
          f"{'bwd':>6} {'optim':>6} {'optim, steps 2+':>15}")
    for r in rows:
        later = r["optimizer_per_later_step"]
        print(f"{r['preset']:>6} {r['parameters'] / 1e9:7.2f}B {gib(r['peak_rss_bytes']):7.2f}Gi "
              f"{r['host_bytes_per_param']:8.2f} {gib(r['nvme_peak_bytes']):6.1f}Gi {r['seconds_per_step']:7.1f} "
              f"{r['forward_per_step']:6.1f} {r['backward_per_step']:6.1f} {r['optimizer_per_step']:6.1f} "
              f"{later if later is not None else float('nan'):15.1f}")
    for r in rows:
        if "against_plan" in r:
            print_comparison(r["against_plan"])
    if a.plan:
        print(f"\n(plan inputs measured before the runs: {json.dumps(inputs)})")
    if len(rows) > 1:
        ratio = rows[-1]["peak_rss_bytes"] / rows[0]["peak_rss_bytes"]
        size = rows[-1]["parameters"] / rows[0]["parameters"]
        print(f"RSS({rows[-1]['preset']}) / RSS({rows[0]['preset']}) = {ratio:.2f} for {size:.1f}x the parameters "
              "(target <= 1.3)")
    if a.json:
        print(json.dumps(rows, indent=1))
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (their output is above)")


if __name__ == "__main__":
    main()
