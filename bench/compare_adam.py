#!/usr/bin/env python3
"""CPU Adam comparison: tier vs DeepSpeed's DeepSpeedCPUAdam vs torch.optim.AdamW, in one run.

Every configuration runs tier-bench adam (which measures tier's Adam and its roofline, a kernel
with Adam's memory pattern, on the same buffers), then DeepSpeed, then PyTorch, each in its own
process with the same thread count, so all figures come from the same machine state. Figures are
medians over --reps optimizer steps on --params parameters; the table gives each as a ratio to
the roofline and tier's speed-up over the others.

  bench/compare_adam.py --tier-bench build/bin/tier-bench --params 100M --threads 1,2 --markdown out.md

DeepSpeed's CPU Adam op is JIT-built by its own op builder on first use (a CPU-only machine is
fine); a missing deepspeed or torch shows as "n/a" in its column with the reason printed.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# (name, tier param dtype, tier grad dtype, tier out dtype, framework param dtype, SIMD)
# SIMD "auto": each library picks its best (DeepSpeed's build uses -march=native and AVX-512 where
# the CPU has it). "AVX2": tier forced to AVX2, DeepSpeed's op built from its own sources for
# AVX2 (-D__AVX256__ -march=haswell), PyTorch with ATEN_CPU_CAPABILITY=avx2: the comparison on
# the many CPUs without AVX-512.
CONFIGS = [
    ("fp32", "fp32", "fp32", "none", "fp32", "auto"),
    ("fp32 + fp16 out", "fp32", "fp32", "fp16", "fp32", "auto"),
    ("bf16 params+grads", "bf16", "bf16", "none", "bf16", "auto"),
    ("fp32", "fp32", "fp32", "none", "fp32", "AVX2"),
    ("bf16 params+grads", "bf16", "bf16", "none", "bf16", "AVX2"),
]


def deepspeed_avx2_builder():
    """DeepSpeed's own CPU Adam builder, retargeted to AVX2 under another extension name."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    class Avx2CPUAdamBuilder(CPUAdamBuilder):
        def __init__(self):
            super().__init__()
            self.name = "cpu_adam_avx2"

        def cpu_arch(self):
            return "-march=haswell"

        def simd_width(self):
            return "-D__AVX256__"

    return Avx2CPUAdamBuilder


def parse_count(text):
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1].lower(), 1)
    return int(float(text[:-1] if mult != 1 else text) * mult)


# --------------------------------------------------------------------------- framework workers
# Run in a child process (python3 compare_adam.py --worker ...), one framework and one
# configuration each, so that thread settings and memory do not leak between measurements.

