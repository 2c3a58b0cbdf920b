#!/usr/bin/env python3
"""Host memory at scale: runs tier's main job at large presets with a fixed host budget and
prints, per size, the parameters, peak RSS, host bytes per parameter, NVMe bytes and the time of
a step split into forward, backward and the optimizer (also over the steps after the first, the
steady state that `tier-bench plan` predicts). Host memory should be flat in the model's
size: the last line prints RSS(largest) / RSS(smallest), the issue's target being <= 1.3.

    python3 bench/scale.py [--presets 737m,1.5b] [--host 2G] [--swap-dir DIR] [--steps 3]

Each run is a separate process (`python -m tier.examples.finetune_llama --preset P --json`) with
TIER_BUDGETS_HOST set; a preset whose files would not fit in the free space of --swap-dir (about
40 bytes per parameter: params, gradients and the optimizer's committed and next state) is
skipped with a note. Not a CI test: minutes per size.
"""

import argparse
import json
import os
import subprocess
import sys
import time

# The installed package when there is one (pip install .), else the in-tree build.
try:
    import tier  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "python"))
from tier.examples import finetune_llama as job  # noqa: E402

DISK_BYTES_PER_PARAM = 40


def params_of(preset):
    args = argparse.Namespace(**dict(vars(job_defaults()), **job.PRESETS[preset]))
    return job.model_shape(args)[0]


def job_defaults():
    return argparse.Namespace(hidden=256, layers=4, heads=8, seq=128, batch=4, gas=2, lr=2e-3, seed=0)


def gib(n):
    return n / (1 << 30)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="737m,1.5b")
    p.add_argument("--host", default="2G", help="TIER_BUDGETS_HOST for every run")
    p.add_argument("--swap-dir", default=os.path.join(os.getcwd(), "tier-scale-swap"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    os.makedirs(a.swap_dir, exist_ok=True)
    rows = []
    for preset in a.presets.split(","):
        n = params_of(preset)
        st = os.statvfs(a.swap_dir)
        free = st.f_bavail * st.f_frsize
        if n * DISK_BYTES_PER_PARAM > free:
            print(f"{preset}: skipped, {n / 1e9:.2f} B parameters need about {gib(n * DISK_BYTES_PER_PARAM):.0f} GiB "
                  f"in {a.swap_dir}, {gib(free):.0f} GiB free", flush=True)
            continue
        print(f"{preset}: {n / 1e9:.2f} B parameters, host budget {a.host} ...", flush=True)
        env = dict(os.environ, TIER_BUDGETS_HOST=a.host)
        t0 = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-m", "tier.examples.finetune_llama", "--preset", preset, "--steps", str(a.steps),
             "--swap-dir", a.swap_dir, "--json"],
            env=env, capture_output=True, text=True,
        )
        if r.returncode != 0:
            print(r.stdout[-2000:], r.stderr[-3000:], sep="\n")
            sys.exit(f"{preset}: the main job failed (exit {r.returncode})")
        out = r.stdout
        result = json.loads(out[out.index("{\n"):])
        summary = result["summary"]
        ph = summary["phase_seconds"]
        # Steady state: the steps after the first (which records the access trace, so nothing is
        # prefetched in it); what `tier-bench plan` predicts.
        later = [h["phase_seconds"] for h in result["history"][1:]]
        rows.append({
            "preset": preset,
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
    if not rows:
        sys.exit("no preset fits the free space")
    print()
    print(f"{'preset':>6} {'params':>8} {'peak RSS':>9} {'B/param':>8} {'NVMe':>8} {'s/step':>7} {'fwd':>6} "
          f"{'bwd':>6} {'optim':>6} {'optim, steps 2+':>15}")
    for r in rows:
        later = r["optimizer_per_later_step"]
        print(f"{r['preset']:>6} {r['parameters'] / 1e9:7.2f}B {gib(r['peak_rss_bytes']):7.2f}Gi "
              f"{r['host_bytes_per_param']:8.2f} {gib(r['nvme_peak_bytes']):6.1f}Gi {r['seconds_per_step']:7.1f} "
              f"{r['forward_per_step']:6.1f} {r['backward_per_step']:6.1f} {r['optimizer_per_step']:6.1f} "
              f"{later if later is not None else float('nan'):15.1f}")
    if len(rows) > 1:
        ratio = rows[-1]["peak_rss_bytes"] / rows[0]["peak_rss_bytes"]
        size = rows[-1]["parameters"] / rows[0]["parameters"]
        print(f"RSS({rows[-1]['preset']}) / RSS({rows[0]['preset']}) = {ratio:.2f} for {size:.1f}x the parameters "
              "(target <= 1.3)")
    if a.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
