#!/usr/bin/env python3
"""CPU Adam comparison: tier vs DeepSpeed's DeepSpeedCPUAdam vs torch.optim.AdamW, interleaved.

For each configuration and thread count one worker process allocates a separate set of tensors
(the same way, with torch) for every contestant: tier's Adam (through a small ctypes shim over
libtier_cpu), tier's roofline kernel (Adam's memory pattern, trivial arithmetic), DeepSpeed's
CPU Adam, torch.optim.AdamW and torch.optim.AdamW(fused=True). It then times one optimizer step of
each in turn, --reps times, rotating the order. Shared machines drift (memory bandwidth here
varies by 2x within minutes), so every ratio in the table is the median of ratios between steps
measured next to each other, and every speed the median over steps.

  bench/compare_adam.py --build build --params 100M --threads 1,2 --markdown out.md

DeepSpeed's CPU Adam op is JIT-built by its own op builder on first use (a CPU-only machine is
fine; the AVX2 rows build it again from the installed package's sources with -D__AVX256__). A
missing deepspeed shows as "n/a" with the reason printed.
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (name, param dtype, grad dtype, out dtype, SIMD). SIMD "auto": each library picks its best
# (DeepSpeed's build uses -march=native and AVX-512 where the CPU has it). "AVX2": tier forced
# to AVX2, DeepSpeed's op built for AVX2 (-D__AVX256__ -march=haswell), PyTorch with
# ATEN_CPU_CAPABILITY=avx2: the comparison on CPUs without AVX-512.
CONFIGS = [
    ("fp32", "fp32", "fp32", "none", "auto"),
    ("fp32 + fp16 out", "fp32", "fp32", "fp16", "auto"),
    ("bf16 params+grads", "bf16", "bf16", "none", "auto"),
    ("fp32", "fp32", "fp32", "none", "AVX2"),
    ("bf16 params+grads", "bf16", "bf16", "none", "AVX2"),
]
CONTESTANTS = ["tier", "roofline", "deepspeed", "torch", "torch_fused"]
DTYPE_CODE = {"fp32": 0, "fp16": 1, "bf16": 2}
LR, WD = 1e-3, 0.01


def parse_count(text):
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1].lower(), 1)
    return int(float(text[:-1] if mult != 1 else text) * mult)


def build_shim(build_dir):
    """Compiles bench/compare_adam_shim.cpp against the built static libraries."""
    out = os.path.join(build_dir, "compare_adam_shim.so")
    lib = os.path.join(build_dir, "lib")
    src = os.path.join(HERE, "compare_adam_shim.cpp")
    deps = [src, os.path.join(lib, "libtier_cpu.a"), os.path.join(lib, "libtier_core.a")]
    if os.path.exists(out) and all(os.path.getmtime(out) >= os.path.getmtime(d) for d in deps):
        return out
    cmd = ["c++", "-O2", "-std=c++20", "-shared", "-fPIC", "-I", os.path.join(ROOT, "include"), src, "-o", out,
           os.path.join(lib, "libtier_cpu.a"), os.path.join(lib, "libtier_core.a"), "-ltbb", "-lhwy", "-lpthread"]
    subprocess.run(cmd, check=True)
    return out


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


# ------------------------------------------------------------------------------------- worker

def worker(args):
    import torch

    threads, n, reps = int(args.threads), args.params, args.reps
    torch.set_num_threads(threads)
    pdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.param_dtype]
    gdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.grad_dtype]
    out_fp16 = args.out_dtype == "fp16"
    errors = {}

    def make_set():
        gen = torch.Generator().manual_seed(0)
        p = (torch.rand(n, generator=gen) + 0.5).to(pdt)
        g = ((torch.rand(n, generator=gen) - 0.5) * 2e-2).to(gdt)
        return p, g

    steps = {}  # contestant -> callable doing one step
    keep = []  # keeps tensors and handles alive

    shim = ctypes.CDLL(args.shim)
    shim.tier_shim_create.restype = ctypes.c_void_p
    shim.tier_shim_create.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_double, ctypes.c_double]
    shim.tier_shim_step.argtypes = [ctypes.c_void_p]
    shim.tier_shim_roofline.argtypes = [ctypes.c_void_p]
    shim.tier_shim_force_simd.argtypes = [ctypes.c_char_p]
    if shim.tier_shim_force_simd(args.simd.encode()) != 0:
        raise SystemExit(f"tier: SIMD target {args.simd} unavailable")
    for name, fn in (("tier", shim.tier_shim_step), ("roofline", shim.tier_shim_roofline)):
        p, g = make_set()
        m, v = torch.zeros(n), torch.zeros(n)
        o = torch.empty(n, dtype=torch.float16) if out_fp16 else None
        h = shim.tier_shim_create(n, p.data_ptr(), DTYPE_CODE[args.param_dtype], m.data_ptr(), v.data_ptr(),
                                  g.data_ptr(), DTYPE_CODE[args.grad_dtype], o.data_ptr() if o is not None else None,
                                  1, threads, LR, WD)
        if not h:
            raise SystemExit("tier: shim refused the tensors")
        keep.append((p, g, m, v, o, h))
        steps[name] = (lambda fn=fn, h=h: fn(h))

    def torch_like(make_opt, name):
        p, g = make_set()
        p = torch.nn.Parameter(p)
        p.grad = g
        o = torch.empty(n, dtype=torch.float16) if out_fp16 else None
        try:
            opt = make_opt([p])
        except Exception as e:  # noqa: BLE001 - report any failure as n/a with its reason
            errors[name] = f"{type(e).__name__}: {e}"
            return
        keep.append((p, o, opt))

        def step():
            opt.step()
            if o is not None:
                o.copy_(p.data)  # the low-precision copy for the GPU: no fused path in these optimizers

        steps[name] = step

    def ds_opt(params):
        import deepspeed.ops.adam.cpu_adam as ds_cpu_adam
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        if args.simd == "AVX2":
            ds_cpu_adam.CPUAdamBuilder = deepspeed_avx2_builder()
        return DeepSpeedCPUAdam(params, lr=LR, weight_decay=WD, adamw_mode=True)

    if "deepspeed" not in args.skip:
        torch_like(ds_opt, "deepspeed")
    if "torch" not in args.skip:
        torch_like(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD), "torch")
    if "torch_fused" not in args.skip:
        torch_like(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD, fused=True), "torch_fused")

    times = {k: [] for k in steps}
    order = list(steps)
    with torch.no_grad():
        for k in order:
            steps[k]()  # warm-up: creates state, loads ops, faults pages in
        for rep in range(reps):
            rot = order[rep % len(order):] + order[:rep % len(order)]
            for k in rot:
                t0 = time.perf_counter()
                steps[k]()
                times[k].append(time.perf_counter() - t0)
    print(json.dumps({"params_per_second": {k: [n / t for t in v] for k, v in times.items()}, "errors": errors}))


def run_worker(args, name, pd, gd, od, simd, threads):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--shim", args.shim, "--params", str(args.params),
           "--threads", str(threads), "--param-dtype", pd, "--grad-dtype", gd, "--out-dtype", od, "--simd", simd,
           "--reps", str(args.reps), "--skip", args.skip]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    if simd == "AVX2":
        env["ATEN_CPU_CAPABILITY"] = "avx2"
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if r.returncode != 0:
        raise SystemExit(f"{name}, {threads} threads: worker failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shim", help=argparse.SUPPRESS)
    ap.add_argument("--param-dtype", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--grad-dtype", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--out-dtype", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="tier build directory (default build/)")
    ap.add_argument("--params", default="100M", help="parameters (default 100M)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--reps", type=int, default=9, help="timed steps of each contestant (default 9)")
    ap.add_argument("--simd", default="auto,AVX2", help="groups of rows: auto, AVX2 (default both)")
    ap.add_argument("--skip", default="", help="comma-separated: deepspeed,torch,torch_fused")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per worker (DeepSpeed JIT-builds)")
    ap.add_argument("--markdown", help="also write the table as Markdown to this file")
    ap.add_argument("--json", help="also write every measured step as JSON to this file")
    args = ap.parse_args()
    args.params = parse_count(str(args.params))
    if args.worker:
        worker(args)
        return
    args.shim = build_shim(args.build)
    groups = set(args.simd.split(","))
    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        for name, pd, gd, od, simd in CONFIGS:
            if simd not in groups:
                continue
            print(f"[{name}, {simd}, {threads} thread(s)] ...", file=sys.stderr)
            r = run_worker(args, name, pd, gd, od, simd, threads)
            for k, e in r["errors"].items():
                print(f"  {k}: n/a ({e})", file=sys.stderr)
            pps = r["params_per_second"]
            print("  " + ", ".join(f"{k} {statistics.median(v) / 1e9:.3f}" for k, v in pps.items()), file=sys.stderr)
            results.append({"config": name, "simd": simd, "threads": threads, "params_per_second": pps})

    def med(k, pps):
        return statistics.median(pps[k]) if k in pps else None

    def ratio(a, b, pps):
        if a not in pps or b not in pps:
            return None
        return statistics.median(x / y for x, y in zip(pps[a], pps[b]))

    def g(x):
        return "n/a" if x is None else f"{x / 1e9:.3f}"

    def r2(x):
        return "n/a" if x is None else f"{x:.2f}"

    header = ["config", "threads", "SIMD", "roofline G/s", "tier G/s", "tier/roofline", "DeepSpeed G/s",
              "DS/roofline", "tier/DS", "torch AdamW G/s", "tier/torch", "torch fused G/s", "tier/torch fused"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for res in results:
        pps = res["params_per_second"]
        cells = [res["config"], str(res["threads"]), res["simd"], g(med("roofline", pps)), g(med("tier", pps)),
                 r2(ratio("tier", "roofline", pps)), g(med("deepspeed", pps)), r2(ratio("deepspeed", "roofline", pps)),
                 r2(ratio("tier", "deepspeed", pps)), g(med("torch", pps)), r2(ratio("tier", "torch", pps)),
                 g(med("torch_fused", pps)), r2(ratio("tier", "torch_fused", pps))]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(f"\nCPU Adam, {args.params / 1e6:.0f}M params, {args.reps} interleaved steps each: speeds are medians, "
          "ratios medians of ratios between neighbouring steps\n")
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