def worker(kind, params, threads, param_dtype, out_fp16, reps, simd):
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[param_dtype]
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.rand(params, generator=gen).to(dt) + 0.5)
    p.grad = (torch.rand(params, generator=gen).to(dt) - 0.5) * 2e-2
    out = torch.empty(params, dtype=torch.float16) if out_fp16 else None
    if kind == "deepspeed":
        import deepspeed.ops.adam.cpu_adam as ds_cpu_adam
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        if simd == "AVX2":
            ds_cpu_adam.CPUAdamBuilder = deepspeed_avx2_builder()

        opt = DeepSpeedCPUAdam([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw_mode=True)
    elif kind == "torch":
        opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    elif kind == "torch_fused":
        opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    else:
        raise SystemExit(f"unknown worker {kind}")

    def step():
        opt.step()
        if out is not None:
            out.copy_(p.data)  # the fp16 copy that goes back to the GPU (no fused path)

    with torch.no_grad():
        step()  # warm-up: creates the state, JIT-loads the op
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(json.dumps({"params_per_second": params / med, "best_params_per_second": params / min(times)}))


def run_worker(kind, args, threads, param_dtype, out_fp16, simd):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--params", str(args.params),
           "--threads", str(threads), "--param-dtype", param_dtype, "--reps", str(args.reps), "--simd", simd]
    if out_fp16:
        cmd.append("--out-fp16")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if simd == "AVX2":
        env["ATEN_CPU_CAPABILITY"] = "avx2"
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"  {kind}: timed out", file=sys.stderr)
        return None
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        print(f"  {kind}: failed: {' | '.join(tail)}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_tier(args, threads, pd, gd, od, simd):
    cmd = [args.tier_bench, "adam", "--params", str(args.params), "--threads", str(threads), "--param-dtype", pd,
           "--grad-dtype", gd, "--out-dtype", od, "--reps", str(args.reps), "--simd", simd, "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"tier-bench failed: {r.stderr.strip()}")
    return json.loads(r.stdout)


def fmt_g(x):
    return "n/a" if x is None else f"{x / 1e9:.3f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--param-dtype", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--out-fp16", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tier-bench", default="build/bin/tier-bench")
    ap.add_argument("--params", default="100M", help="parameters (default 100M)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--reps", type=int, default=5, help="timed steps per measurement (median; default 5)")
    ap.add_argument("--simd", default="auto,AVX2", help="SIMD groups of rows to run (default auto,AVX2)")
    ap.add_argument("--skip", default="", help="comma-separated: deepspeed,torch,torch_fused")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per framework run (DeepSpeed JIT-builds)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every measurement; report medians (default 1)")
    ap.add_argument("--markdown", help="also write the table as Markdown to this file")
    ap.add_argument("--json", help="also write every raw measurement as JSON to this file")
    args = ap.parse_args()
    args.params = parse_count(str(args.params))
    if args.worker:
        worker(args.worker, args.params, int(args.threads), args.param_dtype, args.out_fp16, args.reps, args.simd)
        return
    simd_groups = set(args.simd.split(","))
    skip = set(filter(None, args.skip.split(",")))
    kinds = [k for k in ("deepspeed", "torch", "torch_fused") if k not in skip]
    # rows[(config index, threads)] = list over rounds of {"tier": json, "deepspeed": pps, ...}
    rows = {}
    order = []
    for rnd in range(args.rounds):
        for threads in [int(t) for t in args.threads.split(",")]:
            for ci, (name, pd, gd, od, fw_dtype, simd) in enumerate(CONFIGS):
                if simd not in simd_groups:
                    continue
                key = (ci, threads)
                if key not in rows:
                    rows[key] = []
                    order.append(key)
                tag = f"[round {rnd + 1}/{args.rounds}, {name}, {simd}, {threads} thread(s)]"
                print(f"{tag} tier ...", file=sys.stderr)
                res = {"tier": run_tier(args, threads, pd, gd, od, simd)}
                for kind in kinds:
                    print(f"{tag} {kind} ...", file=sys.stderr)
                    r = run_worker(kind, args, threads, fw_dtype, od == "fp16", simd)
                    res[kind] = r["params_per_second"] if r else None
                rows[key].append(res)
                t = res["tier"]
                print(f"  tier {fmt_g(t['params_per_second'])}, roofline {fmt_g(t['roofline_params_per_second'])}, "
                      + ", ".join(f"{k} {fmt_g(res[k])}" for k in kinds), file=sys.stderr)

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def med_ratio(rounds, num, den):
        # Median over rounds of the ratio measured within each round (both figures same machine state).
        return med([num(r) / den(r) if num(r) is not None and den(r) is not None else None for r in rounds])

    def r2(x):
        return "n/a" if x is None else f"{x:.2f}"

    header = ["config", "threads", "SIMD", "roofline G/s", "tier G/s", "tier/roofline", "DeepSpeed G/s",
              "DS/roofline", "tier/DS", "torch AdamW G/s", "tier/torch", "torch fused G/s", "tier/torch fused"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    results = []
    for key in order:
        ci, threads = key
        rounds = rows[key]
        name, _, _, od, _, simd = CONFIGS[ci]
        tier = lambda r: r["tier"]["params_per_second"]  # noqa: E731
        roof = lambda r: r["tier"]["roofline_params_per_second"]  # noqa: E731
        get = lambda k: (lambda r: r.get(k))  # noqa: E731
        cells = [name, str(threads), rounds[0]["tier"]["simd_target"], fmt_g(med([roof(r) for r in rounds])),
                 fmt_g(med([tier(r) for r in rounds])), r2(med_ratio(rounds, tier, roof)),
                 fmt_g(med([r.get("deepspeed") for r in rounds])), r2(med_ratio(rounds, get("deepspeed"), roof)),
                 r2(med_ratio(rounds, tier, get("deepspeed"))), fmt_g(med([r.get("torch") for r in rounds])),
                 r2(med_ratio(rounds, tier, get("torch"))), fmt_g(med([r.get("torch_fused") for r in rounds])),
                 r2(med_ratio(rounds, tier, get("torch_fused")))]
        lines.append("| " + " | ".join(cells) + " |")
        results.append({"config": name, "threads": threads, "simd": simd, "rounds": rounds})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    table = "\n".join(lines)
    print(f"\nCPU Adam, {args.params / 1e6:.0f}M params; each figure the median of {args.reps} steps, "
          f"then the median over {args.rounds} round(s); ratios are medians of per-round ratios\n")
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
